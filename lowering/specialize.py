"""A graph with symbolic sizes made static for one set of concrete inputs.

Dynamo hands over graphs whose node metadata (`meta["val"]`) holds sizes as symbols (`s0`, `2*s0
+ 1`); lowering rules read result shapes from that metadata. Evaluated as plain ints, the
symbols give the sizes of the trace that made the graph, not of the inputs being compiled for:
`new_zeros(n + 1)` would keep the first trace's length. So a symbolic graph is first copied with
its metadata propagated again through fake tensors of the concrete inputs: every rule, and the
interpreter's shape checks, then see the sizes being compiled.

An integer input that is only a value (a step counter multiplied into a tensor), never a size,
is not compiled in: `value_only_integer_inputs` finds those, and they are passed to the module
as 0-d int64 tensors, so that a new value is not a new compile.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from copy import deepcopy
from typing import Any

import torch

from ..exc import LoweringError
from . import registry

# Size arithmetic the interpreter evaluates that computes the same on a traced integer (a 0-d
# array) as on a Python int, whatever the operands (more in `_is_value_arithmetic`).
_VALUE_ARITHMETIC = frozenset(
    {operator.add, operator.sub, operator.mul, operator.neg, operator.truediv}
)


def is_symbolic(gm: torch.fx.GraphModule) -> bool:
    """Whether any node's metadata holds a symbolic size or value."""
    for node in gm.graph.nodes:
        for value in _flat_values(node.meta.get("val")):
            if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return True
            if isinstance(value, torch.Tensor) and not all(isinstance(d, int) for d in value.shape):
                return True
    return False


def with_concrete_sizes(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> torch.fx.GraphModule:
    """A copy of `gm` whose metadata is recomputed for `inputs` (tensors and plain numbers)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    copy = torch.fx.GraphModule(gm, deepcopy(gm.graph))  # nodes copied, their meta shallowly
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:  # real or fake inputs alike: only their sizes, strides and dtypes matter
        fakes = [
            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            if isinstance(v, torch.Tensor)
            else v
            for v in inputs
        ]
    try:
        FakeTensorProp(copy, mode).propagate_dont_convert_inputs(*fakes)
    except Exception as e:  # any op's meta kernel may refuse: say which sizes, and what to do
        shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in inputs]
        raise LoweringError(
            f"could not specialize a graph with symbolic sizes to the inputs {shapes}: {e}. "
            "Compile with static shapes (torch.compile(..., dynamic=False)) or report the graph."
        ) from e
    return copy


def value_only_integer_inputs(gm: torch.fx.GraphModule, platform: str | None) -> frozenset[int]:
    """Positions of the SymInt inputs whose symbol is in no size, stride or offset, and whose
    uses are integer arithmetic and rules marked `takes_traced_scalars` (elementwise ones, full,
    clamp...: they take a traced 0-d array as a scalar argument): nothing reads their value at
    compile time."""
    in_sizes = set()
    for node in gm.graph.nodes:
        for value in _flat_values(node.meta.get("val")):
            if isinstance(value, torch.Tensor):
                for d in (*value.shape, *value.stride(), value.storage_offset()):
                    if isinstance(d, torch.SymInt):
                        in_sizes |= d.node.expr.free_symbols
    positions = set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for position, node in enumerate(placeholders):
        value = node.meta.get("val")
        if (
            isinstance(value, torch.SymInt)
            and value.node.expr.is_Symbol
            and value.node.expr not in in_sizes
            and _used_as_value_only(node, platform)
        ):
            positions.add(position)
    return frozenset(positions)


def _used_as_value_only(node: torch.fx.Node, platform: str | None) -> bool:
    for user in node.users:
        if user.op == "output" and node.op == "placeholder":
            continue  # the input itself, returned (saved for the backward): given back as it is
        if user.op != "call_function":
            return False  # a computed number returned: the caller wants it as a Python number
        if _is_value_arithmetic(user, node):
            if not _used_as_value_only(user, platform):
                return False
            continue
        rule = registry.lookup(user.target, platform)
        if rule is None or not getattr(rule.fn, "takes_traced_scalars", False):
            return False
    return True


def _is_value_arithmetic(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether `user` computes the same on a traced `node` as on a Python int: + - * / and
    negation; a power with a float operand (jax's integer power of a negative exponent is not
    Python's float); // and % of it by a nonzero constant (floor semantics in both; a divisor
    that is the value could be zero, where Python raises)."""
    if user.target in _VALUE_ARITHMETIC:
        return True
    if user.target is operator.pow:
        return any(isinstance(a, float) for a in user.args)
    if user.target in (operator.floordiv, operator.mod):
        divisor = user.args[1]
        return user.args[0] is node and isinstance(divisor, int) and divisor != 0
    return False


def _flat_values(value) -> list:
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in _flat_values(item)]
    return [value]
