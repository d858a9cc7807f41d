"""fuse_norms: a written-out RMSNorm or LayerNorm → one `tpu_inductor::norm` op
(tpu_inductor/ops/norm.py; option `fusion.norms`). Rewrites, each counted in `ctx.rewrites`:

    Hugging Face's LlamaRMSNorm (Qwen, Mistral, T5 alike), over the last dim:
    a = x.to(float32)?; r = rsqrt(mean(a ** 2 | a * a, -1, keepdim) + eps)
    w * (x' * r).to(dtype)?                     (x' is a, or x: T5 multiplies the uncast x)
        -> norm(a, w, None, eps, centered=False, ...)                          # rms_norm
    a hand-written LayerNorm:
    m = mean(x, -1, keepdim); v = mean((x - m) ** 2, -1, keepdim) | var(x, -1, correction=0)
    w * ((x - m) * rsqrt(v + eps) | (x - m) / sqrt(v + eps)) + b
        -> norm(x, w, b, eps, centered=True, divide=...)                       # layer_norm
    a chain node the graph reads elsewhere, kept as it was (see below)         # kept

The weight and the bias are optional, 1-d over the normalized dim; converts after h are read
as the dtype h is rounded to before the weight (`normed_dtype`). `F.rms_norm` reaches the
graph as the chain above (and is fused); `nn.LayerNorm` is an ATen op already
(`native_layer_norm`, lowered as one rule): nothing to match.

Training graphs: AOTAutograd derives the backward from the unfused forward and saves some of
the chain's values for it (the rsqrt, LayerNorm's mean, a `/ sqrt` norm's sqrt). This pass
matches the forward alone and gives the op those values as extra results (`mean`, `scale`):
the saved nodes' other readers (the forward graph's outputs) read the op's results instead, and
the backward graph is left as AOTAutograd made it, so every gradient is the unfused backward's
of the same saved values. (Matching forward-backward pairs instead would need both graphs at
once; the partitioner hands them over one at a time, and the unfused backward is already what
XLA fuses well.) A chain node read elsewhere (an intermediate other than those two, which a
different partitioner choice might save) stays, with the nodes it reads, and is counted
`kept`. Inference graphs are the case with nothing saved.

Numerics: the op accumulates in float32 for 16-bit inputs. Hugging Face's norms cast to
float32 themselves, so there the op is the graph's computation (float32: equal to 1e-6). A
norm written in bfloat16 without a cast rounds each step (squares, mean, rsqrt) to bfloat16
unfused; fused, h is rounded once: the results differ by bfloat16 rounding and are closer to
float64 (tests/passes/test_fuse_norms.py). A saved value in a 16-bit dtype is the op's float32
statistic rounded to it.

Preserves: `node.meta["val"]` (new nodes get theirs from the op's fake kernel), the layout of
each replaced result (graph_edits' `keep_layout`), the random streams (no random op is
touched) and the topological order (re-sorted after: a weight may be computed after the norm's
first node).
"""

from __future__ import annotations

import operator

import torch

from .context import PassContext
from .fuse_patterns import CONVERTS, same
from .graph_edits import insert_call, keep_layout

aten = torch.ops.aten
prims = torch.ops.prims
_MEAN = aten.mean.dim
_VAR = aten.var.correction
_ADDS = (aten.add.Tensor, aten.add.Scalar)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    if not ctx.options.fusion.norms:
        return gm
    from torch._inductor.pattern_matcher import stable_topological_sort

    from tpu_inductor.ops.norm import ops as ours

    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (_MEAN, _VAR) and node.users:
            match = _match(node)
            if match is not None:
                _fuse(match, ours.norm.default, ctx, order)
    if ctx.rewrites:
        stable_topological_sort(gm.graph)
    return gm


def _call(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _same_value(node, base: torch.fx.Node) -> bool:
    """Whether `node` holds `base`'s values: `base` itself, or what `base` converts losslessly
    (T5 multiplies the uncast x by a statistic of x.to(float32))."""
    if node is base:
        return True
    if not _call(base, *CONVERTS) or base.args[0] is not node:
        return False
    wide = base.meta["val"].dtype
    return torch.promote_types(node.meta["val"].dtype, wide) == wide


def _over_last(node: torch.fx.Node, dims, keepdim) -> bool:
    rank = node.args[0].meta["val"].dim()
    return keepdim is True and dims is not None and list(dims) in ([-1], [rank - 1])


def _row_mean(node) -> bool:
    """mean(x, [-1], keepdim=True)."""
    if not _call(node, _MEAN) or node.kwargs.get("dtype") is not None:
        return False
    return _over_last(node, node.args[1], node.kwargs.get("keepdim", node.args[2:3] == (True,)))


def _scalar_tensor(before: torch.fx.Node, value: float, like: torch.fx.Node) -> torch.fx.Node:
    """A 0-d tensor of `value` in the dtype `like` accumulates in."""
    acc = torch.promote_types(like.meta["val"].dtype, torch.float32)
    return insert_call(before, aten.scalar_tensor.default, (value,), {"dtype": acc})


def _eps(c) -> bool:
    """A number, or a 0-d floating-point tensor (a float attribute Dynamo passes in at
    symbolic sizes)."""
    if isinstance(c, torch.fx.Node):
        val = c.meta.get("val")
        return isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype.is_floating_point
    return isinstance(c, (int, float)) and not isinstance(c, bool)


def _variance(v: torch.fx.Node):
    """(base, the LayerNorm's row mean or None, chain nodes) of a variance node, or None."""
    if _call(v, _VAR):
        dims = v.args[1] if len(v.args) > 1 else None
        if v.kwargs.get("correction") != 0 or not _over_last(v, dims, v.kwargs.get("keepdim")):
            return None
        base = v.args[0]
        mu = next((u for u in base.users if _row_mean(u) and u.args[0] is base), None)
        return None if mu is None else (base, mu, [v])
    if not _row_mean(v):
        return None
    sq = v.args[0]
    square = _call(sq, aten.pow.Tensor_Scalar) and sq.args[1] == 2
    if not (square or (_call(sq, aten.mul.Tensor) and sq.args[0] is sq.args[1])):
        return None
    a = sq.args[0]
    if _call(a, aten.sub.Tensor) and _row_mean(a.args[1]):
        mu = a.args[1]
        if mu.args[0] is a.args[0]:
            return a.args[0], mu, [a, sq, v]
    return a, None, [sq, v]


def _centered(other, base, mu) -> bool:
    """Whether `other` is the value the statistic scales: x (RMS) or x - mean (LayerNorm)."""
    if mu is None:
        return _same_value(other, base)
    return (
        _call(other, aten.sub.Tensor) and other.args[1] is mu and _same_value(other.args[0], base)
    )


def _user(node: torch.fx.Node, target, test):
    return next((u for u in node.users if _call(u, *target) and test(u)), None)


def _match(v: torch.fx.Node):
    found = _variance(v)
    if found is None:
        return None
    base, mu, chain = found
    add = _user(v, _ADDS, lambda u: u.args[0] is v and _eps(u.args[1]) and not u.kwargs)
    if add is None:
        return None
    eps = add.args[1]
    s = _user(add, (aten.rsqrt.default, aten.sqrt.default), lambda u: True)
    if s is None:
        return None
    divide = s.target is aten.sqrt.default
    if divide:
        h = _user(
            s, (aten.div.Tensor,), lambda u: u.args[1] is s and _centered(u.args[0], base, mu)
        )
    else:
        h = _user(
            s,
            (aten.mul.Tensor,),
            lambda u: any(o is s for o in u.args) and _centered(_other(u, s), base, mu),
        )
    if h is None:
        return None
    acc = torch.promote_types(base.meta["val"].dtype, torch.float32)
    if h.meta["val"].dtype not in (acc, base.meta["val"].dtype):
        return None
    chain += [add, s, h]
    if mu is not None:  # LayerNorm's x - mean (the variance's, or computed again)
        chain.append(h.args[0] if divide else _other(h, s))
    node = h
    while len(node.users) == 1 and _call(next(iter(node.users)), *CONVERTS):
        node = next(iter(node.users))
        chain.append(node)
    normed = node.meta["val"].dtype
    weight, node = _affine(node, aten.mul.Tensor, base, chain)
    bias, node = _affine(node, aten.add.Tensor, base, chain)
    return base, mu, s, weight, bias, eps, divide, normed, node, chain


def _other(node: torch.fx.Node, one: torch.fx.Node):
    a, b = node.args[:2]
    return b if a is one else a


def _affine(node, target, base, chain):
    """(w, w's node) where `node`'s only user is `node * w`, `w * node` (or + for a bias) with
    w 1-d over the normalized dim; (None, node) otherwise."""
    user = next(iter(node.users)) if len(node.users) == 1 else None
    if not _call(user, target) or user.kwargs or len(user.args) != 2:
        return None, node
    w = _other(user, node)
    size = base.meta["val"].shape[-1:]
    if not isinstance(w, torch.fx.Node) or w.meta["val"].dim() != 1:
        return None, node
    if not same(w.meta["val"].shape, size):
        return None, node
    chain.append(user)
    return w, user


def _fuse(match, op, ctx: PassContext, order: dict) -> None:
    base, mu, s, weight, bias, eps, divide, normed, final, chain = match
    members = sorted(set(chain) | ({mu} if mu is not None else set()), key=order.__getitem__)
    if not isinstance(eps, torch.fx.Node):  # the op's eps is a 0-d tensor
        eps = _scalar_tensor(members[0], eps, base)
    args = (base, weight, bias, eps, mu is not None, divide, normed)
    fused = insert_call(members[0], op, args)
    for old, index in ((final, 0), (s, 2), (mu, 1)):
        readers = [] if old is None else [u for u in old.users if u not in members]
        if readers:
            new = insert_call(fused.next, operator.getitem, (fused, index))
            dtype = old.meta["val"].dtype
            if new.meta["val"].dtype != dtype:  # a 16-bit saved value: the statistic rounded
                new = insert_call(new.next, prims.convert_element_type.default, (new, dtype))
            for user in readers:
                user.replace_input_with(old, new)
            keep_layout(new, old.meta["val"])
    kept = 0
    for node in reversed(members):
        if node.users:
            kept += 1
        else:
            node.graph.erase_node(node)
    ctx.rewrites["layer_norm" if mu is not None else "rms_norm"] += 1
    if kept:
        ctx.rewrites["kept"] += kept
