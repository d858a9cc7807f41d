"""Special functions: polygamma, zeta, incomplete gamma, erfcx, ndtri, Bessel, Airy, and the
orthogonal polynomials.

Rules use jax.scipy.special where it matches torch (checked against eager in
tests/lowering/test_linalg_special.py); where it does not (zeta and polygamma for negative arguments),
torch's own algorithm is ported. Bessel J/Y, modified Bessel K, Airy Ai and the Chebyshev,
Hermite, Laguerre and Legendre polynomials have no jax counterpart: they are ports of
aten/src/ATen/native/Math.h, with its Cephes coefficients (cephes_tables.py), branch points and
early returns, computed in the input dtype as torch does (tests/lowering/test_special_port.py).
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from . import cephes_tables as T
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
    # Cephes' order of its domain checks: x first (x == 1: inf, x < 1: NaN), then q.
    s = jnp.where((q <= 0) & (q != jnp.floor(q)) & (x != jnp.floor(x)), jnp.nan, s)
    s = jnp.where((q <= 0) & (q == jnp.floor(q)), jnp.inf, s)
    s = jnp.where(x == 1, jnp.inf, jnp.where(x < 1, jnp.nan, s))
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


# --- Bessel J/Y, modified Bessel K and Airy Ai: torch's Cephes ports, in the input dtype. ---


def _horner(coefficients, z):
    """torch's `acc = 0; for c in coefficients: acc = acc * z + c` (highest power first)."""
    acc = jnp.zeros_like(z)
    for c in coefficients:
        acc = acc * z + c
    return acc


def _divide(a, b):
    """a / b for a scalar or broadcast b, rounded as torch rounds it.

    XLA rewrites a division by a broadcast scalar into a multiplication by its reciprocal (off
    by an ulp, which the large phases of airy_ai turn into visible errors); the barrier hides
    the broadcast from that rewrite.
    """
    return a / lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape))


def _chbevl(y, coefficients):
    """torch's inline Cephes chbevl: the Chebyshev series of `coefficients` at y / 2."""
    p, q, b = jnp.zeros_like(y), jnp.zeros_like(y), jnp.full_like(y, coefficients[0])
    for c in coefficients[1:]:
        p, q = q, b
        b = y * q - p + c
    return 0.5 * (b - p)


def _bessel_large(x, z, tables, phase, second_kind):
    """The x > 5 form of J (second_kind=False) or Y, of order 0 or 1 (by tables and phase)."""
    pp, pq, qp, qq = (_horner(c, z) for c in tables)
    p, q = pp / pq, 5.0 / x * (qp / qq)
    s, c = jnp.sin(x - phase), jnp.cos(x - phase)
    core = p * s + q * c if second_kind else p * c - q * s
    return core * 0.797884560802865355879892119868763737 / jnp.sqrt(x)


_J0_TABLES = (T.J0_PP, T.J0_PQ, T.J0_QP, T.J0_QQ)
_J1_TABLES = (T.J1_PP, T.J1_PQ, T.J1_QP, T.J1_QQ)
_PI_4, _3PI_4 = 0.785398163397448309615660845819875721, 2.356194490192344928846982537459627163
_2_PI = 0.636619772367581343075535053490057448


def _j0_small(x):
    xx = x * x
    rational = (xx - 5.78318596294678452118) * (xx - 30.4712623436620863991)
    rational = rational * _horner(T.J0_RP, xx) / _horner(T.J0_RQ, xx)
    return jnp.where(x < 0.00001, 1.0 - xx / 4.0, rational)


def _j1_small(x):
    xx = x * x
    out = _horner(T.J1_RP, xx) / _horner(T.J1_RQ, xx) * x
    return out * (xx - 14.6819706421238932572) * (xx - 49.2184563216946036703)


def bessel_j0(x):
    """torch's bessel_j0_forward: rational fit up to 5, asymptotic form above."""
    x = jnp.abs(x)
    large = _bessel_large(x, 25.0 / (x * x), _J0_TABLES, _PI_4, second_kind=False)
    return jnp.where(x <= 5.0, _j0_small(x), large)


def bessel_j1(x):
    """torch's bessel_j1_forward (odd: computed at -x for negative x, then negated)."""
    ax = jnp.where(x < 0, -x, x)
    large = _bessel_large(ax, 5.0 / ax * (5.0 / ax), _J1_TABLES, _3PI_4, second_kind=False)
    out = jnp.where(ax <= 5.0, _j1_small(ax), large)
    return jnp.where(x < 0, -out, out)


def bessel_y0(x):
    """torch's bessel_y0_forward: -inf at 0, NaN below."""
    xx = x * x
    small = _horner(T.Y0_YP, xx) / _horner(T.Y0_YQ, xx)
    small = small + _2_PI * jnp.log(x) * _j0_small(x)
    small = jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, small))
    large = _bessel_large(x, 25.0 / xx, _J0_TABLES, _PI_4, second_kind=True)
    return jnp.where(x <= 5.0, small, large)


def bessel_y1(x):
    """torch's bessel_y1_forward: -inf at 0, NaN below."""
    xx = x * x
    small = x * (_horner(T.Y1_YP, xx) / _horner(T.Y1_YQ, xx))
    small = small + _2_PI * (_j1_small(x) * jnp.log(x) - 1.0 / x)
    small = jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, small))
    large = _bessel_large(x, 5.0 / x * (5.0 / x), _J1_TABLES, _3PI_4, second_kind=True)
    return jnp.where(x <= 5.0, small, large)


def _bessel_k(x, order, scaled):
    """torch's (scaled_)modified_bessel_k{0,1}_forward: Chebyshev series below and above 2."""
    a, b = (T.K0_A, T.K0_B) if order == 0 else (T.K1_A, T.K1_B)
    series = _chbevl(x * x - 2.0, a)
    if order == 0:  # (torch takes this log in double, a literal's slip; float32 agrees to 1e-6)
        small = series - jnp.log(0.5 * x) * jss.i0(x)
    else:
        small = jnp.log(0.5 * x) * jss.i1(x) + series / x
    tail = _chbevl(8.0 / x - 2.0, b)
    if scaled:
        small, large = small * jnp.exp(x), tail / jnp.sqrt(x)
    else:
        large = jnp.exp(-x) * tail / jnp.sqrt(x)
    out = jnp.where(x <= 2.0, small, large)
    return jnp.where(x == 0, jnp.inf, jnp.where(x < 0, jnp.nan, out))


def airy_ai(x):
    """torch's airy_ai_forward: asymptotic forms outside [-2.09, 2.09), a power series inside."""
    # x < -2.09: oscillatory asymptotic expansion.
    zeta_neg = _divide(-2.0 * x * jnp.sqrt(-x), 3.0)
    z = 1.0 / zeta_neg
    zz = z * z
    f = 1.0 + zz * _horner(T.AIRY_AFN, zz) / _horner(T.AIRY_AFD, zz)
    g = z * _horner(T.AIRY_AGN, zz) / _horner(T.AIRY_AGD, zz)
    t = zeta_neg + 0.25 * math.pi
    negative = (
        5.64189583547756286948e-01 / jnp.sqrt(jnp.sqrt(-x)) * (jnp.sin(t) * f - jnp.cos(t) * g)
    )
    # x >= 2.09: exponentially small tail (exp overflows to a zero result for large x).
    zeta = _divide(2.0 * x * jnp.sqrt(x), 3.0)
    ratio = _horner(T.AIRY_AN, 1.0 / zeta) / _horner(T.AIRY_AD, 1.0 / zeta)
    positive = 5.64189583547756286948e-01 * ratio / (2.0 * jnp.sqrt(jnp.sqrt(x)) * jnp.exp(zeta))
    # Otherwise (NaN included) the Maclaurin series, summed per element until torch's stop.
    inside = ~(x < -2.09) & ~(x >= 2.09)
    series = _airy_series(jnp.where(inside, x, 0))
    return jnp.select(
        [jnp.isinf(x), x > 103.892, x < -2.09, x >= 2.09],
        [jnp.full_like(x, jnp.nan), jnp.zeros_like(x), negative, positive],
        series,
    )


def _airy_series(x):
    """torch's Maclaurin series of Ai, each element summed until its own last term is below eps."""
    eps = jnp.finfo(x.dtype).eps
    one = jnp.ones_like(x)

    def step(state):
        f, g, k, m, n, t = state
        go = t > eps
        m2 = m * z
        k2 = k + 1.0
        m2 = m2 / k2
        n2 = n * z
        k2 = k2 + 1.0
        n2 = n2 / k2
        m2 = m2 / k2
        f2 = f + m2
        k2 = k2 + 1.0
        n2 = n2 / k2
        g2 = g + n2
        new = (f2, g2, k2, m2, n2, jnp.abs(m2 / f2))
        return tuple(jnp.where(go, a, b) for a, b in zip(new, state))

    z = x * x * x
    init = (one, x, one, one, x, one)
    f, g, *_ = lax.while_loop(lambda s: jnp.any(s[-1] > eps), step, init)
    return 0.355028053887817239260 * f - 0.258819403792806798405 * g


for _op, _fn in {
    aten.special_bessel_j0: bessel_j0,
    aten.special_bessel_j1: bessel_j1,
    aten.special_bessel_y0: bessel_y0,
    aten.special_bessel_y1: bessel_y1,
    aten.special_modified_bessel_k0: lambda x: _bessel_k(x, 0, scaled=False),
    aten.special_modified_bessel_k1: lambda x: _bessel_k(x, 1, scaled=False),
    aten.special_scaled_modified_bessel_k0: lambda x: _bessel_k(x, 0, scaled=True),
    aten.special_scaled_modified_bessel_k1: lambda x: _bessel_k(x, 1, scaled=True),
    aten.special_airy_ai: airy_ai,
}.items():
    elementwise(_op.default)(_fn)


# --- Orthogonal polynomials of a per-element degree n: torch's recurrences and special cases. ---


def _degree(n):
    """torch's static_cast<int64_t>(n) of a float degree, as (valid, n, n as an int).

    NaN, ±inf and |n| >= 2**63 cast to INT64_MIN on x86, i.e. a negative degree, as does
    anything <= -1: every polynomial is then 0 (`valid` is false). The int copy, which bounds
    the recurrence, is capped far beyond any loop that could finish.
    """
    valid = (n > -1) & (n < 2.0**63)
    n = jnp.trunc(jnp.where(valid, n, 0))
    int_dtype = jnp.asarray(0).dtype
    return valid, n, jnp.minimum(n, jnp.iinfo(int_dtype).max // 2).astype(int_dtype)


def _recurrence(step, q, first, last, active, stop_on_nan=True):
    """Per element, torch's `p = 1; for (k = first; k <= last && !isnan(q); k++)
    {r = step(k, p, q); p = q; q = r;}`, where `active`; returns q (the start value where the
    loop does not run). k is a shared integer counter; step receives it as an int scalar.
    """

    def running(state):
        k, _, q = state
        go = active & (k <= last)
        return go & ~jnp.isnan(q) if stop_on_nan else go

    def body(state):
        k, p, q = state
        go = running(state)
        return k + 1, jnp.where(go, q, p), jnp.where(go, step(k, p, q), q)

    init = (jnp.asarray(first, last.dtype), jnp.ones_like(q), q)
    return lax.while_loop(lambda s: jnp.any(running(s)), body, init)[2]


def _polynomial(cases, step, q, first, last, stop_on_nan=True):
    """torch's chain of early returns `cases` ((condition, value); the first that holds wins),
    else the recurrence `_recurrence(step, q, first, last)` (run only where no case holds).
    """
    conditions = [c for c, _ in cases]
    otherwise = ~functools.reduce(operator.or_, conditions)
    loop = _recurrence(step, q, first, last, otherwise, stop_on_nan)
    return jnp.select(conditions, [v for _, v in cases], loop)


def _signed(value, even):
    """torch's `n % 2 == 0 ? value : -value`."""
    return jnp.where(even, value, -value)


# kind → (start q as a function of y, trig-form degree threshold: plain, shifted)
_CHEBYSHEV = {
    "t": (lambda y: y, 6, 6),
    "u": (lambda y: y + y, 8, 6),
    "v": (lambda y: y + y - 1.0, 8, 6),
    "w": (lambda y: y + y + 1.0, 8, 4),
}


def chebyshev(kind, x, n, shifted=False):
    """torch's (shifted_)chebyshev_polynomial_{t,u,v,w}_forward.

    The shifted polynomial is the plain one at y = 2x - 1, with its endpoint tests made on x
    (x == 1, x == 0) and its own degree threshold for the trigonometric form, as torch does.
    """
    start, plain_threshold, shifted_threshold = _CHEBYSHEV[kind]
    x, n = jnp.broadcast_arrays(x, n)
    valid, n, n_int = _degree(n)
    even = jnp.fmod(n, 2) == 0
    y = x + x - 1.0 if shifted else x
    if shifted:
        top, bottom = x == 1, x == 0
    else:
        top, bottom = (jnp.abs(x) == 1) & (x > 0), (jnp.abs(x) == 1) & ~(x > 0)
    at_top = {"t": 1.0, "u": n + 1.0, "v": 1.0, "w": n + n + 1.0}[kind]
    at_bottom = _signed({"t": 1.0, "u": n + 1.0, "v": n + n + 1.0, "w": 1.0}[kind], even)
    theta = _arccos(y)
    if kind == "t":
        trig = jnp.cos(n * theta)
    elif kind == "u":
        s = jnp.sin(theta)
        by_cos = (n + 1.0) * jnp.cos((n + 1.0) * theta) / y
        trig = jnp.where(s != 0, jnp.sin((n + 1.0) * theta) / s, by_cos)
    elif kind == "v":
        ok = jnp.sin(theta / 2.0) != 1
        trig = jnp.where(ok, jnp.cos((n + 0.5) * theta) / jnp.cos(theta / 2.0), at_bottom)
    else:
        ok = jnp.cos(theta / 2.0) != 1
        degenerate = _signed(1.0, even) if shifted else n + n + 1.0
        trig = jnp.where(ok, jnp.sin((n + 0.5) * theta) / jnp.sin(theta / 2.0), degenerate)
    use_trig = (n > (shifted_threshold if shifted else plain_threshold)) & (jnp.abs(y) < 1)
    q = start(y)
    cases = [(~valid, 0.0), (top, at_top), (bottom, at_bottom), (use_trig, trig), (n == 0, 1.0),
             (n == 1, q)]  # fmt: skip
    return _polynomial(cases, lambda k, p, q: (y + y) * q - p, q, 2, n_int)


def _arccos(y):
    """acos rounded from float64 where x64 is on: within an ulp of libm's acosf, which torch
    calls (jax's float32 arccos is off by up to two, and the trig forms multiply that by n).
    """
    wide = jax.dtypes.canonicalize_dtype(jnp.float64)
    return jnp.arccos(y.astype(jnp.promote_types(y.dtype, wide))).astype(y.dtype)


def _hermite_limit(dtype):
    """torch's getHermitianLimit: degrees above it give NaN."""
    return {jnp.dtype(jnp.float32): 128, jnp.dtype(jnp.float64): 512}.get(jnp.dtype(dtype), 1024)


def hermite_h(x, n):
    """torch's hermite_polynomial_h_forward (physicists')."""
    x, n = jnp.broadcast_arrays(x, n)
    valid, n, n_int = _degree(n)
    q = x + x
    cases = [(~valid, 0.0), (n == 0, 1.0), (n == 1, q), (n > _hermite_limit(x.dtype), jnp.nan)]

    def step(j, p, q):  # torch's k = 2, 4, ... < 2n
        return (x + x) * q - (j + j).astype(x.dtype) * p

    return _polynomial(cases, step, q, 1, n_int - 1, stop_on_nan=False)


def hermite_he(x, n):
    """torch's hermite_polynomial_he_forward (probabilists')."""
    x, n = jnp.broadcast_arrays(x, n)
    valid, n, n_int = _degree(n)
    cases = [(~valid, 0.0), (n == 0, 1.0), (n == 1, x), (n > _hermite_limit(x.dtype), jnp.nan)]

    def step(k, p, q):
        return x * q - k.astype(x.dtype) * p

    return _polynomial(cases, step, x, 1, n_int - 1, stop_on_nan=False)


def laguerre_l(x, n):
    """torch's laguerre_polynomial_l_forward."""
    x, n = jnp.broadcast_arrays(x, n)
    valid, n, n_int = _degree(n)
    q = 1.0 - x
    cases = [(~valid, 0.0), (jnp.abs(x) == 0, 1.0), (n == 0, 1.0), (n == 1, q)]

    def step(k, p, q):
        a = ((k + k).astype(x.dtype) + (1.0 - x)) * q - k.astype(x.dtype) * p
        return _divide(a, (k + 1).astype(x.dtype))

    return _polynomial(cases, step, q, 1, n_int - 1)


def legendre_p(x, n):
    """torch's legendre_polynomial_p_forward."""
    x, n = jnp.broadcast_arrays(x, n)
    valid, n, n_int = _degree(n)
    end = jnp.where((x > 0) | (jnp.fmod(n, 2) == 0), 1.0, -1.0)
    cases = [(~valid, 0.0), (jnp.abs(x) == 1, end), (n == 0, 1.0), (n == 1, x)]

    def step(k, p, q):
        a = (k + k + 1).astype(x.dtype) * x * q - k.astype(x.dtype) * p
        return _divide(a, (k + 1).astype(x.dtype))

    return _polynomial(cases, step, x, 1, n_int - 1)


_POLYNOMIALS = {
    aten.special_hermite_polynomial_h: hermite_h,
    aten.special_hermite_polynomial_he: hermite_he,
    aten.special_laguerre_polynomial_l: laguerre_l,
    aten.special_legendre_polynomial_p: legendre_p,
}


def _chebyshev_rule(kind, shifted):
    def rule(x, n):
        return chebyshev(kind, x, n, shifted)

    rule.__name__ = f"{'shifted_' if shifted else ''}chebyshev_{kind}"
    return rule


for _kind in "tuvw":
    for _prefix, _shifted in (("", False), ("shifted_", True)):
        _op = getattr(aten, f"special_{_prefix}chebyshev_polynomial_{_kind}")
        _POLYNOMIALS[_op] = _chebyshev_rule(_kind, _shifted)
for _op, _fn in _POLYNOMIALS.items():
    elementwise(_op.default, _op.x_scalar, _op.n_scalar)(_fn)
