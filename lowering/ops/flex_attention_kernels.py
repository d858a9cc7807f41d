"""FlexAttention on the TPU: the attentions Splash computes go to its kernel.

Splash takes a mask it knows (full, causal, a causal window), segment ids and no score_mod. So a
`flex_attention` whose `score_mod` returns the score as it is and whose `mask_mod` is an and of:
`q_idx >= kv_idx` (causal), that and `q_idx - kv_idx <= w` (a sliding window), a document mask
`doc[q_idx] == doc[kv_idx]` (or `doc[b, q_idx] == doc[b, kv_idx]`, `doc` a captured integer
tensor: its ids become the kernel's segment ids; or, with the causal term, TorchTitan's `q_idx
<= doc_end[b, kv_idx]`, the last position of each key's document: the ends are the segment ids
where the table is well formed, checked at run time, the XLA form where not), `kv_idx < n`
(bucketing's mask of padded keys, passes/bucket_rules_flex.py: a mask over keys, or with
document ids the later keys' id -1, a row left without keys made exact around the kernel) or
nothing (every key) becomes the Splash call the attention op makes
(lowering/ops/attention_kernels.py: GQA, scale, logsumexp), and its backward the kernel's own
VJP. The rest, and any shape or dtype the kernel refuses, take the XLA form
(lowering/ops/flex_attention.py); each choice is counted with its reason in the module's kernel
choices (`tpu.flex_attention.splash`, `tpu.flex_attention.xla: <reason>`). Recognized by the
subgraphs' structure, not by evaluating them: a mask written another way (`kv_idx <= q_idx`, the
terms in any order) is recognized as well; one that reads a captured tensor any other way is
not.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import torch

from ..registry import register_lowering
from . import attention_kernels
from . import flex_attention as portable
from .common import reads_result

aten, hop = torch.ops.aten, torch.ops.higher_order

# mask_mod(b, h, q_idx, kv_idx): the comparisons that say "causal" (query at or after key)
_CAUSAL = {(aten.ge.Tensor, 2, 3), (aten.le.Tensor, 3, 2)}
_AND = (aten.bitwise_and.Tensor, aten.logical_and.default)
# q_idx - kv_idx compared with a number: how much the window is wider than it
_BAND = {aten.le.Scalar: 1, aten.lt.Scalar: 0}
_Q, _KV, _B = 2, 3, 0  # mask_mod's arguments (b, h, q_idx, kv_idx, *captured tensors)


class _Form(NamedTuple):
    """A mask Splash has: its causal diagonal (0, or None: every key), window (None, or the
    keys a row keeps up to its diagonal) and document ids (None, or (which captured tensor,
    whether indexed by batch too, "ids" or "ends": each key's document's last position)))."""

    diagonal: int | None = None
    window: int | None = None
    document: tuple[int, bool, str] | None = None
    keys: int | None = None  # which captured tensor holds how many keys are kept (the first)


@register_lowering(hop.flex_attention, platform="tpu", needs_ctx=True)
def flex_attention_tpu(
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
    buffers = (score_mod_other_buffers, mask_mod_other_buffers)
    form, reason = _splash_form(query, key, value, score_mod, block_mask, *buffers)
    if reason is None and reads_result(ctx.node, 2):
        reason = "the max scores asked for (return_aux max_scores)"
    args = (query, key, value, score_mod, block_mask, scale, kernel_options, *buffers)
    if not _count(ctx, reason, form):
        return portable.xla_form(ctx, *args)

    def splash():
        ids, keep, empty = _splash_masks(form, query, key, buffers[1])
        out, lse = attention_kernels.splash_attention(
            query, key, value, scale, form.diagonal, keep, form.window,
            interpret=ctx.interpret_kernels, segment_ids=ids,
        )  # fmt: skip
        if empty is not None:  # rows that keep no key: 0 and logsumexp -inf, as the mask says
            out = jnp.where(empty[:, None, :, None], jnp.zeros((), out.dtype), out)
            lse = jnp.where(empty[:, None, :], -jnp.inf, lse)
        results = [out, lse / math.log(2)]
        if len(ctx.out) > 2:  # the max scores, read by nothing (checked above): NaN
            results.append(jnp.full(ctx.out[2].shape, jnp.nan))
        return tuple(r.astype(ctx.jax_dtype(v.dtype)) for r, v in zip(results, ctx.out))

    return _checked(form, query, buffers[1], splash, lambda: portable.xla_form(ctx, *args))


@register_lowering(hop.flex_attention_backward, platform="tpu", needs_ctx=True)
def flex_attention_backward_tpu(
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
    buffers = (score_mod_other_buffers, mask_mod_other_buffers)
    form, reason = _splash_form(query, key, value, fw_graph, block_mask, *buffers)
    if reason is None and grad_logsumexp is not None:
        reason = "a gradient of the logsumexp (the kernel's VJP takes the output's alone)"
    args = (
        query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
        block_mask, scale, kernel_options, *buffers,
    )  # fmt: skip
    if not _count(ctx, reason, form):
        return portable.flex_attention_backward(ctx, *args)

    def splash():
        ids, keep, empty = _splash_masks(form, query, key, buffers[1])
        grad = grad_out
        if empty is not None:  # rows that keep no key add nothing (their gradient 0)
            grad = jnp.where(empty[:, None, :, None], jnp.zeros((), grad.dtype), grad)
        grads = attention_kernels.splash_attention_grads(
            grad, query, key, value, scale, form.diagonal, keep, form.window,
            interpret=ctx.interpret_kernels, segment_ids=ids,
        )  # fmt: skip
        grads = tuple(g.astype(ctx.jax_dtype(e.dtype)) for g, e in zip(grads, ctx.out))
        return (*grads, ()) if len(ctx.out) > 3 else grads

    xla = lambda: portable.flex_attention_backward(ctx, *args)  # noqa: E731
    return _checked(form, query, buffers[1], splash, xla)


def _checked(form, query, buffers, splash, xla):
    """splash(); for a mask of document ends, splash() where the table is well formed and
    xla() where it is not, chosen at run time (the executable holds both)."""
    if form.document is None or form.document[2] != "ends":
        return splash()
    which, batched, _ = form.document
    ends = _per_row(buffers[which], batched, query.shape[0], query.shape[-2])
    return jax.lax.cond(_well_formed(ends), splash, xla)


def _well_formed(ends):
    """Whether `ends` [B, L] gives each position its document's last one, documents packed one
    after another: ends[j] >= j, and ends[j] == j or ends[j + 1] == ends[j]. Then, for
    q >= kv, `q <= ends[kv]` is `ends[q] == ends[kv]`: the ends are segment ids."""
    at = jnp.arange(ends.shape[-1])
    closes = (ends[:, :-1] == at[:-1]) | (ends[:, 1:] == ends[:, :-1])
    return jnp.all(ends >= at) & jnp.all(closes)


def _per_row(ids, batched: bool, batch: int, length: int):
    """A captured table indexed by position (and batch) as [B, L]."""
    return ids[:batch, :length] if batched else jnp.broadcast_to(ids[:length], (batch, length))


def _count(ctx, reason: str | None, form) -> bool:
    """Record the choice; True when Splash was chosen (reason None)."""
    key = "tpu.flex_attention.splash" if reason is None else f"tpu.flex_attention.xla: {reason}"
    if reason is None and form.document is not None and form.document[2] == "ends":
        key += " (where the document ends are well formed, checked at run time; else XLA)"
    ctx.chose(key)
    return reason is None


def _splash_form(query, key, value, score_mod, block_mask, score_buffers, mask_buffers):
    """(the `_Form` of the mask, the reason Splash cannot compute this attention: None)."""
    if score_buffers:
        return None, "score_mod reads captured tensors"
    if not _returns_its_score(score_mod):
        return None, "a score_mod (Splash adds nothing to the scores)"
    form = _mask_form(block_mask[-1])
    if form is None:
        return None, "a mask_mod other than causal, a causal window, document ids or every key"
    if form.document is not None and form.keys is not None:
        if form.document[2] == "ends" or form.window is not None:
            return None, "document ends or a window over padded keys (bucketed lengths)"
    if form.document is not None:
        reason = _document_refusal(query, key, mask_buffers, *form.document[:2])
        if reason is not None:
            return None, reason
    if form.keys is not None and jnp.ndim(mask_buffers[form.keys]) != 0:
        return None, f"a key count of shape {jnp.shape(mask_buffers[form.keys])}"
    keep = None if form.document is not None else _keys(form, key, mask_buffers)
    return form, attention_kernels.splash_refusal(query, key, value, keep, *form[:2])


def _splash_masks(form, query, key, buffers):
    """(segment ids or None, a mask over keys or None, rows that keep no key [B, L] or None)
    for the Splash call. Document ids over the first n keys: the later keys' id -1, and a
    row that keeps no key (no earlier real key of its document) reads them instead, its
    results replaced after: the kernel takes no empty row."""
    ids = _segment_ids(form, query, buffers)
    if ids is None or form.keys is None:
        return ids, _keys(form, key, buffers), None
    ranks, length = ids[0], ids[0].shape[-1]
    at = jnp.arange(length, dtype=jnp.int32)
    real = at < buffers[form.keys]
    rows = jnp.arange(ranks.shape[0])[:, None]
    first = (
        jnp.full(ranks.shape, length, jnp.int32).at[rows, ranks].min(jnp.where(real, at, length))
    )  # each document's first real key
    seen = jnp.take_along_axis(first, ranks, axis=-1)
    empty = seen > at if form.diagonal is not None else seen >= length
    none = jnp.full((), -1, jnp.int32)
    return (jnp.where(empty, none, ranks), jnp.where(real, ranks, none)), None, empty


def _keys(form, key, buffers):
    """The keys kept, a bool mask [1, 1, 1, S] (`kv_idx < n`), or None: every key."""
    if form.keys is None:
        return None
    kept = jnp.arange(key.shape[-2]) < buffers[form.keys]
    return kept.reshape(1, 1, 1, -1)


def _document_refusal(query, key, buffers, which: int, batched: bool) -> str | None:
    """Why a document mask's ids cannot be Splash's segment ids (None: they can)."""
    ids = buffers[which]
    batch, length = query.shape[0], query.shape[-2]
    if key.shape[-2] != length:
        return f"a document mask over {length} queries and {key.shape[-2]} keys"
    if not (jnp.issubdtype(ids.dtype, jnp.integer) or ids.dtype == jnp.bool_):
        return f"document ids of dtype {ids.dtype} (integers compare exactly)"
    wanted = (batch, length) if batched else (length,)
    if ids.ndim != len(wanted) or any(n < w for n, w in zip(ids.shape, wanted)):
        return f"document ids of shape {tuple(ids.shape)} for {wanted} (batch, queries)"
    return None


def _segment_ids(form, query, buffers):
    """(the queries', the keys') Splash segment ids [B, L] of a document mask, or None: its
    ids as dense int32 ranks (equal where the ids are, whatever their dtype's width)."""
    if form.document is None:
        return None
    which, batched, _ = form.document
    ids = _per_row(buffers[which], batched, query.shape[0], query.shape[-2])
    order = jnp.argsort(ids, axis=-1)
    ordered = jnp.take_along_axis(ids, order, axis=-1)
    new = jnp.pad(ordered[:, 1:] != ordered[:, :-1], ((0, 0), (1, 0)))
    ranks = jnp.cumsum(new, axis=-1, dtype=jnp.int32)
    dense = jnp.take_along_axis(ranks, jnp.argsort(order, axis=-1), axis=-1)
    return dense, dense


def _returns_its_score(gm) -> bool:
    """Whether a score_mod subgraph returns its first input (the score) unchanged."""
    if gm is None:
        return True
    inputs, result = _ends(gm)
    return bool(inputs) and result is inputs[0]


def _mask_form(gm) -> _Form | None:
    """The `_Form` of a mask_mod (None given: every key), an and of terms each causal, a
    band (`q - kv <= w - 1`, with a causal term: a causal window), a document mask, a key
    count (`kv < n`) or true; None for any other."""
    if gm is None:
        return _Form()
    inputs, result = _ends(gm)
    causal, window, document, keys = False, None, None, None
    for term in _and_terms(result):
        width = _band(term, inputs)
        if _is_true(term):
            continue
        if _is_causal(term, inputs):
            causal = True
        elif width is not None and window is None:
            window = width
        elif document is None and (document := _document(term, inputs)) is not None:
            continue
        elif document is None and (document := _document_ends(term, inputs)) is not None:
            continue
        elif keys is None and (keys := _key_count(term, inputs)) is not None:
            continue
        else:
            return None
    if (window is not None or (document and document[2] == "ends")) and not causal:
        return None
    return _Form(0 if causal else None, window, document, keys)


def _key_count(node, inputs) -> int | None:
    """Which captured tensor n, for `kv_idx < n`; None for any other node."""
    if not _is_call(node) or node.target is not aten.lt.Tensor or len(node.args) != 2:
        return None
    kv, n = node.args
    if kv is not inputs[_KV] or n not in inputs[4:]:
        return None
    return inputs.index(n) - 4


def _and_terms(node) -> list:
    """The terms of an and (nested ands flattened), or [node]."""
    if _is_call(node) and node.target in _AND and len(node.args) == 2:
        return [t for arg in node.args for t in _and_terms(arg)]
    return [node]


def _document(node, inputs) -> tuple[int, bool] | None:
    """(which captured tensor, indexed by batch too) for `doc[q_idx] == doc[kv_idx]` (or
    `doc[b, q_idx] == doc[b, kv_idx]`, either side first); None for any other node."""
    if not _is_call(node) or node.target is not aten.eq.Tensor or len(node.args) != 2:
        return None
    reads = [_lookup(arg, inputs) for arg in node.args]
    if None in reads or reads[0][:2] != reads[1][:2]:
        return None
    if {reads[0][2], reads[1][2]} != {_Q, _KV}:
        return None
    return reads[0][0] - 4, reads[0][1], "ids"


def _document_ends(node, inputs) -> tuple[int, bool, str] | None:
    """(which captured tensor, indexed by batch too, "ends") for `q_idx <= ends[kv_idx]` (or
    `ends[b, kv_idx] >= q_idx`); None for any other node."""
    if not _is_call(node) or len(node.args) != 2:
        return None
    if node.target is aten.le.Tensor:
        query, read = node.args
    elif node.target is aten.ge.Tensor:
        read, query = node.args
    else:
        return None
    found = _lookup(read, inputs)
    if query is not inputs[_Q] or found is None or found[2] != _KV:
        return None
    return found[0] - 4, found[1], "ends"


def _lookup(node, inputs):
    """(captured tensor's argument position, batched, index argument) for `doc[i]` or
    `doc[b, i]` with i one of mask_mod's arguments; None for any other node."""
    if not _is_call(node) or node.target is not aten.index.Tensor or len(node.args) != 2:
        return None
    table, indices = node.args
    if table not in inputs[4:] or not isinstance(indices, (list, tuple)):
        return None
    where = [inputs.index(i) if i in inputs else None for i in indices]
    if where not in ([_Q], [_KV], [_B, _Q], [_B, _KV]):
        return None
    return inputs.index(table), len(where) == 2, where[-1]


def _is_call(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function"


def _is_causal(node, inputs) -> bool:
    """`q_idx >= kv_idx` (or `kv_idx <= q_idx`)."""
    if not _is_call(node) or len(node.args) != 2:
        return False
    args = [inputs.index(a) if a in inputs else None for a in node.args]
    return (node.target, *args) in _CAUSAL


def _band(node, inputs) -> int | None:
    """w for `q_idx - kv_idx <= w - 1` (or `< w`): the keys a row keeps up to its own."""
    if not _is_call(node) or node.target not in _BAND or not isinstance(node.args[1], int):
        return None
    difference = node.args[0]
    if not _is_call(difference) or difference.target is not aten.sub.Tensor:
        return None
    if [inputs.index(a) if a in inputs else None for a in difference.args] != [2, 3]:
        return None
    return node.args[1] + _BAND[node.target]


def _ends(gm):
    """(a subgraph's inputs, the node it returns)."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = output.args[0]
    return inputs, result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result


def _is_true(node) -> bool:
    """Whether a ones-like node makes a bool scalar (the noop mask: every key kept)."""
    if not _is_call(node) or node.target not in (aten.new_ones.default, aten.ones.default):
        return False
    value = node.meta.get("val")
    return value is not None and value.dtype == torch.bool and value.dim() == 0
