"""Indexing: advanced indexing, gather/scatter, index_* ops, masked ops, sort and topk.

Only ops whose output shape follows from input shapes are lowered. Indexing with a boolean
mask (`x[mask]`), like nonzero, masked_select or unique, has a data-dependent output shape: such
nodes are reported unsupported (the `supports=` predicates below, or no rule at all) and run in
eager torch. Assigning through a mask (`x[mask] = v`) keeps the shape of `x` and is lowered as a
select when `v` does not depend on how many elements the mask selects.

Out-of-range indices are not checked (torch raises; here they are clamped or wrapped).

Scatters that add (index_put and put with accumulate, index_add, scatter_add, scatter_reduce's
sum and mean) accumulate 16-bit floats in float32 and round once, as eager's CUDA kernels do
(eager CPU's index_add and scatter_add too; its index_put rounds after every add): a weight
gradient gathered from many rows (an MoE's `weight[expert_ids]`, a gather's backward) would
otherwise lose a bit per duplicate.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from . import common
from .common import cast

aten = ops.aten

_MASK_DTYPES = (torch.bool, torch.uint8)


def _add_at(x, where, values):
    """`x.at[where].add(values)` in `x`'s accumulation dtype, rounded once to `x`'s dtype."""
    acc = common.accumulation_dtype(x.dtype)
    return x.astype(acc).at[where].add(values.astype(acc)).astype(x.dtype)


def _index_vals(node: torch.fx.Node) -> list:
    """Fake values of an index/index_put node's index list (None where a dim is not indexed)."""
    return [i.meta.get("val") if isinstance(i, torch.fx.Node) else i for i in node.args[1]]


def _is_mask(val) -> bool:
    return isinstance(val, torch.Tensor) and val.dtype in _MASK_DTYPES


def _no_mask(node: torch.fx.Node) -> bool:
    """Supported when no index is a boolean mask (a mask's output shape depends on the data)."""
    return not any(_is_mask(v) for v in _index_vals(node))


def _integer_index(x, indices) -> tuple:
    return tuple(slice(None) if i is None else i for i in indices)


@register_lowering(aten.index.Tensor, aten._unsafe_index.Tensor, supports=_no_mask)
def index(x, indices):
    return x[_integer_index(x, indices)]


def _mask_put_layout(node: torch.fx.Node):
    """(position, mask rank, values) when an index_put writes through one mask, shape-static.

    That is: the only non-None index is a boolean mask, and the values are the same for every
    selected element (their dim that runs over the selected elements has size 1 or is absent).
    None for any other index_put.
    """
    vals = _index_vals(node)
    masks = [p for p, v in enumerate(vals) if _is_mask(v)]
    if len(masks) != 1 or any(v is not None for p, v in enumerate(vals) if p != masks[0]):
        return None
    position, mask = masks[0], vals[masks[0]]
    x, values = node.args[0].meta["val"], node.args[2].meta["val"]
    trailing = x.ndim - position - mask.ndim  # dims after the selected-elements dim
    if values.ndim > trailing and values.shape[values.ndim - 1 - trailing] != 1:
        return None
    return position, mask.ndim


def _index_put_supported(node: torch.fx.Node) -> bool:
    return _no_mask(node) or _mask_put_layout(node) is not None


@register_lowering(
    aten.index_put.default,
    aten._unsafe_index_put.default,
    needs_ctx=True,
    supports=_index_put_supported,
)
def index_put(ctx, x, indices, values, accumulate=False):
    values = cast(values, x.dtype)
    if _no_mask(ctx.node):
        where = _integer_index(x, indices)
        return _add_at(x, where, values) if accumulate else x.at[where].set(values)
    position, mask_rank = _mask_put_layout(ctx.node)
    mask = indices[position].astype(jnp.bool_)
    trailing = x.ndim - position - mask_rank
    # values broadcast to x[mask]'s shape with one selected element, then to x's dims.
    one = jnp.broadcast_to(values, x.shape[:position] + (1,) + x.shape[x.ndim - trailing :])
    one = one.reshape(x.shape[:position] + (1,) * mask_rank + x.shape[x.ndim - trailing :])
    mask = mask.reshape((1,) * position + mask.shape + (1,) * trailing)
    if accumulate:
        return x + jnp.where(mask, one, jnp.zeros((), x.dtype))
    return jnp.where(mask, one, x)


def _along(x, d, index) -> tuple:
    """An index tuple that selects `index` along dim `d` of `x` and everything elsewhere."""
    return (slice(None),) * common.dim(d, x.ndim) + (index.reshape(-1),)


def _on_1d(fn, x, *operands):
    """`fn(x, *operands)`; a 0-d `x` and its array operands run as 1-element vectors.

    torch treats dim 0 (or -1) of a scalar as a dim of size 1; jax has no such dim.
    """
    if x.ndim:
        return fn(x, *operands)
    out = fn(*(a.reshape(-1) if hasattr(a, "reshape") else a for a in (x, *operands)))
    return tuple(o.reshape(()) for o in out) if isinstance(out, tuple) else out.reshape(())


@register_lowering(aten.index_select.default, needs_ctx=True)
def index_select(ctx, x, d, index):
    return _on_1d(lambda v, i: v[_along(v, d, i)], x, index).reshape(ctx.out_shape)


@register_lowering(aten.index_add.default)
def index_add(x, d, index, source, *, alpha=1):
    source = cast(source if alpha == 1 else source * alpha, x.dtype)
    return _on_1d(lambda v, i, s: _add_at(v, _along(v, d, i), s), x, index, source)


@register_lowering(aten.index_copy.default)
def index_copy(x, d, index, source):
    return _on_1d(lambda v, i, s: v.at[_along(v, d, i)].set(cast(s, v.dtype)), x, index, source)


@register_lowering(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(x, d, index, value):
    return _on_1d(lambda v, i: v.at[_along(v, d, i)].set(cast(value, v.dtype)), x, index)


@register_lowering(aten.take.default)
def take(x, index):
    return x.reshape(-1)[index]


def _grid(index, d) -> tuple:
    """gather/scatter's index tuple: `index` along dim `d`, each element's own position elsewhere."""
    axis = common.dim(d, index.ndim)
    return tuple(
        index if a == axis else lax.broadcasted_iota(index.dtype, index.shape, a)
        for a in range(index.ndim)
    )


def _scatter_source(src, index, dtype):
    """The part of `src` that scatter reads (its leading index.shape block), or a scalar."""
    if not hasattr(src, "shape") or src.ndim == 0:
        return cast(src, dtype)
    return src[tuple(slice(0, n) for n in index.shape)].astype(dtype)


@register_lowering(aten.gather.default)
def gather(x, d, index, *, sparse_grad=False):
    return _on_1d(lambda v, i: v[_grid(i, d)], x, index)


_SCATTER_OPS = {
    None: lambda at, v: at.set(v),
    "multiply": lambda at, v: at.multiply(v),
    "prod": lambda at, v: at.multiply(v),
    "amax": lambda at, v: at.max(v),
    "amin": lambda at, v: at.min(v),
}


def _scatter(x, d, index, src, reduce=None):
    def run(v, i, s):
        source = _scatter_source(s, i, v.dtype)
        if reduce in ("add", "sum"):
            return _add_at(v, _grid(i, d), source)
        return _SCATTER_OPS[reduce](v.at[_grid(i, d)], source)

    return _on_1d(run, x, index, src)


@register_lowering(
    aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce
)
def scatter(x, d, index, src, *, reduce=None):
    return _scatter(x, d, index, src, reduce)


@register_lowering(aten.scatter_add.default)
def scatter_add(x, d, index, src):
    return _scatter(x, d, index, src, "add")


def _identity(reduce, dtype):
    """The value a reduction starts from where include_self=False drops the input."""
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf if reduce == "amax" else jnp.inf
    info = jnp.iinfo(dtype)
    return info.min if reduce == "amax" else info.max


@register_lowering(aten.scatter_reduce.two)
def scatter_reduce(x, d, index, src, reduce, *, include_self=True):
    base = x if include_self else _scatter(x, d, index, _identity(reduce, x.dtype))
    if reduce != "mean":
        return _scatter(base, d, index, src, reduce)
    # the mean of 16-bit floats divides the float32 sum: one rounding
    acc = common.accumulation_dtype(x.dtype)
    src = src.astype(acc) if hasattr(src, "astype") else src
    total = _scatter(base.astype(acc), d, index, src, "sum")
    count = _scatter(jnp.full(x.shape, int(include_self), x.dtype), d, index, 1, "sum")
    count = jnp.maximum(count, jnp.ones((), x.dtype))
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jnp.floor_divide(total, count)
    return (total / count.astype(acc)).astype(x.dtype)


@register_lowering(aten.index_reduce.default)
def index_reduce(x, d, index, source, reduce, *, include_self=True):
    """scatter_reduce with `index` spread over `source`'s other dims (as Inductor decomposes)."""

    def reduce_1d(v, i, s):
        axis = common.dim(d, v.ndim)
        shape = [1] * s.ndim
        shape[axis] = -1
        spread = jnp.broadcast_to(i.reshape(shape), s.shape)
        return scatter_reduce(v, axis, spread, s, reduce, include_self=include_self)

    return _on_1d(reduce_1d, x, index, source)


@register_lowering(aten.masked_fill.Scalar, aten.masked_fill.Tensor, needs_ctx=True)
def masked_fill(ctx, x, mask, value):
    out = jnp.where(mask, cast(value, x.dtype), x)
    return jnp.broadcast_to(out, ctx.out_shape)


@register_lowering(aten.masked_scatter.default, needs_ctx=True)
def masked_scatter(ctx, x, mask, source):
    # The k-th selected position (row-major) takes source's k-th element.
    shape = ctx.out_shape
    mask = jnp.broadcast_to(mask, shape)
    x = jnp.broadcast_to(x, shape)
    if source.size == 0:
        return x
    position = jnp.cumsum(mask.reshape(-1).astype(jnp.int32)) - 1
    picked = source.reshape(-1)[jnp.clip(position, 0, source.size - 1)].reshape(shape)
    return jnp.where(mask, picked.astype(x.dtype), x)


def _argsort(x, d, descending):
    """Stable sort order of `x` along dim `d` (NaN sorts as the largest value, as in torch)."""
    return jnp.argsort(x, axis=common.dim(d, x.ndim), stable=True, descending=descending)


@register_lowering(aten.sort.default, aten.sort.stable, needs_ctx=True)
def sort(ctx, x, dim=-1, descending=False, *, stable=False):
    index_dtype = ctx.jax_dtype(torch.int64)

    def run(v):
        order = _argsort(v, dim, descending)
        return jnp.take_along_axis(v, order, common.dim(dim, v.ndim)), order.astype(index_dtype)

    return _on_1d(run, x)


@register_lowering(aten.argsort.default, aten.argsort.stable, needs_ctx=True)
def argsort(ctx, x, dim=-1, descending=False, *, stable=False):
    return _on_1d(lambda v: _argsort(v, dim, descending).astype(ctx.out_dtype), x)


@register_lowering(aten.topk.default, needs_ctx=True)
def topk(ctx, x, k, dim=-1, largest=True, sorted=True):
    index_dtype = ctx.jax_dtype(torch.int64)

    def run(v):
        axis = common.dim(dim, v.ndim)
        if largest:  # lax.top_k: the k largest along the last axis, ties by lower index
            values, order = lax.top_k(jnp.moveaxis(v, axis, -1), int(k))
            values, order = jnp.moveaxis(values, -1, axis), jnp.moveaxis(order, -1, axis)
        else:
            order = lax.slice_in_dim(_argsort(v, axis, False), 0, int(k), axis=axis)
            values = jnp.take_along_axis(v, order, axis)
        return values, order.astype(index_dtype)

    return _on_1d(run, x)


@register_lowering(aten.put.default)
def put(x, index, source, accumulate=False):
    """x.flatten()[index] = source (+= when accumulating), negative indices from the end."""
    flat, index = x.reshape(-1), index.reshape(-1)
    index = jnp.where(index < 0, index + flat.shape[0], index)
    source = source.reshape(-1).astype(x.dtype)
    if not accumulate:
        out = flat.at[index].set(source)
    else:  # a bool sum is an or
        out = flat.at[index].max(source) if x.dtype == jnp.bool_ else _add_at(flat, index, source)
    return out.reshape(x.shape)


@register_lowering(aten.nonzero_static.default, needs_ctx=True)
def nonzero_static(ctx, x, *, size, fill_value=-1):
    """The first `size` indices of nonzero elements (row-major), then rows of `fill_value`."""
    if x.ndim == 0:  # one index of no dims: [size, 0]
        return jnp.zeros(ctx.out_shape, ctx.out_dtype)
    found = jnp.nonzero(x, size=int(size), fill_value=fill_value)
    return jnp.stack(found, axis=1).astype(ctx.out_dtype)
