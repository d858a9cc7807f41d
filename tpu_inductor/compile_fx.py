"""`compile_graph(gm, example_inputs, options)`: the one place that orders the stages.

Per ATen graph from AOTAutograd:
  1 partition  supported nodes → compiled regions; the rest stays in eager torch, reported
  2 passes     passes.pipeline (cleanup → bucket_shapes → fuse_patterns → annotate_sharding)
  3 lower      lowering.stablehlo.lower: FX → jax → StableHLO (or lowering.torch_mlir.lower)
  4 compile    cache lookup → PJRT compile → cache store
  5 wrap       runtime.CompiledGraph: torch in → device → torch out

With options lowering="torch-mlir" every graph goes through torch-mlir; with
fallback="torch-mlir" the regions our rules cannot lower go to torch-mlir, and what it cannot
lower either to eager torch: each region's choice is logged and in its compile record.

Graphs whose inputs have symbolic sizes are specialized per concrete size (keyed by the sizes,
one log line per compile) until the bucketing pass lands.

`load_cached` is the way in from torch's AOTAutogradCache (autograd_cache.py): a graph key
from an earlier process, stage 4's lookup only.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import cache, debug, runtime
from .config import Options
from .exc import TpuInductorError, UnsupportedOpError

log = logging.getLogger(__name__)

_graph_ids = itertools.count()
aten = torch.ops.aten
# Ops that read their argument's strides and storage, not only its values.
_READS_STORAGE = frozenset(
    {aten.as_strided.default, aten.as_strided_copy.default, aten.as_strided_scatter.default}
)


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Options,
    *,
    static_inputs: Sequence[int] = (),
    kind: str = "graph",
) -> Callable[[list], list]:
    """Compile an ATen graph; returns a boxed callable (takes a list of inputs).

    `kind` ("forward", "backward", "inference") names the graph in logs and compile records.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # AOTAutograd calls compilers under its fake mode; the graph's real tensor constants
    # (get_attr) must be read as real tensors.
    with unset_fake_temporarily():
        return _compile_graph(gm, example_inputs, options, static_inputs, kind)


def _compile_graph(gm, example_inputs, options: Options, static_inputs, kind: str):
    name = f"{kind}_{next(_graph_ids)}"
    debug.graph_stage(name, f"aten_{kind}", gm, options)
    from .lowering import interpreter

    device = runtime.select_device(options.device)
    if "torch-mlir" in (options.lowering, options.fallback):
        from .lowering import torch_mlir

        torch_mlir.require()
    missing = (
        {}
        if options.lowering == "torch-mlir"
        else interpreter.missing_ops(gm, device.lowering_platform)
    )
    if missing:
        if options.fallback != "torch-mlir":  # otherwise reported once torch-mlir had its turn
            stage = contextlib.nullcontext()
            if options.fallback == "error":  # the failed compile gets a record (a dump folder)
                concrete = all(_is_concrete(v) for v in example_inputs)
                inputs = _input_signature(example_inputs) if concrete else ()
                stage = debug.new_record(name, inputs, options=options).stage("partition")
            with stage:
                _report_missing(missing, options)
            debug.fallback_ops(name, missing, device.lowering_platform, options)
        return _boxed_outputs_list(_compile_partitioned(gm, options, device, name))
    return _compile_region(gm, example_inputs, options, device, static_inputs, name)


def _report_missing(missing: dict[str, list[str]], options: Options) -> None:
    if options.fallback == "error":
        lines = [
            f"  {op} ({len(sites)}x): " + "; ".join(dict.fromkeys(sites))
            for op, sites in sorted(missing.items())
        ]
        hops = any(op.startswith("torch.ops.higher_order.") for op in missing)
        raise UnsupportedOpError(
            "tpu_inductor: these ops have no lowering rule:\n"
            + "\n".join(lines)
            + (
                "\nHigher-order ops (torch.cond, while_loop, scan, map, flex_attention) are not "
                "lowered: they run in eager torch (torch.where can replace a torch.cond)."
                if hops
                else ""
            )
            + "\nRemove options={'fallback': 'error'} to run them in eager torch, or add rules "
            "for ATen ops (README: 'Adding a lowering rule')."
        )
    summary = ", ".join(f"{op} x{len(sites)}" for op, sites in sorted(missing.items()))
    log.warning(
        "tpu_inductor: running ops without a lowering in eager torch (graph split): %s", summary
    )


def _compile_partitioned(gm, options: Options, device, name: str) -> torch.fx.GraphModule:
    """Fuse supported nodes into regions compiled by us; the rest of `gm` runs in eager torch."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import create_op_support

    eager = _eager_nodes(gm, device.lowering_platform)
    partitioner = CapabilityBasedPartitioner(
        gm,
        create_op_support(lambda _modules, node: node.op == "call_function" and node not in eager),
        allows_single_node_partition=True,
    )
    partitions = [p for p in partitioner.propose_partitions() if _has_computation(p.nodes)]
    fused = partitioner.fuse_partitions(partitions)
    debug.graph_stage(name, "partitioned", fused, options)
    for region, sub in list(fused.named_children()):
        if region.startswith("fused_"):
            debug.graph_stage(f"{name}.{region}", "region", sub, options)
            compiled = _compile_region(sub, None, options, device, (), f"{name}.{region}")
            setattr(fused, region, _Unboxed(compiled, sub, _call_of(fused, region)))
    if options.fallback == "torch-mlir":
        fused = _lower_rest_with_torch_mlir(fused, options, device, name)
    fused.recompile()
    log.info("tpu_inductor: compiled %d region(s); the rest runs in eager torch", len(partitions))
    return fused


def _eager_nodes(gm: torch.fx.GraphModule, platform: str) -> set[torch.fx.Node]:
    """The call nodes of a split graph that run in eager torch: those without a rule; a write
    into an input (it stays in graph order: eager ops read the input before it); views of
    results computed in eager (a compiled region would return a copy, not a view of them); and
    the producers of what an eager `as_strided` reads, back to a result laid out contiguously
    from offset 0 (a compiled region returns that layout; as_strided reads the strides)."""
    from torch._ops import OpOverload

    from .lowering import registry

    eager: set[torch.fx.Node] = set()
    while True:
        found = len(eager)
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            of_eager = bool(node.args) and node.args[0] in eager
            if (
                not registry.supported(node, platform)
                or (node.target is aten.copy_.default and node.args[0].op == "placeholder")
                or (of_eager and node.target is operator.getitem)
                or (of_eager and isinstance(node.target, OpOverload) and node.target.is_view)
            ):
                eager.add(node)
        reading = [node for node in eager if node.target in _READS_STORAGE]
        while reading:
            source = reading.pop().args[0]
            if source.op == "call_function" and source not in eager and not _plain(source):
                eager.add(source)
                reading.append(source)  # its layout, in eager, follows its argument's
        if len(eager) == found:
            return eager


def _plain(node: torch.fx.Node) -> bool:
    """Whether a node's result is a storage of its own, laid out contiguously from offset 0, as
    compiled results are (a view's storage is its base's: as_strided may read beyond it)."""
    value = node.meta.get("val")
    if isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        return False
    try:
        return bool(value.is_contiguous() and value.storage_offset() == 0)
    except Exception:  # not a tensor, or a layout no guard can decide
        return False


def _lower_rest_with_torch_mlir(fused, options: Options, device, name: str):
    """The regions of `fused` our rules left to eager torch, lowered by torch-mlir where it can.

    A region torch-mlir cannot lower (or whose sizes are symbolic) stays in eager torch; the
    ops that do are reported as fallback ops, each region's choice is logged.
    """
    import dataclasses

    from torch._ops import OpOverload
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import create_op_support

    from .lowering import interpreter

    def eager_op(_modules, node) -> bool:
        if node.target is operator.getitem:  # keep a multi-result op's getitems with it
            node = node.args[0]
        return node.op == "call_function" and isinstance(node.target, OpOverload)

    partitioner = CapabilityBasedPartitioner(
        fused, create_op_support(eager_op), allows_single_node_partition=True
    )
    partitions = [p for p in partitioner.propose_partitions() if _has_computation(p.nodes)]
    fused = partitioner.fuse_partitions(partitions, prefix="torch_mlir_")
    tm_options = dataclasses.replace(options, lowering="torch-mlir")
    eager: dict[str, list[str]] = {}
    for region, sub in list(fused.named_children()):
        if not region.startswith("torch_mlir_"):
            continue
        ops = interpreter.missing_ops(sub, device.lowering_platform)
        values = _placeholder_values(sub)
        try:
            if values is None or not all(_is_concrete(v) for v in values):
                raise UnsupportedOpError("its input sizes are symbolic")
            compiled = _compile_region(sub, values, tm_options, device, (), f"{name}.{region}")
        except TpuInductorError as e:
            log.warning(
                "tpu_inductor: %s.%s (%s) runs in eager torch: %s", name, region, ", ".join(ops), e
            )
            for op, sites in ops.items():
                eager.setdefault(op, []).extend(sites)
            continue
        log.info("tpu_inductor: %s.%s (%s) lowered by torch-mlir", name, region, ", ".join(ops))
        setattr(fused, region, _Unboxed(compiled, sub, _call_of(fused, region)))
    if eager:
        _report_missing(eager, options)
        debug.fallback_ops(name, eager, device.lowering_platform, options)
    return fused


def _boxed_outputs_list(gm: torch.fx.GraphModule) -> Callable[[list], list]:
    """A partitioned graph with the compiled-graph convention: a list in, a list out."""
    returns_tuple = _returns_tuple(gm)

    def run(args: list) -> list:
        out = gm(*args)
        args.clear()
        return list(out) if returns_tuple else [out]

    run._boxed_call = True
    return run


def _has_computation(nodes) -> bool:
    from .lowering.interpreter import INTERPRETER_TARGETS

    return any(
        n.target not in INTERPRETER_TARGETS or n.target is torch.ops.aten.copy_.default
        for n in nodes
    )


def _returns_tuple(gm: torch.fx.GraphModule) -> bool:
    return isinstance(gm.graph.output_node().args[0], (tuple, list))


def _call_of(fused: torch.fx.GraphModule, region: str) -> torch.fx.Node:
    return next(n for n in fused.graph.nodes if n.op == "call_module" and n.target == region)


def _layouts_eager_ops_read(
    region: torch.fx.GraphModule, call: torch.fx.Node
) -> dict[int, tuple[int, ...]]:
    """Output index → dim order (`torch.empty_permuted`'s) of a region's results that eager ops
    read and that were traced in another dense layout than the contiguous one compiled results
    have: an eager op's result layout can follow its argument's (elementwise ops, CPU flash
    attention), and the views after it were traced for that layout."""
    from .lowering.stablehlo import flat_outputs

    results = flat_outputs(region)
    read: set[int] = set()
    for user in call.users:
        if user.op == "call_function" and user.target is not operator.getitem:
            read.add(0)
        elif user.op == "call_function" and any(u.op == "call_function" for u in user.users):
            read.add(user.args[1])
    layouts = {}
    for index in sorted(read):
        order = _dense_dim_order(getattr(results[index], "meta", {}).get("val"))
        if order is not None and order != tuple(range(len(order))):
            layouts[index] = order
    return layouts


def _dense_dim_order(value) -> tuple[int, ...] | None:
    """The dim order of a dense traced tensor, by its size hints (a permutation's order does not
    depend on the sizes); None for other layouts and unbacked sizes (no hint to order by)."""
    from .lowering.ops.common import dense_dim_order

    if not isinstance(value, torch.Tensor):
        return None
    sizes = [n if isinstance(n, int) else n.node.hint for n in value.shape]
    strides = [n if isinstance(n, int) else n.node.hint for n in value.stride()]
    if None in sizes or None in strides:
        return None
    return dense_dim_order(sizes, strides)


class _Unboxed(torch.nn.Module):
    """A compiled `region` called by `call` from an FX graph with positional arguments; the
    results eager ops read are given the layouts they were traced with."""

    def __init__(self, compiled, region: torch.fx.GraphModule, call: torch.fx.Node):
        super().__init__()
        self.compiled = compiled
        self.returns_tuple = _returns_tuple(region)
        self.layouts = _layouts_eager_ops_read(region, call)

    def forward(self, *args):
        outs = self.compiled(list(args))
        for index, order in self.layouts.items():
            out = outs[index]
            if not out.permute(order).is_contiguous():  # a view of an input may already be
                outs[index] = torch.empty_permuted(
                    out.shape, order, dtype=out.dtype, device=out.device
                ).copy_(out)
        return tuple(outs) if self.returns_tuple else outs[0]


def _compile_region(gm, example_inputs, options: Options, device, static_inputs, name: str):
    from .passes import pipeline

    hook = debug.pass_hook(name, gm, options)
    gm = pipeline.run_passes(gm, options.disable_passes, after_pass=hook)
    if example_inputs is None:
        example_inputs = _placeholder_values(gm)
    specializer = _Specializer(gm, options, device, static_inputs, name)
    if example_inputs is not None and all(_is_concrete(v) for v in example_inputs):
        return specializer(example_inputs)
    scalars = frozenset()
    if options.lowering != "torch-mlir" and options.x64 == "keep":  # narrow: 32 bits would wrap
        from .lowering import specialize

        scalars = specialize.value_only_integer_inputs(gm, device.lowering_platform)
    return SpecializingGraph(specializer, scalars)


def _placeholder_values(gm) -> list | None:
    values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return None if any(v is None for v in values) else values


def _is_concrete(value) -> bool:
    if isinstance(value, torch.Tensor):
        return all(isinstance(d, int) for d in value.shape)
    return not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


class _Specializer:
    """Stages 3-5 for one set of concrete input sizes, through the compile cache."""

    def __init__(self, gm, options: Options, device, static_inputs, name: str):
        self.name = name
        self.gm = gm
        self.options = options
        self.device = device
        self.static_inputs = tuple(static_inputs)
        self.graph_entry = _graph_fingerprint(gm)

    def __call__(
        self, inputs: Sequence[Any], scalars: frozenset[int] = frozenset()
    ) -> runtime.CompiledGraph:
        """Compiled for `inputs`; `scalars`: positions of integer inputs given as 0-d tensors."""
        signature = _input_signature(inputs)
        key = cache.CacheKey.of(
            [("graph", self.graph_entry), ("inputs", signature), ("strides", _strides(inputs))]
        )
        record = debug.new_record(
            self.name, signature, fingerprint=self.graph_entry, options=self.options
        )
        compiled = _cached_compile(
            key,
            self.options,
            self.device,
            self.static_inputs,
            record,
            lambda: self._lower_and_compile(inputs, scalars, record),
        )
        debug.finish(record)
        return compiled

    def _lower_and_compile(self, inputs, scalars, record: debug.CompileRecord):
        from .lowering import stablehlo, torch_mlir

        platform, x64 = self.device.lowering_platform, self.options.x64
        with record.stage("lower"):
            if self.options.lowering == "torch-mlir":
                lowered = torch_mlir.lower(self.gm, inputs, platform=platform, x64=x64)
            else:
                lowered = stablehlo.lower(
                    self.gm, inputs, platform=platform, x64=x64, scalar_inputs=scalars
                )
        debug.dump_lowered(record, lowered)
        with (
            record.stage("pjrt_compile"),
            debug.reproducer_on_error(record, lowered, self.device.platform),
        ):
            executable = runtime.compile_stablehlo(lowered.bytecode, self.device)
        debug.dump_executable(record, executable)
        log.info(
            "tpu_inductor: compiled %s for inputs %s: lower %.2fs, PJRT compile %.2fs",
            self.name,
            record.inputs,
            record.timings["lower"],
            record.timings["pjrt_compile"],
        )
        return executable, lowered


def context_entries(options: Options, device: runtime.Device) -> list[tuple[str, Any]]:
    """The compile-cache key entries besides the graph's: options, passes, environment."""
    from .passes import pipeline

    return [
        ("options", options.cache_key_entries()),
        ("passes", pipeline.pass_fingerprint(options.disable_passes)),
        *cache.environment_entries(device),
    ]


def _cached_compile(
    graph_key: cache.CacheKey,
    options: Options,
    device: runtime.Device,
    static_inputs: Sequence[int],
    record: debug.CompileRecord,
    compile_fn: Callable[[], Any] | None,
) -> runtime.CompiledGraph | None:
    """The graph of `graph_key` (graph and inputs entries) from the compile cache, or compiled
    by `compile_fn` and stored; None when it is not cached and there is no `compile_fn`."""
    key = cache.CacheKey(
        graph_key.entries + cache.CacheKey.of(context_entries(options, device)).entries
    )
    disk = None
    if options.cache:
        disk = cache.open_disk_cache(options.cache_dir, options.cache_max_mb)
    value = cache.memory_cache.get_or_compile(
        key,
        compile_fn,
        disk=disk,
        codec=_disk_codec(device),
        info=record.cache,
        stage=record.stage,
        label=f"{record.graph} {record.inputs}",
    )
    if value is None:
        return None
    executable, lowered = value
    if record.cache["decision"] in ("memory_hit", "disk_hit"):  # `compile_fn` dumped the others
        debug.dump_lowered(record, lowered)
        debug.dump_executable(record, executable)
    static = static_inputs if options.resident_params else ()
    return runtime.CompiledGraph(executable, lowered, device, static, graph_key)


def load_cached(
    kind: str,
    graph_key: cache.CacheKey,
    static_inputs: Sequence[int],
    example_inputs: Sequence[Any],
    options: Options,
) -> runtime.CompiledGraph | None:
    """A graph compiled by an earlier process, from the compile cache only (None if absent).

    For torch's AOTAutogradCache, which keeps `graph_key` and not the graph: the rest of the
    key comes from this process's options and environment.
    """
    device = runtime.select_device(options.device)
    record = debug.new_record(
        f"{kind}_{next(_graph_ids)}", _input_signature(example_inputs), options=options
    )
    record.cache["aot_autograd"] = "hit"
    record.cache["stages_skipped"] = "ATen graph and passes: nothing was traced in this process"
    compiled = _cached_compile(graph_key, options, device, static_inputs, record, None)
    if compiled is None:
        record.status, record.error = "failed", "not in the compile cache: compiled again"
        return None
    debug.finish(record)
    return compiled


def _disk_codec(device: runtime.Device) -> cache.Codec:
    """(executable, LoweredModule) ↔ files and a JSON manifest, for the disk cache."""
    from . import serialize

    def encode(value):
        executable, lowered = value
        meta = {"lowered": serialize.lowered_to_json(lowered)}
        files = {
            "executable.bin": runtime.serialize_executable(executable, device),
            "module.mlirbc": lowered.bytecode,
            "module.mlir": lowered.text.encode(),
        }
        return files, meta

    def decode(files, meta):
        text = files["module.mlir"].decode()
        lowered = serialize.lowered_from_json(meta["lowered"], files["module.mlirbc"], text)
        executable = runtime.deserialize_executable(files["executable.bin"], device, text)
        return executable, lowered

    return cache.Codec(encode, decode)


class SpecializingGraph:
    """A graph with symbolic sizes, compiled once per concrete input signature.

    Integer inputs that are values only (`scalars`: positions) are passed as 0-d int64 tensors,
    not compiled in: a new value is not a new signature. Should such a graph fail to lower, they
    are compiled in (once per value) from then on, with a warning.

    The `max_sizes` most recently used compiles are kept (a warning says when one is dropped).
    """

    max_sizes = 64

    def __init__(self, specialize: _Specializer, scalars: frozenset[int] = frozenset()):
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__, not the class
        self._specialize = specialize
        self._scalars = scalars
        self._compiled = cache.RecentlyUsed(self.max_sizes)
        self._warned = False

    def __call__(self, args: list) -> list:
        scalars = self._scalars
        passed = []  # (0-d tensor, the int it stands for)
        for position in scalars:
            passed.append((torch.tensor(args[position]), args[position]))
            args[position] = passed[-1][0]
        outs = self._call(args, scalars)
        for tensor, number in passed:  # an input returned as it is (saved for the backward)
            outs = [number if out is tensor else out for out in outs]
        return outs

    def _call(self, args: list, scalars: frozenset[int]) -> list:
        key = (_input_signature(args), _strides(args))
        compiled = self._compiled.get(key)
        if compiled is None:  # debug.new_record logs why (which input, which dim)
            try:
                compiled = self._specialize(args, scalars)
            except Exception as e:  # a rule, or size arithmetic the trace cannot do
                if not scalars:
                    raise
                log.warning(
                    "tpu_inductor: %s: integer inputs %s compiled in as constants (each new value "
                    "compiles again): passed as tensors, they failed to lower: %s",
                    self._specialize.name,
                    sorted(scalars),
                    e,
                )
                self._scalars = frozenset()
                for position in scalars:
                    args[position] = int(args[position])
                return self._call(args, frozenset())
            self._keep(key, compiled)
        return compiled(args)

    def _keep(self, key: tuple, compiled: runtime.CompiledGraph) -> None:
        if self._compiled.put(key, compiled) and not self._warned:
            self._warned = True
            log.warning(
                "tpu_inductor: %s has been compiled for more than %d input sizes; the least "
                "recently used are dropped (compiled again if they come back). Pad inputs "
                "to a few fixed sizes.",
                self._specialize.name,
                self.max_sizes,
            )


def _input_signature(inputs: Sequence[Any]) -> tuple:
    return tuple(
        (tuple(int(d) for d in v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else v
        for v in inputs
    )


def _strides(inputs: Sequence[Any]) -> tuple:
    """The tensor inputs' strides: rules may lower by layout (det factors a contiguous A^T)."""
    return tuple(tuple(v.stride()) if isinstance(v, torch.Tensor) else None for v in inputs)


def _graph_fingerprint(gm: torch.fx.GraphModule) -> str:
    """The graph's code (comments, i.e. source locations, stripped) and its tensor constants."""
    code = "\n".join(line for line in gm.code.splitlines() if not line.lstrip().startswith("#"))
    digest = hashlib.sha256(code.encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Tensor):
                data = value.detach().cpu().contiguous()
                digest.update(f"{node.target}:{data.dtype}:{tuple(data.shape)}".encode())
                raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
                digest.update(raw)
    return digest.hexdigest()
