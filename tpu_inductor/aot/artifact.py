"""Offline (ahead-of-time) compilation: a model → an artifact directory that runs without Python.

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

`compile_model` writes into a temporary directory next to `out` and moves it into place when
every bucket compiled: a failed compile leaves nothing, and a previous artifact at `out` is
replaced whole (a directory holding anything else is refused).

`load(directory)` returns a callable that checks its inputs against the manifest and runs the
bucket they match, without Dynamo or tracing. A damaged file or an incompatible version is an
ArtifactError that names the file and says what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import itertools
import json
import logging
import re
import time
import warnings
from collections.abc import Callable, Sequence
from inspect import Parameter, signature
from pathlib import Path
from typing import Any

import torch

from tpu_inductor import decompositions, files
from tpu_inductor.aot import buckets as aot_buckets
from tpu_inductor.cache import serialize
from tpu_inductor.config import Options
from tpu_inductor.exc import ArtifactError, DeviceError, InputMismatchError, OptionError
from tpu_inductor.runtime import compiled_graph, devices
from tpu_inductor.runtime.devices import device_option_of
from tpu_inductor.sharding.mesh import Plan
from tpu_inductor.version import __version__

log = logging.getLogger(__name__)

FORMAT = 3  # the artifact layout version this module writes and reads (3: padded buckets)
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


# ---------------------------------------------------------------------------------------------
# compile


def load_target(target: str) -> torch.nn.Module | torch.export.ExportedProgram:
    """A model from `module:factory` (the factory returns an nn.Module) or a saved .pt2 program."""
    if target.endswith(".pt2"):
        if not Path(target).is_file():
            raise OptionError(
                f"tpu-inductor: {target} does not exist (or is not a file); give the path of a "
                "program saved with torch.export.save, or a module:factory target."
            )
        return torch.export.load(target)
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
    model: torch.nn.Module | torch.export.ExportedProgram,
    inputs: Sequence[InputSpec],
    out: str | Path,
    *,
    buckets: dict[str, Sequence[int]] | None = None,
    platform: str | None = None,
    x64: str = "keep",
    plan: Plan | None = None,
    options: dict[str, Any] | None = None,
    command: str = "",
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Compile `model` for every bucket into the artifact directory `out`.

    `model`: an nn.Module (put in eval mode) or an ExportedProgram (its mode was fixed when it
    was exported). `out` must be new, empty or a previous artifact, which is replaced whole once
    the compile succeeds. `platform`: "cpu", "cuda" or "tpu" (default: the best one here).
    `plan`: split the inputs over a device mesh (see sharding.py). Executables are included
    when that platform (with a plan: as many of its devices as the mesh has) is present here.
    `options`: backend options (as torch.compile's; `TPU_INDUCTOR_*` give the defaults), for
    the compile cache, dumps and `disable_passes`: every bucket is compiled through
    `compile_fx.compile_artifact_graph`, torch.compile's stages. `progress(label)` is called as
    each bucket starts. Returns the manifest's path.
    """
    buckets = {k: tuple(v) for k, v in (buckets or {}).items()}
    platform = platform or devices.select_device("auto").lowering_platform
    if platform not in PLATFORMS:
        raise OptionError(f"tpu-inductor: platform {platform!r}; choose cpu, cuda or tpu.")
    options = Options.from_user(
        {**(options or {}), "x64": x64, "fallback": "error", "device": device_option_of(platform)}
    )
    if isinstance(model, torch.export.ExportedProgram):
        model = model.module()  # eval() raises on it: the mode was fixed by the export
    else:
        model = model.eval()
    _check_inputs(model, inputs)
    _check_dims(inputs, buckets)
    out = Path(out)
    _check_out(out)
    device = _device_here(platform, plan)
    with files.staged_directory(out) as staging:
        build = _Build(inputs, platform, device, options, plan)
        _compile_into(model, build, staging, buckets, command, progress)
    return out / MANIFEST


@dataclasses.dataclass(frozen=True)
class _Build:
    """What every bucket of one artifact is compiled with."""

    inputs: Sequence[InputSpec]
    platform: str
    device: devices.Device | None  # None: StableHLO only
    options: Options
    plan: Plan | None


def _compile_into(model, build: _Build, out: Path, buckets, command, progress):
    (out / "buckets").mkdir()
    combos = [dict(zip(buckets, sizes)) for sizes in itertools.product(*buckets.values())]
    weights: dict[str, torch.Tensor] = {}
    padding, padded = _padded_graph(model, build, buckets, weights)
    entries, out_spec = [], None
    for number, sizes in enumerate(combos):
        label = " ".join(f"{k}={v}" for k, v in sizes.items()) or "static shapes"
        if progress:
            progress(label)
        start = time.perf_counter()
        folder = out / "buckets" / str(number)
        if padded is not None and aot_buckets.is_padded(sizes, padded[-1]):
            entry, out_spec = _compile_padded_bucket(padded, build, sizes, folder, padding)
        else:
            entry, out_spec = _compile_bucket(model, build, sizes, folder, weights, number)
        entries.append(entry)
        log.info("tpu-inductor: compiled bucket %s in %.1fs", label, time.perf_counter() - start)
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().clone() for k, v in weights.items()}, out / WEIGHTS)
    _write_manifest(out, build, buckets, entries, out_spec, command, padding)


def _padded_graph(model, build: _Build, buckets, weights):
    """One export with the named dims symbolic, through the passes, for every padded bucket
    (aot_buckets.py): (the manifest's `padding`, what `_compile_padded_bucket` needs, or None
    where the buckets compile at their exact sizes)."""
    from tpu_inductor import compile_fx
    from tpu_inductor.passes.bucket_shapes import BucketLayout, Refusal

    padded = aot_buckets.padded_sizes(buckets)
    if not buckets:
        return None, None
    if build.plan is not None or not padded:
        why = "the artifact is split over a mesh" if build.plan else "no bucket of 2 or more"
        return {"refused": why}, None
    largest = {name: max(v) for name, v in padded.items()}
    examples = tuple(torch.zeros(s.concrete(largest), dtype=s.dtype) for s in build.inputs)
    try:
        program = _export(model, examples, aot_buckets.dynamic_shapes(build.inputs, padded))
    except Exception as e:  # torch.export's many ways to say a size cannot stay symbolic
        reason = f"torch.export cannot keep {sorted(padded)} symbolic: {type(e).__name__}: {e}"
        log.warning("tpu-inductor: buckets compiled at their exact sizes: %.300s", reason)
        return {"refused": reason[:2000]}, None
    graph_inputs, flat = _graph_inputs(program, build, examples, weights)
    shapes = dataclasses.replace(build.options.shapes, policy="pow2")  # any policy but exact
    options = dataclasses.replace(build.options, shapes=shapes)
    symbolic = [n.meta["val"] for n in program.graph_module.graph.find_nodes(op="placeholder")]
    passed = compile_fx.artifact_passes(
        program.graph_module, symbolic, options, name="artifact_padded", platform=build.platform
    )
    layout = passed[0].meta.get("bucketing")
    if not isinstance(layout, BucketLayout):
        reason = layout.reason if isinstance(layout, Refusal) else "no symbolic size was left"
        log.warning("tpu-inductor: buckets compiled at their exact sizes: %s", reason)
        return {"refused": reason}, None
    padding = aot_buckets.describe(layout, graph_inputs, build.inputs)
    out_spec = _out_spec(program)
    return padding, (passed, options, graph_inputs, flat, out_spec, padded)


def _compile_padded_bucket(padded, build: _Build, sizes, folder: Path, padding):
    from tpu_inductor import compile_fx

    passed, options, graph_inputs, flat, out_spec, _ = padded
    examples = {s.name: torch.zeros(s.concrete(sizes), dtype=s.dtype) for s in build.inputs}
    values = [examples[g["input"]] if "input" in g else v for g, v in zip(graph_inputs, flat)]
    values += aot_buckets.true_size_inputs(padding, sizes)
    lowered, executable = compile_fx.compile_artifact_bucket(
        passed, values, options, device=build.device
    )
    entry = _write_bucket(folder, build, sizes, graph_inputs, lowered, executable)
    return {**entry, "padded": True}, out_spec


def _check_inputs(model: torch.nn.Module, inputs: Sequence[InputSpec]) -> None:
    """Each input named once, as many as `model.forward` takes (OptionError otherwise)."""
    names = [s.name for s in inputs]
    twice = [n for n in dict.fromkeys(names) if names.count(n) > 1]
    if twice:
        raise OptionError(
            f"tpu-inductor: --input {twice[0]!r} is given {names.count(twice[0])} times; give "
            "each input once, with its own name, in the order of the model's forward()."
        )
    try:
        params = list(signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # no inspectable signature: torch.export will check
        return
    positional = [
        p for p in params if p.kind in (Parameter.POSITIONAL_ONLY, Parameter.POSITIONAL_OR_KEYWORD)
    ]
    required = [p for p in positional if p.default is Parameter.empty]
    varargs = any(p.kind is Parameter.VAR_POSITIONAL for p in params)
    if len(inputs) < len(required) or (len(inputs) > len(positional) and not varargs):
        takes = f"{len(required)}" + (f" to {len(positional)}" if positional != required else "")
        raise OptionError(
            f"tpu-inductor: {type(model).__name__}.forward({', '.join(p.name for p in positional)})"
            f" takes {takes} inputs; got {len(inputs)} --input ({', '.join(names)}). Give one "
            "--input per parameter, in order."
        )


def _check_out(out: Path) -> None:
    """`out` must be new, an empty directory or a previous artifact (OptionError otherwise)."""
    if out.exists() and not out.is_dir():
        raise OptionError(f"tpu-inductor: --out {out} is a file; give a directory to create.")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise OptionError(
            f"tpu-inductor: --out {out} is a directory that holds other files and is not an "
            f"artifact (no {MANIFEST}); its files would be mixed into the artifact. Give a new "
            "or empty directory, or a previous artifact to replace."
        )


def _check_dims(inputs: Sequence[InputSpec], buckets: dict[str, tuple[int, ...]]) -> None:
    used = {d for spec in inputs for d in spec.shape if isinstance(d, str)}
    if used - set(buckets):
        raise OptionError(
            f"tpu-inductor: dims {sorted(used - set(buckets))} have no --bucket; give their "
            "sizes, e.g. --bucket S=16,32,64."
        )
    if set(buckets) - used:
        raise OptionError(f"tpu-inductor: --bucket {sorted(set(buckets) - used)} unused by inputs.")


def _device_here(platform: str, plan: Plan | None) -> devices.Device | None:
    device_name = device_option_of(platform)
    if device_name not in devices.available_platforms():
        log.info("tpu-inductor: no %s device here: StableHLO only, no executables", platform)
        return None
    if plan is None:
        return devices.select_device(device_name)
    try:
        return devices.mesh_device(device_name, plan.mesh.axes)
    except DeviceError as e:
        log.warning("tpu-inductor: StableHLO only, no executables: %s", e)
        return None


def _compile_bucket(model, build: _Build, sizes, directory: Path, weights, number: int):
    from tpu_inductor import compile_fx

    examples = tuple(torch.zeros(s.concrete(sizes), dtype=s.dtype) for s in build.inputs)
    program = _export(model, examples)
    graph_inputs, flat = _graph_inputs(program, build, examples, weights)
    lowered, executable = compile_fx.compile_artifact_graph(
        program.graph_module,
        flat,
        build.options,
        name=f"artifact_{number}",
        platform=build.platform,
        device=build.device,
        mesh=_mesh_split(build, sizes, graph_inputs),
    )
    entry = _write_bucket(directory, build, sizes, graph_inputs, lowered, executable)
    return entry, _out_spec(program)


def _export(model, examples, dynamic_shapes=None) -> torch.export.ExportedProgram:
    """`model` exported at `examples` (core ATen); a model that mutates state is refused."""
    from torch.export.graph_signature import OutputKind

    with decompositions.tracing(), warnings.catch_warnings():
        # torch 2.13's run_decompositions deep-copies pytree specs, which warns about its own
        # deprecated LeafSpec check: noise in the progress bar that a user cannot act on.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`")
        program = torch.export.export(model, examples, dynamic_shapes=dynamic_shapes, strict=False)
        program = program.run_decompositions(dict(decompositions.table()))
    odd = [o for o in program.graph_signature.output_specs if o.kind is not OutputKind.USER_OUTPUT]
    if odd:
        raise ArtifactError(
            f"tpu-inductor: the model mutates {[o.target for o in odd]} when called; an "
            "artifact cannot carry state. Compile a model without in-place buffer updates."
        )
    return program


def _graph_inputs(program, build: _Build, examples, weights) -> tuple[list, list]:
    """(the manifest's graph inputs: each a model input or a weight by name, the values in
    that order); the weights are added to `weights`."""
    from torch.export.graph_signature import InputKind

    graph_inputs, flat, user = [], [], iter(zip(build.inputs, examples))
    state = {**program.state_dict, **program.constants}
    for spec in program.graph_signature.input_specs:
        if spec.kind is InputKind.USER_INPUT:
            named, example = next(user)
            graph_inputs.append({"input": named.name})
            flat.append(example)
        else:
            weights[spec.target] = state[spec.target]
            graph_inputs.append({"weight": spec.target})
            flat.append(state[spec.target])
    return graph_inputs, flat


def _out_spec(program) -> str:
    from torch.utils._pytree import treespec_dumps

    return treespec_dumps(program.call_spec.out_spec)


def _write_bucket(directory: Path, build: _Build, sizes, graph_inputs, lowered, executable):
    """A bucket's files and its manifest entry."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "module.mlir": lowered.text.encode(),
        "module.stablehlo": _portable(lowered.bytecode),
    }
    if executable is not None:
        try:
            files["executable.bin"] = devices.serialize_executable(executable, build.device)
        except Exception as e:  # PJRT cannot serialize some executables (XLA:CPU's sorts:
            log.warning(  # "`LessThan` is not serializable"); the loader compiles the module
                "tpu-inductor: bucket %s: the executable is not stored (%s: %s); the StableHLO "
                "is, and loading the artifact compiles it",
                directory.name,
                type(e).__name__,
                e,
            )
            executable = None
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return {
        "sizes": sizes,
        "graph_inputs": graph_inputs,
        "lowered": serialize.lowered_to_json(lowered),
        "executable": _executable_tag(build.device) if executable is not None else None,
        "padded": False,
    }


def _mesh_split(build: _Build, sizes, graph_inputs):
    """(mesh axes, a partition spec per module argument) of the plan for one bucket (weights
    replicated), or None without a plan."""
    if build.plan is None:
        return None
    specs = build.plan.specs({s.name: s.concrete(sizes) for s in build.inputs})
    arguments = tuple(specs[g["input"]] if "input" in g else () for g in graph_inputs)
    return build.plan.mesh.axes, arguments


def _portable(bytecode: bytes) -> bytes:
    """A StableHLO portable artifact (versioned bytecode; see openxla/stablehlo compatibility)."""
    from jax._src.lib import _jax
    from jax._src.lib.mlir.dialects import hlo

    target = hlo.get_version_from_compatibility_requirement(
        hlo.StablehloCompatibilityRequirement.WEEK_4
    )
    return _jax.mlir.serialize_portable_artifact(bytecode, target, False)


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


def _write_manifest(out, build: _Build, buckets, entries, out_spec, command, padding) -> None:
    import jax

    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        "format": FORMAT,
        "platform": build.platform,
        "x64": build.options.x64,
        "mesh": [list(axis) for axis in build.plan.mesh.axes] if build.plan else None,
        "versions": {
            "tpu_inductor": __version__,
            "torch": torch.__version__,
            "jax": jax.__version__,
        },
        "inputs": [
            {"name": s.name, "dtype": serialize.dtype_name(s.dtype), "shape": list(s.shape)}
            for s in build.inputs
        ],
        "buckets": {k: list(v) for k, v in buckets.items()},
        "padding": padding,
        "entries": entries,
        "out_spec": out_spec,
        "files": {str(p.relative_to(out)): _file_sha256(p) for p in files},
        "command": command,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


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
