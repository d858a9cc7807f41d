"""Which part of a written input a graph changes, so the host's copy is updated by that part only.

A static KV cache is written one position per decode step (`index_copy_`, `cache[:, :, pos] =
kv`): AOTAutograd's graph computes the whole new cache (`index_put(cache, [None, None, pos],
kv)`) and copies it into the input. Where the new value is such a scatter into the input
itself, the module also returns the written part — the indices (made non-negative and in range,
as the device used them) and the new value read back at them — and the runtime writes that part
into the host tensor (`index_put_`, or a slice's `copy_`) instead of the whole value, which stays
on the device as the tensor's copy. Reading the part back from the new value (not the values
written) makes the host equal the device wherever the scatter wrote, whichever of two writes to
one place the device kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class PartialWrite:
    """The host update of written input `position` (a graph input): module result `piece` holds
    the new values of the part written, at `indices` (per leading dim, the module result of its
    index tensor, or None: the whole dim; for `index_put_`) or in `slice` (dim, start, end, step;
    for a slice's `copy_`). The whole new value is the mutation's own result, on the device."""

    position: int
    piece: int
    indices: tuple[int | None, ...] = ()
    slice: tuple[int, int, int, int] | None = None


@dataclasses.dataclass
class Part:
    """What the lowering returns besides for one partial write: the index arrays (None: a whole
    dim) and their torch dtypes, or the slice, and the piece."""

    piece: Any
    indices: list = dataclasses.field(default_factory=list)
    index_dtypes: list = dataclasses.field(default_factory=list)
    slice: tuple[int, int, int, int] | None = None


def part(write: torch.fx.Node, load: Callable[[Any], Any], new) -> Part | None:
    """The written part of AOTAutograd's `copy_(input, value)` node `write`, whose new value (a
    jax array) is `new`; None when the value is not a scatter into the input itself, or the
    part is not smaller than the whole."""
    source = write.args[1]
    if not isinstance(source, torch.fx.Node) or source.op != "call_function" or new.ndim == 0:
        return None
    if source.args[0] is not write.args[0]:
        return None
    found = None
    if source.target is aten.index_put.default and not _accumulates(source):
        found = _indexed(source.args[1], load(source.args[1]), new)
    elif source.target is aten.index_copy.default:
        dim = source.args[1] % new.ndim
        found = _indexed(
            [None] * dim + [source.args[2]], [None] * dim + [load(source.args[2])], new
        )
    elif source.target is aten.slice_scatter.default:
        found = _sliced(source, new)
    if found is None or found.piece.size >= new.size:
        return None
    return found


def _accumulates(node: torch.fx.Node) -> bool:
    return bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))


def _indexed(nodes: list, arrays: list, new) -> Part | None:
    """`new` read back at integer index tensors (negative ones wrapped, all clipped in range)."""
    import jax.numpy as jnp

    indices, dtypes = [], []
    for dim, (node, array) in enumerate(zip(nodes, arrays)):
        if node is None:
            indices.append(None)
            dtypes.append(None)
            continue
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dtype not in (torch.int64, torch.int32):
            return None  # a mask, or a Python index
        size = new.shape[dim]
        indices.append(jnp.clip(jnp.where(array < 0, array + size, array), 0, size - 1))
        dtypes.append(val.dtype)
    at = tuple(slice(None) if i is None else i for i in indices)
    return Part(new[at], indices, dtypes)


def _sliced(node: torch.fx.Node, new) -> Part | None:
    """`new` read back in a slice_scatter's static slice."""
    from jax import lax

    from .ops.shape import _slice_bounds

    given = {**dict(zip(("dim", "start", "end", "step"), node.args[2:])), **node.kwargs}
    dim, start, end, step = (
        given.get(k, d) for k, d in (("dim", 0), ("start", None), ("end", None), ("step", 1))
    )
    if not all(v is None or isinstance(v, int) for v in (dim, start, end, step)):
        return None  # a symbolic bound
    axis = dim % new.ndim
    start, end, step = _slice_bounds(new.shape[axis], start, end, step)
    return Part(lax.slice_in_dim(new, start, end, step, axis=axis), slice=(axis, start, end, step))
