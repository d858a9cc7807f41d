"""Sharding annotation: where the graph's inputs and outputs live on the device mesh.

Reads the placements the caller found (`ctx.plan`: a `SpecPlan` of graph input position →
partition spec, and of graph output position → spec, e.g. a gradient placed as its parameter)
and the sharding constraints in the graph (`tpu_inductor::shard_as`, from `mark_sharding`
inside compiled code and from their gradients). Writes:

- `gm.meta["sharding"]`: a `GraphSharding` (the mesh, each input's spec) for compile_fx, which
  compiles the graph for the mesh's devices and gives the lowering the inputs' specs;
- a constraint on each placed output, so the partitioner computes it split that way (a
  gradient reduce-scattered into its parameter's layout, not all-reduced).

An input with no placement whose value goes straight into a constraint takes that
constraint's spec (it is sent shard by shard instead of whole and then split). The mesh is
the placements' and the constraints' one: two meshes in one graph are an error. A graph with
neither is left alone (one device).
"""

from __future__ import annotations

import dataclasses

import torch

from tpu_inductor.sharding import Mesh, Placement, Spec, check_spec, common_mesh
from tpu_inductor.sharding_op import decode, encode_spec, is_constraint

from .context import PassContext


@dataclasses.dataclass(frozen=True)
class SpecPlan:
    """Placements the caller knows: graph input position → spec, graph output position → spec,
    all on `mesh`."""

    mesh: Mesh
    inputs: dict[int, Spec] = dataclasses.field(default_factory=dict)
    outputs: dict[int, Spec] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class GraphSharding:
    """The mesh a graph runs on and the spec of each graph input placed on it (by position;
    the others are whole on every device)."""

    mesh: Mesh
    inputs: dict[int, Spec]


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    plan: SpecPlan | None = ctx.plan
    constraints = [n for n in gm.graph.nodes if is_constraint(n)]
    meshes = [Placement(decode(*n.args[1:])[0], ()) for n in constraints]
    if plan is not None:
        meshes.append(Placement(plan.mesh, ()))
    mesh = common_mesh(meshes)
    if mesh is None:
        return gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = dict(plan.inputs) if plan is not None else {}
    for position, node in enumerate(placeholders):
        if position not in inputs:
            spec = _constraint_of(node)
            if spec is not None:
                inputs[position] = spec
                ctx.rewrites["inputs_from_constraints"] += 1
        elif isinstance(node.meta.get("val"), torch.Tensor):
            check_spec(mesh, tuple(node.meta["val"].shape), inputs[position], f"input {node.name}")
    ctx.rewrites["inputs"] += len(inputs)
    ctx.rewrites["constraints"] += len(constraints)
    if plan is not None and plan.outputs:
        _constrain_outputs(gm, mesh, plan.outputs, ctx)
    gm.meta["sharding"] = GraphSharding(mesh, inputs)
    return gm


def _constraint_of(node: torch.fx.Node) -> Spec | None:
    """The spec of the first constraint `node` goes straight into, if any."""
    for user in node.users:
        if is_constraint(user) and user.args[0] is node:
            return decode(*user.args[1:])[1]
    return None


def _constrain_outputs(gm, mesh: Mesh, outputs: dict[int, Spec], ctx: PassContext) -> None:
    """A constraint on each placed graph output (a tensor of the spec's rank or more)."""
    output = gm.graph.output_node()
    values = list(output.args[0])
    for position, spec in outputs.items():
        value = values[position] if position < len(values) else None
        fake = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if not isinstance(fake, torch.Tensor) or fake.ndim < len(spec) or not spec:
            continue
        with gm.graph.inserting_before(output):
            node = gm.graph.call_function(
                torch.ops.tpu_inductor.shard_as.default, (value, str(mesh), encode_spec(spec))
            )
        node.meta["val"] = fake
        values[position] = node
        ctx.rewrites["outputs"] += 1
    output.args = (tuple(values),) + tuple(output.args[1:])
