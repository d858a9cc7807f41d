"""Device meshes and partition specs: named axes of devices (`Mesh({"data": 2, "model": 4})`)
and, per dim of a tensor, the mesh axis it is split over, or None. The bottom of the sharding
room: passes and lowering import it. The ahead-of-time compiler's plans (`tpu-inductor compile
--mesh data=8 [--shard x:data,-]`) are `Plan`: without `--shard`, every input is split over the
mesh's first axis along its first dim (data parallelism) and weights are replicated.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from tpu_inductor.exc import OptionError

_AXIS = re.compile(r"^[A-Za-z_]\w*$")


Spec = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True, init=False)
class Mesh:
    """Named mesh axes and their sizes, in order (devices are laid out row-major):
    `Mesh({"data": 2, "model": 4})` or `Mesh((("data", 2), ("model", 4)))`."""

    axes: tuple[tuple[str, int], ...]

    def __init__(self, axes: Mapping[str, int] | Sequence[tuple[str, int]]):
        items = tuple(axes.items()) if isinstance(axes, Mapping) else tuple(map(tuple, axes))
        for item in items:
            name, size = item if len(item) == 2 else (item, None)
            if (
                not (isinstance(name, str) and _AXIS.match(name))
                or type(size) is not int
                or size < 1
            ):
                raise OptionError(
                    f"tpu_inductor: Mesh({axes!r}): each axis is a name and a positive size, "
                    'e.g. Mesh({"data": 2, "model": 4}).'
                )
        names = [name for name, _ in items]
        if not items or len(set(names)) != len(names):
            raise OptionError(f"tpu_inductor: Mesh({axes!r}) needs axes, each named once.")
        object.__setattr__(self, "axes", items)

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
    specs = {}
    for name, shape in inputs.items():
        spec = tuple(shards.get(name, (mesh.names[0],) if shape else ()))
        whole = f"keep the dim whole with --shard {name}:{','.join('-' for _ in shape)}"
        check_spec(mesh, shape, spec, f"input {name}", whole, prefix="tpu-inductor")
        specs[name] = spec
    return specs


def check_spec(
    mesh: Mesh,
    shape: Sequence[int],
    spec: Spec,
    what: str,
    whole: str = "keep the dim whole (None in its place)",
    prefix: str = "tpu_inductor",
) -> None:
    """An OptionError naming `what` (its shape and the mesh) unless `spec` is a partition spec
    of `shape` on `mesh`: at most one entry per dim, axes of the mesh used once each, and each
    dividing the dim it splits (`whole`: how to keep a dim whole, for the message)."""
    where = f"{what} (shape {list(shape)})"
    if len(spec) > len(shape):
        raise OptionError(
            f"{prefix}: the sharding {spec} of {where} gives {len(spec)} dims; it has {len(shape)}."
        )
    sizes = dict(mesh.axes)
    used = [axis for axis in spec if axis is not None]
    if set(used) - set(sizes) or len(set(used)) != len(used):
        raise OptionError(
            f"{prefix}: the sharding {spec} of {where} must use axes of the mesh ({mesh}), each "
            "at most once."
        )
    for dim, axis in enumerate(spec):
        if axis is not None and isinstance(shape[dim], int) and shape[dim] % sizes[axis]:
            raise OptionError(
                f"{prefix}: {where}: dim {dim} ({shape[dim]}) does not divide over mesh axis "
                f"{axis} ({sizes[axis]} devices) of mesh {mesh}. Choose sizes that divide, or "
                f"{whole}."
            )


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a tensor lives: split over `mesh` by `spec` (an empty spec: whole on every device)."""

    mesh: Mesh
    spec: Spec


def common_mesh(placements: Sequence[Placement | None]) -> Mesh | None:
    """The one mesh of `placements` (None: none placed); an OptionError for two meshes."""
    meshes = {p.mesh for p in placements if p is not None}
    if len(meshes) > 1:
        raise OptionError(
            f"tpu_inductor: one compiled graph reads tensors placed on different meshes "
            f"({', '.join(sorted(map(str, meshes)))}); place them all on one mesh."
        )
    return next(iter(meshes), None)
