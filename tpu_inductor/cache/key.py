"""The compile-cache key: the one place it is assembled, from named entries.

A key is an ordered list of (name, value) entries, each hashed on its own (sha256 of a canonical
text) and the list hashed again, so that a miss is explained entry by entry (`CacheKey.explain`,
`tpu-inductor cache explain`). A value with no stable text (an object identity) cannot be
hashed: the compile then bypasses the cache.

    graph part (`for_graph`, what AOTAutograd's cache keeps of a graph):
      graph             the graph after the passes, whatever its nodes are named, with what its
                        lowering reads besides (random streams) and its tensor constants' data
      inputs, strides   the input signature and the tensor inputs' strides
      shardings         over a mesh: mesh axes and a spec per tensor input
      separate_outputs  outputs the module returns as results of their own
      donate_writes     inputs it writes, donated to the executable
    context (`context_entries`, the process's: also AOTAutograd's backend id):
      options.<name>    every option whose field config.py declares in the key
      pass.<name>       each pass's identity (passes/pipeline.py: source, settings read)
      versions          torch, jax, jaxlib, tpu_inductor
      source            the sources of tpu_inductor, lowering and passes but the pass modules
      user_rules        lowering rules users registered
      pjrt, devices     PJRT platform and version, device kind and count
      xla_flags         XLA_FLAGS less the dump flags

Each room declares its part in one place: the options their fields (`_knob(in_key=...)`), the
passes their `identity`, lowering its users' rules; nothing else adds to the key.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tpu_inductor import lowering
from tpu_inductor.config import Options
from tpu_inductor.passes import pipeline
from tpu_inductor.runtime import devices, size_dispatch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """An ordered list of named entries and their hashes."""

    entries: tuple[tuple[str, str], ...]  # (name, sha256 of the entry's canonical text)

    @classmethod
    def of(cls, entries: Sequence[tuple[str, Any]]) -> CacheKey:
        """The key of (name, value) entries; UnhashableEntry if a value has no stable text."""
        return cls(tuple((name, sha256(_canonical(value))) for name, value in entries))

    @property
    def digest(self) -> str:
        return sha256("\n".join(f"{n}={h}" for n, h in self.entries))

    def explain(self, other: CacheKey) -> list[str]:
        """The names of the entries whose values differ between two keys."""
        mine, theirs = dict(self.entries), dict(other.entries)
        return [n for n in dict.fromkeys([*mine, *theirs]) if mine.get(n) != theirs.get(n)]

    def __add__(self, other: CacheKey) -> CacheKey:
        return CacheKey(self.entries + other.entries)


class UnhashableEntry(TypeError):
    """A key entry whose value has no stable text form: the cache is bypassed."""


def sha256(text: str | bytes) -> str:
    """The hex sha256 of a text (UTF-8) or of bytes."""
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _canonical(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_canonical(k)}:{_canonical(v)}" for k, v in value.items()) + "}"
    text = repr(value)
    if " at 0x" in text:  # an object identity, not a value
        raise UnhashableEntry(f"cannot hash {type(value).__name__} for the cache key: {text}")
    return text


# ---------------------------------------------------------------------------------------------
# The graph part.


def graph_fingerprint(gm: torch.fx.GraphModule, platform: str) -> str:
    """A graph's computation, whatever its nodes are named: each node by its position, op,
    target and arguments (other nodes by position) and, for a random op on `platform`, its
    stream (no position: passes that move it keep it), its tensor constants' data and its
    subgraphs' fingerprints (a flex_attention's score_mod and mask_mod).
    Dynamo's and torch.export's traces of one program name their inputs differently; they key
    alike."""
    position: dict = {}
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        position[node] = len(position)
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{position[n]}")
        target = "" if node.op in ("placeholder", "get_attr") else _target_name(node.target)
        stream = lowering.rng_stream(node) if lowering.draws_random(node, platform) else None
        digest.update(f"{node.op} {target} {args!r} {stream!r}\n".encode())
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            if isinstance(value, torch.fx.GraphModule):  # a higher-order op's subgraph
                digest.update(graph_fingerprint(value, platform).encode())
            elif isinstance(value, torch.Tensor):
                data = value.detach().cpu().contiguous()
                digest.update(f"{data.dtype}:{tuple(data.shape)}".encode())
                raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
                digest.update(raw)
    return digest.hexdigest()


def _target_name(target) -> str:
    from torch._ops import HigherOrderOperator, OpOverload

    if isinstance(target, OpOverload):
        return str(target)
    if isinstance(target, HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)!s}"


def for_graph(
    fingerprint: str,
    inputs: Sequence[Any],
    *,
    shardings: lowering.Shardings | None = None,
    separate_outputs: frozenset[int] = frozenset(),
    donate_writes: bool = False,
) -> CacheKey | None:
    """The graph part of a key: the graph (`graph_fingerprint`) at the sizes of `inputs`, as
    the lowering is asked to make it; None when an entry cannot be hashed."""
    entries = [("graph", fingerprint), ("inputs", size_dispatch.input_signature(inputs))]
    entries.append(("strides", size_dispatch.strides(inputs)))
    if shardings is not None:
        entries.append(("shardings", (shardings.axes, shardings.inputs)))
    if separate_outputs:
        entries.append(("separate_outputs", tuple(sorted(separate_outputs))))
    if donate_writes:
        entries.append(("donate_writes", True))
    return _hashed(entries)


def for_compile(graph_key: CacheKey | None, options: Options, device) -> CacheKey | None:
    """The whole key of a compile: the graph part and this process's context; None when
    either cannot be hashed (the compile bypasses the cache)."""
    context = _hashed(context_entries(options, device))
    return None if graph_key is None or context is None else graph_key + context


def _hashed(entries: Sequence[tuple[str, Any]]) -> CacheKey | None:
    try:
        return CacheKey.of(entries)
    except UnhashableEntry as e:
        log.debug("compile cache bypassed: %s", e)
        return None


# ---------------------------------------------------------------------------------------------
# The context: options, passes and the environment.


def context_entries(options: Options, device: devices.Device) -> list[tuple[str, Any]]:
    """Everything besides the graph that changes the binary (see the module docstring)."""
    client = device.client
    options = options.on_platform(device.lowering_platform)  # the fusions it compiles with
    return [
        *((f"options.{name}", value) for name, value in options.cache_key_entries().items()),
        *((f"pass.{name}", (digest, read)) for name, digest, read in pipeline.identity(options)),
        ("versions", _versions()),
        ("source", _source_digest()),
        ("user_rules", lowering.user_rules_fingerprint()),
        ("pjrt", (client.platform, client.platform_version)),
        ("devices", (device.kind, len(client.devices()))),
        ("xla_flags", xla_flags()),
    ]


def _versions() -> tuple[str, ...]:
    import jax
    import jaxlib

    from tpu_inductor.version import __version__

    return (torch.__version__, jax.__version__, jaxlib.__version__, __version__)


@functools.cache
def _source_digest() -> str:
    """sha256 of the package's Python sources (an edited lowering rule is a different key) but
    the pass modules, which `pipeline.identity` covers."""
    from tpu_inductor import passes

    package = Path(__file__).resolve().parents[1]  # tpu_inductor/
    roots = sorted({package, *map(Path, lowering.__path__), *map(Path, passes.__path__)})
    own = pipeline.pass_files()
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if path.resolve() not in own:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def xla_flags() -> tuple[str, ...]:
    """XLA_FLAGS less the dump flags, which do not change the compiled program."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return tuple(f for f in flags if not f.startswith("--xla_dump"))
