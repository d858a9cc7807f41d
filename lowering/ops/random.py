"""Random ops on jax.random, keyed per node from a per-call seed drawn from torch's generator.

Successive calls differ and `torch.manual_seed` makes runs repeatable, but the numbers are not
bitwise equal to eager torch's (a different generator).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from torch._ops import ops

from ..registry import register_lowering
from .common import accumulation_dtype

aten = ops.aten


def _uniform(ctx, shape, dtype):
    acc = accumulation_dtype(dtype)
    return jax.random.uniform(ctx.rng_key(), shape, dtype=acc).astype(dtype)


@register_lowering(aten.rand.default, aten.rand_like.default, needs_ctx=True, uses_rng=True)
def rand(ctx, *_args, **_kw):
    return _uniform(ctx, ctx.out_shape, ctx.out_dtype)


@register_lowering(aten.randn.default, aten.randn_like.default, needs_ctx=True, uses_rng=True)
def randn(ctx, *_args, **_kw):
    acc = accumulation_dtype(ctx.out_dtype)
    return jax.random.normal(ctx.rng_key(), ctx.out_shape, dtype=acc).astype(ctx.out_dtype)


@register_lowering(
    aten.randint.default,
    aten.randint.low,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
    needs_ctx=True,
    uses_rng=True,
)
def randint(ctx, *args, **_kw):
    bounds = [a for a in args if isinstance(a, int)]
    low, high = (0, bounds[0]) if len(bounds) == 1 else bounds[:2]
    values = jax.random.randint(ctx.rng_key(), ctx.out_shape, low, high, dtype=jnp.int64)
    return values.astype(ctx.out_dtype)


@register_lowering(aten.bernoulli.default, aten.bernoulli.p, needs_ctx=True, uses_rng=True)
def bernoulli(ctx, x, p=None, *, generator=None):
    prob = x if p is None else p
    keep = jax.random.uniform(ctx.rng_key(), x.shape, dtype=jnp.float32) < prob
    return keep.astype(ctx.out_dtype)


@register_lowering(aten.native_dropout.default, needs_ctx=True, uses_rng=True)
def native_dropout(ctx, x, p, train):
    if train is False or p == 0:
        return x, jnp.ones(x.shape, jnp.bool_)
    keep = jax.random.uniform(ctx.rng_key(), x.shape, dtype=jnp.float32) >= p
    scale = jnp.asarray(1.0 / (1.0 - p), x.dtype) if p < 1 else jnp.zeros((), x.dtype)
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype)), keep


@register_lowering(aten.native_dropout_backward.default)
def native_dropout_backward(grad, mask, scale):
    return jnp.where(mask, grad * jnp.asarray(scale, grad.dtype), jnp.zeros((), grad.dtype))
