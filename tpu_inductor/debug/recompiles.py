"""Recompile explanations: why a graph compiles again (which input or option changed, from what
to what) and what would avoid it, set on the new compile's record and logged at INFO.

Records are debug/records.py's `CompileRecord`s, read by their fields (this module is below
records.py, which calls it, so it does not import it)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def describe_input(value: Any) -> str:
    """An input signature entry as text: "float32[8, 16]" for a tensor, repr for a scalar."""
    if _is_tensor_entry(value):
        shape, dtype = value
        return f"{dtype.removeprefix('torch.')}[{', '.join(map(str, shape))}]"
    return repr(value)


def _is_tensor_entry(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], tuple)
        and isinstance(value[1], str)
    )


def explain_recompile(
    old: tuple,
    new: tuple,
    *,
    same_graph: bool,
    old_options: dict | None = None,
    new_options: dict | None = None,
) -> str:
    """Why a graph compiled for `old` inputs is compiled again for `new` ones, and the remedy.

    `same_graph`: the same (symbolic-shape) graph is specialized again, rather than Dynamo
    handing over an identical graph for the new static shapes.
    """
    changes: list[str] = []
    advice: list[str] = []
    if len(old) != len(new):
        changes.append(f"the number of inputs changed from {len(old)} to {len(new)}")
    sizes: dict[tuple[int, int], dict] = {}  # one symbol's change: (from, to) -> where
    for position, (before, after) in enumerate(zip(old, new)):
        if before == after:
            continue
        if _is_tensor_entry(before) and _is_tensor_entry(after):
            if before[1] == after[1] and len(before[0]) == len(after[0]):
                for d, (a, b) in enumerate(zip(before[0], after[0])):
                    if a != b:
                        sizes.setdefault((a, b), {}).setdefault(d, []).append(position)
            else:
                changes.append(_tensor_change(position, before, after, advice))
        elif same_graph and isinstance(before, int) and isinstance(after, int):
            sizes.setdefault((before, after), {}).setdefault(None, []).append(position)
        else:
            kind = " (a symbolic size or number)" if same_graph else ""
            changes.append(
                f"input {position}{kind}: {describe_input(before)} → {describe_input(after)}"
            )
            if not any(_is_tensor_entry(v) and v != w for v, w in zip(old, new)):
                advice.append("pass a number that varies and sets no size as a 0-d tensor")
    pads = []  # per size: the first dim that carries it
    for (a, b), where in sizes.items():
        changes.append(f"size {a} → {b} at {_places(where)}")
        dims = [(d, p) for d, positions in where.items() if d is not None for p in positions]
        if dims:
            others = f" (and every dim of size {a})" if len(dims) > 1 else ""
            pads.append((dims[0], f"dim {dims[0][0]} of input {dims[0][1]}{others}"))
        elif not any(_is_tensor_entry(v) and v != w for v, w in zip(old, new)):
            advice.append("pass a number that varies and sets no size as a 0-d tensor")
    if pads:
        why = (
            "a graph with symbolic sizes compiles once per size here"
            if same_graph
            else f"torch._dynamo.mark_dynamic(input, {pads[0][0][0]}) before the first call "
            "spares Dynamo's new traces, not the compile per size"
        )
        advice.append(
            f"pad {' and '.join(text for _, text in pads)} to a few fixed sizes, one compile "
            f"each ({why})"
        )
    for key in sorted(set(old_options or {}) | set(new_options or {})):
        before, after = (old_options or {}).get(key), (new_options or {}).get(key)
        if before != after:
            changes.append(f"option {key}: {before!r} → {after!r}")
            advice.append("use the same options for every torch.compile of this model")
    if not changes:
        changes.append("the cache key changed (e.g. versions, device or passes)")
    remedy = "; ".join(dict.fromkeys(advice)) or "nothing: the program differs"
    return f"{'; '.join(changes)}. To avoid it: {remedy}."


def _places(where: dict) -> str:
    """Where one size changed: "dim 2 of inputs 7, 13 and the value of inputs 6, 12"."""
    parts = []
    for d, positions in where.items():
        inputs = f"input{'s' if len(positions) > 1 else ''} {', '.join(map(str, positions))}"
        parts.append(f"the value of {inputs}" if d is None else f"dim {d} of {inputs}")
    return " and ".join(parts)


def _tensor_change(position: int, before, after, advice: list[str]) -> str:
    """A tensor input's change of dtype or rank (a size change is told per size)."""
    (old_shape, old_dtype), (new_shape, new_dtype) = before, after
    what = f"input {position} ({describe_input(before)} → {describe_input(after)})"
    if old_dtype != new_dtype:
        advice.append(
            f"cast input {position} to {old_dtype.removeprefix('torch.')} before the call"
        )
        return f"{what}: dtype {old_dtype} → {new_dtype}"
    advice.append(f"keep input {position}'s rank fixed")
    return f"{what}: rank {len(old_shape)} → {len(new_shape)}"


def _bucketing_note(bucketing: dict[str, Any] | None) -> str:
    """What the recompile explanation adds about shape bucketing."""
    if not bucketing:
        return ""
    if "refused" in bucketing:
        return f" Not bucketed (compiled per exact size): {bucketing['refused']}."
    return (
        f" A new bucket {bucketing['bucket']} for true sizes {bucketing['true_sizes']} "
        "(tpu_inductor.precompile compiles the buckets before the first call)."
    )


def explain_if_recompile(record, records: list) -> None:
    """Set `record.recompile` (and log it) when an earlier compile in `records` was of the same
    graph, or of the same part of Dynamo's earlier trace of the frame, for other inputs or options."""
    same = [(r, r.inputs) for r in records if r.fingerprint == record.fingerprint]
    if any(r.inputs == record.inputs and r.options == record.options for r, _ in same):
        return  # the same program again (a cache hit)
    candidates = same or _earlier_traces(record, records)
    if not candidates:
        return  # a first compile
    # The closest earlier compile (the latest of equals) names the change that mattered.
    previous, old_inputs = min(reversed(candidates), key=lambda c: _differences(*c, record))
    if (
        previous.fingerprint != record.fingerprint
        and _differences(previous, old_inputs, record) == 0
    ):
        record.recompile = (  # no tensor changed: a Python number did, now an input
            "Dynamo traced it again: a Python number changed between calls and is an input "
            "from now on (one compile for all its values if it only scales tensors)"
        )
        log.info(
            "tpu_inductor: recompiling %s (Dynamo's new trace of %s): %s",
            record.graph,
            previous.graph,
            record.recompile,
        )
        return
    record.recompile = explain_recompile(
        old_inputs,
        record.inputs,
        same_graph=previous.graph == record.graph,
        old_options=previous.options,
        new_options=record.options,
    ) + _bucketing_note(record.bucketing)
    if previous.graph == record.graph:
        same_as = ""
    elif previous.fingerprint == record.fingerprint:
        same_as = f", the same graph as {previous.graph}"
    else:
        same_as = f", Dynamo's new trace of {previous.graph}"
        record.recompile = f"Dynamo traced it again, with symbolic sizes: {record.recompile}"
    log.info(
        "tpu_inductor: recompiling for new %s (%s%s): %s",
        _what_changed(old_inputs, record.inputs),
        record.graph,
        same_as,
        record.recompile,
    )


def _earlier_traces(record, records: list) -> list[tuple[Any, tuple]]:
    """Compiles of the same part (e.g. the forward, or its region fused_0) in Dynamo's earlier
    traces of the same frame, each with its tensor inputs laid over `record`'s inputs (a graph
    with symbolic sizes takes the sizes as extra inputs)."""
    new_id = record.compile_id
    if not getattr(new_id, "frame_compile_id", None):
        return []
    tensors = [i for i, v in enumerate(record.inputs) if _is_tensor_entry(v)]
    found = []
    for r in records:
        old_id = r.compile_id
        if (
            getattr(old_id, "frame_id", None) != new_id.frame_id
            or (old_id.frame_compile_id or 0) >= new_id.frame_compile_id
            or _part(r.graph) != _part(record.graph)
        ):
            continue
        old_tensors = [v for v in r.inputs if _is_tensor_entry(v)]
        if len(old_tensors) == len(tensors):
            laid_over = list(record.inputs)
            for i, value in zip(tensors, old_tensors):
                laid_over[i] = value
            found.append((r, tuple(laid_over)))
    return found


def _part(graph: str) -> str:
    """A graph's name without its number: "forward_3.fused_0" → "forward.fused_0"."""
    name, dot, region = graph.partition(".")
    return name.rpartition("_")[0] + dot + region


def _differences(earlier, inputs: tuple, record) -> int:
    """How many inputs and options of `record` differ from an earlier compile's."""
    changed = sum(a != b for a, b in zip(inputs, record.inputs))
    keys = set(earlier.options) | set(record.options)
    options = sum(earlier.options.get(k) != record.options.get(k) for k in keys)
    return changed + abs(len(inputs) - len(record.inputs)) + options


def _what_changed(old: tuple, new: tuple) -> str:
    """What a recompile is for: "input sizes" (dtypes and ranks kept), "inputs" or "options"."""
    if old == new:
        return "options"
    changed = [(a, b) for a, b in zip(old, new) if a != b]
    if len(old) == len(new) and all(_is_size_change(a, b) for a, b in changed):
        return "input sizes"
    return "inputs"


def _is_size_change(before, after) -> bool:
    if _is_tensor_entry(before) and _is_tensor_entry(after):
        return before[1] == after[1] and len(before[0]) == len(after[0])
    return isinstance(before, int) and isinstance(after, int)  # a symbolic size's value
