"""The artifact format: its directory layout and manifest version, the input specs
(`x:float32[B,16]`) and bucket sizes it is compiled for, and what its files are checked by.

Offline (ahead-of-time) compilation turns a model into an artifact directory that runs without
Python (aot/compile.py), and `load` runs one (aot/loader.py).

`compile_model` exports a model with torch.export (core ATen, parameters lifted to inputs) once
per bucket (each combination of `--bucket` sizes) and compiles each graph through torch.compile's
own stages (`compile_fx.compile_artifact_graph`: passes, lowering, the compile cache, dumps),
for a PJRT platform that need not be present here. The directory holds:

    manifest.json                 inputs (names, dtypes, symbolic shapes), buckets, versions,
                                  platform, each bucket's call description, a sha256 per file
    weights.safetensors           parameters, buffers and constants, by name
    buckets/<n>/module.mlir       StableHLO text (for people)
    buckets/<n>/module.stablehlo  versioned portable StableHLO (what a host compiles)
    buckets/<n>/executable.bin    the PJRT executable, when the platform is present here

With a mesh (`--mesh data=8`, `--shard NAME:SPEC`; see sharding.py), each module takes its
inputs split over the mesh's devices and returns its results whole on every device; the manifest
records the mesh and each bucket's partition specs, and `load` needs that many devices.

"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import torch

from tpu_inductor.cache import serialize
from tpu_inductor.exc import OptionError
from tpu_inductor.runtime import devices

FORMAT = 3  # the artifact layout version compile.py writes and loader.py reads (3: padded buckets)
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
PLATFORMS = tuple(devices.LOWERING_PLATFORMS.values())  # what --platform may name
_SPEC = re.compile(r"^(?P<name>[A-Za-z_]\w*):(?P<dtype>\w+)\[(?P<dims>[^\]]*)\]$")


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """A named model input: dtype and shape, where a dim may be a bucket name (e.g. "S")."""

    name: str
    dtype: torch.dtype
    shape: tuple[int | str, ...]

    def __str__(self) -> str:
        dims = ",".join(map(str, self.shape))
        return f"{self.name}:{serialize.dtype_name(self.dtype)}[{dims}]"

    def concrete(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.shape)


def parse_input(text: str) -> InputSpec:
    """`"ids:int64[8,S]"` → InputSpec; an OptionError that shows the expected form otherwise."""
    match = _SPEC.match(text.replace(" ", ""))
    try:
        if not match:
            raise ValueError("not of the form NAME:DTYPE[D0,D1,...]")
        dims = [d for d in match["dims"].split(",") if d]
        shape = tuple(int(d) if d.isdigit() else _dim_name(d) for d in dims)
        return InputSpec(match["name"], serialize.dtype_from_name(match["dtype"]), shape)
    except ValueError as e:
        raise OptionError(
            f"tpu-inductor: bad --input {text!r}: {e}. Example: --input ids:int64[8,S] "
            "(a named dim needs --bucket S=...)."
        ) from None


def parse_bucket(text: str) -> tuple[str, tuple[int, ...]]:
    """`"S=16,32,64"` → ("S", (16, 32, 64))."""
    name, _, sizes = text.partition("=")
    try:
        values = tuple(int(v) for v in sizes.split(","))
        if not values or min(values) < 1:
            raise ValueError
        return _dim_name(name.strip()), values
    except ValueError:
        raise OptionError(
            f"tpu-inductor: bad --bucket {text!r}; expected NAME=SIZE,SIZE,... e.g. S=16,32,64."
        ) from None


def _dim_name(text: str) -> str:
    if not text.isidentifier():
        raise ValueError(f"dim {text!r} is neither a size nor a name")
    return text


def _executable_tag(device: devices.Device) -> dict[str, str]:
    """What a serialized executable depends on: it is loaded only where all of it matches."""
    import jaxlib

    tag = {
        "jaxlib": jaxlib.__version__,
        "pjrt_platform_version": device.client.platform_version,
        "device_kind": device.kind,
    }
    if device.mesh:
        tag["devices"] = str(len(device.mesh))
    return tag


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
