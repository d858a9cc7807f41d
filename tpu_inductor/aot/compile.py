"""Offline compilation: `compile_model` exports a model once per bucket and compiles each graph
through torch.compile's own stages into an artifact directory (the layout: aot/artifact.py).

`compile_model` writes into a temporary directory next to `out` and moves it into place when
every bucket compiled: a failed compile leaves nothing, and a previous artifact at `out` is
replaced whole (a directory holding anything else is refused).
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from inspect import Parameter, signature
from pathlib import Path
from typing import Any

import torch

from tpu_inductor import decompositions, files
from tpu_inductor.aot import buckets as aot_buckets
from tpu_inductor.aot.artifact import (
    FORMAT,
    MANIFEST,
    PLATFORMS,
    WEIGHTS,
    InputSpec,
    _executable_tag,
    _file_sha256,
)
from tpu_inductor.cache import serialize
from tpu_inductor.config import Options
from tpu_inductor.exc import ArtifactError, DeviceError, OptionError
from tpu_inductor.runtime import devices
from tpu_inductor.runtime.devices import device_option_of
from tpu_inductor.sharding.mesh import Plan
from tpu_inductor.version import __version__

log = logging.getLogger(__name__)


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
    param_names = [p.name for p in positional]
    for at, name in enumerate(names[: len(positional)]):
        if name != param_names[at] and name in param_names:  # inputs go by position
            raise OptionError(
                f"tpu-inductor: --input {name!r} is given at position {at + 1}, where "
                f"{type(model).__name__}.forward takes {param_names[at]!r} ({name!r} is its "
                f"parameter {param_names.index(name) + 1}). Inputs are passed by position: give "
                f"the --input options in the order of forward({', '.join(param_names)})."
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
