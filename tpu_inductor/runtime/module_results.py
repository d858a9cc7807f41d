"""What each result of a lowered module is for, and how the host receives the written ones.

`kinds` sorts a module's results by their reader (a graph output, a write-back, a saved
activation kept on the device, or nothing on the host); `write_part` brings a host tensor up to
date by the part a graph wrote (lowering/written_parts.py); `nbytes` is a spec's size.
"""

from __future__ import annotations

import collections
import math

import torch


def kinds(lowered, saved_outputs: frozenset[int], deferred: bool = False) -> list[str]:
    """Per module result, what reads it: "mutation" (a write-back, or the part of one that
    crosses), "output" (a graph output or a view's base), "kept" (only outputs in
    `saved_outputs`, as they are), or "device" (nothing on the host: the whole new value of an
    input whose host copy is updated by the part written). `deferred` (host_sync="explicit"):
    a write-back's value and parts are "deferred" (left on the device, the host copy stale)."""
    kinds = ["output"] * len(lowered.output_specs)
    readers: dict[int, set[str]] = collections.defaultdict(set)
    for index, slot in enumerate(lowered.outputs):
        if slot.result is not None:
            readers[slot.result].add(
                "saved" if index in saved_outputs and not slot.view else "other"
            )
        if slot.view and slot.input is None:
            readers[slot.view[0]].add("other")
    partial = {write.position for write in lowered.partial_writes}
    for position, result in lowered.mutations:
        whole = "device" if position in partial else "mutation"
        readers[result].add("deferred" if deferred else whole)
    for write in lowered.partial_writes:  # the part written crosses, not the whole
        for r in (write.piece, *(i for i in write.indices if i is not None)):
            readers[r].add("deferred" if deferred else "mutation")
    for r, seen in readers.items():
        if "mutation" in seen:
            kinds[r] = "mutation"
        elif seen == {"saved"}:
            kinds[r] = "kept"
        elif seen == {"device"}:
            kinds[r] = "device"
        elif seen == {"deferred"}:
            kinds[r] = "deferred"
    return kinds


def write_part(tensor: torch.Tensor, part, outs: list) -> None:
    """Bring `tensor` up to date by the part a graph wrote (a lowering.PartialWrite)."""
    if part.slice is not None:
        dim, start, end, step = part.slice
        torch.ops.aten.slice.Tensor(tensor, dim, start, end, step).copy_(outs[part.piece])
    else:
        indices = [None if i is None else outs[i] for i in part.indices]
        torch.ops.aten.index_put_.default(tensor, indices, outs[part.piece])


def nbytes(spec, dtype: torch.dtype) -> int:
    return math.prod(spec.shape) * dtype.itemsize
