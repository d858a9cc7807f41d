"""Neural-network ops: convolution, normalization, pooling, embedding, attention, losses.

Backward rules reuse their forward math through `jax.vjp` (one function per computation, no
hand-written copies) unless torch's backward reads saved statistics (normalizations and
attention's logsumexp) or saved indices (max pooling). 16-bit inputs are computed in float32
and cast back, as torch's CPU kernels do; every result's dtype is read from the node
(`ctx.out`), never guessed.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from torch._ops import ops

from ...exc import LoweringError
from ..registry import register_lowering
from .common import accumulation_dtype, outputs_unread
from .linalg import matmul

aten = ops.aten


def _results(ctx, values):
    """Each value reshaped and cast to the node's result; None where the node expects None.

    The node's metadata, not `output_mask`, decides which results exist: torch's meta
    functions sometimes promise a tensor that its eager kernel leaves out.
    """
    return tuple(
        None if val is None else v.reshape(val.shape).astype(ctx.jax_dtype(val.dtype))
        for v, val in zip(values, ctx.out)
    )


def _f32(x):
    """x in the dtype torch accumulates it in (float32 for 16-bit floats)."""
    return x.astype(accumulation_dtype(x.dtype))


# --- convolution -------------------------------------------------------------------------


def _conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    """torch's convolution (1-3 spatial dims, transposed or not) with lax.conv_general_dilated."""
    nd = w.ndim - 2
    stride, padding, dilation = (_ntuple(v, nd) for v in (stride, padding, dilation))
    spatial = "DHW"[-nd:]
    numbers = (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")
    kernel = w.shape[2:]
    if transposed:
        # (C_in, C_out/g, k...) → (C_out, C_in/g, k...) flipped: the gradient of a forward conv.
        c_in, c_out_g = w.shape[:2]
        w = w.reshape((groups, c_in // groups, c_out_g) + kernel)
        w = jnp.swapaxes(w, 1, 2).reshape((groups * c_out_g, c_in // groups) + kernel)
        w = jnp.flip(w, axis=tuple(range(2, w.ndim)))
        out_pad = _ntuple(output_padding, nd)
        pads = [
            (d * (k - 1) - p, d * (k - 1) - p + op)
            for k, p, d, op in zip(kernel, padding, dilation, out_pad)
        ]
        lhs_dilation, window_strides = stride, (1,) * nd
    else:
        pads = [(p, p) for p in padding]
        lhs_dilation, window_strides = (1,) * nd, stride
    out = lax.conv_general_dilated(
        x,
        w,
        window_strides=window_strides,
        padding=pads,
        lhs_dilation=lhs_dilation,
        rhs_dilation=dilation,
        dimension_numbers=numbers,
        feature_group_count=groups,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=accumulation_dtype(x.dtype),
    )
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((-1,) + (1,) * nd)
    return out.astype(x.dtype)


def _ntuple(value, n: int) -> tuple[int, ...]:
    values = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return tuple(values * n if len(values) == 1 else values)


@register_lowering(aten.convolution.default)
def convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    return _conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)


@register_lowering(aten.convolution_backward.default, needs_ctx=True)
def convolution_backward(
    ctx, grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask
):
    def forward(x_, w_):
        return _conv(x_, w_, None, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(forward, x, w)
    grad_x, grad_w = vjp(grad)
    axes = (0,) + tuple(range(2, grad.ndim))
    return _results(ctx, (grad_x, grad_w, jnp.sum(_f32(grad), axis=axes)))


# --- normalization -------------------------------------------------------------------------
# Layer, group and batch norm are one computation on a view of the input: normalize over
# `axes`, then scale and shift by parameters broadcast as `param_shape`.


def _moments(x, axes):
    """Mean and biased variance of x over axes, in float32, keeping the reduced axes."""
    xf = _f32(x)
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    return mean, jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)


def _norm(x, axes, eps, weight, bias, param_shape, stats=None):
    """(y, mean, rstd) in float32; `stats` = (mean, rstd) to use instead of x's own."""
    if stats is None:
        mean, var = _moments(x, axes)
        stats = mean, lax.rsqrt(var + eps)
    mean, rstd = stats
    y = (_f32(x) - mean) * rstd
    if weight is not None:
        y = y * _f32(weight).reshape(param_shape)
    if bias is not None:
        y = y + _f32(bias).reshape(param_shape)
    return y, mean, rstd


def _norm_backward(grad, x, mean, rstd, weight, axes, param_shape, stats_from_input=True):
    """Gradients of `_norm` given its saved (mean, rstd): (grad_x, grad_weight, grad_bias)."""
    g, xhat = _f32(grad), (_f32(x) - mean) * rstd
    gxhat = g * _f32(weight).reshape(param_shape) if weight is not None else g
    if stats_from_input:
        mean_g = jnp.mean(gxhat, axis=axes, keepdims=True)
        mean_gx = jnp.mean(gxhat * xhat, axis=axes, keepdims=True)
        grad_x = rstd * (gxhat - mean_g - xhat * mean_gx)
    else:
        grad_x = rstd * gxhat
    lead = (1,) * (x.ndim - len(param_shape)) + tuple(param_shape)
    outer = tuple(i for i, size in enumerate(lead) if size == 1)
    return grad_x, jnp.sum(g * xhat, axis=outer), jnp.sum(g, axis=outer)


def _layer_norm_layout(x, normalized_shape):
    k = len(normalized_shape)
    return tuple(range(x.ndim - k, x.ndim)), tuple(int(s) for s in normalized_shape)


@register_lowering(aten.native_layer_norm.default, needs_ctx=True)
def native_layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    axes, param_shape = _layer_norm_layout(x, normalized_shape)
    results = _norm(x, axes, eps, weight, bias, param_shape)
    return _results(ctx, results)


@register_lowering(aten.native_layer_norm_backward.default, needs_ctx=True)
def native_layer_norm_backward(ctx, grad, x, normalized_shape, mean, rstd, weight, bias, mask):
    axes, param_shape = _layer_norm_layout(x, normalized_shape)
    grads = _norm_backward(grad, x, _f32(mean), _f32(rstd), weight, axes, param_shape)
    return _results(ctx, grads)


def _group_view(x, n, c, groups):
    """The (N, G, C/G, HxW) view group norm normalizes over its last two axes."""
    return x.reshape(n, groups, c // groups, -1), (2, 3), (groups, c // groups, 1)


@register_lowering(aten.native_group_norm.default, needs_ctx=True)
def native_group_norm(ctx, x, weight, bias, n, c, hxw, groups, eps):
    xv, axes, param_shape = _group_view(x, n, c, groups)
    results = _norm(xv, axes, eps, weight, bias, param_shape)
    return _results(ctx, results)


@register_lowering(aten.native_group_norm_backward.default, needs_ctx=True)
def native_group_norm_backward(ctx, grad, x, mean, rstd, weight, n, c, hxw, groups, mask):
    xv, axes, param_shape = _group_view(x, n, c, groups)
    gv = grad.reshape(xv.shape)
    stat_shape = (n, groups, 1, 1)
    mean, rstd = _f32(mean).reshape(stat_shape), _f32(rstd).reshape(stat_shape)
    grads = _norm_backward(gv, xv, mean, rstd, weight, axes, param_shape)
    return _results(ctx, grads)


def _batch_layout(x):
    """Batch norm normalizes over every axis but the channels (axis 1)."""
    return (0,) + tuple(range(2, x.ndim)), (x.shape[1],) + (1,) * (x.ndim - 2)


def _batch_norm(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    """(out, save_mean, save_invstd[, new running_mean, new running_var]) as torch returns them."""
    axes, param_shape = _batch_layout(x)
    if training:
        mean, var = _moments(x, axes)
        stats = mean, lax.rsqrt(var + eps)
        results = list(_norm(x, axes, eps, weight, bias, param_shape, stats))
        if running_mean is not None:  # running stats take the unbiased batch variance
            count = math.prod(x.shape) // x.shape[1]
            unbiased = var * (count / max(count - 1, 1))
            results += [
                (1 - momentum) * _f32(running) + momentum * stat.reshape(-1)
                for running, stat in ((running_mean, mean), (running_var, unbiased))
            ]
    else:
        mean = _f32(running_mean).reshape(param_shape)
        rstd = lax.rsqrt(_f32(running_var).reshape(param_shape) + eps)
        y, _, _ = _norm(x, axes, eps, weight, bias, param_shape, stats=(mean, rstd))
        empty = jnp.zeros((0,), jnp.float32)
        results = [y, empty, empty]
        if len(ctx.out) == 5:  # the functional op returns the running stats unchanged
            results += [running_mean, running_var]
    return _results(ctx, results)


@register_lowering(aten._native_batch_norm_legit_functional.default, needs_ctx=True)
def native_batch_norm_functional(ctx, x, weight, bias, mean, var, training, momentum, eps):
    return _batch_norm(ctx, x, weight, bias, mean, var, training, momentum, eps)


@register_lowering(aten._native_batch_norm_legit_no_training.default, needs_ctx=True)
def native_batch_norm_no_training(ctx, x, weight, bias, mean, var, momentum, eps):
    return _batch_norm(ctx, x, weight, bias, mean, var, False, momentum, eps)


@register_lowering(
    aten._native_batch_norm_legit.default, aten.native_batch_norm.default, needs_ctx=True
)
def native_batch_norm_inplace(ctx, x, weight, bias, mean, var, training, momentum, eps):
    if training and mean is not None:
        raise LoweringError(
            f"{ctx.node.target} updates running_mean/running_var in place, which a lowered "
            "graph cannot do; trace through AOTAutograd (functionalized graphs use "
            "_native_batch_norm_legit_functional instead)."
        )
    return _batch_norm(ctx, x, weight, bias, mean, var, training, momentum, eps)


@register_lowering(aten._native_batch_norm_legit.no_stats, needs_ctx=True)
def native_batch_norm_no_stats(ctx, x, weight, bias, training, momentum, eps):
    return _batch_norm(ctx, x, weight, bias, None, None, True, momentum, eps)


@register_lowering(aten.native_batch_norm_backward.default, needs_ctx=True)
def native_batch_norm_backward(
    ctx, grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask
):
    axes, param_shape = _batch_layout(x)
    if train:
        mean, rstd = _f32(save_mean), _f32(save_invstd)
    else:
        mean, rstd = _f32(running_mean), lax.rsqrt(_f32(running_var) + eps)
    mean, rstd = mean.reshape(param_shape), rstd.reshape(param_shape)
    grads = _norm_backward(grad, x, mean, rstd, weight, axes, param_shape, train)
    return _results(ctx, grads)


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
    XLA:CPU (the zoo CNN's pool of 16x32x32x32: 0.66 -> 0.20 ms)."""
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


# --- embedding -------------------------------------------------------------------------------


@register_lowering(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


def _bag_supported(node) -> bool:
    """Only the bags' values are computed (offset2bag, bag sizes and max indices are not)."""
    return outputs_unread((1, 2, 3))(node)


@register_lowering(
    aten._embedding_bag_forward_only.default,
    aten._embedding_bag.default,
    needs_ctx=True,
    supports=_bag_supported,
)
def embedding_bag(
    ctx,
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    """Bags of embedding rows, summed (mode 0, weighted by `per_sample_weights`), averaged (1)
    or maxed (2): bag b holds indices offsets[b] up to the next offset (the last bag to the end,
    or to the last offset with `include_last_offset`); rows at `padding_idx` are left out, and
    an empty bag is zeros. The other three results are placeholders (see `_bag_supported`)."""
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    n = indices.shape[0]
    position = jnp.arange(n)
    bag = jnp.sum(offsets[None, :bags] <= position[:, None], axis=1) - 1  # last start <= j
    valid = bag >= 0
    if include_last_offset:
        valid = valid & (position < offsets[bags])
    if padding_idx is not None and padding_idx >= 0:
        valid = valid & (indices != padding_idx)
    acc = accumulation_dtype(weight.dtype)
    rows = jnp.take(weight, indices, axis=0).astype(acc)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.astype(acc)[:, None]
    bag = jnp.where(valid, bag, bags)  # dropped rows land in an extra bag
    count = jnp.zeros(bags + 1, acc).at[bag].add(1)[:bags, None]
    if mode == 2:
        out = jnp.full((bags + 1, weight.shape[1]), -jnp.inf, acc).at[bag].max(rows)[:bags]
        out = jnp.where(count > 0, out, 0)
    else:
        out = jnp.zeros((bags + 1, weight.shape[1]), acc).at[bag].add(rows)[:bags]
        if mode == 1:
            out = out / jnp.maximum(count, 1)
    placeholders = [jnp.zeros(v.shape, ctx.jax_dtype(v.dtype)) for v in ctx.out[1:]]
    return (out.astype(ctx.out_dtype), *placeholders)


@register_lowering(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = indices.reshape(-1)
    g = _f32(grad).reshape(idx.shape[0], -1)
    if padding_idx >= 0:
        g = jnp.where((idx == padding_idx)[:, None], jnp.zeros((), g.dtype), g)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1)
        g = g / counts[idx][:, None]
    out = jnp.zeros((num_weights, g.shape[1]), g.dtype).at[idx].add(g)
    return out.astype(grad.dtype)


# --- attention -------------------------------------------------------------------------------


def _attention(q, k, v, is_causal, attn_mask, scale):
    """Softmax attention in float32: (output, logsumexp over keys).

    A fully masked row gives output 0 and logsumexp 0, as torch's CPU kernel does, and no
    gradient. Fewer key/value heads than query heads (grouped-query attention) serve
    consecutive groups of query heads.
    """
    scores = _scores(q, _heads_of(q, k), is_causal, attn_mask, scale)
    top = jnp.max(scores, axis=-1, keepdims=True)
    top = jnp.where(jnp.isneginf(top), 0.0, top)
    weights = jnp.exp(scores - top)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    empty = total == 0
    total = jnp.where(empty, 1.0, total)
    lse = jnp.where(empty, 0.0, top + jnp.log(total))[..., 0]
    return matmul(weights / total, _f32(_heads_of(q, v))).astype(q.dtype), lse


def _attention_backward(grad, q, k, v, out, lse, is_causal, attn_mask, scale):
    """Gradients of `_attention`'s output for q, k, v, from its saved output and logsumexp.

    The weights come back as exp(scores - logsumexp): one scores dot again, no softmax
    reductions (what a flash-attention backward does).
    """
    keys, values = _heads_of(q, k), _heads_of(q, v)
    weights = jnp.exp(_scores(q, keys, is_causal, attn_mask, scale) - _f32(lse)[..., None])
    g = _f32(grad)
    d_weights = matmul(g, jnp.swapaxes(_f32(values), -1, -2))
    row = jnp.sum(g * _f32(out), axis=-1, keepdims=True)
    d_scores = weights * (d_weights - row) * _scale(q, scale)
    dq = matmul(d_scores, _f32(keys))
    dk = matmul(jnp.swapaxes(d_scores, -1, -2), _f32(q))
    dv = matmul(jnp.swapaxes(weights, -1, -2), g)
    return dq, _sum_over_groups(dk, k), _sum_over_groups(dv, v)


def _scale(q, scale):
    return 1 / math.sqrt(q.shape[-1]) if scale is None else scale


def _scores(q, keys, is_causal, attn_mask, scale):
    """Scaled, masked scores q·k in float32; -inf where masked out."""
    scores = matmul(_f32(q), jnp.swapaxes(_f32(keys), -1, -2)) * _scale(q, scale)
    if is_causal:
        length, count = scores.shape[-2:]
        scores = jnp.where(jnp.tril(jnp.ones((length, count), bool)), scores, -jnp.inf)
    if attn_mask is not None:
        scores = scores + _f32(attn_mask)  # torch's kernel takes float masks only
    return scores


def _heads_of(q, t):
    """Key or value heads `t` repeated to q's head count (grouped-query attention)."""
    groups = q.shape[-3] // t.shape[-3]
    return jnp.repeat(t, groups, axis=-3) if groups > 1 else t


def _sum_over_groups(grad, t):
    """The gradient of `_heads_of(q, t)` for t: each head's group of copies summed."""
    heads = t.shape[-3]
    if grad.shape[-3] == heads:
        return grad
    shape = (*grad.shape[:-3], heads, grad.shape[-3] // heads, *grad.shape[-2:])
    return jnp.sum(grad.reshape(shape), axis=-3)


def _no_dropout(op, dropout_p):
    if dropout_p:
        raise LoweringError(
            f"{op}: dropout_p={dropout_p} is not supported (torch's CPU kernel "
            "does not support it either); use the math attention path."
        )


@register_lowering(aten._scaled_dot_product_flash_attention_for_cpu.default, needs_ctx=True)
def flash_attention_for_cpu(
    ctx, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None
):
    _no_dropout(ctx.node.target, dropout_p)
    out, lse = _attention(q, k, v, is_causal, attn_mask, scale)
    return _results(ctx, (out, lse))


@register_lowering(
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default, needs_ctx=True
)
def flash_attention_for_cpu_backward(
    ctx, grad, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    _no_dropout(ctx.node.target, dropout_p)
    grads = _attention_backward(grad, q, k, v, out, lse, is_causal, attn_mask, scale)
    return _results(ctx, grads)


# --- losses ----------------------------------------------------------------------------------


def _nll(x, target, weight, reduction, ignore_index):
    """(loss, total_weight) of torch's nll_loss; the class axis is 1 (0 for unbatched input)."""
    axis = 1 if x.ndim >= 2 else 0
    keep = target != ignore_index
    safe = jnp.where(keep, target, 0)
    picked = jnp.squeeze(jnp.take_along_axis(x, jnp.expand_dims(safe, axis), axis), axis)
    w = jnp.ones(safe.shape, x.dtype) if weight is None else jnp.take(weight, safe)
    w = jnp.where(keep, w, jnp.zeros((), x.dtype))
    losses = -picked * w
    total = jnp.sum(w)
    if reduction == 0:  # none: torch reports a zero total weight
        return losses, jnp.zeros((), x.dtype)
    loss = jnp.sum(losses)
    return (loss / total if reduction == 1 else loss), total


@register_lowering(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    return _nll(x, target, weight, reduction, ignore_index)


@register_lowering(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    """torch's kernel: -weight * grad (over the total weight for a mean) at each target's
    class; 0 elsewhere and for ignored targets, also when every target is ignored (the vjp
    of the mean was 0/0 = NaN there)."""
    axis = 1 if x.ndim >= 2 else 0
    keep = target != ignore_index
    safe = jnp.where(keep, target, 0)
    w = jnp.ones(safe.shape, x.dtype) if weight is None else jnp.take(weight, safe)
    g = grad.astype(x.dtype)
    if reduction == 1:
        g = g / total_weight.astype(x.dtype)
    value = jnp.where(keep, -w.astype(x.dtype) * g, jnp.zeros((), x.dtype))
    hit = jnp.expand_dims(safe, axis) == lax.broadcasted_iota(safe.dtype, x.shape, axis)
    return jnp.where(hit, jnp.expand_dims(value, axis), jnp.zeros((), x.dtype))


def _multilabel_margin(x, target, reduction):
    """(loss, is_target) of torch's multilabel_margin_loss: a row's target classes are its
    entries before the first -1; each pairs with every non-target class."""
    xf, classes = _f32(x), x.shape[-1]
    valid = jnp.cumsum(target == -1, axis=-1) == 0
    safe = jnp.where(valid, target, 0)
    is_target = jnp.any(valid[..., None] & (safe[..., None] == jnp.arange(classes)), axis=-2)
    picked = jnp.take_along_axis(xf, safe, axis=-1)
    margin = 1 - picked[..., :, None] + xf[..., None, :]  # (..., target j, class i)
    margin = jnp.where(valid[..., :, None] & ~is_target[..., None, :] & (margin > 0), margin, 0)
    losses = jnp.sum(margin, axis=(-2, -1)) / classes
    loss = losses if reduction == 0 else jnp.mean(losses) if reduction == 1 else jnp.sum(losses)
    return loss.astype(x.dtype), is_target.astype(x.dtype)


@register_lowering(aten.multilabel_margin_loss_forward.default, needs_ctx=True)
def multilabel_margin_loss_forward(ctx, x, target, reduction):
    # shaped as torch's meta says: (1,), not the kernel's (), for a 1-d input left unreduced
    return _results(ctx, _multilabel_margin(x, target, reduction))


@register_lowering(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad, x, target, reduction, is_target):
    forward = lambda x_: _multilabel_margin(x_, target, reduction)[0]  # noqa: E731
    loss, vjp = jax.vjp(forward, x)
    return vjp(grad.reshape(loss.shape).astype(loss.dtype))[0]


@register_lowering(aten._weight_norm_interface_backward.default)
def weight_norm_interface_backward(grad_w, v, g, norms, dim):
    """Gradients of w = v * g / ||v|| (the norm over every dim but `dim`; -1: over all), as the
    vjp of that forward in the accumulation dtype. (The forward is decomposed by torch.)"""
    axes = tuple(i for i in range(v.ndim) if i != dim)

    def forward(v_, g_):
        return v_ * (g_ / jnp.sqrt(jnp.sum(v_ * v_, axis=axes, keepdims=True)))

    grad_v, grad_g = jax.vjp(forward, _f32(v), _f32(g))[1](_f32(grad_w))
    return grad_v.astype(v.dtype), grad_g.astype(g.dtype)
