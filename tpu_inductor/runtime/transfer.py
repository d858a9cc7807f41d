"""torch tensor <-> jax array on one device (or a mesh), by the fastest path this jax/torch pair has.

On the CPU platform tensors cross zero-copy through dlpack when they are contiguous and
aligned; anything else (a transposed or sliced view) is copied to a fresh contiguous tensor
first: executing PJRT on a transposed zero-copy view returns wrong numbers. The "cpu-copy"
device copies every crossing, as an accelerator does.
"""

from __future__ import annotations

import contextlib

import torch

from tpu_inductor.runtime import devices, residency
from tpu_inductor.runtime.host_sync import host_sync
from tpu_inductor.sharding import placement as mesh_placement

_ALIGNMENT = 64  # bytes; XLA:CPU wants aligned buffers for zero-copy
# What `Transfer.argument` hands jax's C++ fast path as numpy: jax takes these as they are.
_NUMPY_DTYPES = frozenset(
    (torch.float32, torch.float16, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
)


class Transfer:
    """torch tensor ↔ jax array on one device, by the fastest path this jax/torch pair has.

    CPU: zero-copy dlpack, through jaxlib's and torch's C entry points when present (less
    per-call overhead than the public `from_dlpack` wrappers, and no int64 narrowing).
    Other devices: zero-copy to a host array, then one `device_put` (split into shards by the
    argument's sharding on a mesh). A CPU mesh: a copy of each device's shard (see `to_device`).
    """

    def __init__(self, device):  # a runtime.Device
        import jax

        self.key = device.key
        self.device = device.device
        self.on_cpu = device.platform == "cpu" and device.zero_copy and not device.mesh
        self.cpu_mesh = device.platform == "cpu" and bool(device.mesh)
        self.copies_on_cpu = device.platform == "cpu" and not device.zero_copy
        self.host = self.device if device.platform == "cpu" else jax.devices("cpu")[0]
        try:
            from jax._src.lib import _jax

            self._import = _jax.dlpack_managed_tensor_to_buffer
            self._export = _jax.buffer_to_dlpack_managed_tensor
            self._torch_import = torch._C._from_dlpack
        except (ImportError, AttributeError):  # a jaxlib without the C entry points
            self._import = None

    def to_device(self, tensor: torch.Tensor, sharding=None):
        """A jax array on the device holding `tensor`'s values (contiguous, aligned first); split
        by `sharding` over a mesh. A CPU mesh gets a copy of each device's shard, from numpy:
        zero-copy torch memory split over devices was released on XLA's worker threads, which
        aborted the process at exit ("terminate called without an active exception") in about
        half of fresh processes."""
        if tensor.__class__ is residency.DeviceTensor:
            if tensor.device_key == self.key and sharding is None:
                return tensor.array
            tensor = tensor.host()
        elif host_sync.pending:  # values the devices hold (host_sync)
            stale = host_sync.array(tensor)
            if stale is not None:
                array, where = stale
                if where == self.key:
                    return self.resharded(array, sharding)
                devices.stats["device_moves"] += 1
                return self.moved(array, sharding)
        if tensor.requires_grad:  # (dlpack exports no tensor that requires grad)
            tensor = tensor.detach()
        if tensor.is_conj() or tensor.is_neg():  # lazy bits dlpack would drop: apply them
            tensor = tensor.resolve_conj().resolve_neg()
        if sharding is not None and self.cpu_mesh:
            import jax

            shape = tuple(tensor.shape)
            with (
                mesh_placement.exact_dtypes()
            ):  # an int64 argument stays int64 (the module's dtype)
                shards = [
                    jax.device_put(_numpy_copy(tensor[index]), device)
                    for device, index in sharding.addressable_devices_indices_map(shape).items()
                ]
            return jax.make_array_from_single_device_arrays(shape, sharding, shards)
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        elif tensor.data_ptr() % _ALIGNMENT:
            tensor = tensor.clone()
        if self._import is not None:
            array = self._import(torch._C._to_dlpack(tensor), self.host, None, None)
        else:
            from jax._src.dlpack import from_dlpack

            with _keeping_width(tensor.element_size()):
                array = from_dlpack(tensor, device=self.host)
        if self.on_cpu:
            return array
        import jax

        with _keeping_width(array.dtype.itemsize):
            if self.copies_on_cpu:  # the device's own copy, as an accelerator's would be
                return jax.device_put(array, self.device, may_alias=False)
            return jax.device_put(array, sharding or self.device)

    def resharded(self, array, sharding):
        """`array` (on this device or mesh) split by `sharding`: moved between the mesh's
        devices where it is split otherwise (no host crossing); as it is on one device."""
        if sharding is None or array.sharding is sharding:
            return array
        if array.sharding.is_equivalent_to(sharding, array.ndim):
            return array
        devices.stats["mesh_reshards"] += 1
        return self.moved(array, sharding)

    def moved(self, array, sharding=None):
        """`array`, on other devices, moved to this device or mesh (split by `sharding`): a
        device-to-device copy, never through the host's torch memory. An array split over
        several processes' devices moves by a program each runs (a copy under jit: the
        partitioner's collectives), which `device_put` cannot."""
        import jax

        with mesh_placement.exact_dtypes():
            if not array.is_fully_addressable:
                return jax.jit(_same, out_shardings=sharding)(array)
            return jax.device_put(array, sharding or self.device)

    def argument(self, tensor: torch.Tensor):
        """`to_device` for jax's C++ fast path (execution.py): a plain contiguous host tensor
        of a dtype numpy has, 32 bits or less, goes as a numpy view, which jax's C++ sends to
        the device (zero-copy on the CPU) without a Python-level transfer; anything else as
        `to_device` makes it. (A 64-bit numpy array would be narrowed by jax without x64.)"""
        if (
            tensor.__class__ is torch.Tensor
            and tensor.is_cpu  # (a CUDA tensor has no numpy view: to_device's dlpack)
            and tensor.dtype in _NUMPY_DTYPES
            and not tensor.requires_grad
            and not tensor.is_neg()  # (a lazy negation, which numpy would drop)
            and tensor.is_contiguous()
            and not host_sync.is_stale(tensor)  # (its host memory is unreadable: the device's)
        ):
            return tensor.numpy()
        return self.to_device(tensor)

    def aliases(self, array, tensor: torch.Tensor) -> bool:
        """Whether a CPU `array` reads `tensor`'s memory (a zero-copy transfer), not a copy."""
        return array.unsafe_buffer_pointer() == residency.address(tensor)

    def to_torch(self, array) -> torch.Tensor:
        """A CPU torch tensor of a device array (zero-copy on CPU)."""
        if not self.on_cpu:
            return _host_tensor(array)
        if self._import is not None:
            return self._torch_import(self._export(array))
        return torch.from_dlpack(array)


def _same(array):
    return array


def _keeping_width(itemsize: int):
    """A scope in which jax keeps 64-bit values 64-bit where they are (the public dlpack import
    and `device_put` narrow them without x64: an int64 token id became int32, which the module,
    lowered at int64, refused on jax 0.11); nothing for narrower ones."""
    return mesh_placement.exact_dtypes() if itemsize >= 8 else contextlib.nullcontext()


def _numpy_copy(tensor: torch.Tensor):
    """A numpy copy of a CPU tensor (bfloat16 through its bits, as ml_dtypes' bfloat16)."""
    import numpy as np

    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return np.array(tensor.view(torch.int16).numpy()).view(ml_dtypes.bfloat16)
    return np.array(tensor.numpy())


def _host_tensor(array) -> torch.Tensor:
    """Copy a device array to a CPU torch tensor (bfloat16 through its bits; one split over
    several processes gathered by all of them).

    jax's host copy is read-only and jax's own: the tensor gets a writable copy of it.
    """
    import numpy as np

    if not array.is_fully_addressable and not array.is_fully_replicated:
        # split over several processes' devices: every process gathers the whole (a collective
        # each runs, as it runs the graphs)
        from jax.experimental import multihost_utils

        array = multihost_utils.process_allgather(array, tiled=True)
    host = np.array(array, copy=True, order="C")
    if host.dtype.name == "bfloat16":
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(host)
