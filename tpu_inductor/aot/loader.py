"""Loading and running an artifact: `load(directory)` reads and checks its manifest and returns
an `Artifact`, a callable that checks its inputs against the manifest and runs the bucket they
match, without Dynamo or tracing. A damaged file or an incompatible version is an
ArtifactError that names the file and says what to do.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tpu_inductor.aot import buckets as aot_buckets
from tpu_inductor.aot.artifact import (
    FORMAT,
    MANIFEST,
    WEIGHTS,
    InputSpec,
    _executable_tag,
    _file_sha256,
)
from tpu_inductor.cache import serialize
from tpu_inductor.exc import ArtifactError, DeviceError, InputMismatchError
from tpu_inductor.runtime import compiled_graph, devices
from tpu_inductor.version import __version__

log = logging.getLogger(__name__)


class Artifact:
    """A loaded artifact: call it with the model's inputs (positional or by name)."""

    def __init__(self, directory: Path, manifest: dict, device: devices.Device, pad_with="zeros"):
        self.directory = directory
        self.manifest = manifest
        self.device = device
        self.inputs = tuple(
            InputSpec(i["name"], serialize.dtype_from_name(i["dtype"]), tuple(i["shape"]))
            for i in manifest["inputs"]
        )
        from safetensors.torch import load_file

        self.weights = _guarded(directory / WEIGHTS, lambda: load_file(directory / WEIGHTS))
        named = {
            g["weight"] for e in manifest["entries"] for g in e["graph_inputs"] if "weight" in g
        }
        absent = sorted(named - set(self.weights))
        if absent:
            raise ArtifactError(
                f"tpu_inductor: {directory / WEIGHTS} lacks the weights {absent} that "
                f"{directory / MANIFEST} names. The artifact is damaged: rebuild it with "
                f"`{manifest['command'] or 'tpu-inductor compile ...'}`."
            )
        self._compiled: dict[int, compiled_graph.CompiledGraph] = {}
        from torch.utils._pytree import treespec_loads

        self._out_spec = treespec_loads(manifest["out_spec"])
        self._selector = aot_buckets.Selector(self.inputs, manifest, directory)
        self.pad_with = pad_with  # what fills the padding of padded buckets ("zeros", "nan", "inf")

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor):
        values = self._bind(args, kwargs)
        number = self._selector.entry_of(values)
        entry = self.manifest["entries"][number]
        flat = [
            self.weights[g["weight"]] if "weight" in g else values[g["input"]]
            for g in entry["graph_inputs"]
        ]
        compiled = self._compiled.get(number) or self._load_bucket(number)
        if entry.get("padded"):
            outs = self._selector.run(compiled, flat, entry["sizes"], self.pad_with)
        else:
            outs = compiled(flat)
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten(outs, self._out_spec)

    def _bind(self, args, kwargs) -> dict[str, torch.Tensor]:
        names = [s.name for s in self.inputs]
        if len(args) > len(names) or set(kwargs) - set(names):
            raise InputMismatchError(
                f"tpu_inductor: the artifact {self.directory} takes inputs {names}; got "
                f"{len(args)} positional and {sorted(kwargs)} by name."
            )
        twice = [n for n in names[: len(args)] if n in kwargs]
        if twice:
            raise InputMismatchError(
                f"tpu_inductor: input {twice[0]!r} of the artifact {self.directory} is given "
                f"twice, by position and by name (inputs, in order: {names}); give it once."
            )
        values = dict(zip(names, args), **kwargs)
        absent = [n for n in names if n not in values]
        if absent:
            raise InputMismatchError(f"tpu_inductor: missing inputs {absent} (expects {names}).")
        return values

    def _load_bucket(self, number: int) -> compiled_graph.CompiledGraph:
        entry = self.manifest["entries"][number]
        folder = self.directory / "buckets" / str(number)
        text = _guarded(folder / "module.mlir", lambda: (folder / "module.mlir").read_text())
        bytecode = _guarded(folder / "module.stablehlo", lambda: _from_portable(folder))
        lowered = _guarded(
            self.directory / MANIFEST,
            lambda: serialize.lowered_from_json(entry["lowered"], bytecode, text),
        )
        executable = None
        if entry["executable"] == _executable_tag(self.device):
            executable = _guarded(
                folder / "executable.bin",
                lambda: devices.deserialize_executable(
                    (folder / "executable.bin").read_bytes(), self.device, bytecode
                ),
            )
        else:
            log.info(
                "tpu_inductor: compiling %s for %s (no matching executable)", folder, self.device
            )
            executable = devices.compile_stablehlo(bytecode, self.device)
        static = [i for i, g in enumerate(entry["graph_inputs"]) if "weight" in g]
        compiled = compiled_graph.CompiledGraph(executable, lowered, self.device, static)
        self._compiled[number] = compiled
        return compiled


def _from_portable(folder: Path) -> bytes:
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax

    with mlir.make_ir_context() as context:
        module = _jax.mlir.deserialize_portable_artifact(
            (folder / "module.stablehlo").read_bytes(), context
        )
        return mlir.module_to_bytecode(module)


def _guarded(path: Path, read: Callable[[], Any]):
    """Run `read`; any failure becomes an ArtifactError that names `path` and what to do."""
    try:
        return read()
    except ArtifactError:
        raise
    except OSError as e:  # absent or unreadable, not damaged
        raise ArtifactError(
            f"tpu_inductor: cannot read {path}: {e.strerror or e}. Check that it exists and that "
            "you may read it (its permissions and its directory's), or rebuild the artifact "
            "with `tpu-inductor compile`."
        ) from e
    except Exception as e:  # a damaged file fails in the reader's own way
        raise ArtifactError(
            f"tpu_inductor: cannot read {path}: {type(e).__name__}: {e}. The artifact is damaged "
            "or from an incompatible version: rebuild it with `tpu-inductor compile` (the "
            "command is in manifest.json) using this tpu_inductor version."
        ) from e


def load(directory: str | Path, device: str = "auto", *, pad_with: str = "zeros") -> Artifact:
    """Load an artifact directory; every file's checksum is verified first. `pad_with`: what
    fills the padding of a padded bucket ("nan" shows that none of it reaches a result)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for name, digest in manifest["files"].items():
        path = directory / name
        if not path.is_file() or _guarded(path, functools.partial(_file_sha256, path)) != digest:
            raise ArtifactError(
                f"tpu_inductor: {path} is {'missing' if not path.is_file() else 'damaged'} "
                "(checksum mismatch with manifest.json). Rebuild the artifact with "
                f"`{manifest.get('command') or 'tpu-inductor compile ...'}`."
            )
    here = devices.select_device(device)
    if here.lowering_platform == manifest["platform"] and manifest.get("mesh"):
        here = _mesh_here(here, manifest["mesh"])
    if here.lowering_platform != manifest["platform"]:
        raise ArtifactError(
            f"tpu_inductor: {directory} was built for {manifest['platform']!r}, this process "
            f"runs on {here.lowering_platform!r}. Run it on a {manifest['platform']} host or "
            f"rebuild it with --platform {here.lowering_platform}."
        )
    return _guarded(directory / MANIFEST, lambda: Artifact(directory, manifest, here, pad_with))


def _mesh_here(device: devices.Device, mesh: list) -> devices.Device:
    """The devices of `device`'s platform for an artifact's mesh ([[axis, size], ...], checked
    by `read_manifest`)."""
    try:
        return devices.mesh_device(device.platform, tuple(map(tuple, mesh)))
    except DeviceError as e:
        raise ArtifactError(f"{e} The artifact is split over that mesh.") from e


def read_manifest(directory: Path) -> dict:
    """The parsed manifest, with its format and fields checked (ArtifactError otherwise)."""
    path = directory / MANIFEST
    if not path.is_file():
        what = (
            "does not exist"
            if not directory.exists()
            else "is not a directory"
            if not directory.is_dir()
            else f"has no {MANIFEST}"
        )
        raise ArtifactError(
            f"tpu_inductor: {directory} is not an artifact directory: it {what}. Give the --out "
            "directory of a `tpu-inductor compile`."
        )
    manifest = _guarded(path, lambda: json.loads(path.read_text()))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ArtifactError(
            f"tpu_inductor: {path} has artifact format {found!r}; this tpu_inductor "
            f"({__version__}) reads format {FORMAT}. Rebuild the artifact with this version "
            "(`tpu-inductor compile`), or load it with the version that wrote it."
        )
    problem = _manifest_problem(manifest)
    if problem:
        command = manifest.get("command") if isinstance(manifest.get("command"), str) else None
        raise ArtifactError(
            f"tpu_inductor: {path} is malformed: {problem}. The artifact is damaged or was not "
            f"written by tpu_inductor: rebuild it with `{command or 'tpu-inductor compile ...'}`."
        )
    return manifest


_FIELDS = {
    "platform": str,
    "x64": str,
    "versions": dict,
    "inputs": list,
    "buckets": dict,
    "entries": list,
    "out_spec": str,
    "files": dict,
    "command": str,
}


def _manifest_problem(manifest: dict) -> str | None:
    """The first missing or ill-typed field of a parsed manifest, described; None if sound."""
    for field, kind in _FIELDS.items():
        if field not in manifest:
            return f"field {field!r} is missing"
        if not isinstance(manifest[field], kind):
            return f"field {field!r} is {manifest[field]!r:.60}, expected a {kind.__name__}"
    names, dims = set(), set()
    for number, spec in enumerate(manifest["inputs"]):
        if not (
            isinstance(spec, dict)
            and isinstance(spec.get("name"), str)
            and isinstance(spec.get("dtype"), str)
            and isinstance(spec.get("shape"), list)
            and all(type(d) in (int, str) for d in spec["shape"])
        ):
            return f"inputs[{number}] is {spec!r:.80}, expected {{name, dtype, shape}}"
        names.add(spec["name"])
        dims.update(d for d in spec["shape"] if isinstance(d, str))
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in manifest["files"].items()):
        return "field 'files' is not a map of file names to sha256 digests"
    if not manifest["entries"]:
        return "field 'entries' is empty"
    mesh = manifest.get("mesh")
    if mesh is not None and not (
        isinstance(mesh, list)
        and mesh
        and all(
            isinstance(a, list)
            and len(a) == 2
            and isinstance(a[0], str)
            and type(a[1]) is int
            and a[1] > 0
            for a in mesh
        )
        and len({a[0] for a in mesh}) == len(mesh)
    ):
        return f"field 'mesh' is {mesh!r:.60}, expected [[axis name, size], ...]"
    for number, entry in enumerate(manifest["entries"]):
        where = f"entries[{number}]"
        if not isinstance(entry, dict):
            return f"{where} is {entry!r:.60}, expected an object"
        sizes, graph_inputs = entry.get("sizes"), entry.get("graph_inputs")
        if (
            not isinstance(sizes, dict)
            or set(sizes) != dims
            or not all(type(v) is int for v in sizes.values())
        ):
            return f"{where}.sizes is {sizes!r:.60}, expected a size for each dim of {sorted(dims)}"
        if not isinstance(graph_inputs, list) or not all(
            isinstance(g, dict) and (g.get("input") in names or isinstance(g.get("weight"), str))
            for g in graph_inputs
        ):
            return f"{where}.graph_inputs is {graph_inputs!r:.60}, expected inputs and weights"
        lowered = entry.get("lowered")
        if not isinstance(lowered, dict) or not isinstance(lowered.get("output_specs"), list):
            return f"{where}.lowered is {lowered!r:.60}, expected a call description"
        if not all(
            isinstance(o, dict) and {"dtype", "shape"} <= set(o) for o in lowered["output_specs"]
        ):
            return f"{where}.lowered.output_specs is {lowered['output_specs']!r:.60}"
        split = lowered.get("shardings")
        if (split or {}).get("mesh") != mesh:
            return f"{where}.lowered.shardings is {split!r:.60}, not over the mesh {mesh!r:.60}"
        if "executable" not in entry or not isinstance(entry["executable"], (dict, type(None))):
            return f"{where}.executable is missing or {entry.get('executable')!r:.60}"
        if entry.get("padded", False) not in (True, False):
            return f"{where}.padded is {entry['padded']!r:.60}, expected true or false"
    return aot_buckets.padding_problem(manifest)
