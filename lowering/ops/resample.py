"""Pooling beyond pooling.py's 2-d kernels (3-d max/avg, adaptive max, fractional max, 3-d adaptive
avg), grid sampling and the trilinear form behind nn.Bilinear.

Max pooling indices are torch's exactly: windows are scanned in row-major order, a later
element wins when it is greater or NaN, and an all -inf window points at its first in-bounds
element. 3-d pools run pooling.py's 2-d pools over each depth offset of the window and merge them
with that same rule. 16-bit inputs are computed in float32 and cast back.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from . import common, pooling

aten = ops.aten


def _take_max(best, index, value, value_index, valid):
    """torch's max-pool scan step: `value` replaces `best` where greater or NaN (and valid)."""
    take = value > best
    if jnp.issubdtype(value.dtype, jnp.floating):
        take = take | jnp.isnan(value)
    take = take & valid
    return jnp.where(take, value, best), jnp.where(take, value_index, index)


def _lowest(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _index_dtype(ctx):
    return ctx.jax_dtype(torch.int64)


# --- adaptive max pooling ---------------------------------------------------------------------


def _adaptive_windows(size: int, out: int):
    """Positions (out, k) of torch's adaptive windows [floor(i*n/o), ceil((i+1)*n/o)) padded
    to the longest window k, and which of them lie inside their window."""
    starts = np.arange(out) * size // out
    ends = -(-(np.arange(out) + 1) * size // out)
    k = int(np.max(ends - starts))
    positions = starts[:, None] + np.arange(k)[None, :]
    return np.minimum(positions, size - 1), positions < ends[:, None]


def _adaptive_max_pool(ctx, x, output_size):
    nd = len(output_size)
    sizes = x.shape[-nd:]
    windows = [_adaptive_windows(s, int(o)) for s, o in zip(sizes, output_size)]
    strides = [math.prod(sizes[d + 1 :]) for d in range(nd)]
    best = jnp.full(x.shape[:-nd] + tuple(int(o) for o in output_size), _lowest(x.dtype), x.dtype)
    index = None
    for ks in itertools.product(*(range(pos.shape[1]) for pos, _ in windows)):
        patch, flat, valid = x, 0, True
        for d, (k, (pos, ok)) in enumerate(zip(ks, windows)):
            patch = jnp.take(patch, jnp.asarray(pos[:, k]), axis=x.ndim - nd + d)
            shape = [1] * nd
            shape[d] = -1
            flat = flat + pos[:, k].reshape(shape) * strides[d]
            valid = valid & ok[:, k].reshape(shape)
        flat = jnp.asarray(flat, _index_dtype(ctx))
        if index is None:  # torch starts at each window's first element
            index = jnp.broadcast_to(flat, best.shape)
        best, index = _take_max(best, index, patch, flat, jnp.asarray(valid))
    return best, index


@register_lowering(
    aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default, needs_ctx=True
)
def adaptive_max_pool(ctx, x, output_size):
    return _adaptive_max_pool(ctx, x, output_size)


@register_lowering(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad, x, indices):
    return pooling.max_pool_backward(grad, x, indices, 2)


@register_lowering(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad, x, indices):
    return pooling.max_pool_backward(grad, x, indices, 3)


# --- fractional max pooling --------------------------------------------------------------------


def _fractional_starts(sample, size: int, out: int, kernel: int, dtype):
    """torch's generate_intervals: window i starts at int((i + u) * a) - int(u * a), with
    a = (size - kernel) / (out - 1) in the input dtype; the last window ends at the edge."""
    if out == 1:
        return jnp.full(sample.shape + (1,), size - kernel, jnp.int32)
    alpha = jnp.asarray((size - kernel) / (out - 1), dtype)
    u = sample.astype(dtype)[..., None]
    i = jnp.arange(out - 1, dtype=dtype)
    starts = ((i + u) * alpha).astype(jnp.int32) - (u * alpha).astype(jnp.int32)
    last = jnp.full(sample.shape + (1,), size - kernel, jnp.int32)
    return jnp.concatenate([starts, last], axis=-1)


@register_lowering(
    aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default, needs_ctx=True
)
def fractional_max_pool(ctx, x, kernel_size, output_size, random_samples):
    """Max over windows of `kernel_size` starting at pseudo-random, increasing offsets (one
    sample in [0, 1) per plane and dim: 2-d takes (w, h), 3-d (t, h, w)), with torch's scan:
    a later element wins when greater or NaN; indices are flat in the plane."""
    d = len(kernel_size)
    batched = x.ndim == d + 2
    xs = x if batched else x[None]
    samples = random_samples if random_samples.ndim == 3 else random_samples[None]
    lead, spatial = xs.shape[:2], xs.shape[2:]
    order = (1, 0) if d == 2 else (0, 1, 2)  # which sample drives each spatial dim
    compute = jnp.float32 if xs.dtype in (jnp.bfloat16, jnp.float16) else xs.dtype
    windows = xs
    flat = jnp.zeros((), jnp.int32)
    for i in range(d):
        starts = _fractional_starts(
            samples[..., order[i]], spatial[i], output_size[i], kernel_size[i], compute
        )
        taps = (starts[..., None] + jnp.arange(kernel_size[i])).reshape(*lead, -1)
        shape = lead + (1,) * i + (taps.shape[-1],) + (1,) * (d - i - 1)
        taps = taps.reshape(shape)
        target = windows.shape[: 2 + i] + (taps.shape[2 + i],) + windows.shape[3 + i :]
        windows = jnp.take_along_axis(windows, jnp.broadcast_to(taps, target), axis=2 + i)
        flat = flat + taps * math.prod(spatial[i + 1 :])
    flat = jnp.broadcast_to(flat, windows.shape)
    split = lead + tuple(v for i in range(d) for v in (output_size[i], kernel_size[i]))
    perm = (0, 1) + tuple(2 + 2 * i for i in range(d)) + tuple(3 + 2 * i for i in range(d))
    shape = lead + tuple(output_size) + (-1,)
    windows, flat = (jnp.transpose(a.reshape(split), perm).reshape(shape) for a in (windows, flat))
    nan = jnp.isnan(windows)
    last_nan = windows.shape[-1] - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
    pick = jnp.where(jnp.any(nan, axis=-1), last_nan, jnp.argmax(windows, axis=-1))[..., None]
    value = jnp.take_along_axis(windows, pick, -1)[..., 0]
    index = jnp.take_along_axis(flat, pick, -1)[..., 0]
    if not batched:
        value, index = value[0], index[0]
    return value, index.astype(ctx.jax_dtype(torch.int64))


@register_lowering(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad, x, kernel_size, output_size, indices):
    return pooling.max_pool_backward(grad, x, indices, 2)


@register_lowering(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad, x, kernel_size, output_size, indices):
    return pooling.max_pool_backward(grad, x, indices, 3)


# --- 3-d pooling: 2-d pools per depth offset ----------------------------------------------------


def _depth_taps(depth, kernel, stride, padding, dilation, ceil_mode):
    """For each depth offset of the window: (clipped positions (OD,), in-bounds mask (OD,))."""
    out = pooling._pool_size(depth, kernel, stride, padding, dilation, ceil_mode)
    starts = np.arange(out) * stride - padding
    taps = []
    for k in range(kernel):
        pos = starts + k * dilation
        taps.append((np.clip(pos, 0, depth - 1), (pos >= 0) & (pos < depth)))
    return taps


def _pool3d_args(kernel, stride, padding, dilation):
    kernel = common._ntuple(kernel, 3)
    stride = common._ntuple(stride, 3) if stride else kernel
    return kernel, stride, common._ntuple(padding, 3), common._ntuple(dilation, 3)


@register_lowering(aten.max_pool3d_with_indices.default, needs_ctx=True)
def max_pool3d_with_indices(ctx, x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    kernel, stride, padding, dilation = _pool3d_args(kernel, stride, padding, dilation)
    depth, plane = x.shape[-3], x.shape[-2] * x.shape[-1]
    taps = _depth_taps(depth, kernel[0], stride[0], padding[0], dilation[0], ceil_mode)
    first = np.argmax(np.stack([ok for _, ok in taps]), axis=0)  # first in-bounds depth offset
    best = index = None
    for k, (pos, ok) in enumerate(taps):
        slab = jnp.take(x, jnp.asarray(pos), axis=x.ndim - 3)
        value, plane_index = pooling._max_pool(
            slab, kernel[1:], stride[1:], padding[1:], dilation[1:], ceil_mode
        )
        flat = plane_index.astype(_index_dtype(ctx)) + jnp.asarray(
            pos[:, None, None] * plane, _index_dtype(ctx)
        )
        is_first = jnp.asarray((first == k)[:, None, None])
        if best is None:
            best, index = value, flat
        else:
            best, index = _take_max(best, index, value, flat, jnp.asarray(ok[:, None, None]))
            best, index = jnp.where(is_first, value, best), jnp.where(is_first, flat, index)
    return best, index


@register_lowering(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(
    grad, x, kernel, stride, padding, dilation, ceil_mode, indices
):
    return pooling.max_pool_backward(grad, x, indices, 3)


def _window_counts(size, kernel, stride, padding, ceil_mode, include_pad):
    """Per output position of one dim: how many window elements torch divides by."""
    out = pooling._pool_size(size, kernel, stride, padding, 1, ceil_mode)
    start = np.arange(out) * stride - padding
    end = np.minimum(start + kernel, size + padding)
    if include_pad:
        return end - start
    return np.minimum(end, size) - np.maximum(start, 0)


def _avg_pool3d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    kernel, stride, padding, _ = _pool3d_args(kernel, stride, padding, 1)
    taps = _depth_taps(x.shape[-3], kernel[0], stride[0], padding[0], 1, ceil_mode)
    xf = common._f32(x)
    total = 0
    for pos, ok in taps:
        slab = jnp.take(xf, jnp.asarray(pos), axis=x.ndim - 3)
        window_sum = pooling._avg_pool(
            slab, kernel[1:], stride[1:], padding[1:], ceil_mode, True, 1
        )
        total = total + jnp.where(jnp.asarray(ok[:, None, None]), window_sum, 0.0)
    if divisor_override:
        divisor = np.asarray(divisor_override)
    else:
        d, h, w = (
            _window_counts(s, k, st, p, ceil_mode, count_include_pad)
            for s, k, st, p in zip(x.shape[-3:], kernel, stride, padding)
        )
        divisor = d[:, None, None] * h[None, :, None] * w[None, None, :]
    return (total / jnp.asarray(divisor, total.dtype)).astype(x.dtype)


@register_lowering(aten.avg_pool3d.default)
def avg_pool3d(
    x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor=None
):
    return _avg_pool3d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor)


@register_lowering(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor):
    def forward(x_):
        return _avg_pool3d(x_, kernel, stride, padding, ceil_mode, count_include_pad, divisor)

    return jax.vjp(forward, x)[1](grad)[0]


def _adaptive_avg_pool3d(x, output_size):
    od, oh, ow = common._ntuple(output_size, 3)
    xf = common._f32(x)
    d, h, w = (
        jnp.asarray(pooling._adaptive_matrix(size, out), xf.dtype)
        for size, out in zip(x.shape[-3:], (od, oh, ow))
    )
    out = jnp.einsum("...dhw,Dd,Hh,Ww->...DHW", xf, d, h, w, precision=lax.Precision.HIGHEST)
    return out.astype(x.dtype)


@register_lowering(aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool3d(x, output_size):
    return _adaptive_avg_pool3d(x, output_size)


@register_lowering(aten._adaptive_avg_pool3d_backward.default)
def adaptive_avg_pool3d_backward(grad, x):
    forward = lambda x_: _adaptive_avg_pool3d(x_, grad.shape[-3:])  # noqa: E731
    return jax.vjp(forward, x)[1](grad)[0]


# --- grid sampling ------------------------------------------------------------------------------

_BILINEAR, _NEAREST = 0, 1
_BORDER, _REFLECTION = 1, 2


def _reflect(coord, twice_low: int, twice_high: int):
    """torch's reflect_coordinates: fold `coord` into [twice_low/2, twice_high/2]."""
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    coord = jnp.abs(coord - low)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _source_coordinate(coord, size: int, padding_mode: int, align_corners: bool):
    """torch's grid_sampler_compute_source_index for one spatial dim."""
    if align_corners:
        coord = (coord + 1) / 2 * (size - 1)
    else:
        coord = ((coord + 1) * size - 1) / 2
    if padding_mode == _REFLECTION:
        coord = (
            _reflect(coord, 0, 2 * (size - 1))
            if align_corners
            else _reflect(coord, -1, 2 * size - 1)
        )
    if padding_mode in (_BORDER, _REFLECTION):
        coord = jnp.clip(coord, 0, size - 1)
    return coord


def _grid_sample(x, grid, mode, padding_mode, align_corners):
    nd = grid.shape[-1]
    n, c, sizes = x.shape[0], x.shape[1], x.shape[2:]
    xf, gf = common._f32(x), common._f32(grid)
    # grid's last axis lists (x, y[, z]): the spatial dims of x in reverse order
    coords = [
        _source_coordinate(gf[..., nd - 1 - d], sizes[d], padding_mode, align_corners)
        for d in range(nd)
    ]
    flat_x = xf.reshape(n, c, -1)
    strides = [math.prod(sizes[d + 1 :]) for d in range(nd)]
    out_shape = gf.shape[1:-1]

    def read(indices):
        """x at integer positions (zero outside x), shaped (N, C, *out)."""
        inside = True
        flat = 0
        for i, size, stride in zip(indices, sizes, strides):
            inside = inside & (i >= 0) & (i < size)
            flat = flat + jnp.clip(i, 0, size - 1) * stride
        values = jnp.take_along_axis(flat_x, flat.reshape(n, 1, -1), axis=2)
        values = values.reshape((n, c) + out_shape)
        return jnp.where(inside[:, None], values, 0.0)

    if mode == _NEAREST:  # std::nearbyint: round half to even
        return read([jnp.round(co).astype(jnp.int32) for co in coords]).astype(x.dtype)
    lows = [jnp.floor(co) for co in coords]
    fractions = [co - lo for co, lo in zip(coords, lows)]
    lows = [lo.astype(jnp.int32) for lo in lows]
    out = 0
    for corner in itertools.product((0, 1), repeat=nd):
        weight = 1
        for up, frac in zip(corner, fractions):
            weight = weight * (frac if up else 1 - frac)
        out = out + read([lo + up for lo, up in zip(lows, corner)]) * weight[:, None]
    return out.astype(x.dtype)


def _not_bicubic(node) -> bool:
    return node.args[2] in (_BILINEAR, _NEAREST)


@register_lowering(
    aten.grid_sampler_2d.default, aten.grid_sampler_3d.default, supports=_not_bicubic
)
def grid_sampler(x, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


# --- trilinear form (nn.functional.bilinear) ----------------------------------------------------


@register_lowering(aten._trilinear.default, needs_ctx=True)
def trilinear(ctx, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """sum over `sumdim` of i1 * i2 * i3, each first unsqueezed at its `expand` dims."""
    total = common._f32(i1).ndim + len(expand1)

    def expanded(t, expand):
        t = common._f32(t)
        for d in sorted(expand):
            t = jnp.expand_dims(t, d)
        return t

    product = expanded(i1, expand1) * expanded(i2, expand2) * expanded(i3, expand3)
    axes = tuple(d % total for d in sumdim)
    return jnp.sum(product, axis=axes).astype(ctx.out_dtype)


# --- antialiased bilinear resampling -----------------------------------------------------------


def _aa_weights(size: int, out: int, align_corners: bool, scale) -> np.ndarray:
    """[out, size] weights of torch's antialiased bilinear kernel (_compute_weights_aa): a
    triangle filter stretched by the scale when downsampling, each row normalised."""
    if align_corners:
        ratio = (size - 1) / (out - 1) if out > 1 else 0.0
    else:
        ratio = 1.0 / scale if scale else size / out
    support = ratio if ratio >= 1.0 else 1.0
    invscale = 1.0 / ratio if ratio >= 1.0 else 1.0
    weights = np.zeros((out, size), np.float64)
    for i in range(out):
        center = ratio * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), size)
        taps = np.arange(lo, hi)
        w = np.maximum(0.0, 1.0 - np.abs((taps - center + 0.5) * invscale))
        total = w.sum()
        weights[i, lo:hi] = w / total if total != 0 else w
    return weights


@register_lowering(aten._upsample_bilinear2d_aa.default)
def upsample_bilinear2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
    """Separable: the height weights, then the width weights, as matrices over the input."""
    (h, w), (oh, ow) = x.shape[-2:], output_size
    compute = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else x.dtype
    wh = jnp.asarray(_aa_weights(h, oh, align_corners, scales_h), compute)
    ww = jnp.asarray(_aa_weights(w, ow, align_corners, scales_w), compute)
    out = jnp.einsum(
        "oh,...hw,pw->...op", wh, x.astype(compute), ww, precision=lax.Precision.HIGHEST
    )
    return out.astype(x.dtype)
