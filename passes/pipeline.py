"""The ordered pass pipeline, run once on the whole ATen graph before it is partitioned.

    run_passes(gm, ctx, observer)   stream stamps → cleanup → shapes → bucket_shapes →
                                    fuse_attention → fuse_matmuls → fuse_norms →
                                    annotate_sharding

Each pass is `fn(gm, ctx) -> gm`: it reads the PassContext, counts what it rewrote in
`ctx.rewrites`, and keeps `node.meta["val"]` true for the nodes it leaves or creates. After each
pass the graph is linted and recompiled, its counts are added to `ctx.counters` and to the
process-wide `counters`, and the observer (debug.GraphObserver) sees the graph.

Before the first pass every call node gets its random stream (`meta["rng_stream"]`, its name
now): a pass that inserts or removes nodes, or a disabled pass, leaves the streams of the
random ops in the graph as they were. A pass that replaces a random op copies its meta.

A pass's identity (`identity`) is its name, a digest of its module's source, and the values of
the options it reads, or that it is disabled: editing a pass, or changing a setting it reads, is
a new key; nobody keeps a version number by hand. It is the passes' one identity: the compile
cache key (cache/key.py) holds it, and so does AOTAutograd's cache through the same key's
context; the key's source digest leaves the pass modules (`pass_files`) to it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import inspect
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ..exc import OptionError
from . import (
    annotate_sharding,
    bucket_shapes,
    cleanup,
    fuse_attention,
    fuse_matmuls,
    fuse_norms,
    shapes,
)
from .context import PassContext

log = logging.getLogger(__name__)

# Total rewrites per pass over the process lifetime (tests assert on these).
counters: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]
    reads: tuple[str, ...] = ()  # the options it reads: part of its cache identity


PASSES: tuple[Pass, ...] = (
    Pass("cleanup", cleanup.run),
    Pass("shapes", shapes.run, reads=("shapes", "x64", "lowering")),
    Pass("bucket_shapes", bucket_shapes.run, reads=("shapes", "lowering")),
    # after bucketing, which has no rule for the op it makes
    Pass("fuse_attention", fuse_attention.run, reads=("fusion",)),
    # after attention, whose patterns read the projections' views, not their splits
    Pass("fuse_matmuls", fuse_matmuls.run, reads=("fusion",)),
    # after bucketing, which has no rule for the op it makes
    Pass("fuse_norms", fuse_norms.run, reads=("fusion",)),
    # last: it reads the graph's inputs and outputs as the lowering will see them
    Pass("annotate_sharding", annotate_sharding.run),
)


@functools.cache
def _module_digest(fn: Callable) -> str:
    return hashlib.sha256(inspect.getsource(inspect.getmodule(fn)).encode()).hexdigest()[:16]


def identity(options: Any) -> tuple[tuple[str, str, Any], ...]:
    """Per pass in order, (name, digest of its module's source, the values of the options it
    reads, or "disabled"): the passes' part of the compile cache key."""
    skip = set(options.disable_passes)
    return tuple(
        (
            p.name,
            _module_digest(p.fn),
            "disabled" if p.name in skip else tuple((k, _setting(options, k)) for k in p.reads),
        )
        for p in PASSES
    )


def pass_files() -> frozenset[Path]:
    """The source files `identity` covers: the modules of the passes."""
    return frozenset(Path(inspect.getfile(p.fn)).resolve() for p in PASSES)


def _setting(options: Any, name: str) -> Any:
    value = getattr(options, name)
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def check_disabled(disabled: Iterable[str]) -> None:
    """An OptionError for a `disable_passes` name that is no pass."""
    unknown = set(disabled) - {p.name for p in PASSES}
    if unknown:
        raise OptionError(
            f"tpu_inductor: disable_passes names unknown passes {sorted(unknown)}; "
            f"known passes: {[p.name for p in PASSES]}."
        )


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext, observer=None) -> torch.fx.GraphModule:
    """Apply the pipeline to the whole graph `gm`, skipping `ctx.options.disable_passes`.

    `observer(name, gm, rewrites)`, if given, sees the graph after each pass (dumps, traces).
    """
    check_disabled(ctx.options.disable_passes)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta.setdefault("rng_stream", node.name)
    for p in PASSES:
        if p.name in ctx.options.disable_passes:
            continue
        ctx.rewrites = collections.Counter()
        gm = p.fn(gm, ctx)
        gm.graph.lint()
        gm.recompile()
        for what, count in ctx.rewrites.items():
            ctx.counters[f"{p.name}.{what}"] += count
            counters[f"{p.name}.{what}"] += count
        if ctx.rewrites:
            log.debug("pass %s rewrote %s", p.name, dict(ctx.rewrites))
        if observer is not None:
            observer(p.name, gm, dict(ctx.rewrites))
    return gm
