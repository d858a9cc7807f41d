"""The one place that orders the stages, for every caller: torch.compile's forward, backward
and inference graphs (`compile_graph`), the AOT compiler's graphs (`compile_artifact_graph`),
and torch's AOTAutogradCache (`load_cached`: the cache lookup and the wrap only).

Per ATen graph:
  1 passes     passes.pipeline on the WHOLE graph with a PassContext (cleanup → shapes → ...)
  2 partition  partition.py: supported nodes → compiled regions; the rest → eager torch
  3 specialize per input signature (size_dispatch.SizeDispatch when sizes are symbolic): its
               cache key (cache/key.py), then the compile cache (cache/lookup.find)
  4 lower      on a miss: passes.shapes.concretize, then tpu_inductor.lowering.lower (or its
               torch-mlir frontend): StableHLO
  5 compile    PJRT, then cache/lookup.store
  6 wrap       compiled_graph.CompiledGraph: torch in → device → torch out

Each stage is a function that takes values and returns them; none calls back into this module.
A GraphObserver (debug/records.py) sees stages 1-2 of a graph and opens one CompileRecord per
compile, whose `run(stage, fn)` times stages 4-5 and dumps what they made.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tpu_inductor import lowering, partition
from tpu_inductor.cache import key, lookup
from tpu_inductor.config import Options
from tpu_inductor.debug import records
from tpu_inductor.exc import CompileError
from tpu_inductor.passes import annotate_sharding, bucket_shapes, hoist_weights, pipeline, shapes
from tpu_inductor.passes.context import PassContext
from tpu_inductor.runtime import (
    buckets,
    compiled_graph,
    devices,
    eager_graph,
    hoisted,
    size_dispatch,
)
from tpu_inductor.sharding import collectives
from tpu_inductor.sharding import shard as sharding
from tpu_inductor.state import device_state

log = logging.getLogger(__name__)
_LOWERING = threading.RLock()


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Options,
    *,
    static_inputs: Sequence[int] = (),
    kind: str = "graph",
    roles: compiled_graph.GraphRoles | None = None,
    placements: annotate_sharding.SpecPlan | None = None,
) -> Callable[[list], list]:
    """Compile an ATen graph; returns a boxed callable (takes a list of inputs).

    `kind` ("forward", "backward", "inference") names the graph in logs and compile records.
    `roles`: what AOTAutograd's calling convention makes of its inputs and outputs (saved
    activations, mutated inputs whose version it bumps). `placements`: inputs and outputs
    placed on a device mesh (the graph then runs on the mesh's devices).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # AOTAutograd calls compilers under its fake mode; the graph's real tensor constants
    # (get_attr) must be read as real tensors.
    with unset_fake_temporarily():
        device = devices.select_device(options.device)
        options = options.on_platform(device.lowering_platform)  # records show the fusions used
        observer = records.GraphObserver(records.graph_name(kind), options)
        observer.graph(f"aten_{kind}", gm)
        gm = _passes(gm, example_inputs, options, device.lowering_platform, observer, placements)
        layout = annotate_sharding.layout_of(gm)
        if layout is not None:
            device = devices.mesh_device(device.platform, layout.mesh.axes)
        missing = partition.missing(gm, options, device.lowering_platform)
        hoist = None if missing else _hoisted_split(gm, kind, static_inputs, len(example_inputs))
        if hoist is not None:
            return _compile_hoisted(
                hoist, example_inputs, observer, options, device, static_inputs, roles
            )
        if not missing:
            return _compile_whole(
                gm, example_inputs, observer, options, device, static_inputs, roles
            )
        if options.fallback == "error":  # the failed compile gets a record (a dump folder)
            record = observer.record(_concrete_signature(example_inputs) or ())
            record.run("partition", lambda: partition.report_missing(missing, options))
        if options.fallback != "torch-mlir":  # otherwise reported once torch-mlir had its turn
            partition.report_missing(missing, options)
            observer.fallback(missing, device.lowering_platform)

        def compile_region(region, region_observer):
            values, region_options = (
                size_dispatch.placeholder_values(region),
                region_observer.options,
            )
            return _compile_whole(region, values, region_observer, region_options, device, ())

        return partition.split(gm, options, device.lowering_platform, observer, compile_region)


def compile_artifact_graph(
    gm: torch.fx.GraphModule,
    inputs: Sequence[Any],
    options: Options,
    *,
    name: str,
    platform: str,
    device: devices.Device | None,
    mesh: tuple[tuple[tuple[str, int], ...], tuple[tuple[str | None, ...], ...]] | None = None,
) -> tuple[lowering.LoweredModule, Any]:
    """One graph of an AOT artifact, whole (an artifact cannot fall back to eager torch):
    (its lowered module, its executable, or None where `device` is None: StableHLO only).

    `mesh`: (mesh axes, a partition spec per tensor argument) to split the module over.
    """
    passed = artifact_passes(gm, inputs, options, name=name, platform=platform)
    return compile_artifact_bucket(passed, inputs, options, device=device, mesh=mesh)


def artifact_passes(gm, inputs, options: Options, *, name: str, platform: str) -> tuple:
    """Stages 1-2 of an artifact's graph (`inputs` may be symbolic: one pass for every bucket):
    (the graph after the passes, its observer, the platform), for `compile_artifact_bucket`."""
    options = options.on_platform(platform)
    observer = records.GraphObserver(name, options)
    observer.graph("aten_export", gm)
    gm = _passes(gm, inputs, options, platform, observer)
    missing = partition.missing(gm, options, platform)
    if missing:
        record = observer.record(_concrete_signature(inputs) or ())
        record.run("partition", lambda: partition.report_missing(missing, options))
    return gm, observer, platform


def compile_artifact_bucket(passed: tuple, inputs, options: Options, *, device, mesh=None):
    """Stages 3-6 of an `artifact_passes` graph at concrete `inputs` (its value-only inputs,
    a bucketed graph's true sizes, given as 0-d tensors): (lowered module, executable or None)."""
    gm, observer, platform = passed
    shardings = None if mesh is None else lowering.Shardings(*mesh)
    graph = _graph(gm, options, device, observer, platform=platform, shardings=shardings)
    scalars = shapes.value_only_inputs(gm)
    if device is None:
        record = observer.record(size_dispatch.input_signature(inputs), graph.fingerprint)
        lowered = _lower(graph, inputs, scalars, _shardings(graph, inputs), record)
        records.finish(record)
        return lowered, None
    compiled = _specialize(graph, inputs, scalars)
    return compiled.lowered, compiled.executable


def load_cached(
    kind: str,
    graph_key: key.CacheKey,
    static_inputs: Sequence[int],
    example_inputs: Sequence[Any],
    options: Options,
    roles: compiled_graph.GraphRoles | None = None,
) -> compiled_graph.CompiledGraph | None:
    """torch's AOTAutogradCache's way in: a graph an earlier process compiled, from the compile
    cache only (None if absent). AOTAutogradCache keeps `graph_key` and not the graph: the rest
    of the key is this process's (options, passes, environment)."""
    device = devices.select_device(options.device)
    options = options.on_platform(device.lowering_platform)
    observer = records.GraphObserver(records.graph_name(kind), options)
    record = observer.record(size_dispatch.input_signature(example_inputs))
    record.cache["aot_autograd"] = "hit"
    record.cache["stages_skipped"] = "ATen graph and passes: nothing was traced in this process"
    compile_key = key.for_compile(graph_key, options, device)
    found = lookup.find(compile_key, options, device, record)
    if found is None:
        record.status, record.error = "failed", "not in the compile cache: compiled again"
        return None
    roles = _kept_roles(roles, options)
    return _wrap(found, graph_key, compile_key, device, options, static_inputs, roles, record)


def _passes(
    gm, inputs, options: Options, platform: str, observer, placements=None
) -> torch.fx.GraphModule:
    """Stage 1: the pass pipeline on the whole graph."""
    ctx = PassContext(
        platform=platform,
        options=options,
        inputs=_concrete_signature(inputs),
        plan=placements,
        takes_traced_scalars=lambda node: lowering.takes_traced_scalars(node, platform),
        supported=lambda node: lowering.supported(node, platform),
    )
    return pipeline.run_passes(gm, ctx, observer)


def _compile_whole(
    gm, example_inputs, observer, options: Options, device, static_inputs, roles=None
):
    """Stages 3-6 of a graph compiled whole (or a region): at its sizes when they are concrete,
    else per signature of the calls (the runtime's size dispatch, or its buckets)."""
    # Written buffers go to the executable where the arrays are the devices' own: copies of
    # the host tensors, or (host_sync="explicit") the zero-copy CPU's, whose state is XLA's
    # after its first write (an argument still reading torch's memory is copied first).
    donate = device.holds_copies or options.host_sync == "explicit"
    graph = _graph(gm, options, device, observer, static_inputs, roles=roles, donate=donate)
    if example_inputs is not None and all(size_dispatch.is_concrete(v) for v in example_inputs):
        return _specialize(graph, example_inputs)
    scalars = shapes.value_only_inputs(gm)
    specialize = functools.partial(_specialize, graph)
    sizes = size_dispatch.SizeDispatch(
        specialize, observer.name, scalars, options.shapes.max_compiles
    )
    layout = bucket_shapes.layout_of(gm)
    if isinstance(layout, bucket_shapes.Refusal):
        observer.bucketing = {"refused": layout.reason}
    if isinstance(layout, bucket_shapes.BucketLayout):
        return buckets.BucketDispatch(sizes, layout, options.shapes, observer)
    return sizes


def _hoisted_split(gm, kind: str, static_inputs, inputs: int) -> hoist_weights.Split | None:
    """An inference graph's work on its parameters alone, split out to be done once per
    parameter version (a training graph's parameters change every call: done in the graph).
    Not over a mesh: each graph there splits its own arguments over the devices."""
    if kind != "inference" or annotate_sharding.layout_of(gm) is not None:
        return None
    return hoist_weights.split(gm, frozenset(static_inputs), inputs)


def _compile_hoisted(
    split: hoist_weights.Split, example_inputs, observer, options, device, static_inputs, roles
) -> hoisted.HoistedGraph:
    """Stages 3-6 of both halves of a hoisted split (hoisted.roles: what each takes and keeps)."""
    made = records.GraphObserver(f"{observer.name}_weights", options)
    made.graph("hoisted_prologue", split.prologue)
    observer.graph("hoisted_main", split.main)
    sources = [example_inputs[i] for i in split.sources]
    made_roles, main_roles = hoisted.roles(split, roles, len(example_inputs))
    every = range(len(sources))
    prologue = _compile_whole(split.prologue, sources, made, options, device, every, made_roles)
    inputs = [*example_inputs, *split.made]
    main = _compile_whole(split.main, inputs, observer, options, device, static_inputs, main_roles)
    return hoisted.HoistedGraph(prologue, main, split.sources, split.prologue_only)


def _concrete_signature(inputs: Sequence[Any]) -> tuple | None:
    """The input signature, or None while sizes are symbolic."""
    concrete = all(size_dispatch.is_concrete(v) for v in inputs)
    return size_dispatch.input_signature(inputs) if concrete else None


@dataclasses.dataclass(frozen=True)
class _Graph:
    """A graph after its passes, as stages 3-6 compile it at each set of sizes asked for."""

    gm: torch.fx.GraphModule
    options: Options
    device: devices.Device | None
    platform: str
    observer: records.GraphObserver
    static_inputs: tuple[int, ...]
    roles: compiled_graph.GraphRoles
    separate: frozenset[int]  # outputs the module returns as results of their own
    donate: bool  # the buffers it writes go to the executable (lowering's donate_writes)
    shardings: lowering.Shardings | None  # as given (an artifact's plan), else from the graph
    fingerprint: str  # the graph entry of its cache key


def _graph(
    gm,
    options: Options,
    device,
    observer,
    static_inputs=(),
    *,
    roles=None,
    donate=False,
    platform=None,
    shardings=None,
) -> _Graph:
    """The _Graph of `gm` (`platform`: the device's unless given)."""
    roles = _kept_roles(roles, options)
    platform = platform or device.lowering_platform
    # Saved activations kept on the device get module results of their own (not views), as do
    # outputs a constraint splits (left split: sharding.split_outputs).
    saved = roles.saved_outputs if roles.keep_saved else ()
    separate = frozenset(saved) | sharding.split_outputs(gm, device_state.placed())
    return _Graph(
        gm,
        options,
        device,
        platform,
        observer,
        tuple(static_inputs),
        roles,
        separate,
        donate,
        shardings,
        key.graph_fingerprint(gm, platform),
    )


def _specialize(graph: _Graph, inputs: Sequence[Any], scalars: frozenset[int] = frozenset()):
    """Stages 3-6 of `graph` at the sizes of `inputs` (`scalars`: positions of integer inputs
    given as 0-d tensors): its key, the cache, else lower, compile and store; then wrapped. A
    PJRT fault under fallback="eager" leaves the graph to eager torch, with a warning."""
    options, device = graph.options, graph.device
    shardings = _shardings(graph, inputs)
    graph_key = key.for_graph(
        graph.fingerprint,
        inputs,
        shardings=shardings,
        separate_outputs=graph.separate,
        donate_writes=graph.donate,
    )
    compile_key = key.for_compile(graph_key, options, device)
    record = graph.observer.record(size_dispatch.input_signature(inputs), graph.fingerprint)
    try:
        found = lookup.find(compile_key, options, device, record)
        if found is None:
            size_dispatch.check_compile_allowed(record.graph, record.inputs, record.bucketing)
            lowered = _lower(graph, inputs, scalars, shardings, record)
            found = _compile(lowered, device, record)
            lookup.store(compile_key, found, options, device, record)
    except CompileError as error:  # PJRT's fault: the graph still runs, in eager torch
        if options.fallback != "eager":
            raise
        log.warning(
            "tpu_inductor: %s %s runs in eager torch (fallback='eager'); PJRT could not "
            "compile it: %s",
            record.graph,
            record.inputs,
            error,
        )
        return eager_graph.EagerGraph(graph.gm, scalars, record.graph)
    static = graph.static_inputs
    return _wrap(found, graph_key, compile_key, device, options, static, graph.roles, record)


def _shardings(graph: _Graph, inputs) -> lowering.Shardings | None:
    """How the module's tensor arguments are split: as given (an artifact's plan), by the
    graph's placements (annotate_sharding), open for the saved activations a backward
    takes as the forward left them on the devices, whole on every device for the others
    (a region of a split graph has none), or None on one device."""
    layout = annotate_sharding.layout_of(graph.gm)
    if graph.shardings is not None or (layout is None and not getattr(graph.device, "mesh", ())):
        return graph.shardings
    saved = graph.roles.saved_inputs if graph.roles.keep_saved else ()
    return lowering.Shardings(*sharding.module_split(layout, graph.device.axes, inputs, saved))


def _lower(graph: _Graph, inputs, scalars, shardings, record: records.CompileRecord):
    """Stage 4: the graph at the sizes of `inputs`, lowered to a StableHLO module."""
    from tpu_inductor.lowering import torch_mlir

    values = [int(v) if i in scalars else v for i, v in enumerate(inputs)]
    platform, x64 = graph.platform, graph.options.x64

    def lower():
        gm = shapes.concretize(graph.gm, values)
        if graph.options.lowering == "torch-mlir":
            return torch_mlir.lower(gm, inputs, platform=platform, x64=x64)
        return lowering.lower(
            gm,
            inputs,
            platform=platform,
            x64=x64,
            scalar_inputs=scalars,
            shardings=shardings,
            separate_outputs=graph.separate,
            donate_writes=graph.donate,
        )

    with _LOWERING:  # precompile's pool: lowerings (Python) one at a time, compiles overlap
        return record.run("lower", lower)


def _compile(lowered, device: devices.Device, record: records.CompileRecord) -> tuple[Any, Any]:
    """Stage 5: PJRT's executable of a lowered module: (executable, lowered module)."""
    executable = record.run("pjrt_compile", lambda: devices.compile_module(lowered, device))
    log.info(
        "tpu_inductor: compiled %s for inputs %s: lower %.2fs, PJRT compile %.2fs",
        record.graph,
        record.inputs,
        record.timings["lower"],
        record.timings["pjrt_compile"],
    )
    return executable, lowered


def _wrap(found, graph_key, compile_key, device, options: Options, static_inputs, roles, record):
    """Stage 6: the executable with torch's calling convention; the record closed."""
    executable, lowered = found
    if lowered.shardings is not None and compile_key is not None:  # over a mesh: what it sends
        record.communication = collectives.report(executable, device, compile_key.digest)
    # Inputs the graph writes (a buffer, a cache passed in) are state too: their device copy,
    # written by this call, serves the next one (residency.mirrors).
    mutated = tuple(position for position, _ in lowered.mutations)
    static = tuple(dict.fromkeys((*static_inputs, *mutated))) if options.resident_params else ()
    if device.mesh and not roles.defer_host and device_state.placed() and _can_defer():
        # A model placed on a mesh lives on its devices (state/device_state.py): the state
        # written and the gradients returned there stay there, whatever host_sync says.
        roles = dataclasses.replace(roles, defer_host=True)
    compiled = compiled_graph.CompiledGraph(executable, lowered, device, static, graph_key, roles)
    record.transfers = compiled.transfer_summary()
    record.memory = compiled.memory_summary()
    compiled.memory.name = record.graph
    if record.communication is not None:  # what a call sends between the mesh's devices
        found = record.communication["collectives"].values()
        compiled.collective_bytes = sum(c["bytes"] for c in found)
    records.finish(record)
    return compiled


def _kept_roles(
    roles: compiled_graph.GraphRoles | None, options: Options
) -> compiled_graph.GraphRoles:
    """`roles`, with no saved output kept on the device under `saved_on_device=False`, and
    written state and gradients left on the device under `host_sync="explicit"` (where host
    storages can be marked stale here: else with a warning, brought up to date each call)."""
    roles = roles or compiled_graph.GraphRoles()
    defer = options.host_sync == "explicit" and _can_defer()
    return dataclasses.replace(roles, keep_saved=options.saved_on_device, defer_host=defer)


@functools.cache
def _can_defer() -> bool:
    from tpu_inductor.runtime.host_sync import host_sync

    why = host_sync.available()
    if why is not None:
        log.warning("%s Host copies are brought up to date after each call instead.", why)
    return why is None
