"""Special functions: polygamma, zeta, incomplete gamma, erfcx, ndtri, modified Bessel I0/I1.

Rules use jax.scipy.special where it matches torch (checked against eager in
tests/test_linalg_special.py); where it does not (zeta and polygamma for negative arguments),
torch's own algorithm is ported. Bessel J/Y/K, Airy and the orthogonal polynomials have no jax
counterpart and are left to eager.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import jax.scipy.special as jss
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from .common import accumulation_dtype, cast, elementwise

aten = ops.aten

_UNARY = {
    aten.special_erfcx: jss.erfcx,
    aten.special_ndtri: jss.ndtri,
    aten.special_i0e: jss.i0e,
    aten.special_i1: jss.i1,
    aten.special_i1e: jss.i1e,
    aten.special_modified_bessel_i0: jss.i0,
    aten.special_modified_bessel_i1: jss.i1,
    aten.special_spherical_bessel_j0: lambda x: jnp.where(x == 0, 1, jnp.sin(x) / x),
}


def zeta(x, q):
    """torch's Hurwitz zeta (Cephes, in float64 as torch computes it on CPU).

    jax's zeta differs from it for q below about -8 and at non-positive integers q.
    """
    out_dtype = jnp.result_type(x, q)
    x, q = jnp.broadcast_arrays(jnp.asarray(x, jnp.float64), jnp.asarray(q, jnp.float64))

    # Direct sum q^-x + (q+1)^-x + ... while i < 9 or a <= 9.
    def active(state):
        i, a, _, _ = state
        return (i < 9) | (a <= 9.0)

    def step(state):
        i, a, s, b = state
        go = active(state)
        a2 = jnp.where(go, a + 1, a)
        b2 = jnp.where(go, a2**-x, b)
        return i + go, a2, jnp.where(go, s + b2, s), b2

    init = (jnp.zeros(x.shape, jnp.int32), q, q**-x, jnp.zeros_like(x))
    _, a, s, b = lax.while_loop(lambda st: jnp.any(active(st)), step, init)
    # Euler-Maclaurin tail (terms past convergence are below float64 epsilon of s).
    w = a
    s = s + b * w / (x - 1) - 0.5 * b
    a, k = jnp.ones_like(x), jnp.zeros_like(x)
    for coefficient in _ZETA_A:
        a = a * (x + k)
        b = b / w
        s = s + a * b / coefficient
        k = k + 1
        a = a * (x + k)
        b = b / w
        k = k + 1
    s = jnp.where(x == 1, jnp.inf, jnp.where(x < 1, jnp.nan, s))
    s = jnp.where((q <= 0) & (q == jnp.floor(q)), jnp.inf, s)
    s = jnp.where((q <= 0) & (q != jnp.floor(q)) & (x != jnp.floor(x)), jnp.nan, s)
    return s.astype(out_dtype)


_ZETA_A = (
    12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
    -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
    1.8152105401943546773e17, -7.1661652561756670113e18,
)  # fmt: skip

_BINARY = {
    aten.igamma: jss.gammainc,
    aten.igammac: jss.gammaincc,
    aten.special_zeta: zeta,
}
for _op, _fn in (_UNARY | _BINARY).items():
    elementwise(_op.default)(_fn)
for _op in _BINARY:
    if hasattr(_op, "other_scalar"):
        elementwise(_op.other_scalar, _op.self_scalar)(_BINARY[_op])


def _trigamma(x):
    """torch's calc_trigamma: reflection below 0.5, six recurrence steps, then a series."""
    reflect = x < 0.5
    sin_pi_x = jnp.sin(jnp.pi * x)
    result = jnp.where(reflect, -(jnp.pi**2) / (sin_pi_x * sin_pi_x), 0)
    x = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / x
    return jnp.where(reflect, -result, result)


def _digamma(x):
    """torch's digamma: -inf/+inf at ±0 (jax gives NaN there)."""
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), jss.digamma(x))


@register_lowering(aten.polygamma.default, needs_ctx=True)
def polygamma(ctx, n, x):
    dtype = accumulation_dtype(ctx.out_dtype)
    x = cast(x, dtype)
    if n == 0:
        out = _digamma(x)
    elif n == 1:
        out = _trigamma(x)
    else:  # torch: (-1)^(n+1) n! zeta(n+1, x)
        out = (-1) ** (n + 1) * math.factorial(n) * zeta(jnp.asarray(n + 1.0, x.dtype), x)
    return out.astype(ctx.out_dtype)
