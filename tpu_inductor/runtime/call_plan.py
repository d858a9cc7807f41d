"""A compiled graph's call plan: per module argument, what it is and where its array comes from;
per module result, what reads it and where it goes; per graph output, what it returns.

`plan_call(lowered, roles, device)` decides all of it once, from the lowered module's call
description (tensor_inputs, input and output specs with the module's dtypes, outputs, mutations,
partial_writes, donated, uses_rng), the caller's GraphRoles and a few facts of the device. It
reads no tensor and needs neither jax nor PJRT: the plan is tested on its own
(tests/runtime/test_call_plan.py). CompiledGraph (compiled_graph.py) builds one per executable
and its call reads the plan's fields; the selections the call loops over (`sent`,
`looked_up`, `kept`, ...) are made once, when the plan is built.

This module reads a lowered module's call description but never imports the lowering package.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from collections.abc import Iterable
from typing import Any

import torch

from tpu_inductor.runtime import ledger, module_results
from tpu_inductor.runtime.host_sync import leaves_stale


class ArgumentKind(enum.Enum):
    """What a module argument is, which decides where its array comes from on each call."""

    PARAMETER = "parameter"  # static: kept on the device while its stamp holds (resident)
    WRITTEN = "written"  # a static buffer the graph writes: its write-back's device copy
    SAVED = "saved"  # an activation saved for the backward: a DeviceTensor's or a mirror's array
    TANGENT = "tangent"  # a backward's gradient of an output: looked up; all zeros sent once
    MIRRORED = "mirrored"  # another graph's output (a gradient): its mirror, else sent
    PLAIN = "plain"  # sent on every call

    @property
    def looked_up(self) -> bool:
        """Whether its array may be on the device already (a DeviceTensor's, a mirror)."""
        return self in _LOOKED_UP


_LOOKED_UP = frozenset(
    (ArgumentKind.WRITTEN, ArgumentKind.SAVED, ArgumentKind.TANGENT, ArgumentKind.MIRRORED)
)


class Destination(enum.Enum):
    """Where a module result goes after the call."""

    HOST = "host"  # copied to the host (returned, written back, or a view's base)
    KEPT = "kept"  # stays on the device as a residency.DeviceTensor (a saved activation)
    DEVICE = "device"  # stays on the device, read by no host tensor (a partial write's whole)
    STALE = "stale"  # stays on the device; its host tensor is left stale (host_sync.py)


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What the plan needs to know of the device."""

    mesh: bool  # over a mesh: a backward's tangents are sent as they come
    zero_copy: bool  # the CPU's zero-copy client: results cross as views, none is prefetched
    host_arguments: bool  # the executable is called through jax's C++ fast path, which sends
    # host (numpy) arguments itself


@dataclasses.dataclass(frozen=True, slots=True)
class ArgumentPlan:
    """One tensor argument of the module: graph input `position`, the module's tensor argument
    `slot` (`arrays[slot]` before the seed goes first), module argument `argument` (after it)."""

    slot: int
    argument: int
    position: int
    kind: ArgumentKind
    cast: torch.dtype | None  # the module's dtype, where the graph input's differs
    nbytes: int  # in the module's dtype: what sending it moves
    sent_as: str  # the transfer ledger's kind when it is sent
    bumped: bool = False  # its version is bumped by the caller just before the call
    donated: bool = False  # the executable takes its buffer over (written in place)
    host: bool = False  # (plain) handed to jax's C++ fast path as a host array
    publish: bool = False  # (plain) returned as a saved activation: its array becomes a mirror
    zeros: bool = False  # (a tangent) an all-zeros value takes a device array sent once


@dataclasses.dataclass(frozen=True, slots=True)
class ResultPlan:
    """One result of the module: what reads it (`reader`, module_results.kinds) and where it
    goes; `cast` is the torch dtype it is cast to on the host (the module narrowed it)."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    cast: torch.dtype | None
    nbytes: int  # in `dtype`: what fetching it moves
    reader: str
    goes: Destination
    published: bool = False  # its host tensor's device copy is a mirror for other graphs
    deferred: bool = False  # a write-back left on the device (host_sync="explicit")


@dataclasses.dataclass(frozen=True, slots=True)
class WriteBackPlan:
    """Graph input `position` is written with module result `result`: on the host by the part
    written (`part`, a lowering.PartialWrite, its pieces fetched) or else the whole value; or,
    `deferred`, left on the device with the host tensor stale."""

    position: int
    result: int
    part: Any = None
    deferred: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class ReturnPlan:
    """One graph output: module result `result`; else graph input `input` as it is; else the
    Python `value`. A view of either is a ViewPlan besides."""

    result: int | None
    input: int | None
    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class ViewPlan:
    """Graph output `index` is a view (size, stride, storage offset; in `dtype` if not its
    base's) of module result `base`, or of graph input `base` when `of_input`."""

    index: int
    of_input: bool
    base: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype | None


@dataclasses.dataclass(frozen=True, slots=True)
class CallPlan:
    """A graph's call: its module arguments (by slot), results (by index), write-backs, graph
    outputs, and flags; the selections a call loops over are derived from them when built."""

    arguments: tuple[ArgumentPlan, ...]
    results: tuple[ResultPlan, ...]
    write_backs: tuple[WriteBackPlan, ...]
    returns: tuple[ReturnPlan, ...]
    views: tuple[ViewPlan, ...]
    uses_rng: bool  # a per-call int32[2] seed goes first among the module's arguments
    outputs_by_memory: bool  # outputs' mirrors are found by their memory too (a backward's)
    prefetch: bool  # the copies to the host are started at once, where more than one
    # Derived: the selections a call loops over, in slot or result order.
    resident: tuple[ArgumentPlan, ...] = dataclasses.field(init=False)
    resident_positions: tuple[int, ...] = dataclasses.field(init=False)
    sent: tuple[ArgumentPlan, ...] = dataclasses.field(init=False)
    looked_up: tuple[ArgumentPlan, ...] = dataclasses.field(init=False)
    published_arguments: tuple[ArgumentPlan, ...] = dataclasses.field(init=False)
    donated: tuple[ArgumentPlan, ...] = dataclasses.field(init=False)
    kept: tuple[ResultPlan, ...] = dataclasses.field(init=False)
    published: tuple[int, ...] = dataclasses.field(init=False)
    stale: tuple[ResultPlan, ...] = dataclasses.field(init=False)
    prefetched: tuple[int, ...] = dataclasses.field(init=False)
    per_call: tuple[tuple[tuple[str, str], int], ...] = dataclasses.field(init=False)

    def __post_init__(self):
        def derive(name: str, value) -> None:
            object.__setattr__(self, name, value)

        arguments, results = self.arguments, self.results
        derive("resident", tuple(a for a in arguments if a.kind is ArgumentKind.PARAMETER))
        derive("resident_positions", tuple(a.position for a in self.resident))
        derive("sent", tuple(a for a in arguments if a.kind is ArgumentKind.PLAIN))
        derive("looked_up", tuple(a for a in arguments if a.kind.looked_up))
        derive("published_arguments", tuple(a for a in self.sent if a.publish))
        derive("donated", tuple(a for a in arguments if a.donated))
        derive("kept", tuple(r for r in results if r.goes is Destination.KEPT))
        derive("published", tuple(r.index for r in results if r.published))
        derive("stale", tuple(r for r in results if r.goes is Destination.STALE))
        fetched = tuple(r.index for r in results if r.goes is Destination.HOST)
        derive("prefetched", fetched if self.prefetch and len(fetched) > 1 else ())
        derive("per_call", _per_call(self.sent, self.uses_rng, results))


def plan_call(lowered, roles, device: DeviceFacts, static_inputs: Iterable[int] = ()) -> CallPlan:
    """The call plan of module `lowered` (a lowering.LoweredModule, or anything with its call
    description) under `roles` (a compiled_graph.GraphRoles) on `device`; `static_inputs` are
    the graph inputs that are parameters and buffers (kept on the device while unchanged)."""
    defer = roles.defer_host
    saved_outputs = frozenset(roles.saved_outputs)
    results = _results(lowered, roles, device, saved_outputs, defer)
    return CallPlan(
        arguments=_arguments(lowered, roles, device, frozenset(static_inputs), saved_outputs),
        results=results,
        write_backs=_write_backs(lowered, results, defer),
        returns=tuple(ReturnPlan(s.result, s.input, s.value) for s in lowered.outputs),
        views=tuple(
            ViewPlan(index, s.input is not None, *s.view, s.view_dtype)
            for index, s in enumerate(lowered.outputs)
            if s.view
        ),
        uses_rng=lowered.uses_rng,
        outputs_by_memory=roles.mirror_outputs,
        prefetch=not device.zero_copy,
    )


def _arguments(lowered, roles, device, static, saved_outputs) -> tuple[ArgumentPlan, ...]:
    """Per module tensor argument, its kind and what it needs (see ArgumentKind)."""
    mutated = frozenset(position for position, _ in lowered.mutations)
    saved = frozenset(roles.saved_inputs) - static
    # Buffers the graph writes (a static KV cache) change on every call: taken from the device
    # copy its own write-back publishes, not restamped as resident state per call.
    written = static & mutated
    static = static - written
    # A backward's tangents, on one device: looked up too (another graph's backward may have
    # returned one), and one that is all zeros takes a device array of zeros sent once
    # (autograd materializes the gradient of an output nothing differentiated — an LM's logits
    # beside its loss — on every step). Never a donated one.
    tangents = frozenset(roles.tangent_inputs) - mutated if not device.mesh else frozenset()
    groups = (  # an argument's kind: the first group that holds its position, else PLAIN
        (ArgumentKind.PARAMETER, static),
        (ArgumentKind.SAVED, saved),
        (ArgumentKind.WRITTEN, written),
        (ArgumentKind.TANGENT, tangents),
        (ArgumentKind.MIRRORED, frozenset(roles.mirrored_inputs)),
    )
    # Per-call arguments the graph returns as saved activations (an input the backward reads):
    # their arrays become mirrors, so the backward does not send them again.
    returned = {s.input for i, s in enumerate(lowered.outputs) if i in saved_outputs}
    bumped, donated = frozenset(roles.bumped_inputs), frozenset(lowered.donated)
    plans = []
    for slot, (position, spec, module_dtype) in enumerate(
        zip(lowered.tensor_inputs, lowered.input_specs, lowered.module_input_dtypes)
    ):
        cast = module_dtype if spec.dtype != module_dtype else None
        kind = next((kind for kind, group in groups if position in group), ArgumentKind.PLAIN)
        plain = kind is ArgumentKind.PLAIN
        publish = plain and position in returned and cast is None
        plans.append(
            ArgumentPlan(
                slot=slot,
                argument=slot + lowered.uses_rng,
                position=position,
                kind=kind,
                cast=cast,
                nbytes=module_results.nbytes(spec, module_dtype),
                sent_as=_SENT_AS[kind],
                bumped=position in bumped,
                donated=slot in donated,
                # jax's C++ fast path sends a host array itself: not one whose array becomes a
                # mirror, nor a donated one
                host=plain and device.host_arguments and not publish and slot not in donated,
                publish=publish,
                zeros=position in tangents,
            )
        )
    return tuple(plans)


_SENT_AS = {
    ArgumentKind.PARAMETER: "parameter",
    ArgumentKind.WRITTEN: "parameter",
    ArgumentKind.SAVED: "saved",
    ArgumentKind.TANGENT: "argument",
    ArgumentKind.MIRRORED: "argument",
    ArgumentKind.PLAIN: "argument",
}


def _results(lowered, roles, device, saved_outputs, defer) -> tuple[ResultPlan, ...]:
    """Per module result, where it goes. Kept on the device: read by saved outputs only, as
    they are. Published as mirrors (one device): results returned as host tensors, which
    another graph may read next (the next graph after a graph break, this one again in a loop,
    a compiled optimizer step reading a backward's gradients) without sending them again.
    Left on the device: the whole new value of an input written in part; under
    host_sync="explicit", every written value and part (fetched where the tensor is not its
    whole storage) and a backward's gradients (their host tensors left stale)."""
    kinds = module_results.kinds(lowered, saved_outputs, deferred=defer)
    written_values = {r for _, r in lowered.mutations}  # (not the parts: never read then)
    viewed = {s.view[0] for s in lowered.outputs if s.view and s.input is None}
    plans = []
    for r, (kind, spec, module_dtype) in enumerate(
        zip(kinds, lowered.output_specs, lowered.module_output_dtypes)
    ):
        cast = spec.dtype if spec.dtype != module_dtype else None
        stays = r not in written_values or leaves_stale(math.prod(spec.shape))
        kept = kind == "kept" and cast is None and roles.keep_saved
        published = kind == "output" and cast is None
        on_device = kind == "device" or kind == "deferred" and stays
        stale = published and defer and roles.mirror_outputs and r not in viewed and stays
        goes = (
            Destination.KEPT
            if kept
            else Destination.DEVICE
            if on_device
            else Destination.STALE
            if stale
            else Destination.HOST
        )
        deferred = on_device and kind == "deferred" and cast is None
        nbytes = module_results.nbytes(spec, spec.dtype)
        plans.append(
            ResultPlan(
                r, tuple(spec.shape), spec.dtype, cast, nbytes, kind, goes, published, deferred
            )
        )
    return tuple(plans)


def _write_backs(lowered, results, defer: bool) -> tuple[WriteBackPlan, ...]:
    """Per written input: the part written, fetched and written on the host (none under
    host_sync="explicit": the whole value, where it is not deferred), and whether deferred."""
    deferred = {r.index for r in results if r.deferred}
    parts = {} if defer else {write.position: write for write in lowered.partial_writes}
    return tuple(
        WriteBackPlan(position, result, parts.get(position), result in deferred)
        for position, result in lowered.mutations
    )


def _per_call(sent, uses_rng: bool, results) -> tuple[tuple[tuple[str, str], int], ...]:
    """The transfer ledger's entries of one steady-state call: what is sent, what is fetched."""
    moved: collections.Counter = collections.Counter()
    for argument in sent:
        moved[ledger.HOST_TO_DEVICE, "argument"] += argument.nbytes
    if uses_rng:
        moved[ledger.HOST_TO_DEVICE, "argument"] += 8
    for result in results:
        if result.goes is Destination.HOST:
            kind = _FETCHED_AS.get(result.reader, result.reader)
            moved[ledger.DEVICE_TO_HOST, kind] += result.nbytes
    return tuple(moved.items())


_FETCHED_AS = {"kept": "saved", "deferred": "mutation"}  # the ledger's kinds of fetched results
