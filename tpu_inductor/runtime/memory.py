"""The memory ledger: what the runtime holds on each device, what each executable needs besides,
and the host memory still held by tensors whose current values are on the devices.

Beside the transfer ledger (ledger.py), which counts bytes that cross, this one counts bytes
that stay. Read when asked (`memory()`): nothing is added to a call but the call counter the
transfer ledger keeps already.

Per device, the bytes of the device arrays the runtime keeps, by kind:

  parameters        a parameter's device copy (a graph's resident arguments, a mirror)
  optimizer_state   a tensor of an optimizer's state (AdamW's moments) a compiled step wrote
  gradients         a gradient a compiled backward returned and left on the device
  hoisted           values made from parameters alone, once per their version (hoisted.py)
  saved             activations a forward kept on the device for its backward (DeviceTensor)
  buffers           a module's buffer (a KV cache, running statistics) or other written state
  mirrors           the device copy of any other host tensor (an input a backward reads again)
  unreachable       arrays still held for a tensor that died (dropped at the next prune)

read from where the runtime keeps them: each CompiledGraph's resident arguments, the mirrors
(residency.py), the stale storages' arrays (host_sync.py), the hoisted values (hoisted.py) and
the live DeviceTensors. An array reached twice counts once (by device and buffer address, so a
zero-copy alias of the same memory too), under the first kind above that reaches it; a tensor's
kind comes from what it is (an `nn.Parameter`, a value of an optimizer's state, a parameter's
`.grad`, a module's buffer), else from where it was found. A sharded array counts each
device's shard on that device. On the zero-copy CPU a device array may be the host tensor's own
memory: it is counted here as an accelerator would hold it, and not again on the host.

Per executable, XLA's memory analysis (`get_compiled_memory_stats`): argument, temporary,
output, alias and generated-code bytes per device, taken when its CompiledGraph is made (a
compile, a cache hit, a deserialized executable, an AOT artifact: every executable runs
through one). A device's *peak* estimate is its resident bytes plus the largest need of the
executables run on it since `reset_peak()`: its arguments not already resident (those that are
parameters, written state, saved activations or another graph's outputs are), its temporaries
and its outputs, less the outputs that reuse a donated argument's buffer.

Per process, `host_held`: host memory of tensors whose current values are on the devices, kept
apart from the device bytes even on the CPU, where both are host memory: storages left stale
under host_sync="explicit" (the bytes each still holds: its memory is given back to the system
where it can be, host_sync.py), by kind, and the host copies a DeviceTensor made when eager code read it ("materialized").
"""

from __future__ import annotations

import dataclasses
import gc
import math
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tpu_inductor.runtime import residency
from tpu_inductor.runtime.call_plan import ArgumentKind
from tpu_inductor.runtime.host_sync import host_sync

# The kinds, in the order that decides an array reached as several: the first wins.
KINDS = (
    "parameters",
    "optimizer_state",
    "gradients",
    "hoisted",
    "saved",
    "buffers",
    "mirrors",
    "unreachable",
)
_PRIORITY = {kind: rank for rank, kind in enumerate(KINDS)}
# An executable's arguments that come from device state rather than from the call.
_ON_DEVICE = frozenset(
    (ArgumentKind.PARAMETER, ArgumentKind.WRITTEN, ArgumentKind.SAVED, ArgumentKind.MIRRORED)
)
_ANALYSIS = (  # our name → XLA's CompiledMemoryStats field
    ("arguments", "argument_size_in_bytes"),
    ("temporaries", "temp_size_in_bytes"),
    ("outputs", "output_size_in_bytes"),
    ("alias", "alias_size_in_bytes"),
    ("generated_code", "generated_code_size_in_bytes"),
)


def analysis(executable) -> dict[str, int] | None:
    """XLA's memory analysis of a loaded executable, per device, in bytes (None where the
    PJRT client has none)."""
    try:
        stats = executable.get_compiled_memory_stats()
    except Exception:  # a client without the analysis raises its own error type
        return None
    return {name: int(getattr(stats, field)) for name, field in _ANALYSIS}


@dataclasses.dataclass(eq=False)
class Executable:
    """One CompiledGraph's executable: its analysis, the devices it runs on, what it needs on
    each beyond the resident state (`need`), and its call counter (ledger.CallCount)."""

    graph: Any  # weakref.ref to the CompiledGraph
    count: Any
    analysis: dict[str, int] | None
    devices: tuple[str, ...]
    need: int
    at_reset: int = 0
    name: str | None = None

    @property
    def ran(self) -> int:
        """Calls since the last `reset_peak`."""
        return self.count.calls - self.at_reset


_executables: list[Executable] = []
_holders: weakref.WeakSet = weakref.WeakSet()  # objects with held_arrays()


def track(graph, executable, device, plan, shardings, lowered, count) -> Executable:
    """Record a CompiledGraph's executable (at its making, never per call) and hold the graph
    weakly, to read its resident arrays (`graph.held_arrays()`)."""
    found = analysis(executable)
    need = 0
    if found is not None:
        resident = sum(
            _per_device(a.nbytes, lowered.input_specs[a.slot].shape, shardings[a.slot])
            for a in plan.arguments
            if a.kind in _ON_DEVICE
        )
        arguments = max(0, found["arguments"] - resident)
        need = arguments + found["temporaries"] + found["outputs"] - found["alias"]
    names = tuple(_name(d) for d in (device.mesh or (device.device,)))
    entry = Executable(weakref.ref(graph), count, found, names, max(0, need), count.calls)
    _executables.append(entry)
    _holders.add(graph)
    return entry


def hold(holder) -> None:
    """Read `holder.held_arrays()` (kind, tensor or None, device array) into the ledger."""
    _holders.add(holder)


def _per_device(nbytes: int, shape, sharding) -> int:
    """The bytes of one device's shard of a value of `nbytes` and `shape`."""
    if sharding is None or not shape:
        return nbytes
    return nbytes * math.prod(sharding.shard_shape(tuple(shape))) // max(1, math.prod(shape))


def _name(device) -> str:
    return f"{device.platform}:{device.id}"


def reset_peak() -> None:
    """Start the peak estimate again: only executables run after this count."""
    alive = []
    for entry in _executables:
        entry.at_reset = entry.count.calls
        if entry.graph() is not None:
            alive.append(entry)
    _executables[:] = alive


@dataclasses.dataclass
class _Roles:
    """What each tensor is, by id: found on the optimizers and modules alive."""

    optimizer_state: set[int] = dataclasses.field(default_factory=set)
    gradients: set[int] = dataclasses.field(default_factory=set)
    buffers: set[int] = dataclasses.field(default_factory=set)

    def kind(self, tensor: torch.Tensor | None, found_as: str) -> str:
        if tensor is None:
            return found_as
        if id(tensor) in self.optimizer_state:
            return "optimizer_state"
        if isinstance(tensor, torch.nn.Parameter):
            return "parameters"
        if id(tensor) in self.gradients:
            return "gradients"
        if id(tensor) in self.buffers:
            return "buffers"
        return found_as


def _walk() -> tuple[_Roles, list]:
    """The roles of tensors (from the optimizers and modules alive) and the live DeviceTensors:
    one pass over the objects the garbage collector tracks (read time only)."""
    roles, device_tensors = _Roles(), []
    optimizer, module = torch.optim.Optimizer, torch.nn.Module
    for item in gc.get_objects():
        cls = type(item)  # (isinstance would call a dead weak proxy)
        if cls is residency.DeviceTensor:
            device_tensors.append(item)
        elif issubclass(cls, optimizer):
            for state in item.state.values():
                roles.optimizer_state.update(
                    id(v) for v in state.values() if isinstance(v, torch.Tensor)
                )
            params = [p for group in item.param_groups for p in group["params"]]
            roles.gradients.update(id(p.grad) for p in params if p.grad is not None)
        elif issubclass(cls, module):
            roles.buffers.update(id(b) for b in item._buffers.values() if b is not None)
            grads = (p.grad for p in item._parameters.values() if p is not None)
            roles.gradients.update(id(g) for g in grads if g is not None)
    return roles, device_tensors


def _reached(roles: _Roles, device_tensors: list) -> Iterator[tuple[str, Any, Any]]:
    """(kind, tensor or None, array) of every device array the runtime holds."""
    for holder in list(_holders):
        yield from holder.held_arrays()
    for tensor, array, by_memory in residency.mirrors.held():
        found_as = "gradients" if by_memory else "mirrors"
        yield (found_as if tensor is not None or by_memory else "unreachable"), tensor, array
    for entry, alive in host_sync.held():
        yield (
            ("gradients" if entry.gradient else "buffers") if alive else "unreachable",
            None,
            (entry.array),
        )
    for tensor in device_tensors:
        yield "saved", None, tensor.array


def _shards(array) -> Iterable[tuple[str, int, int]]:
    """(device name, buffer address, bytes) of each of `array`'s shards on this process."""
    if array is None or array.is_deleted():
        return ()
    found = []
    for shard in array.addressable_shards:
        data = shard.data
        found.append((_name(shard.device), data.unsafe_buffer_pointer(), data.nbytes))
    return found


def _device_bytes(pairs: Iterable[tuple[str, Any, Any]], roles: _Roles) -> tuple[dict, set]:
    """device → kind → bytes, each buffer once (under its first kind), and the buffers'
    addresses (a zero-copy host storage among them holds no host memory of its own)."""
    ranked = sorted(
        ((roles.kind(tensor, found_as), array) for found_as, tensor, array in pairs),
        key=lambda pair: _PRIORITY[pair[0]],
    )
    seen: set[tuple[str, int]] = set()
    devices: dict[str, dict[str, int]] = {}
    for kind, array in ranked:
        for device, address, nbytes in _shards(array):
            if (device, address) in seen:
                continue
            seen.add((device, address))
            kinds = devices.setdefault(device, dict.fromkeys(KINDS, 0))
            kinds[kind] += nbytes
    for kinds in devices.values():
        kinds["total"] = sum(kinds[k] for k in KINDS)
    return devices, {address for _, address in seen}


def _host_held(roles: _Roles, device_tensors: list, tensors: dict, addresses: set) -> dict:
    """The host bytes of tensors whose current values are on the devices: stale storages by
    kind (not one that is a device buffer's own memory: the zero-copy CPU), and DeviceTensors'
    host copies."""
    stale = dict.fromkeys(("parameters", "optimizer_state", "gradients", "buffers"), 0)
    for entry, alive in host_sync.held():
        if not alive or entry.address in addresses:
            continue
        tensor = tensors.get(entry.key)
        kind = roles.kind(tensor, "gradients" if entry.gradient else "buffers")
        kind = kind if kind in stale else "buffers"
        stale[kind] += entry.held
    copies = {}
    for tensor in device_tensors:
        host = tensor._host
        if host is not None:
            copies[host.untyped_storage()._cdata] = host.untyped_storage().nbytes()
    materialized = sum(copies.values())
    return {
        "stale": stale,
        "materialized": materialized,
        "total": sum(stale.values()) + materialized,
    }


def memory() -> dict:
    """The memory ledger now (see the module's text): {"devices": {device: {kind: bytes,
    "total"}}, "executables": [...], "peak": {device: bytes}, "host_held": {...}}."""
    residency.drop_dead()  # (gradients zero_grad dropped: not held, so not counted)
    roles, device_tensors = _walk()
    pairs = list(_reached(roles, device_tensors))
    devices, addresses = _device_bytes(pairs, roles)
    tensors = {}  # storage key → a tensor over it (the stale storages' kinds)
    for _, tensor, _ in pairs:
        if tensor is not None and host_sync.is_stale(tensor):
            tensors[tensor.untyped_storage()._cdata] = tensor
    executables, needs = [], {}
    for entry in _executables:
        graph = entry.graph()
        if graph is None and entry.ran <= 0:
            continue
        if entry.ran > 0:
            for device in entry.devices:
                needs[device] = max(needs.get(device, 0), entry.need)
        executables.append(
            {
                "graph": entry.name,
                "alive": graph is not None,
                "devices": list(entry.devices),
                "analysis": entry.analysis,
                "need": entry.need,
                "calls_since_reset": entry.ran,
            }
        )
    names = sorted({*devices, *needs})
    resident = {d: devices.get(d, {}).get("total", 0) for d in names}
    return {
        "devices": devices,
        "executables": executables,
        "peak": {d: resident[d] + needs.get(d, 0) for d in names},
        "host_held": _host_held(roles, device_tensors, tensors, addresses),
    }
