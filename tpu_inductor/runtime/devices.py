"""Devices and PJRT compilation: which PJRT client runs a graph (tpu > gpu > cpu, or the
option), a mesh's devices, compiling a StableHLO module into an executable, serializing it, and
the compile counters (`stats`)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

from tpu_inductor.exc import CompileError, DeviceError
from tpu_inductor.sharding import distributed
from tpu_inductor.sharding import placement as mesh_placement

log = logging.getLogger(__name__)

# PJRT platform names by our device option, best first.
_PREFERENCE = ("tpu", "gpu", "cpu")
# The device option (a PJRT client platform) → jax's lowering platform, which artifacts and
# `tpu-inductor compile --platform` name (other client platforms lower under their own name).
LOWERING_PLATFORMS = {"tpu": "tpu", "gpu": "cuda", "cpu": "cpu"}


@dataclasses.dataclass(frozen=True)
class Device:
    """A PJRT client and the device of it that graphs run on."""

    client: Any
    device: Any
    platform: str  # the client's platform: "cpu", "gpu", "tpu"
    process: int = dataclasses.field(default_factory=os.getpid)  # where the client was made
    # A device mesh, for modules split over devices: its axes (name, size) and its devices in
    # row-major order (`device` is the first). Empty: one device.
    axes: tuple[tuple[str, int], ...] = ()
    mesh: tuple[Any, ...] = ()
    # Whether CPU tensors cross zero-copy. False ("cpu-copy"): every crossing copies, as on an
    # accelerator, so a missed write-back or a stale copy shows as a wrong number in tests.
    zero_copy: bool = True

    def require_own_process(self) -> None:
        """PJRT clients do not survive a fork: their threads stay in the parent, and a compile
        in the child waits for them forever. Running what the parent compiled still works."""
        if os.getpid() != self.process:
            raise DeviceError(
                f"tpu_inductor: this process was forked (from pid {self.process}) after its PJRT "
                f"client was created; PJRT cannot compile in a forked child. Start workers with "
                "multiprocessing's 'spawn' or 'forkserver' method (DataLoader(..., "
                "multiprocessing_context='spawn')), or call the model at every input size "
                "before forking."
            )

    @property
    def key(self) -> tuple:
        """Which device (or mesh) an array is on (residency.mirrors keys its copies by it)."""
        where = tuple(d.id for d in self.mesh) if self.mesh else self.device.id
        return (id(self.client), where, self.zero_copy)

    @property
    def holds_copies(self) -> bool:
        """Whether its arrays are copies of the torch tensors (all but the zero-copy CPU's one
        device; a mesh's shards always are): a buffer a graph writes is then donated to the
        executable (an optimizer step updates parameters and moments in place)."""
        return bool(self.mesh) or not (self.platform == "cpu" and self.zero_copy)

    @property
    def lowering_platform(self) -> str:
        return LOWERING_PLATFORMS.get(self.platform, self.platform)

    @property
    def kind(self) -> str:
        return getattr(self.device, "device_kind", self.platform)

    def __str__(self) -> str:
        if self.mesh:
            axes = ",".join(f"{name}={size}" for name, size in self.axes)
            return f"{self.platform} mesh {axes} of {len(self.mesh)} devices ({self.kind})"
        copy = "" if self.zero_copy else ", copied"
        return f"{self.platform}:{self.device.id} ({self.kind}{copy})"


def device_option_of(lowering_platform: str) -> str:
    """The device option that runs modules lowered for `lowering_platform` ("cuda" → "gpu")."""
    return {v: k for k, v in LOWERING_PLATFORMS.items()}.get(lowering_platform, lowering_platform)


def available_platforms() -> dict[str, list[Any]]:
    """Every PJRT platform jax can open here → its devices."""
    import jax

    found: dict[str, list[Any]] = {}
    for name in _PREFERENCE:
        try:
            found[name] = jax.devices(name)
        except RuntimeError:
            continue
    return found


@functools.cache
def select_device(name: str = "auto") -> Device:
    """The device for option `device`: a platform name, or "auto" for the best present."""
    import jax.extend.backend as jeb

    platforms = available_platforms()
    if name == "auto":
        name = next(p for p in _PREFERENCE if p in platforms)
    if ("cpu" if name == "cpu-copy" else name) not in platforms:
        raise DeviceError(
            f"tpu_inductor: device {name!r} was requested but no such PJRT platform is present "
            f"(found: {', '.join(platforms) or 'none'}). Install its PJRT plugin (e.g. libtpu, "
            "jax[cuda12]) or choose another with options={'device': ...} / TPU_INDUCTOR_DEVICE."
        )
    if name in ("cpu", "cpu-copy"):
        client = _synchronous_cpu_client()
        device = client.local_devices()[0]
        return Device(client, device, platform="cpu", zero_copy=name == "cpu")
    return Device(client=jeb.get_backend(name), device=platforms[name][0], platform=name)


def mesh_device(name: str, axes: Sequence[tuple[str, int]]) -> Device:
    """The first devices of platform `name` as a mesh of `axes` (name, size), for a module split
    over them (on the CPU, of our synchronous client: see `_synchronous_cpu_client`)."""
    import jax.extend.backend as jeb

    count = math.prod(size for _, size in axes)
    if distributed.active():  # every process's devices, by global id
        client = jeb.get_backend(name)
        found = sorted(client.devices(), key=lambda d: d.id)
    elif name == "cpu":
        client = _synchronous_cpu_client()
        found = client.local_devices()
    else:
        client = jeb.get_backend(name) if name in available_platforms() else None
        found = client.local_devices() if client else []
    if len(found) < count:
        hint = (
            f" Run with XLA_FLAGS=--xla_force_host_platform_device_count={count} (set before "
            "jax is imported) for that many CPU devices."
            if name == "cpu"
            else ""
        )
        raise DeviceError(
            f"tpu_inductor: a mesh of {count} devices ({dict(axes)}) needs {count} {name} "
            f"devices; {len(found)} here.{hint}"
        )
    mesh = mesh_placement.topology_order(found[:count], [size for _, size in axes])
    local = next((d for d in mesh if d.process_index == client.process_index()), mesh[0])
    return Device(client, local, name, axes=tuple(axes), mesh=mesh)


@functools.cache  # one client, whether the device was asked for as "auto" or "cpu"
def _synchronous_cpu_client():
    """A CPU PJRT client of our own that runs each execution on the calling thread.

    jax's CPU client hands larger executions to a worker thread, which then releases the
    zero-copy torch inputs; torch's dlpack deleter takes the GIL on that thread: a GIL handoff
    per call, and an abort ("terminate called without an active exception") when it happens
    while the interpreter shuts down.
    """
    import jax
    from jax._src.lib import xla_client

    count = jax.config.jax_num_cpu_devices
    return xla_client.make_cpu_client(asynchronous=False, num_devices=count if count >= 0 else None)


# Process-wide counts: "pjrt_compiles" (what a TPU pays seconds to minutes for, each), and
# "pjrt_compiles_saved" (a module compiled before, its executable reused).
stats: collections.Counter = collections.Counter()
_counting = threading.Lock()  # precompile compiles in a pool of threads


def compile_stablehlo(module: bytes | str, device: Device):
    """PJRT-compile a StableHLO module (bytecode or text) for one device; returns the executable."""
    device.require_own_process()
    _register_custom_calls(device, module)
    with _counting:
        stats["pjrt_compiles"] += 1
    try:
        return device.client.compile_and_load(module, *_placement(device))
    except Exception as e:  # PJRT raises its own runtime error type
        raise CompileError(f"PJRT failed to compile the module for {device}: {e}") from e


_executables_by_module = None  # lru.RecentlyUsed, made on first use


def compile_module(lowered, device: Device):
    """The executable of a lowered module: compiled once per module text and device in this
    process. Two graphs that lower to the same module (a size Dynamo compiled statically, then
    again in a graph with symbolic sizes) share one PJRT compile."""
    global _executables_by_module
    from tpu_inductor.runtime.lru import RecentlyUsed

    if _executables_by_module is None:
        _executables_by_module = RecentlyUsed(256)
    key = (hashlib.sha256(lowered.text.encode()).hexdigest(), id(device.client), str(device))
    executable = _executables_by_module.get(key)
    if executable is not None:
        stats["pjrt_compiles_saved"] += 1
        log.info("tpu_inductor: the same module was compiled before: its executable is reused")
        return executable
    executable = compile_stablehlo(lowered.bytecode, device)
    _executables_by_module.put(key, executable)
    return executable


def forget_executables() -> None:
    """Drop the executables `compile_module` keeps (a benchmark's run as a new process)."""
    if _executables_by_module is not None:
        _executables_by_module.clear()


def serialize_executable(executable, device: Device) -> bytes:
    """The bytes of a compiled executable, for the compile cache and AOT artifacts."""
    return device.client.serialize_executable(executable)


def deserialize_executable(data: bytes, device: Device, module: bytes | str):
    """An executable from `serialize_executable` bytes, loaded on `device`.

    `module` is the StableHLO (bytecode or text) it was compiled from: it says which custom-call
    kernels must be registered first. Loading runs code from `data` in this process: only pass
    bytes from a trusted place.
    """
    device.require_own_process()
    _register_custom_calls(device, module)
    return device.client.deserialize_executable(data, *_placement(device))


def _register_custom_calls(device: Device, module: bytes | str) -> None:
    """Register jaxlib's custom-call kernels (LAPACK on CPU, cuSOLVER etc. on GPU) with PJRT.

    jax registers them while lowering the ops that use them; an executable deserialized from
    the cache, or compiled from StableHLO that this process did not lower, calls them too, and
    an unregistered target crashes the process (as jax.export's deserialization also guards).
    Registering is slow on first use, so it is skipped for modules without custom
    calls (the op's name is in both the text and the bytecode's string table).
    """
    marker = b"custom_call" if isinstance(module, bytes) else "custom_call"
    if marker not in module:
        return
    from jax._src.lax import linalg  # importing it registers the GPU targets

    if device.platform == "cpu":
        linalg.initialize_lapack()


# XLA options we set per executable, by platform, unless XLA_FLAGS names the same option.
# CPU: jaxlib 0.10's YNNPACK fusion types less INDIVIDUAL_CONVOLUTION (same fusions otherwise,
# checked on the zoo's HLO): convolutions by XLA's own emitter, faster forward and backward
# (figures: docs/benchmarks.md). (Per-executable options take enum names and replace the whole
# list; XLA_FLAGS' "-individual_convolution" form is not accepted.)
_XLA_OPTIONS = {
    "cpu": {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,"
        "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE"
    }
}


def _placement(device: Device):
    """(DeviceList, CompileOptions) of an executable for `device` (one, or a mesh's)."""
    from jax._src import compiler
    from jax._src.lib import xla_client

    user_flags = os.environ.get("XLA_FLAGS", "")
    overrides = {
        name: value
        for name, value in _XLA_OPTIONS.get(device.platform, {}).items()
        if name not in user_flags
    }
    devices = device.mesh or (device.device,)
    options = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=len(devices),
        device_assignment=[[d.id for d in devices]] if device.mesh else None,
        env_options_overrides=overrides,
    )
    if device.mesh:  # arguments and results the module leaves open: the partitioner chooses
        build = options.executable_build_options
        build.allow_spmd_sharding_propagation_to_parameters = [True]
        build.allow_spmd_sharding_propagation_to_output = [True]
    return xla_client.DeviceList(devices), options
