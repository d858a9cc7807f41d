"""Discrete Fourier transforms: the three ATen FFT primitives the torch.fft functions decompose to.

`normalization` is torch's fft_norm_mode: 0 none, 1 by 1/sqrt(n), 2 by 1/n, where n is the
product of the signal sizes over `dim` (the output's for c2r). The transforms themselves are
computed unnormalized and scaled once, so forward and backward directions share one rule.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from torch._ops import ops

from ..registry import register_lowering

aten = ops.aten


def _normalized(x, sizes, normalization):
    n = math.prod(sizes)
    if normalization == 0 or n == 0:
        return x
    scale = 1 / math.sqrt(n) if normalization == 1 else 1 / n
    return x * jnp.asarray(scale, jnp.real(x).dtype)


@register_lowering(aten._fft_c2c.default)
def fft_c2c(x, dim, normalization, forward):
    if forward:
        y = jnp.fft.fftn(x, axes=dim)
    else:  # numpy's "forward" norm leaves the inverse transform unscaled
        y = jnp.fft.ifftn(x, axes=dim, norm="forward")
    return _normalized(y, [x.shape[d] for d in dim], normalization).astype(x.dtype)


@register_lowering(aten._fft_r2c.default, needs_ctx=True)
def fft_r2c(ctx, x, dim, normalization, onesided):
    y = jnp.fft.rfftn(x, axes=dim) if onesided else jnp.fft.fftn(x, axes=dim)
    return _normalized(y, [x.shape[d] for d in dim], normalization).astype(ctx.out_dtype)


@register_lowering(aten._fft_c2r.default, needs_ctx=True)
def fft_c2r(ctx, x, dim, normalization, last_dim_size):
    sizes = [x.shape[d] for d in dim[:-1]] + [int(last_dim_size)]
    y = jnp.fft.irfftn(x, s=sizes, axes=dim, norm="forward")
    return _normalized(y, sizes, normalization).astype(ctx.out_dtype)


def _frequencies(ctx, bins, n, d):
    """Sample frequencies as torch computes them: integer bins times 1 / (n * d)."""
    out = ctx.out_dtype
    return jnp.asarray(bins, out) * jnp.asarray(1.0 / (n * d), out)


@register_lowering(aten.fft_fftfreq.default, needs_ctx=True)
def fft_fftfreq(ctx, n, d=1.0, **_kw):
    bins = np.concatenate([np.arange((n + 1) // 2), np.arange(-(n // 2), 0)])
    return _frequencies(ctx, bins, n, d)


@register_lowering(aten.fft_rfftfreq.default, needs_ctx=True)
def fft_rfftfreq(ctx, n, d=1.0, **_kw):
    return _frequencies(ctx, np.arange(n // 2 + 1), n, d)


# Conjugation: the Hermitian FFTs (hfft, ihfft) conjugate their input or result.
@register_lowering(aten._conj.default, aten._conj_physical.default)
def conj(x):
    return jnp.conj(x)
