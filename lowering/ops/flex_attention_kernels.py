"""FlexAttention on the TPU: the attentions Splash computes go to its kernel.

Splash takes a mask it knows (full, causal, a causal window) and no score_mod. So a
`flex_attention` whose `score_mod` returns the score as it is and whose `mask_mod` is
`q_idx >= kv_idx`, that and `q_idx - kv_idx <= w` (a sliding window), or absent (every key)
becomes the Splash call the attention op makes (lowering/ops/attention_kernels.py: GQA,
scale, logsumexp), and its backward the kernel's own VJP. The rest, and any shape or
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
_AND = (aten.bitwise_and.Tensor, aten.logical_and.default)
# q_idx - kv_idx compared with a number: how much the window is wider than it
_BAND = {aten.le.Scalar: 1, aten.lt.Scalar: 0}


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
    (diagonal, window), reason = _splash_form(query, key, value, score_mod, block_mask, *buffers)
    if reason is None and _reads_result(ctx.node, 2):
        reason = "the max scores asked for (return_aux max_scores)"
    if not _count(ctx, reason):
        args = (query, key, value, score_mod, block_mask, scale, kernel_options, *buffers)
        return portable.xla_form(ctx, *args)
    out, lse = attention_kernels.splash_attention(
        query, key, value, scale, diagonal, None, window, interpret=ctx.interpret_kernels
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
    (diagonal, window), reason = _splash_form(query, key, value, fw_graph, block_mask, *buffers)
    if reason is None and grad_logsumexp is not None:
        reason = "a gradient of the logsumexp (the kernel's VJP takes the output's alone)"
    if not _count(ctx, reason):
        return portable.flex_attention_backward(
            ctx, query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
            joint_graph, block_mask, scale, kernel_options, *buffers,
        )  # fmt: skip
    grads = attention_kernels.splash_attention_grads(
        grad_out, query, key, value, scale, diagonal, None, window, interpret=ctx.interpret_kernels
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
    """((Splash's causal diagonal, its window), the reason it cannot: None); the diagonal 0
    or None (every key), the window None or the keys a row keeps up to its diagonal."""
    if score_buffers or mask_buffers:
        return (None, None), "score_mod or mask_mod reads captured tensors"
    if not _returns_its_score(score_mod):
        return (None, None), "a score_mod (Splash adds nothing to the scores)"
    form = _mask_form(block_mask[-1])
    if form is None:
        return (None, None), "a mask_mod other than causal, a causal window or every key"
    return form, attention_kernels.splash_refusal(query, key, value, None, *form)


def _returns_its_score(gm) -> bool:
    """Whether a score_mod subgraph returns its first input (the score) unchanged."""
    if gm is None:
        return True
    inputs, result = _ends(gm)
    return bool(inputs) and result is inputs[0]


def _mask_form(gm):
    """(diagonal, window) of a mask_mod Splash has: (None, None) keeps every key (or none
    given), (0, None) is causal, (0, w) a causal window (`(q >= kv) & (q - kv <= w - 1)`);
    None for any other."""
    if gm is None:
        return None, None
    inputs, result = _ends(gm)
    if _is_true(result):
        return None, None
    if _is_causal(result, inputs):
        return 0, None
    if _is_call(result) and result.target in _AND and len(result.args) == 2:
        for causal, band in (result.args, result.args[::-1]):
            width = _band(band, inputs)
            if _is_causal(causal, inputs) and width is not None:
                return 0, width
    return None


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
