"""FlexAttention's XLA form over the block mask's blocks: the blocks no query block lists are
not computed (lowering/ops/flex_attention.py calls it).

A `BlockMask` lists, per (batch, head, query block), the key blocks where its `mask_mod` keeps
something (`kv_indices` up to `kv_num_blocks`, and the full ones in `full_kv_*`); torch's own
kernels visit those alone. Here the listed blocks of every (batch, head) are merged into one
[query blocks, key blocks] table (the tables are data: runtime inputs under torch.compile), and
each query block runs over the key blocks in a `lax.scan` whose step is a `lax.cond`: a listed
block is scored (score_mod, mask_mod) and folded into a running softmax (max, sum, output, as
flash attention does), an unlisted one is passed over. So a causal mask computes about half the
blocks, a packed-document mask fewer. Each query block is checkpointed: its backward
recomputes it, and the temporaries are one query block's scores against the keys.

The tables must tile the lengths being compiled (lengths multiples of their block sizes), else
the caller keeps its dense form; positions the mask drops inside a listed block are masked as
before. A block mask whose tables omit blocks its mask_mod keeps (not one `create_block_mask`
makes) loses those blocks here, as in torch's kernels (its eager reference reads mask_mod
alone).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The block mask's tuple (BlockMask.as_tuple()): its tables and block sizes
_KV_NUM, _KV_INDICES, _FULL_NUM, _FULL_INDICES, _Q_BLOCK, _KV_BLOCK = 2, 3, 4, 5, 14, 15


def tiles(block_mask, length: int, count: int) -> bool:
    """Whether the block mask's tables tile `length` queries and `count` keys (then
    `listed_blocks` reads them)."""
    kv_num, kv_indices = block_mask[_KV_NUM], block_mask[_KV_INDICES]
    if kv_num is None or kv_indices is None or kv_indices.ndim != 4:
        return False
    q_size, kv_size = block_mask[_Q_BLOCK], block_mask[_KV_BLOCK]
    if not isinstance(q_size, int) or not isinstance(kv_size, int):
        return False
    return kv_num.shape[-1] * q_size == length and count % kv_size == 0


def listed_blocks(block_mask, length: int, count: int):
    """[query blocks, key blocks] bool, a key block some (batch, head) lists for a query block;
    None where the tables do not tile `length` queries and `count` keys."""
    if not tiles(block_mask, length, count):
        return None
    kv_blocks = count // block_mask[_KV_BLOCK]
    listed = _listed(block_mask[_KV_NUM], block_mask[_KV_INDICES], kv_blocks)
    full_num, full_indices = block_mask[_FULL_NUM], block_mask[_FULL_INDICES]
    if full_num is not None and full_indices is not None:
        listed = listed | _listed(full_num, full_indices, kv_blocks)
    return jnp.any(listed, axis=(0, 1))


def _listed(num, indices, kv_blocks: int):
    """[B, H, query blocks, key blocks] bool from a count and an index table."""
    slot = jnp.arange(indices.shape[-1]) < num[..., None]
    hit = (indices[..., None] == jnp.arange(kv_blocks)) & slot[..., None]
    return jnp.any(hit, axis=-2)


def attend(q, k, v, listed, scores_of):
    """(output, logsumexp, max score), natural logs, of queries `q` [B, H, L, D] against keys
    and values [B, H, S, D] (heads already per query head), visiting the listed blocks alone.
    `scores_of(q_rows, k_block, q_start, kv_start)` gives a block's modded, masked scores."""
    batch, heads, length, dim = q.shape
    q_blocks, kv_blocks = listed.shape
    q_size, kv_size = length // q_blocks, k.shape[-2] // kv_blocks
    work = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    k_parts = jnp.moveaxis(k.reshape(batch, heads, kv_blocks, kv_size, -1), 2, 0)
    v_parts = jnp.moveaxis(v.reshape(batch, heads, kv_blocks, kv_size, -1), 2, 0)

    def rows(part):
        q_rows, i = part
        q_start = i * q_size

        def visit(carry, block):
            k_block, v_block, j = block

            def compute(carry):
                top, total, acc = carry
                s = scores_of(q_rows, k_block, q_start, j * kv_size)
                new_top = jnp.maximum(top, jnp.max(s, axis=-1))
                safe = jnp.where(jnp.isneginf(new_top), 0.0, new_top)
                weights = jnp.exp(s - safe[..., None])
                kept = jnp.exp(jnp.where(jnp.isneginf(top), -jnp.inf, top - safe))
                block = jnp.einsum(
                    "bhqk,bhkd->bhqd",
                    weights,
                    v_block.astype(work),
                    precision=jax.lax.Precision.HIGHEST,
                )
                total = total * kept + jnp.sum(weights, axis=-1)
                return new_top, total, acc * kept[..., None] + block

            return jax.lax.cond(listed[i, j], jax.checkpoint(compute), lambda c: c, carry), None

        init = (
            jnp.full((batch, heads, q_size), -jnp.inf, work),
            jnp.zeros((batch, heads, q_size), work),
            jnp.zeros((batch, heads, q_size, v.shape[-1]), work),
        )
        blocks = (k_parts, v_parts, jnp.arange(kv_blocks, dtype=jnp.int32))
        (top, total, acc), _ = jax.lax.scan(visit, init, blocks)
        empty = jnp.isneginf(top)
        out = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, total)[..., None])
        lse = jnp.where(empty, -jnp.inf, top + jnp.log(jnp.where(empty, 1.0, total)))
        return out.astype(q.dtype), lse, top

    parts = jnp.moveaxis(q.reshape(batch, heads, q_blocks, q_size, dim), 2, 0)
    blocks = jax.lax.map(jax.checkpoint(rows), (parts, jnp.arange(q_blocks, dtype=jnp.int32)))
    return tuple(jnp.moveaxis(p, 0, 2).reshape(batch, heads, length, *p.shape[4:]) for p in blocks)
