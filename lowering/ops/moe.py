"""Mixture-of-experts: grouped matmuls (`aten._grouped_mm`, transformers' `grouped_mm_fallback`).

A grouped matmul multiplies consecutive slices of one operand by one matrix each; the slices
end at `offs` (cumulative sizes, one per group, a runtime value). It lowers to XLA's ragged dot
(`lax.ragged_dot_general`), whose group sizes are runtime values too: a new routing of tokens to
experts runs the same executable, and nothing is padded per group. The four forms
`torch._grouped_mm` defines, by operand ranks (g groups, offsets over the ragged dim):

    2-D x 3-D  [m, k] x [g, k, n] -> [m, n]     rows of the lhs grouped (the MoE forward)
    2-D x 2-D  [m, k] x [k, n] -> [g, m, n]     the contracted dim grouped (weight gradients)
    3-D x 2-D  [g, m, k] x [k, n] -> [m, n]     columns of the rhs grouped
    3-D x 3-D  [g, m, k] x [g, k, n] -> [g, m, n]   no offsets: a batched matmul

Rows (or columns) past the last offset are zeros; torch leaves them uninitialised. Offsets
are taken as given: torch does not check them on every device either (decreasing offsets give
zero-size groups here). Products accumulate in float32 for 16-bit floats at HIGHEST precision,
as the other matmuls do (linalg.py). `grouped_mm_fallback` and its backward are transformers'
custom ops (transformers/integrations/moe.py), registered by name: they exist once transformers
is imported, which tpu_inductor never does.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from .common import accumulation_dtype

aten = ops.aten
_HIGHEST = lax.Precision.HIGHEST


def _sizes(offs, total: int):
    """Group sizes from cumulative offsets, as int32 (ragged dot's group-size dtype)."""
    ends = jnp.clip(offs.astype(jnp.int32), 0, total)
    return jnp.maximum(jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32)), 0)


def _ragged(lhs, rhs, sizes, contracting, lhs_ragged: int, rhs_group: tuple[int, ...]):
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(contracting, ((), ())),
        lhs_ragged_dimensions=(lhs_ragged,),
        rhs_group_dimensions=rhs_group,
    )
    acc = accumulation_dtype(lhs.dtype)  # XLA:CPU has no bf16 x bf16 -> f32 ragged dot
    return lax.ragged_dot_general(
        lhs.astype(acc), rhs.astype(acc), sizes, numbers, precision=_HIGHEST
    )


def grouped_mm(a, b, offs):
    """torch._grouped_mm's product, in the accumulation dtype (see the module docstring)."""
    if a.ndim == 3 and b.ndim == 3:
        acc = accumulation_dtype(a.dtype)
        return jnp.matmul(a, b, precision=_HIGHEST, preferred_element_type=acc)
    if a.ndim == 2 and b.ndim == 3:  # rows of a grouped
        return _ragged(a, b, _sizes(offs, a.shape[0]), ((1,), (1,)), 0, (0,))
    if a.ndim == 2 and b.ndim == 2:  # the contracted dim grouped
        return _ragged(a, b, _sizes(offs, a.shape[1]), ((1,), (0,)), 1, ())
    # 3-D x 2-D, columns of b grouped: out^T = b^T [n, k] (rows grouped) x a^T [g, k, m]
    out_t = _ragged(b.T, jnp.swapaxes(a, 1, 2), _sizes(offs, b.shape[1]), ((1,), (1,)), 0, (0,))
    return out_t.T


def _no_bias(node) -> bool:
    """The rule lowers _grouped_mm without a bias (torch rejects one on every device today)."""
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    return bias is None


@register_lowering(aten._grouped_mm.default, needs_ctx=True, supports=_no_bias)
def _grouped_mm(ctx, a, b, offs=None, bias=None, out_dtype=None):
    return grouped_mm(a, b, offs).astype(ctx.out_dtype)


@register_lowering("transformers.grouped_mm_fallback.default", needs_ctx=True)
def grouped_mm_fallback(ctx, x, weight, offs):
    """transformers' float32 expert matmul: input [S, k] sorted by expert, weight [g, k, n]."""
    return grouped_mm(x, weight, offs).astype(ctx.out_dtype)


@register_lowering("transformers.grouped_mm_fallback_backward.default")
def grouped_mm_fallback_backward(x, weight, offs, grad):
    """Its backward: (grad @ weight[g]^T per group, x[group]^T @ grad[group] per group)."""
    grad_x = grouped_mm(grad, jnp.swapaxes(weight, 1, 2), offs)
    grad_weight = grouped_mm(x.T, grad, offs)
    return grad_x.astype(x.dtype), grad_weight.astype(weight.dtype)
