"""Lowering of `tpu_inductor::attention` and its backward (tpu_inductor/ops/attention.py).

The computation is the SDPA rules' (`sdpa._attention`, `sdpa._attention_backward`: float32 scores,
softmax by logsumexp, grouped-query heads read without repeating them); this module only turns
the op's mask forms into theirs: a bool mask becomes a 0 / -inf bias, a causal diagonal other
than 0 (a decode step) a -inf bias above that diagonal, a window one below it too; and grouped-query attention (fewer K/V
heads) is computed with q's heads folded into K/V's (`_grouped`), so the repeated K/V the SDPA
rules build are never materialized.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from tpu_inductor.ops.attention import ops as ours

from ..registry import register_lowering
from .common import _results, accumulation_dtype
from .sdpa import _attention, _attention_backward


def _bias(q, k, mask, causal_diagonal, window=None):
    """(is_causal, additive float bias or None) for `sdpa._attention`. A bias made from a bool
    mask, a diagonal or a window is in the scores' dtype (under x64 a where of Python floats is float64,
    which made every score float64: twice the temporaries, half the speed)."""
    bias = None
    if mask is not None:
        bias = _keep_bias(mask, q.dtype) if mask.dtype == jnp.bool_ else mask
    if causal_diagonal in (None, 0) and window is None and _groups(q, k) == 1:
        return causal_diagonal == 0, bias
    if causal_diagonal is None:
        return False, bias
    length, count = q.shape[-2], k.shape[-2]
    keep = jnp.tri(length, count, causal_diagonal, dtype=bool)
    if window is not None:
        keep &= ~jnp.tri(length, count, causal_diagonal - window, dtype=bool)
    causal = _keep_bias(keep, q.dtype)
    return False, causal if bias is None else bias + causal


def _keep_bias(keep, dtype):
    """0 where `keep`, -inf elsewhere, in the dtype attention accumulates `dtype` in."""
    acc = accumulation_dtype(dtype)
    return jnp.where(keep, jnp.zeros((), acc), jnp.full((), -jnp.inf, acc))


def _groups(q, k) -> int:
    return q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1


def _grouped(q, k, bias):
    """Grouped-query attention as plain attention over K/V's own heads: q [..., Hkv*g, L, D]
    as [..., Hkv, g*L, D] (query head h*g + j is rows j*L .. j*L+L-1 of head h) and the bias
    to match, so that K and V are never repeated. Returns (q, bias, ungroup) where ungroup
    takes a [..., Hkv, g*L, ...] result back to [..., H, L, ...]."""
    groups = _groups(q, k)
    heads, length = q.shape[-3], q.shape[-2]
    lead, kv = q.shape[:-3], k.shape[-3]
    q = q.reshape(*lead, kv, groups * length, q.shape[-1])
    if bias is not None:
        bias = jnp.reshape(bias, (1,) * (q.ndim - bias.ndim) + bias.shape)
        count = bias.shape[-1]
        heads_of_bias = heads if bias.shape[-3] == heads else 1
        bias = jnp.broadcast_to(bias, (*bias.shape[:-3], heads_of_bias, length, count))
        split = (*bias.shape[:-3], kv if heads_of_bias == heads else 1, -1)
        if heads_of_bias == 1:
            bias = jnp.broadcast_to(
                bias[..., None, :, :], (*bias.shape[:-2], groups, length, count)
            )
        bias = bias.reshape(*split[:-1], groups * length, count)

    def ungroup(t, tail):
        return t.reshape(*lead, heads, length, *tail)

    return q, bias, ungroup


@register_lowering(ours.attention.default, needs_ctx=True)
def attention(ctx, q, k, v, mask, scale, causal_diagonal=None, empty_rows_nan=False, window=None):
    is_causal, bias = _bias(q, k, mask, causal_diagonal, window)
    grouped, grouped_bias, ungroup = _grouped(q, k, bias) if _groups(q, k) > 1 else (q, bias, None)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = _attention(grouped, k, v, is_causal, grouped_bias, scale)
    if ungroup is not None:
        out, lse = ungroup(out, out.shape[-1:]), ungroup(lse, ())
    if empty_rows_nan and bias is not None:
        # a written-out softmax over a row of -inf scores: NaN, where the kernels give 0
        empty = jnp.all(jnp.isneginf(jnp.broadcast_to(bias, (*q.shape[:-1], k.shape[-2]))), -1)
        out = jnp.where(empty[..., None], jnp.nan, out)
    return _results(ctx, (out, lse))


@register_lowering(ours.attention_backward.default, needs_ctx=True)
def attention_backward(
    ctx, grad, q, k, v, out, lse, mask, scale, causal_diagonal=None, window=None
):
    is_causal, bias = _bias(q, k, mask, causal_diagonal, window)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if _groups(q, k) == 1:
        return _results(ctx, _attention_backward(grad, q, k, v, out, lse, is_causal, bias, scale))
    grouped, bias, ungroup = _grouped(q, k, bias)
    shape = grouped.shape[:-1]
    grad, out = (t.reshape(*shape, t.shape[-1]) for t in (grad, out))
    dq, dk, dv = _attention_backward(
        grad, grouped, k, v, out, lse.reshape(shape), is_causal, bias, scale
    )
    return _results(ctx, (ungroup(dq, dq.shape[-1:]), dk, dv))
