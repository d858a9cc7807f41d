"""Causal-mask detection for the attention fusion: a mask built inside the graph → a diagonal.

A mask the graph computes from sizes alone (arange compares, tril of ones, a `full` and-ed in,
HF's where(bool, 0, min) bias) is evaluated once, at compile time, when every size it depends
on is concrete: no placeholder (so no buffer or input) and no random op among its ancestors.
It is causal with diagonal d when the keys it keeps are exactly j <= i + d for every leading
index, with d = 0 (torch's is_causal) or d = S - L (a decode step: fewer queries than keys, the
queries at the end); every dropped key must be -inf, or a finite fill no score reaches
(<= -1e30, HF's finfo.min), so that the flag changes no result. A mask with symbolic sizes, or
one read from an input (GPT-2's bias buffer is a graph input), is left as a mask: still fused
and exact, only without the flag.
"""

from __future__ import annotations

import torch

_LARGEST = 1 << 24  # elements: a mask larger than this is not evaluated
DROPPED_FILL = -1e30  # a fill at or below this acts as -inf next to any finite score


def diagonal(mask: torch.fx.Node, *, keep_when: str, queries, keys) -> int | None:
    """The causal diagonal `mask` stands for, or None. `keep_when` says how it keeps a key:
    "true" (a bool keep-mask), "false" (a bool drop-mask) or "zero" (an additive bias)."""
    value = _evaluate(mask)
    if value is None or not isinstance(queries, int) or not isinstance(keys, int):
        return None
    if keep_when == "zero":
        if value.dtype == torch.bool:
            return None
        keep = value == 0
        if not bool(torch.all(keep | (value <= DROPPED_FILL))):
            return None
    else:
        if value.dtype != torch.bool:
            return None
        keep = value if keep_when == "true" else ~value
    if keep.dim() < 2 or tuple(keep.shape[-2:]) not in ((queries, keys), (1, keys)):
        return None
    for d in dict.fromkeys((0, keys - queries)):
        tril = torch.ones(queries, keys, dtype=torch.bool).tril(d)
        if d >= 0 and bool(torch.all(keep == tril)):
            return d
    return None


def _evaluate(node: torch.fx.Node) -> torch.Tensor | None:
    """`node`'s value computed from constants and concrete sizes, or None if it reads anything
    else (a placeholder, an attribute, a random op) or has a symbolic size."""
    order, seen, todo = [], set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op != "call_function" or not _concrete(n):
            return None
        if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            return None
        order.append(n)
        todo.extend(n.all_input_nodes)
    values: dict[torch.fx.Node, object] = {}
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        for n in sorted(order, key=_position(node.graph)):
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), values.__getitem__)
            values[n] = n.target(*args, **kwargs)
    value = values[node]
    return value if isinstance(value, torch.Tensor) else None


def _concrete(n: torch.fx.Node) -> bool:
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        sizes = tuple(val.shape)
        if not all(isinstance(s, int) for s in sizes):
            return False
        count = 1
        for s in sizes:
            count *= s
        return count <= _LARGEST
    return isinstance(val, (tuple, list))  # e.g. a split's results: their getitems are checked


def _position(graph: torch.fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__
