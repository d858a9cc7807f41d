"""Padding rules of the ops that keep, reduce or rearrange dims: pointwise ops (broadcasting),
reductions, views, permutes, squeezes, expands and matrix products.
"""

from __future__ import annotations

import math

import sympy
import torch

from .bucket_proof import Refused, size_expr

aten = torch.ops.aten


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


def _topk(b, node):
    """topk along an unpadded dim (an MoE router's experts): each row on its own."""
    layout = b.layout(node.args[0])
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)) % len(layout)
    if b._padded(layout[dim]):
        raise Refused(f"{node.name} ({node.target}) picks along a padded dim")
    out = tuple(
        (size_expr(node.meta["val"][0].shape[dim]),) if i == dim else f
        for i, f in enumerate(layout)
    )
    return [out, out]


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
    aten.topk.default: _topk,
    **dict.fromkeys((aten.mm.default, aten.bmm.default, aten.addmm.default), _contract),
}
