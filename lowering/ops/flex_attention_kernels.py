"""FlexAttention on the TPU: the attentions Splash computes go to its kernel.

Splash takes a mask it knows (full, or causal) and no score_mod. So a `flex_attention` whose
`score_mod` returns the score as it is and whose `mask_mod` is `q_idx >= kv_idx` (or absent:
every key) becomes the Splash call the attention op makes (lowering/ops/attention_kernels.py:
GQA, scale, logsumexp), and its backward the kernel's own VJP. The rest, and any shape or
dtype the kernel refuses, take the XLA form (lowering/ops/flex_attention.py); each choice is
counted with its reason in the module's kernel choices (`tpu.flex_attention.splash`,
`tpu.flex_attention.xla: <reason>`). Recognized by the subgraphs' structure, not by
evaluating them: a mask written another way (`kv_idx <= q_idx`) is recognized as well, one
with captured tensors (a document mask) is not yet.
"""

from __future__ import annotations

import math
import operator

import jax.numpy as jnp
import torch

from ..registry import register_lowering
from . import attention_kernels
from . import flex_attention as portable

aten, hop = torch.ops.aten, torch.ops.higher_order

# mask_mod(b, h, q_idx, kv_idx): the comparisons that say "causal" (query at or after key)
_CAUSAL = {(aten.ge.Tensor, 2, 3), (aten.le.Tensor, 3, 2)}


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
    diagonal, reason = _splash_form(query, key, value, score_mod, block_mask, *buffers)
    if reason is None and _reads_result(ctx.node, 2):
        reason = "the max scores asked for (return_aux max_scores)"
    if not _count(ctx, reason):
        return portable.xla_form(ctx, query, key, value, score_mod, block_mask, scale, *buffers)
    out, lse = attention_kernels.splash_attention(
        query, key, value, scale, diagonal, mask=None, interpret=ctx.interpret_kernels
    )
    results = [out, lse / math.log(2)]
    if len(ctx.out) > 2:  # the max scores, read by nothing (checked above): NaN, never a value
        results.append(jnp.full(ctx.out[2].shape, jnp.nan))
    return tuple(r.astype(ctx.jax_dtype(v.dtype)) for r, v in zip(results, ctx.out))


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
    diagonal, reason = _splash_form(query, key, value, fw_graph, block_mask, *buffers)
    if reason is None and grad_logsumexp is not None:
        reason = "a gradient of the logsumexp (the kernel's VJP takes the output's alone)"
    if not _count(ctx, reason):
        return portable.flex_attention_backward(
            ctx, query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
            joint_graph, block_mask, scale, kernel_options, *buffers,
        )  # fmt: skip
    grads = attention_kernels.splash_attention_grads(
        grad_out, query, key, value, scale, diagonal, mask=None, interpret=ctx.interpret_kernels
    )
    grads = tuple(g.astype(ctx.jax_dtype(e.dtype)) for g, e in zip(grads, ctx.out))
    return (*grads, ()) if len(ctx.out) > 3 else grads


def _reads_result(node, index: int) -> bool:
    """Whether anything reads result `index` of a node that returns several."""
    return any(u.target is operator.getitem and u.args[1] == index and u.users for u in node.users)


def _count(ctx, reason: str | None) -> bool:
    """Record the choice; True when Splash was chosen (reason None)."""
    key = "tpu.flex_attention.splash" if reason is None else f"tpu.flex_attention.xla: {reason}"
    ctx.chose(key)
    return reason is None


def _splash_form(query, key, value, score_mod, block_mask, score_buffers, mask_buffers):
    """(Splash's causal diagonal: 0 or None for every key, the reason it cannot: None)."""
    if score_buffers or mask_buffers:
        return None, "score_mod or mask_mod reads captured tensors"
    if not _returns_its_score(score_mod):
        return None, "a score_mod (Splash adds nothing to the scores)"
    mask_mod = block_mask[-1]
    diagonal = _causal_diagonal(mask_mod)
    if diagonal == "unknown":
        return None, "a mask_mod other than causal or every key"
    reason = attention_kernels.splash_refusal(query, key, value, None, diagonal)
    return diagonal, reason


def _returns_its_score(gm) -> bool:
    """Whether a score_mod subgraph returns its first input (the score) unchanged."""
    if gm is None:
        return True
    inputs, result = _ends(gm)
    return bool(inputs) and result is inputs[0]


def _causal_diagonal(gm):
    """0 for a causal mask_mod, None for one that keeps every key (or none given), else
    "unknown"."""
    if gm is None:
        return None
    inputs, result = _ends(gm)
    if not isinstance(result, torch.fx.Node) or result.op != "call_function":
        return "unknown"
    if result.target in (aten.new_ones.default, aten.ones.default) and _is_true(result):
        return None
    args = [inputs.index(a) if a in inputs else None for a in result.args]
    if len(args) == 2 and (result.target, *args) in _CAUSAL:
        return 0
    return "unknown"


def _ends(gm):
    """(a subgraph's inputs, the node it returns)."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = output.args[0]
    return inputs, result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result


def _is_true(node) -> bool:
    """Whether a ones-like node makes a bool scalar (the noop mask: every key kept)."""
    value = node.meta.get("val")
    return value is not None and value.dtype == torch.bool and value.dim() == 0
