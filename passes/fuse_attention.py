"""fuse_attention: attention → one `tpu_inductor::attention` op (tpu_inductor/ops/attention.py).

Runs on each ATen graph after bucketing (so bucketing never meets the op; its masks on padded
keys are read as any other mask). Rewrites, each counted in `ctx.rewrites`:

    _scaled_dot_product_flash_attention_for_cpu(q, k, v, 0, causal, mask, scale)
        -> attention(q, k, v, mask, scale, 0 | None)                        # sdpa_forward
    _scaled_dot_product_flash_attention_for_cpu_backward(...)
        -> attention_backward(...)                                          # sdpa_backward
    bmm(softmax(steps(bmm(q, kᵀ))), v), steps from passes/fuse_patterns.py
        -> attention(q, k, v, mask, scale, ...)                             # written_out
    a mask that is a causal tril (passes/fuse_causal.py) -> its diagonal    # causal_mask
    a causal tril and a sliding window -> the diagonal and the window      # sliding_window
    a padding mask: keys(b) & size-only terms (fuse_causal.key_mask)
        -> the mask over keys alone [B, 1, 1, S] (and the band)               # key_mask
    K/V repeated for grouped-query attention -> the unrepeated K/V          # gqa_folded

The other SDPA kernels (flash, efficient, cuDNN) take CUDA tensors, which the backend refuses;
the math kernel is decomposed before this pass and met as written-out attention (with
`_safe_softmax`). Not rewritten: a softmax or score another node also reads (a training
forward saves its softmax for the backward: the written-out backward stays as it is), dropout,
a where/masked_fill mask next to another mask (several additive ones are summed), masks that
are neither float biases nor -inf / finfo.min fills, and so written-out attention bucketed
at symbolic lengths (bucket_shapes masks the padded keys with a where next to the model's
mask, and both operands of the second bmm; for the same reason bucketed K/V, masked after
their repeat, are not folded). A scale that is a 0-d tensor (a float attribute
Dynamo passes in at dynamic=True) is applied to q: (q·kᵀ)·c as (q·c)·kᵀ.

Preserves: every result (the op computes what the nodes it replaces did, in float32; a
written-out softmax over a row of -inf stays NaN), `node.meta["val"]` (new nodes get theirs
from the op's fake kernel), the layout of each replaced result (a view after it may rely on
its strides: the op's contiguous result is permuted into the replaced one's, `graph_edits.keep_layout`)
and the random streams (no random op is touched).
"""

from __future__ import annotations

import math
import operator

import torch
from torch.fx.operator_schemas import normalize_function

from tpu_inductor.ops.attention import ops as ours

from . import fuse_causal
from .context import PassContext
from .fuse_patterns import (
    AFTER_SOFTMAX,
    SOFTMAX,
    VIEWS,
    match_step,
    matmul_operand,
    repeated_heads,
    safe_softmax_guard,
)
from .graph_edits import insert_call, keep_layout

aten = torch.ops.aten
_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    if not ctx.options.fusion.attention:
        return gm
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not node.users:
            continue
        if node.target in SOFTMAX:
            _written_out(node, ctx)
        elif node.target in (_FLASH, _FLASH_BACKWARD):
            _sdpa(node, ctx)
    gm.graph.eliminate_dead_code()
    return gm


def _replace(old: torch.fx.Node, target, args, counts, ctx: PassContext) -> None:
    """`old`'s uses read a new call of `target`, each result in the layout `old`'s had; the
    rewrite's counts go to `ctx.rewrites`."""
    new = insert_call(old, target, args)
    was = old.meta["val"]
    old.replace_all_uses_with(new)
    if isinstance(was, torch.Tensor):
        keep_layout(new, was)
    else:  # a node of several results is read through getitem
        for user in list(new.users):
            if user.target is operator.getitem:
                user.meta["val"] = new.meta["val"][user.args[1]]
                keep_layout(user, was[user.args[1]])
    # SDPA's dropout tags it nondeterministic, so eliminate_dead_code would keep it (and its
    # sequence x sequence scores in the module) once its results are read from the op
    old.graph.erase_node(old)
    for what in counts:
        ctx.rewrites[what] += 1


def _sdpa(node: torch.fx.Node, ctx: PassContext) -> None:
    _, kw = normalize_function(
        node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True
    )
    if kw.get("dropout_p", 0.0):
        ctx.rewrites["skipped_dropout"] += 1
        return
    q, k, v = kw["query"], kw["key"], kw["value"]
    scale = kw.get("scale")  # None: 1/sqrt(D), as for SDPA
    mask = kw.get("attn_mask")
    causal = fuse_causal.Band(0) if kw.get("is_causal") else None
    counts = ["sdpa_backward" if node.target is _FLASH_BACKWARD else "sdpa_forward"]
    if mask is not None and causal is None:
        causal = _causal(mask, "zero", q, k)
        if causal is not None:
            mask = None
            counts.append(_band_count(causal))
        elif (found := _key_mask(mask, _keep_when(mask), q, k)) is not None:
            mask, causal = found
            counts += ["key_mask", *([] if causal is None else [_band_count(causal)])]
    diagonal, window = causal or (None, None)
    if node.target is _FLASH_BACKWARD:  # keeps the repeated K/V: its gradients are theirs
        args = (kw["grad_out"], q, k, v, kw["out"], kw["logsumexp"], mask, scale, diagonal)
        _replace(node, ours.attention_backward.default, (*args, window), counts, ctx)
        return
    k, v, folded = _fold_gqa(q, k, v)
    counts += ["gqa_folded"] * folded
    args = (q, k, v, mask, scale, diagonal, False, window)
    _replace(node, ours.attention.default, args, counts, ctx)


def _band_count(band: fuse_causal.Band) -> str:
    """The rewrite a causal band counts as: a causal mask, or a sliding window."""
    return "causal_mask" if band.window is None else "sliding_window"


def _causal(mask: torch.fx.Node, keep_when: str, q: torch.fx.Node, k: torch.fx.Node):
    queries, keys = q.meta["val"].shape[-2], k.meta["val"].shape[-2]
    return fuse_causal.band(mask, keep_when=keep_when, queries=queries, keys=keys)


def _key_mask(mask, keep_when, q, k):
    """fuse_causal.key_mask at q's and k's lengths: (a mask over keys alone or None, a causal
    band or None) keeping what `mask` keeps, or None."""
    queries, keys = q.meta["val"].shape[-2], k.meta["val"].shape[-2]
    return fuse_causal.key_mask(mask, keep_when=keep_when, queries=queries, keys=keys)


def _keep_when(mask: torch.fx.Node) -> str:
    """How SDPA's `attn_mask` keeps a key: True in a bool mask, 0 in a float bias."""
    return "true" if mask.meta["val"].dtype == torch.bool else "zero"


def _fold_gqa(q, k, v):
    """K and V read back to their unrepeated heads where q's heads are a multiple of theirs."""
    heads = q.meta["val"].shape[-3] if q.meta["val"].dim() >= 3 else None
    folded = 0
    out = []
    for t in (k, v):
        source = repeated_heads(t)
        groups = source.meta["val"].shape[-3]
        if source is not t and isinstance(heads, int) and heads % groups == 0:
            t, folded = source, folded + 1
        out.append(t)
    return out[0], out[1], folded


# --- written-out attention -----------------------------------------------------------------


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _written_out(softmax: torch.fx.Node, ctx: PassContext) -> None:
    rank = softmax.meta["val"].dim()
    dim = softmax.args[1]
    if rank < 3 or dim not in (-1, rank - 1) or (len(softmax.args) > 2 and softmax.args[2]):
        return
    scores = softmax.args[0]
    guard = _safe_guard(softmax, scores)
    safe = SOFTMAX[softmax.target] or guard is not None
    tail = _tail(guard or softmax, rank)
    head = _head(scores, [], users=2 if guard is not None else 1)
    if tail is None or head is None:
        return
    out_node, v3 = tail
    (q3, kt3), found = head
    q, kt, v = (matmul_operand(t, rank) for t in (q3, kt3, v3))
    if q is None or kt is None or v is None:
        return
    if out_node.meta["val"].dtype != q.meta["val"].dtype or out_node.meta["val"].dim() != rank:
        return
    scale, bias, causal, counts = 1.0, None, None, ["written_out"]
    masks = [(step, got) for step, got in found if step.kind in ("bias", "keep", "drop")]
    if len(masks) > 1 and any(step.kind != "bias" for step, _ in masks):
        return  # where(m, s + b, fill) is no sum of biases where a row is all fill
    given = []  # scales that are 0-d tensors (a float attribute Dynamo passes in, dynamic=True)
    for step, got in found:
        if step.kind in ("scale", "inverse_scale"):
            c = got["c"]
            if _scalar_tensor(c):
                given.append((aten.mul.Tensor if step.kind == "scale" else aten.div.Tensor, c))
            elif isinstance(c, bool) or not isinstance(c, (int, float)) or c == 0:
                return
            else:
                scale *= c if step.kind == "scale" else 1 / c
    k = _untransposed(kt)
    for step, got in masks:  # several additive masks (T5: position bias + mask): their sum
        made = _mask(step, got, softmax, q, k, counts if len(masks) == 1 else None)
        if made is None or (made[1] is not None and causal is not None):
            return
        if made[1] is not None:
            causal = made[1]
            counts.append(_band_count(causal))
        if made[0] is None:
            continue
        if bias is None:
            bias = made[0]
        else:
            bias = insert_call(softmax, aten.add.Tensor, (bias, made[0]))
    for op, c in given:  # (q·k)·c as (q·c)·k
        q = insert_call(out_node, op, (q, c))
    k, v, folded = _fold_gqa(q, k, v)
    counts += ["gqa_folded"] * folded
    nan_rows = bias is not None and not safe
    diagonal, window = causal or (None, None)
    args = (q, k, v, bias, scale, diagonal, nan_rows, window)
    fused = insert_call(out_node, ours.attention.default, args)
    _replace(out_node, operator.getitem, (fused, 0), counts, ctx)


def _scalar_tensor(c) -> bool:
    """Whether `c` is a node of a 0-d floating-point tensor."""
    val = c.meta.get("val") if isinstance(c, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype.is_floating_point


def _safe_guard(softmax: torch.fx.Node, scores) -> torch.fx.Node | None:
    """The where() that zeroes the softmax's all -inf rows (a decomposed `_safe_softmax`)."""
    from torch._inductor.pattern_matcher import is_match

    for user in softmax.users:
        m = safe_softmax_guard().match(user) if user.target is aten.where.self else None
        if m is not None and is_match(m):
            got = m.kwargs
            if (
                got["softmax"] is softmax
                and got["x"] is scores
                and got["dim"] in (-1, len(softmax.meta["val"].shape) - 1)
            ):
                return user if len(softmax.users) == 2 else None
    return None


def _tail(start: torch.fx.Node, rank: int):
    """(the node holding the attention's output, the bmm's value operand) after the softmax:
    converts, then expand → view → bmm(p, v) → view (bmm(p, v) alone for 3-d)."""
    node = _only_user(start)
    while node is not None and node.target in AFTER_SOFTMAX:
        node = _only_user(node)
    if node is not None and node.target is aten.expand.default:
        view = _only_user(node)
        node = _only_user(view) if view is not None and view.target in VIEWS else None
    if node is None or node.target is not aten.bmm.default:
        return None
    values = node.args[1]
    view = _only_user(node)
    if rank == 3:
        return node, values
    return (view, values) if view is not None and view.target in VIEWS else None


def _head(node, found, users=1):
    """((q operand, kᵀ operand) of the scores' bmm, [(step, captured)]) reading the steps
    from the softmax's input back to view(bmm(q, kᵀ)); None if it is no attention."""
    if not isinstance(node, torch.fx.Node) or len(node.users) != users:
        return None
    if node.target is aten.bmm.default:
        return (node.args[0], node.args[1]), found
    if node.target in VIEWS and getattr(node.args[0], "target", None) is aten.bmm.default:
        bmm = node.args[0]
        return ((bmm.args[0], bmm.args[1]), found) if len(bmm.users) == 1 else None
    for step, got in match_step(node):
        head = _head(got["x"], [*found, (step, got)])
        if head is not None:
            return head
    return None


def _untransposed(kt: torch.fx.Node) -> torch.fx.Node:
    """k from kᵀ: the permute's input when kᵀ is k.transpose(-1, -2), else a permute of kᵀ."""
    rank = kt.meta["val"].dim()
    swap = [*range(rank - 2), rank - 1, rank - 2]
    if kt.target is aten.permute.default and list(kt.args[1]) == swap:
        return kt.args[0]
    return insert_call(kt.next, aten.permute.default, (kt, swap))


def _mask(step, got, softmax, q, k, counts=None):
    """(additive float bias, bool mask over keys or None; causal band or None) of a mask
    step, or None. `counts`: the step is the only mask, and may become a mask over keys
    (fuse_causal.key_mask; a bool one is no term of a sum), its rewrite counted there."""
    m = got["m"]
    if not isinstance(m, torch.fx.Node):
        return None
    if step.kind == "bias":
        if not m.meta["val"].dtype.is_floating_point:
            return None
        causal = _causal(m, "zero", q, k)
        if causal is not None:
            return None, causal
        found = _key_mask(m, "zero", q, k) if counts is not None else None
        if found is None:
            return m, None
        counts.append("key_mask")
        return found
    fill = fuse_causal.constant(got["fill"])
    if m.meta["val"].dtype != torch.bool or fill is None:
        return None
    if not (fill == -math.inf or fill <= fuse_causal.DROPPED_FILL):
        return None
    causal = _causal(m, "true" if step.kind == "keep" else "false", q, k)
    if causal is not None:
        return None, causal
    if counts is not None and step.kind == "keep" and fill == -math.inf:
        found = _key_mask(m, "true", q, k)
        if found is not None:
            counts.append("key_mask")
            return found
    kept, dropped = (0.0, fill) if step.kind == "keep" else (fill, 0.0)
    return insert_call(softmax, aten.where.Scalar, (m, kept, dropped)), None
