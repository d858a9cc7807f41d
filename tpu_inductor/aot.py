"""Offline (ahead-of-time) compilation: a model → an artifact directory that runs without Python.

`compile_model` exports a model with torch.export (core ATen, parameters lifted to inputs), runs
the pass pipeline and lowers it once per bucket (each combination of `--bucket` sizes), for a
PJRT platform that need not be present here. The directory holds:

    manifest.json                 inputs (names, dtypes, symbolic shapes), buckets, versions,
                                  platform, each bucket's call description, a sha256 per file
    weights.safetensors           parameters, buffers and constants, by name
    buckets/<n>/module.mlir       StableHLO text (for people)
    buckets/<n>/module.stablehlo  versioned portable StableHLO (what a host compiles)
    buckets/<n>/executable.bin    the PJRT executable, when the platform is present here

`load(directory)` returns a callable that checks its inputs against the manifest and runs the
bucket they match, without Dynamo or tracing. A damaged file or an incompatible version is an
ArtifactError that names the file and says what to do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import itertools
import json
import logging
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from . import __version__, runtime, serialize
from .exc import ArtifactError, InputMismatchError, OptionError, UnsupportedOpError

log = logging.getLogger(__name__)

FORMAT = 1  # the artifact layout version this module writes and reads
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
# Our platform names → the device option that runs them here.
_DEVICE_OF_PLATFORM = {"cpu": "cpu", "cuda": "gpu", "tpu": "tpu"}
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


# ---------------------------------------------------------------------------------------------
# compile


def load_target(target: str) -> torch.nn.Module:
    """A model from `module:factory` (the factory returns an nn.Module) or a saved .pt2 program."""
    if target.endswith(".pt2") and Path(target).is_file():
        return torch.export.load(target).module()
    module_name, _, factory_name = target.partition(":")
    if not factory_name:
        raise OptionError(
            f"tpu-inductor: target {target!r} is neither module:factory nor a .pt2 file."
        )
    factory = getattr(importlib.import_module(module_name), factory_name, None)
    if factory is None:
        raise OptionError(f"tpu-inductor: module {module_name!r} has no {factory_name!r}.")
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise OptionError(
            f"tpu-inductor: {target} returned {type(model).__name__}; it must return an nn.Module."
        )
    return model


def compile_model(
    model: torch.nn.Module,
    inputs: Sequence[InputSpec],
    out: str | Path,
    *,
    buckets: dict[str, Sequence[int]] | None = None,
    platform: str | None = None,
    x64: str = "keep",
    command: str = "",
    progress: Callable[[int, int, str], None] | None = None,
) -> Path:
    """Compile `model` (put in eval mode) for every bucket into the artifact directory `out`.

    `platform`: "cpu", "cuda" or "tpu" (default: the best one here). Executables are included
    when that platform is present here. Returns the manifest's path.
    """
    buckets = {k: tuple(v) for k, v in (buckets or {}).items()}
    platform = platform or runtime.select_device("auto").lowering_platform
    if platform not in _DEVICE_OF_PLATFORM:
        raise OptionError(f"tpu-inductor: platform {platform!r}; choose cpu, cuda or tpu.")
    _check_dims(inputs, buckets)
    device = _device_here(platform)
    out = Path(out)
    (out / "buckets").mkdir(parents=True, exist_ok=True)
    model = model.eval()
    combos = [dict(zip(buckets, sizes)) for sizes in itertools.product(*buckets.values())]
    weights: dict[str, torch.Tensor] = {}
    entries, out_spec = [], None
    for number, sizes in enumerate(combos):
        label = " ".join(f"{k}={v}" for k, v in sizes.items()) or "static shapes"
        if progress:
            progress(number, len(combos), label)
        start = time.perf_counter()
        entry, out_spec = _compile_bucket(
            model, inputs, sizes, out / "buckets" / str(number), platform, device, x64, weights
        )
        entries.append(entry)
        log.info("tpu-inductor: compiled bucket %s in %.1fs", label, time.perf_counter() - start)
    if progress:
        progress(len(combos), len(combos), "done")
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().clone() for k, v in weights.items()}, out / WEIGHTS)
    return _write_manifest(out, inputs, buckets, entries, out_spec, platform, x64, command)


def _check_dims(inputs: Sequence[InputSpec], buckets: dict[str, tuple[int, ...]]) -> None:
    used = {d for spec in inputs for d in spec.shape if isinstance(d, str)}
    if used - set(buckets):
        raise OptionError(
            f"tpu-inductor: dims {sorted(used - set(buckets))} have no --bucket; give their "
            "sizes, e.g. --bucket S=16,32,64."
        )
    if set(buckets) - used:
        raise OptionError(f"tpu-inductor: --bucket {sorted(set(buckets) - used)} unused by inputs.")


def _device_here(platform: str) -> runtime.Device | None:
    device_name = _DEVICE_OF_PLATFORM[platform]
    if device_name in runtime.available_platforms():
        return runtime.select_device(device_name)
    log.info("tpu-inductor: no %s device here: StableHLO only, no executables", platform)
    return None


def _compile_bucket(model, inputs, sizes, directory: Path, platform, device, x64, weights):
    from torch._decomp import core_aten_decompositions
    from torch.export.graph_signature import InputKind, OutputKind
    from torch.utils._pytree import treespec_dumps

    from .lowering import interpreter, stablehlo
    from .passes import pipeline

    examples = tuple(torch.zeros(s.concrete(sizes), dtype=s.dtype) for s in inputs)
    program = torch.export.export(model, examples, strict=False)
    program = program.run_decompositions(core_aten_decompositions())
    signature = program.graph_signature
    odd = [o for o in signature.output_specs if o.kind is not OutputKind.USER_OUTPUT]
    if odd:
        raise ArtifactError(
            f"tpu-inductor: the model mutates {[o.target for o in odd]} when called; an "
            "artifact cannot carry state. Compile a model without in-place buffer updates."
        )
    graph_inputs, flat, user = [], [], iter(zip(inputs, examples))
    state = {**program.state_dict, **program.constants}
    for spec in signature.input_specs:
        if spec.kind is InputKind.USER_INPUT:
            named, example = next(user)
            graph_inputs.append({"input": named.name})
            flat.append(example)
        else:
            weights[spec.target] = state[spec.target]
            graph_inputs.append({"weight": spec.target})
            flat.append(state[spec.target])
    gm = program.graph_module
    missing = interpreter.missing_ops(gm, platform)
    if missing:
        raise UnsupportedOpError(
            f"tpu-inductor: these ATen ops have no lowering for {platform}: {sorted(missing)}; "
            "an artifact cannot fall back to eager torch."
        )
    gm = pipeline.run_passes(gm)
    lowered = stablehlo.lower(gm, flat, platform=platform, x64=x64)
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "module.mlir": lowered.text.encode(),
        "module.stablehlo": _portable(lowered.bytecode),
    }
    if device is not None:
        executable = runtime.compile_stablehlo(lowered.bytecode, device)
        files["executable.bin"] = runtime.serialize_executable(executable, device)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    entry = {
        "sizes": sizes,
        "graph_inputs": graph_inputs,
        "lowered": serialize.lowered_to_json(lowered),
        "executable": _executable_tag(device) if device is not None else None,
    }
    return entry, treespec_dumps(program.call_spec.out_spec)


def _portable(bytecode: bytes) -> bytes:
    """A StableHLO portable artifact (versioned bytecode; see openxla/stablehlo compatibility)."""
    from jax._src.lib import _jax
    from jax._src.lib.mlir.dialects import hlo

    target = hlo.get_version_from_compatibility_requirement(
        hlo.StablehloCompatibilityRequirement.WEEK_4
    )
    return _jax.mlir.serialize_portable_artifact(bytecode, target, False)


def _executable_tag(device: runtime.Device) -> dict[str, str]:
    """What a serialized executable depends on: it is loaded only where all of it matches."""
    import jaxlib

    return {
        "jaxlib": jaxlib.__version__,
        "pjrt_platform_version": device.client.platform_version,
        "device_kind": device.kind,
    }


def _write_manifest(out, inputs, buckets, entries, out_spec, platform, x64, command) -> Path:
    import jax

    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        "format": FORMAT,
        "platform": platform,
        "x64": x64,
        "versions": {
            "tpu_inductor": __version__,
            "torch": torch.__version__,
            "jax": jax.__version__,
        },
        "inputs": [
            {"name": s.name, "dtype": serialize.dtype_name(s.dtype), "shape": list(s.shape)}
            for s in inputs
        ],
        "buckets": {k: list(v) for k, v in buckets.items()},
        "entries": entries,
        "out_spec": out_spec,
        "files": {str(p.relative_to(out)): _file_sha256(p) for p in files},
        "command": command,
    }
    path = out / MANIFEST
    path.write_text(json.dumps(manifest, indent=1))
    return path


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# load


class Artifact:
    """A loaded artifact: call it with the model's inputs (positional or by name)."""

    def __init__(self, directory: Path, manifest: dict, device: runtime.Device):
        self.directory = directory
        self.manifest = manifest
        self.device = device
        self.inputs = tuple(
            InputSpec(i["name"], serialize.dtype_from_name(i["dtype"]), tuple(i["shape"]))
            for i in manifest["inputs"]
        )
        from safetensors.torch import load_file

        self.weights = _guarded(directory / WEIGHTS, lambda: load_file(directory / WEIGHTS))
        self._compiled: dict[int, runtime.CompiledGraph] = {}
        from torch.utils._pytree import treespec_loads

        self._out_spec = treespec_loads(manifest["out_spec"])

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor):
        values = self._bind(args, kwargs)
        number = self._bucket_of(values)
        entry = self.manifest["entries"][number]
        flat = [
            self.weights[g["weight"]] if "weight" in g else values[g["input"]]
            for g in entry["graph_inputs"]
        ]
        compiled = self._compiled.get(number) or self._load_bucket(number)
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten(compiled(flat), self._out_spec)

    def _bind(self, args, kwargs) -> dict[str, torch.Tensor]:
        names = [s.name for s in self.inputs]
        if len(args) > len(names) or set(kwargs) - set(names):
            raise InputMismatchError(
                f"tpu_inductor: the artifact {self.directory} takes inputs {names}; got "
                f"{len(args)} positional and {sorted(kwargs)} by name."
            )
        values = dict(zip(names, args), **kwargs)
        absent = [n for n in names if n not in values]
        if absent:
            raise InputMismatchError(f"tpu_inductor: missing inputs {absent} (expects {names}).")
        return values

    def _bucket_of(self, values: dict[str, torch.Tensor]) -> int:
        entries = self.manifest["entries"]
        for number, entry in enumerate(entries):
            if all(_matches(values[s.name], s, entry["sizes"]) for s in self.inputs):
                return number
        spec = next(s for s in self.inputs if not _fits_any(values[s.name], s, entries))
        got = values[spec.name]
        actual = (
            f"{serialize.dtype_name(got.dtype)}{list(got.shape)}"
            if isinstance(got, torch.Tensor)
            else type(got).__name__
        )
        expected = " or ".join(
            dict.fromkeys(
                f"{serialize.dtype_name(spec.dtype)}{list(spec.concrete(e['sizes']))}"
                for e in entries
            )
        )
        raise InputMismatchError(
            f"tpu_inductor: input {spec.name!r} expected {expected} (spec {spec}), got {actual}. "
            "Pass a matching tensor, or recompile with the shapes you need (--bucket)."
        )

    def _load_bucket(self, number: int) -> runtime.CompiledGraph:
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
                lambda: runtime.deserialize_executable(
                    (folder / "executable.bin").read_bytes(), self.device, bytecode
                ),
            )
        else:
            log.info(
                "tpu_inductor: compiling %s for %s (no matching executable)", folder, self.device
            )
            executable = runtime.compile_stablehlo(bytecode, self.device)
        static = [i for i, g in enumerate(entry["graph_inputs"]) if "weight" in g]
        compiled = runtime.CompiledGraph(executable, lowered, self.device, static)
        self._compiled[number] = compiled
        return compiled


def _matches(value, spec: InputSpec, sizes: dict[str, int]) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == spec.dtype
        and tuple(value.shape) == spec.concrete(sizes)
    )


def _fits_any(value, spec: InputSpec, entries) -> bool:
    return any(_matches(value, spec, e["sizes"]) for e in entries)


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
    except Exception as e:  # a damaged file fails in the reader's own way
        raise ArtifactError(
            f"tpu_inductor: cannot read {path}: {type(e).__name__}: {e}. The artifact is damaged "
            "or from an incompatible version: rebuild it with `tpu-inductor compile` (the "
            "command is in manifest.json) using this tpu_inductor version."
        ) from e


def load(directory: str | Path, device: str = "auto") -> Artifact:
    """Load an artifact directory; every file's checksum is verified first."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for name, digest in manifest["files"].items():
        path = directory / name
        if not path.is_file() or _file_sha256(path) != digest:
            raise ArtifactError(
                f"tpu_inductor: {path} is {'missing' if not path.is_file() else 'damaged'} "
                "(checksum mismatch with manifest.json). Rebuild the artifact with "
                f"`{manifest.get('command') or 'tpu-inductor compile ...'}`."
            )
    here = runtime.select_device(device)
    if here.lowering_platform != manifest["platform"]:
        raise ArtifactError(
            f"tpu_inductor: {directory} was built for {manifest['platform']!r}, this process "
            f"runs on {here.lowering_platform!r}. Run it on a {manifest['platform']} host or "
            f"rebuild it with --platform {here.lowering_platform}."
        )
    return _guarded(directory / MANIFEST, lambda: Artifact(directory, manifest, here))


def read_manifest(directory: Path) -> dict:
    """The parsed manifest, with its format checked (ArtifactError otherwise)."""
    path = directory / MANIFEST
    manifest = _guarded(path, lambda: json.loads(path.read_text()))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ArtifactError(
            f"tpu_inductor: {path} has artifact format {found!r}; this tpu_inductor "
            f"({__version__}) reads format {FORMAT}. Rebuild the artifact with this version "
            "(`tpu-inductor compile`), or load it with the version that wrote it."
        )
    return manifest


# ---------------------------------------------------------------------------------------------
# `tpu-inductor compile | run | inspect`


def add_subcommands(commands) -> None:
    """Add `compile`, `run` and `inspect` to the `tpu-inductor` parser."""
    comp = commands.add_parser("compile", help="compile a model ahead of time into a directory")
    comp.add_argument("target", help="module:factory (returns an nn.Module) or a saved .pt2")
    comp.add_argument("--input", action="append", required=True, metavar="NAME:DTYPE[SHAPE]")
    comp.add_argument("--bucket", action="append", default=[], metavar="DIM=A,B,C")
    comp.add_argument("--platform", choices=sorted(_DEVICE_OF_PLATFORM))
    comp.add_argument("--x64", choices=("keep", "narrow"), default="keep")
    comp.add_argument("--out", required=True)
    comp.set_defaults(run=_cli_compile)
    run = commands.add_parser("run", help="run an artifact on inputs from an .npz file")
    run.add_argument("directory")
    run.add_argument("--input", required=True, help=".npz file with one array per input name")
    run.add_argument("--out", help="write the outputs to this .npz file")
    run.set_defaults(run=_cli_run)
    inspect = commands.add_parser("inspect", help="describe an artifact directory")
    inspect.add_argument("directory")
    inspect.set_defaults(run=_cli_inspect)


def _cli_compile(args) -> int:
    if "" not in sys.path:
        sys.path.insert(0, "")  # module:factory targets are found from the current directory
    inputs = [parse_input(text) for text in args.input]
    buckets = dict(parse_bucket(text) for text in args.bucket)

    def progress(done: int, total: int, label: str) -> None:
        bar = "#" * (20 * done // total) + "." * (20 - 20 * done // total)
        print(
            f"\r[{bar}] {done}/{total} {label:<30}",
            end="\n" if done == total else "",
            file=sys.stderr,
            flush=True,
        )

    path = compile_model(
        load_target(args.target),
        inputs,
        args.out,
        buckets=buckets,
        platform=args.platform,
        x64=args.x64,
        command=shlex.join(["tpu-inductor", *sys.argv[1:]]),
        progress=progress,
    )
    print(f"wrote {path.parent}")
    return 0


def _cli_run(args) -> int:
    import numpy as np

    artifact = load(args.directory)
    with np.load(args.input) as data:
        values = {name: torch.from_numpy(data[name]) for name in data.files}
    from torch.utils._pytree import tree_flatten

    outputs, _ = tree_flatten(artifact(**values))
    for number, out in enumerate(outputs):
        print(f"output {number}: {serialize.dtype_name(out.dtype)}{list(out.shape)}")
    if args.out:
        np.savez(args.out, *[o.detach().numpy() for o in outputs])
        print(f"wrote {args.out}")
    return 0


def _cli_inspect(args) -> int:
    directory = Path(args.directory)
    manifest = read_manifest(directory)
    print(f"artifact:  {directory}  (format {manifest['format']})")
    print(f"platform:  {manifest['platform']}   x64: {manifest['x64']}")
    print("versions:  " + ", ".join(f"{k} {v}" for k, v in manifest["versions"].items()))
    for spec in manifest["inputs"]:
        print(f"input:     {spec['name']}: {spec['dtype']}{spec['shape']}")
    for number, entry in enumerate(manifest["entries"]):
        outs = ", ".join(f"{s['dtype']}{s['shape']}" for s in entry["lowered"]["output_specs"])
        exe = "executable" if entry["executable"] else "StableHLO only"
        print(f"bucket {number}:  {entry['sizes'] or 'static'} → {outs}  ({exe})")
    total = sum((directory / name).stat().st_size for name in manifest["files"])
    print(f"files:     {len(manifest['files'])}, {total / 2**20:.1f} MiB")
    return 0
