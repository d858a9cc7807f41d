"""Options of the backend: one typed dataclass, each knob with a default and an env override.

`torch.compile(m, backend="tpu_inductor", options={...})` passes a dict that is validated here
up front; defaults come from `TPU_INDUCTOR_<NAME>` environment variables, then from the field
default. A knob may be a small frozen record (`shapes: ShapeOptions`), given as a dict of some
of its fields (the rest keep their defaults) or as the record itself, and checked field by field
by the same `_check` as the scalars. An environment value that starts with `{`, `[` or `"` is
read as JSON (a record is always a JSON object); any other is the plain form (`1`/`0`, names
separated by commas, an integer, a text).

Whether a knob changes what is compiled is declared on its field: `_knob(..., in_key=False)`
keeps it out of the compile-cache key (`cache_key_entries`, which cache/key.py reads); every
other knob is in it, so a new option that changes the code needs nothing but its declaration.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from tpu_inductor.exc import OptionError


def _knob(
    default: Any,
    *,
    choices: tuple[str, ...] = (),
    minimum: int = 0,
    unset: str = "",
    in_key: bool = True,
) -> Any:
    """A field's default and what `_check` allows beyond its type: `choices` for a text,
    `minimum` for an integer, and for a path what leaving it unset means (`unset`).
    `in_key=False`: the knob never changes the compiled program (it stays out of the cache key)."""
    metadata = {"choices": choices, "minimum": minimum, "unset": unset, "in_key": in_key}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class ShapeOptions:
    """How graphs with symbolic sizes are compiled: `options={"shapes": {"policy": "pow2"}}`.

    The policy pads every symbolic size that is a whole input dim to a bucket and compiles one
    executable per bucket, exact at every size in it (passes/bucket_shapes.py): "exact" compiles
    per size; "pow2" the next power of two (at least `min_bucket`); "multiple" the next multiple
    of `multiple`; "sizes" the next of the explicit `sizes` (above the largest: exact); "auto"
    boundaries chosen from the sizes seen (kept in the `plan` file; pow2 until there is one).
    """

    # pow2 by default: on a TPU a compile costs seconds to minutes (docs/shapes.md: policies)
    policy: str = _knob("pow2", choices=("exact", "pow2", "multiple", "sizes", "auto"))
    min_bucket: int = _knob(1, minimum=1)
    multiple: int = _knob(128, minimum=1)
    sizes: tuple[int, ...] = ()
    # "auto": the plan file (sizes seen, boundaries chosen); None: kept in this process only.
    plan: str | None = _knob(None, unset="to keep the plan in this process only", in_key=False)
    # What fills the padding: "zeros", or "nan" / "inf" (NaN / +inf, and the largest integer)
    # to prove in a test that no padded value reaches a real result.
    pad_with: str = _knob("zeros", choices=("zeros", "nan", "inf"), in_key=False)
    # Concrete-size compiles kept per graph; past it the least recently used one is dropped.
    max_compiles: int = _knob(64, minimum=1, in_key=False)


@dataclasses.dataclass(frozen=True)
class FusionOptions:
    """Rewrites of structure XLA cannot see (passes/fuse_*.py): `{"fusion": {"attention": False}}`.

    `attention`: SDPA kernels and written-out attention (matmul, scale, mask, softmax, matmul)
    become one `tpu_inductor::attention` op; masks built as a causal tril become its causal
    flag, a padding mask a mask over keys alone, K/V repeated for grouped-query attention are
    read unrepeated. `matmuls`: matmuls that share an input become one against the others
    concatenated, its result split. `norms`: a written-out RMSNorm or LayerNorm becomes one
    `tpu_inductor::norm` op, accumulating in float32 for 16-bit inputs.

    A fusion left unset (None) takes the default of the platform compiled for
    (`FUSION_DEFAULTS`, resolved by `on`); one given, True or False, holds on every platform.
    """

    attention: bool | None = None
    matmuls: bool | None = None
    norms: bool | None = None

    def on(self, platform: str) -> FusionOptions:
        """These options on `platform` ("cpu", "cuda", "tpu"): each unset one its default."""
        defaults = FUSION_DEFAULTS.get(platform, FUSION_DEFAULTS["cpu"])
        return FusionOptions(
            **{
                f.name: defaults[f.name] if getattr(self, f.name) is None else getattr(self, f.name)
                for f in dataclasses.fields(self)
            }
        )


@dataclasses.dataclass(frozen=True)
class ShardingOptions:
    """The mesh and ready-made plan a script that asks for them receives (`tpu-inductor tune
    --mesh` writes them into tuned.json): `tpu_inductor.auto_mesh(default)` is `mesh` (else
    `default`), `tpu_inductor.shard(model, mesh, "auto")` places by `plan`, one of
    sharding/named.py's (else "data": the weights whole). Not in the key: the placements are."""

    # "data=2,model=4" (as tpu-inductor's --mesh); None: the mesh the script gives.
    mesh: str | None = _knob(None, unset="for the mesh the script gives", in_key=False)
    # "data", "fsdp", "tensor_parallel", "fsdp_tensor_parallel", "expert_parallel"; None: "data".
    plan: str | None = _knob(None, unset="for data parallelism (weights whole)", in_key=False)


# What each fusion defaults to on each platform (docs/options.md, "Fusion defaults").
FUSION_DEFAULTS: dict[str, dict[str, bool]] = {
    # all off: on XLA:CPU the fused forms are no faster (docs/performance.md, "Fusion options")
    "cpu": {"attention": False, "matmuls": False, "norms": False},
    # attention: the Splash kernel (lowering/ops/attention_kernels.py); matmuls: one wider
    # matmul for the MXU in place of Q/K/V's and gate/up's; norms: no kernel behind the op
    # on the TPU (its XLA form is the unfused chain's), so off
    "tpu": {"attention": True, "matmuls": True, "norms": False},
    # attention: cuDNN's fused attention (16-bit inputs)
    "cuda": {"attention": True, "matmuls": False, "norms": False},
}


# torch.compile's modes, all accepted; on XLA they compile the same program. "reduce-overhead"
# (CUDA graphs in Inductor: the least work per call) is one PJRT execution per graph, state kept
# on the device and donated, as always, and host_sync="explicit" unless an option or its
# environment variable says otherwise: like the outputs of Inductor's CUDA graphs, a host copy
# a later call made stale raises when read. "max-autotune" (Inductor's kernel search) is XLA's
# own autotuning, which its GPU compiler runs by default.
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated options of one `torch.compile(..., backend="tpu_inductor")` call."""

    # PJRT platform to run on; "auto" picks the best present: tpu > gpu > cpu. "cpu-copy": the
    # CPU, every tensor copied across as on an accelerator (no zero-copy; for tests). Not in the
    # key: the key holds the PJRT platform and devices it chooses.
    device: str = _knob("auto", choices=("auto", "tpu", "gpu", "cpu", "cpu-copy"), in_key=False)
    # What to do with ops that have no lowering: run them in eager torch ("eager"), raise
    # ("error"), or lower their regions with torch-mlir and run in eager what it cannot either.
    # Not in the key: the key holds the graph it leads to (a whole one or a region), so
    # torch.compile and `tpu-inductor compile` (fallback="error") share entries.
    fallback: str = _knob("eager", choices=("eager", "error", "torch-mlir"), in_key=False)
    # Frontend that lowers ATen graphs: our rules ("own") or torch-mlir's FX importer (optional).
    lowering: str = _knob("own", choices=("own", "torch-mlir"))
    # 64-bit policy: "keep" computes int64/float64 as torch does; "narrow" lowers them to 32 bits.
    x64: str = _knob("keep", choices=("keep", "narrow"))
    # Keep parameters and buffers on the device between calls, re-sent when their version changes.
    resident_params: bool = _knob(True, in_key=False)
    # Activations saved for the backward stay on the device (residency.DeviceTensor) instead of
    # crossing to the host and back; eager code that reads one gets its values.
    saved_on_device: bool = _knob(True, in_key=False)
    # When host tensors a graph writes (parameters, optimizer state, caches) and a backward's
    # gradients are brought up to date: after "each_call" (they cross the host link every
    # step), or on "explicit" `tpu_inductor.sync()`: they stay on the device, and eager code
    # that reads one before the sync gets an error that says so (tpu_inductor/host_sync.py).
    # mode="reduce-overhead" makes "explicit" the default.
    host_sync: str = _knob("each_call", choices=("each_call", "explicit"), in_key=False)
    # Passes to skip, by name (for bisecting a miscompile).
    disable_passes: tuple[str, ...] = ()
    # Folder to dump every compile's stages into (graphs, StableHLO, HLO, compile.json); None: off.
    dump_dir: str | None = _knob(None, unset="to dump nothing", in_key=False)
    # Persistent compile cache on disk (executables reused across processes); off with False.
    cache: bool = _knob(True, in_key=False)
    # Directory of the persistent cache; None: the user's cache directory (platformdirs).
    cache_dir: str | None = _knob(None, unset="for the user's cache directory", in_key=False)
    # Size cap of the persistent cache in MiB; least recently used entries are evicted past it.
    cache_max_mb: int = _knob(2048, in_key=False)
    # Symbolic sizes: the shape policy and how many concrete-size compiles a graph keeps.
    shapes: ShapeOptions = ShapeOptions()
    # Fusion passes, each switchable (passes/fuse_attention.py, passes/fuse_matmuls.py); each
    # left unset takes the default of the platform compiled for (FUSION_DEFAULTS).
    fusion: FusionOptions = FusionOptions()
    # The mesh and plan `auto_mesh` and `shard(model, mesh, "auto")` read (tpu-inductor tune).
    sharding: ShardingOptions = _knob(ShardingOptions(), in_key=False)

    @classmethod
    def from_user(cls, options: dict[str, Any] | None = None, mode: str | None = None) -> Options:
        """Build Options from env defaults overridden by the user's dict; validate everything.

        `{"config": "tuned.json"}` (or `TPU_INDUCTOR_CONFIG`) reads options from a JSON file
        (`tpu-inductor tune` writes one): they override the environment, the dict's other keys
        override them.

        A key the user gives replaces its environment variable whole (which is then not read):
        `{"shapes": {"policy": "exact"}}` keeps the default `max_compiles`, whatever
        `TPU_INDUCTOR_SHAPES` says."""
        if mode not in MODES:
            raise OptionError(
                f"tpu_inductor: mode={mode!r} is not a torch.compile mode; use one of "
                f"{', '.join(map(repr, MODES))} (tune with options={{...}} instead)."
            )
        given = dict(options or {})
        path = given.pop("config") if "config" in given else os.environ.get(_env_name("config"))
        from_file = {} if path is None else _config_file(path, "config" not in (options or {}))
        from_env = _env_values(cls, skip={*given, *from_file})
        if mode == "reduce-overhead" and "host_sync" not in {*given, *from_file, *from_env}:
            from_env["host_sync"] = "explicit"
        items = [(k, v, _Where((k,), env=True)) for k, v in from_env.items()]
        items += [(k, v, _Where((k,), file=os.fspath(path))) for k, v in from_file.items()]
        items += [(k, v, _Where((k,))) for k, v in given.items()]
        options = cls(**_check_fields(cls, items, _Where(())))
        if options.x64 == "narrow" and options.lowering == "torch-mlir":
            where = {k: w for k, _, w in items}
            raise OptionError(
                f"tpu_inductor: {where['x64']} is 'narrow' and {where['lowering']} is "
                "'torch-mlir': torch-mlir's importer keeps int64/float64, so nothing would be "
                "narrowed. Use x64='keep' with lowering='torch-mlir', or lowering='own' to narrow."
            )
        return options

    def on_platform(self, platform: str) -> Options:
        """These options for a compile on `platform`: the fusions left unset its defaults."""
        return dataclasses.replace(self, fusion=self.fusion.on(platform))

    def cache_key_entries(self) -> dict[str, Any]:
        """The options that change compiled code (every field not declared `in_key=False`), for
        the compile cache key: keys sorted, each record a plain dict of its own such fields (so
        the whole is JSON-able)."""
        return _key_entries(self)


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where a value came from, for errors: its key path and whether the environment gave it."""

    path: tuple[str, ...]
    env: bool = False
    file: str | None = None  # the config file it came from

    def child(self, key: Any) -> _Where:
        return _Where((*self.path, str(key)), self.env, self.file)

    def __str__(self) -> str:
        key = ".".join(self.path)
        if self.file is not None:
            return f"option {key!r} from config file {self.file}"
        if not self.env:
            return f"option {key!r}"
        variable = f"environment variable {_env_name(self.path[0])}"
        return variable if len(self.path) == 1 else f"option {key!r} from {variable}"


def _config_file(path: Any, from_env: bool) -> dict[str, Any]:
    """The options a config file holds (a JSON object of options, `config` not among them)."""
    where = f"environment variable {_env_name('config')}" if from_env else "option 'config'"
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise OptionError(f"tpu_inductor: {where} must be the path of a JSON file, got {path!r}.")
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, ValueError) as e:
        raise OptionError(f"tpu_inductor: {where}: cannot read {os.fspath(path)!r}: {e}.") from None
    if not isinstance(values, dict) or "config" in values:
        raise OptionError(
            f"tpu_inductor: {where}: {os.fspath(path)!r} must hold a JSON object of options "
            f'(no \'config\' of its own), e.g. {{"shapes": {{"policy": "auto"}}}}.'
        )
    return values


def _is_record(f: dataclasses.Field) -> bool:
    return dataclasses.is_dataclass(f.default)


def _key_entries(record: Any) -> dict[str, Any]:
    entries = {}
    for f in sorted(dataclasses.fields(record), key=lambda f: f.name):
        if f.metadata.get("in_key", True):
            value = getattr(record, f.name)
            entries[f.name] = _key_entries(value) if _is_record(f) else value
    return entries


def _env_name(name: str) -> str:
    return f"TPU_INDUCTOR_{name.upper()}"


def _env_values(cls: type, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The knobs of `cls` set by `TPU_INDUCTOR_<NAME>` environment variables, but those in
    `skip`."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = None if f.name in skip else os.environ.get(_env_name(f.name))
        if raw is not None:
            values[f.name] = _parse_env(f, raw)
    return values


def _parse_env(f: dataclasses.Field, raw: str) -> Any:
    """The value the text of `f`'s environment variable stands for (validated later)."""
    variable, kind, text = _env_name(f.name), f.type, raw.strip()
    if _is_record(f) or text[:1] in ("{", "[", '"'):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise OptionError(
                f"tpu_inductor: environment variable {variable}={raw!r} is not valid JSON ({e}); "
                f"{_env_form(f)}."
            ) from None
        if _is_record(f) and not isinstance(value, dict):
            raise OptionError(
                f"tpu_inductor: environment variable {variable}={raw!r} is not a JSON object; "
                f"{_env_form(f)}."
            )
        return value
    if kind == "bool":
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise OptionError(
            f"tpu_inductor: environment variable {variable}={raw!r} is not a "
            "boolean; use 1/0, true/false, yes/no or on/off."
        )
    if kind.startswith("tuple"):
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise OptionError(
                f"tpu_inductor: environment variable {variable}={raw!r} is not an integer."
            ) from None
    return raw


def _env_form(f: dataclasses.Field) -> str:
    """What the environment variable of `f` should hold, with an example."""
    if _is_record(f):
        example = json.dumps(dataclasses.asdict(f.default), sort_keys=True)
        keys = ", ".join(sorted(x.name for x in dataclasses.fields(f.default)))
        return f"give a JSON object with keys among {keys}, e.g. {_env_name(f.name)}='{example}'"
    if f.type.startswith("tuple"):
        return "give a JSON list of names, e.g. '[\"cleanup\"]', or names separated by commas"
    return 'give the plain value, or valid JSON (a text starting with {, [ or " is read as JSON)'


def _check_fields(cls: type, items: Iterable[tuple[Any, Any, _Where]], parent: _Where) -> dict:
    """The (key, value, where) items for fields of the record `cls`, each validated."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    checked = {}
    for key, value, where in items:
        if key not in fields:
            allowed = (
                f"Allowed keys of {'.'.join(parent.path)!r}" if parent.path else "Allowed options"
            )
            raise OptionError(
                f"tpu_inductor: unknown {where} (value {value!r}). "
                f"{allowed}: {', '.join(sorted(fields))}."
            )
        checked[key] = _check(fields[key], value, where)
    return checked


def _check(f: dataclasses.Field, value: Any, where: _Where) -> Any:
    """`value` of field `f`, validated; `where` names where it came from, for errors."""
    kind, choices = f.type, f.metadata.get("choices")
    if _is_record(f):
        record = type(f.default)
        if isinstance(value, record):
            value = {x.name: getattr(value, x.name) for x in dataclasses.fields(record)}
        if not isinstance(value, Mapping):
            keys = ", ".join(sorted(x.name for x in dataclasses.fields(record)))
            raise OptionError(
                f"tpu_inductor: {where} must be a dict with keys among {keys} (unset ones keep "
                f"their defaults) or a {record.__name__}, got {value!r}."
            )
        items = ((k, v, where.child(k)) for k, v in value.items())
        return record(**_check_fields(record, items, where))
    if choices:
        if value not in choices:
            raise OptionError(
                f"tpu_inductor: {where} has value {value!r}; "
                f"allowed values: {', '.join(map(repr, choices))}."
            )
        return value
    if kind in ("bool", "bool | None"):
        if value is None and kind == "bool | None":  # unset: the platform's default
            return value
        if type(value) is int and value in (0, 1):  # as in the env var: resident_params=0
            return bool(value)
        if not isinstance(value, bool):
            raise OptionError(
                f"tpu_inductor: {where} must be True or False (or 1 or 0"
                f"{', or None for the platform default' if kind != 'bool' else ''}), "
                f"got {value!r}."
            )
        return value
    if kind == "tuple[int, ...]":
        if (
            not isinstance(value, (list, tuple))
            or not all(type(v) is int and v > 0 for v in value)
            or list(value) != sorted(set(value))
        ):
            raise OptionError(
                f"tpu_inductor: {where} must be a list of ascending positive sizes, e.g. "
                f"[64, 128, 512], got {value!r}."
            )
        return tuple(value)
    if kind.startswith("tuple"):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise OptionError(f"tpu_inductor: {where} must be a list of names, got {value!r}.")
        return tuple(value)
    if kind == "int":
        minimum = f.metadata.get("minimum", 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            allowed = "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}"
            raise OptionError(f"tpu_inductor: {where} must be {allowed}, got {value!r}.")
        return value
    if kind == "str | None":
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise OptionError(f"tpu_inductor: {where} must be a path or None, got {value!r}.")
        if value is not None and not os.fspath(value):
            raise OptionError(
                f"tpu_inductor: {where} is an empty path; give a directory, or leave it unset "
                f"{f.metadata['unset']}."
            )
        return None if value is None else os.fspath(value)
    raise AssertionError(f"unhandled option type {kind} for {where}")  # a bug in this module
