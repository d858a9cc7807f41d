"""FlexAttention (`torch.nn.attention.flex_attention`): the `flex_attention` higher-order op and
its backward, `flex_attention_backward`.

The op carries its `score_mod` and the block mask's `mask_mod` as FX subgraphs of scalars
(score, b, h, q_idx, kv_idx, *captured buffers). Each is run by the interpreter under
`jax.vmap` over the (batch, head, query, key) grid, as torch's math reference does, so any
op with a lowering may appear in them (ALiBi's slopes, soft-capping's tanh, a document mask's
lookup into a captured tensor).

Forward (torch's math reference, `sdpa_dense`): scores in float32 (float64 for float64
inputs), `where(mask_mod, score_mod(scores), -inf)`, a safe softmax (a fully masked row gives
0 and logsumexp -inf), the weights cast to the inputs' dtype times the values. Grouped-query
attention serves each group of query heads from one key/value head. The logsumexp comes back
in base 2, as the op's kernels return it (`flex_attention` multiplies by ln 2).

Backward: the gradient of that forward, by `jax.vjp` (the forward recomputed, as a flash
attention backward does), for the query, key, value and every floating captured buffer of
`score_mod` (a learnable bias); `joint_graph`, torch's hand-made derivative of `score_mod`,
is not needed.

Which positions are kept is `mask_mod`'s, as in torch's reference; where the block mask's
tables tile the lengths, the key blocks no query block lists are not computed at all
(lowering/ops/flex_attention_blocks.py: a running softmax over the listed blocks, a query
block at a time). Elsewhere (lengths not multiples of the block sizes, no block mask) every
block is computed, then masked: past `ROWS` queries a block of rows at a time (`lax.map` over
checkpointed blocks, recomputed in the backward), so the temporaries hold ROWS × keys of the
scores, not queries × keys.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from ...exc import LoweringError
from ..registry import register_lowering
from . import flex_attention_blocks as blocks

aten, hop = torch.ops.aten, torch.ops.higher_order

# Longer queries are attended a block of this many rows at a time (when it divides them).
ROWS = 512

# Counted in the module's kernel choices (on every platform: no kernel takes it yet).
_CHOICE = "flex_attention.xla: no kernel for it yet, "
_LISTED, _DENSE = "the listed blocks alone", "every block computed and masked"

# The block mask's tuple (BlockMask.as_tuple()) ends with its mask_mod (torch checks its
# lengths against the call's; without a block mask it is a one-block mask that keeps all).
_MASK_MOD = -1


@register_lowering(hop.flex_attention, needs_ctx=True)
def flex_attention(ctx, *args):
    """(output, logsumexp in base 2[, max score in base 2]) as the node expects."""
    query, key, block_mask = args[0], args[1], args[4]
    listed = blocks.tiles(block_mask, query.shape[-2], key.shape[-2])
    ctx.chose(_CHOICE + (_LISTED if listed else _DENSE))
    return xla_form(ctx, *args)


def xla_form(
    ctx,
    query,
    key,
    value,
    score_mod,
    block_mask,
    scale,
    kernel_options,
    score_mod_other_buffers=(),
    mask_mod_other_buffers=(),
):
    """The forward's XLA form, the op's arguments in (the portable rule's, uncounted: a
    platform's rule that falls back to it counts its own reason)."""
    attend = _attention(ctx, score_mod, block_mask, scale, mask_mod_other_buffers)
    out, lse, top = attend(query, key, value, tuple(score_mod_other_buffers))
    results = (out, lse, top)[: len(ctx.out)]
    return tuple(r.astype(ctx.jax_dtype(v.dtype)) for r, v in zip(results, ctx.out))


@register_lowering(hop.flex_attention_backward, needs_ctx=True)
def flex_attention_backward(
    ctx,
    query,
    key,
    value,
    out,
    logsumexp,
    grad_out,
    grad_logsumexp,
    fw_graph,
    joint_graph,
    block_mask,
    scale,
    kernel_options,
    score_mod_other_buffers=(),
    mask_mod_other_buffers=(),
):
    """(grad query, grad key, grad value, (grad of each score_mod buffer or None))."""
    attend = _attention(ctx, fw_graph, block_mask, scale, mask_mod_other_buffers)
    buffers = tuple(score_mod_other_buffers)
    learned = tuple(
        i
        for i, b in enumerate(buffers)
        if hasattr(b, "dtype") and jnp.issubdtype(b.dtype, jnp.inexact)
    )

    def forward(q, k, v, trained):
        given = list(buffers)
        for i, b in zip(learned, trained):
            given[i] = b
        o, lse, _ = attend(q, k, v, tuple(given))
        return o, lse

    (o, lse), pullback = jax.vjp(forward, query, key, value, tuple(buffers[i] for i in learned))
    d_lse = jnp.zeros_like(lse) if grad_logsumexp is None else grad_logsumexp.astype(lse.dtype)
    dq, dk, dv, d_trained = pullback((grad_out.astype(o.dtype), d_lse))
    expected = ctx.out
    d_buffers = [None] * len(buffers)
    for i, d in zip(learned, d_trained):
        d_buffers[i] = d
    wanted = expected[3] if len(expected) > 3 else ()
    d_buffers = tuple(
        None if want is None else d.astype(ctx.jax_dtype(want.dtype))
        for d, want in zip(d_buffers, wanted)
    )
    grads = tuple(g.astype(ctx.jax_dtype(e.dtype)) for g, e in zip((dq, dk, dv), expected))
    return (*grads, d_buffers) if len(expected) > 3 else grads


@register_lowering(aten._local_scalar_dense.default, supports=lambda node: False)
def _scalar_value(x):
    """A 0-d tensor's value, traced: inside a FlexAttention subgraph only, where a float that
    changed between Dynamo's compiles (a soft-cap from a config) arrives as a 0-d tensor read
    by `.item()`. The partitioner never takes it (`supports`): elsewhere the value is a
    Python number the graph's sizes or control flow need, which only eager torch has."""
    return jnp.reshape(x, ())


def _attention(ctx, score_mod, block_mask, scale, mask_buffers):
    """attend(q, k, v, score buffers) -> (output, logsumexp, max score), both in base 2."""
    from ..interpreter import GraphRunner

    mask_mod = block_mask[_MASK_MOD]
    score_fn = _over_grid(_subgraph(GraphRunner, score_mod, ctx.x64), 1, None)
    mask = None
    if mask_mod is not None:
        mask_fn = _over_grid(_subgraph(GraphRunner, mask_mod, ctx.x64), 0, len(mask_buffers))
        mask = lambda *grid: mask_fn(*grid, *mask_buffers)  # noqa: E731

    def attend(q, k, v, score_buffers):
        batch, heads, length, dim = q.shape
        k, v = _per_query_head(k, heads), _per_query_head(v, heads)
        k, v = (
            jnp.broadcast_to(k, (batch, *k.shape[1:])),
            jnp.broadcast_to(v, (batch, *v.shape[1:])),
        )

        def scores_of(q_rows, k_rows, start, kv_start):
            grid = (q_rows, k_rows, start, kv_start, score_buffers, scale, score_fn, mask)
            return _scores(*grid)

        def rows(q_rows, start):
            return _rows_attention(q_rows, k, v, scores_of(q_rows, k, start, 0))

        listed = blocks.listed_blocks(block_mask, length, k.shape[-2])
        if listed is not None:
            out, lse, top = blocks.attend(q, k, v, listed, scores_of)
        elif length <= ROWS or length % ROWS:
            out, lse, top = rows(q, 0)
        else:  # a block of query rows at a time, recomputed in the backward: O(ROWS x keys)
            count = length // ROWS
            chunks = jnp.moveaxis(q.reshape(batch, heads, count, ROWS, dim), 2, 0)
            starts = jnp.arange(count, dtype=jnp.int32) * ROWS
            parts = jax.lax.map(jax.checkpoint(lambda part: rows(*part)), (chunks, starts))
            out, lse, top = (_joined(p, batch, heads, length) for p in parts)
        return out, lse / math.log(2), top / math.log(2)

    return attend


def _scores(q, k, start, kv_start, score_buffers, scale, score_fn, mask):
    """The modded, masked scores of the query rows `q` (the first at row `start`) against the
    keys `k` (the first at `kv_start`), in float32 (float64 for float64 inputs)."""
    batch, heads, length, _ = q.shape
    work = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    scores = jnp.einsum(
        "bhqd,bhkd->bhqk", q.astype(work), k.astype(work), precision=jax.lax.Precision.HIGHEST
    )
    scores = (scores * scale).astype(work)
    b, h, queries, keys = _grid(batch, heads, length, k.shape[-2])
    grid = (b, h, queries + start, keys + kv_start)
    modded = score_fn(scores, *grid, *score_buffers).astype(work)
    if mask is not None:
        modded = jnp.where(mask(*grid), modded, -jnp.inf)
    return modded


def _rows_attention(q, k, v, modded):
    """Attention of query rows `q` over every key, their scores `modded`: (output, logsumexp,
    max score), natural logs; the score matrix of these rows formed whole."""
    work = modded.dtype
    top = jnp.max(modded, axis=-1)
    empty = jnp.isneginf(top)
    safe_top = jnp.where(empty, 0.0, top)
    weights = jnp.exp(modded - safe_top[..., None])
    total = jnp.sum(weights, axis=-1)
    lse = jnp.where(empty, -jnp.inf, safe_top + jnp.log(jnp.where(empty, 1.0, total)))
    probabilities = jnp.where(
        empty[..., None], 0.0, weights / jnp.where(empty, 1.0, total)[..., None]
    )
    out = jnp.einsum(
        "bhqk,bhkd->bhqd",
        probabilities.astype(q.dtype),
        v.astype(q.dtype),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=work,
    ).astype(q.dtype)
    return out, lse, top


def _joined(part, batch: int, heads: int, length: int):
    """A result computed per block of rows, (blocks, B, H, ROWS, ...), as (B, H, length, ...)."""
    return jnp.moveaxis(part, 0, 2).reshape(batch, heads, length, *part.shape[4:])


def _subgraph(runner_class, gm, x64):
    """A subgraph of scalars as a jax function of scalars (its first output)."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise LoweringError(
            f"flex_attention: expected a traced score_mod / mask_mod subgraph, got {gm!r}"
        )
    runner = runner_class(gm, x64=x64)

    def run(*args):
        return runner.run(list(args))[0]

    return run


def _over_grid(fn, prefix: int, buffers: int | None):
    """`fn(*prefix, b, h, q, kv, *buffers)` of scalars vectorized over the (b, h, q, kv) grid:
    the `prefix` arguments of shape (B, H, Q, K), the indices of shapes (B,), (H,), (Q,), (K,),
    the buffers whole (their count: None for as many as given)."""

    def vectorized(*args):
        count = len(args) - prefix - 4 if buffers is None else buffers
        mapped = fn
        for axis in range(3, -1, -1):  # kv innermost, b outermost
            in_axes = (0,) * prefix + tuple(0 if i == axis else None for i in range(4))
            mapped = jax.vmap(mapped, in_axes=in_axes + (None,) * count)
        return mapped(*args)

    return vectorized


def _grid(batch: int, heads: int, queries: int, keys: int):
    return tuple(jnp.arange(n, dtype=jnp.int32) for n in (batch, heads, queries, keys))


def _per_query_head(x, heads: int):
    """Keys or values of fewer heads repeated for each group of query heads (torch's
    repeat_interleave: consecutive query heads share one)."""
    groups = heads // x.shape[1]
    return x if groups == 1 else jnp.repeat(x, groups, axis=1)
