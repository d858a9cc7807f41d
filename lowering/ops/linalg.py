"""Linear algebra: matrix products, vector norms, distances and the foreach norm ops.

Products keep the input dtype and accumulate in float32 for 16-bit floats (as torch does);
precision is HIGHEST so float32 matmuls are float32 on TPU too (torch's default).
Factorizations and solves are factorizations.py's (ldl.py's for LDL^T).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from .common import accumulation_dtype, cast, dims

aten = ops.aten
_HIGHEST = lax.Precision.HIGHEST


def matmul(a, b):
    """a @ b with torch's float32 semantics on every platform."""
    return _product(a, b).astype(a.dtype)


def _product(a, b):
    """a @ b at full precision, in the accumulation dtype (float32 for 16-bit floats)."""
    return jnp.matmul(a, b, precision=_HIGHEST, preferred_element_type=accumulation_dtype(a.dtype))


def _scaled_add(bias, product, beta, alpha, dtype):
    """beta * bias + alpha * product in the accumulation dtype, rounded once to `dtype` (as
    torch adds the bias in the accumulator); bias ignored (even NaN) when beta is 0. For an
    integer `dtype` torch reads beta and alpha as that integer type (0.6 -> 0)."""
    if jnp.issubdtype(dtype, jnp.integer):
        beta, alpha = int(beta), int(alpha)
    if alpha != 1:
        product = product * alpha
    if beta != 0:
        bias = bias.astype(product.dtype)
        product = (bias * beta if beta != 1 else bias) + product
    return product.astype(dtype)


@register_lowering(
    aten.mm.default, aten.bmm.default, aten.matmul.default, aten.dot.default, aten.mv.default
)
def mm(a, b):
    return matmul(a, b)


@register_lowering(aten.addmm.default, aten.baddbmm.default, aten.addmv.default)
def addmm(bias, a, b, *, beta=1, alpha=1):
    return _scaled_add(bias, _product(a, b), beta, alpha, a.dtype)


@register_lowering(aten.addbmm.default)
def addbmm(bias, b1, b2, *, beta=1, alpha=1):
    acc = accumulation_dtype(b1.dtype)
    product = jnp.einsum("bij,bjk->ik", b1, b2, precision=_HIGHEST, preferred_element_type=acc)
    return _scaled_add(bias, product, beta, alpha, b1.dtype)


# ---- vector norms and distances ----


def vector_norm(x, ord, axis, keepdim=False):
    """torch.linalg.vector_norm of `x` over `axis` (a real result; `x` already in its dtype)."""
    a = jnp.abs(x)
    if ord == math.inf:
        return jnp.max(a, axis=axis, keepdims=keepdim)
    if ord == -math.inf:
        return jnp.min(a, axis=axis, keepdims=keepdim)
    if ord == 0:
        return jnp.sum(a != 0, axis=axis, keepdims=keepdim).astype(a.dtype)
    if ord == 1:
        return jnp.sum(a, axis=axis, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axis, keepdims=keepdim))
    return jnp.sum(a**ord, axis=axis, keepdims=keepdim) ** (1.0 / ord)


@register_lowering(aten.linalg_vector_norm.default, needs_ctx=True)
def linalg_vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    if dtype is not None:
        x = x.astype(ctx.jax_dtype(dtype))
    acc = accumulation_dtype(ctx.out_dtype)
    x = x if jnp.iscomplexobj(x) else cast(x, acc)
    axis = dims(dim, x.ndim) if x.ndim else ()
    return vector_norm(x, float(ord), axis, keepdim).astype(ctx.out_dtype)


# ---- foreach ops (clip_grad_norm_ in a compiled training step): one result per tensor ----


@register_lowering(aten._foreach_norm.Scalar, needs_ctx=True)
def foreach_norm(ctx, tensors, ord=2, dtype=None):
    results = []
    for x, val in zip(tensors, ctx.out):
        out = ctx.jax_dtype(val.dtype)
        x = x if jnp.iscomplexobj(x) else cast(x, accumulation_dtype(out))
        results.append(vector_norm(x, float(ord), tuple(range(x.ndim))).astype(out))
    return results


@register_lowering(
    aten._foreach_mul.Tensor, aten._foreach_mul.Scalar, aten._foreach_mul.List, needs_ctx=True
)
def foreach_mul(ctx, tensors, other):
    others = other if isinstance(other, (list, tuple)) else [other] * len(tensors)
    return [
        (cast(x, accumulation_dtype(x.dtype)) * y).astype(ctx.jax_dtype(val.dtype))
        for x, y, val in zip(tensors, others, ctx.out)
    ]


@register_lowering(aten.dist.default, needs_ctx=True)
def dist(ctx, a, b, p=2):
    diff = cast(a, ctx.promoted_dtype()) - cast(b, ctx.promoted_dtype())
    acc = accumulation_dtype(ctx.out_dtype)
    return vector_norm(cast(diff, acc), float(p), None).astype(ctx.out_dtype)


def _pairwise_norm(diff, p):
    return vector_norm(diff, float(p), -1)


@register_lowering(aten._cdist_forward.default)
def cdist(x1, x2, p, compute_mode=None):
    rows, cols = x1.shape[-2], x2.shape[-2]
    # torch's compute_mode: None/0 uses the matmul form past 25 rows, 1 always, 2 never.
    use_mm = p == 2 and (compute_mode == 1 or (compute_mode in (None, 0) and max(rows, cols) > 25))
    if use_mm:  # the same expansion torch uses (_euclidean_dist), so rounding matches
        n1 = jnp.sum(x1 * x1, axis=-1, keepdims=True)
        n2 = jnp.sum(x2 * x2, axis=-1, keepdims=True)
        a = jnp.concatenate([x1 * -2, n1, jnp.ones_like(n1)], axis=-1)
        b = jnp.concatenate([x2, jnp.ones_like(n2), n2], axis=-1)
        return jnp.sqrt(jnp.maximum(matmul(a, jnp.swapaxes(b, -1, -2)), 0))
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    return _pairwise_norm(x1[..., :, None, :] - x2[..., None, :, :], p)


@register_lowering(aten._pdist_forward.default)
def pdist(x, p=2.0):
    i, j = jnp.triu_indices(x.shape[0], 1)
    return _pairwise_norm(x[i] - x[j], p)
