"""The communication report of an executable split over a device mesh.

From the optimized HLO XLA's SPMD partitioner produced: each collective it inserted
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute) with how many there are
and the bytes their results hold per device; and from the executable's memory analysis, what
each device holds (arguments, temporaries, results). In compile.json ("communication"), dumps
and `tpu-inductor explain`.
"""

from __future__ import annotations

import collections
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# `%name = f32[8,16]{1,0} all-reduce(...)`, a tuple result `(f32[4], f32[8]) all-to-all(...)`,
# and the async forms (`all-gather-start`; its `-done` is not counted again).
_OP = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\("
)
_ARRAY = re.compile(r"\b(?P<dtype>pred|[a-z]+(?P<bits>[0-9]+))\[(?P<dims>[0-9,]*)\]")


def _bytes(shape: str) -> int:
    """Bytes of an HLO result shape (`f32[8,16]{1,0}` or a tuple of such; pred is a byte)."""
    total = 0
    for match in _ARRAY.finditer(shape):
        count = 1
        for dim in filter(None, match["dims"].split(",")):
            count *= int(dim)
        total += count * (int(match["bits"]) // 8 if match["bits"] else 1)
    return total


def count(hlo_text: str) -> dict[str, dict[str, int]]:
    """Collective kind → {"count", "bytes"} (per device) in optimized HLO text."""
    found: dict[str, collections.Counter] = {}
    for match in _OP.finditer(hlo_text):
        entry = found.setdefault(match["kind"], collections.Counter())
        entry["count"] += 1
        entry["bytes"] += _bytes(match["shape"])
    return {kind: dict(found[kind]) for kind in KINDS if kind in found}


def report(executable, device) -> dict:
    """The collectives of `executable` (compiled for `device`'s mesh) and each device's memory."""
    text = "\n".join(module.to_string() for module in executable.hlo_modules())
    stats = executable.get_compiled_memory_stats()
    return {
        "mesh": dict(device.axes),
        "collectives": count(text),
        "per_device_bytes": {
            "arguments": stats.argument_size_in_bytes,
            "temporaries": stats.temp_size_in_bytes,
            "outputs": stats.output_size_in_bytes,
        },
    }


def line(communication: dict) -> str:
    """One line for `tpu-inductor explain`."""
    ops = communication["collectives"]
    found = ", ".join(f"{kind} x{e['count']} ({e['bytes']} B)" for kind, e in ops.items())
    memory = communication["per_device_bytes"]
    return (
        f"mesh {communication['mesh']}: {found or 'no collectives'}; per device: arguments "
        f"{memory['arguments']} B, temporaries {memory['temporaries']} B"
    )
