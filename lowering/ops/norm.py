"""Lowering of `tpu_inductor::norm` (tpu_inductor/ops/norm.py): a written-out RMSNorm or
LayerNorm as one rule.

The statistics are accumulated in float32 for bfloat16/float16 inputs (the dtype torch's own
reductions accumulate in, `accumulation_dtype`), as Hugging Face's explicit `.to(float32)`
does; h is rounded to `normed_dtype` once, before the weight and bias, in their dtypes.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tpu_inductor.ops.norm import ops as ours

from ..registry import register_lowering
from .common import _results, accumulation_dtype


@register_lowering(ours.norm.default, needs_ctx=True)
def norm(ctx, x, weight, bias, eps, centered, divide, normed_dtype):
    xa = x.astype(accumulation_dtype(x.dtype))
    if centered:
        mean = jnp.mean(xa, axis=-1, keepdims=True)
        xa = xa - mean
    else:
        mean = jnp.zeros((*x.shape[:-1], 1), xa.dtype)
    var = jnp.mean(xa * xa, axis=-1, keepdims=True) + eps.astype(xa.dtype)
    scale = jnp.sqrt(var) if divide else lax.rsqrt(var)
    h = (xa / scale if divide else xa * scale).astype(ctx.jax_dtype(normed_dtype))
    out = h if weight is None else h * weight
    return _results(ctx, (out if bias is None else out + bias, mean, scale))
