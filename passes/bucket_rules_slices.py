"""Padding rules of the ops that cut or join along a dim: slice, select, split, slice_scatter,
constant_pad_nd and cat.
"""

from __future__ import annotations

import operator

import sympy
import torch

from .bucket_proof import Refused, size_expr

aten = torch.ops.aten


def _slice(b, node):
    x = node.args[0]
    layout = b.layout(x)
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(layout)
    out_size = size_expr(node.meta["val"].shape[dim])
    in_size = size_expr(x.meta["val"].shape[dim])
    start = node.args[2] if len(node.args) > 2 else 0
    step = node.args[4] if len(node.args) > 4 else 1
    if b._padded(layout[dim]) and out_size == in_size and start in (0, None) and step == 1:
        return layout  # all of it (x[:n], n its size)
    end = node.args[3] if len(node.args) > 3 else None
    if b._padded(layout[dim]) and _is_head_slice(start, end, step, out_size):
        out = list(layout)  # x[a:e] of real positions only (the graph assumes n >= e)
        out[dim] = (out_size,)
        return tuple(out)
    if (
        b._padded(layout[dim])
        and start in (0, None)
        and step == 1
        and isinstance(end, torch.fx.Node)
        and size_expr(end.meta["val"]) == out_size
        and b.symbol_of(out_size) == (out_size, 0)
    ):  # x[:m], m a shorter length (a mask cut to the keys): buckets grow with sizes
        out = list(layout)
        out[dim] = (out_size,)
        return tuple(out)
    if b._padded(layout[dim]) and _is_tail_slice(layout[dim], start, node, step, out_size):
        return _tail(b, node, x, layout, dim, int(out_size))
    if b._padded(layout[dim]):
        # x[a:-c] of one padded factor: the real values start a earlier, c fewer are real
        end = node.args[3] if len(node.args) > 3 else None
        whole_end = end is None or (isinstance(end, int) and (end < 0 or end >= 2**62))
        whole_end = whole_end or (
            isinstance(end, torch.fx.Node) and size_expr(end.meta["val"]) == in_size
        )
        shrink = out_size - in_size
        if (
            len(layout[dim]) != 1
            or not isinstance(start, (int, type(None)))
            or (start or 0) < 0
            or step != 1
            or not whole_end
            or not shrink.is_Integer
            or b.symbol_of(out_size) is None
        ):
            raise Refused(
                f"{node.name}: a slice of a padded dim other than x[a:-c] "
                f"(start {start}, end {end}, step {step})"
            )
        out = list(layout)
        out[dim] = (out_size,)
        return tuple(out)
    out = list(layout)
    out[dim] = (out_size,)
    if out_size in b.symbols:  # a table sliced to a length: real rows first, valid padding
        if start not in (0, None) or step != 1 or not in_size.is_Integer:
            raise Refused(f"{node.name}: a slice to a padded length must start at 0")
        b.bound(out_size, int(in_size))
    return b.fresh_check(node, tuple(out))


def _is_head_slice(start, end, step, out_size) -> bool:
    return (
        isinstance(start, (int, type(None)))
        and (start or 0) >= 0
        and isinstance(end, int)
        and 0 <= end < 2**62
        and step == 1
        and out_size.is_Integer
    )


def _is_tail_slice(factors, start, node, step, out_size) -> bool:
    end = node.args[3] if len(node.args) > 3 else None
    whole_end = end is None or (isinstance(end, int) and end >= 2**62)
    return (
        len(factors) == 1
        and isinstance(start, int)
        and start < 0
        and whole_end
        and step == 1
        and out_size.is_Integer
    )


def _tail(b, node, x, layout, dim, k):
    """x[-k:] along a padded dim: the last k real positions, gathered from the true end."""
    index = b.insert(node, aten.arange.default, (k,), {"device": x.meta["val"].device})
    first = b.insert(node, operator.sub, (b.true_value(layout[dim][0], node), k))
    index = b.insert(node, aten.add.Tensor, (index, first))
    tail = b.insert(node, aten.index_select.default, (x, dim, index))
    out = list(layout)
    out[dim] = (sympy.Integer(k),)
    b.replace(node, tail, tuple(out))
    b.ctx.rewrites["tails"] += 1
    return tuple(out)


def _along_unpadded(b, node, dim_index, what):
    layout = b.layout(node.args[0])
    dim = (node.args[dim_index] if len(node.args) > dim_index else 0) % len(layout)
    if b._padded(layout[dim]):
        raise Refused(f"{node.name} ({node.target}) {what} a padded dim")
    return layout, dim


def _slice_scatter(b, node):
    """The backward of x[a:-c]: `src` written from a into zeros of x's size; along a padded dim
    the real values of `src` land on the real positions of the result, its padding past them."""
    base, src = node.args[:2]
    layout = b.layout(base)
    dim = (node.args[2] if len(node.args) > 2 else 0) % len(layout)
    start = node.args[3] if len(node.args) > 3 else 0
    if b._padded(layout[dim]) and (
        len(layout[dim]) != 1 or not isinstance(start, (int, type(None)))
    ):
        raise Refused(f"{node.name}: a slice_scatter into a merged or symbolic-start dim")
    return layout


def _constant_pad(b, node):
    """F.pad(x, (0, k), value) along one padded factor: the k values belong right after the
    true end, so every position from the true end on is set to `value`."""
    x, pads = node.args[:2]
    value = node.args[2] if len(node.args) > 2 else 0
    layout = list(b.layout(x))
    for i in range(len(pads) // 2):
        dim = len(layout) - 1 - i
        if pads[2 * i] or pads[2 * i + 1]:
            if b._padded(layout[dim]) and (len(layout[dim]) != 1 or pads[2 * i] != 0):
                raise Refused(f"{node.name}: padding before, or of a merged, padded dim")
            layout[dim] = (size_expr(node.meta["val"].shape[dim]),)
    out = tuple(layout)
    b.layouts[node] = out
    padded = [len(layout) - 1 - i for i in range(len(pads) // 2) if pads[2 * i + 1]]
    padded = [d for d in padded if b._padded(b.layout(x)[d])]
    if padded:
        users = list(node.users)
        filled = b.mask(node.next, node, padded, value, layout=b.layout(x))
        for user in users:
            user.replace_input_with(node, filled)
    return out


def _select(b, node):
    layout, dim = _along_unpadded(b, node, 1, "selects in")
    return tuple(f for i, f in enumerate(layout) if i != dim)


def _split(b, node):
    layout, dim = _along_unpadded(b, node, 2, "splits")
    outs = []
    for v in node.meta["val"]:
        out = list(layout)
        out[dim] = (size_expr(v.shape[dim]),)
        outs.append(tuple(out))
    return outs


def _cat(b, node):
    rank = len(node.meta["val"].shape)
    dim = (node.args[1] if len(node.args) > 1 else 0) % rank
    nonempty = [t for t in node.args[0] if all(size_expr(d) != 0 for d in t.meta["val"].shape)]
    if len(nonempty) == 1:
        return b.layout(nonempty[0])  # the others are empty (a cache before its first entry)
    padded = [i for i, t in enumerate(nonempty) if b._padded(b.layout(t)[dim])]
    out = list(b.layout(nonempty[0]))
    for t in nonempty[1:]:  # the other dims are equal in every piece; take any padded one
        out = [f if b._padded(f) else o for o, f in zip(out, b.layout(t))]
    out[dim] = (size_expr(node.meta["val"].shape[dim]),)
    out = tuple(out)
    if not padded:
        return out
    if len(padded) > 1 or len(b.layout(nonempty[padded[0]])[dim]) != 1:
        raise Refused(f"{node.name} concatenates several, or merged, padded dims")
    trailing = nonempty[padded[0] + 1 :]
    if not trailing:
        return out  # the padding stays at the end
    return _append(b, node, out, dim, trailing)


def _append(b, node, out, dim, trailing):
    """cat([..., padded, tail]) along the padded dim: the tail belongs right after the true end
    (a KV cache's new entries): gathered there from the tail, the padding after it."""
    rank = len(out)
    if len(trailing) > 1:
        tail = b.insert(node.next, aten.cat.default, (list(trailing), dim))
    else:
        tail = trailing[0]
    k = size_expr(tail.meta["val"].shape[dim])
    if not k.is_Integer:
        raise Refused(f"{node.name} appends a tail of size {k} after a padded dim")
    after = node.next
    device = node.meta["val"].device
    index = b.insert(
        after, aten.arange.default, (b.size_node(out[dim][0], after),), {"device": device}
    )
    head = b.insert(after, operator.sub, (b.true_value(out[dim][0], after), int(k)))
    rel = b.insert(after, aten.sub.Tensor, (index, head))
    rel = b.insert(after, aten.clamp.default, (rel, 0, int(k) - 1))
    placed = b.insert(after, aten.index_select.default, (tail, dim, rel))
    in_head = b.insert(after, aten.lt.Scalar, (index, head))
    shape = [1] * rank
    shape[dim] = -1
    in_head = b.insert(after, aten.view.default, (in_head, shape))
    fixed = b.insert(after, aten.where.self, (in_head, node, placed))
    b.replace(node, fixed, out)
    b.ctx.rewrites["appends"] += 1
    return out


RULES = {
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.slice_scatter.default: _slice_scatter,
    aten.constant_pad_nd.default: _constant_pad,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.cat.default: _cat,
}
