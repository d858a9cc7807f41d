"""float32 sine and cosine for XLA:CPU as vectorizable arithmetic.

jaxlib 0.10's XLA:CPU emits `sine` and `cosine` as one scalar libm call (sincosf) per element,
many times slower than torch's vectorized ones. XLA also fuses the result into each consumer, so
a broadcast one (rotary position embeddings: cos/sin of [1, seq, dim] times q of [batch, heads,
seq, dim]) evaluates it once per consumer element (figures: docs/benchmarks.md).

Here float32 sin and cos are a Cody-Waite reduction by pi/2 and minimax polynomials on
[-pi/4, pi/4] (the single-precision coefficients of Cephes' sinf/cosf), vectorized, and within
2.3 ulp of the correctly rounded result (torch: 0.6 ulp) wherever |x| <= 8192. pi/2 is split in four parts, the first three of 8, 11 and 11 significant bits, so
that k * part is exact for every quadrant k below 2^13: arguments next to a multiple of pi/2
keep their relative accuracy. A tensor with any element beyond 8192, infinite or NaN takes
XLA's own sine/cosine instead: a max-reduction and a conditional pick the path, and the
conditional also keeps XLA from recomputing the result inside every consumer.

bfloat16 and float16 compute in float32 (as every elementwise rule does) and take the same path;
float64 and complex keep the portable rule.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from torch._ops import ops

from .common import elementwise

aten = ops.aten

REDUCTION_LIMIT = 8192.0  # |x| up to which the reduction below is exact in its products
_HALF_PI_PARTS = tuple(  # sum: pi/2 to about 1e-19; k * part exact for |k| < 2^13 (first three)
    np.float32(p)
    for p in (1.5703125, 4.837512969970703125e-4, 7.549533620476723e-08, 2.5633440682570896e-12)
)
_SIN_COEFFICIENTS = tuple(
    np.float32(c) for c in (-1.6666654611e-1, 8.3321608736e-3, -1.9515295891e-4)
)
_COS_COEFFICIENTS = tuple(
    np.float32(c) for c in (4.166664568298827e-2, -1.388731625493765e-3, 2.443315711809948e-5)
)


def _reduced(x):
    """(quadrant k mod 4, sin r, cos r) for x = k * pi/2 + r, |r| <= pi/4 (about)."""
    k = jnp.round(x * np.float32(2 / math.pi))
    r = x
    for part in _HALF_PI_PARTS:
        r = r - k * part
    z = r * r
    s1, s2, s3 = _SIN_COEFFICIENTS
    c1, c2, c3 = _COS_COEFFICIENTS
    sin_r = r + r * z * (s1 + z * (s2 + z * s3))
    cos_r = np.float32(1) - np.float32(0.5) * z + z * z * (c1 + z * (c2 + z * c3))
    return k.astype(jnp.int32) & 3, sin_r, cos_r


def polynomial_sin(x):
    quadrant, sin_r, cos_r = _reduced(x)
    value = jnp.where((quadrant & 1) != 0, cos_r, sin_r)
    value = jnp.where((quadrant & 2) != 0, -value, value)
    return jnp.where(x == 0, x, value)  # sin(-0.0) is -0.0


def polynomial_cos(x):
    quadrant, sin_r, cos_r = _reduced(x)
    value = jnp.where((quadrant & 1) != 0, sin_r, cos_r)
    return jnp.where(((quadrant + 1) & 2) != 0, -value, value)  # quadrants 1 and 2: negative


def _within_limit(polynomial, portable):
    """The polynomial where every |x| <= REDUCTION_LIMIT (NaN fails the test), else XLA's op."""

    def rule(x):
        if x.dtype != jnp.float32:
            return portable(x)
        largest = jnp.max(jnp.abs(x), initial=np.float32(0))
        return lax.cond(largest <= REDUCTION_LIMIT, polynomial, portable, x)

    rule.__name__ = portable.__name__
    return rule


elementwise(aten.sin, platform="cpu")(_within_limit(polynomial_sin, jnp.sin))
elementwise(aten.cos, platform="cpu")(_within_limit(polynomial_cos, jnp.cos))
