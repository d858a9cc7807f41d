"""A graph PJRT failed to compile, run by eager torch in place of its executable (the compile
fault degrades to eager with a warning under `fallback="eager"`: compile_fx's stages)."""

from __future__ import annotations

import torch

from tpu_inductor.debug import profiling
from tpu_inductor.runtime.host_sync import host_sync


class EagerGraph:
    """The ATen graph with the calling convention of the executable it stands for (boxed;
    value-only integers arrive as 0-d tensors, as SizeDispatch passes them)."""

    def __init__(self, gm: torch.fx.GraphModule, scalars: frozenset[int], name: str = "graph"):
        self._boxed_call = True
        self.gm, self.scalars, self.name = gm, scalars, name

    def __call__(self, args: list) -> list:
        if profiling.active:
            with profiling.span("eager", self.name):
                return self._run(args)
        return self._run(args)

    def _run(self, args: list) -> list:
        if host_sync.pending:  # eager torch reads host memory: stale copies brought home first
            host_sync.sync([v for v in args if isinstance(v, torch.Tensor)])
        values = [int(v) if i in self.scalars else v for i, v in enumerate(args)]
        args.clear()
        return list(self.gm(*values))

    def release_parameters(self) -> None:
        """Nothing to release: it holds no device copies (as CompiledGraph's, for hoisted.py)."""
