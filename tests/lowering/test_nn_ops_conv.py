"""Convolution (lowering/ops/conv.py), forward and backward, and replication padding's
backward, against eager torch.

Each case calls one ATen overload directly, so the traced graph holds exactly that op; the
compile runs with fallback="error", so a missing rule fails instead of running in eager torch.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import grads_of
from tests.lowering.nn_helpers import BF16, F32, STRICT, aten, case, rand, run

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
    x, w = rand(*x_shape, dtype=dtype), rand(*w_shape, dtype=dtype, seed=1)
    b = rand(out_channels, dtype=dtype, seed=2)

    def conv(x, w, b):
        return aten.convolution(
            x, w, b, stride, padding, dilation, transposed, output_padding, groups
        )

    return case(name, conv, x, w, b, tol=tol)


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
    run(fn, args, tol)


@pytest.mark.parametrize("mask", [(True, True, True), (False, True, False), (True, False, False)])
@pytest.mark.parametrize("name, x_shape, w_shape, config", _CONVS, ids=[c[0] for c in _CONVS])
def test_convolution_backward(name, x_shape, w_shape, config, mask):
    stride, padding, dilation, transposed, output_padding, groups = config
    x, w = rand(*x_shape), rand(*w_shape, seed=1)
    out = aten.convolution(
        x, w, None, stride, padding, dilation, transposed, output_padding, groups
    )
    grad = rand(*out.shape, seed=3)
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

    run(backward, (grad, x, w), {"rtol": 1e-4, "atol": 1e-4})


# --- padding ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x_shape, pad",
    [((2, 3, 6), [2, 1]), ((2, 3, 5, 6), [1, 2, 3, 0]), ((3, 4, 5), [2, -1, 1, 1]),
     ((1, 2, 3, 4, 5), [1, 0, 2, 1, 1, 2])],
    ids=["1d", "2d", "2d_unbatched_crop", "3d"],
)  # fmt: skip
def test_replication_pad_backward(x_shape, pad):
    x = rand(*x_shape)
    out = torch.nn.functional.pad(x, pad, mode="replicate")
    backward = getattr(aten, f"replication_pad{len(pad) // 2}d_backward")
    run(lambda g, x: backward(g, x, pad), (rand(*out.shape, seed=1), x), F32)


def test_replicate_padded_conv_training():
    """Conv2d(padding_mode="replicate") trains: its backward needs replication_pad2d_backward."""
    torch.manual_seed(0)  # the weight gradient is a sum: some initializations round past F32
    conv = torch.nn.Conv2d(3, 4, 3, padding=2, padding_mode="replicate")
    x = rand(2, 3, 6, 5)
    expected = grads_of(conv, conv(x).square().sum())
    compiled = torch.compile(conv, backend="tpu_inductor", options=STRICT)
    torch.testing.assert_close(grads_of(conv, compiled(x).square().sum()), expected, **F32)
