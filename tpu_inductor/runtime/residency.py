"""What stays on the device between calls: device-backed tensors and device mirrors of host ones.

`DeviceTensor` is a torch tensor whose values live in a device array: a compiled forward returns
the activations only its backward reads as DeviceTensors, and the backward takes their arrays
as they are, so they never cross the host link. Anything else that reads one (an eager op, a
print, `torch.save`) gets its values: the array is copied to the host once (counted as
"materialized" in the transfer ledger) and the op runs on that copy. What has no values on the
host: `data_ptr()` is 0 (no host memory), never a stale address; `.numpy()` and `.tolist()`
give the values.

Compiled autograd (`torch._dynamo.config.compiled_autograd`) makes the backward a Dynamo graph
whose inputs are the saved activations. A DeviceTensor reaches it as its *stand-in*: a plain
CPU tensor of its shape and dtype over one zero element (zero strides: no host memory), which
Dynamo and AOTAutograd trace as any input, and which carries a twin DeviceTensor over the same
array (`DeviceTensor.stood_for`) and is mirrored (below) by the array. The backend hands the
graph the twins (its executable takes their arrays; eager ops of a split graph read their
values, counted), and a graph loaded from AOTAutograd's cache finds the arrays as the
stand-ins' mirrors: the activations never cross. (Chosen over returning saved activations as
host tensors under compiled autograd, which sends them to the host, and over lifting them as
opaque handles, which needs compiled autograd's capture changed. A bucketed graph's padded
array is not the values: its stand-in is the host copy, counted.)

A *mirror* is the device copy of a host tensor (a parameter, a buffer, a saved input) together
with the host tensor's stamp (version counter, storage pointer) when the copy was made or
written: every compiled graph that takes the tensor reuses the copy while the stamp holds, and a
graph that writes the tensor (a buffer update, an optimizer step) publishes its result as the
new copy after it wrote the host tensor, so the next graph does not send it again. An in-place
write through torch bumps the version: the stamp no longer holds and the tensor is sent again.
(Writes that bypass the version counter, through `.data` or to an inference tensor, are not
seen on an accelerator: as with `resident_params`.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tpu_inductor.runtime import ledger
from tpu_inductor.runtime.host_sync import host_sync


class DeviceTensor(torch.Tensor):
    """A tensor of `shape` and `dtype` whose values are the device array `array`.

    `to_host(array)` copies an array to a CPU torch tensor (the runtime's transfer);
    `device_key` names the array's device (runtime.Device.key).

    Under compiled autograd, Dynamo traces the backward and takes the saved activations as
    graph inputs: this is a traceable wrapper subclass (`__tensor_flatten__`), which Dynamo and
    AOTAutograd see as its one inner tensor, its `stand_in` (see the module's text).
    Rebuilt from a traced stand-in (`__tensor_unflatten__`) it has no array, and its ops run
    on the stand-in: that is how they are traced."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        array,
        shape,
        dtype: torch.dtype,
        to_host: Callable[[Any], Any] | None,
        device_key,
        unpad: Callable[[torch.Tensor], torch.Tensor] | None = None,
        stand_in: torch.Tensor | None = None,
    ):
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu")
        tensor.array, tensor.device_key = array, device_key
        tensor._to_host, tensor._unpad, tensor._host = to_host, unpad, None
        tensor._stand_in = stand_in
        return tensor

    @property
    def padded_shape(self) -> tuple[int, ...] | None:
        """The array's shape where it holds a bucket's padding around the values (else None)."""
        return None if self._unpad is None else tuple(self.array.shape)

    def with_padding(self, shape, unpad: Callable[[torch.Tensor], torch.Tensor]) -> DeviceTensor:
        """This tensor's array as the values of `shape` that `unpad` cuts out of it: a
        bucketed graph's saved activation, whose backward takes the padded array as it is."""
        return DeviceTensor(self.array, shape, self.dtype, self._to_host, self.device_key, unpad)

    def padded(self) -> DeviceTensor:
        """The whole padded array as a tensor (for the next bucketed graph of the same bucket)."""
        shape = tuple(self.array.shape)
        return DeviceTensor(self.array, shape, self.dtype, self._to_host, self.device_key)

    def host(self) -> torch.Tensor:
        """The values as a plain CPU tensor (copied from the device on first use)."""
        if self._host is None:
            host = self._to_host(self.array)
            if self._unpad is not None:
                host = self._unpad(host)
            ledger.add(
                [((ledger.DEVICE_TO_HOST, "materialized"), host.numel() * host.element_size())]
            )
            self._host = host.reshape(self.shape)
        return self._host

    # Called by Dynamo and AOTAutograd themselves, also from eager code between graphs, where
    # Dynamo would compile these frames: never traced.
    @property
    @torch._disable_dynamo
    def stand_in(self) -> torch.Tensor:
        """The plain tensor traced graphs take for this one (made on first use)."""
        if self._stand_in is None:
            if self._unpad is not None:
                self._stand_in = self.host()
            else:
                stand_in = torch.zeros((), dtype=self.dtype).expand(self.shape)
                # (a twin over the same array, not this tensor: no reference cycle)
                stand_in._stands_for = DeviceTensor(
                    self.array, self.shape, self.dtype, self._to_host, self.device_key
                )
                mirrors.put(stand_in, self.device_key, self.array)
                self._stand_in = stand_in
        return self._stand_in

    @staticmethod
    def stood_for(tensor: torch.Tensor) -> torch.Tensor:
        """The DeviceTensor that `tensor` is the stand-in of (over the same array); else
        `tensor` itself."""
        return getattr(tensor, "_stands_for", tensor)

    @torch._disable_dynamo
    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["stand_in"], None

    @staticmethod
    @torch._disable_dynamo
    def __tensor_unflatten__(inner: dict, meta: None, outer_size, outer_stride) -> DeviceTensor:
        stand_in = inner["stand_in"]
        return DeviceTensor(None, outer_size, stand_in.dtype, None, None, stand_in=stand_in)

    @classmethod
    @torch._disable_dynamo
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        source = args[0] if args else None
        if func in _SHARING and type(source) is cls and source.array is not None:
            # autograd's detach of a saved tensor
            return cls(
                source.array,
                source.shape,
                source.dtype,
                source._to_host,
                source.device_key,
                source._unpad,
                source._stand_in,
            )
        args, kwargs = torch.utils._pytree.tree_map_only(cls, cls._values, (args, kwargs or {}))
        return func(*args, **kwargs)

    def _values(self) -> torch.Tensor:
        """What an op reads: the values; the stand-in where traced (no array)."""
        return self._stand_in if self.array is None else self.host()

    def numpy(self, *, force: bool = False):
        return self.host().numpy(force=force)

    def tolist(self):
        return self.host().tolist()

    def __reduce_ex__(self, protocol):  # torch.save, pickle, deepcopy: the values
        return self.host().__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents=None) -> str:
        if self.array is None:
            return f"DeviceTensor(traced, {self._stand_in!r})"
        return f"DeviceTensor({self.host()!r})"


_SHARING = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


class WeakIdentityMap:
    """A dict keyed by objects' identity that drops an entry when its key dies: torch's
    WeakIdKeyDictionary without its key object (a Python class) per lookup, which a training
    step makes hundreds of."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, key: Any, default: Any = None) -> Any:
        found = self._entries.get(id(key))
        return found[1] if found is not None and found[0]() is key else default

    def __contains__(self, key: Any) -> bool:
        found = self._entries.get(id(key))
        return found is not None and found[0]() is key

    def __setitem__(self, key: Any, value: Any) -> None:
        ident, entries = id(key), self._entries
        found = entries.get(ident)
        if found is not None and found[0]() is key:  # the key's reference, made once
            entries[ident] = (found[0], value)
            return

        def drop(ref, ident=ident):  # (an entry a new object at the same address took stays)
            if entries.get(ident, (None,))[0] is ref:
                del entries[ident]

        entries[ident] = (weakref.ref(key, drop), value)

    def pop(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            return default
        return self._entries.pop(id(key))[1]

    def entries(self) -> list[tuple[weakref.ref, Any]]:
        """(weak reference to the key, value) of every entry."""
        return list(self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class Mirrors:
    """Device copies of host tensors, per device, keyed by the tensor (weakly: a tensor that
    dies drops its copy) and valid while the tensor's stamp holds.

    A graph's outputs are also found by their memory (storage, offset, shape, strides, dtype):
    autograd hands a gradient on as another tensor over the same storage (`detach`), which
    shares its version counter, so the copy is as current for it. Such an entry dies with the
    storage (a weak reference to it), never read for memory that was freed and reused."""

    def __init__(self):
        self._copies = WeakIdentityMap()
        self._by_memory: dict[tuple, tuple] = {}
        self._memory_devices: set = set()  # the device keys `_by_memory` holds copies on
        # tensor → the states (Watched) that hold an array of it: dropped when a new copy
        # replaces the old (an optimizer step's), so no graph keeps the old version alive
        self._holders = WeakIdentityMap()

    def get(self, tensor: torch.Tensor, device_key: Any, bumped: bool = False):
        """The device copy of `tensor` on the device of `device_key`, or None if there is none
        or the tensor changed since. `bumped`: the caller's wrapper has just bumped the
        tensor's version once without writing it (AOTAutograd does, before calling a graph
        that writes the tensor)."""
        entry = self._copies.get(tensor)
        if entry is None and self._by_memory:
            entry = self._by_memory.get(_memory(tensor, device_key))
            if entry is not None and entry[3].expired():
                entry = None
        if entry is None or entry[0] != device_key:
            return None
        version, storage = stamp(tensor)
        if bumped and version >= 0:
            version -= 1
        return entry[2] if entry[1] == (version, storage) else None

    def has_copy(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` has a device copy on some device (current or not)."""
        if tensor in self._copies:
            return True
        for key in self._memory_devices:
            entry = self._by_memory.get(_memory(tensor, key))
            if entry is not None and not entry[3].expired():  # (not a dead storage's memory)
                return True
        return False

    def put(self, tensor: torch.Tensor, device_key: Any, array) -> None:
        """`array` is `tensor`'s current values on the device of `device_key`: the states
        that hold an older copy are dropped (their graphs take this one at their next call)."""
        before = self._copies.get(tensor)
        self._copies[tensor] = (device_key, stamp(tensor), array)
        if before is not None and before[2] is not array:
            for owner, state in self._holders.pop(tensor, {}).values():
                _drop(owner, state)

    def hold(self, tensor: torch.Tensor, owner: weakref.ref, state: weakref.ref) -> None:
        """The state `state` of `owner` holds an array of `tensor` (see `put`)."""
        held = self._holders.get(tensor)
        if held is None:
            held = self._holders[tensor] = {}
        held[id(state)] = (owner, state)

    def put_output(self, tensor: torch.Tensor, device_key: Any, array) -> None:
        """`put`, findable by the tensor's memory too (a graph output autograd passes on)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        self.put(tensor, device_key, array)
        if len(self._by_memory) > 4 * len(self._copies) + 64:
            self.drop_dead()
        weak = StorageWeakRef(tensor.untyped_storage())
        self._memory_devices.add(device_key)
        self._by_memory[_memory(tensor, device_key)] = (device_key, stamp(tensor), array, weak)

    @property
    def by_memory(self) -> bool:
        """Whether some copies are found by memory (a backward's outputs: gradients)."""
        return bool(self._by_memory)

    def drop_dead(self) -> None:
        """Drop the copies found by memory whose storage died (a gradient zero_grad dropped)."""
        self._by_memory = {k: e for k, e in self._by_memory.items() if not e[3].expired()}

    def discard(self, tensor: torch.Tensor) -> None:
        """Forget `tensor`'s device copy (its memory is freed unless a graph holds it)."""
        self._copies.pop(tensor, None)

    def held(self) -> list[tuple[torch.Tensor | None, Any, bool]]:
        """(tensor, device array, found by memory) of every copy kept: a copy by identity has
        its tensor (None where it died), one by memory (a backward's output) has none; a dead
        storage's is held until the next prune (tensor None, False)."""
        found = [(entry[0](), entry[1][2], False) for entry in self._copies.entries()]
        for entry in list(self._by_memory.values()):
            alive = not entry[3].expired()
            found.append((None, entry[2], alive))
        return found

    def clear(self) -> None:
        self._copies.clear()
        self._by_memory.clear()
        self._memory_devices.clear()
        self._holders.clear()


def _memory(tensor: torch.Tensor, device_key: Any) -> tuple:
    """Which memory a tensor views, and how: equal for a tensor and its `detach()`."""
    return (
        device_key,
        address(tensor),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )


def drop_dead() -> None:
    """Free the device arrays of gradients that died since (zero_grad): the stale storages'
    (host_sync) and the copies found by memory. Each compiled call runs it first while there
    are any, so a step's dead gradients are not held through the next one."""
    if host_sync.gradients:
        host_sync.prune_gradients()
    if mirrors.by_memory:
        mirrors.drop_dead()


def stamps(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
    """Each tensor's identity and stamp: what a state made from them was made at."""
    return [(id(t), *stamp(t)) for t in tensors]


def stamp(tensor: torch.Tensor) -> tuple[int, int]:
    """What changes when a tensor's values may have: its version (inference tensors have none:
    -1) and its storage."""
    return (-1 if tensor.is_inference() else tensor._version, address(tensor))


def address(tensor: torch.Tensor) -> int:
    """`tensor.data_ptr()`, also of a tensor whose host memory is stale (host_sync), where
    `data_ptr()` raises."""
    if host_sync.pending:
        stale = host_sync.address(tensor)
        if stale is not None:
            return stale
    return tensor.data_ptr()


mirrors = Mirrors()


class Watched:
    """State made from some tensors (their device arrays, what was computed from them), which its
    owner drops when one of them dies (an identity or a storage could then be reused by another
    tensor, which must never read it) or gets a new device copy (Mirrors.put: the old arrays
    are not kept alive). `owner.drop_state(state)`; keeps neither alive."""

    _finalizers: tuple | list = ()

    def watch(self, tensors: Sequence[torch.Tensor], owner: Any) -> None:
        refs = weakref.ref(owner), weakref.ref(self)
        self._finalizers = [weakref.finalize(t, _drop, *refs) for t in tensors]
        for tensor in tensors:
            mirrors.hold(tensor, *refs)

    def watched(self) -> list[torch.Tensor | None]:
        """The tensors watched, in order (None for one that died)."""
        return [None if (f := finalizer.peek()) is None else f[0] for finalizer in self._finalizers]

    def unwatch(self) -> None:
        for finalizer in self._finalizers:
            finalizer.detach()


def _drop(owner_ref, state_ref) -> None:
    owner, state = owner_ref(), state_ref()
    if owner is not None and state is not None:
        owner.drop_state(state)
