"""The ordered pass pipeline: run each named pass, lint and recompile after it, count rewrites.

A pass's name and version enter the compile cache key (`pass_fingerprint`). Each pass takes a
GraphModule and a `Counter` it adds its rewrite counts to, and returns the (new) GraphModule;
each keeps `node.meta["val"]` true for the nodes it leaves or creates.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable

import torch

from . import cleanup

log = logging.getLogger(__name__)

# Total rewrites per pass over the process lifetime (tests assert on these).
counters: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    version: int
    fn: Callable[[torch.fx.GraphModule, collections.Counter], torch.fx.GraphModule]


PASSES: tuple[Pass, ...] = (Pass("cleanup", 2, cleanup.run),)


def pass_fingerprint(disabled: Iterable[str] = ()) -> tuple[tuple[str, int], ...]:
    """(name, version) of every pass that runs: part of the compile cache key."""
    skip = set(disabled)
    return tuple((p.name, p.version) for p in PASSES if p.name not in skip)


def run_passes(
    gm: torch.fx.GraphModule,
    disabled: Iterable[str] = (),
    *,
    after_pass: Callable[[str, torch.fx.GraphModule, collections.Counter], None] | None = None,
) -> torch.fx.GraphModule:
    """Apply the pipeline to `gm` in order, skipping passes named in `disabled`.

    `after_pass(name, gm, rewrites)`, if given, sees the graph after each pass (for dumps).
    """
    skip = set(disabled)
    unknown = skip - {p.name for p in PASSES}
    if unknown:
        from ..exc import OptionError

        raise OptionError(
            f"tpu_inductor: disable_passes names unknown passes {sorted(unknown)}; "
            f"known passes: {[p.name for p in PASSES]}."
        )
    for p in PASSES:
        if p.name in skip:
            continue
        rewrites: collections.Counter = collections.Counter()
        gm = p.fn(gm, rewrites)
        gm.graph.lint()
        gm.recompile()
        for what, count in rewrites.items():
            counters[f"{p.name}.{what}"] += count
        if rewrites:
            log.debug("pass %s rewrote %s", p.name, dict(rewrites))
        if after_pass is not None:
            after_pass(p.name, gm, rewrites)
    return gm
