"""bucket_values: where a bucketed symbol's value goes, a size or a number (bucket_shapes.py).

Compiled at a bucket, a size is the bucket's. As a size (a view's shape, an arange's length, a
creation's shape) that is what the pass wants: the padded shapes. As a number the graph
computes with (a cache position `arange(1) + past`, a causal mask's `kv_idx <= q_idx`, `x * n`,
`full([], n)`), it must be the true size: such a use is rewritten to read the true size (the
0-d input `true_<symbol>` the masks read), recomputed through the size arithmetic that led to
it. Exact by the pass's invariant: every real position holds eager's value, and a number made
of true sizes is eager's number; where such values index or compare with positions, the rule of
the op that reads them decides (real positions lead each padded factor; an index into a merged
padded dim is refused there).

Taken by ops whose lowering takes a traced scalar (elementwise ops, full...), through arithmetic
that computes the same on a traced integer as on a Python int (+ - *, // and % by a nonzero
constant). Any other use needs the exact size and is refused with the op that reads it.

    %n: Sym(s0)                                   %n, %true_s0 (a 0-d int input)
    %p = aten.add.Tensor(%arange, %n)        ->   %p = aten.add.Tensor(%arange, %true_s0)
"""

from __future__ import annotations

import operator

import torch

from .bucket_proof import Refused, size_expr
from .bucket_rules import VIEWS
from .bucket_rules_flex import SHAPES as FLEX_ATTENTION
from .bucket_rules_flex import reads_as_size

aten = torch.ops.aten

CREATION = {aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format}
CREATION |= {aten.empty_strided.default}
NEW = {aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}
NEW |= {aten.new_empty.default, aten.new_empty_strided.default}
ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
SYM_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod}
SYM_ARITHMETIC |= {torch.sym_max, torch.sym_min, torch.sym_sum}
# arithmetic the interpreter computes alike on a traced 0-d integer and on a Python int
_TRACED_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.neg}


def check_uses(b, node: torch.fx.Node) -> None:
    """Every use of `node` (a SymInt of bucketed symbols) as a number reads its true value;
    raises Refused for a use that needs the exact size."""
    for user in list(node.users):
        if user.op == "output":
            continue
        if user.op == "call_function" and user.target in SYM_ARITHMETIC:
            check_uses(b, user)
            continue
        if user.target in FLEX_ATTENTION and reads_as_size(b.gm, user, node):
            continue
        sizes = _size_positions(user)
        if sizes is None or not _as_number(user, node, sizes):
            continue
        if user.op != "call_function" or not b.ctx.takes_traced_scalars(user):
            raise Refused(
                f"the value of size {node.name} reaches {user.name} ({user.target}), "
                "which needs it at compile time: compiled at a bucket, it would be the bucket's"
            )
        true = _true_number(b, node, user)
        user.args = tuple(
            a if i in sizes else _replaced(a, node, true) for i, a in enumerate(user.args)
        )
        user.kwargs = {k: _replaced(v, node, true) for k, v in user.kwargs.items()}
        b.ctx.rewrites["true_values"] += 1


def _size_positions(user) -> set[int] | None:
    """The argument positions of `user` that are sizes; None: every argument is a size."""
    target, args = user.target, user.args
    if user.op != "call_function":
        return set()
    if target is aten.sym_size.int:
        return None
    if target in VIEWS or target is aten.expand.default or target in NEW:
        return {1}
    if target in CREATION or target is aten.arange.default:
        return {0}
    if target in (aten.arange.start, aten.arange.start_step) and args[0] == 0:
        return {1}  # arange(0, n): n is its length
    if target is aten.slice.Tensor:
        return {3}
    return set()


def _as_number(user, node, sizes: set[int]) -> bool:
    """Whether `node` is among `user`'s arguments outside its size positions."""
    for i, a in enumerate(user.args):
        inside = any(v is node for v in a) if isinstance(a, (list, tuple)) else a is node
        if inside and i not in sizes:
            return True
    return any(v is node for v in user.kwargs.values())


def _replaced(arg, node, true):
    if isinstance(arg, (list, tuple)):
        return type(arg)(true if v is node else v for v in arg)
    return true if arg is node else arg


def _true_number(b, node, before):
    """A graph value (or int) of `node`'s number at the true sizes, computed before `before`."""
    value = node.meta.get("val")
    if not isinstance(value, torch.SymInt) or not size_expr(value).free_symbols & set(b.symbols):
        return node  # not made of bucketed sizes: the same number at any bucket
    expr = size_expr(value)
    if node.op == "placeholder" and b.symbol_of(expr) is not None:
        return b.true_value(expr, before)
    if node.target is aten.sym_size.int:
        x, dim = node.args
        return b.true_count(before, b.layout(x), [dim % x.meta["val"].dim()])
    if node.target in _TRACED_ARITHMETIC or (
        node.target in (operator.floordiv, operator.mod)
        and isinstance(node.args[1], int)
        and node.args[1] != 0
    ):
        args = [
            _true_number(b, a, before) if isinstance(a, torch.fx.Node) else a for a in node.args
        ]
        return b.insert(before, node.target, args)
    raise Refused(
        f"the value of size {node.name} ({node.target}) reaches {before.name} "
        f"({before.target}) as a number, and the pass cannot recompute it from the true sizes"
    )
