"""The nn lowering rules (lowering/ops/nn.py) against eager torch, forward and backward ops.

Each case calls one ATen overload directly, so the traced graph holds exactly that op; the
compile runs with fallback="error", so a missing rule fails instead of running in eager torch.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import check_against_eager, compile_aten, grads_of
from tpu_inductor.exc import LoweringError

aten = torch.ops.aten
STRICT = {"fallback": "error"}
F32 = {"rtol": 1e-5, "atol": 1e-5}
BF16 = {"rtol": 2e-2, "atol": 2e-2}


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _case(name, fn, *args, tol=F32):
    return pytest.param(fn, args, tol, id=name)


def _run(fn, args, tol):
    check_against_eager(fn, *args, options=STRICT, **tol)


# --- convolution ---------------------------------------------------------------------------

# name, input shape, weight shape, (stride, padding, dilation, transposed, output_padding, groups)
_CONVS = [
    ("1d", (2, 4, 10), (6, 4, 3), ([1], [1], [1], False, [0], 1)),
    (
        "2d_stride_pad_dil_groups",
        (2, 4, 9, 8),
        (6, 2, 3, 2),
        ([2, 1], [1, 2], [2, 1], False, [0, 0], 2),
    ),
    (
        "3d",
        (1, 2, 5, 6, 6),
        (4, 2, 3, 3, 3),
        ([1, 2, 2], [1, 1, 1], [1, 1, 1], False, [0, 0, 0], 1),
    ),
    ("transposed_2d", (2, 4, 5, 5), (4, 3, 3, 3), ([2, 2], [1, 1], [1, 1], True, [1, 1], 1)),
    (
        "transposed_2d_groups_dil",
        (2, 4, 5, 6),
        (4, 2, 3, 2),
        ([1, 2], [2, 0], [2, 1], True, [0, 1], 2),
    ),
    ("transposed_1d", (2, 3, 7), (3, 2, 4), ([3], [0], [1], True, [2], 1)),
]


def _conv_case(name, x_shape, w_shape, config, dtype=torch.float32, tol=F32):
    stride, padding, dilation, transposed, output_padding, groups = config
    out_channels = w_shape[1] * groups if transposed else w_shape[0]
    x, w = _rand(*x_shape, dtype=dtype), _rand(*w_shape, dtype=dtype, seed=1)
    b = _rand(out_channels, dtype=dtype, seed=2)

    def conv(x, w, b):
        return aten.convolution(
            x, w, b, stride, padding, dilation, transposed, output_padding, groups
        )

    return _case(name, conv, x, w, b, tol=tol)


@pytest.mark.parametrize(
    "fn, args, tol",
    [_conv_case(*c) for c in _CONVS]
    + [
        _conv_case(
            "2d_bf16", (2, 4, 8, 8), (6, 4, 3, 3), _CONVS[1][3][:5] + (1,), torch.bfloat16, BF16
        )
    ],
)
def test_convolution(fn, args, tol):
    _run(fn, args, tol)


@pytest.mark.parametrize("mask", [(True, True, True), (False, True, False), (True, False, False)])
@pytest.mark.parametrize("name, x_shape, w_shape, config", _CONVS, ids=[c[0] for c in _CONVS])
def test_convolution_backward(name, x_shape, w_shape, config, mask):
    stride, padding, dilation, transposed, output_padding, groups = config
    x, w = _rand(*x_shape), _rand(*w_shape, seed=1)
    out = aten.convolution(
        x, w, None, stride, padding, dilation, transposed, output_padding, groups
    )
    grad = _rand(*out.shape, seed=3)
    bias_sizes = [out.shape[1]]

    def backward(grad, x, w):
        return aten.convolution_backward(
            grad,
            x,
            w,
            bias_sizes,
            stride,
            padding,
            dilation,
            transposed,
            output_padding,
            groups,
            list(mask),
        )

    _run(backward, (grad, x, w), {"rtol": 1e-4, "atol": 1e-4})


# --- normalization -------------------------------------------------------------------------


def _layer_norm(shape, weight):
    def ln(x, w, b):
        return aten.native_layer_norm(x, shape, w if weight else None, b if weight else None, 1e-5)

    return ln


@pytest.mark.parametrize(
    "fn, args, tol",
    [
        _case(
            "layer_norm_last",
            _layer_norm([8], True),
            _rand(2, 5, 8),
            _rand(8, seed=1),
            _rand(8, seed=2),
        ),
        _case(
            "layer_norm_two_dims_no_affine", _layer_norm([5, 8], False), _rand(2, 5, 8), None, None
        ),
        _case(
            "layer_norm_bf16",
            _layer_norm([16], True),
            _rand(4, 16, dtype=torch.bfloat16),
            _rand(16, dtype=torch.bfloat16, seed=1),
            _rand(16, dtype=torch.bfloat16, seed=2),
            tol=BF16,
        ),
        _case(
            "group_norm",
            lambda x, w, b: aten.native_group_norm(x, w, b, 2, 6, 16, 3, 1e-5),
            _rand(2, 6, 4, 4),
            _rand(6, seed=1),
            _rand(6, seed=2),
        ),
        _case(
            "group_norm_no_affine_3d",
            lambda x: aten.native_group_norm(x, None, None, 3, 4, 5, 2, 1e-3),
            _rand(3, 4, 5),
        ),
    ],
)
def test_norm_forward(fn, args, tol):
    _run(fn, args, tol)


@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False)])
@pytest.mark.parametrize("shape", [[8], [5, 8]])
def test_layer_norm_backward(shape, mask):
    x, w, b = _rand(2, 5, 8), _rand(*shape, seed=1), _rand(*shape, seed=2)
    _, mean, rstd = aten.native_layer_norm(x, shape, w, b, 1e-5)
    grad = _rand(2, 5, 8, seed=3)

    def backward(grad, x, mean, rstd, w, b):
        return aten.native_layer_norm_backward(grad, x, shape, mean, rstd, w, b, list(mask))

    _run(backward, (grad, x, mean, rstd, w, b), {"rtol": 1e-4, "atol": 1e-5})


@pytest.mark.parametrize("affine", [True, False])
def test_group_norm_backward(affine):
    x, w = _rand(2, 6, 4, 4), _rand(6, seed=1) if affine else None
    _, mean, rstd = aten.native_group_norm(x, w, None, 2, 6, 16, 3, 1e-5)
    grad = _rand(2, 6, 4, 4, seed=3)
    mask = [True, affine, affine]

    def backward(grad, x, mean, rstd, w):
        return aten.native_group_norm_backward(grad, x, mean, rstd, w, 2, 6, 16, 3, mask)

    _run(backward, (grad, x, mean, rstd, w), {"rtol": 1e-4, "atol": 1e-5})


def _bn_args(dtype=torch.float32, shape=(4, 3, 5, 5)):
    c = shape[1]
    running_var = _rand(c, seed=4).abs().to(dtype) + 0.5
    return (
        _rand(*shape, dtype=dtype),
        _rand(c, dtype=dtype, seed=1),
        _rand(c, dtype=dtype, seed=2),
        _rand(c, dtype=dtype, seed=3),
        running_var,
    )


@pytest.mark.parametrize(
    "fn, args, tol",
    [
        _case(
            "functional_train",
            lambda x, w, b, m, v: aten._native_batch_norm_legit_functional(
                x, w, b, m, v, True, 0.1, 1e-5
            ),
            *_bn_args(),
        ),
        _case(
            "functional_train_2d_input",
            lambda x, w, b, m, v: aten._native_batch_norm_legit_functional(
                x, w, b, m, v, True, 0.3, 1e-5
            ),
            *_bn_args(shape=(6, 3)),
        ),
        _case(
            "functional_eval",
            lambda x, w, b, m, v: aten._native_batch_norm_legit_functional(
                x, w, b, m, v, False, 0.1, 1e-5
            ),
            *_bn_args(),
        ),
        _case(
            "no_training",
            lambda x, w, b, m, v: aten._native_batch_norm_legit_no_training(
                x, w, b, m, v, 0.1, 1e-5
            ),
            *_bn_args(),
        ),
        _case(
            "legit_eval",
            lambda x, w, b, m, v: aten._native_batch_norm_legit(x, w, b, m, v, False, 0.1, 1e-5),
            *_bn_args(),
        ),
        _case(
            "no_stats",
            lambda x, w, b: aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5),
            *_bn_args()[:3],
        ),
        _case(
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
    _run(fn, args, tol)


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
    grad = _rand(*x.shape, seed=5)

    def backward(grad, x, w, rm, rv, sm, si):
        grads = aten.native_batch_norm_backward(grad, x, w, rm, rv, sm, si, train, 1e-5, list(mask))
        return [g for g, wanted in zip(grads, mask) if wanted]  # eager leaves out the rest

    args = (grad, x, w, running_mean, running_var, save_mean, save_invstd)
    _run(backward, args, {"rtol": 1e-4, "atol": 1e-5})


# --- pooling ---------------------------------------------------------------------------------


def _special_values(x):
    """x with ties, -inf and NaN planted where max pooling must treat them as torch does."""
    x = x.round()  # many ties
    x[0, 0, 0, :3] = float("-inf")
    x[0, 1, 2, 2] = float("nan")
    x[1, 0, 4, 4:6] = float("nan")
    return x


# kernel, stride, padding, dilation, ceil_mode
_MAX_POOLS = [
    ([2, 2], [], [0, 0], [1, 1], False),
    ([3, 3], [2, 2], [1, 1], [1, 1], False),
    ([3, 2], [2, 1], [1, 0], [2, 1], True),
    ([3, 3], [2, 2], [1, 1], [1, 1], True),
    ([2, 2], [2, 2], [0, 0], [1, 1], True),  # tiles, the last ones partial
    ([2, 3], [2, 3], [0, 0], [1, 1], False),  # tiles, the last row and columns left out
    ([3], [2], [1], [1], False),  # one size for both dims
]


@pytest.mark.parametrize("config", _MAX_POOLS, ids=str)
@pytest.mark.parametrize("values", ["random", "special", "unbatched"])
def test_max_pool2d_with_indices(config, values):
    x = _rand(2, 3, 9, 8)
    x = _special_values(x) if values == "special" else x[0] if values == "unbatched" else x
    _run(lambda x: aten.max_pool2d_with_indices(x, *config), (x,), F32)


@pytest.mark.parametrize("config", _MAX_POOLS, ids=str)
def test_max_pool2d_with_indices_backward(config):
    x = _rand(2, 3, 9, 8).round()  # ties: the gradient goes to the index torch chose
    out, indices = aten.max_pool2d_with_indices(x, *config)
    grad = _rand(*out.shape, seed=1)
    _run(
        lambda g, x, i: aten.max_pool2d_with_indices_backward(g, x, *config, i),
        (grad, x, indices),
        F32,
    )


def test_max_pool2d_backward_of_tiling_windows_is_elementwise():
    """Windows that tile the input need no scatter-add (a serial loop on XLA:CPU): each cell
    takes its window's gradient where it is the saved index; bfloat16 stays bfloat16."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from tpu_inductor.lowering import stablehlo

    x = _rand(2, 3, 8, 8, dtype=torch.bfloat16).round()
    out, indices = aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    grad = _rand(*out.shape, seed=1, dtype=torch.bfloat16)
    backward = lambda g, x, i: aten.max_pool2d_with_indices_backward(  # noqa: E731
        g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, i
    )
    _run(backward, (grad, x, indices), BF16)
    text = stablehlo.lower(make_fx(backward)(grad, x, indices), [grad, x, indices]).text
    assert "scatter" not in text


def test_max_pool2d_bf16():
    x = _rand(2, 3, 8, 8, dtype=torch.bfloat16)
    _run(lambda x: aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1]), (x,), BF16)


# kernel, stride, padding, ceil_mode, count_include_pad, divisor_override
_AVG_POOLS = [
    ([2, 2], [], [0, 0], False, True, None),
    ([3, 3], [2, 2], [1, 1], False, True, None),
    ([3, 3], [2, 2], [1, 1], True, False, None),
    ([3, 2], [2, 2], [1, 1], True, True, None),
    ([3, 3], [1, 2], [1, 0], False, True, 5),
    ([3], [2], [1], False, True, None),  # one size for both dims
]


@pytest.mark.parametrize("config", _AVG_POOLS, ids=str)
def test_avg_pool2d(config):
    _run(lambda x: aten.avg_pool2d(x, *config), (_rand(2, 3, 9, 8),), F32)


@pytest.mark.parametrize("config", _AVG_POOLS, ids=str)
def test_avg_pool2d_backward(config):
    x = _rand(2, 3, 9, 8)
    grad = _rand(*aten.avg_pool2d(x, *config).shape, seed=1)
    _run(lambda g, x: aten.avg_pool2d_backward(g, x, *config), (grad, x), F32)


def test_avg_pool2d_bf16():
    x = _rand(2, 3, 8, 8, dtype=torch.bfloat16)
    _run(lambda x: aten.avg_pool2d(x, [3, 3], [2, 2], [1, 1]), (x,), BF16)


@pytest.mark.parametrize(
    "sizes", [((7, 9), (3, 4)), ((8, 8), (1, 1)), ((5, 6), (5, 6)), ((4, 5), (6, 7))]
)
def test_adaptive_avg_pool2d(sizes):
    (h, w), out_size = sizes
    for lead in ((2, 3), (3,)):  # batched, unbatched
        x = _rand(*lead, h, w)
        _run(lambda x: aten._adaptive_avg_pool2d(x, list(out_size)), (x,), F32)
        grad = _rand(*lead, *out_size, seed=1)
        _run(lambda g, x: aten._adaptive_avg_pool2d_backward(g, x), (grad, x), F32)


_ADAPTIVE_MAX = torch.nn.functional.adaptive_max_pool2d, torch.nn.functional.adaptive_max_pool3d


@pytest.mark.parametrize(
    "x_shape, out_size",
    [((2, 3, 7, 9), (3, 4)), ((3, 5, 6), (5, 6)), ((2, 2, 5, 6, 7), (2, 3, 4)),
     ((2, 4, 5, 3), (3, 2, 2))],
    ids=["2d", "2d_unbatched", "3d", "3d_unbatched"],
)  # fmt: skip
def test_adaptive_max_pool_backward(x_shape, out_size):
    x = _rand(*x_shape).round().requires_grad_()  # ties: the gradient goes to torch's index
    grad = _rand(*x_shape[: -len(out_size)], *out_size, seed=1)
    pool = _ADAPTIVE_MAX[len(out_size) - 2]

    def pool_and_grad(x, g):
        out = pool(x, out_size)
        return out, torch.autograd.grad(out, x, g)[0]

    _run(pool_and_grad, (x, grad), F32)


# --- padding ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x_shape, pad",
    [((2, 3, 6), [2, 1]), ((2, 3, 5, 6), [1, 2, 3, 0]), ((3, 4, 5), [2, -1, 1, 1]),
     ((1, 2, 3, 4, 5), [1, 0, 2, 1, 1, 2])],
    ids=["1d", "2d", "2d_unbatched_crop", "3d"],
)  # fmt: skip
def test_replication_pad_backward(x_shape, pad):
    x = _rand(*x_shape)
    out = torch.nn.functional.pad(x, pad, mode="replicate")
    backward = getattr(aten, f"replication_pad{len(pad) // 2}d_backward")
    _run(lambda g, x: backward(g, x, pad), (_rand(*out.shape, seed=1), x), F32)


def test_replicate_padded_conv_training():
    """Conv2d(padding_mode="replicate") trains: its backward needs replication_pad2d_backward."""
    conv = torch.nn.Conv2d(3, 4, 3, padding=2, padding_mode="replicate")
    x = _rand(2, 3, 6, 5)
    expected = grads_of(conv, conv(x).square().sum())
    compiled = torch.compile(conv, backend="tpu_inductor", options=STRICT)
    torch.testing.assert_close(grads_of(conv, compiled(x).square().sum()), expected, **F32)


# --- embedding -------------------------------------------------------------------------------


def _tokens(*shape, high=10, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding(dtype):
    _run(lambda w, i: aten.embedding(w, i), (_rand(10, 6, dtype=dtype), _tokens(3, 7)), F32)


@pytest.mark.parametrize("padding_idx, scale", [(-1, False), (2, False), (3, True)])
def test_embedding_dense_backward(padding_idx, scale):
    indices, grad = _tokens(3, 7), _rand(3, 7, 6)

    def backward(grad, indices):
        return aten.embedding_dense_backward(grad, indices, 10, padding_idx, scale)

    _run(backward, (grad, indices), F32)


# --- attention -------------------------------------------------------------------------------

# name, (B, H, L, S, E), is_causal, mask kind (None, "float", "-inf", "empty_row"), scale;
# H: heads, or (query heads, key/value heads) for grouped-query attention (enable_gqa)
_ATTENTION = [
    ("plain", (2, 3, 16, 16, 8), False, None, None),
    ("grouped_query", (2, (4, 2), 12, 12, 8), True, None, None),
    ("causal", (2, 3, 16, 16, 8), True, None, None),
    ("causal_short_query", (1, 2, 6, 16, 8), True, None, 0.3),
    ("float_mask", (2, 2, 8, 12, 4), False, "float", None),
    ("neg_inf_mask", (2, 2, 8, 12, 4), False, "-inf", 0.5),
    ("fully_masked_row", (2, 2, 8, 12, 4), False, "empty_row", None),
]


def _attention_inputs(shape, mask_kind, dtype=torch.float32):
    b, h, length, keys, e = shape
    h, kv_heads = (h, h) if isinstance(h, int) else h
    q, k, v = (
        _rand(b, h, length, e, dtype=dtype),
        _rand(b, kv_heads, keys, e, dtype=dtype, seed=1),
        _rand(b, kv_heads, keys, e, dtype=dtype, seed=2),
    )
    mask = None
    if mask_kind is not None:
        mask = _rand(length, keys, seed=3)
        mask[:, 0] = 1.0  # no fully masked row...
        if mask_kind != "float":  # a boolean mask, as SDPA passes it to this kernel
            mask = torch.zeros_like(mask).masked_fill(mask < 0, float("-inf"))
        if mask_kind == "empty_row":  # ...unless asked for
            mask[2] = float("-inf")
        mask = mask.to(dtype)
    return q, k, v, mask


@pytest.mark.parametrize(
    "name, shape, causal, mask_kind, scale", _ATTENTION, ids=[a[0] for a in _ATTENTION]
)
def test_flash_attention_for_cpu(name, shape, causal, mask_kind, scale):
    q, k, v, mask = _attention_inputs(shape, mask_kind)

    def attention(q, k, v, mask):
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )

    _run(attention, (q, k, v, mask), {"rtol": 1e-5, "atol": 2e-5})


@pytest.mark.parametrize(
    "name, shape, causal, mask_kind, scale", _ATTENTION, ids=[a[0] for a in _ATTENTION]
)
def test_flash_attention_for_cpu_backward(name, shape, causal, mask_kind, scale):
    q, k, v, mask = _attention_inputs(shape, mask_kind)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )
    grad = _rand(*out.shape, seed=4)

    def backward(grad, q, k, v, out, lse, mask):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )

    _run(backward, (grad, q, k, v, out, lse, mask), {"rtol": 1e-4, "atol": 1e-4})


def test_flash_attention_bf16():
    q, k, v, _ = _attention_inputs((2, 2, 16, 16, 8), None, torch.bfloat16)
    _run(
        lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True),
        (q, k, v),
        BF16,
    )


# --- losses ----------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kind", ["unbatched", "1d", "2d"])
def test_nll_loss(kind, weighted, reduction):
    """Every case has targets equal to ignore_index (their loss and gradient are 0, their
    weight is not counted); the unbatched one is that target alone."""
    ignore = 1
    if kind == "unbatched":
        x, target = _rand(5).log_softmax(0), torch.tensor(ignore)
        forward, backward = aten.nll_loss_forward, aten.nll_loss_backward
    elif kind == "1d":
        x, target = _rand(8, 5).log_softmax(1), _tokens(8, high=5)
        forward, backward = aten.nll_loss_forward, aten.nll_loss_backward
    else:
        x, target = _rand(2, 5, 3, 4).log_softmax(1), _tokens(2, 3, 4, high=5)
        forward, backward = aten.nll_loss2d_forward, aten.nll_loss2d_backward
    target.view(-1)[::3] = ignore
    weight = _rand(5, seed=1).abs() if weighted else None
    _run(lambda x, t, w: forward(x, t, w, reduction, ignore), (x, target, weight), F32)
    loss, total = forward(x, target, weight, reduction, ignore)
    grad = torch.randn(loss.shape, generator=torch.Generator().manual_seed(2))

    def grad_fn(g, x, t, w, total):
        return backward(g, x, t, w, reduction, ignore, total)

    _run(grad_fn, (grad, x, target, weight, total), F32)


# A -1 ends a row's targets: the entries after it are not targets. The last row has a margin of
# exactly 0 (1 - 1.5 + 0.5), where torch's gradient is 0.
_MLM_TARGETS = torch.tensor([[3, 0, -1, 1, 2], [1, -1, 2, 2, 0], [0, 4, 2, 1, 3], [0, -1, 1, 1, 1]])


def _mlm_inputs():
    x = _rand(4, 5)
    x[3, :2] = torch.tensor([1.5, 0.5])
    return x


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("batched", [True, False], ids=["2d", "1d"])
def test_multilabel_margin_loss(batched, reduction):
    x, target = _mlm_inputs(), _MLM_TARGETS
    if not batched:
        x, target = x[0], target[0]

    def loss_and_grad(x, t):
        loss = torch.nn.functional.multilabel_margin_loss(x, t, reduction=reduction)
        # torch's meta shapes a 1-d input's unreduced loss (1,), its kernel ()
        return loss.reshape(-1), torch.autograd.grad(loss.sum(), x)[0]

    _run(loss_and_grad, (x.requires_grad_(), target), F32)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multilabel_margin_loss_through_dynamo(reduction):
    """torch also installs its wrong decomposition as the op's Autograd kernel, which tracing
    runs before any table: taken out while tracing (tpu_inductor.decompositions)."""
    x, target = _mlm_inputs(), _MLM_TARGETS

    def loss(x, t):
        return torch.nn.functional.multilabel_margin_loss(x, t, reduction=reduction)

    compiled = torch.compile(loss, backend="tpu_inductor", options=STRICT)
    leaf, want_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = compiled(leaf, target), loss(want_leaf, target)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(leaf.grad, want_leaf.grad)
    kernels = torch.ops.aten.multilabel_margin_loss_forward.default.py_kernels
    assert torch._C.DispatchKey.Autograd in kernels  # put back for everyone else


# --- 64-bit policy ---------------------------------------------------------------------------


@pytest.mark.parametrize("x64", ["keep", "narrow"])
def test_max_pool_indices_follow_the_64_bit_policy(x64):
    # narrowed to int32 inside the graph, the indices come back as torch int64, same values
    fn = lambda x: aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1])  # noqa: E731
    check_against_eager(fn, _rand(2, 3, 8, 8), options={**STRICT, "x64": x64})


def test_average_pooling_is_one_windowed_sum_whatever_the_kernel():
    """EfficientNet pools with AvgPool2d(1280, ceil_mode=True): a sum of one slice per kernel
    element was 100k ops (minutes of XLA compile at 320); it is one reduce_window."""
    import functools

    from torch.fx.experimental.proxy_tensor import make_fx
    from tpu_inductor.lowering import stablehlo

    x = torch.randn(2, 3, 5, 4)
    pool = torch.nn.functional.avg_pool2d
    for count_include_pad in (True, False):
        fn = functools.partial(
            pool, kernel_size=64, ceil_mode=True, count_include_pad=count_include_pad
        )
        check_against_eager(fn, x)
        text = stablehlo.lower(make_fx(fn)(x), [x]).text
        assert text.count("reduce_window") == 1 and text.count("stablehlo.slice") <= 1, text
    check_against_eager(
        functools.partial(
            pool, kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False
        ),
        x,
    )


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
