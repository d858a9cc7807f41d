"""The ATen decompositions graphs are traced with: core ATen's, less those that compute wrong
values and those of ops our rules lower whole; our rules lower those ops instead.

torch also installs some decompositions as an op's Python Autograd kernel, which tracing runs
before it looks at any table: `tracing()` takes those kernels of the wrong decompositions out
while a graph is traced, and puts them back after.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping

import torch

# torch's multilabel_margin_loss decomposition counts the targets after a row's first -1
# (values and gradients wrong, up to 3x); eager's kernel stops there, as documented.
_WRONG = ("multilabel_margin_loss_forward",)


# Kept whole: CPU flash attention, which torch decomposes into its math form (Inductor leaves
# that decomposition out too). Its forward and backward rules (lowering/ops/sdpa.py) are the same
# computation; tracing the math form and its gradient op by op is a large share of a first
# call (docs/benchmarks.md, "Figures found in code comments and docstrings").
_KEPT = ("_scaled_dot_product_flash_attention_for_cpu",)


def _overloads(names: tuple[str, ...]) -> list:
    ops = [getattr(torch.ops.aten, name) for name in names]
    return [getattr(op, overload) for op in ops for overload in op.overloads()]


@functools.cache
def table() -> Mapping:
    """The decomposition table, built at its first use: a warm start (an AOTAutogradCache hit,
    no tracing) never needs to pay for building it."""
    return _LazyTable()


class _LazyTable(Mapping):
    @functools.cached_property
    def _table(self) -> dict:
        from torch._decomp import core_aten_decompositions

        table = dict(core_aten_decompositions())
        for op in _overloads(_WRONG + _KEPT):
            table.pop(op, None)
        return table

    def __getitem__(self, op):
        return self._table[op]

    def __iter__(self) -> Iterator:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


@contextlib.contextmanager
def tracing():
    """While tracing: the wrong decompositions' Autograd kernels out of torch's dispatch."""
    from torch._C import DispatchKey

    removed = []
    for op in _overloads(_WRONG):
        kernel = op.py_kernels.pop(DispatchKey.Autograd, None)
        if kernel is not None:
            removed.append((op, kernel))
            op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in removed:
            op.py_kernels[DispatchKey.Autograd] = kernel
            op._dispatch_cache.clear()
