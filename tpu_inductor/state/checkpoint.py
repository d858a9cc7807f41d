"""Sharded checkpoints of device-only state: `save_checkpoint` and `load_checkpoint`.

    handle = tpu_inductor.save_checkpoint("/ckpt/step_1000", model, optimizer)  # returns at once
    ...next steps...
    handle.wait()
    tpu_inductor.load_checkpoint("/ckpt/step_1000", model, optimizer)  # onto the model's placement

A model placed on a mesh (`tpu_inductor.shard`) keeps its parameters, AdamW moments and
gradients on the devices only (state/device_state.py): gathering them to one host to call
`torch.save` would need the whole model in one host's memory. Here nothing is gathered: a
device-only tensor is saved from its sharded jax array, each process writing the shards its
devices hold; a host tensor (an unplaced buffer, AdamW's one-element `step`) as it is, copied
at the call. A load restores each placed tensor straight into the sharding the model has now
(another mesh, another plan, another process count than the save's) and makes that array its
only copy (`device_state.put`); an unplaced tensor is read to the host and copied in.

Why orbax-checkpoint and not torch.distributed.checkpoint: our device state is jax arrays with
shardings, which orbax writes as they are (each process its addressable shards, through
tensorstore) and restores into any target sharding, asynchronously: the device-to-host copy is
done when `save` returns, the writes go on in a thread. DCP would need the state as DTensors
and a torch process group, neither of which this runtime has (its processes meet in jax's
coordination service, sharding/distributed.py).

Layout: an orbax composite checkpoint of three items: `model` (state_dict names → arrays),
`optimizer` (parameter name → its state by key: exp_avg, exp_avg_sq, step, ...) and `meta`
(JSON: the format and the optimizer's param_groups hyperparameters, parameters by name).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tpu_inductor.exc import TpuInductorError
from tpu_inductor.runtime import devices, transfer
from tpu_inductor.runtime.host_sync import host_sync
from tpu_inductor.sharding import shard as placements
from tpu_inductor.state import device_state

FORMAT = 1


class CheckpointError(TpuInductorError, ValueError):
    """A checkpoint that cannot be saved to or loaded into what was given: not a checkpoint, a
    tensor name one side lacks, a shape or dtype that differs."""


class SaveHandle:
    """A save under way: `wait()` returns once every process's files are written and the
    checkpoint is committed (it raises the save's error, if any)."""

    def __init__(self, checkpointer, path: str):
        self._checkpointer, self.path = checkpointer, path

    def wait(self) -> None:
        """Block until the save is committed."""
        if self._checkpointer is not None:
            checkpointer, self._checkpointer = self._checkpointer, None
            checkpointer.wait_until_finished()
            checkpointer.close()


def save_checkpoint(path, model=None, optimizer=None, *, asynchronous: bool = True) -> SaveHandle:
    """Save `model`'s state_dict tensors and `optimizer`'s state (named by the model's parameter
    names; by "group.position" without a model) to the new directory `path`, without gathering:
    device-only tensors from their shards, each process writing its own. Every process of a job
    calls it. `asynchronous`: returns once the values are copied off the devices, the files are
    written in the background; call `.wait()` on the handle before the process ends (and before
    reading the checkpoint). Eager code may change the state right after the call."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        raise CheckpointError(
            f"tpu_inductor.save_checkpoint: {path} exists already; save to a new directory "
            "(e.g. one per step) or remove it first."
        )
    model_part, optimizer_part, names = _parts(model, optimizer)
    items = {
        "meta": ocp.args.JsonSave({"format": FORMAT, "param_groups": _groups(optimizer, names)})
    }
    if model is not None:
        items["model"] = ocp.args.PyTreeSave({k: _saved(t) for k, t in model_part.items()})
    if optimizer is not None:
        saved = {k: {key: _saved(t) for key, t in s.items()} for k, s in optimizer_part.items()}
        items["optimizer"] = ocp.args.PyTreeSave(saved)
    checkpointer = ocp.AsyncCheckpointer(_handler())
    checkpointer.save(path, args=ocp.args.Composite(**items))
    handle = SaveHandle(checkpointer, path)
    if not asynchronous:
        handle.wait()
    return handle


def load_checkpoint(path, model=None, optimizer=None) -> None:
    """Restore `model` and `optimizer` in place from the checkpoint at `path`, onto where their
    tensors live now: a placed tensor is read straight into its sharding (each process its own
    shards) and the device array becomes its only copy; an unplaced one is copied into its host
    memory. Optimizer state the checkpoint has and the optimizer lacks yet (a fresh AdamW) is
    created first. Every process of a job calls it. Raises CheckpointError where the checkpoint
    and the model differ (a name, a shape, a dtype)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    checkpointer = ocp.Checkpointer(_handler())
    saved, meta = _read_metadata(checkpointer, path)
    model_part, optimizer_part, names = _parts(model, optimizer)
    if optimizer is not None:
        _create_state(optimizer, names, saved.get("optimizer"), path)
        _, optimizer_part, _ = _parts(None, optimizer, names)
    targets = {"model": model_part if model is not None else None}
    targets["optimizer"] = optimizer_part if optimizer is not None else None
    items, places = {}, {}
    for part, tensors in targets.items():
        if tensors is None:
            continue
        if part not in saved:
            raise CheckpointError(
                f"tpu_inductor.load_checkpoint: {path} holds no {part} state (it was saved "
                f"without one); load it with {part}=None."
            )
        flat = _flat(tensors)
        _check(part, flat, _flat(saved[part]), path)
        places[part] = {name: _target(tensor) for name, tensor in flat.items()}
        restore = _nest({name: _restore_args(t, places[part][name]) for name, t in flat.items()})
        items[part] = ocp.args.PyTreeRestore(
            item=_nest(dict.fromkeys(flat, 0)), restore_args=restore
        )
    if not items:
        return
    restored = checkpointer.restore(path, args=ocp.args.Composite(**items))
    for part in items:
        values = _flat(restored[part])
        for name, tensor in _flat(targets[part]).items():
            _assign(tensor, values[name], places[part][name])
    if optimizer is not None:
        _set_groups(optimizer, meta["param_groups"], path)


def _handler():
    """The handler of our three items (named, so a new process reads their metadata)."""
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointHandler
    return ocp.CompositeCheckpointHandler(
        model=tree(), optimizer=tree(), meta=ocp.JsonCheckpointHandler()
    )


def _parts(model, optimizer, names: dict | None = None):
    """({state_dict name: tensor}, {parameter name: {state key: tensor}}, {id(parameter): name})."""
    model_part = dict(model.state_dict(keep_vars=True)) if model is not None else {}
    if names is None:
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    optimizer_part = {}
    for g, group in enumerate(optimizer.param_groups if optimizer is not None else ()):
        for i, parameter in enumerate(group["params"]):
            name = names.setdefault(id(parameter), f"{g}.{i}")
            state = optimizer.state.get(parameter, {})
            optimizer_part[name] = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return model_part, {k: v for k, v in optimizer_part.items() if v}, names


def _saved(tensor: torch.Tensor):
    """What is written for `tensor`: its device array, or a numpy copy of its host values (a
    copy: a step right after an asynchronous save may write them)."""
    array = device_state.device_array(tensor)
    if array is not None and tuple(array.shape) == tuple(tensor.shape):
        return array
    import numpy as np

    host = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return np.array(host.view(torch.int16).numpy()).view(_numpy_dtype(torch.bfloat16))
    return np.array(host.numpy())


def _numpy_dtype(dtype: torch.dtype):
    import numpy as np

    if dtype == torch.bfloat16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty((), dtype=dtype).numpy().dtype


def _read_metadata(checkpointer, path: str) -> tuple[dict, dict]:
    """({item: its tree of ArrayMetadata}, meta) of the checkpoint at `path`."""
    import orbax.checkpoint as ocp

    meta = None
    if os.path.isdir(os.path.join(path, "meta")):
        try:
            found = checkpointer.metadata(path).item_metadata
            meta = checkpointer.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = meta["meta"]
        except (OSError, ValueError, KeyError) as error:
            raise CheckpointError(
                f"tpu_inductor.load_checkpoint: {path} is not a readable checkpoint: {error}"
            ) from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        what = "nothing" if not os.path.exists(path) else "no tpu_inductor checkpoint"
        raise CheckpointError(
            f"tpu_inductor.load_checkpoint: {path} holds {what} (format {FORMAT} expected, "
            f"found {meta and meta.get('format')!r}). Give the directory save_checkpoint wrote; "
            "an asynchronous save is there only once its handle's wait() returned."
        )
    return {k: v.tree for k, v in found.items() if k != "meta" and v is not None}, meta


def _create_state(optimizer, names: dict, saved: dict | None, path: str) -> None:
    """Give each parameter the state the checkpoint has for it and the optimizer lacks yet (a
    fresh AdamW before its first step): zeros of the saved shape and dtype, restored next."""
    by_name = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
    for name, state in (saved or {}).items():
        parameter = by_name.get(name)
        if parameter is None or optimizer.state.get(parameter):
            continue  # (a missing parameter is named by _check)
        optimizer.state[parameter] = {
            key: torch.zeros(tuple(m.shape), dtype=_torch_dtype(m.dtype, f"{name}.{key}", path))
            for key, m in state.items()
        }


_TORCH_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.bool)
_TORCH_DTYPES += (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _torch_dtype(dtype, name: str, path: str) -> torch.dtype:
    for candidate in _TORCH_DTYPES:
        if _numpy_dtype(candidate) == dtype:
            return candidate
    raise CheckpointError(
        f"tpu_inductor.load_checkpoint: {name} in {path} has dtype {dtype}, which no torch "
        "dtype here matches."
    )


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": x}} → {"a/b": x}: optimizer state by "parameter/key", model tensors by name."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _nest(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        *outer, leaf = name.split("/")
        node = tree
        for key in outer:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def _check(part: str, tensors: dict, saved: dict, path: str) -> None:
    """Every tensor named on both sides, with the saved shape and dtype."""
    where = f"tpu_inductor.load_checkpoint ({part} of {path})"
    missing, extra = sorted(set(tensors) - set(saved)), sorted(set(saved) - set(tensors))
    if missing or extra:
        raise CheckpointError(
            f"{where}: the {part} has tensors the checkpoint lacks: {missing[:8]} and the "
            f"checkpoint has tensors the {part} lacks: {extra[:8]} ({len(missing)} and "
            f"{len(extra)}). Load into the model (and optimizer) that was saved: same "
            "architecture and config, same parameter names."
        )
    for name, tensor in tensors.items():
        shape, dtype = tuple(saved[name].shape), saved[name].dtype
        if shape != tuple(tensor.shape) or _numpy_dtype(tensor.dtype) != dtype:
            raise CheckpointError(
                f"{where}: {name} is {tuple(tensor.shape)} {tensor.dtype} here and "
                f"{shape} {dtype} in the checkpoint. Build the model with the config it was "
                "saved from (and convert dtypes after loading, not before)."
            )


def _target(tensor: torch.Tensor):
    """(sharding, mesh Device) a tensor is restored into: where it lives now on a mesh, or
    None for a host tensor (a stale one's values brought home first: they are replaced)."""
    given = placements.placements([tensor])[0]
    array = device_state.device_array(tensor)
    if given is None:
        if array is not None:
            host_sync.sync([tensor])
        return None
    device = devices.mesh_device(devices.select_device().platform, given.mesh.axes)
    if array is not None and tuple(array.shape) == tuple(tensor.shape):
        return array.sharding, device
    return device_state.sharding(device, given.spec), device


def _restore_args(tensor: torch.Tensor, place):
    import numpy as np
    import orbax.checkpoint as ocp

    if place is None:
        return ocp.RestoreArgs(restore_type=np.ndarray)
    dtype = _numpy_dtype(tensor.dtype)
    return ocp.ArrayRestoreArgs(sharding=place[0], global_shape=tuple(tensor.shape), dtype=dtype)


def _assign(tensor: torch.Tensor, value, place) -> None:
    """`value` (restored into `place`'s sharding, or a numpy array) becomes `tensor`'s values."""
    import numpy as np

    if place is not None:
        moves = transfer.Transfer(place[1])
        if device_state.put(tensor, value, place[1], moves):
            return
        host = moves.to_torch(value)  # a counter or a view: its host copy is its copy
    elif value.dtype == _numpy_dtype(torch.bfloat16):
        host = torch.from_numpy(np.array(value).view(np.int16)).view(torch.bfloat16)
    else:
        host = torch.from_numpy(np.array(value))
    with torch.no_grad():
        tensor.copy_(host)


def _groups(optimizer, names: dict) -> list[dict]:
    """The optimizer's param_groups as JSON: hyperparameters of plain values, parameters by name."""
    groups = []
    for group in optimizer.param_groups if optimizer is not None else ():
        kept = {k: v for k, v in group.items() if k != "params" and _plain(v)}
        groups.append({**kept, "params": [names[id(p)] for p in group["params"]]})
    return groups


def _plain(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _set_groups(optimizer, saved: list[dict], path: str) -> None:
    """The saved hyperparameters (lr as a schedule left it, betas, ...) into the optimizer's groups."""
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"tpu_inductor.load_checkpoint: the optimizer has {len(optimizer.param_groups)} "
            f"param groups and {path} has {len(saved)}; build the optimizer as it was saved."
        )
    for group, values in zip(optimizer.param_groups, saved):
        for key, value in values.items():
            if key != "params" and key in group and _plain(group[key]):
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
