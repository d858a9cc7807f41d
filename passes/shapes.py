"""shapes: the shape policy. Decides which sizes a graph is compiled at, and makes them concrete.

The `exact` half, which every policy rests on: a graph is compiled once per concrete input
signature (bucket_shapes.py makes the signatures few: inputs padded to buckets). Two halves:

- `run(gm, ctx)`, the pass, once on the whole graph: marks the integer nodes that are values
  only (a step counter multiplied into a tensor, never a size), `meta["value_only"] = True`, so
  that they are passed to the module as 0-d int64 tensors, and a new value is not a new compile.
  Only under x64="keep" (narrowed, a 32-bit value would wrap) and our own lowering. A region of
  a split graph inherits its inputs' marks (the partitioner copies their meta).
- `concretize(gm, inputs)`, per signature, where the compile pipeline dispatches on sizes: a copy
  of `gm` whose metadata is propagated again through fake tensors of the concrete inputs. Rules
  read result shapes from that metadata; evaluated as plain ints, the symbols would give the sizes
  of the trace that made the graph (`new_zeros(n + 1)` would keep the first trace's length).

Assumes a functional ATen graph; preserves every node, and the metadata of a concrete graph.

    %n: SymInt used only as a value   -> %n.meta["value_only"] = True
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from copy import deepcopy
from typing import Any

import torch

from ..exc import LoweringError
from .context import PassContext

# Size arithmetic the interpreter evaluates that computes the same on a traced integer (a 0-d
# array) as on a Python int, whatever the operands (more in `_is_value_arithmetic`).
_VALUE_ARITHMETIC = frozenset(
    {operator.add, operator.sub, operator.mul, operator.neg, operator.truediv}
)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    if ctx.options.x64 != "keep" or ctx.options.lowering == "torch-mlir" or not is_symbolic(gm):
        return gm
    for node in value_only_integer_nodes(gm, ctx):
        node.meta["value_only"] = True
        ctx.rewrites["value_only_marked"] += 1
    return gm


def value_only_inputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Positions of the inputs of `gm` (a whole graph or a region) marked values only."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return frozenset(i for i, n in enumerate(placeholders) if n.meta.get("value_only"))


def is_symbolic(gm: torch.fx.GraphModule) -> bool:
    """Whether any node's metadata holds a symbolic size or value."""
    for node in gm.graph.nodes:
        for value in _flat_values(node.meta.get("val")):
            if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return True
            if isinstance(value, torch.Tensor) and not all(isinstance(d, int) for d in value.shape):
                return True
    return False


def concretize(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> torch.fx.GraphModule:
    """`gm` itself when its sizes are concrete; else a copy whose metadata is recomputed for
    `inputs` (tensors and plain numbers; value-only inputs as their ints)."""
    if not is_symbolic(gm):
        return gm
    from torch._subclasses.fake_tensor import FakeTensorMode

    copy = torch.fx.GraphModule(gm, deepcopy(gm.graph))  # nodes copied, their meta shallowly
    placeholders = [n for n in copy.graph.nodes if n.op == "placeholder"]
    strides = _traced_strides(placeholders, inputs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:  # real or fake inputs alike: only their sizes, strides and dtypes matter
        fakes = [
            torch.empty_strided(v.shape, stride, dtype=v.dtype, device=v.device)
            if isinstance(v, torch.Tensor)
            else v
            for v, stride in zip(inputs, strides)
        ]
    try:
        _propagate(copy, mode, fakes)
    except Exception as e:  # any op's meta kernel may refuse: say which sizes, and what to do
        shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in inputs]
        raise LoweringError(
            f"could not specialize a graph with symbolic sizes to the inputs {shapes}: {e}. "
            "Compile with static shapes (torch.compile(..., dynamic=False)) or report the graph."
        ) from e
    return copy


def _propagate(gm: torch.fx.GraphModule, mode, fakes: list) -> None:
    """FakeTensorProp over `gm` that also records plain numbers (a value-only input, a size
    read from a tensor) as their nodes' values: torch 2.11's keeps the traced SymInt there,
    which a lowering then refuses as symbolic (torch 2.13's records them itself)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    class NumbersToo(FakeTensorProp):
        def run_node(self, n):
            result = super().run_node(n)
            if type(result) in (int, float, bool):
                n.meta["val"] = result
            return result

    NumbersToo(gm, mode).propagate_dont_convert_inputs(*fakes)


def _traced_strides(placeholders: list[torch.fx.Node], inputs: Sequence[Any]) -> list:
    """Each tensor input's strides, in the dim order the trace laid it out. A saved activation
    kept on the device comes back dense, where the graph may have it as a view in another
    order: `a.t()` saved as [k, m] with strides (1, k) arrives as (m, 1), which a meta kernel
    may refuse (`_grouped_mm`'s, when m is odd). Such an input gets dense strides in the
    traced order (what a static graph is lowered with); one in the traced order, or traced as a
    broadcast (stride 0), keeps its own."""
    strides = []
    for node, value in zip(placeholders, inputs):
        val = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            strides.append(None)
            continue
        traced = _hints(val.stride()) if isinstance(val, torch.Tensor) else None
        shape = tuple(value.shape)
        if traced is None or len(traced) != len(shape) or _broadcast(traced, shape):
            strides.append(value.stride())
            continue
        order = _dim_order(traced, shape)
        if order == _dim_order(value.stride(), shape):
            strides.append(value.stride())
            continue
        dense, step = [0] * len(shape), 1
        for d in reversed(sorted(range(len(shape)), key=lambda d: (-traced[d], d))):
            dense[d], step = step, step * max(shape[d], 1)
        strides.append(tuple(dense))
    return strides


def _hints(values) -> tuple[int, ...] | None:
    """Ints for sizes or strides, symbols by the value they had when traced (None: unknown)."""
    out = []
    for v in values:
        hint = v.node.hint if isinstance(v, torch.SymInt) else v
        if hint is None:
            return None
        out.append(int(hint))
    return tuple(out)


def _broadcast(strides, shape) -> bool:
    """Whether a dim of more than one element has stride 0 (an expand: no dense order)."""
    return any(st == 0 and n > 1 for st, n in zip(strides, shape))


def _dim_order(strides, shape) -> tuple[int, ...]:
    """The dims of more than one element, outermost (largest stride) first."""
    return tuple(
        sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: (-strides[d], d))
    )


def value_only_integer_nodes(gm: torch.fx.GraphModule, ctx: PassContext) -> list[torch.fx.Node]:
    """The SymInt inputs whose symbol is in no size, stride or offset, and whose uses are
    integer arithmetic and rules that take traced scalars (elementwise ones, full, clamp...: a
    traced 0-d array as a scalar argument): nothing reads their value at compile time."""
    in_sizes = set()
    for node in gm.graph.nodes:
        for value in _flat_values(node.meta.get("val")):
            if isinstance(value, torch.Tensor):
                for d in (*value.shape, *value.stride(), value.storage_offset()):
                    if isinstance(d, torch.SymInt):
                        in_sizes |= d.node.expr.free_symbols
    found = []
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if (
            node.op == "placeholder"
            and isinstance(value, torch.SymInt)
            and value.node.expr.is_Symbol
            and value.node.expr not in in_sizes
            and _used_as_value_only(node, ctx)
        ):
            found.append(node)
    return found


def _used_as_value_only(node: torch.fx.Node, ctx: PassContext) -> bool:
    for user in node.users:
        if user.op == "output" and node.op == "placeholder":
            continue  # the input itself, returned (saved for the backward): given back as it is
        if user.op != "call_function":
            return False  # a computed number returned: the caller wants it as a Python number
        if _is_value_arithmetic(user, node):
            if not _used_as_value_only(user, ctx):
                return False
            continue
        if not ctx.takes_traced_scalars(user):
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
