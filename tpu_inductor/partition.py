"""Partition: the nodes our rules lower become compiled regions; the rest runs in eager torch.

Stage 2 of compile_fx, after the passes ran on the whole graph. `missing` says which ops have no
rule; `report_missing` raises on them (fallback="error") or warns; `split` fuses the supported
nodes into regions (torch's CapabilityBasedPartitioner), compiles each through the
`compile_region` callable compile_fx hands in, and, with fallback="torch-mlir", gives the regions
left to eager torch to torch-mlir. The split graph is a boxed callable (a list in, a list out).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tpu_inductor import lowering
from tpu_inductor.debug import profiling
from tpu_inductor.exc import TpuInductorError, UnsupportedOpError
from tpu_inductor.runtime.host_sync import host_sync
from tpu_inductor.runtime.size_dispatch import is_concrete, placeholder_values

if TYPE_CHECKING:
    from tpu_inductor.config import Options
    from tpu_inductor.debug.records import GraphObserver

log = logging.getLogger(__name__)

aten = torch.ops.aten
# Ops that read their argument's strides and storage, not only its values.
_READS_STORAGE = frozenset(
    {aten.as_strided.default, aten.as_strided_copy.default, aten.as_strided_scatter.default}
)
# compile_region(region, observer) → a boxed callable (under the observer's options).
CompileRegion = Callable[[torch.fx.GraphModule, "GraphObserver"], Callable]


def missing(gm: torch.fx.GraphModule, options: Options, platform: str) -> dict[str, list[str]]:
    """The ops of `gm` with no rule (op name → source lines); none when torch-mlir lowers all."""
    if "torch-mlir" in (options.lowering, options.fallback):
        from tpu_inductor.lowering import torch_mlir

        torch_mlir.require()
    return {} if options.lowering == "torch-mlir" else lowering.missing_ops(gm, platform)


def report_missing(missing: dict[str, list[str]], options: Options) -> None:
    """An UnsupportedOpError naming each op and its sites (fallback="error"), else a warning."""
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
                "\nHigher-order ops other than flex_attention (torch.cond, while_loop, scan, "
                "map) are not lowered: they run in eager torch (torch.where can replace a "
                "torch.cond)."
                if hops
                else ""
            )
            + _custom_ops_hint(missing)
            + "\nRemove options={'fallback': 'error'} to run them in eager torch (an AOT "
            "artifact cannot), or add rules for ATen ops (README: 'Adding a lowering rule')."
        )
    summary = ", ".join(f"{op} x{len(sites)}" for op, sites in sorted(missing.items()))
    log.warning(
        "tpu_inductor: running ops without a lowering in eager torch (graph split): %s%s",
        summary,
        _custom_ops_hint(missing),
    )


def _custom_ops_hint(missing: dict[str, list[str]]) -> str:
    """A line naming the custom ops (torch.library, not ATen's or prims') among `missing` and
    the API that lowers them; "" for none."""
    custom = list(dict.fromkeys(filter(None, map(_custom_op, sorted(missing)))))
    if not custom:
        return ""
    return (
        f"\nCustom ops without a rule: {', '.join(custom)}. Lower one with a jax function: "
        f"@tpu_inductor.register_lowering({custom[0]!r}) (README: 'Lowering a custom op')."
    )


def _custom_op(name: str) -> str | None:
    """The spelling "namespace::op" of a torch.library custom op's name ("ns.op.overload"),
    None for other names (ATen, prims, higher-order ops, Python functions)."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] in ("aten", "prims", "torch", "higher_order"):
        return None
    namespace, op, overload = parts
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
    except AttributeError:  # a Python function's module.qualname
        return None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or overload not in packet.overloads():
        return None
    return f"{namespace}::{op}" if overload == "default" else f"{namespace}::{op}.{overload}"


def split(
    gm: torch.fx.GraphModule,
    options: Options,
    platform: str,
    observer: GraphObserver,
    compile_region: CompileRegion,
) -> Callable[[list], list]:
    """Fuse supported nodes into regions compiled by `compile_region`; the rest of `gm` runs
    in eager torch. Returns the split graph with the boxed calling convention."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import create_op_support

    eager = _eager_nodes(gm, platform)
    partitioner = CapabilityBasedPartitioner(
        gm,
        create_op_support(lambda _modules, node: node.op == "call_function" and node not in eager),
        allows_single_node_partition=True,
    )
    partitions = [p for p in partitioner.propose_partitions() if _computes(p.nodes)]
    fused = partitioner.fuse_partitions(partitions)
    observer.graph("partitioned", fused)
    for region, sub in list(fused.named_children()):
        if region.startswith("fused_"):
            compiled = compile_region(sub, observer.region(region, sub))
            setattr(fused, region, _Unboxed(compiled, sub, _call_of(fused, region)))
    if options.fallback == "torch-mlir":
        fused = _lower_rest_with_torch_mlir(fused, options, platform, observer, compile_region)
    fused.recompile()
    log.info("tpu_inductor: compiled %d region(s); the rest runs in eager torch", len(partitions))
    return _boxed_outputs_list(fused, observer.name)


def _eager_nodes(gm: torch.fx.GraphModule, platform: str) -> set[torch.fx.Node]:
    """The call nodes of a split graph that run in eager torch: those without a rule; a write
    into an input (it stays in graph order: eager ops read the input before it); views of
    results computed in eager (a compiled region would return a copy, not a view of them); and
    the producers of what an eager `as_strided` reads, back to a result laid out contiguously
    from offset 0 (a compiled region returns that layout; as_strided reads the strides)."""
    from torch._ops import OpOverload

    eager: set[torch.fx.Node] = set()
    while True:
        found = len(eager)
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            of_eager = bool(node.args) and node.args[0] in eager
            if (
                not lowering.supported(node, platform)
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


def _lower_rest_with_torch_mlir(fused, options: Options, platform, observer, compile_region):
    """The regions of `fused` our rules left to eager torch, lowered by torch-mlir where it can.

    A region torch-mlir cannot lower (or whose sizes are symbolic) stays in eager torch; the
    ops that do are reported as fallback ops, each region's choice is logged.
    """
    from torch._ops import OpOverload
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import create_op_support

    def eager_op(_modules, node) -> bool:
        if node.target is operator.getitem:  # keep a multi-result op's getitems with it
            node = node.args[0]
        return node.op == "call_function" and isinstance(node.target, OpOverload)

    partitioner = CapabilityBasedPartitioner(
        fused, create_op_support(eager_op), allows_single_node_partition=True
    )
    partitions = [p for p in partitioner.propose_partitions() if _computes(p.nodes)]
    fused = partitioner.fuse_partitions(partitions, prefix="torch_mlir_")
    tm_options = dataclasses.replace(options, lowering="torch-mlir")
    eager: dict[str, list[str]] = {}
    for region, sub in list(fused.named_children()):
        if not region.startswith("torch_mlir_"):
            continue
        ops = lowering.missing_ops(sub, platform)
        values = placeholder_values(sub)
        try:
            if values is None or not all(is_concrete(v) for v in values):
                raise UnsupportedOpError("its input sizes are symbolic")
            compiled = compile_region(sub, observer.region(region, sub, tm_options))
        except TpuInductorError as e:
            log.warning(
                "tpu_inductor: %s.%s (%s) runs in eager torch: %s",
                observer.name,
                region,
                ", ".join(ops),
                e,
            )
            for op, sites in ops.items():
                eager.setdefault(op, []).extend(sites)
            continue
        log.info(
            "tpu_inductor: %s.%s (%s) lowered by torch-mlir", observer.name, region, ", ".join(ops)
        )
        setattr(fused, region, _Unboxed(compiled, sub, _call_of(fused, region)))
    if eager:
        report_missing(eager, options)
        observer.fallback(eager, platform)
    return fused


def _boxed_outputs_list(gm: torch.fx.GraphModule, name: str) -> Callable[[list], list]:
    """A partitioned graph with the compiled-graph convention: a list in, a list out. The
    inputs its eager ops read are brought up to date first where a compiled graph left their
    host copy stale (host_sync="explicit"): eager torch reads host memory. Profiled, a call is
    one "eager" range of graph `name` (its regions' calls inside)."""
    returns_tuple = _returns_tuple(gm)
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    read_in_eager = tuple(
        index
        for index, node in enumerate(placeholders)
        if any(_runs_in_eager(user) for user in node.users)
    )

    def run(args: list) -> list:
        if profiling.active:
            with profiling.span("eager", name):
                return call(args)
        return call(args)

    def call(args: list) -> list:
        if read_in_eager and host_sync.pending:
            host_sync.sync([args[i] for i in read_in_eager if isinstance(args[i], torch.Tensor)])
        out = gm(*args)
        args.clear()
        return list(out) if returns_tuple else [out]

    run._boxed_call = True
    return run


def _runs_in_eager(node: torch.fx.Node) -> bool:
    """Whether a node of a split graph is an eager op (not a compiled region's call)."""
    if node.op == "call_module":
        return not str(node.target).startswith("fused_")
    return node.op == "call_function"


def _computes(nodes) -> bool:
    return any(lowering.computes(n) for n in nodes)


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
    results = lowering.flat_outputs(region)
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
    if not isinstance(value, torch.Tensor):
        return None
    sizes = [n if isinstance(n, int) else n.node.hint for n in value.shape]
    strides = [n if isinstance(n, int) else n.node.hint for n in value.stride()]
    if None in sizes or None in strides:
        return None
    return lowering.dense_dim_order(sizes, strides)


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
