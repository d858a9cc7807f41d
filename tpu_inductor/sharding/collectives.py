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
_COMMENT = re.compile(r"/\*.*?\*/")  # `/*index=5*/` inside long tuple shapes and operand lists
# One instruction: `%name = shape op(%operand, ...), attributes`; a computation's first line.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>[\w.-]+) = (?P<shape>\([^=]*?\)|\S+) (?P<op>[a-z][\w-]*)"
    r"\((?P<operands>[^)]*)\)(?P<attributes>.*)$"
)
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.-]+) .*\{$")
_CALLS = re.compile(r"calls=%(?P<name>[\w.-]+)")
_NAME = re.compile(r"%([\w.-]+)")
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
    for match in _OP.finditer(_COMMENT.sub("", hlo_text)):
        entry = found.setdefault(match["kind"], collections.Counter())
        entry["count"] += 1
        entry["bytes"] += _bytes(match["shape"])
    return {kind: dict(found[kind]) for kind in KINDS if kind in found}


def sliced_all_reduces(hlo_text: str) -> dict[str, int]:
    """{"count", "bytes", "reduced_bytes"}: all-reduced values that every user slices to a part
    (the SPMD partitioner's form of a reduce-scatter: a partial sum reduced, each device keeping
    its shard). XLA's GPU and TPU pipelines rewrite it into one reduce-scatter
    (ReduceScatterCreator), moving a shard's bytes instead of the whole; XLA:CPU's keeps the
    all-reduce, so here it is counted apart. `bytes`: the slices', per device;
    `reduced_bytes`: the whole values' the all-reduces moved."""
    instructions, slicing = {}, set()  # name → (op, operands, shape, calls); slicing computations
    computation = None
    for line in _COMMENT.sub("", hlo_text).splitlines():
        if (head := _COMPUTATION.match(line)) is not None:
            computation = head["name"]
        elif (match := _INSTRUCTION.match(line)) is not None:
            calls = _CALLS.search(match["attributes"])
            operands = tuple(_NAME.findall(match["operands"]))
            instructions[match["name"]] = (
                match["op"],
                operands,
                match["shape"],
                calls and calls["name"],
            )
            if match["op"] == "dynamic-slice":
                slicing.add(computation)
    users = collections.defaultdict(list)
    for name, (_, operands, _, _) in instructions.items():
        for operand in operands:
            users[operand].append(name)
    found = collections.Counter()
    for name, (op, _, shape, _) in instructions.items():
        if op != "all-reduce":
            continue
        values = (
            [name]
            if not shape.startswith("(")
            else [u for u in users[name] if instructions[u][0] == "get-tuple-element"]
        )
        for value in values:
            slices = [instructions[u] for u in users[value]]
            if slices and all(
                (u[0] == "dynamic-slice" or (u[0] == "fusion" and u[3] in slicing))
                and _bytes(u[2]) < _bytes(instructions[value][2])
                for u in slices
            ):
                found["count"] += 1
                found["bytes"] += sum(_bytes(u[2]) for u in slices)
                found["reduced_bytes"] += _bytes(instructions[value][2])
    return dict(found)


def moved_bytes(communication: dict, platform: str) -> int:
    """The bytes per device a call's collectives move on `platform` (a `report`): XLA:CPU's as
    counted; on GPU and TPU each sliced all-reduce as the reduce-scatter their pipelines make
    of it (its slices' bytes, not the whole value's). Elsewhere than the platform compiled for,
    an estimate: the other pipeline's own choices are not seen."""
    moved = sum(entry["bytes"] for entry in communication["collectives"].values())
    if platform != "cpu":
        sliced = communication.get("sliced_all_reduces") or {}
        moved -= sliced.get("reduced_bytes", 0) - sliced.get("bytes", 0)
    return moved


_REPORTS: dict[str, dict] = {}  # by compile-cache key digest: a cache hit reads no HLO again
_KEPT_REPORTS = 256


def report(executable, device, key: str) -> dict:
    """The collectives of `executable` (compiled for `device`'s mesh) and each device's memory;
    `key`: the executable's compile-cache key digest (one report per key and process)."""
    if key in _REPORTS:
        return _REPORTS[key]
    if len(_REPORTS) >= _KEPT_REPORTS:
        del _REPORTS[next(iter(_REPORTS))]
    _REPORTS[key] = _report(executable, device)
    return _REPORTS[key]


def _report(executable, device) -> dict:
    text = "\n".join(module.to_string() for module in executable.hlo_modules())
    stats = executable.get_compiled_memory_stats()
    return {
        "mesh": dict(device.axes),
        "collectives": count(text),
        "sliced_all_reduces": sliced_all_reduces(text),
        "per_device_bytes": {
            "arguments": stats.argument_size_in_bytes,
            "temporaries": stats.temp_size_in_bytes,
            "outputs": stats.output_size_in_bytes,
        },
    }
