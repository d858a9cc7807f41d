"""Padding rules of FlexAttention's higher-order ops, `flex_attention` and its backward.

Which positions attend is the `mask_mod` subgraph's (the lowering reads the block mask's
tables only to pass over the key blocks no query block lists, and never its lengths:
lowering/ops/flex_attention.py), so padded keys are masked in it: the mask_mod is replaced
by a copy that ands `kv_idx < true_keys`, the true key length a new captured tensor (the
pass's 0-d true-size input). Real query rows then see eager's keys, eager's
scores and eager's mask; padded query rows are whatever they are, and are sliced off. So that
they never reach a gradient, every padded operand (q, k, v, the captured tensors, and in the
backward the output, its logsumexp and their gradients) is made 0 there: a padded row's
gradient of the output is 0, so its scores' gradient is 0 and it adds nothing to dk, dv or a
captured bias's gradient; finite operands keep 0 · that gradient 0.

    %o = flex_attention(%q, %k, %v, %score, (%s, %s, ..., %mask), ...)
      -> %o = flex_attention(%q', %k', %v', %score, (%s, %s, ..., %mask_keys), ...,
                             (*bufs, %true_s))
         %mask_keys(b, h, q, kv, *bufs, n) = %mask(b, h, q, kv, *bufs) & (kv < n)

A block mask's tables made at the true lengths list no padded block; tables whose own dims are
padded hold garbage in padded query blocks' rows and past each row's count, which only padded
query rows read. Refused: heads or head dims padded, a key length that is a merged dim.
"""

from __future__ import annotations

import copy

import torch

from .bucket_proof import Refused

aten, hop = torch.ops.aten, torch.ops.higher_order

# where each op's operands sit: (q, k, v), other padded tensors, block mask, score / mask buffers
_FORWARD = ((0, 1, 2), (), 4, 7, 8)
_BACKWARD = ((0, 1, 2), (3, 4, 5, 6), 9, 12, 13)
SHAPES = {hop.flex_attention: _FORWARD, hop.flex_attention_backward: _BACKWARD}
_SCORE_MOD = {hop.flex_attention: 3, hop.flex_attention_backward: 7}


def reads_as_size(gm, node, size) -> bool:
    """Whether a flex_attention op `node` takes the SymInt node `size` as a size only: among
    its block mask's lengths (the lowering reads mask_mod alone), or as a captured argument
    its subgraph does not read (Dynamo passes the sizes of a captured tensor along)."""
    _, _, block_at, score_at, mask_at = SHAPES[node.target]
    score_mod = getattr(gm, node.args[_SCORE_MOD[node.target]].target)
    mask_mod = getattr(gm, node.args[block_at][-1].target)
    for graph, first, at in ((score_mod, 5, score_at), (mask_mod, 4, mask_at)):
        inputs = list(graph.graph.find_nodes(op="placeholder"))
        if any(a is size and inputs[first + i].users for i, a in enumerate(node.args[at])):
            return False
    return True


def flex_attention(b, node):
    """The rule of both ops: padded keys masked in mask_mod, padded operands made 0."""
    qkv, others, block_at, score_at, mask_at = SHAPES[node.target]
    q, k, v = (node.args[i] for i in qkv)
    lq, lk, lv = b.layout(q), b.layout(k), b.layout(v)
    for name, layout in (("query", lq), ("key", lk), ("value", lv)):
        if b._padded(layout[1]) or b._padded(layout[3]):
            raise Refused(f"{node.name}: flex_attention with padded {name} heads or head dims")
    if b._padded(lk[2]):
        if len(lk[2]) != 1:
            raise Refused(f"{node.name}: flex_attention over keys of a merged padded dim")
        _mask_keys(b, node, lk[2][0], block_at, mask_at)
    for index in (*qkv, *others):
        _zero_padding(b, node, index)
    for at in (score_at, mask_at):
        buffers = list(node.args[at])
        for i, buffer in enumerate(buffers):
            if isinstance(buffer, torch.fx.Node) and b._has_padding(buffer):
                buffers[i] = _zeroed(b, node, buffer)
        b.replace_input(node, at, tuple(buffers))
    if node.target is hop.flex_attention_backward:
        grads = [_layout_or_none(b, t) for t in node.args[score_at]]
        return [lq, lk, lv, grads]
    rows = lq[:3]
    return [(*rows, lv[3]), rows, rows]


def _mask_keys(b, node, factor, block_at, mask_at):
    """mask_mod anded with `kv_idx < true keys`, the true length its last captured tensor."""
    true = b.true_value(factor, node)
    block = list(node.args[block_at])
    mask_node = block[-1]
    limited = _limited(getattr(b.gm, mask_node.target))
    name = _free_name(b.gm, f"{mask_node.target}_keys")
    b.gm.add_submodule(name, limited)
    with b.graph.inserting_before(node):
        block[-1] = b.graph.get_attr(name)
    b.replace_input(node, block_at, tuple(block))
    b.replace_input(node, mask_at, (*node.args[mask_at], true))
    b.ctx.rewrites["key_masks"] += 1


def _limited(mask_mod: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `mask_mod` with one more argument n, its result anded with `kv_idx < n`."""
    graph = copy.deepcopy(mask_mod.graph)
    inputs = list(graph.find_nodes(op="placeholder"))
    (output,) = graph.find_nodes(op="output")
    (result,) = output.args if not isinstance(output.args[0], (tuple, list)) else output.args[0]
    with graph.inserting_after(inputs[-1]):
        limit = graph.placeholder("true_keys")
    limit.meta["val"] = torch.zeros((), dtype=torch.int64)
    with graph.inserting_before(output):
        below = graph.call_function(aten.lt.Tensor, (inputs[3], limit))
        kept = graph.call_function(aten.bitwise_and.Tensor, (result, below))
    below.meta["val"] = kept.meta["val"] = torch.zeros((), dtype=torch.bool)
    output.args = (kept,)
    return torch.fx.GraphModule(mask_mod, graph)


def _free_name(gm, base: str) -> str:
    name, n = base, 0
    while hasattr(gm, name):
        n += 1
        name = f"{base}_{n}"
    return name


def _zero_padding(b, node, index):
    arg = node.args[index]
    if isinstance(arg, torch.fx.Node) and b._has_padding(arg):
        b.replace_input(node, index, _zeroed(b, node, arg))


def _zeroed(b, node, x):
    """`x` with 0 (False) in the padding of every dim."""
    fill = False if x.meta["val"].dtype == torch.bool else 0.0
    return b.mask(node, x, list(range(len(b.layout(x)))), fill)


def _layout_or_none(b, x):
    return b.layout(x) if isinstance(x, torch.fx.Node) else None


RULES = {target: flex_attention for target in SHAPES}
