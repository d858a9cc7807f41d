"""Models built on the devices: a model made on the meta device is materialized on its mesh, shard
by shard, by its own initialization, so the whole model never sits in one host's memory (as
FSDP2 and TorchTitan build theirs).

    with torch.device("meta"):
        model = Transformer(config)
    tpu_inductor.materialize(model, mesh, tpu_inductor.sharding_plans.fsdp("data"))

The placements are recorded first (sharding/shard.py: its checks need only shapes). Then module
by module, in `named_modules()` order, the module's own meta parameters and buffers get host
memory, its initialization runs (`reset_parameters()`; in a Hugging Face model, that and then
the model's `_init_weights(module)`, as an eager build runs the constructor's and then
`post_init`'s), and its parameters and the buffers the plan placed move to the mesh as
device_state.shard moves them, leaving no host copy. Buffers the plan leaves out stay on the
host (eager code reads them: rotary tables, counters). The host holds one module's tensors at a
time. Tensors already on the host are moved as they are.

Torch cannot give a meta tensor host memory in place, so each gets a new tensor that takes its
attributes and placement; a tensor shared by modules (tied weights) stays one tensor. Floating
tensors start as NaN: one that no initialization wrote is named, never left as garbage.

Random values: a model whose modules draw in `reset_parameters()` in construction order (torch's
layers) gets the values an eager build from the same seed gets. A Hugging Face model gets the
same distributions, not the same values: eagerly every layer's constructor draws first, then
`post_init` draws again for the whole model, an order one module at a time does not replay.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator

import torch

from tpu_inductor.exc import OptionError
from tpu_inductor.runtime import transfer
from tpu_inductor.sharding import shard as placements
from tpu_inductor.sharding.mesh import Mesh
from tpu_inductor.state import device_state


def materialize(model: torch.nn.Module, mesh: Mesh, plan) -> torch.nn.Module:
    """Build `model`, made under `torch.device("meta")`, on `mesh` placed by `plan` (as
    `tpu_inductor.shard` places it), running each module's initialization on the host one
    module at a time. Returns `model`; its parameters hold no host memory afterwards."""
    if not any(tensor.is_meta for _, tensor in _own_tensors(model, recurse=True)):
        raise OptionError(
            f"tpu_inductor.materialize: {type(model).__name__} has no tensor on the meta device: "
            "it is built already. Place it with tpu_inductor.shard(model, mesh, plan), or build "
            'it under `with torch.device("meta"):` to materialize it on the mesh.'
        )
    placements.shard(model, mesh, plan)
    device = device_state.mesh_device(mesh)
    moves = transfer.Transfer(device)
    owners = _hf_owners(model)
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta, its tensor)
    for name, module in model.named_modules():
        fresh, tied = _allocate(module, made)
        if fresh or tied:
            _initialize(name, module, owners.get(name), fresh)
        for table, key, shared in tied:
            table[key] = shared
        for key, tensor in _own_tensors(module):
            if not tensor.is_meta and device_state.device_array(tensor) is None:
                device_state.place(tensor, key in module._parameters, mesh, device, moves)
    return model


def _own_tensors(
    module: torch.nn.Module, recurse: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """`module`'s parameters and buffers (its own only unless `recurse`), by name."""
    yield from module.named_parameters(recurse=recurse, remove_duplicate=False)
    yield from module.named_buffers(recurse=recurse, remove_duplicate=False)


def _allocate(module: torch.nn.Module, made: dict) -> tuple[list, list]:
    """Give `module`'s own meta tensors host memory: new tensors in their place (NaN where
    floating) with the meta tensors' attributes and placements, returned as (name, tensor).
    A tensor made before for another module (tied) gets a scratch copy for the initialization,
    which draws for it as an eager constructor does before the tie; returned as (table, name,
    the tensor) to put back after."""
    fresh, tied = [], []
    for table in (module._parameters, module._buffers):
        for key, tensor in table.items():
            if tensor is None or not tensor.is_meta:
                continue
            new = torch.empty_like(tensor, device="cpu")
            if new.is_floating_point() or new.is_complex():
                new.fill_(math.nan)
            if isinstance(tensor, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
            table[key] = new
            if id(tensor) in made:
                tied.append((table, key, made[id(tensor)][1]))
                continue
            new.__dict__.update(tensor.__dict__)
            given = placements.placement(tensor)
            if given is not None:
                placements.mark_sharding(new, given.mesh, given.spec)
            made[id(tensor)] = (tensor, new)  # (the meta tensor kept alive: its id stays unique)
            fresh.append((key, new))
    return fresh, tied


def _initialize(name: str, module: torch.nn.Module, owner, fresh: list) -> None:
    """Run `module`'s initialization over its new tensors: `reset_parameters()` and, under a
    Hugging Face model (`owner`), its `_init_weights(module)` after, as an eager build runs
    them; then check every floating tensor was written."""
    what = f"module {name!r} ({type(module).__name__})" if name else type(module).__name__
    reset = getattr(module, "reset_parameters", None)
    if reset is None and owner is None:
        raise OptionError(
            f"tpu_inductor.materialize: {what} has meta tensors "
            f"({', '.join(key for key, _ in fresh)}) and no initialization to compute them: "
            "define its reset_parameters() (fill every parameter and every buffer computed in "
            "__init__, in place), or build that module on the host."
        )
    with torch.no_grad():
        if reset is not None:
            reset()
        if owner is not None:
            owner._init_weights(module)
    unwritten = [
        key
        for key, tensor in fresh
        if (tensor.is_floating_point() or tensor.is_complex()) and tensor.sum().isnan()
    ]
    if unwritten:
        raise OptionError(
            f"tpu_inductor.materialize: the initialization of {what} left "
            f"{', '.join(unwritten)} unwritten (NaN). Fill them in its reset_parameters()"
            + (f" or in {type(owner).__name__}._init_weights." if owner is not None else ".")
        )


def _hf_owners(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Per module name, the Hugging Face model whose `_init_weights` initializes it (the
    nearest `PreTrainedModel` around it, as transformers' `initialize_weights` dispatches);
    empty for a model with none."""
    if "transformers" not in sys.modules:  # (no Hugging Face model without it imported)
        return {}
    from transformers import PreTrainedModel

    owners: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        outer = owners.get(name.rpartition(".")[0]) if name else None
        owner = module if isinstance(module, PreTrainedModel) else outer
        if owner is not None:
            owners[name] = owner
    return owners
