"""Targets the interpreter evaluates itself, in Python: size arithmetic and checks, tuple
access, effect tokens. A graph's sizes are concrete when it is lowered, so these compute plain
numbers (on a traced 0-d array, for the integer inputs passed to a module as values).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..exc import LoweringError

aten = torch.ops.aten


def _make_token():
    """An effect token (threaded through `with_effects` nodes; carries no data)."""
    import jax.numpy as jnp

    return jnp.zeros((0,), jnp.float32)


def _assert_scalar(condition, message) -> None:
    """`torch._check` on sizes, for the sizes being compiled: a no-op where it holds."""
    if condition is not True and condition is not False:
        raise LoweringError(f"a runtime assertion on a traced value cannot be checked: {message}")
    if not condition:
        raise LoweringError(
            f"a runtime assertion fails for these inputs' sizes: {message} (eager torch raises "
            "it too: call the model with inputs that satisfy it)"
        )


# Targets the interpreter evaluates itself: size arithmetic and checks, tuple access, effect tokens.
PYTHON_TARGETS: dict[Any, Callable] = {
    operator.getitem: operator.getitem,
    operator.add: operator.add,
    operator.sub: operator.sub,
    operator.mul: operator.mul,
    operator.truediv: operator.truediv,
    operator.floordiv: operator.floordiv,
    operator.mod: operator.mod,
    operator.neg: operator.neg,
    operator.pow: operator.pow,
    operator.eq: operator.eq,
    operator.ne: operator.ne,
    operator.lt: operator.lt,
    operator.le: operator.le,
    operator.gt: operator.gt,
    operator.ge: operator.ge,
    math.ceil: math.ceil,
    math.floor: math.floor,
    math.sqrt: math.sqrt,
    math.trunc: math.trunc,
    torch.sym_int: int,
    torch.sym_float: float,
    torch.sym_max: max,
    torch.sym_min: min,
    torch.sym_sum: sum,
    torch.sym_not: operator.not_,
    torch.sym_ite: lambda condition, a, b: a if condition else b,
    aten.sym_size.int: lambda x, dim: x.shape[dim],
    aten.sym_numel.default: lambda x: math.prod(x.shape),
    aten.sym_stride.int: lambda x, dim: _contiguous_strides(x.shape)[dim],
    aten.sym_storage_offset.default: lambda x: 0,
    aten._assert_scalar.default: _assert_scalar,
    torch.ops.prims._make_token.default: _make_token,
    torch.ops.prims._sink_tokens.default: lambda tokens: None,
}
INTERPRETER_TARGETS = frozenset(PYTHON_TARGETS) | {aten.copy_.default}


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def computes(node: torch.fx.Node) -> bool:
    """Whether a node computes something (not only size arithmetic, tuple access or tokens);
    a write into an input (`copy_`) does."""
    return node.target not in INTERPRETER_TARGETS or node.target is aten.copy_.default
