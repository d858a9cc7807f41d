"""Small FX graph edits the fusion passes share: insert a call with true fake metadata, and
keep a replaced value's memory layout for the views after it."""

from __future__ import annotations

import torch

aten = torch.ops.aten


def insert_call(before: torch.fx.Node, target, args, kwargs=None) -> torch.fx.Node:
    """A call of `target` before `before`, its meta["val"] from the fake values of its args,
    in their fake mode (the graph inputs' where the args hold no tensor)."""
    graph = before.graph
    with graph.inserting_before(before):
        node = graph.call_function(target, tuple(args), kwargs)
    vals = torch.fx.node.map_arg(node.args, lambda n: n.meta["val"])
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    if not tensors:  # e.g. scalar_tensor(eps): the graph's own fake mode, from its inputs
        tensors = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
        tensors = [v for v in tensors if isinstance(v, torch.Tensor)]
    mode = torch._guards.detect_fake_mode(tensors)
    with mode if mode is not None else torch._subclasses.fake_tensor.unset_fake_temporarily():
        node.meta["val"] = target(*vals, **node.kwargs)
    node.meta["stack_trace"] = before.meta.get("stack_trace")
    return node


def keep_layout(node: torch.fx.Node, like: torch.Tensor) -> None:
    """`node`'s users read its value in `like`'s layout where the two differ: a view after the
    replaced node may rely on its strides (the CPU SDPA kernels return [B, L, H, D]-strided
    results; the op, contiguous ones), and a graph with symbolic sizes has its strides derived
    again per size (passes/shapes.py), where such a view is refused.

        x -> permute(clone(permute(x, order)), inverse)   # the values unchanged
    """
    order = list(like.dim_order())
    if list(node.meta["val"].dim_order()) == order:
        return
    users, after = list(node.users), node.next
    inverse = sorted(range(len(order)), key=order.__getitem__)
    physical = insert_call(after, aten.permute.default, (node, order))
    dense = insert_call(
        after, aten.clone.default, (physical,), {"memory_format": torch.contiguous_format}
    )
    logical = insert_call(after, aten.permute.default, (dense, inverse))
    for user in users:
        user.replace_input_with(node, logical)


# --- SDPA ----------------------------------------------------------------------------------
