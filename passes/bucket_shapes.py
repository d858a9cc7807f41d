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
size it cannot follow (`s + 1`), a symbol's value used as a number, a random op over padding,
an op the lowering lacks — is left as it was and compiled per exact size; the reason is kept in
`gm.meta["bucketing"]` (a `Refusal`), logged, dumped and shown by the recompile explanation.

    %x: f32[s0, 8]  (padded to B0 at run time)     %x, %true_s0 (a 0-d int input)
    %y = aten.sum.dim_IntList(%x, [0])        ->   %valid = aten.lt.Scalar(arange(B0), %true_s0)
                                                   %m = aten.where.ScalarOther(%valid, %x, 0)
                                                   %y = aten.sum.dim_IntList(%m, [0])
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from typing import Any

import sympy
import torch

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
    """What the runtime needs to run a bucketed graph (tpu_inductor/bucketing.py)."""

    symbols: tuple[str, ...]  # bucketed symbols, the order of the true-size inputs
    sources: dict  # symbol -> (input position, dim) or (input position, None) for a SymInt input
    padded_inputs: tuple  # (position, dim, symbol): tensor dims to pad to the bucket
    size_inputs: tuple  # (position, symbol): SymInt inputs given the bucket
    true_inputs: tuple  # symbols whose true size is an input, appended in this order
    outputs: tuple  # per output: Layout (tensor to slice), sympy expr (a SymInt), or None
    bounds: dict  # symbol -> the largest bucket the graph allows (None: unbounded)


class _Refused(Exception):
    pass


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    policy = ctx.options.shapes.policy
    if policy == "exact" or ctx.options.lowering == "torch-mlir":
        return gm
    if not any(isinstance(d, torch.SymInt) for d in _input_dims(gm)):
        return gm
    try:
        layout = _Bucketing(gm, ctx).rewrite()
    except _Refused as e:
        gm.meta["bucketing"] = Refusal(str(e))
        ctx.rewrites["refused"] += 1
        log.info("tpu_inductor: not bucketing a graph (compiled per exact size): %s", e)
        return gm
    gm.meta["bucketing"] = layout
    ctx.rewrites["bucketed_symbols"] += len(layout.symbols)
    return gm


def _input_dims(gm):
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            yield from value.shape


def _expr(d) -> sympy.Expr:
    return d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(int(d))


_POINTWISE_EXTRA = {aten._to_copy.default, aten.alias.default, aten.detach.default}
_POINTWISE_EXTRA |= {aten.lift_fresh_copy.default, aten.copy.default}
_CREATION = {aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format}
_CREATION |= {aten.scalar_tensor.default, aten.empty_strided.default}
_NEW = {aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}
_NEW |= {aten.new_empty.default, aten.new_empty_strided.default}
_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# Reductions: op -> (identity to mask padding with, where its dims are: an arg index or "all").
_REDUCE = {
    aten.sum.dim_IntList: (0, 1),
    aten.sum.default: (0, "all"),
    aten.amax.default: (-math.inf, 1),
    aten.amin.default: (math.inf, 1),
    aten.max.dim: (-math.inf, 1),
    aten.min.dim: (math.inf, 1),
    aten.argmax.default: (-math.inf, 1),
    aten.argmin.default: (math.inf, 1),
    aten.logsumexp.default: (-math.inf, 1),
    aten._softmax.default: (-math.inf, 1),
    aten._log_softmax.default: (-math.inf, 1),
    aten.any.dim: (False, 1),
    aten.any.dims: (False, 1),
    aten.all.dim: (True, 1),
    aten.prod.dim_int: (1, 1),
    aten.cumsum.default: (0, 1),
}
_KEEPS_DIMS = {aten._softmax.default, aten._log_softmax.default, aten.cumsum.default}
_MEAN = {aten.mean.dim: 1, aten.mean.default: "all"}


class _Bucketing:
    """One analysis and rewrite of a graph; `rewrite()` returns its BucketLayout or raises."""

    def __init__(self, gm: torch.fx.GraphModule, ctx: PassContext):
        self.gm, self.ctx, self.graph = gm, ctx, gm.graph
        self.layouts: dict[torch.fx.Node, Any] = {}
        self.placeholders = list(gm.graph.find_nodes(op="placeholder"))
        self.symbols: dict[sympy.Symbol, tuple] = {}  # symbol -> its source
        self.bounds: dict[str, int | None] = {}
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
        return BucketLayout(names, sources, padded, sizes, true_inputs, outputs, dict(self.bounds))

    def _find_symbols(self) -> None:
        for position, node in enumerate(self.placeholders):
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                for dim, d in enumerate(value.shape):
                    expr = _expr(d)
                    if expr.is_Symbol:
                        self.symbols.setdefault(expr, (position, dim))
        for position, node in enumerate(self.placeholders):
            value = node.meta.get("val")
            if isinstance(value, torch.SymInt) and _expr(value) in self.symbols:
                self.padded_size.setdefault(_expr(value), node)
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
                        padded.append((position, dim, str(factors[0])))
            elif isinstance(value, torch.SymInt):
                expr = _expr(value)
                if expr in self.symbols:
                    sizes.append((position, str(expr)))
                    self._check_size_uses(node)
                elif expr.free_symbols & set(self.symbols):
                    raise _Refused(f"input {node.name} is the size expression {expr}")
        return tuple(padded), tuple(sizes)

    def _check_supported(self, node) -> None:
        supported = getattr(self.ctx, "supported", None)
        if supported is not None and not supported(node):
            raise _Refused(f"{node.name} ({node.target}) has no lowering rule: the graph is split")

    def _fresh(self, shape, node) -> Layout:
        """The layout of a value made from sizes alone: a dim that is a bucketed symbol is padded
        (what fills the padding is whatever the op makes at the bucket's size)."""
        layout = []
        for d in shape:
            expr = _expr(d)
            if expr.free_symbols & set(self.symbols) and not expr.is_Symbol:
                raise _Refused(f"{node.name} has a dim of size {expr}: the pass follows only whole "
                               "symbols and products of them")
            layout.append((expr,))
        return tuple(layout)

    def _padded(self, factors: Factors) -> bool:
        return any(f in self.symbols for f in factors)

    def _has_padding(self, node) -> bool:
        layout = self.layouts.get(node)
        return isinstance(layout, tuple) and any(
            isinstance(f, tuple) and self._padded(f) for f in layout
        )

    def _check_size_uses(self, node) -> None:
        """A symbol's value may only become sizes: compiled at the bucket, a value would be
        the bucket's, not the true size's."""
        for user in node.users:
            if user.op == "output":
                continue
            if user.op == "call_function" and user.target in _SYM_ARITHMETIC:
                self._check_size_uses(user)
                continue
            if user.op == "call_function" and _size_argument_only(user, node):
                continue
            raise _Refused(f"the value of size {node.name} reaches {user.name} ({user.target}), "
                           "not as a size")

    def _visit(self, node) -> Any:
        target, args = node.target, node.args
        value = node.meta.get("val")
        if target is operator.getitem:
            parent = self.layouts.get(args[0])
            return parent[args[1]] if isinstance(parent, list) else None
        if target is aten.sym_size.int or target in _SYM_ARITHMETIC:
            if isinstance(value, torch.SymInt) and _expr(value).free_symbols & set(self.symbols):
                self._check_size_uses(node)
            return None
        padded_in = [a for a in node.all_input_nodes if self._has_padding(a)]
        rule = _RULES.get(target) or _rule_by_tag(target)
        if rule is not _attention and torch.Tag.nondeterministic_seeded in getattr(
            target, "tags", ()
        ):  # attention: dropout is refused by its rule and its lowering
            if padded_in or (isinstance(value, torch.Tensor) and self._shape_padded(value, node)):
                raise _Refused(f"{node.name} ({target}) draws random numbers over padded dims: "
                               "an exact compile would draw others")
        if rule is not None and any(
            isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes
        ):
            return rule(self, node)
        if padded_in:
            raise _Refused(f"{node.name} ({target}) reads a padded value and has no padding rule")
        if isinstance(value, torch.Tensor):
            return self._creation(node, value)
        if isinstance(value, (tuple, list)):
            return [self._creation(node, v) if isinstance(v, torch.Tensor) else None
                    for v in value]
        return None

    def _shape_padded(self, value, node) -> bool:
        return any(self._padded(f) for f in self._fresh(value.shape, node))

    def _creation(self, node, value) -> Layout:
        """Sizes-only ops (full, arange...) may make padded dims; others of unpadded inputs may
        not (the pass would not know what fills the padding)."""
        creates = node.target in _CREATION or node.target in _NEW
        if self._shape_padded(value, node) and not (creates or node.target in _ARANGE):
            raise _Refused(f"{node.name} ({node.target}) makes a padded dim from unpadded "
                           "inputs, which the pass cannot follow")
        return self._fresh(value.shape, node)

    def layout(self, node) -> Layout:
        layout = self.layouts.get(node)
        if isinstance(layout, tuple):
            return layout
        return self._fresh(node.meta["val"].shape, node)

    def fresh_check(self, node, layout) -> Layout:
        for factors in layout:
            for f in factors:
                if f.free_symbols & set(self.symbols) and not f.is_Symbol:
                    raise _Refused(f"{node.name} has a dim of size {f}, which the pass cannot "
                                   "follow")
        return layout

    def replace_input(self, node, index, new) -> None:
        args = list(node.args)
        args[index] = new
        node.args = tuple(args)

    def _output(self, value) -> Any:
        if not isinstance(value, torch.fx.Node):
            return None
        val = value.meta.get("val")
        if isinstance(val, torch.SymInt):
            return _expr(val)
        layout = self.layouts.get(value)
        if isinstance(layout, tuple) and self._has_padding(value):
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
        return self.placeholders[position].meta["val"].shape[dim]

    def size_node(self, expr, before) -> Any:
        """A graph value (or int) of a factor's padded size."""
        if expr.is_Integer:
            return int(expr)
        if expr in self.symbols:
            return self.padded_size_of(expr, before)
        raise _Refused(f"a factor of size {expr} is not a bucketed symbol")

    def mask(self, before, x, dims, fill) -> torch.fx.Node:
        """`x` with the padding of `dims` (those that carry any) replaced by `fill`."""
        layout = self.layout(x)
        rank = len(layout)
        valid = None
        for dim in dims:
            factors = layout[dim]
            if not self._padded(factors):
                continue
            index = self.insert(before, aten.arange.default, (self._dim_size(before, factors),),
                                {"device": x.meta["val"].device})
            ok = None
            for t, factor in enumerate(factors):
                if factor not in self.symbols:
                    continue
                j, stride = index, factors[t + 1:]
                for f in stride:
                    j = self.insert(before, aten.div.Tensor_mode, (j, self.size_node(f, before)),
                                    {"rounding_mode": "floor"})
                if t > 0:
                    j = self.insert(before, aten.remainder.Scalar,
                                    (j, self.size_node(factor, before)))
                less = self.insert(before, aten.lt.Scalar, (j, self.true_size_of(factor)))
                ok = less if ok is None else self.insert(before, aten.logical_and.default,
                                                         (ok, less))
            shape = [1] * rank
            shape[dim] = -1
            ok = self.insert(before, aten.view.default, (ok, shape))
            valid = ok if valid is None else self.insert(before, aten.logical_and.default,
                                                         (valid, ok))
        if valid is None:
            return x
        if isinstance(fill, float) and not x.meta["val"].dtype.is_floating_point:
            fill = _integer_extreme(x.meta["val"].dtype, fill)
        masked = self.insert(before, aten.where.ScalarOther, (valid, x, fill))
        self.layouts[masked] = layout
        self.ctx.rewrites["masks"] += 1
        return masked

    def _dim_size(self, before, factors) -> Any:
        size = 1
        for f in factors:
            part = self.size_node(f, before)
            size = part if size == 1 else (
                size * part if isinstance(part, int) and isinstance(size, int)
                else self.insert(before, operator.mul, (size, part))
            )
        return size

    def true_count(self, before, layout, dims) -> Any:
        """The number of real elements over `dims`: static sizes times true sizes."""
        count = 1
        for dim in dims:
            for f in layout[dim]:
                part = self.true_size_of(f) if f in self.symbols else self.size_node(f, before)
                if isinstance(part, int) and isinstance(count, int):
                    count *= part
                else:
                    count = part if count == 1 else self.insert(before, operator.mul, (count, part))
        return count


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


_SYM_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod}
_SYM_ARITHMETIC |= {torch.sym_max, torch.sym_min}


def _size_argument_only(user, node) -> bool:
    """Whether every occurrence of `node` among `user`'s arguments is a size."""
    target, args = user.target, list(user.args)
    if target in _VIEWS or target is aten.expand.default or target in _NEW:
        positions = [1]
    elif target in _CREATION:
        positions = [0]
    elif target is aten.arange.default:
        positions = [0]
    elif target in (aten.arange.start, aten.arange.start_step) and args[0] == 0:
        positions = [1]  # arange(0, n): n is its length
    elif target is aten.slice.Tensor:
        positions = [3]
    elif target is aten.sym_size.int:
        return True
    else:
        return False
    for i, a in enumerate(args):
        inside = node in torch.fx.node.map_aggregate(a, lambda v: v) if isinstance(
            a, (list, tuple)) else a is node
        if inside and i not in positions:
            return False
    return not any(node is v for v in user.kwargs.values())


# --- rules: (analysis, node) -> the result's layout, masking inputs as the op needs -------------


def _dims_arg(node, where, rank):
    if where == "all":
        return list(range(rank))
    dims = node.args[where] if len(node.args) > where else node.kwargs.get("dim")
    if dims is None or dims == []:
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [d % max(rank, 1) for d in dims]


def _keepdim(node, index) -> bool:
    return bool(node.args[index]) if len(node.args) > index else node.kwargs.get("keepdim", False)


def _reduced(layout, dims, keepdim):
    if keepdim:
        return tuple((sympy.Integer(1),) if i in dims else f for i, f in enumerate(layout))
    return tuple(f for i, f in enumerate(layout) if i not in dims)


def _reduce(b, node):
    fill, where = _REDUCE[node.target]
    x = node.args[0]
    layout = b.layout(x)
    dims = _dims_arg(node, where, len(layout))
    b.replace_input(node, 0, b.mask(node, x, dims, fill))
    if node.target in _KEEPS_DIMS:
        return layout
    out = _reduced(layout, dims, where != "all" and _keepdim(node, 2))
    return [out, out] if node.target in (aten.max.dim, aten.min.dim) else out


def _mean(b, node):
    x = node.args[0]
    layout = b.layout(x)
    dims = _dims_arg(node, _MEAN[node.target], len(layout))
    keepdim = node.target is aten.mean.dim and _keepdim(node, 2)
    out = _reduced(layout, dims, keepdim)
    if not any(b._padded(layout[d]) for d in dims):
        return out
    dtype = node.kwargs.get("dtype") or (node.args[3] if len(node.args) > 3 else None)
    total = b.insert(
        node, aten.sum.dim_IntList, (b.mask(node, x, dims, 0), dims, keepdim), {"dtype": dtype}
    )
    mean = b.insert(node, aten.div.Tensor, (total, b.true_count(node, layout, dims)))
    node.replace_all_uses_with(mean)
    b.graph.erase_node(node)
    b.ctx.rewrites["means"] += 1
    b.layouts[mean] = out
    return out


def _broadcast(b, node):
    shape = node.meta["val"].shape
    rank = len(shape)
    out = [(_expr(d),) for d in shape]
    for a in node.all_input_nodes:
        value = a.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        layout = b.layout(a)
        for i, factors in enumerate(layout):
            o = rank - len(layout) + i
            if b._padded(factors):
                if b._padded(out[o]) and out[o] != factors:
                    raise _Refused(f"{node.name}: operands padded differently in dim {o}")
                out[o] = factors
    return tuple(out)


def _view(b, node):
    """Regroup the input's factors into the output's dims (static factors may split); a padded
    factor that would be split, or merged with one it is not next to, cannot be followed."""
    factors = [f for dim in b.layout(node.args[0]) for f in dim if f != 1]
    out, i = [], 0
    for d in node.meta["val"].shape:
        remaining, group = _expr(d), []
        while remaining != 1:
            if i >= len(factors):
                raise _Refused(f"{node.name} ({node.target}) reshapes a padded dim across dims")
            f = factors[i]
            if f.is_Integer and remaining.is_Integer and f > remaining:
                if f % remaining:
                    raise _Refused(f"{node.name} ({node.target}) splits a dim unevenly")
                group.append(remaining)
                factors[i], remaining = f // remaining, sympy.Integer(1)
                continue
            quotient = sympy.cancel(remaining / f)
            if not quotient.as_numer_denom()[1].is_Integer or (
                quotient.is_Rational and not quotient.is_Integer
            ):
                raise _Refused(f"{node.name} ({node.target}) reshapes a padded dim across dims")
            group.append(f)
            remaining, i = quotient, i + 1
        out.append(tuple(group) or (sympy.Integer(1),))
    if i < len(factors):
        raise _Refused(f"{node.name} ({node.target}) reshapes a padded dim across dims")
    return tuple(out)


def _permute(b, node):
    layout = b.layout(node.args[0])
    if node.target is aten.permute.default:
        return tuple(layout[d % len(layout)] for d in node.args[1])
    if node.target is aten.t.default:
        return tuple(reversed(layout))
    i, j = (d % len(layout) for d in node.args[1:3])
    out = list(layout)
    out[i], out[j] = out[j], out[i]
    return tuple(out)


def _unsqueeze(b, node):
    layout = list(b.layout(node.args[0]))
    layout.insert(node.args[1] % (len(layout) + 1), (sympy.Integer(1),))
    return tuple(layout)


def _squeeze(b, node):
    layout = b.layout(node.args[0])
    shape = node.args[0].meta["val"].shape
    dims = list(range(len(layout))) if len(node.args) < 2 else node.args[1]
    dims = {d % len(layout) for d in ([dims] if isinstance(dims, int) else dims)}
    return tuple(f for i, f in enumerate(layout) if not (i in dims and _expr(shape[i]) == 1))


def _expand(b, node):
    layout = b.layout(node.args[0])
    shape = node.meta["val"].shape
    extra = len(shape) - len(layout)
    out = [(_expr(d),) for d in shape[:extra]]
    for i, factors in enumerate(layout):
        out.append(factors if factors != (sympy.Integer(1),) else (_expr(shape[extra + i]),))
    return b.fresh_check(node, tuple(out))


def _slice(b, node):
    x = node.args[0]
    layout = b.layout(x)
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(layout)
    out_size = _expr(node.meta["val"].shape[dim])
    in_size = _expr(x.meta["val"].shape[dim])
    start = node.args[2] if len(node.args) > 2 else 0
    step = node.args[4] if len(node.args) > 4 else 1
    if b._padded(layout[dim]):
        if start not in (0, None) or step != 1 or out_size != in_size:
            raise _Refused(f"{node.name}: a slice of a padded dim that is not all of it")
        return layout
    out = list(layout)
    out[dim] = (out_size,)
    if out_size in b.symbols:  # a table sliced to a length: real rows first, valid padding
        if start not in (0, None) or step != 1 or not in_size.is_Integer:
            raise _Refused(f"{node.name}: a slice to a padded length must start at 0")
        bound = b.bounds.get(str(out_size))
        b.bounds[str(out_size)] = int(in_size) if bound is None else min(bound, int(in_size))
    return b.fresh_check(node, tuple(out))


def _along_unpadded(b, node, dim_index, what):
    layout = b.layout(node.args[0])
    dim = (node.args[dim_index] if len(node.args) > dim_index else 0) % len(layout)
    if b._padded(layout[dim]):
        raise _Refused(f"{node.name} ({node.target}) {what} a padded dim")
    return layout, dim


def _select(b, node):
    layout, dim = _along_unpadded(b, node, 1, "selects in")
    return tuple(f for i, f in enumerate(layout) if i != dim)


def _split(b, node):
    layout, dim = _along_unpadded(b, node, 2, "splits")
    outs = []
    for v in node.meta["val"]:
        out = list(layout)
        out[dim] = (_expr(v.shape[dim]),)
        outs.append(tuple(out))
    return outs


def _cat(b, node):
    rank = len(node.meta["val"].shape)
    dim = (node.args[1] if len(node.args) > 1 else 0) % rank
    nonempty = [t for t in node.args[0] if all(_expr(d) != 0 for d in t.meta["val"].shape)]
    if len(nonempty) == 1:
        return b.layout(nonempty[0])  # the others are empty (a cache before its first entry)
    if any(b._padded(b.layout(t)[dim]) for t in nonempty):
        raise _Refused(f"{node.name} concatenates along a padded dim")
    out = list(_broadcast(b, node))
    out[dim] = (_expr(node.meta["val"].shape[dim]),)
    return tuple(out)


def _contract(b, node):
    """mm, bmm, addmm: a padded contracted dim masked to 0 in both operands."""
    first = 1 if node.target is aten.addmm.default else 0
    a, w = node.args[first], node.args[first + 1]
    la, lw = b.layout(a), b.layout(w)
    r = len(la)
    if b._padded(la[r - 1]) or b._padded(lw[r - 2]):
        b.replace_input(node, first, b.mask(node, a, [r - 1], 0))
        b.replace_input(node, first + 1, b.mask(node, w, [r - 2], 0))
    batch = [la[0] if b._padded(la[0]) else lw[0]] if r == 3 else []
    return tuple([*batch, la[r - 2], lw[r - 1]])


def _embedding(b, node):
    weight, indices = node.args[:2]
    if b._has_padding(weight):
        raise _Refused(f"{node.name}: an embedding table with padded rows")
    return (*b.layout(indices), (_expr(node.meta["val"].shape[-1]),))


def _layer_norm_layouts(b, node, x, normalized):
    layout = b.layout(x)
    k = len(normalized)
    if any(b._padded(f) for f in layout[len(layout) - k :]):
        raise _Refused(f"{node.name}: layer norm over a padded dim")
    return layout, k


def _layer_norm(b, node):
    layout, k = _layer_norm_layouts(b, node, node.args[0], node.args[1])
    stats = layout[: len(layout) - k] + ((sympy.Integer(1),),) * k
    return [layout, stats, stats]


def _layer_norm_backward(b, node):
    layout, k = _layer_norm_layouts(b, node, node.args[1], node.args[2])
    leading = list(range(len(layout) - k))
    for index in (0, 1, 3, 4):  # grad, x, mean, rstd: the weight and bias grads sum over rows
        b.replace_input(node, index, b.mask(node, node.args[index], leading, 0))
    params = tuple((_expr(d),) for d in node.args[1].meta["val"].shape[len(layout) - k :])
    return [layout, params, params]


def _softmax_backward(b, node):
    grad, out, dim = node.args[:3]
    dim %= len(b.layout(grad))
    b.replace_input(node, 0, b.mask(node, grad, [dim], 0))
    b.replace_input(node, 1, b.mask(node, out, [dim], 0))
    return b.layout(grad)


def _embedding_backward(b, node):
    grad, indices = node.args[:2]
    b.replace_input(node, 0, b.mask(node, grad, list(range(len(b.layout(indices)))), 0))
    return tuple((_expr(d),) for d in node.meta["val"].shape)


def _nll_forward(b, node):
    x, target, _, reduction, ignore_index = node.args[:5]
    b.replace_input(node, 0, b.mask(node, x, [0], 0))
    b.replace_input(node, 1, b.mask(node, target, [0], ignore_index))
    return [b.layout(target) if reduction == 0 else (), ()]


def _nll_backward(b, node):
    b.replace_input(node, 2, b.mask(node, node.args[2], [0], node.args[5]))
    return b.layout(node.args[1])


def _attention(b, node):
    """Causal attention over one padded length: real queries never see padded keys; every
    padded operand is zeroed, so that 0 · NaN never reaches a real position."""
    backward = node.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    q, k, v = node.args[1:4] if backward else node.args[:3]
    causal = node.args[7 if backward else 4] if len(node.args) > (7 if backward else 4) else False
    lq, lk, lv = b.layout(q), b.layout(k), b.layout(v)
    if node.args[6 if backward else 3] if len(node.args) > (6 if backward else 3) else 0:
        raise _Refused(f"{node.name}: attention with dropout over padded dims")
    if node.kwargs.get("attn_mask") is not None and b._padded(lk[2]):
        raise _Refused(f"{node.name}: attention with a mask over padded keys")
    if b._padded(lk[2]) and not (causal and lq[2] == lk[2]):
        raise _Refused(f"{node.name}: non-causal attention over padded keys")
    for index, a in enumerate(node.args[: 6 if backward else 3]):
        if isinstance(a, torch.fx.Node):
            b.replace_input(node, index, b.mask(node, a, list(range(len(b.layout(a)))), 0))
    if backward:
        return [lq, lk, lv]
    return [(*lq[:3], lv[3]), lq[:3]]


def _pointwise(b, node):
    return _broadcast(b, node)


_RULES = {
    **dict.fromkeys(_REDUCE, _reduce),
    **dict.fromkeys(_MEAN, _mean),
    **dict.fromkeys(_VIEWS, _view),
    **dict.fromkeys(_POINTWISE_EXTRA, _pointwise),
    **dict.fromkeys((aten.permute.default, aten.transpose.int, aten.t.default), _permute),
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.squeeze.default: _squeeze,
    aten.expand.default: _expand,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.cat.default: _cat,
    **dict.fromkeys((aten.mm.default, aten.bmm.default, aten.addmm.default), _contract),
    aten.embedding.default: _embedding,
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _softmax_backward,
    aten.embedding_dense_backward.default: _embedding_backward,
    aten.nll_loss_forward.default: _nll_forward,
    aten.nll_loss_backward.default: _nll_backward,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _attention,
}


def _rule_by_tag(target):
    return _pointwise if torch.Tag.pointwise in getattr(target, "tags", ()) else None
