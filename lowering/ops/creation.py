"""Tensor creation: full/zeros/ones/empty (and *_like, new_*), arange, scalar_tensor, fill,
tril_indices/triu_indices."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from torch._ops import ops

from ..registry import register_lowering
from .common import takes_traced_scalars

aten = ops.aten

_IGNORED = ("dtype", "layout", "device", "pin_memory", "memory_format", "requires_grad")


def _full(ctx, value):
    return jnp.full(ctx.out_shape, value, dtype=ctx.out_dtype)


@register_lowering(aten.full.default, needs_ctx=True)
@takes_traced_scalars
def full(ctx, size, fill_value, **_kw):
    return _full(ctx, fill_value)


@register_lowering(aten.full_like.default, needs_ctx=True)
@takes_traced_scalars
def full_like(ctx, x, fill_value, *args, **_kw):
    return _full(ctx, fill_value)


@register_lowering(aten.new_full.default, needs_ctx=True)
@takes_traced_scalars
def new_full(ctx, x, size, fill_value, **_kw):
    return _full(ctx, fill_value)


@register_lowering(
    aten.zeros.default,
    aten.zeros_like.default,
    aten.new_zeros.default,
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.empty_strided.default,
    aten.new_empty_strided.default,
    needs_ctx=True,
)
def zeros(ctx, *_args, **_kw):
    # empty* are zeros: their contents are unspecified, and deterministic is better.
    return _full(ctx, 0)


@register_lowering(aten.ones.default, aten.ones_like.default, aten.new_ones.default, needs_ctx=True)
def ones(ctx, *_args, **_kw):
    return _full(ctx, 1)


@register_lowering(aten.scalar_tensor.default, ops.prims.scalar_tensor.default, needs_ctx=True)
@takes_traced_scalars
def scalar_tensor(ctx, value, **_kw):
    return jnp.asarray(value, dtype=ctx.out_dtype)


@register_lowering(aten.fill.Scalar, aten.fill.Tensor, needs_ctx=True)
@takes_traced_scalars
def fill(ctx, x, value):
    return jnp.full(x.shape, jnp.asarray(value).astype(ctx.out_dtype), dtype=ctx.out_dtype)


@register_lowering(aten.zero.default, needs_ctx=True)
def zero(ctx, x):
    return jnp.zeros(x.shape, ctx.out_dtype)


@register_lowering(aten.arange.default, aten.arange.start, aten.arange.start_step, needs_ctx=True)
def arange(ctx, *args, **_kw):
    numbers = [a for a in args if isinstance(a, (int, float))]
    start, end, step = (0, numbers[0], 1) if len(numbers) == 1 else (*numbers, 1)[:3]
    n = ctx.out_shape[0]
    return (
        start
        + jnp.arange(
            n,
            dtype=jnp.float64 if isinstance(step, float) or isinstance(start, float) else jnp.int64,
        )
        * step
    ).astype(ctx.out_dtype)


@register_lowering(aten.empty_permuted.default, needs_ctx=True)
def empty_permuted(ctx, size, physical_layout, **_kw):
    return _full(ctx, 0)


@register_lowering(aten.tril_indices.default, needs_ctx=True)
def tril_indices(ctx, row, col, offset=0, **_kw):
    return jnp.asarray(np.stack(np.tril_indices(row, offset, col)), ctx.out_dtype)


@register_lowering(aten.triu_indices.default, needs_ctx=True)
def triu_indices(ctx, row, col, offset=0, **_kw):
    return jnp.asarray(np.stack(np.triu_indices(row, offset, col)), ctx.out_dtype)
