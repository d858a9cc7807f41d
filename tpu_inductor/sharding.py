"""Device meshes and sharding plans: which inputs are split over which mesh axes.

A mesh is named axes of devices (`data=4`, or `data=2,model=4`); a plan gives each input a
partition spec: per dim, the mesh axis it is split over, or none. The lowering turns the plan
into sharding annotations on the module's arguments, and XLA's SPMD partitioner (Shardy) splits
the computation and inserts the collectives: nothing here schedules communication.

Used by the ahead-of-time compiler (`tpu-inductor compile --mesh data=8 [--shard x:data,-]`).
Without `--shard`, every input is split over the mesh's first axis along its first dim (data
parallelism) and weights are replicated.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from .exc import OptionError

_AXIS = re.compile(r"^[A-Za-z_]\w*$")


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Named mesh axes and their sizes, in order (devices are laid out row-major)."""

    axes: tuple[tuple[str, int], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    def __str__(self) -> str:
        return ",".join(f"{name}={size}" for name, size in self.axes)


def parse_mesh(text: str) -> Mesh:
    """`data=4` or `data=2,model=4` → a Mesh."""
    axes = []
    for part in text.split(","):
        name, _, size = part.strip().partition("=")
        if not _AXIS.match(name) or not (size.isascii() and size.isdigit()) or int(size) < 1:
            raise OptionError(
                f"tpu-inductor: --mesh {text!r}: each axis is NAME=SIZE with a positive size, "
                "e.g. --mesh data=8 or --mesh data=2,model=4."
            )
        axes.append((name, int(size)))
    names = [name for name, _ in axes]
    if len(set(names)) != len(names):
        raise OptionError(f"tpu-inductor: --mesh {text!r} names an axis twice.")
    return Mesh(tuple(axes))


def parse_shard(text: str) -> tuple[str, tuple[str | None, ...]]:
    """`x:data,-` → ("x", ("data", None)): input x's first dim split over axis data, its second
    whole; `x:` (nothing after the colon) keeps x whole on every device."""
    name, colon, spec = text.partition(":")
    if not colon or not _AXIS.match(name):
        raise OptionError(
            f"tpu-inductor: --shard {text!r}: expected NAME:SPEC, SPEC a mesh axis or - per dim "
            "(e.g. --shard x:data,- splits x's first dim over axis data; x: replicates x)."
        )
    dims = [d.strip() for d in spec.split(",")] if spec else []
    return name, tuple(None if d == "-" else d for d in dims)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A mesh and the partition specs given for some inputs (`--shard`), by input name."""

    mesh: Mesh
    shards: tuple[tuple[str, tuple[str | None, ...]], ...] = ()

    def __post_init__(self) -> None:
        names = [name for name, _ in self.shards]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise OptionError(f"tpu-inductor: --shard is given more than once for {twice}.")

    def specs(self, inputs: Mapping[str, Sequence[int]]) -> dict[str, tuple[str | None, ...]]:
        """Each input's partition spec (input name → its shape): see `partition_specs`."""
        return partition_specs(self.mesh, inputs, dict(self.shards))


def partition_specs(
    mesh: Mesh,
    inputs: Mapping[str, Sequence[int]],
    shards: Mapping[str, tuple[str | None, ...]],
) -> dict[str, tuple[str | None, ...]]:
    """Each input's partition spec (input name → its shape): from `shards`, else its first dim
    over the mesh's first axis (an input without dims stays whole). Checked: axes exist, each
    used once per input, and divide the dims they split."""
    unknown = set(shards) - set(inputs)
    if unknown:
        raise OptionError(
            f"tpu-inductor: --shard names {sorted(unknown)}, which are not inputs "
            f"({', '.join(inputs)})."
        )
    sizes = dict(mesh.axes)
    specs = {}
    for name, shape in inputs.items():
        default = (mesh.names[0],) if shape else ()
        spec = shards.get(name, default)
        where = f"input {name} (shape {list(shape)})"
        if len(spec) > len(shape):
            raise OptionError(f"tpu-inductor: --shard for {where} gives {len(spec)} dims.")
        used = [axis for axis in spec if axis is not None]
        if set(used) - set(sizes) or len(set(used)) != len(used):
            raise OptionError(
                f"tpu-inductor: the sharding {spec} of {where} must use axes of the mesh "
                f"({mesh}), each at most once."
            )
        for dim, axis in enumerate(spec):
            if axis is not None and shape[dim] % sizes[axis]:
                raise OptionError(
                    f"tpu-inductor: {where}: dim {dim} ({shape[dim]}) does not divide over mesh "
                    f"axis {axis} ({sizes[axis]} devices). Choose sizes that divide, or keep "
                    f"the dim whole with --shard {name}:{','.join('-' for _ in shape)}."
                )
        specs[name] = tuple(spec)
    return specs
