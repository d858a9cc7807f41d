"""`PassContext`: what a pass may read about the compile it is part of.

The pipeline makes one per whole ATen graph, before partitioning: the lowering platform, the
validated options, the input signature being compiled (None while sizes are symbolic), the
placements of inputs and outputs on a device mesh (annotate_sharding), one question passes may ask of the
lowering, and the rewrite counters of this run.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def _no_traced_scalars(_node: torch.fx.Node) -> bool:
    return False


@dataclasses.dataclass
class PassContext:
    """The compile a pass runs in. Passes read it; only the pipeline writes `rewrites`."""

    platform: str  # jax's lowering platform: "cpu", "cuda", "tpu"
    options: Any  # tpu_inductor.config.Options
    inputs: tuple | None = None  # the input signature being compiled; None: symbolic sizes
    # Placements of graph inputs and outputs on a device mesh (annotate_sharding.SpecPlan)
    plan: Any = None
    # Whether a node's lowering rule takes a traced 0-d value where the op has a scalar (the
    # one thing passes ask of the lowering; compile_fx passes lowering's answer in).
    takes_traced_scalars: Callable[[torch.fx.Node], bool] = _no_traced_scalars
    # Whether the lowering has a rule for a node (None: not asked; the partitioner decides).
    supported: Callable[[torch.fx.Node], bool] | None = None
    # Rewrites of this run, "<pass>.<what>" → count (and of the running pass, by `what`).
    counters: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    rewrites: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def __post_init__(self):
        # the fusions left unset take the platform's defaults (config.FusionOptions.on)
        self.options = self.options.on_platform(self.platform)
