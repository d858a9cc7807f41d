"""aten's native layer, group and batch norm, forward and backward, and weight norm's backward.

The backward rules read torch's saved statistics (mean, rstd) instead of recomputing them. 16-bit inputs are computed in float32 and cast back, as torch's CPU kernels do; every result's dtype is read from the node
(`ctx.out`), never guessed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from torch._ops import ops

from ...exc import LoweringError
from ..registry import register_lowering
from .common import _f32, _results

aten = ops.aten

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


@register_lowering(aten._weight_norm_interface_backward.default)
def weight_norm_interface_backward(grad_w, v, g, norms, dim):
    """Gradients of w = v * g / ||v|| (the norm over every dim but `dim`; -1: over all), as the
    vjp of that forward in the accumulation dtype. (The forward is decomposed by torch.)"""
    axes = tuple(i for i in range(v.ndim) if i != dim)

    def forward(v_, g_):
        return v_ * (g_ / jnp.sqrt(jnp.sum(v_ * v_, axis=axes, keepdims=True)))

    grad_v, grad_g = jax.vjp(forward, _f32(v), _f32(g))[1](_f32(grad_w))
    return grad_v.astype(v.dtype), grad_g.astype(g.dtype)
