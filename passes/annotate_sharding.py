"""Sharding annotation: where the graph's inputs and outputs live on the device mesh.

Reads the placements the caller found (`ctx.plan`: a `SpecPlan` of graph input position →
partition spec, and of graph output position → spec, e.g. a gradient placed as its parameter)
and the sharding constraints in the graph (`tpu_inductor::shard_as`, from `mark_sharding`
inside compiled code and from their gradients). Writes:

- a `GraphSharding` (the mesh, each input's spec), read with `layout_of(gm)`: compile_fx
  compiles the graph for the mesh's devices and gives the lowering the inputs' specs;
- a constraint on each placed output, so the partitioner computes it split that way (a
  gradient reduce-scattered into its parameter's layout, not all-reduced);
- a constraint on the new value of each placed input the graph writes (an optimizer step's
  parameters and moments stay split as placed, never gathered whole on every device).

An input with no placement whose value goes straight into a constraint takes that
constraint's spec (it is sent shard by shard instead of whole and then split). The mesh is
the placements' and the constraints' one: two meshes in one graph are an error. A graph with
neither is left alone (one device).

Expert parallelism: a grouped matmul over rows sorted by expert (`aten._grouped_mm`'s 2-d x 3-d
form, transformers' `grouped_mm_fallback` and its backward) whose stacked expert weight is
split over one mesh axis along its expert dim only becomes `tpu_inductor::expert_mm` (or
`expert_mm_backward`) on that axis (tpu_inductor/ops/expert.py): the lowering dispatches rows to
the devices holding their experts by all-to-all. The weight's spec is found by following it
back through views that keep its first dim to a placed input, or, for a backward, its
gradient forward to the constraint that places it. Counted as `expert_parallel`.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

import tpu_inductor.ops.expert  # noqa: F401  (registers the expert_mm ops)
from tpu_inductor.ops.shard_as import decode, encode_spec, is_constraint
from tpu_inductor.sharding.mesh import Mesh, Placement, Spec, check_spec, common_mesh

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


def layout_of(gm: torch.fx.GraphModule) -> GraphSharding | None:
    """What this pass made of `gm`: its mesh and each input's spec, or None on one device."""
    return gm.meta.get("sharding")


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
    _constrain_writes(gm, mesh, inputs, placeholders, ctx)
    _expert_parallel(gm, mesh, inputs, ctx)
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


def _constrain_writes(gm, mesh: Mesh, inputs: dict[int, Spec], placeholders, ctx) -> None:
    """A constraint on the new value of each placed input the graph writes (AOTAutograd's
    `copy_` into it: an optimizer step's parameters and moments), so it stays split as placed
    (else the partitioner may return it whole on every device)."""
    position_of = {node: i for i, node in enumerate(placeholders)}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy_.default:
            continue
        target, value = node.args[0], node.args[1]
        spec = inputs.get(position_of.get(target, -1))
        fake = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if not spec or not isinstance(fake, torch.Tensor) or fake.ndim < len(spec):
            continue
        with gm.graph.inserting_before(node):
            split = gm.graph.call_function(
                torch.ops.tpu_inductor.shard_as.default, (value, str(mesh), encode_spec(spec))
            )
        split.meta["val"] = fake
        node.args = (target, split, *node.args[2:])
        ctx.rewrites["written_inputs"] += 1


aten = torch.ops.aten
# Ops that keep a tensor's first dim where it is (the expert dim of a stacked weight).
_KEEP_FIRST = (aten.alias.default, aten.clone.default, aten._to_copy.default)


def _keeps_first_dim(node) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target in _KEEP_FIRST:
        return True
    if node.target is aten.permute.default:
        return list(node.args[1])[0] % node.args[0].meta["val"].ndim == 0
    if node.target is aten.transpose.int:
        ndim = node.args[0].meta["val"].ndim
        return all(d % ndim != 0 for d in node.args[1:3])
    return False


def _weight_spec(weight, placeholders, inputs: dict[int, Spec]) -> Spec | None:
    """The spec of the placed input `weight` is a first-dim-keeping view of, if any."""
    while _keeps_first_dim(weight):
        weight = weight.args[0]
    if isinstance(weight, torch.fx.Node) and weight.op == "placeholder":
        return inputs.get(placeholders.index(weight))
    return None


def _gradient_spec(node) -> Spec | None:
    """The spec of the constraint a backward's weight gradient (`node[1]`) goes into, if any."""
    users = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]
    value = users[0] if len(users) == 1 else None
    while value is not None and len(value.users) == 1:
        (user,) = value.users
        if is_constraint(user):
            return decode(*user.args[1:])[1]
        value = user if _keeps_first_dim(user) and user.args[0] is value else None
    return None


def _grouped_rows(node) -> tuple[str, tuple] | None:
    """("forward", (x, weight, offs)) or ("backward", (x, weight, offs, grad)) for a grouped
    matmul over rows sorted by expert, else None."""
    if node.op != "call_function":
        return None
    if str(node.target) == "transformers.grouped_mm_fallback.default":
        return "forward", tuple(node.args[:3])
    if str(node.target) == "transformers.grouped_mm_fallback_backward.default":
        return "backward", tuple(node.args[:4])
    if node.target is aten._grouped_mm.default:
        names = ("self", "mat2", "offs", "bias", "out_dtype")
        args = {**dict(zip(names, node.args)), **node.kwargs}
        a, b = args["self"].meta["val"], args["mat2"].meta["val"]
        plain = args.get("bias") is None and args.get("out_dtype") in (None, a.dtype)
        if a.ndim == 2 and b.ndim == 3 and args.get("offs") is not None and plain:
            return "forward", (args["self"], args["mat2"], args["offs"])
    return None


def _expert_parallel(gm, mesh: Mesh, inputs: dict[int, Spec], ctx: PassContext) -> None:
    """Grouped matmuls whose expert weights are split along their expert dim only, over an
    axis of more than one device, made `expert_mm` ops over that axis (module docstring)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sizes = dict(mesh.axes)
    ops = torch.ops.tpu_inductor
    for node in list(gm.graph.nodes):
        found = _grouped_rows(node)
        if found is None:
            continue
        kind, operands = found
        spec = _weight_spec(operands[1], placeholders, inputs)
        if spec is None and kind == "backward":
            spec = _gradient_spec(node)
        if not spec or spec[0] is None or any(spec[1:]) or sizes[spec[0]] == 1:
            continue
        target = ops.expert_mm.default if kind == "forward" else ops.expert_mm_backward.default
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(target, (*operands, str(mesh), spec[0]))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        ctx.rewrites["expert_parallel"] += 1
