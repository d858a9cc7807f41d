"""Random ops on jax.random, keyed per node from a per-call seed drawn from torch's generator.

Successive calls differ and `torch.manual_seed` makes runs repeatable, but the numbers are not
bitwise equal to eager torch's (a different generator).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from .common import accumulation_dtype, cast

aten = ops.aten


def _standard(ctx, sampler):
    """`sampler(key, shape, dtype)` drawn in the node's accumulation dtype."""
    acc = accumulation_dtype(ctx.out_dtype)
    return sampler(ctx.rng_key(), ctx.out_shape, acc)


@register_lowering(aten.rand.default, aten.rand_like.default, needs_ctx=True, uses_rng=True)
def rand(ctx, *_args, **_kw):
    return _uniform(ctx, 0.0, 1.0)


def _uniform(ctx, low, high):
    """Samples in [low, high) of the node's dtype: drawn in the accumulation dtype and rounded
    down into it (to nearest, a 16-bit draw just below `high` would become `high`), and not
    below the first value of the dtype at or above `low` (bfloat16's 0.1 is above 0.1, so a draw
    rounded down could fall under it). Complex: real and imaginary parts each so drawn."""
    dtype = ctx.out_dtype
    if jnp.issubdtype(dtype, jnp.complexfloating):
        part = jnp.finfo(dtype).dtype
        both = jax.random.uniform(ctx.rng_key(), (*ctx.out_shape, 2), part, minval=low, maxval=high)
        return lax.complex(both[..., 0], both[..., 1])
    wide = _standard(ctx, lambda k, s, d: jax.random.uniform(k, s, d, minval=low, maxval=high))
    narrow = wide.astype(dtype)
    below = jnp.nextafter(narrow, jnp.asarray(-jnp.inf, dtype))
    narrow = jnp.where(narrow.astype(wide.dtype) > wide, below, narrow)
    lowest = jnp.asarray(low, dtype)
    lowest = jnp.where(lowest.astype(wide.dtype) < low, jnp.nextafter(lowest, high), lowest)
    return jnp.maximum(narrow, lowest.astype(dtype))


@register_lowering(aten.randn.default, aten.randn_like.default, needs_ctx=True, uses_rng=True)
def randn(ctx, *_args, **_kw):
    return _standard(ctx, jax.random.normal).astype(ctx.out_dtype)


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


# --- distributions of a tensor's shape (the functional forms of torch's in-place samplers) --------


def _open_uniform(ctx):
    """Uniform samples in the open interval (0, 1), safe for log."""
    acc = accumulation_dtype(ctx.out_dtype)
    tiny = jnp.finfo(acc).tiny
    return jax.random.uniform(ctx.rng_key(), ctx.out_shape, acc, minval=tiny, maxval=1.0)


@register_lowering(aten.uniform.default, needs_ctx=True, uses_rng=True)
def uniform(ctx, x, low=0.0, high=1.0, *, generator=None):
    return _uniform(ctx, low, high)


@register_lowering(
    aten.normal.Tensor_float,
    aten.normal.float_Tensor,
    aten.normal.Tensor_Tensor,
    aten.normal.float_float,
    needs_ctx=True,
    uses_rng=True,
)
def normal(ctx, mean, std=1.0, *_size, **_kw):
    noise = _standard(ctx, jax.random.normal)
    return (cast(mean, noise.dtype) + cast(std, noise.dtype) * noise).astype(ctx.out_dtype)


@register_lowering(aten.normal_functional.default, needs_ctx=True, uses_rng=True)
def normal_functional(ctx, x, mean=0.0, std=1.0, *, generator=None):
    return (mean + std * _standard(ctx, jax.random.normal)).astype(ctx.out_dtype)


@register_lowering(aten.log_normal.default, needs_ctx=True, uses_rng=True)
def log_normal(ctx, x, mean=1.0, std=2.0, *, generator=None):
    return jnp.exp(mean + std * _standard(ctx, jax.random.normal)).astype(ctx.out_dtype)


@register_lowering(aten.exponential.default, needs_ctx=True, uses_rng=True)
def exponential(ctx, x, lambd=1.0, *, generator=None):
    return (-jnp.log(_open_uniform(ctx)) / lambd).astype(ctx.out_dtype)


@register_lowering(aten.cauchy.default, needs_ctx=True, uses_rng=True)
def cauchy(ctx, x, median=0.0, sigma=1.0, *, generator=None):
    return (median + sigma * jnp.tan(jnp.pi * (_open_uniform(ctx) - 0.5))).astype(ctx.out_dtype)


@register_lowering(aten.geometric.default, needs_ctx=True, uses_rng=True)
def geometric(ctx, x, p, *, generator=None):
    """The number of Bernoulli(p) trials up to the first success (1, 2, ...), as torch draws it."""
    trials = jnp.ceil(jnp.log(_open_uniform(ctx)) / jnp.log1p(-p))
    return jnp.maximum(trials, 1).astype(ctx.out_dtype)


@register_lowering(aten.rrelu_with_noise_functional.default, needs_ctx=True, uses_rng=True)
def rrelu_with_noise_functional(
    ctx, x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None
):
    """(out, noise): a random slope in [lower, upper) per non-positive element when training,
    else leaky_relu with the mean slope and the noise unchanged (torch's CPU kernel)."""
    acc = accumulation_dtype(x.dtype)
    xf = x.astype(acc)
    if not training:
        slope = (lower + upper) / 2
        return jnp.where(xf > 0, xf, xf * slope).astype(x.dtype), noise
    slopes = jax.random.uniform(ctx.rng_key(), x.shape, acc, minval=lower, maxval=upper)
    slopes = jnp.where(xf <= 0, slopes, jnp.ones((), acc))
    return (xf * slopes).astype(x.dtype), slopes.astype(noise.dtype)


@register_lowering(aten.multinomial.default, needs_ctx=True, uses_rng=True)
def multinomial(ctx, probs, num_samples, replacement=False, *, generator=None):
    """Category draws from each row of (unnormalized) `probs`; without replacement by the
    Gumbel top-k trick (categories of probability 0 are never drawn)."""
    logits = jnp.log(probs.astype(jnp.float32))
    gumbel = jax.random.gumbel(
        ctx.rng_key(), logits.shape[:-1] + (num_samples,) + logits.shape[-1:]
    )
    if replacement:
        draws = jnp.argmax(logits[..., None, :] + gumbel, axis=-1)
    else:
        draws = lax.top_k(logits + gumbel[..., 0, :], int(num_samples))[1]
    return draws.astype(ctx.out_dtype)


@register_lowering(aten.randperm.default, aten.randperm.generator, needs_ctx=True, uses_rng=True)
def randperm(ctx, n, **_kw):
    return jax.random.permutation(ctx.rng_key(), int(n)).astype(ctx.out_dtype)
