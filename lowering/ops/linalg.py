"""Matrix products: mm, bmm, addmm, baddbmm, dot, mv, matmul.

Products keep the input dtype and accumulate in float32 for 16-bit floats (as torch does);
precision is HIGHEST so float32 matmuls are float32 on TPU too (torch's default).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from .common import accumulation_dtype

aten = ops.aten


def matmul(a, b):
    """a @ b with torch's float32 semantics on every platform."""
    acc = accumulation_dtype(a.dtype)
    out = jnp.matmul(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=acc)
    return out.astype(a.dtype)


@register_lowering(
    aten.mm.default, aten.bmm.default, aten.matmul.default, aten.dot.default, aten.mv.default
)
def mm(a, b):
    return matmul(a, b)


@register_lowering(aten.addmm.default, aten.baddbmm.default, aten.addmv.default)
def addmm(bias, a, b, *, beta=1, alpha=1):
    product = matmul(a, b)
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return (bias * beta if beta != 1 else bias).astype(product.dtype) + product
