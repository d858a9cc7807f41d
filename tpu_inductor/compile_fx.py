"""The one place that orders the stages, for every caller: torch.compile's forward, backward
and inference graphs (`compile_graph`), the AOT compiler's graphs (`compile_artifact_graph`),
and torch's AOTAutogradCache (cached_compile.load_cached: stage 5's lookup only).

Per ATen graph:
  1 passes     passes.pipeline on the WHOLE graph with a PassContext (cleanup → shapes)
  2 partition  partition.py: supported nodes → compiled regions; the rest → eager torch
  3 specialize passes.shapes.concretize, per input signature (dispatch.SizeDispatch when sizes
               are symbolic; the value-only integers the shape pass marked are module inputs)
  4 lower      tpu_inductor.lowering.lower (or its torch-mlir frontend): StableHLO
  5 compile    the compile cache (memory, disk) or PJRT, then stored   } cached_compile.py
  6 wrap       compiled_graph.CompiledGraph: torch in → device → torch out     }

A GraphObserver (debug.py) sees stages 1-2 of a graph and opens one CompileRecord per compile,
whose `run(stage, fn)` times stages 3-5 and dumps what they made.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tpu_inductor import lowering, partition
from tpu_inductor.cache import lookup as cached_compile
from tpu_inductor.cache import stores as cache
from tpu_inductor.config import Options
from tpu_inductor.debug import records as debug
from tpu_inductor.exc import CompileError
from tpu_inductor.passes import annotate_sharding, bucket_shapes, hoist_weights, pipeline, shapes
from tpu_inductor.passes.context import PassContext
from tpu_inductor.runtime import buckets as bucketing
from tpu_inductor.runtime import compiled_graph, devices, eager_graph, hoisted
from tpu_inductor.runtime import size_dispatch as dispatch
from tpu_inductor.sharding import shard as sharding

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
        observer = debug.GraphObserver(debug.graph_name(kind), options)
        observer.graph(f"aten_{kind}", gm)
        gm = _passes(gm, example_inputs, options, device.lowering_platform, observer, placements)
        layout = gm.meta.get("sharding")
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
            values, region_options = dispatch.placeholder_values(region), region_observer.options
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
    observer = debug.GraphObserver(name, options)
    observer.graph("aten_export", gm)
    gm = _passes(gm, inputs, options, platform, observer)
    missing = partition.missing(gm, options, platform)
    if missing:
        record = observer.record(_concrete_signature(inputs) or ())
        record.run("partition", lambda: partition.report_missing(missing, options))
    return gm, observer, platform


def compile_artifact_bucket(passed: tuple, inputs, options: Options, *, device, mesh=None):
    """Stages 3-5 of an `artifact_passes` graph at concrete `inputs` (its value-only inputs,
    a bucketed graph's true sizes, given as 0-d tensors): (lowered module, executable or None)."""
    gm, observer, platform = passed
    shardings = None if mesh is None else lowering.Shardings(*mesh)
    scalars = shapes.value_only_inputs(gm)
    specializer = _Specializer(gm, options, device, (), observer, platform, shardings)
    if device is None:
        record = observer.record(dispatch.input_signature(inputs), specializer.fingerprint)
        lowered = specializer.lower(inputs, scalars, record)
        debug.finish(record)
        return lowered, None
    compiled = specializer(inputs, scalars)
    return compiled.lowered, compiled.executable


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
    else per signature of the calls."""
    specializer = _Specializer(
        gm, options, device, static_inputs, observer, roles=roles, donate=device.holds_copies
    )
    if example_inputs is not None and all(dispatch.is_concrete(v) for v in example_inputs):
        return specializer(example_inputs)
    scalars = shapes.value_only_inputs(gm)
    sizes = dispatch.SizeDispatch(specializer, observer.name, scalars, options.shapes.max_compiles)
    layout = gm.meta.get("bucketing")
    if isinstance(layout, bucket_shapes.Refusal):
        observer.bucketing = {"refused": layout.reason}
    if isinstance(layout, bucket_shapes.BucketLayout):
        return bucketing.BucketDispatch(sizes, layout, options.shapes, observer)
    return sizes


def _hoisted_split(gm, kind: str, static_inputs, inputs: int) -> hoist_weights.Split | None:
    """An inference graph's work on its parameters alone, split out to be done once per
    parameter version (a training graph's parameters change every call: done in the graph).
    Not over a mesh: each graph there splits its own arguments over the devices."""
    if kind != "inference" or gm.meta.get("sharding") is not None:
        return None
    return hoist_weights.split(gm, frozenset(static_inputs), inputs)


def _compile_hoisted(
    split: hoist_weights.Split, example_inputs, observer, options, device, static_inputs, roles
) -> hoisted.HoistedGraph:
    """Stages 3-6 of both halves of a hoisted split (hoisted.roles: what each takes and keeps)."""
    made = debug.GraphObserver(f"{observer.name}_weights", options)
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
    concrete = all(dispatch.is_concrete(v) for v in inputs)
    return dispatch.input_signature(inputs) if concrete else None


class _Specializer:
    """Stages 3-6 for one set of concrete input sizes, through the compile cache."""

    def __init__(
        self,
        gm,
        options: Options,
        device: devices.Device | None,
        static_inputs,
        observer,
        platform: str | None = None,
        shardings: lowering.Shardings | None = None,
        roles: compiled_graph.GraphRoles | None = None,
        donate: bool = False,
    ):
        self.gm = gm
        self.donate = donate  # the buffers it writes go to the executable (lower: donate_writes)
        self.roles = cached_compile.kept_roles(roles, options)
        # Saved activations kept on the device get module results of their own (not views),
        # as do outputs a constraint splits (left split: sharding.split_outputs).
        saved = self.roles.saved_outputs if self.roles.keep_saved else ()
        self._separate = frozenset(saved) | sharding.split_outputs(gm)
        self.options = options
        self.device = device
        self.static_inputs = tuple(static_inputs)
        self.observer = observer
        self.platform = platform or device.lowering_platform
        self.shardings = shardings
        self.fingerprint = cache.graph_fingerprint(gm, salt=self._stream)

    def _stream(self, node: torch.fx.Node) -> int | None:
        """What a random node's key folds in (its stream is no position: passes that move it
        keep it); nothing for the others."""
        return lowering.rng_stream(node) if lowering.draws_random(node, self.platform) else None

    def __call__(
        self, inputs: Sequence[Any], scalars: frozenset[int] = frozenset()
    ) -> compiled_graph.CompiledGraph:
        """Compiled for `inputs`; `scalars`: positions of integer inputs given as 0-d tensors."""
        signature = dispatch.input_signature(inputs)
        entries = [("graph", self.fingerprint), ("inputs", signature)]
        entries.append(("strides", dispatch.strides(inputs)))
        shardings = self._shardings_for(inputs)
        if shardings is not None:
            entries.append(("shardings", (shardings.axes, shardings.inputs)))
        if self._separate:
            entries.append(("separate_outputs", tuple(sorted(self._separate))))
        if self.donate:
            entries.append(("donate_writes", True))
        record = self.observer.record(signature, self.fingerprint)
        try:
            compiled = cached_compile.cached_compile(
                cache.CacheKey.of(entries),
                self.options,
                self.device,
                self.static_inputs,
                record,
                lambda: self._lower_and_compile(inputs, scalars, record),
                self.roles,
            )
        except CompileError as error:  # PJRT's fault: the graph still runs, in eager torch
            if self.options.fallback != "eager":
                raise
            log.warning(
                "tpu_inductor: %s %s runs in eager torch (fallback='eager'); PJRT could not "
                "compile it: %s",
                record.graph,
                record.inputs,
                error,
            )
            return eager_graph.EagerGraph(self.gm, scalars)
        record.transfers = compiled.transfer_summary()
        debug.finish(record)
        return compiled

    def _shardings_for(self, inputs) -> lowering.Shardings | None:
        """How the module's tensor arguments are split: as given (an artifact's plan), by the
        graph's placements (annotate_sharding), open for the saved activations a backward
        takes as the forward left them on the devices, whole on every device for the others
        (a region of a split graph has none), or None on one device."""
        layout = self.gm.meta.get("sharding")
        if self.shardings is not None or (layout is None and not getattr(self.device, "mesh", ())):
            return self.shardings
        saved = self.roles.saved_inputs if self.roles.keep_saved else ()
        return lowering.Shardings(*sharding.module_split(layout, self.device.axes, inputs, saved))

    def lower(self, inputs, scalars: frozenset[int], record: debug.CompileRecord):
        """Stages 3-4: the graph at the sizes of `inputs`, lowered."""
        from tpu_inductor.lowering import torch_mlir

        values = [int(v) if i in scalars else v for i, v in enumerate(inputs)]
        platform, x64 = self.platform, self.options.x64

        def lower():
            gm = shapes.concretize(self.gm, values)
            if self.options.lowering == "torch-mlir":
                return torch_mlir.lower(gm, inputs, platform=platform, x64=x64)
            return lowering.lower(
                gm,
                inputs,
                platform=platform,
                x64=x64,
                scalar_inputs=scalars,
                shardings=self._shardings_for(inputs),
                separate_outputs=self._separate,
                donate_writes=self.donate,
            )

        with _LOWERING:  # precompile's pool: lowerings (Python) one at a time, compiles overlap
            return record.run("lower", lower)

    def _lower_and_compile(self, inputs, scalars, record: debug.CompileRecord):
        dispatch.check_compile_allowed(record.graph, record.inputs, record.bucketing)
        lowered = self.lower(inputs, scalars, record)
        executable = record.run(
            "pjrt_compile", lambda: devices.compile_module(lowered, self.device)
        )
        log.info(
            "tpu_inductor: compiled %s for inputs %s: lower %.2fs, PJRT compile %.2fs",
            record.graph,
            record.inputs,
            record.timings["lower"],
            record.timings["pjrt_compile"],
        )
        return executable, lowered
