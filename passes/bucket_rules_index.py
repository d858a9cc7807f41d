"""Padding rules of the ops that read or write by index: embedding, index, index_put, gather
and scatter (with the arange positions an embedding's bound is read from).
"""

from __future__ import annotations

import sympy
import torch

from .bucket_proof import Refused, size_expr
from .bucket_rules_dims import VIEWS

aten = torch.ops.aten


def _embedding(b, node):
    weight, indices = node.args[:2]
    if b._has_padding(weight):
        raise Refused(f"{node.name}: an embedding table with padded rows")
    rows, positions = weight.meta["val"].shape[0], _positions(indices)
    found = b.symbol_of(positions[0]) if positions and isinstance(rows, int) else None
    if found is not None:  # positions a + (0..s+c-1) look up a table: s <= rows - a - c
        b.bound(found[0], max(rows - positions[1] - found[1], 0))
    return (*b.layout(indices), (size_expr(node.meta["val"].shape[-1]),))


_SAME_VALUES = {*VIEWS, aten.unsqueeze.default, aten.expand.default, aten._to_copy.default}
_SAME_VALUES |= {aten.clone.default, aten.alias.default}
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_ADDS = {aten.add.Tensor, aten.add.Scalar}


def _positions(node) -> tuple[sympy.Expr, int] | None:
    """(length, first value) of the step-1 arange whose values `node` holds, through views,
    casts and adding an int (a first value that is a size counts as 0: it is >= 0); or None."""
    first = 0
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target in _SAME_VALUES or _whole_slice(node):
            node = node.args[0]
        elif node.target in _ADDS and _plain_int(node.args[1]) and not node.kwargs:
            first, node = first + node.args[1], node.args[0]
        else:
            break
    if not isinstance(node, torch.fx.Node) or node.target not in _ARANGES:
        return None
    start = 0 if node.target is aten.arange.default else node.args[0]
    step = node.args[2] if len(node.args) > 2 else 1
    first += start if _plain_int(start) else 0  # a symbolic start is a length: >= 0
    if step != 1 or first < 0:
        return None
    return size_expr(node.meta["val"].shape[0]), first


def _whole_slice(node) -> bool:
    """x[:] along a dim (x[:, None] of an index tensor): x's values."""
    if node.target is not aten.slice.Tensor:
        return False
    start, end, step = (list(node.args[2:5]) + [None, None, None])[:3]
    whole = end is None or (isinstance(end, int) and end >= 2**62)
    return start in (0, None) and whole and step in (1, None)


def _plain_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _index(b, node):
    """x[i0, i1, ...] by index tensors over x's leading dims. Real positions of the indices hold
    eager's values, which are inside the true sizes: they read real positions of x. A negative
    index into a padded dim would wrap at the bucket: it is wrapped at the true size first.
    Padded positions read some position of x (clamped if out of range), in padding only."""
    x, indices = node.args[:2]
    if not all(isinstance(i, torch.fx.Node) for i in indices):
        raise Refused(f"{node.name}: indexing with slices between index tensors")
    layout = b.layout(x)
    fixed = list(indices)
    for dim, index in enumerate(indices):
        if b._padded(layout[dim]):
            if len(layout[dim]) != 1:
                raise Refused(f"{node.name}: indexing into a merged padded dim")
            positions = _positions(index)
            if positions is not None:
                b.tie(layout[dim][0], positions[0] + positions[1])
            true = b.true_value(layout[dim][0], node)
            wrapped = b.insert(node, aten.add.Tensor, (index, true))
            negative = b.insert(node, aten.lt.Scalar, (index, 0))
            fixed[dim] = b.insert(node, aten.where.self, (negative, wrapped, index))
    if fixed != list(indices):
        b.replace_input(node, 1, fixed)
        b.ctx.rewrites["wrapped_indices"] += 1
    shape = node.meta["val"].shape
    rank = len(shape) - (len(layout) - len(indices))
    out = [(size_expr(d),) for d in shape[:rank]]
    for index in indices:
        for i, factors in enumerate(b.layout(index)):
            o = rank - len(b.layout(index)) + i
            if b._padded(factors):
                if b._padded(out[o]) and out[o] != factors:
                    raise Refused(f"{node.name}: indices padded differently in dim {o}")
                out[o] = factors
    return (*out, *layout[len(indices) :])


def _index_put(b, node):
    """index_put(x, indices, values, accumulate=True), the backward of x[indices]: the padded
    positions of `values` add 0 (where their indices point is anyone's guess)."""
    x, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if not accumulate and any(b._has_padding(i) for i in indices if i is not None):
        raise Refused(f"{node.name}: index_put without accumulate from padded indices")
    if not all(isinstance(i, torch.fx.Node) for i in indices):
        raise Refused(f"{node.name}: index_put with slices between index tensors")
    layout = b.layout(x)
    if any(b._padded(layout[d]) for d in range(len(indices))):
        raise Refused(f"{node.name}: index_put into a padded dim")
    rank = len(b.layout(values))
    b.replace_input(node, 2, b.mask(node, values, list(range(rank)), 0))
    return layout


def _gather(b, node):
    """gather(x, dim, index): the result has the index's layout; padded indices read some
    position of x (clamped if out of range), in padded positions only."""
    x, dim, index = node.args[:3]
    layout = b.layout(x)
    dim %= len(layout)
    if b._padded(layout[dim]):
        raise Refused(f"{node.name}: a gather along a padded dim")
    return b.layout(index)


def _scatter(b, node):
    """scatter(x, dim, index, value or src) along an unpadded dim: each position writes within
    its own row, so padded rows write padded rows only."""
    x, dim = node.args[:2]
    layout = b.layout(x)
    if b._padded(layout[dim % len(layout)]):
        raise Refused(f"{node.name}: a scatter along a padded dim")
    index = b.layout(node.args[2])
    if any(b._padded(f) and f != layout[i] for i, f in enumerate(index)):
        raise Refused(f"{node.name}: padded index rows would write real rows of the result")
    return layout


RULES = {
    aten.embedding.default: _embedding,
    aten.index.Tensor: _index,
    aten.gather.default: _gather,
    aten.scatter.value: _scatter,
    aten.scatter.src: _scatter,
    aten.index_put.default: _index_put,
}
