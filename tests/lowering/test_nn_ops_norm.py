"""Layer, group, batch and weight norm (lowering/ops/normalization.py) against eager torch.

Each case calls one ATen overload directly, so the traced graph holds exactly that op; the
compile runs with fallback="error", so a missing rule fails instead of running in eager torch.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import compile_aten, grads_of
from tests.lowering.nn_helpers import BF16, STRICT, aten, case, rand, run
from tpu_inductor.exc import LoweringError

# --- normalization -------------------------------------------------------------------------


def _layer_norm(shape, weight):
    def ln(x, w, b):
        return aten.native_layer_norm(x, shape, w if weight else None, b if weight else None, 1e-5)

    return ln


@pytest.mark.parametrize(
    "fn, args, tol",
    [
        case(
            "layer_norm_last",
            _layer_norm([8], True),
            rand(2, 5, 8),
            rand(8, seed=1),
            rand(8, seed=2),
        ),
        case(
            "layer_norm_two_dims_no_affine", _layer_norm([5, 8], False), rand(2, 5, 8), None, None
        ),
        case(
            "layer_norm_bf16",
            _layer_norm([16], True),
            rand(4, 16, dtype=torch.bfloat16),
            rand(16, dtype=torch.bfloat16, seed=1),
            rand(16, dtype=torch.bfloat16, seed=2),
            tol=BF16,
        ),
        case(
            "group_norm",
            lambda x, w, b: aten.native_group_norm(x, w, b, 2, 6, 16, 3, 1e-5),
            rand(2, 6, 4, 4),
            rand(6, seed=1),
            rand(6, seed=2),
        ),
        case(
            "group_norm_no_affine_3d",
            lambda x: aten.native_group_norm(x, None, None, 3, 4, 5, 2, 1e-3),
            rand(3, 4, 5),
        ),
    ],
)
def test_norm_forward(fn, args, tol):
    run(fn, args, tol)


@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False)])
@pytest.mark.parametrize("shape", [[8], [5, 8]])
def test_layer_norm_backward(shape, mask):
    x, w, b = rand(2, 5, 8), rand(*shape, seed=1), rand(*shape, seed=2)
    _, mean, rstd = aten.native_layer_norm(x, shape, w, b, 1e-5)
    grad = rand(2, 5, 8, seed=3)

    def backward(grad, x, mean, rstd, w, b):
        return aten.native_layer_norm_backward(grad, x, shape, mean, rstd, w, b, list(mask))

    run(backward, (grad, x, mean, rstd, w, b), {"rtol": 1e-4, "atol": 1e-5})


@pytest.mark.parametrize("affine", [True, False])
def test_group_norm_backward(affine):
    x, w = rand(2, 6, 4, 4), rand(6, seed=1) if affine else None
    _, mean, rstd = aten.native_group_norm(x, w, None, 2, 6, 16, 3, 1e-5)
    grad = rand(2, 6, 4, 4, seed=3)
    mask = [True, affine, affine]

    def backward(grad, x, mean, rstd, w):
        return aten.native_group_norm_backward(grad, x, mean, rstd, w, 2, 6, 16, 3, mask)

    run(backward, (grad, x, mean, rstd, w), {"rtol": 1e-4, "atol": 1e-5})


def _bn_args(dtype=torch.float32, shape=(4, 3, 5, 5)):
    c = shape[1]
    running_var = rand(c, seed=4).abs().to(dtype) + 0.5
    return (
        rand(*shape, dtype=dtype),
        rand(c, dtype=dtype, seed=1),
        rand(c, dtype=dtype, seed=2),
        rand(c, dtype=dtype, seed=3),
        running_var,
    )


@pytest.mark.parametrize(
    "fn, args, tol",
    [
        case(
            "functional_train",
            lambda x, w, b, m, v: aten._native_batch_norm_legit_functional(
                x, w, b, m, v, True, 0.1, 1e-5
            ),
            *_bn_args(),
        ),
        case(
            "functional_train_2d_input",
            lambda x, w, b, m, v: aten._native_batch_norm_legit_functional(
                x, w, b, m, v, True, 0.3, 1e-5
            ),
            *_bn_args(shape=(6, 3)),
        ),
        case(
            "functional_eval",
            lambda x, w, b, m, v: aten._native_batch_norm_legit_functional(
                x, w, b, m, v, False, 0.1, 1e-5
            ),
            *_bn_args(),
        ),
        case(
            "no_training",
            lambda x, w, b, m, v: aten._native_batch_norm_legit_no_training(
                x, w, b, m, v, 0.1, 1e-5
            ),
            *_bn_args(),
        ),
        case(
            "legit_eval",
            lambda x, w, b, m, v: aten._native_batch_norm_legit(x, w, b, m, v, False, 0.1, 1e-5),
            *_bn_args(),
        ),
        case(
            "no_stats",
            lambda x, w, b: aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5),
            *_bn_args()[:3],
        ),
        case(
            "functional_train_bf16",
            # torch's meta promises float32 running stats here (eager: bfloat16); compare values
            lambda x, w, b, m, v: [
                r.to(x.dtype)
                for r in aten._native_batch_norm_legit_functional(x, w, b, m, v, True, 0.1, 1e-5)
            ],
            *_bn_args(torch.bfloat16),
            tol=BF16,
        ),
    ],
)
def test_batch_norm_forward(fn, args, tol):
    run(fn, args, tol)


def test_batch_norm_inplace_training_is_a_clear_error():
    fn = lambda x, w, b, m, v: aten._native_batch_norm_legit(x, w, b, m, v, True, 0.1, 1e-5)  # noqa: E731
    args = _bn_args()
    with pytest.raises(LoweringError, match="running_mean/running_var in place"):
        compile_aten(fn, args, STRICT)(*args)


@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)])
@pytest.mark.parametrize("train", [True, False])
def test_batch_norm_backward(train, mask):
    x, w, b, running_mean, running_var = _bn_args()
    _, save_mean, save_invstd = aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)
    grad = rand(*x.shape, seed=5)

    def backward(grad, x, w, rm, rv, sm, si):
        grads = aten.native_batch_norm_backward(grad, x, w, rm, rv, sm, si, train, 1e-5, list(mask))
        return [g for g, wanted in zip(grads, mask) if wanted]  # eager leaves out the rest

    args = (grad, x, w, running_mean, running_var, save_mean, save_invstd)
    run(backward, args, {"rtol": 1e-4, "atol": 1e-5})


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_weight_norm_trains_compiled(dim):
    """Wav2Vec2's positional conv: torch decomposes weight norm's forward, not its backward
    (aten._weight_norm_interface_backward), which ran in eager torch."""
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(4, 6, 3)
    conv = torch.nn.utils.parametrizations.weight_norm(conv, dim=dim)
    x = torch.randn(2, 4, 9)
    options = {"cache": False, "fallback": "error"}
    compiled = torch.compile(conv, backend="tpu_inductor", options=options)
    got = grads_of(conv, compiled(x).square().sum())
    want = grads_of(conv, conv(x).square().sum())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
