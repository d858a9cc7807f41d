"""Where tensors live on a mesh: the user-facing half of sharding. XLA's SPMD partitioner
(Shardy) splits the computation and inserts the collectives: nothing here schedules
communication. Under torch.compile:

    mesh = tpu_inductor.Mesh({"data": 2, "model": 4})
    tpu_inductor.shard(model, mesh, tpu_inductor.sharding_plans.tensor_parallel("model"))
    tpu_inductor.mark_sharding(batch, mesh, ("data", None))    # an input, before the call
    y = tpu_inductor.mark_sharding(y, mesh, ("data", None, "model"))  # inside compiled code

`shard` and `mark_sharding` outside compiled code record each tensor's placement (`placement`);
the backend gives the graph inputs theirs (passes/annotate_sharding.py). Inside compiled code
`mark_sharding` is the `tpu_inductor::shard_as` op (ops/shard_as.py), a sharding constraint.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tpu_inductor.exc import OptionError
from tpu_inductor.sharding.mesh import Mesh, Placement, check_spec

log = logging.getLogger(__name__)


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
    are created and after; returns `optimizer`. Call it after `shard`, before the first
    compiled step."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptionError(
            f"tpu_inductor.shard_optimizer_state: {type(optimizer).__name__} is not a "
            "torch.optim.Optimizer."
        )
    _optimizers.add(optimizer)
    from tpu_inductor.sharding import named

    named.note_optimizer(optimizer)  # what its state holds, for the tuner's estimates
    return optimizer


def shard(model: torch.nn.Module, mesh: Mesh, plan) -> torch.nn.Module:
    """Place `model`'s parameters and buffers on `mesh` by `plan`, and return `model`.

    `plan`: name globs → partition specs (`{"layers.*.mlp.up_proj.weight": ("model", None)}`),
    module-name globs → TorchTitan-style styles (`{"layers.*.attn.q_proj": ColwiseParallel()}`),
    a ready-made plan (tpu_inductor.sharding.plans), or "auto": the one the config names
    (options' sharding.plan, e.g. from `tpu-inductor tune`'s tuned.json; else weights whole:
    sharding/named.py). Every entry must match something;
    unmatched tensors stay whole on every device. Specs are checked against each tensor's
    shape here, and the compile's cache key holds them."""
    from tpu_inductor.sharding import plans as sharding_plans

    if not isinstance(mesh, Mesh):
        raise OptionError(
            f"tpu_inductor.shard: mesh is {mesh!r}; pass a tpu_inductor.Mesh, e.g. "
            'Mesh({"data": 2, "model": 4}).'
        )
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    if isinstance(plan, str) and plan == "auto":  # the config's plan (sharding/named.py)
        from tpu_inductor.sharding import named

        plan = named.auto(model, mesh)
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
        from tpu_inductor.ops.shard_as import shard_as

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


def split_outputs(gm: torch.fx.GraphModule, on_devices: bool = False) -> frozenset[int]:
    """Graph outputs a sharding constraint splits (a gradient placed as its parameter, by
    annotate_sharding): the module returns them split (a reduce-scatter of the partial sums,
    not an all-reduce and a gather) and the host assembles their shards. Across processes a
    host holds only its own shards, so there they come back whole (none), unless they stay on
    the devices (`on_devices`: a model placed there, whose gradients never come home)."""
    from tpu_inductor.ops.shard_as import is_constraint
    from tpu_inductor.sharding import distributed

    if distributed.active() and not on_devices:
        return frozenset()
    outputs = gm.graph.output_node().args[0]
    flat = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
    return frozenset(
        i for i, v in enumerate(flat) if isinstance(v, torch.fx.Node) and is_constraint(v)
    )
