"""Lowering of `tpu_inductor::attention` and its backward (tpu_inductor/attention_op.py).

The computation is the SDPA rules' (`nn._attention`, `nn._attention_backward`: float32 scores,
softmax by logsumexp, grouped-query heads read without repeating them); this module only turns
the op's mask forms into theirs: a bool mask becomes a 0 / -inf bias, a causal diagonal other
than 0 (a decode step) a -inf bias above that diagonal.
"""

from __future__ import annotations

import jax.numpy as jnp

from tpu_inductor.attention_op import ops as ours

from ..registry import register_lowering
from .nn import _attention, _attention_backward, _results


def _bias(q, k, mask, causal_diagonal):
    """(is_causal, additive float bias or None) for `nn._attention`."""
    bias = None
    if mask is not None:
        bias = jnp.where(mask, 0.0, -jnp.inf) if mask.dtype == jnp.bool_ else mask
    if causal_diagonal in (None, 0):
        return causal_diagonal == 0, bias
    length, count = q.shape[-2], k.shape[-2]
    causal = jnp.where(jnp.tri(length, count, causal_diagonal, dtype=bool), 0.0, -jnp.inf)
    return False, causal if bias is None else bias + causal


@register_lowering(ours.attention.default, needs_ctx=True)
def attention(ctx, q, k, v, mask, scale, causal_diagonal=None, empty_rows_nan=False):
    is_causal, bias = _bias(q, k, mask, causal_diagonal)
    out, lse = _attention(q, k, v, is_causal, bias, scale)
    if empty_rows_nan and bias is not None:
        # a written-out softmax over a row of -inf scores: NaN, where the kernels give 0
        empty = jnp.all(jnp.isneginf(jnp.broadcast_to(bias, (*q.shape[:-1], k.shape[-2]))), -1)
        out = jnp.where(empty[..., None], jnp.nan, out)
    return _results(ctx, (out, lse))


@register_lowering(ours.attention_backward.default, needs_ctx=True)
def attention_backward(ctx, grad, q, k, v, out, lse, mask, scale, causal_diagonal=None):
    is_causal, bias = _bias(q, k, mask, causal_diagonal)
    return _results(ctx, _attention_backward(grad, q, k, v, out, lse, is_causal, bias, scale))
