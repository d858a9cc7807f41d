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


@register_lowering(
    aten.hash_tensor.default, needs_ctx=True, supports=lambda n: n.kwargs.get("mode", 0) == 0
)
def hash_tensor(ctx, x, dim=(), *, keepdim=False, mode=0):
    """torch.hash_tensor's xor-sum (mode 0): floats as their float64 bits, integers as uint64."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        bits = jax.lax.bitcast_convert_type(x.astype(jnp.float64), jnp.uint64)
    else:
        bits = x.astype(jnp.uint64)
    axes = _axes(x, dim)
    zero = jnp.zeros((), jnp.uint64)
    out = jax.lax.reduce(bits, zero, jax.lax.bitwise_xor, axes) if axes else bits
    if keepdim:
        out = jnp.expand_dims(out, axes)
    return out.reshape(ctx.out_shape).astype(ctx.out_dtype)


def _segment_supported(node) -> bool:
    """Segments given by lengths or offsets (not indices); a mean with an initial value."""
    kw = node.kwargs
    if kw.get("indices") is not None or (kw.get("lengths") is None) == (kw.get("offsets") is None):
        return False
    return node.args[1] != "mean" or kw.get("initial") is not None


_SEGMENT = {  # reduce -> (jnp reduction, identity, combine with the initial value)
    "sum": (jnp.sum, 0.0, jnp.add),
    "mean": (jnp.sum, 0.0, jnp.add),
    "prod": (jnp.prod, 1.0, jnp.multiply),
    "max": (jnp.max, -jnp.inf, jnp.maximum),
    "min": (jnp.min, jnp.inf, jnp.minimum),
}


@register_lowering(aten.segment_reduce.default, needs_ctx=True, supports=_segment_supported)
def segment_reduce(
    ctx,
    data,
    reduce,
    *,
    lengths=None,
    indices=None,
    offsets=None,
    axis=0,
    unsafe=False,
    initial=None,
):
    """torch's segment_reduce: `data`'s dim `axis` cut into consecutive segments (lengths, or
    offsets: their cumulative sums with a leading 0, over the dims before `axis`), each reduced
    from `initial` (the reduction's identity if none); a mean divides by a nonempty length."""
    axis = dim(axis, data.ndim)
    if lengths is None:
        lengths = jnp.diff(offsets, axis=-1)
    ends = jnp.cumsum(lengths, axis=-1)
    starts = ends - lengths
    position = jnp.arange(data.shape[axis])
    member = (starts[..., None] <= position) & (position < ends[..., None])  # [..., S, L]
    acc = accumulation_dtype(data.dtype)
    values = jnp.expand_dims(data.astype(acc), axis)  # [..., 1, L, ...]
    member = member.reshape(member.shape + (1,) * (data.ndim - axis - 1))
    fn, identity, combine = _SEGMENT[reduce]
    out = fn(jnp.where(member, values, jnp.asarray(identity, acc)), axis=axis + 1)
    if initial is not None:
        out = combine(out, jnp.asarray(initial, acc))
    if reduce == "mean":
        count = lengths.reshape(lengths.shape + (1,) * (data.ndim - axis - 1)).astype(acc)
        out = jnp.where(count > 0, out / jnp.maximum(count, 1), out)
    return out.astype(ctx.out_dtype)
