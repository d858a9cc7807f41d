"""fuse_matmuls: matmuls that share an operand → one matmul against the others concatenated,
its result split back (option `fusion.matmuls`). Rewrites, each group counted in `ctx.rewrites`
(and its matmuls under `matmuls`):

    mm(x, t(W1)), mm(x, t(W2)), ...        Q/K/V, gate/up: nn.Linear weights, graph inputs
                                           (x: one node, or equal nodes: same target,
                                           equal arguments)
        -> slice(mm(x, t(cat([W1, W2, ...]))), 1, ...)                    # shared_input
    addmm(b1, x, t(W1)), ...               biased projections (BERT)
        -> slice(addmm(cat([b1, ...]), x, t(cat([W1, ...]))), 1, ...)     # shared_input
    mm(x, W1), addmm(b1, x, W1), ...       Conv1D's untransposed weights: cat(W_i, 1)
    mm(A1, x), mm(A2, x), ...              their backward: each weight's gradient t(g_i)·x
        -> slice(mm(cat([A1, A2, ...]), x), 0, ...)                       # shared_right

A shared input's other operands must be weights: graph inputs (AOTAutograd's primals), as
they are or transposed (`permute(W, [1, 0])`, `t(W)`); the backward's, anything 2-d. Members
are one target (mm or addmm with beta = alpha = 1 and 1-d biases), one dtype, one contraction
size, and none reads another's result (that would be a cycle; checked). A shared operand is
one node or several equal ones (numbered as CSE does: an inference graph views the hidden
states once per projection, bucketing masks each weight gradient's x on its own), so the
merges fire at symbolic sizes too. GPT-2 has no group: Conv1D's c_attn already holds Q, K
and V in one weight, and no two of its projections share an input.

Where the concatenation happens: each concatenation of weights is marked
`meta[hoist_weights.MARK]`; an inference graph has it split out and made once per parameter
version (passes/hoist_weights.py, tpu_inductor/runtime/hoisted.py), a training graph (whose parameters
change every call anyway) and an AOT artifact do it in the graph. In the graph, XLA fuses it
into the dot for one token and copies the weights once per call from 16 tokens on (temporaries
and time: docs/benchmarks.md, "Matmul merging"). Off by default: on the CPU the merged models
ran within the noise of the unmerged ones.

Preserves: every result (each column or row of the merged matmul is the dot product it was;
float32 equal to 1e-6 against the unfused graph, tests/passes/test_fuse_matmuls.py), `node.meta["val"]`
(new nodes get theirs from fake tensors), each replaced result's contiguous layout (a split
along dim 1 is cloned dense: a later view may rely on its strides), the random streams (no
random op is touched), and the graph's topological order (users moved after the merged node).
"""

from __future__ import annotations

import collections

import torch

from . import hoist_weights
from .context import PassContext
from .fuse_patterns import same
from .graph_edits import insert_call

aten = torch.ops.aten
_MATMULS = (aten.mm.default, aten.addmm.default)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    if not ctx.options.fusion.matmuls:
        return gm
    from torch._inductor.pattern_matcher import stable_topological_sort

    for kind, grouping in (("shared_input", _by_input), ("shared_right", _by_right)):
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        for group in grouping(gm).values():
            group = _independent(group, order)
            if len(group) > 1:
                _merge(group, kind, order)
                ctx.rewrites[kind] += 1
                ctx.rewrites["matmuls"] += len(group)
        if ctx.rewrites[kind]:  # users of a merged matmul go after it
            stable_topological_sort(gm.graph)
    if ctx.rewrites:
        gm.graph.eliminate_dead_code()
    return gm


def _calls(gm: torch.fx.GraphModule):
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _MATMULS and node.users:
            if node.target is aten.mm.default or _plain_addmm(node):
                yield node


def _plain_addmm(node: torch.fx.Node) -> bool:
    """addmm(b, x, w) with beta = alpha = 1 and a 1-d bias of the result's columns."""
    bias = node.args[0]
    return (
        len(node.args) == 3
        and not node.kwargs
        and isinstance(bias, torch.fx.Node)
        and bias.meta["val"].dim() == 1
        and same(bias.meta["val"].shape, node.meta["val"].shape[1:])  # not one broadcast
    )


def _operands(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    return node.args[-2], node.args[-1]


def _weight(node: torch.fx.Node) -> tuple[torch.fx.Node, bool] | None:
    """(the graph input, transposed?) a matmul's right operand is, or None."""
    if node.op == "placeholder":
        return node, False
    transposed = node.op == "call_function" and (
        node.target is aten.t.default
        or (node.target is aten.permute.default and list(node.args[1]) == [1, 0])
    )
    if transposed and node.args[0].op == "placeholder":
        return node.args[0], True
    return None


def _key(node: torch.fx.Node, shared: torch.fx.Node, other: torch.fx.Node, *extra) -> tuple:
    val = other.meta["val"]
    return (node.target, shared, val.dtype, val.dim(), *extra)


def _values(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each node's first equal: the first node of its target with equal arguments (numbered
    in graph order, as CSE does), or itself for a graph input, a random or impure call. An
    inference graph views the hidden states once per projection; bucketing masks each weight
    gradient's x on its own: equal values, so one group."""
    first: dict[tuple, torch.fx.Node] = {}
    equal: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        equal[node] = node
        if node.op != "call_function" or node.is_impure():
            continue
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            continue
        key = (node.target, _hashable(node.args, equal), _hashable(node.kwargs, equal))
        try:
            equal[node] = first.setdefault(key, node)
        except TypeError:  # an argument that cannot be compared
            pass
    return equal


def _hashable(arg, equal: dict):
    """`arg` with nodes read as their first equal, containers as tuples, and numbers with
    their type (1, 1.0, True and -0.0 are not the same argument)."""
    if isinstance(arg, torch.fx.Node):
        return equal[arg]
    if isinstance(arg, (list, tuple)):
        return tuple(_hashable(a, equal) for a in arg)
    if isinstance(arg, dict):
        return tuple(sorted((k, _hashable(v, equal)) for k, v in arg.items()))
    if isinstance(arg, (bool, int, float)):
        return type(arg), repr(arg)
    return arg


def _by_input(gm: torch.fx.GraphModule) -> dict[tuple, list[torch.fx.Node]]:
    """Matmuls by their shared left operand, their right ones weights of one form."""
    groups, equal = collections.defaultdict(list), _values(gm)
    for node in _calls(gm):
        x, w = _operands(node)
        weight = _weight(w)
        if weight is not None and w.meta["val"].dim() == 2:
            groups[_key(node, equal[x], w, weight[1], _size(w, 0))].append(node)
    return groups


def _by_right(gm: torch.fx.GraphModule) -> dict[tuple, list[torch.fx.Node]]:
    """mm's by their shared right operand (a weight's gradient t(g)·x shares x)."""
    groups, equal = collections.defaultdict(list), _values(gm)
    for node in _calls(gm):
        a, x = _operands(node)
        if node.target is aten.mm.default and a.meta["val"].dim() == 2:
            groups[_key(node, equal[x], a, _size(a, 1))].append(node)
    return groups


def _size(node: torch.fx.Node, dim: int):
    size = node.meta["val"].shape[dim]
    return size if isinstance(size, int) else str(size)


def _independent(group: list[torch.fx.Node], order: dict) -> list[torch.fx.Node]:
    """The members, in graph order, that read no earlier member's result (transitively)."""
    kept: list[torch.fx.Node] = []
    for node in sorted(group, key=order.__getitem__):
        if not kept or not _reads(node, set(kept), order[kept[0]], order):
            kept.append(node)
    return kept


def _reads(node: torch.fx.Node, members: set, first: int, order: dict) -> bool:
    """Whether `node` reads any of `members` (none of which comes before position `first`)."""
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in members:
            return True
        if n in seen or order.get(n, first) < first:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


def _merge(group: list[torch.fx.Node], kind: str, order: dict) -> None:
    """One matmul after the group's last operand; each member's uses read its slice."""
    operands = [a for node in group for a in node.all_input_nodes]
    after = max(operands, key=order.__getitem__).next
    first = group[0]
    if kind == "shared_input":
        shared = _operands(first)[0]
        right, dim = _concatenated_weights([_operands(n)[1] for n in group], after), 1
        args = (shared, right)
    else:
        shared = _operands(first)[1]
        left = insert_call(after, aten.cat.default, ([_operands(n)[0] for n in group], 0))
        args, dim = (left, shared), 0
    if first.target is aten.addmm.default:
        bias = insert_call(after, aten.cat.default, ([n.args[0] for n in group],))
        bias.meta[hoist_weights.MARK] = kind == "shared_input"  # biases, graph inputs
        args = (bias, *args)
    merged = insert_call(after, first.target, args)
    start = 0
    for node in group:
        width = node.meta["val"].shape[dim]
        part = insert_call(after, aten.slice.Tensor, (merged, dim, start, start + width))
        if dim == 1:  # the slice of columns is strided; the replaced result was dense
            part = insert_call(
                after, aten.clone.default, (part,), {"memory_format": torch.contiguous_format}
            )
        part.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(part)
        start = start + width


def _concatenated_weights(rights: list[torch.fx.Node], after: torch.fx.Node) -> torch.fx.Node:
    """[W1ᵀ | W2ᵀ | ...] as t(cat(W_i)) for transposed weights (a fused Linear's weight),
    cat(W_i, 1) for Conv1D's."""
    weights = [_weight(w) for w in rights]
    transposed = weights[0][1]
    cat = insert_call(after, aten.cat.default, ([w for w, _ in weights], 0 if transposed else 1))
    cat.meta[hoist_weights.MARK] = True  # made once per parameter version at inference
    return insert_call(after, aten.permute.default, (cat, [1, 0])) if transposed else cat
