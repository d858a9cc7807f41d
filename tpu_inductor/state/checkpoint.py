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
at the call. By default orbax copies the shards to host memory before it returns and writes
from those copies: the save holds one host copy of this process's state until written, and
the next step runs at once. With `host_bytes`, the shards are copied and written a batch at a
time after the call returns: the host holds at most that many bytes of copies, and a step
that would donate (write in place) an array not yet copied waits for the save first
(runtime/pending_reads.py). A load restores each placed tensor straight into the sharding the
model has now (another mesh, another plan, another process count than the save's) and makes
that array its only copy (`device_state.put`); an unplaced tensor is read to the host and
copied in.

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

import ctypes
import functools
import os

import torch

from tpu_inductor.exc import CheckpointError
from tpu_inductor.runtime import devices, pending_reads, transfer
from tpu_inductor.runtime.host_sync import host_sync
from tpu_inductor.sharding import shard as placements
from tpu_inductor.state import device_state

FORMAT = 1


class SaveHandle:
    """A save under way: `wait()` returns once every process's files are written and the
    checkpoint is committed (it raises the save's error, if any)."""

    def __init__(self, checkpointer, path: str, held: list):
        self._checkpointer, self.path, self._held = checkpointer, path, held

    def wait(self) -> None:
        """Block until the save is committed."""
        if self._checkpointer is not None:
            checkpointer, self._checkpointer = self._checkpointer, None
            try:
                checkpointer.wait_until_finished()
                checkpointer.close()
            finally:
                pending_reads.release(self._held)


def save_checkpoint(
    path, model=None, optimizer=None, *, asynchronous: bool = True, host_bytes: int | None = None
) -> SaveHandle:
    """Save `model`'s state_dict and `optimizer`'s state (by the model's parameter names, else
    "group.position") to the new directory `path` without gathering: each process writes the
    shards it holds (every process calls it). `asynchronous`: the files are written in a
    thread; `.wait()` on the handle before the process ends or the checkpoint is read.

    `host_bytes` bounds the host memory a save takes. None: every shard this process holds is
    copied to the host before the call returns (one host copy of its state until written), so
    the next step runs at once. A number (bytes, per process): the shards are copied and
    written a batch of at most that many bytes at a time, after the call returns; a step that
    writes in place an array not yet copied waits for the save first."""
    import numpy as np
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        where = "save to a new directory (e.g. one per step) or remove it first"
        raise CheckpointError(f"tpu_inductor.save_checkpoint: {path} exists already; {where}.")
    if host_bytes is not None and (not isinstance(host_bytes, int) or host_bytes <= 0):
        raise CheckpointError(
            f"tpu_inductor.save_checkpoint: host_bytes={host_bytes!r}; give a positive number "
            "of bytes (e.g. a tenth of the state: shards are copied to the host that many "
            "bytes at a time) or None (one host copy of the state, the fastest)."
        )
    parts, names = _parts(model, optimizer)
    meta = {"format": FORMAT, "param_groups": _groups(optimizer, names)}
    items, held = {"meta": ocp.args.JsonSave(meta)}, []
    for part, tensors in parts.items():
        if tensors:  # (orbax writes no empty tree: a fresh optimizer has no state yet)
            values = {k: _saved(t) for k, t in tensors.items()}
            held += [v for v in values.values() if not isinstance(v, np.ndarray)]
            items[part] = ocp.args.PyTreeSave(ocp.tree.from_flat_dict(values, sep="/"))
    checkpointer = ocp.AsyncCheckpointer(_handler(host_bytes))
    handle = SaveHandle(checkpointer, path, held if host_bytes is not None else [])
    if host_bytes is not None:  # (before the save starts: its batches run in a thread)
        pending_reads.hold(held, handle.wait)
    try:
        checkpointer.save(path, args=ocp.args.Composite(**items))
    except BaseException:
        pending_reads.release(held)
        raise
    if not asynchronous:
        handle.wait()
    return handle


def load_checkpoint(path, model=None, optimizer=None) -> None:
    """Restore `model` and `optimizer` in place from `path`, onto where their tensors live now: a
    placed tensor read straight into its sharding (each process its shards; every process calls
    it) becomes that array alone, an unplaced one is copied in. State a fresh optimizer lacks
    is created first. CheckpointError where the two differ (a name, a shape, a dtype)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    checkpointer = ocp.Checkpointer(_handler())
    saved, meta = _read_metadata(checkpointer, path)
    if optimizer is not None and not meta["param_groups"]:
        raise CheckpointError(
            f"tpu_inductor.load_checkpoint: {path} holds no optimizer (it was saved without "
            "one); load it with optimizer=None."
        )
    if optimizer is not None:
        _create_state(optimizer, _parts(model, optimizer)[1], saved.get("optimizer", {}))
    parts, _ = _parts(model, optimizer)
    items, targets = {}, {}
    for part, tensors in parts.items():
        _check(part, tensors, saved.get(part, {}), path)
        if tensors:
            targets[part] = {name: _target(tensor) for name, tensor in tensors.items()}
            args = {name: restore for name, (restore, _) in targets[part].items()}
            items[part] = ocp.args.PyTreeRestore(
                item=ocp.tree.from_flat_dict(dict.fromkeys(tensors, 0), sep="/"),
                restore_args=ocp.tree.from_flat_dict(args, sep="/"),
            )
    restored = checkpointer.restore(path, args=ocp.args.Composite(**items)) if items else {}
    for part in items:
        values = ocp.tree.to_flat_dict(restored[part], sep="/")
        for name, tensor in parts[part].items():
            _assign(tensor, values[name], targets[part][name][1])
    if optimizer is not None:
        _set_groups(optimizer, meta["param_groups"], path)


def _handler(host_bytes: int | None = None):
    """The handler of our three items (named, so a new process reads their metadata); with
    `host_bytes`, one that copies device arrays to the host in batches of that many bytes."""
    import orbax.checkpoint as ocp

    budget = {}
    if host_bytes is not None:
        budget = {
            "save_device_host_concurrent_gb": host_bytes / 1e9,
            "type_handler_registry": _batched_registry(),
        }
    trees = {part: ocp.PyTreeCheckpointHandler(**budget) for part in ("model", "optimizer")}
    return ocp.CompositeCheckpointHandler(**trees, meta=ocp.JsonCheckpointHandler())


def _batched_registry():
    """Orbax's handlers of our saved types, device arrays transferred after `save` returns,
    in batches under the device-to-host budget (orbax: "deprioritized" keys)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    try:  # (the priority enum is not exported by orbax; its callback protocol is documented)
        from orbax.checkpoint._src.serialization.types import TransferPriority
    except ImportError as error:
        raise CheckpointError(
            "tpu_inductor.save_checkpoint(host_bytes=...) needs orbax-checkpoint's "
            f"device-to-host budget (0.12.8 has it): {error}. Upgrade orbax-checkpoint or "
            "save with host_bytes=None."
        ) from error

    class _Later:
        def key_priority(self, keypath):
            return TransferPriority.ASYNCHRONOUS_DEPRIORITIZED

        def on_transfer_start(self, keypath):
            pass

        def on_transfer_end(self, keypath):
            pass

        def on_write_end(self, keypath):
            _trim_heap()  # (the batch's host copies, freed, go back to the system)

    array = ocp.type_handlers.ArrayHandler(callback=_Later())
    numpy = ocp.type_handlers.NumpyHandler()
    return ocp.type_handlers.create_type_handler_registry((jax.Array, array), (np.ndarray, numpy))


def _trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc keeps freed blocks in its
    per-thread arenas: the host copies of a save's batches would add up in the process's
    resident memory though each was freed); nothing where the C library is not glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    libc = ctypes.CDLL(None)
    return getattr(libc, "malloc_trim", None)


def _parts(model, optimizer) -> tuple[dict[str, dict[str, torch.Tensor]], dict[int, str]]:
    """({"model": {state_dict name: tensor}, "optimizer": {"parameter/key": tensor}}, each
    parameter's name by id); a part is absent where its object is None. Orbax's trees nest
    at "/" (names hold dots)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    if model is not None:
        parts["model"] = dict(model.state_dict(keep_vars=True))
    if optimizer is not None:
        parts["optimizer"] = {}
        for g, group in enumerate(optimizer.param_groups):
            for i, parameter in enumerate(group["params"]):
                name = names.setdefault(id(parameter), f"{g}.{i}")
                state = optimizer.state.get(parameter, {}).items()
                tensors = {f"{name}/{k}": v for k, v in state if isinstance(v, torch.Tensor)}
                parts["optimizer"].update(tensors)
    return parts, names


def _saved(tensor: torch.Tensor):
    """What is written for `tensor`: its device array, or a numpy copy of its host values (a
    copy: a step right after an asynchronous save may write them)."""
    import numpy as np

    array = device_state.device_array(tensor)
    if array is not None and tuple(array.shape) == tuple(tensor.shape):
        return array
    host = tensor.detach().contiguous()
    bits = host.view(torch.int16) if tensor.dtype == torch.bfloat16 else host  # (numpy has none)
    return np.array(bits.numpy()).view(_numpy_dtype(tensor.dtype))


def _numpy_dtype(dtype: torch.dtype):
    import ml_dtypes
    import numpy as np

    bfloat16 = dtype == torch.bfloat16
    return np.dtype(ml_dtypes.bfloat16) if bfloat16 else torch.empty((), dtype=dtype).numpy().dtype


def _torch_tensor(array) -> torch.Tensor:
    """A host torch tensor of a numpy array's values (bfloat16 through its bits)."""
    import numpy as np

    array = np.array(array)
    if array.dtype == _numpy_dtype(torch.bfloat16):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _read_metadata(checkpointer, path: str) -> tuple[dict, dict]:
    """({item: {name: ArrayMetadata}}, meta) of the checkpoint at `path`."""
    import orbax.checkpoint as ocp

    meta, found = None, {}
    if os.path.isdir(os.path.join(path, "meta")):
        try:
            found = checkpointer.metadata(path).item_metadata
            meta = checkpointer.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except (OSError, ValueError, KeyError) as error:
            raise CheckpointError(f"tpu_inductor.load_checkpoint: {path}: {error}") from error
    if not isinstance(meta and meta["meta"], dict) or meta["meta"].get("format") != FORMAT:
        raise CheckpointError(
            f"tpu_inductor.load_checkpoint: {path} holds no tpu_inductor checkpoint (of format "
            f"{FORMAT}). Give the directory save_checkpoint wrote; an asynchronous save is "
            "there only once its handle's wait() returned."
        )
    trees = {k: v.tree for k, v in found.items() if k != "meta" and v is not None}
    return {k: ocp.tree.to_flat_dict(tree, sep="/") for k, tree in trees.items()}, meta["meta"]


def _create_state(optimizer, names: dict, saved: dict) -> None:
    """Zeros of the saved shape and dtype for the state a fresh optimizer lacks (restored next)."""
    import numpy as np

    by_name = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
    for key, metadata in saved.items():
        name, _, state_key = key.rpartition("/")
        parameter = by_name.get(name)
        if parameter is None or state_key in optimizer.state[parameter]:
            continue  # (a parameter the optimizer lacks is named by _check)
        zeros = np.zeros(tuple(metadata.shape), dtype=metadata.dtype)
        optimizer.state[parameter][state_key] = _torch_tensor(zeros)


def _check(part: str, tensors: dict, saved: dict, path: str) -> None:
    """Every tensor named on both sides, with the saved shape and dtype."""
    where = f"tpu_inductor.load_checkpoint ({part} of {path})"
    missing, extra = sorted(set(tensors) - set(saved)), sorted(set(saved) - set(tensors))
    if missing or extra:
        raise CheckpointError(
            f"{where}: the checkpoint lacks {len(missing)} of its tensors {missing[:8]} and "
            f"has {len(extra)} it lacks {extra[:8]}. Load into what was saved: the same "
            "architecture and config (parameter names), the same optimizer."
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
    """(orbax's restore arguments, the mesh Device or None) of a tensor: read into where it
    lives now on a mesh, or to the host (a stale one's values brought home first: replaced)."""
    import numpy as np
    import orbax.checkpoint as ocp

    given = placements.placements([tensor])[0]
    array = device_state.device_array(tensor)
    if given is None:
        if array is not None:
            host_sync.sync([tensor])
        return ocp.RestoreArgs(restore_type=np.ndarray), None
    device = devices.mesh_device(devices.select_device().platform, given.mesh.axes)
    now = array is not None and tuple(array.shape) == tuple(tensor.shape)
    sharding = array.sharding if now else device_state.sharding(device, given.spec)
    shape, dtype = tuple(tensor.shape), _numpy_dtype(tensor.dtype)
    return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype), device


def _assign(tensor: torch.Tensor, value, device) -> None:
    """`value` (restored over `device`'s mesh, or a numpy array) becomes `tensor`'s values."""
    if device is not None:
        moves = transfer.Transfer(device)
        if device_state.put(tensor, value, device, moves):
            return
        host = moves.to_torch(value)  # a counter or a view: its host copy is its copy
    else:
        host = _torch_tensor(value)
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
        return all(map(_plain, value))
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
