"""Causal-mask detection for the attention fusion: a mask built inside the graph → a diagonal.

A mask the graph computes from sizes alone (arange compares, tril of ones, a `full` and-ed in,
HF's where(bool, 0, min) bias) is evaluated once, at compile time, when every size it depends
on is concrete: no placeholder (so no buffer or input) and no random op among its ancestors.
It is causal with diagonal d when the keys it keeps are exactly j <= i + d for every leading
index, with d = 0 (torch's is_causal) or d = S - L (a decode step: fewer queries than keys, the
queries at the end), and a sliding window w when they are i + d - w < j <= i + d (a `Band`); every dropped key must be -inf, or a finite fill no score reaches
(<= -1e30, HF's finfo.min), so that the flag changes no result. A mask with symbolic sizes, or
one read from an input (GPT-2's bias buffer is a graph input), is left as a mask: still fused
and exact, only without the flag.

`key_mask` splits a padding mask the same way: a keep-mask (or its where(keep, 0, -inf) bias)
that is the and of one term read from the inputs over keys alone ([..., 1, 1, S]: HF's padding
mask, indexed per batch) and terms computed from sizes alone that are all true or causal
(HF's `sdpa_mask` ands its query-side `q_idx >= 0`, the causal tril and a sliding window into
it) is that term and a band: the forms the TPU's Splash kernel takes (segment ids, its causal mask).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

aten = torch.ops.aten
_AND = (aten.bitwise_and.Tensor, aten.logical_and.default)
_LARGEST = 1 << 24  # elements: a mask larger than this is not evaluated
DROPPED_FILL = -1e30  # a fill at or below this acts as -inf next to any finite score


class Band(NamedTuple):
    """The keys a causal mask keeps for query i: j <= i + diagonal, and with a window (a
    sliding window) i + diagonal - window < j as well."""

    diagonal: int
    window: int | None = None


def band(mask: torch.fx.Node, *, keep_when: str, queries, keys) -> Band | None:
    """The causal band `mask` stands for, or None. `keep_when` says how it keeps a key:
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
    return _band(keep, queries, keys)


def _band(keep: torch.Tensor, queries: int, keys: int) -> Band | None:
    if keep.dim() < 2 or tuple(keep.shape[-2:]) not in ((queries, keys), (1, keys)):
        return None
    ones = torch.ones(queries, keys, dtype=torch.bool)
    window = int(keep.sum(-1).max())  # a band's widest row holds the whole window
    for d in dict.fromkeys((0, keys - queries)):
        if d < 0:
            continue
        tril = ones.tril(d)
        if bool(torch.all(keep == tril)):
            return Band(d)
        if window and bool(torch.all(keep == (tril & ~ones.tril(d - window)))):
            return Band(d, window)
    return None


def key_mask(mask: torch.fx.Node, *, keep_when: str, queries, keys):
    """(a bool mask over keys alone or None, a causal Band or None) that keep what `mask`
    keeps, or None. `keep_when`: "true" (a bool keep-mask) or "zero" (a float bias, read only
    as where(keep, 0, -inf): a finite fill would differ where a row keeps nothing)."""
    if not isinstance(queries, int) or not isinstance(keys, int):
        return None
    if keep_when == "zero":
        if mask.target is not aten.where.self or len(mask.args) != 3:
            return None
        if constant(mask.args[1]) != 0.0 or constant(mask.args[2]) != -float("inf"):
            return None
        mask = mask.args[0]
    if not isinstance(mask, torch.fx.Node) or _dtype(mask) != torch.bool:
        return None
    key, sizes_only = None, None  # the term read from the inputs; the others and-ed
    for term in _and_terms(mask):
        value = _evaluate(term)
        if value is None:
            if key is not None or not _over_keys(term, keys):
                return None
            key = term
        elif value.dtype != torch.bool:
            return None
        else:
            sizes_only = value if sizes_only is None else sizes_only & value
    if sizes_only is None or bool(sizes_only.all()):
        return key, None
    found = _band(sizes_only, queries, keys)
    return None if found is None else (key, found)


def _and_terms(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The terms `node` ands together, through the expands that broadcast them."""
    while node.target is aten.expand.default:
        node = node.args[0]
    if node.target in _AND and all(isinstance(a, torch.fx.Node) for a in node.args[:2]):
        return [*_and_terms(node.args[0]), *_and_terms(node.args[1])]
    return [node]


def _over_keys(term: torch.fx.Node, keys: int) -> bool:
    val = term.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and val.dtype == torch.bool
        and val.dim() >= 3
        and tuple(val.shape[-3:]) == (1, 1, keys)
    )


def _dtype(node: torch.fx.Node):
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def constant(fill) -> float | None:
    """A fill's value: a number, or a 0-d scalar_tensor / full of one."""
    if isinstance(fill, (int, float)) and not isinstance(fill, bool):
        return float(fill)
    if isinstance(fill, torch.fx.Node) and fill.target is aten.scalar_tensor.default:
        return float(fill.args[0])
    if isinstance(fill, torch.fx.Node) and fill.target is aten.full.default and not fill.args[0]:
        return float(fill.args[1])
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
