"""The transfer ledger: bytes that cross between the host and the device, by direction and kind.

On a TPU or GPU every tensor that crosses a graph boundary moves over the host link; the CPU
PJRT client shares memory with torch, so the cost is invisible here. The runtime counts each
crossing as an accelerator would pay it, whatever the CPU client does underneath:

  host_to_device  argument      a graph input sent for this call
                  parameter     a parameter or buffer sent (the first call; after it changed)
                  saved         an activation saved for the backward that came back from the host
  device_to_host  output        a graph output returned to torch
                  saved         an activation saved for the backward, returned to the host
                  mutation      a buffer the graph wrote, copied back into its host tensor
                  materialized  a value kept on the device (tensors.DeviceTensor) read by eager
                                code
                  synced        a host copy left stale (host_sync="explicit") brought up to
                                date by tpu_inductor.sync()

What stays on the device (parameters while unchanged, saved activations the backward reads,
state a compiled graph wrote) counts nothing. Per process here (`transfers()`), per compiled
graph on `CompiledGraph.ledger`; each compile record holds its graph's per-call figures.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

HOST_TO_DEVICE = "host_to_device"
DEVICE_TO_HOST = "device_to_host"
KINDS = {
    HOST_TO_DEVICE: ("argument", "parameter", "saved"),
    DEVICE_TO_HOST: ("output", "saved", "mutation", "materialized", "synced"),
}

CALLS = ("calls", "")  # the key that counts executions, besides the bytes
_process: collections.Counter = collections.Counter()  # (direction, kind) → bytes


class CallCount:
    """The steady-state calls of one graph, counted on the call path as one increment
    (`count.calls += 1`), summed into bytes when read: `entries` is what one call moves, a
    tuple of ((direction, kind), bytes), CALLS included."""

    __slots__ = ("entries", "calls", "at_reset")

    def __init__(self, entries: tuple):
        self.entries, self.calls, self.at_reset = entries, 0, 0


_counts: list[CallCount] = []  # every graph's, the dead ones' too (one per compiled graph)


def add(
    entries: Iterable[tuple[tuple[str, str], int]], ledger: collections.Counter | None = None
) -> None:
    """Count `entries` ((direction, kind), bytes) in the process's ledger and in `ledger`."""
    for key, count in entries:
        _process[key] += count
        if ledger is not None:
            ledger[key] += count


def call_count(entries: tuple) -> CallCount:
    """A graph's call counter, whose calls the process's ledger sums (each moving `entries`)."""
    count = CallCount(entries)
    _counts.append(count)
    return count


def summed(calls: collections.Counter, *others: collections.Counter) -> collections.Counter:
    """(direction, kind) → bytes of `calls` (entries → calls, as `CallCount` has them), and
    of `others`."""
    total: collections.Counter = collections.Counter()
    for other in others:
        total.update(other)
    for entries, count in calls.items():
        for key, size in entries:
            total[key] += size * count
    return total


def as_dict(ledger: collections.Counter) -> dict[str, dict[str, int]]:
    """{direction: {kind: bytes}}, every kind present (0 where nothing crossed)."""
    return {
        direction: {kind: int(ledger[direction, kind]) for kind in kinds}
        for direction, kinds in KINDS.items()
    }


def transfers() -> dict:
    """The bytes this process moved (or, on the CPU, would have moved on an accelerator)
    between host and device, by direction and kind, and the executions counted."""
    calls: collections.Counter = collections.Counter()
    for count in _counts:
        calls[count.entries] += count.calls - count.at_reset
    total = summed(calls, _process)
    return {**as_dict(total), "calls": total[CALLS]}


def reset() -> None:
    """Start the process's ledger again from zero (a benchmark's steady state, a test)."""
    _process.clear()
    for count in _counts:
        count.at_reset = count.calls
