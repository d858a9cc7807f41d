"""The Dynamo backend `tpu_inductor`, found through the `torch_dynamo_backends` entry point.

Options are parsed and validated first; then AOTAutograd functionalizes the Dynamo graph,
decomposes it to core ATen and splits forward from backward, and hands each graph to
`compile_fx.compile_graph`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tpu_inductor import decompositions
from tpu_inductor.config import Options
from tpu_inductor.debug import records
from tpu_inductor.exc import DeviceError
from tpu_inductor.runtime import residency, size_dispatch
from tpu_inductor.sharding import shard as sharding
from tpu_inductor.sharding.mesh import common_mesh

log = logging.getLogger(__name__)


def tpu_inductor(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: dict[str, Any] | None = None,
    mode: str | None = None,
):
    """Compile a Dynamo FX graph; returns a callable with the graph's calling convention."""
    opts = Options.from_user(options, mode)
    records.dynamo_graph(gm, opts)
    if any(isinstance(v, torch.Tensor) and v.is_meta for v in example_inputs):  # shapes only
        log.warning("tpu_inductor: a graph of meta tensors has nothing to compute: eager torch")
        return gm.forward
    _require_cpu_tensors(example_inputs)
    from torch._dynamo.backends.common import aot_autograd

    from tpu_inductor.cache import (
        aot_autograd as autograd_cache,  # imports torch._inductor: not at module import
    )
    from tpu_inductor.compile_fx import compile_graph, load_cached

    # AOTAutograd's graphs take the Dynamo graph's own parameters and buffers (an optimizer
    # step's) first, in aot_module_simplified's order, then its inputs, a list flattened (the
    # one list a compiled-autograd graph takes).
    lifted = {
        **dict(gm.named_parameters(remove_duplicate=False)),
        **dict(gm.named_buffers(remove_duplicate=False)),
    }
    inputs = (*lifted.values(), *torch.utils._pytree.arg_tree_leaves(*example_inputs))
    placed = sharding.placements(inputs)
    # Saved activations kept on the device that a compiled-autograd backward takes: AOTAutograd
    # hands the graph their stand-ins (residency.DeviceTensor).
    kept = tuple(i for i, v in enumerate(inputs) if type(v) is residency.DeviceTensor)
    # Inputs another graph returned (gradients a compiled optimizer step takes, those saved
    # activations): a device copy of them may be there (residency.mirrors), which the graph
    # takes instead of sending them.
    from_graphs = tuple(
        i
        for i, v in enumerate(inputs)
        if i in kept or isinstance(v, torch.Tensor) and residency.mirrors.has_copy(v)
    )
    mesh = common_mesh(placed)
    # AOTAutograd's cache key knows nothing of placements: a graph over a mesh skips it (our
    # compile cache, whose key holds the mesh and specs, still serves it).
    use_autograd_cache = autograd_cache.enabled(gm, opts) and mesh is None
    if use_autograd_cache:
        gm._backend_id = autograd_cache.backend_id(opts)

    # Over a mesh: how the forward left its saved activations on the devices, for the backward.
    saved_layouts: list = []

    def compiler(kind: str):
        def compile_one(fx_graph, inputs):
            static = _static_input_indices() if kind != "backward" else ()
            roles = _roles(kind, fx_graph, len(inputs), from_graphs)
            placements = _placements(kind, fx_graph, mesh, placed, roles, saved_layouts)
            compiled = compile_graph(
                fx_graph,
                inputs,
                opts,
                static_inputs=static,
                kind=kind,
                roles=roles,
                placements=placements,
            )
            if kind == "forward" and mesh is not None:
                specs = getattr(compiled, "output_partition_specs", dict)()
                saved_layouts[:] = [specs.get(i) for i in roles.saved_outputs]
            if kept and kind != "backward":
                compiled = _standing_for(compiled, kept)
            return (
                autograd_cache.CachedGraph(compiled, kind, static, roles)
                if use_autograd_cache
                else compiled
            )

        if not use_autograd_cache:
            return compile_one
        from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler

        return SerializableAOTDispatchCompiler(autograd_cache.CachedGraph, compile_one)

    # Effect tokens (of _linalg_check_errors, ...) made inside the graph, as Inductor has them,
    # instead of graph inputs that AOTAutograd fills with None at run time.
    with (
        torch._functorch.config.patch(unlift_effect_tokens=True),
        autograd_cache.active(opts, load_cached)
        if use_autograd_cache
        else contextlib.nullcontext(),
        decompositions.tracing(),
        size_dispatch.new_trace() as wrap,
    ):
        compiled = aot_autograd(
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            partition_fn=_partition,
            decompositions=decompositions.table(),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    return wrap(compiled)


def _standing_for(compiled: Callable[[list], list], positions: tuple[int, ...]):
    """`compiled`, called with the DeviceTensors that the stand-ins at `positions` stand for:
    the graph's whole executable takes their arrays, a split graph's eager ops their values
    (read from the device, counted). (A graph loaded from AOTAutograd's cache, whole, takes the
    stand-ins themselves: their mirrors are the arrays.)"""
    stood_for = residency.DeviceTensor.stood_for

    def run(args: list) -> list:
        for position in positions:
            args[position] = stood_for(args[position])
        return compiled(args)

    run._boxed_call = True
    run.graph_key = getattr(compiled, "graph_key", None)  # (storable in AOTAutograd's cache)
    return run


def _require_cpu_tensors(inputs: Sequence[Any]) -> None:
    """Tensors come in from torch's CPU; the runtime moves them to the PJRT device itself."""
    for position, value in enumerate(inputs):
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise DeviceError(
                f"tpu_inductor: graph input {position} is a tensor on {value.device}; the "
                "compiled graph takes CPU tensors and runs on the PJRT device of the 'device' "
                "option. Move the model and its inputs to the CPU (.cpu()), or compile for "
                f"{value.device.type} with another backend."
            )


def _partition(joint, joint_inputs, **kwargs):
    """Forward/backward split by Inductor's min-cut partitioner: views and cheap pointwise ops
    are recomputed in the backward instead of saved. Saved tensors are module outputs, which XLA
    materializes: saving `weight.t()` made every training step transpose and copy each weight.
    """
    from functorch.compile import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _static_input_indices() -> tuple[int, ...]:
    """Positions of parameters and buffers among the forward graph's inputs (kept resident)."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None) if context else None
    return tuple(getattr(metadata, "static_input_indices", None) or ())


def _roles(kind: str, gm: torch.fx.GraphModule, dynamo_inputs: int, from_graphs: tuple):
    """What AOTAutograd's calling convention makes of a graph's inputs and outputs: the
    activations the forward saves for the backward (a forward's outputs past its returns, its
    slice of them, tensors; a backward's inputs that are not the gradients of the forward's
    outputs, `tangents_*`), the tangents, the mutated inputs whose version its wrapper bumps
    after the call; a backward's gradients become mirrors, and the inputs another graph returned
    (`from_graphs`, positions among the `dynamo_inputs` the forward takes in order) are taken
    from theirs."""
    import dataclasses

    from tpu_inductor.runtime.compiled_graph import GraphRoles

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if kind == "backward":
        tangents = tuple(i for i, n in enumerate(placeholders) if n.name.startswith("tangents"))
        inputs = tuple(i for i in range(len(placeholders)) if i not in tangents)
        return GraphRoles(saved_inputs=inputs, mirror_outputs=True, tangent_inputs=tangents)
    roles = _forward_roles(kind, gm)
    if from_graphs and len(placeholders) == dynamo_inputs:
        roles = dataclasses.replace(roles, mirrored_inputs=from_graphs)
    return roles


def _forward_roles(kind: str, gm: torch.fx.GraphModule):
    """A forward's or inference graph's roles from AOTAutograd's metadata (see `_roles`)."""
    from torch._guards import TracingContext

    from tpu_inductor.runtime.compiled_graph import GraphRoles

    context = TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None) if context else None
    if metadata is None:
        return GraphRoles()
    bumped = tuple(metadata.mutated_graph_handled_indices_seen_by_autograd)
    if kind != "forward" or metadata.num_symints_saved_for_bw is None:
        return GraphRoles(bumped_inputs=bumped)
    outputs = len(gm.graph.output_node().args[0])
    saved = metadata.tensors_saved_for_backwards_slice.indices(outputs)
    return GraphRoles(saved_outputs=tuple(range(*saved)), bumped_inputs=bumped)


def _placements(kind: str, gm: torch.fx.GraphModule, mesh, placed, roles, saved_layouts):
    """The placements (sharding.placement) of the Dynamo graph's inputs, as the ATen graph's:
    a forward's inputs are those inputs in order; a backward's outputs are their gradients, in
    the same order, placed as they are, and its saved activations come split as the forward
    left them (`saved_layouts`, in order). None without a mesh."""
    if mesh is None:
        return None
    from tpu_inductor.passes.annotate_sharding import SpecPlan

    specs = {i: p.spec for i, p in enumerate(placed) if p is not None}
    if kind == "backward":
        count = len(gm.graph.output_node().args[0])
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        saved = [
            i
            for i in roles.saved_inputs
            if isinstance(placeholders[i].meta.get("val"), torch.Tensor)
        ]
        layouts = {}
        if len(saved) == len(saved_layouts):
            layouts = {i: s for i, s in zip(saved, saved_layouts) if s is not None}
        where, plan = "outputs", SpecPlan(mesh, inputs=layouts, outputs=specs)
    else:
        count = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
        where, plan = "inputs", SpecPlan(mesh, inputs=specs)
    if count != len(placed):
        log.warning(
            "tpu_inductor: the %s graph has %d %s for the %d inputs Dynamo gave; the placements "
            "of parameters and inputs are not applied to it (it runs on mesh %s with them whole "
            "on every device)",
            kind,
            count,
            where,
            len(placed),
            mesh,
        )
        return SpecPlan(mesh)
    return plan
