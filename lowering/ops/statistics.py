"""Order statistics, running extrema, histograms, binary search and float decomposition.

Index outputs follow torch's CPU kernels where torch defines them: cummax/cummin point at the
last of equal extrema, mode at the last occurrence of the smallest most frequent value. median,
nanmedian and kthvalue pick the k-th element of a stable sort, so among equal values their index
may differ from torch's (quickselect, order unspecified); the values are exact.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from . import common, normalization
from .common import accumulation_dtype

aten = ops.aten


# --- order statistics -------------------------------------------------------------------------


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _pick(ctx, x, dim, keepdim, position):
    """(value, index) of the element at sorted `position(sorted_row, nan_count)` along `dim`.

    The sort is stable with NaN last, as torch orders NaN above every number.
    """
    axis = common.dim(dim, x.ndim)
    v = jnp.moveaxis(x.reshape(x.shape or (1,)), axis if x.ndim else 0, -1)
    order = jnp.argsort(v, axis=-1, stable=True)
    ordered = jnp.take_along_axis(v, order, -1)
    nans = jnp.sum(jnp.isnan(v), axis=-1, keepdims=True) if _is_float(v) else jnp.zeros((), int)
    pos = jnp.broadcast_to(position(v.shape[-1], nans), v.shape[:-1] + (1,))
    value = jnp.take_along_axis(ordered, pos, -1)[..., 0]
    index = jnp.take_along_axis(order, pos, -1)[..., 0]
    if keepdim and x.ndim:
        value, index = jnp.expand_dims(value, axis), jnp.expand_dims(index, axis)
    index_dtype = ctx.jax_dtype(torch.int64)
    return value.reshape(ctx.out[0].shape), index.reshape(ctx.out[1].shape).astype(index_dtype)


def _median_position(n, nans):
    """The lower median, or the first NaN (sorted after every number) when there is one."""
    return jnp.where(nans > 0, n - nans, (n - 1) // 2)


def _nanmedian_position(n, nans):
    return jnp.maximum((n - nans - 1) // 2, 0)


class _FlatCtx:
    """A context whose node results are (value, index) of a whole-tensor reduction."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.out = (ctx.out, ctx.out)

    def jax_dtype(self, dtype):
        return self._ctx.jax_dtype(dtype)


@register_lowering(aten.median.default, needs_ctx=True)
def median(ctx, x):
    return _pick(_FlatCtx(ctx), x.reshape(-1), 0, False, _median_position)[0]


@register_lowering(aten.nanmedian.default, needs_ctx=True)
def nanmedian(ctx, x):
    return _pick(_FlatCtx(ctx), x.reshape(-1), 0, False, _nanmedian_position)[0]


@register_lowering(aten.median.dim, needs_ctx=True)
def median_dim(ctx, x, dim, keepdim=False):
    return _pick(ctx, x, dim, keepdim, _median_position)


@register_lowering(aten.nanmedian.dim, needs_ctx=True)
def nanmedian_dim(ctx, x, dim, keepdim=False):
    return _pick(ctx, x, dim, keepdim, _nanmedian_position)


@register_lowering(aten.kthvalue.default, needs_ctx=True)
def kthvalue(ctx, x, k, dim=-1, keepdim=False):
    return _pick(ctx, x, dim, keepdim, lambda n, nans: jnp.asarray(int(k) - 1))


@register_lowering(aten.mode.default, needs_ctx=True)
def mode(ctx, x, dim=-1, keepdim=False):
    """The smallest of the most frequent values, and the index of its last occurrence."""
    axis = common.dim(dim, x.ndim)
    v = jnp.moveaxis(x.reshape(x.shape or (1,)), axis if x.ndim else 0, -1)
    ordered = jnp.sort(v, axis=-1)
    n = v.shape[-1]
    positions = jnp.arange(n)
    starts = jnp.concatenate(
        [jnp.ones(v.shape[:-1] + (1,), bool), ordered[..., 1:] != ordered[..., :-1]], axis=-1
    )
    run_start = lax.cummax(jnp.where(starts, positions, 0), axis=v.ndim - 1)
    run_length = positions - run_start + 1
    best = jnp.argmax(run_length, axis=-1, keepdims=True)  # end of the first longest run
    value = jnp.take_along_axis(ordered, best, -1)
    index = jnp.max(jnp.where(v == value, positions, -1), axis=-1)
    value = value[..., 0]
    if keepdim and x.ndim:
        value, index = jnp.expand_dims(value, axis), jnp.expand_dims(index, axis)
    index_dtype = ctx.jax_dtype(torch.int64)
    return value.reshape(ctx.out[0].shape), index.reshape(ctx.out[1].shape).astype(index_dtype)


# --- running extrema and log-sum-exp ----------------------------------------------------------


def _cumulative_extreme(ctx, x, dim, later_wins):
    """(values, indices) of a running extreme: a later element replaces the running one when
    it is NaN, or when neither is NaN and `later_wins(later, earlier)` (torch's CPU rule)."""
    axis = common.dim(dim, x.ndim)
    if x.ndim == 0:
        return x, jnp.zeros((), ctx.jax_dtype(torch.int64))
    index = lax.broadcasted_iota(jnp.int64 if ctx.x64 == "keep" else jnp.int32, x.shape, axis)

    def combine(earlier, later):
        (a, ia), (b, ib) = earlier, later
        take = later_wins(b, a)
        if _is_float(a):
            take = jnp.isnan(b) | (~jnp.isnan(a) & take)
        return jnp.where(take, b, a), jnp.where(take, ib, ia)

    values, indices = lax.associative_scan(combine, (x, index), axis=axis)
    return values, indices.astype(ctx.jax_dtype(torch.int64))


@register_lowering(aten.cummax.default, needs_ctx=True)
def cummax(ctx, x, dim):
    return _cumulative_extreme(ctx, x, dim, lambda b, a: b >= a)


@register_lowering(aten.cummin.default, needs_ctx=True)
def cummin(ctx, x, dim):
    return _cumulative_extreme(ctx, x, dim, lambda b, a: b <= a)


@register_lowering(aten.logcumsumexp.default, needs_ctx=True)
def logcumsumexp(ctx, x, dim):
    if x.ndim == 0:
        return x
    xf = x.astype(accumulation_dtype(x.dtype))
    return lax.cumlogsumexp(xf, axis=common.dim(dim, x.ndim)).astype(ctx.out_dtype)


# --- histograms and binary search -------------------------------------------------------------


@register_lowering(aten.histc.default, needs_ctx=True)
def histc(ctx, x, bins=100, low=0, high=0):
    """torch's histc: `bins` equal bins over [low, high] (the data's range when low == high),
    the bin computed by torch's division in the input dtype; values outside are dropped."""
    flat = x.reshape(-1)
    if low == high:
        lo, hi = (jnp.min(flat), jnp.max(flat)) if flat.size else (low, high)
        lo, hi = jnp.asarray(lo, jnp.float32), jnp.asarray(hi, jnp.float32)
        same = lo == hi
        lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    else:
        lo, hi = jnp.asarray(low, jnp.float32), jnp.asarray(high, jnp.float32)
    # torch computes (x - lo) * bins / (hi - lo) in the input dtype, rounding every step
    lo, hi = (_in_dtype(x.dtype, v.astype(jnp.float32)) for v in (lo, hi))
    flat = flat.astype(jnp.float32)
    pos = _in_dtype(x.dtype, _in_dtype(x.dtype, flat - lo) * bins)
    pos = _in_dtype(x.dtype, pos / _in_dtype(x.dtype, hi - lo))
    pos = jnp.clip(pos.astype(jnp.int32), 0, bins - 1)
    inside = (flat >= lo) & (flat <= hi)
    counts = jnp.zeros((bins,), jnp.float32).at[pos].add(inside.astype(jnp.float32))
    return counts.astype(ctx.out_dtype)


def _in_dtype(dtype, value):
    """`value` rounded to `dtype`'s precision, as torch rounds each 16-bit operation's result
    (a plain cast could be elided by XLA's excess-precision rewrites)."""
    if dtype == jnp.bfloat16:
        return lax.reduce_precision(value, exponent_bits=8, mantissa_bits=7)
    if dtype == jnp.float16:
        return lax.reduce_precision(value, exponent_bits=5, mantissa_bits=10)
    return value


def _binary_search(boundaries, values, right, sorter=None):
    """torch's searchsorted: for each value, the first position p of `boundaries` (last axis)
    with boundaries[p] >= value (> when `right`), found by the same bisection torch runs, so
    NaN and unsorted boundaries give torch's answers. Leading axes of boundaries batch."""
    dtype = jnp.result_type(boundaries, values)
    boundaries, values = boundaries.astype(dtype), values.astype(dtype)
    n = boundaries.shape[-1]
    if boundaries.ndim == 1:
        lookup = lambda mid: boundaries[mid]  # noqa: E731
        if sorter is not None:
            lookup = lambda mid: boundaries[sorter[mid]]  # noqa: E731
    else:

        def lookup(mid):
            take = mid if sorter is None else jnp.take_along_axis(sorter, mid, -1)
            return jnp.take_along_axis(boundaries, take, -1)

    start = jnp.zeros(values.shape, jnp.int32)
    end = jnp.full(values.shape, n, jnp.int32)
    for _ in range(max(n, 1).bit_length()):
        mid = start + (end - start) // 2
        mid_value = lookup(jnp.minimum(mid, max(n - 1, 0)))
        go_right = ~(mid_value > values) if right else ~(mid_value >= values)
        active = start < end
        start = jnp.where(active & go_right, mid + 1, start)
        end = jnp.where(active & ~go_right, mid, end)
    return start


def _linspace(start, end, steps: int, dtype):
    """torch's CPU linspace: the first half counted up from `start`, the rest down from `end`."""
    start, end = jnp.asarray(start, dtype), jnp.asarray(end, dtype)
    step = (end - start) / max(steps - 1, 1)
    idx = jnp.arange(steps)
    up = start + step * idx.astype(dtype)
    down = end - step * (steps - idx - 1).astype(dtype)
    return jnp.where(idx < steps // 2, up, down)


def _outer_edges(x, counts, range_):
    """(leftmost, rightmost) per dim: `range` (pairs), or the data's extrema; an empty span
    widened by 0.5 each side, as torch (and numpy) do."""
    if range_ is not None:
        edges = [(range_[2 * d], range_[2 * d + 1]) for d in range(len(counts))]
        lo, hi = (jnp.asarray([e[i] for e in edges], jnp.float32) for i in (0, 1))
    elif x.shape[0]:
        lo, hi = jnp.min(x, axis=0).astype(jnp.float32), jnp.max(x, axis=0).astype(jnp.float32)
    else:
        lo, hi = jnp.zeros(len(counts), jnp.float32), jnp.zeros(len(counts), jnp.float32)
    same = lo == hi
    return jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)


def _bin_edges(x, counts, range_):
    lo, hi = _outer_edges(x, counts, range_)
    return [_linspace(lo[d], hi[d], n + 1, x.dtype) for d, n in enumerate(counts)]


def _histogramdd(x, edges, weight, density):
    """Counts (or summed weights) of the rows of `x` [N, D] in the bins between `edges`: a
    value's bin is the last edge at or below it (the last bin also holds its right edge);
    values outside the outer edges are dropped. `density` divides by the total and the bin
    volumes."""
    shape = tuple(e.shape[0] - 1 for e in edges)
    flat, inside = jnp.zeros(x.shape[0], jnp.int32), jnp.ones(x.shape[0], bool)
    for d, e in enumerate(edges):
        v = x[:, d]
        pos = _binary_search(e, v, right=True) - 1
        pos = jnp.clip(jnp.where(pos == shape[d], shape[d] - 1, pos), 0, shape[d] - 1)
        inside = inside & (v >= e[0]) & (v <= e[-1])
        flat = flat * shape[d] + pos
    acc = accumulation_dtype(x.dtype)
    w = jnp.ones(x.shape[0], acc) if weight is None else weight.reshape(-1).astype(acc)
    hist = jnp.zeros(math.prod(shape), acc).at[flat].add(jnp.where(inside, w, 0))
    hist = hist.reshape(shape)
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            widths = jnp.diff(e).astype(acc)
            hist = hist / widths.reshape([-1 if i == d else 1 for i in range(len(shape))])
    return hist.astype(x.dtype)


@register_lowering(aten.histogram.bin_ct)
def histogram(x, bins=100, *, range=None, weight=None, density=False):  # noqa: A002
    edges = _bin_edges(x.reshape(-1, 1), (bins,), range)
    return _histogramdd(x.reshape(-1, 1), edges, weight, density), edges[0]


@register_lowering(aten.histogram.bins_tensor)
def histogram_bins(x, bins, *, weight=None, density=False):
    return _histogramdd(x.reshape(-1, 1), [bins], weight, density), bins


@register_lowering(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(x, bins, *, range=None, weight=None, density=False):  # noqa: A002
    return _bin_edges(x.reshape(-1, x.shape[-1]), bins, range)


@register_lowering(aten._histogramdd_from_bin_cts.default)
def histogramdd(x, bins, *, range=None, weight=None, density=False):  # noqa: A002
    rows = x.reshape(-1, x.shape[-1])
    return _histogramdd(rows, _bin_edges(rows, bins, range), weight, density)


@register_lowering(aten._histogramdd_from_bin_tensors.default)
def histogramdd_edges(x, bins, *, weight=None, density=False):
    return _histogramdd(x.reshape(-1, x.shape[-1]), list(bins), weight, density)


@register_lowering(aten.searchsorted.Tensor, aten.searchsorted.Scalar, needs_ctx=True)
def searchsorted(ctx, boundaries, x, *, out_int32=False, right=False, side=None, sorter=None):
    values = jnp.asarray(x) if not hasattr(x, "dtype") else x
    right = right or side == "right"
    return _binary_search(boundaries, values, right, sorter).astype(ctx.out_dtype)


@register_lowering(aten.bucketize.Tensor, aten.bucketize.Scalar, needs_ctx=True)
def bucketize(ctx, x, boundaries, *, out_int32=False, right=False):
    values = jnp.asarray(x) if not hasattr(x, "dtype") else x
    return _binary_search(boundaries, values, right).astype(ctx.out_dtype)


# --- batch norm with running-stat update ------------------------------------------------------


class _WithoutReserve:
    """The context of _batch_norm_with_update_functional seen as the legit functional op's
    (the same results less the empty `reserve` buffer at position 3)."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.out = tuple(ctx.out[:3]) + tuple(ctx.out[4:])

    def jax_dtype(self, dtype):
        return self._ctx.jax_dtype(dtype)


@register_lowering(aten._batch_norm_with_update_functional.default, needs_ctx=True)
def batch_norm_with_update_functional(ctx, x, weight, bias, mean, var, momentum, eps):
    out, save_mean, save_rstd, new_mean, new_var = normalization._batch_norm(
        _WithoutReserve(ctx), x, weight, bias, mean, var, True, momentum, eps
    )
    reserve = jnp.zeros(ctx.out[3].shape, ctx.jax_dtype(ctx.out[3].dtype))
    return out, save_mean, save_rstd, reserve, new_mean, new_var


# --- float decomposition ----------------------------------------------------------------------


@register_lowering(aten.frexp.Tensor, needs_ctx=True)
def frexp(ctx, x):
    """(mantissa in [0.5, 1), exponent), as std::frexp: 0, inf and NaN keep their value with
    exponent 0. float32 and bfloat16 are decoded from their bits, so subnormals are exact even
    where XLA flushes subnormal arithmetic to zero."""
    mantissa_dtype = ctx.jax_dtype(ctx.out[0].dtype)
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        mantissa, exponent = jnp.frexp(x)
        return mantissa.astype(mantissa_dtype), exponent.astype(jnp.int32)
    if x.dtype == jnp.bfloat16:
        bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    else:
        bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign, field, fraction = bits & jnp.uint32(0x80000000), (bits >> 23) & 0xFF, bits & 0x7FFFFF
    # a subnormal's leading 1 moves up to the implicit bit: `shift` places, exponent lower
    shift = jnp.where(field == 0, lax.clz(fraction).astype(jnp.int32) - 8, 0)
    fraction = jnp.where(field == 0, (fraction << shift.astype(jnp.uint32)) & 0x7FFFFF, fraction)
    exponent = jnp.where(field == 0, -125, field.astype(jnp.int32) - 126) - shift
    # 0, inf and NaN keep their bits; selecting on bits, not floats, keeps subnormals apart
    zero = (field == 0) & (fraction == 0)
    out_bits = jnp.where(zero, sign, sign | (126 << 23) | fraction)
    out_bits = jnp.where(field == 0xFF, bits, out_bits)
    mantissa = lax.bitcast_convert_type(out_bits, jnp.float32)
    exponent = jnp.where(zero | (field == 0xFF), 0, exponent)
    return mantissa.astype(mantissa_dtype), exponent.astype(jnp.int32)


@register_lowering(aten.ldexp.Tensor, needs_ctx=True)
def ldexp(ctx, x, other):
    """x * 2**other: exact scaling for integer exponents, torch's pow-and-multiply otherwise."""
    dtype = accumulation_dtype(ctx.out_dtype)
    if jnp.issubdtype(other.dtype, jnp.integer):
        return jnp.ldexp(x.astype(dtype), other.astype(jnp.int32)).astype(ctx.out_dtype)
    return (x.astype(dtype) * jnp.exp2(other.astype(dtype))).astype(ctx.out_dtype)


@register_lowering(aten.angle.default, needs_ctx=True)
def angle(ctx, x):
    """The argument of x: atan2(imag, real) for complex, pi for negative reals, else 0."""
    if jnp.iscomplexobj(x):
        return jnp.angle(x).astype(ctx.out_dtype)
    xf = x.astype(accumulation_dtype(ctx.out_dtype))
    result = jnp.where(xf < 0, jnp.pi, 0.0).astype(xf.dtype)
    if _is_float(x):
        result = jnp.where(jnp.isnan(xf), xf, result)
    return result.astype(ctx.out_dtype)
