"""The pattern table of the attention fusion (passes/fuse_attention.py), one line per form.

Patterns are torch's pattern-matcher expressions (torch._inductor.pattern_matcher), built at
the first use, not at import (importing the matcher imports Inductor). A written-out attention
is read from its softmax outwards, one step at a time: each step below is one ATen node between
the scores `q·kᵀ` and the softmax, matched by its pattern; `x` is the way on towards the scores.

    s * c, s / c                      -> scale (a number, or a 0-d tensor: applied to q)
    s + m                             -> additive mask m (float)
    where(m, s, fill), where(m, fill, s), masked_fill(s, m, fill)
                                      -> bool mask (fill -inf, or a finite one no score reaches)
    s.to(dtype)                       -> nothing (the op computes in float32)

After the softmax: converts, a clone (dropout in eval), and `_safe_softmax`'s zeroing of rows
that are all -inf as core ATen decomposes it (`safe_softmax_guard`).

Operands of the two batched matmuls, `view(expand(t))` or `view(clone(expand(t)))` of the 4-d
tensor t, are read back to t; K/V repeated for grouped-query attention
(`view(clone(expand(unsqueeze(t, 2))))`, HF's repeat_kv, through the whole-dim slices of
`t[:, :, None]` at symbolic sizes) are read back to their own heads.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch

aten = torch.ops.aten
prims = torch.ops.prims

SOFTMAX = {aten._softmax.default: False, aten._safe_softmax.default: True}  # → safe
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
CONVERTS = (aten._to_copy.default, prims.convert_element_type.default)
AFTER_SOFTMAX = (*CONVERTS, aten.clone.default)  # converts, dropout in eval (a clone)


class Step(NamedTuple):
    name: str
    kind: str  # "scale", "inverse_scale", "bias", "keep", "drop", "convert"
    pattern: Any


@functools.cache
def steps() -> tuple[Step, ...]:
    """The steps between the scores and the softmax, as torch pattern-matcher expressions."""
    from torch._inductor.pattern_matcher import CallFunction, KeywordArg

    x, m, c, fill = (KeywordArg(n) for n in ("x", "m", "c", "fill"))
    return (
        Step("mul", "scale", CallFunction(aten.mul.Tensor, x, c)),  # s * c
        Step("mul_left", "scale", CallFunction(aten.mul.Tensor, c, x)),  # c * s
        Step("mul_scalar", "scale", CallFunction(aten.mul.Scalar, x, c)),  # s * c
        Step("div", "inverse_scale", CallFunction(aten.div.Tensor, x, c)),  # s / c
        Step("div_scalar", "inverse_scale", CallFunction(aten.div.Scalar, x, c)),  # s / c
        Step("add", "bias", CallFunction(aten.add.Tensor, x, m)),  # s + m
        Step("add_left", "bias", CallFunction(aten.add.Tensor, m, x)),  # m + s
        Step("where", "keep", CallFunction(aten.where.self, m, x, fill)),  # where(m, s, -inf)
        Step("where_fill", "drop", CallFunction(aten.where.self, m, fill, x)),  # where(m, -inf, s)
        Step("masked_fill", "drop", CallFunction(aten.masked_fill.Scalar, x, m, fill)),
        Step("masked_fill_t", "drop", CallFunction(aten.masked_fill.Tensor, x, m, fill)),
        Step("to_copy", "convert", CallFunction(aten._to_copy.default, x, dtype=c)),  # s.to(t)
        Step("convert", "convert", CallFunction(prims.convert_element_type.default, x, c)),
    )


@functools.cache
def safe_softmax_guard():
    """`_safe_softmax(x)` as core ATen decomposes it: rows of x that are all -inf → 0.

    where(~any(~(x == -inf), -1, keepdim), full_like(softmax(x), 0), softmax(x))
    """
    from torch._inductor.pattern_matcher import CallFunction, KeywordArg

    x, softmax, dim = KeywordArg("x"), KeywordArg("softmax"), KeywordArg("dim")
    finite = CallFunction(aten.logical_not.default, CallFunction(aten.eq.Scalar, x, -math.inf))
    empty = CallFunction(aten.logical_not.default, CallFunction(aten.any.dim, finite, dim, True))
    zeros = CallFunction(aten.full_like.default, softmax, 0)
    return CallFunction(aten.where.self, empty, zeros, softmax)


def match_step(node: torch.fx.Node):
    """Every (step, captured values) of the table that `node` matches."""
    from torch._inductor.pattern_matcher import is_match

    found = []
    for step in steps():
        m = step.pattern.match(node)
        if is_match(m):
            found.append((step, m.kwargs))
    return found


def _call(node: Any, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def matmul_operand(node: torch.fx.Node, rank: int) -> torch.fx.Node | None:
    """The rank-`rank` tensor a bmm operand was made from: t of view(expand(t)) or
    view(clone(expand(t))) (what matmul makes of a 4-d operand), the operand itself for 3-d."""
    inner = node.args[0] if _call(node, VIEWS) else None
    if _call(inner, (aten.clone.default,)):
        inner = inner.args[0]
    if _call(inner, (aten.expand.default,)):
        t = inner.args[0]
        if t.meta["val"].dim() == rank and same(t.meta["val"].shape, inner.meta["val"].shape):
            return t
    return node if rank == 3 else None


def broadcast_heads(t: torch.fx.Node, full_shape) -> torch.fx.Node | None:
    """`t` if its heads (dim -3) broadcast to `full_shape`'s and every other dim is equal."""
    shape = tuple(t.meta["val"].shape)
    if len(shape) != len(full_shape) or len(shape) < 3:
        return None
    rest = [i for i in range(len(shape)) if i != len(shape) - 3]
    equal = same([shape[i] for i in rest], [full_shape[i] for i in rest])
    heads = same(shape[-3:-2], (1,)) or same(shape[-3:-2], full_shape[-3:-2])
    return t if equal and heads else None


def repeated_heads(t: torch.fx.Node) -> torch.fx.Node:
    """K or V heads repeated for grouped-query attention, read back to the unrepeated tensor:
    reshape(clone?(expand(unsqueeze(kv, -3), [..., hkv, g, s, d])), [..., hkv * g, s, d]) or
    expand(kv, [..., h, s, d]) of one head (MQA). Anything else: `t` itself."""
    if _call(t, (aten.expand.default,)):
        source = broadcast_heads(t.args[0], tuple(t.meta["val"].shape))
        return t if source is None else source
    if not _call(t, VIEWS):
        return t
    inner = t.args[0]
    if _call(inner, (aten.clone.default,)):
        inner = inner.args[0]
    if not _call(inner, (aten.expand.default,)):
        return t
    unsqueeze = whole(inner.args[0])
    if not _call(unsqueeze, (aten.unsqueeze.default,)):
        return t
    kv = whole(unsqueeze.args[0])
    rank = kv.meta["val"].dim()
    if rank < 3 or unsqueeze.args[1] not in (rank - 2, -3):
        return t
    heads, spread = kv.meta["val"].shape, inner.meta["val"].shape  # [..., hkv, g, s, d]
    repeated = (*heads[:-3], heads[-3] * spread[-3], *heads[-2:])
    keeps = same(spread[:-3], heads[:-2]) and same(spread[-2:], heads[-2:])
    return kv if keeps and same(t.meta["val"].shape, repeated) else t


def whole(node: torch.fx.Node) -> torch.fx.Node:
    """`node` read through slices that keep the whole dim (`t[:, :, None]` at symbolic sizes
    leaves `slice(t, d, 0, 2**63 - 1)` in the graph; at concrete sizes it is traced away)."""
    while (
        _call(node, (aten.slice.Tensor,))
        and node.args[2:3] in ((), (None,), (0,))
        and node.args[4:5] in ((), (1,))
        and same(node.meta["val"].shape, node.args[0].meta["val"].shape)
    ):
        node = node.args[0]
    return node


def same(a, b) -> bool:
    """Sizes provably equal (symbolic sizes too), without adding a guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))
