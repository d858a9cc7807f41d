"""Device meshes and where tensors live on them: the user-facing half of sharding.

A mesh is named axes of devices (`Mesh({"data": 2, "model": 4})`); a partition spec gives, per
dim of a tensor, the mesh axis it is split over, or None. XLA's SPMD partitioner (Shardy)
splits the computation and inserts the collectives: nothing here schedules communication.

Under torch.compile:

    mesh = tpu_inductor.Mesh({"data": 2, "model": 4})
    tpu_inductor.shard(model, mesh, tpu_inductor.sharding_plans.tensor_parallel("model"))
    tpu_inductor.mark_sharding(batch, mesh, ("data", None))    # an input, before the call
    y = tpu_inductor.mark_sharding(y, mesh, ("data", None, "model"))  # inside compiled code

`shard` and `mark_sharding` outside compiled code record each tensor's placement (`placement`);
the backend gives the graph inputs theirs (passes/annotate_sharding.py). Inside compiled code
`mark_sharding` is the `tpu_inductor::shard_as` op (sharding_op.py), a sharding constraint.

The ahead-of-time compiler's plans (`tpu-inductor compile --mesh data=8 [--shard x:data,-]`)
are `Plan`: without `--shard`, every input is split over the mesh's first axis along its first
dim (data parallelism) and weights are replicated.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .exc import OptionError

log = logging.getLogger(__name__)

_AXIS = re.compile(r"^[A-Za-z_]\w*$")

Spec = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True, init=False)
class Mesh:
    """Named mesh axes and their sizes, in order (devices are laid out row-major):
    `Mesh({"data": 2, "model": 4})` or `Mesh((("data", 2), ("model", 4)))`."""

    axes: tuple[tuple[str, int], ...]

    def __init__(self, axes: Mapping[str, int] | Sequence[tuple[str, int]]):
        items = tuple(axes.items()) if isinstance(axes, Mapping) else tuple(map(tuple, axes))
        for item in items:
            name, size = item if len(item) == 2 else (item, None)
            if (
                not (isinstance(name, str) and _AXIS.match(name))
                or type(size) is not int
                or size < 1
            ):
                raise OptionError(
                    f"tpu_inductor: Mesh({axes!r}): each axis is a name and a positive size, "
                    'e.g. Mesh({"data": 2, "model": 4}).'
                )
        names = [name for name, _ in items]
        if not items or len(set(names)) != len(names):
            raise OptionError(f"tpu_inductor: Mesh({axes!r}) needs axes, each named once.")
        object.__setattr__(self, "axes", items)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    def __str__(self) -> str:
        return ",".join(f"{name}={size}" for name, size in self.axes)


def parse_mesh(text: str) -> Mesh:
    """`data=4` or `data=2,model=4` → a Mesh."""
    axes = []
    for part in text.split(","):
        name, _, size = part.strip().partition("=")
        if not _AXIS.match(name) or not (size.isascii() and size.isdigit()) or int(size) < 1:
            raise OptionError(
                f"tpu-inductor: --mesh {text!r}: each axis is NAME=SIZE with a positive size, "
                "e.g. --mesh data=8 or --mesh data=2,model=4."
            )
        axes.append((name, int(size)))
    names = [name for name, _ in axes]
    if len(set(names)) != len(names):
        raise OptionError(f"tpu-inductor: --mesh {text!r} names an axis twice.")
    return Mesh(tuple(axes))


def parse_shard(text: str) -> tuple[str, tuple[str | None, ...]]:
    """`x:data,-` → ("x", ("data", None)): input x's first dim split over axis data, its second
    whole; `x:` (nothing after the colon) keeps x whole on every device."""
    name, colon, spec = text.partition(":")
    if not colon or not _AXIS.match(name):
        raise OptionError(
            f"tpu-inductor: --shard {text!r}: expected NAME:SPEC, SPEC a mesh axis or - per dim "
            "(e.g. --shard x:data,- splits x's first dim over axis data; x: replicates x)."
        )
    dims = [d.strip() for d in spec.split(",")] if spec else []
    return name, tuple(None if d == "-" else d for d in dims)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A mesh and the partition specs given for some inputs (`--shard`), by input name."""

    mesh: Mesh
    shards: tuple[tuple[str, tuple[str | None, ...]], ...] = ()

    def __post_init__(self) -> None:
        names = [name for name, _ in self.shards]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise OptionError(f"tpu-inductor: --shard is given more than once for {twice}.")

    def specs(self, inputs: Mapping[str, Sequence[int]]) -> dict[str, tuple[str | None, ...]]:
        """Each input's partition spec (input name → its shape): see `partition_specs`."""
        return partition_specs(self.mesh, inputs, dict(self.shards))


def partition_specs(
    mesh: Mesh,
    inputs: Mapping[str, Sequence[int]],
    shards: Mapping[str, tuple[str | None, ...]],
) -> dict[str, tuple[str | None, ...]]:
    """Each input's partition spec (input name → its shape): from `shards`, else its first dim
    over the mesh's first axis (an input without dims stays whole). Checked: axes exist, each
    used once per input, and divide the dims they split."""
    unknown = set(shards) - set(inputs)
    if unknown:
        raise OptionError(
            f"tpu-inductor: --shard names {sorted(unknown)}, which are not inputs "
            f"({', '.join(inputs)})."
        )
    specs = {}
    for name, shape in inputs.items():
        spec = tuple(shards.get(name, (mesh.names[0],) if shape else ()))
        whole = f"keep the dim whole with --shard {name}:{','.join('-' for _ in shape)}"
        check_spec(mesh, shape, spec, f"input {name}", whole, prefix="tpu-inductor")
        specs[name] = spec
    return specs


def check_spec(
    mesh: Mesh,
    shape: Sequence[int],
    spec: Spec,
    what: str,
    whole: str = "keep the dim whole (None in its place)",
    prefix: str = "tpu_inductor",
) -> None:
    """An OptionError naming `what` (its shape and the mesh) unless `spec` is a partition spec
    of `shape` on `mesh`: at most one entry per dim, axes of the mesh used once each, and each
    dividing the dim it splits (`whole`: how to keep a dim whole, for the message)."""
    where = f"{what} (shape {list(shape)})"
    if len(spec) > len(shape):
        raise OptionError(
            f"{prefix}: the sharding {spec} of {where} gives {len(spec)} dims; it has {len(shape)}."
        )
    sizes = dict(mesh.axes)
    used = [axis for axis in spec if axis is not None]
    if set(used) - set(sizes) or len(set(used)) != len(used):
        raise OptionError(
            f"{prefix}: the sharding {spec} of {where} must use axes of the mesh ({mesh}), each "
            "at most once."
        )
    for dim, axis in enumerate(spec):
        if axis is not None and isinstance(shape[dim], int) and shape[dim] % sizes[axis]:
            raise OptionError(
                f"{prefix}: {where}: dim {dim} ({shape[dim]}) does not divide over mesh axis "
                f"{axis} ({sizes[axis]} devices) of mesh {mesh}. Choose sizes that divide, or "
                f"{whole}."
            )


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a tensor lives: split over `mesh` by `spec` (an empty spec: whole on every device)."""

    mesh: Mesh
    spec: Spec


# The placements `shard` and `mark_sharding` gave tensors outside compiled code (not keeping
# them alive): the backend reads the graph inputs' here.
_placements: WeakIdKeyDictionary = WeakIdKeyDictionary()


# Optimizers whose state tensors take their parameters' placements (shard_optimizer_state).
_optimizers: weakref.WeakSet = weakref.WeakSet()


# Whether a compile read a placement (`placements`) since the last reset (_place).
_read_since_placed = [False]


def placement(tensor: Any) -> Placement | None:
    """The placement given to `tensor` (a parameter, a buffer, an input), or None."""
    return _placements.get(tensor) if isinstance(tensor, torch.Tensor) else None


def placements(values) -> list[Placement | None]:
    """Each value's placement: its own (`placement`), or, for the gradient and the state of a
    placed parameter of an optimizer given to `shard_optimizer_state` (Adam's moments), the
    parameter's."""
    states: dict[int, tuple[torch.Tensor, Placement]] = {}
    for optimizer in list(_optimizers):
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                given = placement(parameter)
                if given is None:
                    continue
                state = optimizer.state.get(parameter, {})
                for value in (parameter.grad, *state.values()):
                    if isinstance(value, torch.Tensor) and value.shape == parameter.shape:
                        states[id(value)] = (value, given)
    found = []
    for value in values:
        own, state = placement(value), states.get(id(value))
        found.append(own or (state[1] if state is not None and state[0] is value else None))
    _read_since_placed[0] |= any(p is not None for p in found)
    return found


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Split `optimizer`'s state and gradients like the parameters they belong to (a moment of
    a parameter FSDP splits is split the same way: ZeRO's optimizer-state sharding), as they
    are created and after; returns `optimizer`. Call it after `shard`, before the first compiled step."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptionError(
            f"tpu_inductor.shard_optimizer_state: {type(optimizer).__name__} is not a "
            "torch.optim.Optimizer."
        )
    _optimizers.add(optimizer)
    return optimizer


def shard(model: torch.nn.Module, mesh: Mesh, plan) -> torch.nn.Module:
    """Place `model`'s parameters and buffers on `mesh` by `plan`, and return `model`.

    `plan`: name globs → partition specs (`{"layers.*.mlp.up_proj.weight": ("model", None)}`),
    module-name globs → TorchTitan-style styles (`{"layers.*.attn.q_proj": ColwiseParallel()}`),
    or a ready-made plan (tpu_inductor.sharding_plans). Every entry must match something;
    unmatched tensors stay whole on every device. Specs are checked against each tensor's
    shape here, and the compile's cache key holds them."""
    from . import sharding_plans

    if not isinstance(mesh, Mesh):
        raise OptionError(
            f"tpu_inductor.shard: mesh is {mesh!r}; pass a tpu_inductor.Mesh, e.g. "
            'Mesh({"data": 2, "model": 4}).'
        )
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for name, spec in sharding_plans.resolve(model, mesh, plan).items():
        tensor = tensors[name]
        check_spec(mesh, tuple(tensor.shape), spec, f"parameter {name}")
        _place(tensor, Placement(mesh, spec), f"parameter {name}")
    return model


def mark_sharding(tensor: torch.Tensor, mesh: Mesh, spec: Sequence[str | None]) -> torch.Tensor:
    """Split `tensor` over `mesh` by `spec` (per dim: a mesh axis or None).

    Outside compiled code it records where a model input lives (the tensor is returned as it
    is: mark each new batch before the call). Inside compiled code it is a sharding constraint
    on the value it returns (use the result)."""
    spec = tuple(spec)
    check_spec(mesh, tuple(tensor.shape), spec, "the tensor given to mark_sharding")
    if torch.compiler.is_compiling():
        from .sharding_op import shard_as

        return shard_as(tensor, mesh, spec)
    _place(tensor, Placement(mesh, spec), "the tensor given to mark_sharding")
    return tensor


def _place(tensor: torch.Tensor, given: Placement, what: str) -> None:
    """Record `given` for `tensor`. Dynamo's guards do not see placements: a tensor placed
    otherwise after a compile read its placement would keep running the old plan's
    executables, so the compiled code is dropped (torch._dynamo.reset(); executables of
    unchanged graphs come back from the compile cache) and the next call compiles anew."""
    before = _placements.get(tensor)
    _placements[tensor] = given
    if before is not None and before != given and _read_since_placed[0]:
        log.warning(
            "tpu_inductor: %s is placed anew (%s %s, was %s %s) after a compile read its "
            "placement: compiled code is reset so the next call compiles for the new one.",
            what,
            given.mesh,
            given.spec,
            before.mesh,
            before.spec,
        )
        torch._dynamo.reset()
        _read_since_placed[0] = False


def common_mesh(placements: Sequence[Placement | None]) -> Mesh | None:
    """The one mesh of `placements` (None: none placed); an OptionError for two meshes."""
    meshes = {p.mesh for p in placements if p is not None}
    if len(meshes) > 1:
        raise OptionError(
            f"tpu_inductor: one compiled graph reads tensors placed on different meshes "
            f"({', '.join(sorted(map(str, meshes)))}); place them all on one mesh."
        )
    return next(iter(meshes), None)


def module_split(layout, device_axes, inputs: Sequence[Any], open_inputs=()) -> tuple:
    """(mesh axes, a spec per tensor input) of a graph compiled over a mesh: the specs of
    `layout` (annotate_sharding's GraphSharding; None: a region of a split graph, all whole),
    checked against the inputs' sizes, None (open: the partitioner chooses) for `open_inputs`
    without one (saved activations, which come as the forward left them), else whole."""
    mesh = layout.mesh if layout is not None else Mesh(device_axes)
    specs = layout.inputs if layout is not None else {}
    positions = [i for i, v in enumerate(inputs) if isinstance(v, torch.Tensor)]
    for i in positions:
        if i in specs:
            check_spec(mesh, tuple(inputs[i].shape), specs[i], f"graph input {i}")
    split = tuple(specs.get(i, None if i in open_inputs else ()) for i in positions)
    return mesh.axes, split


def split_outputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Graph outputs a sharding constraint splits (a gradient placed as its parameter, by
    annotate_sharding): the module returns them split (a reduce-scatter of the partial sums,
    not an all-reduce and a gather) and the host assembles their shards. Across processes a
    host holds only its own shards, so there they come back whole (none)."""
    from . import distributed
    from .sharding_op import is_constraint

    if distributed.active():
        return frozenset()
    outputs = gm.graph.output_node().args[0]
    flat = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
    return frozenset(
        i for i, v in enumerate(flat) if isinstance(v, torch.fx.Node) and is_constraint(v)
    )
