"""The padding rules of passes/bucket_shapes.py: per ATen op, the layout of its result (which
dims carry padding, as row-major factors) from its inputs', masking the inputs the op reads
across with the op's identity. A rule raises `Refused` for what it cannot prove exact."""

from __future__ import annotations

import math
import operator

import sympy
import torch

aten = torch.ops.aten


class Refused(Exception):
    """The graph cannot be proven exact under padding: the reason."""


def size_expr(d) -> sympy.Expr:
    """A size (an int or a SymInt) as a sympy expression."""
    return d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(int(d))


_POINTWISE_EXTRA = {aten._to_copy.default, aten.alias.default, aten.detach.default}
_POINTWISE_EXTRA |= {aten.lift_fresh_copy.default, aten.copy.default}
_POINTWISE_EXTRA |= {aten.full_like.default, aten.zeros_like.default, aten.ones_like.default}
_POINTWISE_EXTRA |= {aten.empty_like.default}
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# Reductions: op -> (identity to mask padding with, where its dims are: an arg index or "all").
_REDUCE = {
    aten.sum.dim_IntList: (0, 1),
    aten.sum.default: (0, "all"),
    aten.amax.default: (-math.inf, 1),
    aten.amin.default: (math.inf, 1),
    aten.max.dim: (-math.inf, 1),
    aten.min.dim: (math.inf, 1),
    aten.argmax.default: (-math.inf, 1),
    aten.argmin.default: (math.inf, 1),
    aten.logsumexp.default: (-math.inf, 1),
    aten._softmax.default: (-math.inf, 1),
    aten._log_softmax.default: (-math.inf, 1),
    aten.any.dim: (False, 1),
    aten.any.dims: (False, 1),
    aten.all.dim: (True, 1),
    aten.prod.dim_int: (1, 1),
    aten.cumsum.default: (0, 1),
}
_KEEPS_DIMS = {aten._softmax.default, aten._log_softmax.default, aten.cumsum.default}
_MEAN = {aten.mean.dim: 1, aten.mean.default: "all"}


# --- rules: (analysis, node) -> the result's layout, masking inputs as the op needs -------------


def _dims_arg(node, where, rank):
    if where == "all":
        return list(range(rank))
    dims = node.args[where] if len(node.args) > where else node.kwargs.get("dim")
    if dims is None or dims == []:
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [d % max(rank, 1) for d in dims]


def _keepdim(node, index) -> bool:
    return bool(node.args[index]) if len(node.args) > index else node.kwargs.get("keepdim", False)


def _reduced(layout, dims, keepdim):
    if keepdim:
        return tuple((sympy.Integer(1),) if i in dims else f for i, f in enumerate(layout))
    return tuple(f for i, f in enumerate(layout) if i not in dims)


def _reduce(b, node):
    fill, where = _REDUCE[node.target]
    x = node.args[0]
    layout = b.layout(x)
    dims = _dims_arg(node, where, len(layout))
    b.replace_input(node, 0, b.mask(node, x, dims, fill))
    if node.target in _KEEPS_DIMS:
        return layout
    out = _reduced(layout, dims, where != "all" and _keepdim(node, 2))
    return [out, out] if node.target in (aten.max.dim, aten.min.dim) else out


def _mean(b, node):
    x = node.args[0]
    layout = b.layout(x)
    dims = _dims_arg(node, _MEAN[node.target], len(layout))
    keepdim = node.target is aten.mean.dim and _keepdim(node, 2)
    out = _reduced(layout, dims, keepdim)
    if not any(b._padded(layout[d]) for d in dims):
        return out
    dtype = node.kwargs.get("dtype") or (node.args[3] if len(node.args) > 3 else None)
    total = b.insert(
        node, aten.sum.dim_IntList, (b.mask(node, x, dims, 0), dims, keepdim), {"dtype": dtype}
    )
    mean = b.insert(node, aten.div.Tensor, (total, b.true_count(node, layout, dims)))
    node.replace_all_uses_with(mean)
    b.graph.erase_node(node)
    b.ctx.rewrites["means"] += 1
    b.layouts[mean] = out
    return out


def _broadcast(b, node):
    shape = node.meta["val"].shape
    rank = len(shape)
    out = [(size_expr(d),) for d in shape]
    for a in node.all_input_nodes:
        value = a.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        layout = b.layout(a)
        for i, factors in enumerate(layout):
            o = rank - len(layout) + i
            if b._padded(factors):
                if b._padded(out[o]) and out[o] != factors:
                    raise Refused(f"{node.name}: operands padded differently in dim {o}")
                out[o] = factors
    return tuple(out)


def _view(b, node):
    """Regroup the input's factors into the output's dims (static factors may split); a padded
    factor that would be split, or merged with one it is not next to, cannot be followed."""
    factors = [f for dim in b.layout(node.args[0]) for f in dim if f != 1]
    out, i = [], 0
    for d in node.meta["val"].shape:
        remaining, group = size_expr(d), []
        while remaining != 1:
            if i >= len(factors):
                raise Refused(
                    f"{node.name} ({node.target}) reshapes a padded dim across dims "
                    f"({b.layout(node.args[0])} to {tuple(node.meta['val'].shape)})"
                )
            f = factors[i]
            if f.is_Integer and remaining.is_Integer and f > remaining:
                if f % remaining:
                    raise Refused(f"{node.name} ({node.target}) splits a dim unevenly")
                group.append(remaining)
                factors[i], remaining = f // remaining, sympy.Integer(1)
                continue
            quotient = sympy.cancel(remaining / f)
            if not quotient.as_numer_denom()[1].is_Integer or (
                quotient.is_Rational and not quotient.is_Integer
            ):
                raise Refused(
                    f"{node.name} ({node.target}) reshapes a padded dim across dims "
                    f"({b.layout(node.args[0])} to {tuple(node.meta['val'].shape)})"
                )
            group.append(f)
            remaining, i = quotient, i + 1
        out.append(tuple(group) or (sympy.Integer(1),))
    if i < len(factors):
        raise Refused(f"{node.name} ({node.target}) reshapes a padded dim across dims")
    return tuple(out)


def _permute(b, node):
    layout = b.layout(node.args[0])
    if node.target is aten.permute.default:
        return tuple(layout[d % len(layout)] for d in node.args[1])
    if node.target is aten.t.default:
        return tuple(reversed(layout))
    i, j = (d % len(layout) for d in node.args[1:3])
    out = list(layout)
    out[i], out[j] = out[j], out[i]
    return tuple(out)


def _unsqueeze(b, node):
    layout = list(b.layout(node.args[0]))
    layout.insert(node.args[1] % (len(layout) + 1), (sympy.Integer(1),))
    return tuple(layout)


def _squeeze(b, node):
    layout = b.layout(node.args[0])
    shape = node.args[0].meta["val"].shape
    dims = list(range(len(layout))) if len(node.args) < 2 else node.args[1]
    dims = {d % len(layout) for d in ([dims] if isinstance(dims, int) else dims)}
    return tuple(f for i, f in enumerate(layout) if not (i in dims and size_expr(shape[i]) == 1))


def _expand(b, node):
    layout = b.layout(node.args[0])
    shape = node.meta["val"].shape
    extra = len(shape) - len(layout)
    out = [(size_expr(d),) for d in shape[:extra]]
    for i, factors in enumerate(layout):
        out.append(factors if factors != (sympy.Integer(1),) else (size_expr(shape[extra + i]),))
    return b.fresh_check(node, tuple(out))


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


def _contract(b, node):
    """mm, bmm, addmm: a padded contracted dim masked to 0 in both operands."""
    first = 1 if node.target is aten.addmm.default else 0
    a, w = node.args[first], node.args[first + 1]
    la, lw = b.layout(a), b.layout(w)
    r = len(la)
    if b._padded(la[r - 1]) or b._padded(lw[r - 2]):
        b.replace_input(node, first, b.mask(node, a, [r - 1], 0))
        b.replace_input(node, first + 1, b.mask(node, w, [r - 2], 0))
    batch = [la[0] if b._padded(la[0]) else lw[0]] if r == 3 else []
    return tuple([*batch, la[r - 2], lw[r - 1]])


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
        if node.target in _SAME_VALUES:
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


def _layer_norm_layouts(b, node, x, normalized):
    layout = b.layout(x)
    k = len(normalized)
    if any(b._padded(f) for f in layout[len(layout) - k :]):
        raise Refused(f"{node.name}: layer norm over a padded dim")
    return layout, k


def _layer_norm(b, node):
    layout, k = _layer_norm_layouts(b, node, node.args[0], node.args[1])
    stats = layout[: len(layout) - k] + ((sympy.Integer(1),),) * k
    return [layout, stats, stats]


def _layer_norm_backward(b, node):
    layout, k = _layer_norm_layouts(b, node, node.args[1], node.args[2])
    leading = list(range(len(layout) - k))
    for index in (0, 1, 3, 4):  # grad, x, mean, rstd: the weight and bias grads sum over rows
        b.replace_input(node, index, b.mask(node, node.args[index], leading, 0))
    params = tuple((size_expr(d),) for d in node.args[1].meta["val"].shape[len(layout) - k :])
    return [layout, params, params]


def _softmax_backward(b, node):
    grad, out, dim = node.args[:3]
    dim %= len(b.layout(grad))
    b.replace_input(node, 0, b.mask(node, grad, [dim], 0))
    b.replace_input(node, 1, b.mask(node, out, [dim], 0))
    return b.layout(grad)


def _embedding_backward(b, node):
    grad, indices = node.args[:2]
    b.replace_input(node, 0, b.mask(node, grad, list(range(len(b.layout(indices)))), 0))
    return tuple((size_expr(d),) for d in node.meta["val"].shape)


def _nll_forward(b, node):
    x, target, _, reduction, ignore_index = node.args[:5]
    b.replace_input(node, 0, b.mask(node, x, [0], 0))
    b.replace_input(node, 1, b.mask(node, target, [0], ignore_index))
    return [b.layout(target) if reduction == 0 else (), ()]


def _nll_backward(b, node):
    b.replace_input(node, 2, b.mask(node, node.args[2], [0], node.args[5]))
    return b.layout(node.args[1])


def attention(b, node):
    """Attention, forward and backward: padded keys get a -inf bias (causal attention over one
    padded length needs none: real queries never see them); every padded operand, and the
    padding of a given mask, is made neutral, so that 0 · NaN never reaches a real position."""
    backward = node.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    q, k, v = node.args[1:4] if backward else node.args[:3]
    causal = node.args[7 if backward else 4] if len(node.args) > (7 if backward else 4) else False
    lq, lk, lv = b.layout(q), b.layout(k), b.layout(v)
    if node.args[6 if backward else 3] if len(node.args) > (6 if backward else 3) else 0:
        raise Refused(f"{node.name}: attention with dropout over padded dims")
    given = node.kwargs.get("attn_mask")
    if isinstance(given, torch.fx.Node) and b._has_padding(given):
        # its padding may hold anything (+inf from a padded input): neutral there, so that a
        # padded row's weights stay finite and 0 · their gradient stays 0
        neutral = True if given.meta["val"].dtype == torch.bool else 0.0
        dims = list(range(len(b.layout(given))))
        node.kwargs = {**node.kwargs, "attn_mask": b.mask(node, given, dims, neutral)}
    if b._padded(lk[2]) and not (causal and lq[2] == lk[2]):
        if causal:
            raise Refused(f"{node.name}: attention over padded keys, causal across lengths")
        _mask_keys(b, node, k, lk)  # forward and backward alike: the weights of padded keys are 0
    for index, a in enumerate(node.args[: 6 if backward else 3]):
        if isinstance(a, torch.fx.Node):
            b.replace_input(node, index, b.mask(node, a, list(range(len(b.layout(a)))), 0))
    if backward:
        return [lq, lk, lv]
    return [(*lq[:3], lv[3]), lq[:3]]


def _mask_keys(b, node, k, lk):
    """Non-causal attention over padded keys: a -inf bias on them, added to the node's mask."""
    valid = b.valid_positions(node, lk[2], device=k.meta["val"].device)
    valid = b.insert(node, aten.view.default, (valid, [1, 1, 1, -1]))
    given = node.kwargs.get("attn_mask")
    if given is not None and given.meta["val"].dtype == torch.bool:
        mask = b.insert(node, aten.logical_and.default, (given, valid))
    else:
        mask = b.insert(node, aten.where.Scalar, (valid, 0.0, -math.inf))
        if given is not None:
            mask = b.insert(node, aten.add.Tensor, (given, mask))
    node.kwargs = {**node.kwargs, "attn_mask": mask}
    b.ctx.rewrites["key_masks"] += 1


def _pointwise(b, node):
    return _broadcast(b, node)


RULES = {
    **dict.fromkeys(_REDUCE, _reduce),
    **dict.fromkeys(_MEAN, _mean),
    **dict.fromkeys(VIEWS, _view),
    **dict.fromkeys(_POINTWISE_EXTRA, _pointwise),
    **dict.fromkeys((aten.permute.default, aten.transpose.int, aten.t.default), _permute),
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.squeeze.default: _squeeze,
    aten.expand.default: _expand,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.slice_scatter.default: _slice_scatter,
    aten.constant_pad_nd.default: _constant_pad,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.cat.default: _cat,
    **dict.fromkeys((aten.mm.default, aten.bmm.default, aten.addmm.default), _contract),
    aten.embedding.default: _embedding,
    aten.index.Tensor: _index,
    aten.gather.default: _gather,
    aten.scatter.value: _scatter,
    aten.scatter.src: _scatter,
    aten.index_put.default: _index_put,
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _softmax_backward,
    aten.embedding_dense_backward.default: _embedding_backward,
    aten.nll_loss_forward.default: _nll_forward,
    aten.nll_loss_backward.default: _nll_backward,
    aten._scaled_dot_product_flash_attention_for_cpu.default: attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: attention,
}


def rule_by_tag(target):
    return _pointwise if torch.Tag.pointwise in getattr(target, "tags", ()) else None
