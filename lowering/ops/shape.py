"""Shape and view ops. Graphs are functional, so a view is a new value: no aliasing to keep."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch._prims  # noqa: F401  (defines the prims ops registered below)
from jax import lax
from torch._ops import ops

from ...exc import LoweringError
from ..layout import dense_dim_order
from ..registry import register_lowering
from .common import cast, dim

aten = ops.aten


def _shape(x, shape):
    """torch's size list (one -1 allowed) for x."""
    shape = [int(s) for s in shape]
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = x.size // known if known else 0
    return tuple(shape)


@register_lowering(
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default
)
def view(x, shape):
    return jnp.reshape(x, _shape(x, shape))


@register_lowering(aten.view.dtype, needs_ctx=True)
def view_dtype(ctx, x, dtype):
    """The same bytes as another dtype; a size change scales the last dim, as in torch."""
    source = ctx.node.args[0].meta["val"].dtype
    if ctx.x64 == "narrow" and 8 in (source.itemsize, dtype.itemsize):
        raise NotImplementedError("view(dtype) of 64-bit values under x64='narrow' (narrowed)")
    return _from_bits(_to_bits(x), ctx.out_dtype)


def _to_bits(x):
    """x as a real (non-bool) array of its bytes: complex as (real, imag) pairs."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        pairs = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
        return pairs.reshape(*x.shape[:-1], -1) if x.ndim else pairs
    return x


def _from_bits(x, out):
    """The bytes of a real array `x` read as `out`, its last dim scaled by the size ratio."""
    if out == jnp.bool_:
        return _from_bits(x, jnp.dtype(jnp.uint8)) != 0
    if jnp.issubdtype(out, jnp.complexfloating):
        part = _from_bits(x, jnp.finfo(out).dtype)
        pairs = part.reshape(*part.shape[:-1], -1, 2)
        return lax.complex(pairs[..., 0], pairs[..., 1])
    ratio = x.dtype.itemsize / jnp.dtype(out).itemsize
    if ratio < 1:  # wider: consecutive elements join
        x = x.reshape(*x.shape[:-1], -1, round(1 / ratio))
    y = lax.bitcast_convert_type(x, out)
    return y.reshape(*x.shape[:-1], -1) if ratio > 1 else y


@register_lowering(aten.permute.default, aten.permute_copy.default)
def permute(x, dims):
    return jnp.transpose(x, [dim(d, x.ndim) for d in dims])


@register_lowering(aten.transpose.int, aten.transpose_copy.int)
def transpose(x, dim0, dim1):
    if x.ndim < 2:
        return x
    return jnp.swapaxes(x, dim(dim0, x.ndim), dim(dim1, x.ndim))


@register_lowering(aten.t.default, aten.t_copy.default)
def t(x):
    return x.T if x.ndim == 2 else x


@register_lowering(aten.expand.default, aten.expand_copy.default)
def expand(x, size, *, implicit=False):
    size = list(size)
    lead = len(size) - x.ndim
    target = [x.shape[i - lead] if s == -1 else int(s) for i, s in enumerate(size)]
    return jnp.broadcast_to(x, tuple(target))


@register_lowering(
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze_copy.default,
    aten.squeeze_copy.dim,
    aten.squeeze_copy.dims,
)
def squeeze(x, dims=None):
    if x.ndim == 0:
        return x
    if dims is None:
        axes = [i for i, s in enumerate(x.shape) if s == 1]
    else:
        axes = [dim(d, x.ndim) for d in ([dims] if isinstance(dims, int) else dims)]
        axes = [a for a in axes if x.shape[a] == 1]
    return jnp.squeeze(x, axis=tuple(axes)) if axes else x


@register_lowering(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def unsqueeze(x, d):
    return jnp.expand_dims(x, d % (x.ndim + 1))


@register_lowering(aten.cat.default, needs_ctx=True)
def cat(ctx, tensors, dim_=0):
    dtype = ctx.out_dtype
    parts = [cast(t, dtype) for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not parts:
        return jnp.zeros(ctx.out_shape, dtype)
    return jnp.concatenate(parts, axis=dim(dim_, parts[0].ndim))


@register_lowering(aten.stack.default, needs_ctx=True)
def stack(ctx, tensors, dim_=0):
    dtype = ctx.out_dtype
    return jnp.stack([cast(t, dtype) for t in tensors], axis=dim_ % (tensors[0].ndim + 1))


@register_lowering(aten.split.Tensor, aten.split_copy.Tensor)
def split(x, split_size, dim_=0):
    axis = dim(dim_, x.ndim)
    n = x.shape[axis]
    step = max(int(split_size), 1)
    return [lax.slice_in_dim(x, s, min(s + step, n), axis=axis) for s in range(0, max(n, 1), step)]


@register_lowering(aten.split_with_sizes.default, aten.split_with_sizes_copy.default)
def split_with_sizes(x, sizes, dim_=0):
    axis = dim(dim_, x.ndim)
    out, start = [], 0
    for size in sizes:
        out.append(lax.slice_in_dim(x, start, start + int(size), axis=axis))
        start += int(size)
    return out


@register_lowering(aten.unbind.int, aten.unbind_copy.int)
def unbind(x, dim_=0):
    axis = dim(dim_, x.ndim)
    return [
        jnp.squeeze(lax.slice_in_dim(x, i, i + 1, axis=axis), axis) for i in range(x.shape[axis])
    ]


def _slice_bounds(size, start, end, step):
    start = 0 if start is None else int(start)
    end = size if end is None else int(end)
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, int(step)


@register_lowering(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_(x, dim_=0, start=None, end=None, step=1):
    axis = dim(dim_, x.ndim)
    start, end, step = _slice_bounds(x.shape[axis], start, end, step)
    return lax.slice_in_dim(x, start, end, step, axis=axis)


@register_lowering(aten.slice_scatter.default)
def slice_scatter(x, src, dim_=0, start=None, end=None, step=1):
    axis = dim(dim_, x.ndim)
    start, end, step = _slice_bounds(x.shape[axis], start, end, step)
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, end, step)
    return x.at[tuple(index)].set(src.astype(x.dtype))


@register_lowering(aten.select.int, aten.select_copy.int)
def select(x, dim_, index):
    axis = dim(dim_, x.ndim)
    return lax.index_in_dim(x, int(index) % x.shape[axis], axis=axis, keepdims=False)


@register_lowering(aten.select_scatter.default)
def select_scatter(x, src, dim_, index):
    axis = dim(dim_, x.ndim)
    idx = [slice(None)] * x.ndim
    idx[axis] = int(index) % x.shape[axis]
    return x.at[tuple(idx)].set(src.astype(x.dtype))


@register_lowering(aten.narrow.default)
def narrow(x, dim_, start, length):
    axis = dim(dim_, x.ndim)
    start = int(start) % x.shape[axis] if x.shape[axis] else 0
    return lax.slice_in_dim(x, start, start + int(length), axis=axis)


@register_lowering(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal(x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, dim(dim1, x.ndim), dim(dim2, x.ndim))


@register_lowering(aten.flip.default)
def flip(x, dims):
    return jnp.flip(x, axis=tuple(dim(d, x.ndim) for d in dims)) if x.ndim else x


@register_lowering(aten.roll.default)
def roll(x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts).reshape(x.shape)
    return jnp.roll(x, shifts, axis=tuple(dim(d, x.ndim) for d in dims))


@register_lowering(aten.repeat.default)
def repeat(x, repeats):
    repeats = tuple(int(r) for r in repeats)
    x = x.reshape((1,) * (len(repeats) - x.ndim) + x.shape)
    return jnp.tile(x, repeats)


@register_lowering(
    aten.clone.default,
    aten.alias.default,
    aten.lift_fresh_copy.default,
    aten.detach.default,
    aten.contiguous.default,
    aten.alias_copy.default,
)
def identity(x, *, memory_format=None):
    return x


@register_lowering(ops.prims.convert_element_type.default, needs_ctx=True)
def convert_element_type(ctx, x, dtype):
    return cast(x, ctx.out_dtype)


@register_lowering(aten._to_copy.default, needs_ctx=True)
def to_copy(
    ctx,
    x,
    *,
    dtype=None,
    layout=None,
    device=None,
    pin_memory=None,
    non_blocking=False,
    memory_format=None,
):
    return cast(x, ctx.out_dtype)


def _pad_widths(pad, rank):
    """torch's pad list (last axis first, (low, high) pairs) as one (low, high) per axis."""
    widths = [(0, 0)] * rank
    for i in range(len(pad) // 2):
        widths[rank - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]))
    return widths


@register_lowering(aten.constant_pad_nd.default, needs_ctx=True)
def constant_pad_nd(ctx, x, pad, value=0):
    config = [(low, high, 0) for low, high in _pad_widths(pad, x.ndim)]
    return lax.pad(x, jnp.asarray(value, x.dtype), config)


def _replication_pad(x, pad):
    """Edge padding (torch's replication_padNd); negative widths crop first."""
    widths = _pad_widths(pad, x.ndim)
    x = lax.pad(x, jnp.zeros((), x.dtype), [(min(lo, 0), min(hi, 0), 0) for lo, hi in widths])
    return jnp.pad(x, [(max(lo, 0), max(hi, 0)) for lo, hi in widths], mode="edge")


@register_lowering(
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
)
def replication_pad_backward(grad, x, padding):
    return jax.vjp(lambda x_: _replication_pad(x_, padding), x)[1](grad)[0]


@register_lowering(aten.tril.default)
def tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@register_lowering(aten.triu.default)
def triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


def _reads_its_storage(node, at: int = 1) -> bool:
    """Whether a strided view (size, stride, offset from argument `at` on) reads only storage
    that its first argument covers, from offset 0, in a dense, non-overlapping layout of any dim
    order (its storage is then its values, reordered). With symbolic sizes, only a contiguous
    argument from offset 0 (the bounds are checked at lowering). A graph input read at an
    explicit offset is left to eager torch (the offset is absolute, and the same graph may be
    called with a view of the input's storage at another offset), unless the view is only
    returned: the caller then views the input it was called with."""
    base, size, stride = node.args[0].meta["val"], node.args[at], node.args[at + 1]
    offset = node.args[at + 2] if len(node.args) > at + 2 else node.kwargs.get("storage_offset")
    if offset is not None and node.args[0].op == "placeholder" and not _viewed_at_run_time(node):
        return False
    offset = 0 if offset is None else offset
    layout = [*base.shape, *base.stride(), base.storage_offset()]
    if not all(type(v) is int for v in [*size, *stride, offset, *layout]):
        return bool(base.is_contiguous() and base.storage_offset() == 0)
    if base.storage_offset() != 0 or dense_dim_order(base.shape, base.stride()) is None:
        return False
    return 0 in size or _last_position(size, stride, offset) < base.numel()


def _viewed_at_run_time(node) -> bool:
    """Whether a view of a graph input is only returned (every user is the output node): an
    output that views an input is made at run time from the input the graph is called with
    (eager's size, strides and absolute offset on that input's storage: stablehlo's
    `_aliased_outputs`, AOTAutograd's regenerated aliases), so the module's value goes unused.
    No backward reads it either: as_strided's gradient needs only the geometry."""
    return bool(node.target.is_view and node.users and all(u.op == "output" for u in node.users))


def _last_position(size, stride, offset) -> int:
    """The last storage position a strided view of a nonempty `size` reads."""
    return int(offset or 0) + sum((int(n) - 1) * int(s) for n, s in zip(size, stride))


def _storage(ctx, x):
    """(x's storage as a flat array, the dim order that lays x out in it)."""
    base = ctx.node.args[0].meta["val"]
    order = dense_dim_order(base.shape, base.stride())  # rules support only dense layouts
    return jnp.transpose(x, order).reshape(-1), order


def _strided_index(x, size, stride, storage_offset):
    """The positions in `_storage` of x that a strided view reads, shaped `size`; a view past
    x's storage is an error (jax would clamp the reads)."""
    last = _last_position(size, stride, storage_offset)
    if 0 not in size and last >= x.size:
        raise LoweringError(
            f"as_strided{tuple(size), tuple(stride), storage_offset} reads position {last} of "
            f"a storage of {x.size} elements"
        )
    index = jnp.asarray(int(storage_offset or 0), jnp.int64)
    for axis, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[axis] = int(n)
        index = index + (jnp.arange(int(n), dtype=jnp.int64) * int(s)).reshape(shape)
    return index


@register_lowering(
    aten.as_strided.default,
    aten.as_strided_copy.default,
    needs_ctx=True,
    supports=_reads_its_storage,
)
def as_strided(ctx, x, size, stride, storage_offset=None):
    storage, _ = _storage(ctx, x)
    return storage[_strided_index(x, size, stride, storage_offset)]


@register_lowering(
    aten.as_strided_scatter.default,
    needs_ctx=True,
    supports=lambda node: _reads_its_storage(node, at=2),
)
def as_strided_scatter(ctx, x, src, size, stride, storage_offset=None):
    storage, order = _storage(ctx, x)
    written = storage.at[_strided_index(x, size, stride, storage_offset)].set(src.astype(x.dtype))
    laid_out = written.reshape([x.shape[d] for d in order])
    return jnp.transpose(laid_out, [order.index(d) for d in range(x.ndim)])


@register_lowering(aten.view_as_real.default, aten.view_as_real_copy.default)
def view_as_real(x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


@register_lowering(aten.view_as_complex.default, aten.view_as_complex_copy.default)
def view_as_complex(x):
    return lax.complex(x[..., 0], x[..., 1])


@register_lowering(aten.copy.default, needs_ctx=True)
def copy(ctx, x, src, non_blocking=False):
    return jnp.broadcast_to(cast(src, ctx.out_dtype), x.shape)


@register_lowering(aten.narrow_copy.default)
def narrow_copy(x, dim_, start, length):
    return narrow(x, dim_, start, length)


@register_lowering(aten.diagonal_scatter.default)
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    d1, d2 = dim(dim1, x.ndim), dim(dim2, x.ndim)
    n = src.shape[-1]
    rows = jnp.arange(n) + max(-offset, 0)
    cols = jnp.arange(n) + max(offset, 0)
    moved = jnp.moveaxis(x, (d1, d2), (-2, -1))
    moved = moved.at[..., rows, cols].set(src.astype(x.dtype))
    return jnp.moveaxis(moved, (-2, -1), (d1, d2))


@register_lowering(aten.unfold.default)
def unfold(x, dimension, size, step):
    if x.ndim == 0:
        return x.reshape((1,))
    axis = dim(dimension, x.ndim)
    count = (x.shape[axis] - size) // step + 1
    starts = jnp.arange(count) * step
    index = starts[:, None] + jnp.arange(size)[None, :]  # [count, size]
    taken = jnp.take(x, index, axis=axis)  # inserts [count, size] at axis
    return jnp.moveaxis(taken, axis + 1, -1)


def _resize_within(node) -> bool:
    """A resize to no more elements than the input holds (more would be uninitialised memory)."""
    x, size = node.args[0].meta["val"], node.args[1]
    return math.prod(size) <= x.numel()


@register_lowering(aten.resize.default, supports=_resize_within)
def resize(x, size, *, memory_format=None):
    """The functional resize_: the first prod(size) elements in row-major order, reshaped."""
    return x.reshape(-1)[: math.prod(size)].reshape(size)
