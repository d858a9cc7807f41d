"""Where a mesh executable's arguments and results live: the mesh's devices in the order of
the hardware's links (`topology_order`), the jax shardings PJRT compiled them with (the
partitioner chose the open ones), and those layouts as partition specs.

runtime.CompiledGraph places every argument by `argument_shardings` and assembles every result
by `result_shardings`, so a layout XLA chose is read, never guessed; `partition_specs` turns the
layouts of saved activations into the specs the backward is lowered with.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from tpu_inductor.exc import DeviceError

log = logging.getLogger(__name__)


def topology_order(devices: Sequence, shape: Sequence[int]) -> tuple:
    """`devices` in the row-major order of a mesh of `shape` that follows the chips' links:
    jax's `mesh_utils.create_device_mesh` (on a TPU slice, neighbours along each axis share
    ICI links, so the last axes, tensor parallel's, communicate fastest; elsewhere the order
    given). A shape it cannot map onto the topology keeps the order given, with the reason."""
    from jax.experimental import mesh_utils

    try:
        ordered = mesh_utils.create_device_mesh(tuple(shape), devices=list(devices))
    except (ValueError, AssertionError, NotImplementedError) as error:
        log.info("tpu_inductor: mesh %s kept in jax.devices() order: %s", tuple(shape), error)
        return tuple(devices)
    return tuple(ordered.flat)


def argument_shardings(device, lowered, executable) -> tuple:
    """Per module argument of `lowered` (its tensor arguments, then its seed), the jax sharding
    that splits it over `device`'s mesh, as the executable has it (the partitioner chose the
    open ones): all None for a module on one device."""
    split = lowered.shardings
    if split is None and not device.mesh:
        return (None,) * (len(lowered.tensor_inputs) + 1)
    if split is None or tuple(split.axes) != device.axes:
        raise DeviceError(
            f"tpu_inductor: a module for mesh {split and dict(split.axes)} cannot run on "
            f"{device}: load an artifact with tpu_inductor.aot.loader.load, which takes its mesh's devices."
        )
    count = len(lowered.tensor_inputs) + lowered.uses_rng
    chosen = _shardings_of(device, executable.get_parameter_shardings(), count)
    if lowered.uses_rng:  # the seed is the module's first argument; ours last
        chosen = (*chosen[1:], chosen[0])
    return chosen


def result_shardings(device, lowered, executable) -> tuple | None:
    """Per module result, its jax sharding over `device`'s mesh (None on one device)."""
    if not device.mesh:
        return None
    return _shardings_of(device, executable.get_output_shardings(), len(lowered.output_specs))


def _shardings_of(device, op_shardings, count: int) -> tuple:
    """jax shardings of an executable's `count` parameters or results over `device`'s mesh
    (PJRT reports none for a mesh of one device: all whole)."""
    from jax._src.sharding_impls import GSPMDSharding

    if op_shardings is None:
        return (GSPMDSharding.get_replicated(device.mesh),) * count
    return tuple(GSPMDSharding(device.mesh, op) for op in op_shardings)


def partition_specs(axes, shardings: Mapping[int, object]) -> dict[int, tuple]:
    """Each sharding of `shardings` over a mesh of `axes` as a partition spec (per dim, one mesh
    axis or None); one that splits a dim over several axes is left out."""
    from jax._src.sharding_impls import parse_flatten_op_sharding
    from jax.sharding import AbstractMesh

    mesh = AbstractMesh(tuple(n for _, n in axes), tuple(a for a, _ in axes))
    specs = {}
    for index, sharding in shardings.items():
        (spec,) = parse_flatten_op_sharding(sharding._hlo_sharding, mesh)
        dims = [axis[0] if isinstance(axis, tuple) and len(axis) == 1 else axis for axis in spec]
        if all(axis is None or isinstance(axis, str) for axis in dims):
            specs[index] = tuple(dims)
    return specs


def exact_dtypes():
    """A scope in which jax keeps 64-bit host values 64-bit (it narrows them by default): the
    arguments are already in the module's dtypes."""
    import jax

    enable_x64 = getattr(jax, "enable_x64", None)
    if enable_x64 is None:  # older jax: the same State object, not yet re-exported
        from jax._src.config import enable_x64
    return enable_x64(True)
