"""Host copies brought up to date on request (option `host_sync="explicit"`).

By default every compiled call brings the host tensors it writes (a parameter an optimizer step
updated, its AdamW moments, a KV cache) and the gradients a backward returns up to date: on an
accelerator those bytes cross the host link on every step, though the next compiled graph reads
them from the device. Under `host_sync="explicit"` they stay on the device: the host tensor's
storage is marked *stale* and the device array is its only current copy. Any eager access to a
stale storage's memory (an op, a print, `.numpy()`, `torch.save`, `state_dict()` values)
raises an error that says to call `tpu_inductor.sync()`, which copies the pending values into
the host tensors; compiled graphs take the device arrays as they are. A stale copy is never
read as current: torch's own storage check raises (the mechanism Inductor's CUDA graphs use for
outputs a later replay overwrote), and eager writes raise too, so the host cannot diverge.

The mark is torch's `StorageImpl` data-pointer error. CUDA builds of torch expose it to Python
(`torch._C._set_storage_data_ptr_access_error_msg`); elsewhere a C function of a few lines over
torch's own header sets it, compiled once per torch build with the system's C++ compiler and
kept in the user's cache directory. Without a compiler the option warns and works as
`"each_call"`.

A stale storage holds no host memory: its pages are given back to the operating system
(`madvise(MADV_DONTNEED)`, Linux) and come back, zeroed, when a sync writes them. Its address
and size stay, so nothing that keys on them changes. Not given back: shared memory (another
process maps it) and the memory of a device buffer itself (a gradient on the zero-copy CPU is
the array's own memory). A numpy view of such a tensor (`.numpy()` taken before, or the array
a tensor was made from) reads zeros, as it would read old values without the release: only
`tpu_inductor.sync()` makes it current. Elsewhere (no `madvise`) the memory stays held, and the
memory ledger shows it.

Only a tensor that covers its whole storage (contiguous, offset 0: a parameter, an optimizer
state, a gradient) is left stale; another is written on the host as by default. So is a tensor
of one element: counters and step counts (a static cache's length, AdamW's `step`), which eager
code reads to decide what to do next (Hugging Face's `generate` reads the cache's), cost bytes
to bring home, not bandwidth.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import mmap
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from tpu_inductor.exc import DeviceError
from tpu_inductor.runtime import ledger

MESSAGE = (
    "tpu_inductor: this tensor's current values are on the device, not in its host memory: "
    "{what}. Call tpu_inductor.sync() (every such tensor) or tpu_inductor.sync(model, "
    "optimizer, tensor, ...) before eager code reads or writes it, or compile the code that "
    "reads it. On one device, options={{'host_sync': 'each_call'}} keeps host copies current "
    "(mode='reduce-overhead' implies 'explicit'; TPU_INDUCTOR_HOST_SYNC=each_call overrides "
    "it); state on a device mesh (tpu_inductor.shard) always lives on its devices."
)
WRITTEN = (
    "a compiled graph wrote it and left it there (options={'host_sync': 'explicit'}, or a "
    "graph over a device mesh)"
)
GRADIENT = (
    "it is a gradient a compiled backward returned and left there (eager autograd adds the "
    "gradients of several backward calls on the host: to accumulate gradients that way on one "
    "device, compile with host_sync='each_call')"
)
PLACED = "tpu_inductor.shard placed it on a device mesh"

_MARK = r"""
#include <c10/core/StorageImpl.h>
#include <string>
extern "C" void tpu_inductor_mark_stale(void* storage, const char* message) {
  static_cast<c10::StorageImpl*>(storage)
      ->release_data_and_set_meta_custom_data_ptr_error_msg_(std::string(message));
}
"""
# The clear, in the order tried: torch 2.13's own, then what it does for a torch without it
# (2.11, 2.12), whose flag and refresh are private: reached through an explicit instantiation
# of a template over their member pointers (the standard exempts it from access checks).
_CLEARS = (
    r"""
extern "C" void tpu_inductor_clear_stale(void* storage) {
  static_cast<c10::StorageImpl*>(storage)->clear_data_ptr_access_error_msg_();
}
""",
    r"""
namespace {
template <typename Tag, typename Tag::type Member>
struct Reach {
  friend typename Tag::type reach(Tag) { return Member; }
};
struct Flag { using type = bool c10::StorageImpl::*; friend type reach(Flag); };
struct Refresh { using type = void (c10::StorageImpl::*)(); friend type reach(Refresh); };
template struct Reach<Flag, &c10::StorageImpl::throw_on_immutable_data_ptr_>;
template struct Reach<Refresh, &c10::StorageImpl::refresh_has_data_ptr_check>;
}  // namespace
extern "C" void tpu_inductor_clear_stale(void* storage) {
  auto* impl = static_cast<c10::StorageImpl*>(storage);
  impl->*reach(Flag{}) = false;
  impl->get_extra_meta().custom_data_ptr_error_msg_ = std::nullopt;
  (impl->*reach(Refresh{}))();
}
""",
)


def leaves_stale(numel: int) -> bool:
    """Whether a written tensor of `numel` elements is left stale (see the module's text)."""
    return numel > 1


@dataclasses.dataclass
class _Pending:
    """A stale storage: a weak reference to it, its host address (read before the mark), the
    device array of its values, as a tensor of `shape` and `dtype`, and how to fetch it."""

    storage: Any  # torch.multiprocessing.reductions.StorageWeakRef
    address: int
    array: Any
    device_key: Any
    shape: tuple[int, ...]
    dtype: torch.dtype
    to_torch: Callable[[Any], torch.Tensor]
    key: int = 0  # the StorageImpl address it is kept under
    gradient: bool = False  # a backward's gradient (else a value a graph wrote)
    held: int = 0  # the host bytes it still holds (all of them where none could be released)


class HostSync:
    """The stale host storages of this process, by their StorageImpl address."""

    def __init__(self):
        self.pending: dict[int, _Pending] = {}
        # The gradients left stale (a subset of `pending`): each compiled call drops those that
        # died (zero_grad) first (`prune_gradients`), so none is held through the next step.
        self.gradients: dict[int, _Pending] = {}
        self._live_after_prune = 0
        self._marks: tuple[Callable, Callable] | None = None
        self._lock = threading.Lock()

    def available(self) -> str | None:
        """None if storages can be marked here, else why not."""
        try:
            self._marker()
        except DeviceError as e:
            return str(e)
        return None

    def defer(
        self,
        tensor: torch.Tensor,
        array,
        device_key,
        to_torch,
        what: str = WRITTEN,
        release: bool = True,
    ) -> bool:
        """Leave `tensor`'s host memory stale, `array` its values on the device; False (nothing
        done) when it does not cover its whole storage: its host copy is written instead.
        `what` says in the error why it is stale (WRITTEN, GRADIENT). Its memory is given back
        to the system unless `release` is False (it is `array`'s own) or it cannot be."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self.pending.get(key)
        if entry is not None:
            entry.array, entry.device_key = array, device_key
            return True
        if (
            not leaves_stale(tensor.numel())
            or tensor.storage_offset() != 0
            or not tensor.is_contiguous()
            or storage.nbytes() != tensor.numel() * tensor.element_size()
        ):
            return False
        from torch.multiprocessing.reductions import StorageWeakRef

        address, nbytes = tensor.data_ptr(), storage.nbytes()
        release = release and not storage.is_shared()
        mark, _ = self._marker()
        mark(key, MESSAGE.format(what=what))
        if release:  # (after the mark: nothing reads it now)
            nbytes -= _give_back(address, nbytes)
        self.pending[key] = _Pending(
            StorageWeakRef(storage),
            address,
            array,
            device_key,
            tuple(tensor.shape),
            tensor.dtype,
            to_torch,
            key,
            what == GRADIENT,
            nbytes,
        )
        if what == GRADIENT:
            self.gradients[key] = self.pending[key]
        if len(self.pending) > 2 * self._live_after_prune + 64:
            self.prune()
        return True

    def address(self, tensor: torch.Tensor) -> int | None:
        """`tensor.data_ptr()` of a tensor over a stale storage (which raises), else None."""
        entry = self.pending.get(tensor.untyped_storage()._cdata)
        if entry is None:
            return None
        return entry.address + tensor.storage_offset() * tensor.element_size()

    def array(self, tensor: torch.Tensor) -> tuple[Any, Any] | None:
        """(device array, its device key) of a stale `tensor` (one that is its storage, as
        deferred), else None."""
        entry = self.pending.get(tensor.untyped_storage()._cdata)
        if (
            entry is None
            or tensor.storage_offset() != 0
            or tuple(tensor.shape) != entry.shape
            or tensor.dtype != entry.dtype
            or not tensor.is_contiguous()
        ):
            return None
        return entry.array, entry.device_key

    def held(self) -> list[tuple[_Pending, bool]]:
        """Each stale storage's entry and whether the storage is alive (a dead one's device
        array is held until the next prune): the memory ledger reads them."""
        return [(entry, not entry.storage.expired()) for entry in list(self.pending.values())]

    def resident_bytes(self, tensor: torch.Tensor) -> int:
        """The host bytes `tensor`'s storage holds: a stale one's that could not be released,
        any other's all."""
        storage = tensor.untyped_storage()
        entry = self.pending.get(storage._cdata)
        return storage.nbytes() if entry is None else entry.held

    def is_stale(self, tensor: torch.Tensor) -> bool:
        return bool(self.pending) and tensor.untyped_storage()._cdata in self.pending

    def sync(self, tensors: Iterable[torch.Tensor] | None = None) -> int:
        """Copy the device values of every stale storage (or those `tensors` view) into host
        memory; returns the bytes copied. The tensors' versions are kept: their values did not
        change, so the device copies stay current for every graph."""
        with self._lock:
            if tensors is None:
                keys = list(self.pending)
            else:
                # in the order given: across processes each gathers them in the same order
                keys = [
                    k
                    for k in dict.fromkeys(t.untyped_storage()._cdata for t in tensors)
                    if k in self.pending
                ]
            copied = 0
            _, clear = self._marker() if keys else (None, None)
            for key in keys:
                entry = self.pending[key]
                storage = _alive(entry.storage)
                if storage is not None and entry.array.is_deleted():  # (it stays marked stale)
                    raise DeviceError(
                        "tpu_inductor: a stale host tensor's device values were deleted (a "
                        "graph that took them over failed): they are lost, and its host memory "
                        f"({entry.shape}, {entry.dtype}) stays unreadable. Load a checkpoint."
                    )
                del self.pending[key]
                self.gradients.pop(key, None)
                if storage is None:
                    continue
                clear(key)
                host = torch.empty(0, dtype=entry.dtype).set_(storage, 0, entry.shape)
                host.copy_(entry.to_torch(entry.array))
                copied += host.numel() * host.element_size()
            if copied:
                ledger.add([((ledger.DEVICE_TO_HOST, "synced"), copied)])
            return copied

    def prune_gradients(self) -> None:
        """Drop the entries of gradients that died (their device arrays with them)."""
        dead = [key for key, entry in self.gradients.items() if entry.storage.expired()]
        for key in dead:
            entry = self.gradients.pop(key)
            if self.pending.get(key) is entry:
                del self.pending[key]

    def prune(self) -> None:
        """Drop the entries of storages that died (their device arrays with them)."""
        self.gradients = {k: e for k, e in self.gradients.items() if not e.storage.expired()}
        self.pending = {k: e for k, e in self.pending.items() if not e.storage.expired()}
        self._live_after_prune = len(self.pending)

    def _marker(self) -> tuple[Callable, Callable]:
        """(mark(storage address, message), clear(storage address))."""
        if self._marks is None:
            self._marks = _torch_marks() or _shim_marks()
        return self._marks


def _give_back(address: int, nbytes: int) -> int:
    """Give the whole pages of host memory [address, address + nbytes) back to the system (read
    again they are zeros); the bytes given back (0 where `madvise` is not to be had)."""
    madvise, page = _madvise()
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    if madvise is None or end <= start:
        return 0
    if madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED):
        return 0
    return end - start


@functools.cache
def _madvise() -> tuple[Callable | None, int]:
    """libc's madvise (None off Linux: elsewhere MADV_DONTNEED may keep the pages) and the page size."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None, mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise, mmap.PAGESIZE


def _alive(weak) -> torch.UntypedStorage | None:
    if weak.expired():
        return None
    return torch.UntypedStorage._new_with_weak_ptr(weak.cdata)


def _torch_marks() -> tuple[Callable, Callable] | None:
    """torch's own binding of the mark (CUDA builds)."""
    mark = getattr(torch._C, "_set_storage_data_ptr_access_error_msg", None)
    clear = getattr(torch._C, "_clear_storage_data_ptr_access_error_msg", None)
    return (mark, clear) if mark and clear else None


def _shim_marks() -> tuple[Callable, Callable]:
    """The mark through the C++ shim, compiled for this torch build on first use."""
    library = ctypes.CDLL(str(_built_shim()))
    library.tpu_inductor_mark_stale.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    library.tpu_inductor_clear_stale.argtypes = [ctypes.c_void_p]

    def mark(key: int, message: str) -> None:
        library.tpu_inductor_mark_stale(key, message.encode())

    return mark, library.tpu_inductor_clear_stale


def _built_shim() -> Path:
    """The shim's shared library for this torch: one built before, else the first of `_CLEARS`
    that compiles against its header (built once, kept in the user's cache; a clear this torch
    lacks is not compiled again in every process)."""
    import platformdirs

    folder = Path(platformdirs.user_cache_dir("tpu_inductor")) / "host_sync"
    sources = [_MARK + clear for clear in _CLEARS]
    built = [_library(source, folder) for source in sources]
    for library in built:
        if library.exists():
            return library
    failures = []
    for source, library in zip(sources, built):
        try:
            return _compiled(source, library)
        except (OSError, subprocess.SubprocessError) as e:
            failures.append(str(getattr(e, "stderr", "") or e))
    compiler = os.environ.get("CXX", "c++")
    raise DeviceError(
        "tpu_inductor: host_sync='explicit' needs to mark host storages stale, which this torch "
        f"build only allows from C++, and compiling that shim with {compiler!r} failed: "
        f"{failures[-1]}. Install a C++ compiler (or set CXX), or use host_sync='each_call'."
    )


def _library(source: str, folder: Path) -> Path:
    """Where `source`, built for this torch, is kept in `folder`."""
    abi = int(torch.compiled_with_cxx11_abi())
    key = f"{source}{torch.__version__}{Path(torch.__file__).parent}{abi}"
    return folder / f"stale-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def _compiled(source: str, library: Path) -> Path:
    """`source` built as the shared library `library` against this torch (once)."""
    if library.exists():
        return library
    torch_dir = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built, code = Path(scratch) / "stale.so", Path(scratch) / "stale.cpp"
        code.write_text(source)
        command = [
            os.environ.get("CXX", "c++"),
            "-O2",
            "-shared",
            "-fPIC",
            "-std=c++17",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{torch_dir / 'include'}",
            str(code),
            f"-L{torch_dir / 'lib'}",
            "-lc10",
            f"-Wl,-rpath,{torch_dir / 'lib'}",
            "-o",
            str(built),
        ]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
        os.replace(built, library)  # whole, even when two processes build it at once
    return library


host_sync = HostSync()


def sync_objects(objects) -> int:
    """`HostSync.sync` of every stale storage (no objects) or those of tensors, modules and
    optimizers (tpu_inductor.sync)."""
    if not objects:
        return host_sync.sync()
    tensors: list[torch.Tensor] = []
    for item in objects:
        if isinstance(item, torch.Tensor):
            tensors.append(item)
        elif isinstance(item, torch.nn.Module):
            tensors += [*item.parameters(), *item.buffers()]
            tensors += [p.grad for p in item.parameters() if p.grad is not None]
        elif isinstance(item, torch.optim.Optimizer):
            tensors += [
                value
                for state in item.state.values()
                for value in state.values()
                if isinstance(value, torch.Tensor)
            ]
            tensors += [p for group in item.param_groups for p in group["params"]]
        else:
            raise TypeError(
                f"tpu_inductor.sync() takes tensors, modules and optimizers; got "
                f"{type(item).__name__}: {item!r:.80}"
            )
    return host_sync.sync(tensors)
