"""Max, average and adaptive pooling (lowering/ops/pooling.py) against eager torch.

Each case calls one ATen overload directly, so the traced graph holds exactly that op; the
compile runs with fallback="error", so a missing rule fails instead of running in eager torch.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import check_against_eager
from tests.lowering.nn_helpers import BF16, F32, STRICT, aten, rand, run

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
    x = rand(2, 3, 9, 8)
    x = _special_values(x) if values == "special" else x[0] if values == "unbatched" else x
    run(lambda x: aten.max_pool2d_with_indices(x, *config), (x,), F32)


@pytest.mark.parametrize("config", _MAX_POOLS, ids=str)
def test_max_pool2d_with_indices_backward(config):
    x = rand(2, 3, 9, 8).round()  # ties: the gradient goes to the index torch chose
    out, indices = aten.max_pool2d_with_indices(x, *config)
    grad = rand(*out.shape, seed=1)
    run(
        lambda g, x, i: aten.max_pool2d_with_indices_backward(g, x, *config, i),
        (grad, x, indices),
        F32,
    )


def test_max_pool2d_backward_of_tiling_windows_is_elementwise():
    """Windows that tile the input need no scatter-add (a serial loop on XLA:CPU): each cell
    takes its window's gradient where it is the saved index; bfloat16 stays bfloat16."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from tpu_inductor.lowering import stablehlo

    x = rand(2, 3, 8, 8, dtype=torch.bfloat16).round()
    out, indices = aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    grad = rand(*out.shape, seed=1, dtype=torch.bfloat16)
    backward = lambda g, x, i: aten.max_pool2d_with_indices_backward(  # noqa: E731
        g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, i
    )
    run(backward, (grad, x, indices), BF16)
    text = stablehlo.lower(make_fx(backward)(grad, x, indices), [grad, x, indices]).text
    assert "scatter" not in text


def test_max_pool2d_bf16():
    x = rand(2, 3, 8, 8, dtype=torch.bfloat16)
    run(lambda x: aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1]), (x,), BF16)


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
    run(lambda x: aten.avg_pool2d(x, *config), (rand(2, 3, 9, 8),), F32)


@pytest.mark.parametrize("config", _AVG_POOLS, ids=str)
def test_avg_pool2d_backward(config):
    x = rand(2, 3, 9, 8)
    grad = rand(*aten.avg_pool2d(x, *config).shape, seed=1)
    run(lambda g, x: aten.avg_pool2d_backward(g, x, *config), (grad, x), F32)


def test_avg_pool2d_bf16():
    x = rand(2, 3, 8, 8, dtype=torch.bfloat16)
    run(lambda x: aten.avg_pool2d(x, [3, 3], [2, 2], [1, 1]), (x,), BF16)


@pytest.mark.parametrize(
    "sizes", [((7, 9), (3, 4)), ((8, 8), (1, 1)), ((5, 6), (5, 6)), ((4, 5), (6, 7))]
)
def test_adaptive_avg_pool2d(sizes):
    (h, w), out_size = sizes
    for lead in ((2, 3), (3,)):  # batched, unbatched
        x = rand(*lead, h, w)
        run(lambda x: aten._adaptive_avg_pool2d(x, list(out_size)), (x,), F32)
        grad = rand(*lead, *out_size, seed=1)
        run(lambda g, x: aten._adaptive_avg_pool2d_backward(g, x), (grad, x), F32)


_ADAPTIVE_MAX = torch.nn.functional.adaptive_max_pool2d, torch.nn.functional.adaptive_max_pool3d


@pytest.mark.parametrize(
    "x_shape, out_size",
    [((2, 3, 7, 9), (3, 4)), ((3, 5, 6), (5, 6)), ((2, 2, 5, 6, 7), (2, 3, 4)),
     ((2, 4, 5, 3), (3, 2, 2))],
    ids=["2d", "2d_unbatched", "3d", "3d_unbatched"],
)  # fmt: skip
def test_adaptive_max_pool_backward(x_shape, out_size):
    x = rand(*x_shape).round().requires_grad_()  # ties: the gradient goes to torch's index
    grad = rand(*x_shape[: -len(out_size)], *out_size, seed=1)
    pool = _ADAPTIVE_MAX[len(out_size) - 2]

    def pool_and_grad(x, g):
        out = pool(x, out_size)
        return out, torch.autograd.grad(out, x, g)[0]

    run(pool_and_grad, (x, grad), F32)


# --- 64-bit policy ---------------------------------------------------------------------------


@pytest.mark.parametrize("x64", ["keep", "narrow"])
def test_max_pool_indices_follow_the_64_bit_policy(x64):
    # narrowed to int32 inside the graph, the indices come back as torch int64, same values
    fn = lambda x: aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1])  # noqa: E731
    check_against_eager(fn, rand(2, 3, 8, 8), options={**STRICT, "x64": x64})


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
