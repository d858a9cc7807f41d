"""Strided layouts as torch lays them out, read by rules and by the partitioner alike."""

from __future__ import annotations


def dense_dim_order(sizes, strides) -> tuple[int, ...] | None:
    """The dims of a strided layout, outermost first, when its strides are contiguous strides in
    that order (dense, non-overlapping: its storage is its values, reordered); None otherwise."""
    order = tuple(sorted(range(len(sizes)), key=lambda d: -strides[d]))
    expected = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return order
