"""State that lives on the devices only: a model placed on a mesh keeps no host copy.

`tpu_inductor.shard(model, mesh, plan)` records each tensor's placement (sharding/shard.py) and
then moves the model's parameters (and the buffers the plan placed) to the mesh, split as
placed (a parameter the plan leaves out: whole on every device, placed so). Each host tensor is then
left stale with its memory given back to the system (runtime/host_sync.py): the device arrays are its
only copy, every compiled graph over the mesh takes them as they are (residency.mirrors), and
the graphs that write it or return its gradient leave the new values there too (compile_fx's
`_wrap`). Eager code that reads such a tensor gets the error that names `tpu_inductor.sync`,
which brings the values home (gathered from the shards).

So a process holds its shards, not the model: on a TPU pod the model is bounded by the pod's
memory, not one host's.
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_inductor.runtime import devices, residency, transfer
from tpu_inductor.runtime.host_sync import PLACED, host_sync
from tpu_inductor.sharding import shard as placements
from tpu_inductor.sharding.mesh import Mesh

# Whether a model was placed on a mesh in this process: graphs over a mesh then leave the state
# they write and the gradients they return on the devices (compile_fx).
_placed = [False]


def placed() -> bool:
    """Whether state lives on a mesh in this process (`shard` placed a model)."""
    return _placed[0]


def shard(model: torch.nn.Module, mesh: Mesh, plan) -> torch.nn.Module:
    """Place `model`'s parameters and buffers on `mesh` by `plan` (sharding.shard.shard: its
    checks and errors), then move them there: the parameters and placed buffers hold no host
    memory afterwards. Returns `model`."""
    placements.shard(model, mesh, plan)
    device = mesh_device(mesh)
    moves = transfer.Transfer(device)
    for tensor in model.parameters():
        place(tensor, True, mesh, device, moves)
    for tensor in model.buffers():
        place(tensor, False, mesh, device, moves)
    return model


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """sharding.shard.shard_optimizer_state (the state split like its parameters), and the
    state the optimizer makes for a parameter that lives on the devices made there: AdamW's
    `zeros_like(p)` moments are zeros of `p`'s placement on its devices, no host memory touched
    (a model larger than the host has moments larger than it too). Returns `optimizer`."""
    placements.shard_optimizer_state(optimizer)
    init = getattr(optimizer, "_init_group", None)  # (torch's optimizers make state there;
    if init is None or getattr(init, "on_devices", False):  # Dynamo calls it as it is)
        return optimizer

    def init_on_devices(*args, **kwargs):
        with _ZerosOnDevices():
            return init(*args, **kwargs)

    init_on_devices.on_devices = True
    optimizer._init_group = init_on_devices
    return optimizer


class _ZerosOnDevices(torch.overrides.TorchFunctionMode):
    """`torch.zeros_like(p)` of a tensor that lives on the devices: a host tensor whose only
    copy is zeros made on them, split as `p` is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = None
        if func is torch.zeros_like and set(kwargs) <= {"memory_format"}:
            entry = host_sync.pending.get(args[0].untyped_storage()._cdata)
        if entry is None or len(args) != 1:
            return func(*args, **kwargs)
        import jax
        import jax.numpy as jnp

        array = entry.array
        zeros = jax.jit(lambda: jnp.zeros(array.shape, array.dtype), out_shardings=array.sharding)()
        tensor = torch.empty(entry.shape, dtype=entry.dtype)  # (its pages never touched)
        if host_sync.defer(tensor, zeros, entry.device_key, entry.to_torch, PLACED):
            residency.mirrors.put(tensor, entry.device_key, zeros)
            return tensor
        return func(*args, **kwargs)


def mesh_device(mesh: Mesh) -> devices.Device:
    """The devices of `mesh` on the best platform here (the one compiled graphs run on)."""
    return devices.mesh_device(devices.select_device().platform, mesh.axes)


def place(tensor: torch.Tensor, parameter: bool, mesh: Mesh, device, moves) -> None:
    """Move `tensor` onto `mesh` (`device`, its runtime Device; `moves`, its Transfer) as
    placed; an unplaced parameter whole on every device (and placed so: every graph that reads
    it then runs on the mesh); an unplaced buffer stays on the host (rotary tables, counters:
    eager code reads those)."""
    given = placements.placement(tensor)
    if given is None and not parameter:
        return
    if given is None:
        placements.mark_sharding(tensor, mesh, ())
    spec = given.spec if given is not None else ()
    put(tensor, moves.to_device(tensor.detach(), sharding(device, spec)), device, moves)
    _placed[0] = True


def put(tensor: torch.Tensor, array, device: devices.Device, moves: transfer.Transfer) -> bool:
    """`array` holds `tensor`'s values on `device` from now on: the host tensor keeps no
    memory (False, and nothing done, for one that is not its whole storage or is a counter:
    host_sync.defer)."""
    if not host_sync.defer(tensor, array, device.key, moves.to_torch, PLACED):
        return False
    residency.mirrors.put(tensor, device.key, array)
    return True


def sharding(device: devices.Device, spec) -> Any:
    """The jax sharding that splits a tensor by `spec` over `device`'s mesh."""
    from tpu_inductor.lowering.stablehlo import Shardings

    return Shardings(device.axes, (tuple(spec),)).named(device.mesh)[0]


def device_array(tensor: torch.Tensor) -> Any | None:
    """The device array holding `tensor`'s current values where its host copy is stale, else
    None (its host memory is current)."""
    entry = host_sync.pending.get(tensor.untyped_storage()._cdata)
    return None if entry is None else entry.array
