"""Embedding lookups: embedding, embedding_bag and embedding's dense backward."""

from __future__ import annotations

import jax.numpy as jnp
from torch._ops import ops

from ..registry import register_lowering
from .common import _f32, accumulation_dtype, outputs_unread

aten = ops.aten

# --- embedding -------------------------------------------------------------------------------


@register_lowering(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


def _bag_supported(node) -> bool:
    """Only the bags' values are computed (offset2bag, bag sizes and max indices are not)."""
    return outputs_unread((1, 2, 3))(node)


@register_lowering(
    aten._embedding_bag_forward_only.default,
    aten._embedding_bag.default,
    needs_ctx=True,
    supports=_bag_supported,
)
def embedding_bag(
    ctx,
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    """Bags of embedding rows, summed (mode 0, weighted by `per_sample_weights`), averaged (1)
    or maxed (2): bag b holds indices offsets[b] up to the next offset (the last bag to the end,
    or to the last offset with `include_last_offset`); rows at `padding_idx` are left out, and
    an empty bag is zeros. The other three results are placeholders (see `_bag_supported`)."""
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    n = indices.shape[0]
    position = jnp.arange(n)
    bag = jnp.sum(offsets[None, :bags] <= position[:, None], axis=1) - 1  # last start <= j
    valid = bag >= 0
    if include_last_offset:
        valid = valid & (position < offsets[bags])
    if padding_idx is not None and padding_idx >= 0:
        valid = valid & (indices != padding_idx)
    acc = accumulation_dtype(weight.dtype)
    rows = jnp.take(weight, indices, axis=0).astype(acc)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.astype(acc)[:, None]
    bag = jnp.where(valid, bag, bags)  # dropped rows land in an extra bag
    count = jnp.zeros(bags + 1, acc).at[bag].add(1)[:bags, None]
    if mode == 2:
        out = jnp.full((bags + 1, weight.shape[1]), -jnp.inf, acc).at[bag].max(rows)[:bags]
        out = jnp.where(count > 0, out, 0)
    else:
        out = jnp.zeros((bags + 1, weight.shape[1]), acc).at[bag].add(rows)[:bags]
        if mode == 1:
            out = out / jnp.maximum(count, 1)
    placeholders = [jnp.zeros(v.shape, ctx.jax_dtype(v.dtype)) for v in ctx.out[1:]]
    return (out.astype(ctx.out_dtype), *placeholders)


@register_lowering(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = indices.reshape(-1)
    g = _f32(grad).reshape(idx.shape[0], -1)
    if padding_idx >= 0:
        g = jnp.where((idx == padding_idx)[:, None], jnp.zeros((), g.dtype), g)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1)
        g = g / counts[idx][:, None]
    out = jnp.zeros((num_weights, g.shape[1]), g.dtype).at[idx].add(g)
    return out.astype(grad.dtype)
