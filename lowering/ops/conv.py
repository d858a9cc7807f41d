"""Convolution: aten's convolution (1-3 spatial dims, transposed or not) and its backward.

The backward is the vjp of the forward (`jax.vjp`), not a hand-written copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from .common import _f32, _ntuple, _results, accumulation_dtype

aten = ops.aten

# --- convolution -------------------------------------------------------------------------


def _conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    """torch's convolution (1-3 spatial dims, transposed or not) with lax.conv_general_dilated."""
    nd = w.ndim - 2
    stride, padding, dilation = (_ntuple(v, nd) for v in (stride, padding, dilation))
    spatial = "DHW"[-nd:]
    numbers = (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")
    kernel = w.shape[2:]
    if transposed:
        # (C_in, C_out/g, k...) → (C_out, C_in/g, k...) flipped: the gradient of a forward conv.
        c_in, c_out_g = w.shape[:2]
        w = w.reshape((groups, c_in // groups, c_out_g) + kernel)
        w = jnp.swapaxes(w, 1, 2).reshape((groups * c_out_g, c_in // groups) + kernel)
        w = jnp.flip(w, axis=tuple(range(2, w.ndim)))
        out_pad = _ntuple(output_padding, nd)
        pads = [
            (d * (k - 1) - p, d * (k - 1) - p + op)
            for k, p, d, op in zip(kernel, padding, dilation, out_pad)
        ]
        lhs_dilation, window_strides = stride, (1,) * nd
    else:
        pads = [(p, p) for p in padding]
        lhs_dilation, window_strides = (1,) * nd, stride
    out = lax.conv_general_dilated(
        x,
        w,
        window_strides=window_strides,
        padding=pads,
        lhs_dilation=lhs_dilation,
        rhs_dilation=dilation,
        dimension_numbers=numbers,
        feature_group_count=groups,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=accumulation_dtype(x.dtype),
    )
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((-1,) + (1,) * nd)
    return out.astype(x.dtype)


@register_lowering(aten.convolution.default)
def convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    return _conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)


@register_lowering(aten.convolution_backward.default, needs_ctx=True)
def convolution_backward(
    ctx, grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask
):
    def forward(x_, w_):
        return _conv(x_, w_, None, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(forward, x, w)
    grad_x, grad_w = vjp(grad)
    axes = (0,) + tuple(range(2, grad.ndim))
    return _results(ctx, (grad_x, grad_w, jnp.sum(_f32(grad), axis=axes)))
