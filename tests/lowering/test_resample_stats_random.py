"""Rules of lowering/ops/{resample,statistics,random}.py against eager torch."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import (
    assert_same,
    check_against_eager,
    check_many_against_eager,
    compile_aten,
    functional,
)

aten = torch.ops.aten
nan = float("nan")


def _ties():
    """Rows with repeated values, a repeated extreme and NaNs (torch's tie and NaN rules)."""
    return torch.tensor(
        [
            [3.0, 1, 3, 1, 2, 2, 1, 3],
            [5.0, 5, 5, 5, 5, 5, 5, 5],
            [1.0, nan, 2, nan, 0, 0, 0, 0],
            [-1.0, 4, 4, -2, 7, 7, -2, 0],
        ]
    )


# --- statistics -----------------------------------------------------------------------------


def test_order_statistics_values_and_distinct_indices():
    x = torch.randn(4, 7, 5)  # distinct values: every index is determined
    check_many_against_eager(
        {
            "median": lambda t: torch.median(t),
            "median_dim": lambda t: torch.median(t, 1),
            "median_keep": lambda t: torch.median(t, -1, keepdim=True),
            "nanmedian_dim": lambda t: torch.nanmedian(t, 0),
            "kthvalue": lambda t: torch.kthvalue(t, 3, 1),
            "kthvalue_keep": lambda t: torch.kthvalue(t, 1, -1, True),
            "mode": lambda t: torch.mode(t, 1),
        },
        x,
    )


def test_order_statistics_nan_and_ties():
    x = _ties()
    median = torch.median(x, 1)
    got = compile_aten(lambda t: torch.median(t, 1), [x])(x)
    torch.testing.assert_close(got[0], median.values, equal_nan=True)
    # a NaN row points at its first NaN; other rows at an element equal to the median
    assert got[1][2] == 1
    torch.testing.assert_close(x.gather(1, got[1][:, None])[[0, 1, 3], 0], median.values[[0, 1, 3]])
    check_many_against_eager(
        {
            "median": lambda t: torch.median(t),
            "nanmedian": lambda t: torch.nanmedian(t),
            "nanmedian_values": lambda t: torch.nanmedian(t, 1).values,
            "kth_values": lambda t: torch.kthvalue(t, 7, 1).values,
            "mode": lambda t: torch.mode(t[[0, 1, 3]], 1),  # smallest most frequent, last index
        },
        x,
    )


def test_nanmedian_all_nan_row():
    check_against_eager(lambda t: torch.nanmedian(t, 1), torch.full((2, 3), nan))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_cummax_cummin_last_index_of_ties(dtype):
    x = _ties() if dtype != torch.int64 else torch.randint(0, 3, (4, 9))
    x = x.to(dtype)
    check_many_against_eager(
        {
            "cummax": lambda t: torch.cummax(t, 1),
            "cummin": lambda t: torch.cummin(t, 1),
            "cummax0": lambda t: torch.cummax(t, 0),
        },
        x,
    )


def test_logcumsumexp_with_infinities():
    x = torch.tensor([[-float("inf"), -float("inf"), 1.0, 1e3, float("inf"), 2.0], [0.5] * 6])
    check_many_against_eager(
        {"lcse": lambda t: torch.logcumsumexp(t, 1), "lcse0": lambda t: torch.logcumsumexp(t, 0)},
        x,
    )
    check_against_eager(lambda t: torch.logcumsumexp(t, -1), torch.randn(3, 50))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_histc(dtype):
    x = (torch.randn(300) * 3).to(dtype)
    x[:5] = torch.tensor([-2.0, 2.0, 0.0, nan, 1.5])  # both edges, NaN dropped
    check_many_against_eager(
        {
            "range": lambda t: torch.histc(t, 7, -2, 2),
            "data": lambda t: torch.histc(t[5:], 13),
            "constant": lambda t: torch.histc(t[:1] * 0 + 3, 4),
        },
        x,
    )


def test_searchsorted_and_bucketize():
    boundaries = torch.tensor([-1.0, 0.0, 0.0, 2.0, 5.0, nan])
    x = torch.tensor([[-3.0, 0.0, 1.0, 2.0], [5.0, 9.0, nan, -1.0]])
    batched = torch.sort(torch.randn(2, 9), dim=1).values
    unsorted = torch.randn(9)
    sorter = torch.argsort(unsorted)
    check_many_against_eager(
        {
            "left": lambda b, v, bb, u, s: torch.searchsorted(b, v),
            "right": lambda b, v, bb, u, s: torch.searchsorted(b, v, right=True),
            "side": lambda b, v, bb, u, s: torch.searchsorted(b, v, side="right", out_int32=True),
            "batched": lambda b, v, bb, u, s: torch.searchsorted(bb, v),
            "sorter": lambda b, v, bb, u, s: torch.searchsorted(u, v, sorter=s),
            "bucketize": lambda b, v, bb, u, s: torch.bucketize(v, b[:5]),
            "bucketize_r": lambda b, v, bb, u, s: torch.bucketize(v, b[:5], right=True),
        },
        boundaries,
        x,
        batched,
        unsorted,
        sorter,
    )
    # isin is decomposed by the backend's table (make_fx alone keeps it, and it has no rule)
    isin = lambda v, b: torch.isin(v, b)  # noqa: E731
    strict = torch.compile(isin, backend="tpu_inductor", options={"fallback": "error"})
    assert_same(strict(x, boundaries), isin(x, boundaries))


def test_batch_norm_with_update():
    x, w, b = torch.randn(4, 3, 5), torch.randn(3), torch.randn(3)
    mean, var = torch.randn(3), torch.rand(3) + 0.5

    def fn(x, w, b, mean, var):
        return aten._batch_norm_with_update_functional(x, w, b, mean, var, 0.1, 1e-5)

    expected = fn(x, w, b, mean, var)
    got = compile_aten(fn, [x, w, b, mean, var])(x, w, b, mean, var)
    for i in (0, 1, 2, 4, 5):  # index 3 is an empty reserve buffer
        torch.testing.assert_close(got[i], expected[i], rtol=1e-5, atol=1e-5)
    assert got[3].shape == expected[3].shape and got[3].dtype == expected[3].dtype


def test_frexp_ldexp_angle():
    x = torch.tensor([0.0, -0.0, float("inf"), nan, 1e-40, -3.5, 6e-39, 1e30, -2.0, 7.0])
    ints = torch.tensor([1, 200, -3, 0, 5, -140, 2, -30, 7, 1])
    check_many_against_eager(
        {
            "frexp": lambda t, e: torch.frexp(t),
            # XLA on CPU flushes subnormal arithmetic: ldexp's inputs and results stay normal
            "ldexp_int": lambda t, e: torch.ldexp(t[5:], e[5:] % 40),
            "ldexp_float": lambda t, e: torch.ldexp(t, (e % 7).float() - 2.5),
            "angle": lambda t, e: torch.angle(t),
            "angle_int": lambda t, e: torch.angle(e),
        },
        x,
        ints,
    )
    check_against_eager(lambda t: torch.frexp(t), torch.randn(20).to(torch.bfloat16))


# --- resampling -----------------------------------------------------------------------------


def test_adaptive_max_pool_indices_nan_and_ties():
    x = torch.randint(0, 3, (2, 3, 7, 9)).float()  # many ties
    x[0, 0, 1, 2] = nan
    x[1, 1] = -float("inf")
    check_many_against_eager(
        {
            "amp2": lambda t: F.adaptive_max_pool2d(t, (3, 4), return_indices=True),
            "amp1": lambda t: F.adaptive_max_pool1d(t[0], 4, return_indices=True),
            "amp3": lambda t: F.adaptive_max_pool3d(t, (2, 3, 5), return_indices=True),
        },
        x,
    )


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_max_pool3d_indices(ceil_mode):
    x = torch.randint(0, 4, (2, 2, 6, 7, 5)).float()
    x[0, 0, 0, 0, 0] = nan
    x[1, 1] = -float("inf")
    check_many_against_eager(
        {
            "plain": lambda t: F.max_pool3d(t, 2, return_indices=True, ceil_mode=ceil_mode),
            "padded": lambda t: F.max_pool3d(
                t, 3, 2, padding=1, dilation=(1, 2, 1), ceil_mode=ceil_mode, return_indices=True
            ),
        },
        x,
    )


def test_max_pool3d_backward():
    x = torch.randn(2, 3, 5, 6, 4, requires_grad=True)

    def fn(t):
        return torch.autograd.grad(F.max_pool3d(t, 2, 2, 1).sum(), t)[0]

    check_against_eager(fn, x)


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_avg_pool3d_and_adaptive_avg_pool3d(ceil_mode):
    x = torch.randn(2, 3, 6, 7, 5)
    check_many_against_eager(
        {
            "avg": lambda t: F.avg_pool3d(t, 3, 2, 1, ceil_mode=ceil_mode),
            "avg_nopad": lambda t: F.avg_pool3d(
                t, 3, 2, 1, ceil_mode=ceil_mode, count_include_pad=False
            ),
            "avg_div": lambda t: F.avg_pool3d(t, 2, divisor_override=3, ceil_mode=ceil_mode),
            "adaptive": lambda t: F.adaptive_avg_pool3d(t, (4, 3, 2)),
        },
        x,
        tolerance=lambda name, dtype: {"rtol": 1e-5, "atol": 1e-5},
    )


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
def test_grid_sample(mode, padding_mode):
    x2, g2 = torch.randn(2, 3, 5, 7), torch.rand(2, 4, 6, 2) * 3 - 1.5
    x3, g3 = torch.randn(2, 2, 4, 5, 3), torch.rand(2, 3, 2, 4, 3) * 3 - 1.5
    g2[0, 0, :3] = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.25]])  # edges, half-way
    tol = {"rtol": 1e-5, "atol": 1e-5}
    for align in (False, True):

        def fn(x, g, align=align):
            return F.grid_sample(x, g, mode=mode, padding_mode=padding_mode, align_corners=align)

        check_against_eager(functools.partial(fn, align=align), x2, g2, **tol)
        check_against_eager(functools.partial(fn, align=align), x3, g3, **tol)


def test_bilinear():
    x1, x2 = torch.randn(6, 3), torch.randn(6, 4)
    w, b = torch.randn(5, 3, 4), torch.randn(5)
    check_against_eager(F.bilinear, x1, x2, w, b, rtol=1e-5, atol=1e-5)


# --- random -----------------------------------------------------------------------------------


def _through_the_backend(fn, args):
    return torch.compile(fn, backend="tpu_inductor", options={"fallback": "error"})


def _draw(fn, *args, compiler=lambda fn, args: compile_aten(functional(fn), args)):
    """Compile fn once; run it under two equal seeds and one other seed."""
    compiled = compiler(fn, list(args))
    torch.manual_seed(1)
    first = compiled(*args)
    torch.manual_seed(1)
    again = compiled(*args)
    torch.manual_seed(2)
    other = compiled(*args)
    return first, again, other


_N = 200_000
_SAMPLERS = {
    # name: (fn of a (N,) float tensor, expected mean, expected variance)
    "normal": (lambda t: torch.normal(t * 0 + 2.0, 3.0), 2.0, 9.0),
    "normal_tt": (lambda t: torch.normal(t * 0 - 1.0, t * 0 + 0.5), -1.0, 0.25),
    "normal_ff": (lambda t: torch.normal(1.5, 2.0, (_N,)) + t * 0, 1.5, 4.0),
    "normal_": (lambda t: t.clone().normal_(0.5, 2.0), 0.5, 4.0),
    "uniform_": (lambda t: t.clone().uniform_(-1.0, 3.0), 1.0, 16 / 12),
    "exponential_": (lambda t: t.clone().exponential_(2.0), 0.5, 0.25),
    "geometric_": (lambda t: t.clone().geometric_(0.25), 4.0, 0.75 / 0.0625),
    "log_normal_": (lambda t: t.clone().log_normal_(0.0, 0.5), 1.1331485, 0.3646958),
}


@pytest.mark.parametrize("name", sorted(_SAMPLERS))
def test_sampler_statistics_and_seeding(name):
    fn, mean, var = _SAMPLERS[name]
    x = torch.zeros(_N)
    first, again, other = _draw(fn, x)
    assert first.shape == (_N,) and first.dtype == torch.float32
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first, other)
    torch.testing.assert_close(first.mean().item(), mean, rtol=0.02, atol=0.02)
    torch.testing.assert_close(first.var().item(), var, rtol=0.03, atol=0.01)
    if name == "geometric_":
        assert torch.equal(first, first.round()) and first.min() >= 1


def test_cauchy_median_and_quartiles():
    first, again, _ = _draw(lambda t: t.clone().cauchy_(1.0, 2.0), torch.zeros(_N))
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    quartiles = torch.quantile(first[:100_000], torch.tensor([0.25, 0.5, 0.75]))
    torch.testing.assert_close(quartiles, torch.tensor([-1.0, 1.0, 3.0]), rtol=0, atol=0.06)


def test_rrelu():
    x = torch.randn(50_000)
    # through the backend: make_fx (functionalized or not) keeps rrelu_with_noise, no rule
    evaluated = lambda t: F.rrelu(t, 0.1, 0.3, training=False)  # noqa: E731
    assert_same(_through_the_backend(evaluated, [x])(x), evaluated(x))
    trained = lambda t: F.rrelu(t, 0.1, 0.3, training=True)  # noqa: E731
    first, again, _ = _draw(trained, x, compiler=_through_the_backend)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    pos, neg = x > 0, x <= 0
    torch.testing.assert_close(first[pos], x[pos])
    slopes = first[neg] / x[neg]
    assert slopes.min() >= 0.1 - 1e-6 and slopes.max() <= 0.3 + 1e-6
    torch.testing.assert_close(slopes.mean().item(), 0.2, rtol=0, atol=0.005)


def test_multinomial():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [1.0, 1.0, 1.0, 1.0]])
    with_replacement, again, _ = _draw(lambda p: torch.multinomial(p, 20_000, True), probs)
    torch.testing.assert_close(with_replacement, again, rtol=0, atol=0)
    assert with_replacement.dtype == torch.int64
    freq = torch.stack([torch.bincount(row, minlength=4) / 20_000.0 for row in with_replacement])
    torch.testing.assert_close(freq, probs / probs.sum(1, keepdim=True), rtol=0, atol=0.015)
    no_replacement, _, _ = _draw(lambda p: torch.multinomial(p, 3), probs)
    assert (no_replacement[0] != 1).all()  # a zero-probability category is never drawn
    for row in no_replacement:
        assert len(set(row.tolist())) == 3


def test_randperm():
    first, again, other = _draw(
        lambda t: torch.randperm(50) + t, torch.zeros((), dtype=torch.int64)
    )
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(torch.sort(first).values, torch.arange(50))
