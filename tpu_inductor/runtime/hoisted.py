"""Values made from parameters alone, computed once per parameter version (passes/hoist_weights.py
splits them out of an inference graph): a weight concatenated for a merged matmul is made on the
device when its sources change, and stays there for every call until they change again.

`HoistedGraph` calls the prologue (a compiled graph whose results stay on the device as
residency.DeviceTensors) when a source's stamp (identity, version, storage) differs from the one
its values were made at, and hands its results to the main graph after the caller's arguments,
as saved activations are handed to a backward: the device arrays as they are, never through the
host. The sources' own device copies are dropped once the values are made, where the main
graph does not read them (sent again when they change). A source that dies drops the values
(its identity or storage could then be reused by another tensor, which must never read them).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import torch

from tpu_inductor.passes import hoist_weights
from tpu_inductor.runtime import compiled_graph, eager_graph, memory, residency

stats: collections.Counter = collections.Counter()  # prologue calls ("made"), process-wide


def roles(
    split: hoist_weights.Split, roles: compiled_graph.GraphRoles | None, inputs: int
) -> tuple:
    """(the prologue's roles, the main graph's) for a graph of `inputs` caller's inputs: the
    prologue's results are saved outputs (kept on the device), the main graph's new inputs
    after the caller's are saved inputs (taken as the device arrays they are)."""
    count = len(split.made)
    roles = roles or compiled_graph.GraphRoles()
    added = tuple(range(inputs, inputs + count))
    main = dataclasses.replace(roles, saved_inputs=(*roles.saved_inputs, *added))
    return compiled_graph.GraphRoles(saved_outputs=tuple(range(count))), main


class HoistedGraph:
    """A boxed callable with the graph's calling convention: `main(args + prologue(sources))`."""

    def __init__(
        self,
        prologue: compiled_graph.CompiledGraph | eager_graph.EagerGraph,
        main: Callable[[list], list],
        sources: Sequence[int],
        prologue_only: Sequence[int] = (),
    ):
        self._boxed_call = True
        self.prologue, self.main, self.sources = prologue, main, tuple(sources)
        self._released = tuple(self.sources.index(i) for i in prologue_only)
        self._made: _Made | None = None  # the values and the stamp they were made at
        memory.hold(self)

    def held_arrays(self):
        """(kind, tensor, device array) of the values made (the memory ledger reads them)."""
        made = self._made
        for value in () if made is None else made.values:
            if isinstance(value, residency.DeviceTensor):
                yield "hoisted", None, value.array

    def __call__(self, args: list) -> list:
        tensors = [args[i] for i in self.sources]
        stamp = residency.stamps(tensors)
        made = self._made
        if made is None or made.stamp != stamp:
            made = self._make(tensors, stamp)
        args.extend(made.values)
        return self.main(args)

    def _make(self, tensors: list[torch.Tensor], stamp: list) -> _Made:
        made = _Made(stamp, tuple(self.prologue(list(tensors))))
        # The sources only the prologue reads are not kept on the device beside what was made
        # of them (a concatenated weight would otherwise double its weights' memory).
        self.prologue.release_parameters()
        for index in self._released:
            residency.mirrors.discard(tensors[index])
        made.watch(tensors, self)
        replaced, self._made = self._made, made
        if replaced is not None:
            replaced.unwatch()
        stats["made"] += 1
        return made

    def drop_state(self, made: _Made) -> None:
        """`made` is no longer current (a source died)."""
        if self._made is made:
            self._made = None


class _Made(residency.Watched):
    """The prologue's results at one stamp of its sources."""

    def __init__(self, stamp: list, values: tuple):
        self.stamp, self.values = stamp, values
