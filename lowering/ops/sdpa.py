"""aten's scaled dot-product attention for CPU (the flash-attention ops), forward and backward.

The float32 attention math here (`_attention`, `_attention_backward`) is also the
`tpu_inductor::attention` op's (lowering/ops/attention.py). The backward reads torch's
saved logsumexp.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from torch._ops import ops

from ...exc import LoweringError
from ..registry import register_lowering
from .common import _f32, _results
from .linalg import matmul

aten = ops.aten

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
