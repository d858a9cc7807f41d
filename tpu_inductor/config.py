"""Options of the backend: one typed dataclass, each knob with a default and an env override.

`torch.compile(m, backend="tpu_inductor", options={...})` passes a dict that is validated here
up front; defaults come from `TPU_INDUCTOR_<NAME>` environment variables, then from the field
default. Knobs listed in `NOT_IN_CACHE_KEY` do not change what is compiled.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .exc import OptionError

_CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "tpu", "gpu", "cpu"),
    "fallback": ("eager", "error", "torch-mlir"),
    "lowering": ("own", "torch-mlir"),
    "x64": ("keep", "narrow"),
}


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated options of one `torch.compile(..., backend="tpu_inductor")` call."""

    # PJRT platform to run on; "auto" picks the best present: tpu > gpu > cpu.
    device: str = "auto"
    # What to do with ops that have no lowering: run them in eager torch ("eager"), raise
    # ("error"), or lower their regions with torch-mlir and run in eager what it cannot either.
    fallback: str = "eager"
    # Frontend that lowers ATen graphs: our rules ("own") or torch-mlir's FX importer (optional).
    lowering: str = "own"
    # 64-bit policy: "keep" computes int64/float64 as torch does; "narrow" lowers them to 32 bits.
    x64: str = "keep"
    # Keep parameters and buffers on the device between calls, re-sent when their version changes.
    resident_params: bool = True
    # Passes to skip, by name (for bisecting a miscompile).
    disable_passes: tuple[str, ...] = ()
    # Folder to dump every compile's stages into (graphs, StableHLO, HLO, compile.json); None: off.
    dump_dir: str | None = None
    # Persistent compile cache on disk (executables reused across processes); off with False.
    cache: bool = True
    # Directory of the persistent cache; None: the user's cache directory (platformdirs).
    cache_dir: str | None = None
    # Size cap of the persistent cache in MiB; least recently used entries are evicted past it.
    cache_max_mb: int = 2048

    @classmethod
    def from_user(cls, options: dict[str, Any] | None = None, mode: str | None = None) -> Options:
        """Build Options from env defaults overridden by the user's dict; validate everything."""
        if mode not in (None, "default"):
            raise OptionError(
                f"tpu_inductor: mode={mode!r} is not supported; use mode=None or 'default' "
                "(tune with options={...} instead)."
            )
        given = options or {}
        values = {  # an env value the dict overrides is not read (a bad one does not matter)
            k: (v, f"environment variable {_env_name(k)}")
            for k, v in _env_defaults(skip=given.keys()).items()
        }
        for key, value in given.items():
            if key not in _FIELDS:
                raise OptionError(
                    f"tpu_inductor: unknown option {key!r} (value {value!r}). "
                    f"Allowed options: {', '.join(sorted(_FIELDS))}."
                )
            values[key] = (value, f"option {key!r}")
        options = cls(**{k: _check(k, v, source) for k, (v, source) in values.items()})
        if options.x64 == "narrow" and options.lowering == "torch-mlir":
            raise OptionError(
                f"tpu_inductor: {values['x64'][1]} is 'narrow' and {values['lowering'][1]} is "
                "'torch-mlir': torch-mlir's importer keeps int64/float64, so nothing would be "
                "narrowed. Use x64='keep' with lowering='torch-mlir', or lowering='own' to narrow."
            )
        return options

    def cache_key_entries(self) -> dict[str, Any]:
        """The options that change compiled code, for the compile cache key."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in NOT_IN_CACHE_KEY
        }


_FIELDS = {f.name: f for f in dataclasses.fields(Options)}

# Knobs that never change the compiled program.
NOT_IN_CACHE_KEY = frozenset({"resident_params", "cache", "cache_dir", "cache_max_mb", "dump_dir"})


# What leaving each path option unset means (an empty path is an error, not that).
_UNSET_PATH = {"cache_dir": "for the user's cache directory", "dump_dir": "to dump nothing"}


def _env_name(name: str) -> str:
    return f"TPU_INDUCTOR_{name.upper()}"


def _env_defaults(skip=()) -> dict[str, Any]:
    """The options set by `TPU_INDUCTOR_<NAME>` environment variables, but those in `skip`."""
    values: dict[str, Any] = {}
    for name in (n for n in _FIELDS if n not in skip):
        raw = os.environ.get(_env_name(name))
        if raw is not None:
            values[name] = _parse_env(name, raw)
    return values


def _parse_env(name: str, raw: str) -> Any:
    kind = _FIELDS[name].type
    if kind == "bool":
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise OptionError(
            f"tpu_inductor: environment variable {_env_name(name)}={raw!r} is not a "
            "boolean; use 1/0, true/false, yes/no or on/off."
        )
    if kind.startswith("tuple"):
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise OptionError(
                f"tpu_inductor: environment variable {_env_name(name)}={raw!r} is not an integer."
            ) from None
    return raw


def _check(name: str, value: Any, source: str) -> Any:
    """`value` of option `name`, validated; `source` names where it came from, for errors."""
    kind = _FIELDS[name].type
    if name in _CHOICES:
        if value not in _CHOICES[name]:
            raise OptionError(
                f"tpu_inductor: {source} has value {value!r}; "
                f"allowed values: {', '.join(map(repr, _CHOICES[name]))}."
            )
        return value
    if kind == "bool":
        if type(value) is int and value in (0, 1):  # as in the env var: resident_params=0
            return bool(value)
        if not isinstance(value, bool):
            raise OptionError(
                f"tpu_inductor: {source} must be True or False (or 1 or 0), got {value!r}."
            )
        return value
    if kind.startswith("tuple"):
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            raise OptionError(f"tpu_inductor: {source} must be a list of names, got {value!r}.")
        return tuple(value)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise OptionError(
                f"tpu_inductor: {source} must be a non-negative integer, got {value!r}."
            )
        return value
    if kind == "str | None":
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise OptionError(f"tpu_inductor: {source} must be a path or None, got {value!r}.")
        if value is not None and not os.fspath(value):
            raise OptionError(
                f"tpu_inductor: {source} is an empty path; give a directory, or leave it unset "
                f"{_UNSET_PATH[name]}."
            )
        return None if value is None else os.fspath(value)
    raise AssertionError(f"unhandled option type {kind} for {name}")  # a bug in this module
