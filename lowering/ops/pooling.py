"""Pooling: max, average and adaptive-average pooling, forward and backward.

Max pooling's backward reads torch's saved indices; the others are the vjp of their forward.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from .common import _f32, _ntuple
from .linalg import matmul

aten = ops.aten

# --- pooling -------------------------------------------------------------------------------


def _pool_size(size, k, s, p, d, ceil_mode) -> int:
    """torch's pooling_output_shape for one spatial dim."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_args(kernel, stride, padding, dilation):
    kernel = _ntuple(kernel, 2)
    stride = _ntuple(stride, 2) if stride else kernel
    return kernel, stride, _ntuple(padding, 2), _ntuple(dilation, 2)


def _window_positions(x, kernel, stride, padding, dilation, ceil_mode):
    """Per pooled dim: the (kernel, out) coordinates each window reads (negative or past the
    end: padding), the (low, high) zero padding that covers them, each window's first one."""
    positions, pads, starts = [], [], []
    for size, k, s, p, d in zip(x.shape[-2:], kernel, stride, padding, dilation, strict=True):
        out = _pool_size(size, k, s, p, d, ceil_mode)
        start = np.arange(out) * s - p
        positions.append(start[None, :] + np.arange(k)[:, None] * d)  # (k, out)
        pads.append((p, max(0, int(positions[-1].max()) + 1 - size)))
        starts.append(start)
    return positions, pads, starts


def _windows(x, kernel, stride, padding, dilation, ceil_mode):
    """A 2-d pooling's windows over the last two axes of x, one window element at a time.

    Returns (patches, valid, flat, starts): patches[k] is element k (row-major over the kernel)
    of every window, shaped (..., OH, OW), read from x zero-padded; valid[k] (numpy bool
    (OH, OW)) marks elements inside x; flat[k] is their index into the H*W plane; starts per
    dim holds each window's first (possibly padded) coordinate.
    """
    positions, pads, starts = _window_positions(x, kernel, stride, padding, dilation, ceil_mode)
    lead = x.ndim - 2
    xp = jnp.pad(x, [(0, 0)] * lead + pads)
    (hs, ws), (height, width) = positions, x.shape[-2:]
    patches, valid, flat = [], [], []
    for i, j in itertools.product(range(kernel[0]), range(kernel[1])):
        lo = (int(hs[i, 0]) + pads[0][0], int(ws[j, 0]) + pads[1][0])
        hi = tuple(a + (n - 1) * s + 1 for a, n, s in zip(lo, (hs.shape[1], ws.shape[1]), stride))
        patches.append(lax.slice(xp, (0,) * lead + lo, xp.shape[:lead] + hi, (1,) * lead + stride))
        inside = [(pos >= 0) & (pos < size) for pos, size in ((hs[i], height), (ws[j], width))]
        valid.append(inside[0][:, None] & inside[1][None, :])
        flat.append(hs[i][:, None] * width + ws[j][None, :])
    return patches, valid, flat, starts


def _max_pool(x, kernel, stride, padding, dilation, ceil_mode):
    """(values, indices into the H*W plane), scanning each window as torch's CPU kernel does."""
    patches, valid, flat, _ = _windows(x, *_pool_args(kernel, stride, padding, dilation), ceil_mode)
    low = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    best = jnp.full(patches[0].shape, low, x.dtype)
    first_valid = np.argmax(np.stack(valid), axis=0)  # torch starts at the first in-bounds cell
    # numpy int64 → jax int64, or int32 when the 64-bit policy narrows
    index = jnp.asarray(np.take_along_axis(np.stack(flat), first_valid[None], 0)[0])
    index = jnp.broadcast_to(index, best.shape)
    for patch, ok, idx in zip(patches, valid, flat):
        better = patch > best
        if jnp.issubdtype(x.dtype, jnp.floating):
            better = better | jnp.isnan(patch)
        take = better & ok
        best = jnp.where(take, patch, best)
        index = jnp.where(take, jnp.asarray(idx), index)
    return best, index


@register_lowering(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(x, kernel, stride, padding, dilation, ceil_mode)


def max_pool_backward(grad, x, indices, nd: int):
    """A max pool's input gradient: grad added at its saved `indices` (flat over the last `nd`
    axes of x)."""
    lead = math.prod(x.shape[:-nd])
    g = _f32(grad).reshape(lead, -1)
    rows = jnp.arange(lead)[:, None]
    out = jnp.zeros((lead, math.prod(x.shape[-nd:])), g.dtype)
    out = out.at[rows, indices.reshape(lead, -1)].add(g)
    return out.reshape(x.shape).astype(grad.dtype)


def _tiled_max_pool_backward(grad, x, indices, kernel):
    """A 2-d max pool's input gradient where the windows tile the input (stride = kernel, no
    padding or dilation): each cell takes its window's gradient where it is the window's saved
    index. One elementwise pass, where `max_pool_backward`'s scatter-add is a serial loop on
    XLA:CPU."""
    (kh, kw), (height, width) = kernel, x.shape[-2:]
    *lead, oh, ow = grad.shape
    tiled = (*lead, oh * kh, ow * kw)

    def spread(a):  # each window's value over its kh x kw cells
        return jnp.broadcast_to(a[..., :, None, :, None], (*lead, oh, kh, ow, kw)).reshape(tiled)

    cell = lax.broadcasted_iota(indices.dtype, tiled, len(tiled) - 2) * width
    cell = cell + lax.broadcasted_iota(indices.dtype, tiled, len(tiled) - 1)
    picked = jnp.where(spread(indices) == cell, spread(grad), jnp.zeros((), grad.dtype))
    # ceil_mode's last windows reach past the input; floor mode leaves its last cells out
    picked = picked[..., :height, :width]
    edges = [(0, height - picked.shape[-2]), (0, width - picked.shape[-1])]
    return jnp.pad(picked, [(0, 0)] * len(lead) + edges)


@register_lowering(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(
    grad, x, kernel, stride, padding, dilation, ceil_mode, indices
):
    kernel, stride, padding, dilation = _pool_args(kernel, stride, padding, dilation)
    if stride == kernel and padding == (0, 0) and dilation == (1, 1):
        return _tiled_max_pool_backward(grad, x, indices, kernel)
    return max_pool_backward(grad, x, indices, 2)


def _avg_pool(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """One windowed sum (reduce_window: one op whatever the kernel size, where a sum of one
    slice per kernel element took minutes to compile for a 320x320 kernel), then torch's
    divisor per window."""
    kernel, stride, padding, dilation = _pool_args(kernel, stride, padding, 1)
    positions, pads, starts = _window_positions(x, kernel, stride, padding, dilation, ceil_mode)
    lead = x.ndim - 2
    padded = jnp.pad(_f32(x), [(0, 0)] * lead + pads)
    ones = (1,) * lead
    total = lax.reduce_window(padded, 0.0, lax.add, ones + kernel, ones + stride, "VALID")
    total = total[..., : positions[0].shape[1], : positions[1].shape[1]]
    if divisor_override:
        divisor = np.asarray(divisor_override)
    elif count_include_pad:
        sizes = [
            np.minimum(start + k, size + p) - start
            for start, k, size, p in zip(starts, kernel, x.shape[-2:], padding)
        ]
        divisor = sizes[0][:, None] * sizes[1][None, :]
    else:  # the window's cells inside x: per dim, then their product
        inside = [
            ((pos >= 0) & (pos < size)).sum(axis=0) for pos, size in zip(positions, x.shape[-2:])
        ]
        divisor = inside[0][:, None] * inside[1][None, :]
    return (total / jnp.asarray(divisor, total.dtype)).astype(x.dtype)


@register_lowering(aten.avg_pool2d.default)
def avg_pool2d(
    x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor=None
):
    return _avg_pool(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor)


@register_lowering(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor):
    def forward(x_):
        return _avg_pool(x_, kernel, stride, padding, ceil_mode, count_include_pad, divisor)

    return jax.vjp(forward, x)[1](grad)[0]


def _adaptive_matrix(size: int, out: int) -> np.ndarray:
    """(out, size) averaging weights of torch's adaptive windows [floor(i*n/o), ceil((i+1)*n/o))."""
    weights = np.zeros((out, size))
    for i in range(out):
        lo, hi = (i * size) // out, -(-((i + 1) * size) // out)
        weights[i, lo:hi] = 1.0 / (hi - lo)
    return weights


def _adaptive_avg_pool(x, output_size):
    oh, ow = _ntuple(output_size, 2)
    xf = _f32(x)
    rows = jnp.asarray(_adaptive_matrix(x.shape[-2], oh), xf.dtype)
    cols = jnp.asarray(_adaptive_matrix(x.shape[-1], ow).T, xf.dtype)
    return matmul(matmul(rows, xf), cols).astype(x.dtype)


@register_lowering(aten._adaptive_avg_pool2d.default)
def adaptive_avg_pool2d(x, output_size):
    return _adaptive_avg_pool(x, output_size)


@register_lowering(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(grad, x):
    forward = lambda x_: _adaptive_avg_pool(x_, grad.shape[-2:])  # noqa: E731
    return jax.vjp(forward, x)[1](grad)[0]
