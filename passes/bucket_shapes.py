"""bucket_shapes: one executable per bucket of sizes, exact at every size in it.

For a graph with symbolic sizes under a bucketing policy (option `shapes.policy` other than
"exact"), every symbol that is a whole dim of an input (a sequence length, a batch) is padded
at run time up to its bucket (`bucket_policy`); the graph is compiled at the bucket's sizes and
told the true sizes as runtime values (0-d tensor inputs, one per symbol, appended after the
graph's inputs). Padding never changes a real result: the pass follows which dims of which
values carry padding (a dim is a row-major product of factors, `(b, s)` after a view merges
batch and length) and, before every op that reads across a padded dim, masks the padding with
that op's identity — 0 for sums and contractions (both operands: 0·NaN is NaN), -inf/+inf for
max/min/softmax/logsumexp, the ignore index for a loss target — and rewrites a mean as a sum
over the true count. Elementwise ops, views, transposes and layer norm over unpadded dims leave
padding where it is; whatever inf/NaN they make there stays there.

A graph the pass cannot prove exact — an op it has no padding rule for reading a padded dim, a
size it cannot follow (`s + 1`), a symbol's value where an op needs it at compile time (a
value used as a number is the true size, an input: bucket_values.py), a random op over
padding, an op the lowering lacks — is left as it was and compiled per exact size; the reason (a
`Refusal`, read with `layout_of(gm)` as a bucketed graph's `BucketLayout` is) is logged, dumped
and shown by the recompile explanation.

    %x: f32[s0, 8]  (padded to B0 at run time)     %x, %true_s0 (a 0-d int input)
    %y = aten.sum.dim_IntList(%x, [0])        ->   %valid = aten.lt.Scalar(arange(B0), %true_s0)
                                                   %m = aten.where.ScalarOther(%valid, %x, 0)
                                                   %y = aten.sum.dim_IntList(%m, [0])
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import operator
from typing import Any

import sympy
import torch

from . import bucket_values
from .bucket_rules import RULES, Refused, attention, rule_by_tag, size_expr
from .bucket_values import ARANGE, CREATION, NEW, SYM_ARITHMETIC
from .context import PassContext

log = logging.getLogger(__name__)
aten = torch.ops.aten

Factors = tuple  # of sympy expressions: one dim as a row-major product
Layout = tuple  # of Factors, one per dim


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a graph is compiled per exact size: what the pass could not prove, and where."""

    reason: str


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """What the runtime needs to run a bucketed graph (tpu_inductor/runtime/buckets.py)."""

    symbols: tuple[str, ...]  # bucketed symbols, the order of the true-size inputs
    sources: dict  # symbol -> (input position, dim) or (input position, None) for a SymInt input
    padded_inputs: tuple  # (position, dim, factors): tensor dims padded to their buckets
    size_inputs: tuple  # (position, size expr): SymInt inputs given its value at the buckets
    true_inputs: tuple  # symbols whose true size is an input, appended in this order
    outputs: tuple  # per output: Layout (tensor to slice), sympy expr (a SymInt), or None
    bounds: dict  # symbol -> the largest bucket the graph allows (None: unbounded)
    keys: dict  # symbol -> a name stable across processes (its source: L['x'].size()[1])
    # (a, b, k): a dim of size a read at positions 0..b+k-1 (a mask read at the keys'): when
    # the true sizes say a == b + k, b is padded to a's bucket less k (one bucket, not two)
    ties: tuple = ()


def layout_of(gm: torch.fx.GraphModule) -> BucketLayout | Refusal | None:
    """What this pass made of `gm`: its bucket layout, why it is not bucketed, or None (no
    policy, or no symbolic size)."""
    return gm.meta.get("bucketing")


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    policy = ctx.options.shapes.policy
    if policy == "exact" or ctx.options.lowering == "torch-mlir":
        return gm
    if not any(isinstance(d, torch.SymInt) for d in _input_dims(gm)):
        return gm
    work = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # a refusal leaves gm untouched
    work.meta.update(gm.meta)
    try:
        layout = _Bucketing(work, ctx).rewrite()
    except Refused as e:
        gm.meta["bucketing"] = Refusal(str(e))
        ctx.rewrites["refused"] += 1
        log.info("tpu_inductor: not bucketing a graph (compiled per exact size): %s", e)
        return gm
    work.meta["bucketing"] = layout
    ctx.rewrites["bucketed_symbols"] += len(layout.symbols)
    return work


def _input_dims(gm):
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            yield from value.shape


class _Bucketing:
    """One analysis and rewrite of a graph; `rewrite()` returns its BucketLayout or raises."""

    def __init__(self, gm: torch.fx.GraphModule, ctx: PassContext):
        self.gm, self.ctx, self.graph = gm, ctx, gm.graph
        self.layouts: dict[torch.fx.Node, Any] = {}
        self.placeholders = list(gm.graph.find_nodes(op="placeholder"))
        self.symbols: dict[sympy.Symbol, tuple] = {}  # symbol -> its source
        self.bounds: dict[str, int | None] = {}
        self.ties: set[tuple[str, str, int]] = set()
        self.true_size: dict[sympy.Symbol, torch.fx.Node] = {}
        self.padded_size: dict[sympy.Symbol, torch.fx.Node] = {}

    # --- analysis ------------------------------------------------------------------------

    def rewrite(self) -> BucketLayout:
        self._find_symbols()
        padded, sizes = self._inputs()
        for node in list(self.graph.nodes):
            if node.op == "call_function":
                self._check_supported(node)
                self.layouts[node] = self._visit(node)
        out = self.graph.find_nodes(op="output")[0]
        outputs = tuple(self._output(v) for v in out.args[0])
        names = tuple(str(s) for s in self.symbols)
        sources = {str(s): src for s, src in self.symbols.items()}
        true_inputs = tuple(str(s) for s in self.true_size)
        keys = {str(s): _source_name(s, self._symint(s)) for s in self.symbols}
        return BucketLayout(
            names,
            sources,
            padded,
            sizes,
            true_inputs,
            outputs,
            dict(self.bounds),
            keys,
            tuple(sorted(self.ties)),
        )

    def _find_symbols(self) -> None:
        for position, node in enumerate(self.placeholders):
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                for dim, d in enumerate(value.shape):
                    expr = size_expr(d)
                    if expr.is_Symbol:
                        self.symbols.setdefault(expr, (position, dim))
        in_shapes = set()
        for node in self.placeholders:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                for d in value.shape:
                    in_shapes |= size_expr(d).free_symbols
        for position, node in enumerate(self.placeholders):
            value = node.meta.get("val")
            expr = size_expr(value) if isinstance(value, torch.SymInt) else None
            if expr is not None and expr.is_Symbol and expr in in_shapes:
                # a size only merged dims show (a backward's [b*s, d]): its SymInt input says it
                self.symbols.setdefault(expr, (position, None))
            if expr in self.symbols:
                self.padded_size.setdefault(expr, node)
        for symbol in self.symbols:
            self.bounds[str(symbol)] = _declared_bound(symbol, self.placeholders)

    def _inputs(self):
        padded, sizes = [], []
        for position, node in enumerate(self.placeholders):
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                layout = self._fresh(value.shape, node)
                self.layouts[node] = layout
                for dim, factors in enumerate(layout):
                    if self._padded(factors):
                        padded.append((position, dim, factors))
            elif isinstance(value, torch.SymInt):
                expr = size_expr(value)
                if expr.free_symbols & set(self.symbols):
                    sizes.append((position, expr))
                    bucket_values.check_uses(self, node)
                elif not node.users:  # a stride of a size-1 dim (the length, at the true size):
                    node.meta["value_only"] = True  # passed as a tensor, not a new signature
        return tuple(padded), tuple(sizes)

    def _check_supported(self, node) -> None:
        supported = self.ctx.supported
        if supported is not None and not supported(node):
            raise Refused(f"{node.name} ({node.target}) has no lowering rule: the graph is split")

    def _fresh(self, shape, node) -> Layout:
        """The layout of a value made from sizes alone: a dim that is a bucketed symbol is padded
        (what fills the padding is whatever the op makes at the bucket's size)."""
        layout = []
        for d in shape:
            expr = size_expr(d)
            order = _FACTOR_ORDERS.get((_shape_env_id(d), expr))
            if order is not None and all(self.symbol_of(f) or f.is_Integer for f in order):
                layout.append(order)  # a merged dim another graph of this code made
                continue
            if expr.free_symbols & set(self.symbols) and self.symbol_of(expr) is None:
                raise Refused(
                    f"{node.name} has a dim of size {expr}: the pass follows only a "
                    "symbol plus a constant, and products of such dims"
                )
            layout.append((expr,))
        return tuple(layout)

    def symbol_of(self, factor) -> tuple | None:
        """(symbol, offset) of a padded factor (`s` or `s - 1` after a slice), else None."""
        free = factor.free_symbols
        if len(free) != 1 or not free <= set(self.symbols):
            return None
        (symbol,) = free
        offset = factor - symbol
        return (symbol, int(offset)) if offset.is_Integer else None

    def _padded(self, factors: Factors) -> bool:
        return any(self.symbol_of(f) for f in factors)

    def _has_padding(self, node) -> bool:
        layout = self.layouts.get(node)
        return isinstance(layout, tuple) and any(
            isinstance(f, tuple) and self._padded(f) for f in layout
        )

    def _visit(self, node) -> Any:
        target, args = node.target, node.args
        value = node.meta.get("val")
        if target is operator.getitem:
            parent = self.layouts.get(args[0])
            return parent[args[1]] if isinstance(parent, list) else None
        if target is aten.sym_size.int or target in SYM_ARITHMETIC:
            if isinstance(value, torch.SymInt) and size_expr(value).free_symbols & set(
                self.symbols
            ):
                bucket_values.check_uses(self, node)
            return None
        padded_in = [a for a in node.all_input_nodes if self._has_padding(a)]
        rule = RULES.get(target) or rule_by_tag(target)
        if rule is not attention and torch.Tag.nondeterministic_seeded in getattr(
            target, "tags", ()
        ):  # attention: dropout is refused by its rule and its lowering
            if padded_in or (isinstance(value, torch.Tensor) and self._shape_padded(value, node)):
                raise Refused(
                    f"{node.name} ({target}) draws random numbers over padded dims: "
                    "an exact compile would draw others"
                )
        if rule is not None and any(
            isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes
        ):
            return rule(self, node)
        if padded_in:
            raise Refused(f"{node.name} ({target}) reads a padded value and has no padding rule")
        if isinstance(value, torch.Tensor):
            return self._creation(node, value)
        if isinstance(value, (tuple, list)):
            return [self._creation(node, v) if isinstance(v, torch.Tensor) else None for v in value]
        return None

    def _shape_padded(self, value, node) -> bool:
        return any(self._padded(f) for f in self._fresh(value.shape, node))

    def _creation(self, node, value) -> Layout:
        """Sizes-only ops (full, arange...) may make padded dims; others of unpadded inputs may
        not (the pass would not know what fills the padding)."""
        creates = node.target in CREATION or node.target in NEW
        if self._shape_padded(value, node) and not (creates or node.target in ARANGE):
            raise Refused(
                f"{node.name} ({node.target}) makes a padded dim from unpadded "
                "inputs, which the pass cannot follow"
            )
        return self._fresh(value.shape, node)

    def layout(self, node) -> Layout:
        layout = self.layouts.get(node)
        if isinstance(layout, tuple):
            return layout
        return self._fresh(node.meta["val"].shape, node)

    def bound(self, symbol, largest: int) -> None:
        """What the graph implies: `symbol` is at most `largest` (its bucket never passes it)."""
        bound = self.bounds.get(str(symbol))
        self.bounds[str(symbol)] = largest if bound is None else min(bound, largest)

    def tie(self, read, positions) -> None:
        """A padded dim of size `read` (a symbol) is read at positions 0..`positions`-1."""
        found = self.symbol_of(positions)
        if read in self.symbols and found is not None and found[0] != read:
            self.ties.add((str(read), str(found[0]), found[1]))

    def fresh_check(self, node, layout) -> Layout:
        for factors in layout:
            for f in factors:
                if f.free_symbols & set(self.symbols) and self.symbol_of(f) is None:
                    raise Refused(
                        f"{node.name} has a dim of size {f}, which the pass cannot follow"
                    )
        return layout

    def replace_input(self, node, index, new) -> None:
        args = list(node.args)
        args[index] = new
        node.args = tuple(args)

    def _output(self, value) -> Any:
        if not isinstance(value, torch.fx.Node):
            return None
        val = value.meta.get("val")
        if isinstance(val, torch.SymInt):  # of bucketed sizes: its value at the true sizes
            expr = size_expr(val)
            return expr if expr.free_symbols & set(self.symbols) else None
        layout = self.layouts.get(value)
        if isinstance(layout, tuple) and self._has_padding(value):
            for d, factors in zip(val.shape, layout):
                if len(factors) > 1:  # the backward takes it merged: it learns the order here
                    _FACTOR_ORDERS[(_shape_env_id(d), size_expr(d))] = factors
            return layout
        return None

    # --- rewriting -----------------------------------------------------------------------

    def insert(self, before, target, args, kwargs=None) -> torch.fx.Node:
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, tuple(args), kwargs or {})
        mode = torch._guards.detect_fake_mode(
            [n.meta["val"] for n in self.placeholders if "val" in n.meta]
        )
        vals = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        with mode if mode is not None else torch._subclasses.fake_tensor.unset_fake_temporarily():
            node.meta["val"] = target(*vals[0], **vals[1])
        return node

    def true_size_of(self, symbol) -> torch.fx.Node:
        if symbol not in self.true_size:
            last = self.placeholders[-1]
            with self.graph.inserting_after(
                self.true_size[list(self.true_size)[-1]] if self.true_size else last
            ):
                node = self.graph.placeholder(f"true_{symbol}")
            node.meta["val"] = self._symint(symbol)
            node.meta["value_only"] = True
            node.meta["bucket_true_size"] = str(symbol)
            self.true_size[symbol] = node
        return self.true_size[symbol]

    def padded_size_of(self, symbol, before) -> Any:
        if symbol not in self.padded_size:
            position, dim = self.symbols[symbol]
            first = next(n for n in self.graph.nodes if n.op != "placeholder")
            self.padded_size[symbol] = self.insert(
                first, aten.sym_size.int, (self.placeholders[position], dim)
            )
        return self.padded_size[symbol]

    def _symint(self, symbol) -> torch.SymInt:
        position, dim = self.symbols[symbol]
        value = self.placeholders[position].meta["val"]
        return value if dim is None else value.shape[dim]

    def size_node(self, expr, before) -> Any:
        """A graph value (or int) of a factor's padded size."""
        if expr.is_Integer:
            return int(expr)
        found = self.symbol_of(expr)
        if found is None:
            raise Refused(f"a factor of size {expr} is not a bucketed symbol")
        return self._offset(before, self.padded_size_of(found[0], before), found[1])

    def true_value(self, expr, before) -> Any:
        """A graph value (or int) of a factor's true size."""
        found = self.symbol_of(expr)
        if found is None:
            return self.size_node(expr, before)
        return self._offset(before, self.true_size_of(found[0]), found[1])

    def _offset(self, before, node, offset: int) -> Any:
        return node if offset == 0 else self.insert(before, operator.add, (node, offset))

    def valid_positions(self, before, factors, ends=None, device=None) -> torch.fx.Node:
        """A 1-d bool over a dim of row-major `factors`: True where every padded factor's index
        is below its true size (`ends`' true sizes, `factors`' own by default)."""
        index = self.insert(
            before, aten.arange.default, (self._dim_size(before, factors),), {"device": device}
        )
        ok = None
        for t, (factor, end) in enumerate(zip(factors, ends or factors)):
            if self.symbol_of(end) is None:
                continue
            j = index
            for f in factors[t + 1 :]:
                j = self.insert(
                    before,
                    aten.div.Tensor_mode,
                    (j, self.size_node(f, before)),
                    {"rounding_mode": "floor"},
                )
            if t > 0:
                j = self.insert(before, aten.remainder.Scalar, (j, self.size_node(factor, before)))
            less = self.insert(before, aten.lt.Scalar, (j, self.true_value(end, before)))
            ok = less if ok is None else self.insert(before, aten.logical_and.default, (ok, less))
        return ok

    def replace(self, node, new, layout) -> None:
        """Every use of `node` but `new`'s own reads `new` (whose layout is `layout`)."""
        for user in list(node.users):
            if user is not new:
                user.replace_input_with(node, new)
        self.layouts[new] = layout

    def mask(self, before, x, dims, fill, layout=None) -> torch.fx.Node:
        """`x` with the padding of `dims` (those that carry any) replaced by `fill`; `layout`:
        whose true sizes say where the padding starts (x's own by default)."""
        own = self.layout(x)
        layout = layout or own
        rank = len(layout)
        valid = None
        for dim in dims:
            factors, ends = own[dim], layout[dim]
            if not self._padded(ends):
                continue
            ok = self.valid_positions(before, factors, ends, x.meta["val"].device)
            shape = [1] * rank
            shape[dim] = -1
            ok = self.insert(before, aten.view.default, (ok, shape))
            valid = (
                ok if valid is None else self.insert(before, aten.logical_and.default, (valid, ok))
            )
        if valid is None:
            return x
        if (
            isinstance(fill, float)
            and math.isinf(fill)
            and not x.meta["val"].dtype.is_floating_point
        ):
            fill = _integer_extreme(x.meta["val"].dtype, fill)  # max/min identities of integers
        elif isinstance(fill, float) and not x.meta["val"].dtype.is_floating_point:
            fill = int(fill)  # F.pad's value of an integer tensor: where() would promote it
        masked = self.insert(before, aten.where.ScalarOther, (valid, x, fill))
        self.layouts[masked] = own
        self.ctx.rewrites["masks"] += 1
        return masked

    def _dim_size(self, before, factors) -> Any:
        size = 1
        for f in factors:
            part = self.size_node(f, before)
            size = (
                part
                if size == 1
                else (
                    size * part
                    if isinstance(part, int) and isinstance(size, int)
                    else self.insert(before, operator.mul, (size, part))
                )
            )
        return size

    def true_count(self, before, layout, dims) -> Any:
        """The number of real elements over `dims`: static sizes times true sizes."""
        count = 1
        for dim in dims:
            for f in layout[dim]:
                part = self.true_value(f, before)
                if isinstance(part, int) and isinstance(count, int):
                    count *= part
                else:
                    count = part if count == 1 else self.insert(before, operator.mul, (count, part))
        return count


# The row-major factors of merged padded dims that graphs returned (a forward's saved `[b*s, d]`),
# by shape environment and size expression: the backward's input is read with the same order.
_FACTOR_ORDERS: dict = {}


def _shape_env_id(d) -> int | None:
    return id(d.node.shape_env) if isinstance(d, torch.SymInt) else None


def _source_name(symbol, value: torch.SymInt) -> str:
    """What Dynamo says the symbol is the size of (a plan's key); the symbol's name if nothing."""
    sources = value.node.shape_env.var_to_sources.get(symbol) or ()
    if not sources:
        return str(symbol)
    name = sources[0].name  # a method in older torch, a property in newer
    return name() if callable(name) else name


def _declared_bound(symbol, placeholders) -> int | None:
    """`mark_dynamic(max=...)` or a range the shape environment knows."""
    for node in placeholders:
        value = node.meta.get("val")
        for d in getattr(value, "shape", ()):
            if isinstance(d, torch.SymInt) and d.node.expr == symbol:
                upper = d.node.shape_env.var_to_range[symbol].upper
                return int(upper) if upper.is_Integer and int(upper) < 2**62 else None
    return None


def _integer_extreme(dtype, fill):
    if dtype == torch.bool:
        return fill > 0
    info = torch.iinfo(dtype)
    return info.max if fill > 0 else info.min
