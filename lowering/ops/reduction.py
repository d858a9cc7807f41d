"""Reductions: sum, mean, max/min (with indices), var, any/all, softmax family, cumsum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from torch._ops import ops

from ..registry import register_lowering
from .common import accumulation_dtype, cast, dim, dims

aten = ops.aten


def _axes(x, dim_arg):
    return dims(dim_arg, x.ndim) if x.ndim else ()


@register_lowering(aten.sum.dim_IntList, aten.sum.default, needs_ctx=True)
def sum_(ctx, x, dim=None, keepdim=False, *, dtype=None):
    acc = accumulation_dtype(ctx.out_dtype)
    return jnp.sum(cast(x, acc), axis=_axes(x, dim), keepdims=keepdim).astype(ctx.out_dtype)


@register_lowering(aten.mean.dim, aten.mean.default, needs_ctx=True)
def mean(ctx, x, dim=None, keepdim=False, *, dtype=None):
    acc = accumulation_dtype(ctx.out_dtype)
    return jnp.mean(cast(x, acc), axis=_axes(x, dim), keepdims=keepdim).astype(ctx.out_dtype)


@register_lowering(aten.prod.default, aten.prod.dim_int, needs_ctx=True)
def prod(ctx, x, dim=None, keepdim=False, *, dtype=None):
    acc = accumulation_dtype(ctx.out_dtype)
    return jnp.prod(cast(x, acc), axis=_axes(x, dim), keepdims=keepdim).astype(ctx.out_dtype)


@register_lowering(aten.amax)
def amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=_axes(x, dim), keepdims=keepdim)


@register_lowering(aten.amin)
def amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=_axes(x, dim), keepdims=keepdim)


@register_lowering(aten.max.default)
def max_(x):
    return jnp.max(x)


@register_lowering(aten.min.default)
def min_(x):
    return jnp.min(x)


def _index_reduce(x, d, keepdim, arg_fn, value_fn):
    axis = dim(d, x.ndim) if x.ndim else None
    if axis is None:
        return x, jnp.zeros((), jnp.int64)
    indices = arg_fn(x, axis=axis, keepdims=keepdim).astype(jnp.int64)
    return value_fn(x, axis=axis, keepdims=keepdim), indices


@register_lowering(aten.max.dim)
def max_dim(x, dim, keepdim=False):
    return _index_reduce(x, dim, keepdim, jnp.argmax, jnp.max)


@register_lowering(aten.min.dim)
def min_dim(x, dim, keepdim=False):
    return _index_reduce(x, dim, keepdim, jnp.argmin, jnp.min)


@register_lowering(aten.argmax, needs_ctx=True)
def argmax(ctx, x, dim=None, keepdim=False):
    if dim is None:
        return (
            jnp.argmax(x.reshape(-1))
            .astype(ctx.out_dtype)
            .reshape((1,) * x.ndim if keepdim else ())
        )
    return jnp.argmax(x, axis=_axes(x, dim)[0] if x.ndim else None, keepdims=keepdim).astype(
        ctx.out_dtype
    )


@register_lowering(aten.argmin, needs_ctx=True)
def argmin(ctx, x, dim=None, keepdim=False):
    if dim is None:
        return (
            jnp.argmin(x.reshape(-1))
            .astype(ctx.out_dtype)
            .reshape((1,) * x.ndim if keepdim else ())
        )
    return jnp.argmin(x, axis=_axes(x, dim)[0] if x.ndim else None, keepdims=keepdim).astype(
        ctx.out_dtype
    )


@register_lowering(aten.any.default, aten.any.dim, aten.any.dims)
def any_(x, dim=None, keepdim=False):
    return jnp.any(x, axis=_axes(x, dim), keepdims=keepdim)


@register_lowering(aten.all.default, aten.all.dim, aten.all.dims)
def all_(x, dim=None, keepdim=False):
    return jnp.all(x, axis=_axes(x, dim), keepdims=keepdim)


def _correction(correction, unbiased=None):
    if correction is None:
        return 1 if unbiased is None or unbiased else 0
    return correction


@register_lowering(aten.var.correction, needs_ctx=True)
def var(ctx, x, dim=None, *, correction=None, keepdim=False):
    acc = accumulation_dtype(ctx.out_dtype)
    out = jnp.var(cast(x, acc), axis=_axes(x, dim), ddof=_correction(correction), keepdims=keepdim)
    return out.astype(ctx.out_dtype)


@register_lowering(aten.var_mean.correction, needs_ctx=True)
def var_mean(ctx, x, dim=None, *, correction=None, keepdim=False):
    acc = accumulation_dtype(ctx.out_dtype)
    xs, axes = cast(x, acc), _axes(x, dim)
    v = jnp.var(xs, axis=axes, ddof=_correction(correction), keepdims=keepdim)
    m = jnp.mean(xs, axis=axes, keepdims=keepdim)
    return v.astype(ctx.out_dtype), m.astype(ctx.out_dtype)


@register_lowering(aten.std.correction, needs_ctx=True)
def std(ctx, x, dim=None, *, correction=None, keepdim=False):
    acc = accumulation_dtype(ctx.out_dtype)
    out = jnp.std(cast(x, acc), axis=_axes(x, dim), ddof=_correction(correction), keepdims=keepdim)
    return out.astype(ctx.out_dtype)


@register_lowering(aten.logsumexp, needs_ctx=True)
def logsumexp(ctx, x, dim=(), keepdim=False):
    acc = accumulation_dtype(ctx.out_dtype)
    out = jax.nn.logsumexp(cast(x, acc), axis=_axes(x, dim), keepdims=keepdim)
    return out.astype(ctx.out_dtype)


@register_lowering(aten._softmax, needs_ctx=True)
def softmax(ctx, x, dim, half_to_float):
    acc = accumulation_dtype(x.dtype)
    return jax.nn.softmax(cast(x, acc), axis=_axes(x, dim)).astype(ctx.out_dtype)


@register_lowering(aten._log_softmax, needs_ctx=True)
def log_softmax(ctx, x, dim, half_to_float):
    acc = accumulation_dtype(x.dtype)
    return jax.nn.log_softmax(cast(x, acc), axis=_axes(x, dim)).astype(ctx.out_dtype)


@register_lowering(aten._softmax_backward_data, needs_ctx=True)
def softmax_backward(ctx, grad, y, dim, input_dtype):
    axes = _axes(y, dim)
    acc = accumulation_dtype(y.dtype)
    g, yy = grad.astype(acc), y.astype(acc)
    out = yy * (g - jnp.sum(g * yy, axis=axes, keepdims=True))
    return out.astype(ctx.out_dtype)


@register_lowering(aten._log_softmax_backward_data, needs_ctx=True)
def log_softmax_backward(ctx, grad, y, dim, input_dtype):
    axes = _axes(y, dim)
    acc = accumulation_dtype(y.dtype)
    g, yy = grad.astype(acc), y.astype(acc)
    out = g - jnp.exp(yy) * jnp.sum(g, axis=axes, keepdims=True)
    return out.astype(ctx.out_dtype)


@register_lowering(aten.cumsum, needs_ctx=True)
def cumsum(ctx, x, dim, *, dtype=None):
    acc = accumulation_dtype(ctx.out_dtype)
    return jnp.cumsum(cast(x, acc), axis=dim_axis(x, dim)).reshape(x.shape).astype(ctx.out_dtype)


@register_lowering(aten.cumprod, needs_ctx=True)
def cumprod(ctx, x, dim, *, dtype=None):
    acc = accumulation_dtype(ctx.out_dtype)
    return jnp.cumprod(cast(x, acc), axis=dim_axis(x, dim)).reshape(x.shape).astype(ctx.out_dtype)


def dim_axis(x, d):
    return dim(d, x.ndim) if x.ndim else None
