"""Elementwise ops: unary math, binary arithmetic and comparisons, activations and their grads."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from .common import accumulation_dtype, cast, elementwise, takes_traced_scalars

aten = ops.aten


def _sign(x):
    """torch.sign: bool stays bool, sign(nan) is 0."""
    if x.dtype == jnp.bool_:
        return x
    sign = jnp.sign(x)
    return (
        jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), sign)
        if jnp.issubdtype(x.dtype, jnp.inexact)
        else sign
    )


# Unary ops: aten op → jax function with torch's semantics.
_UNARY = {
    aten.abs: jnp.abs,
    aten.neg: jnp.negative,
    aten.exp: jnp.exp,
    aten.exp2: jnp.exp2,
    aten.expm1: jnp.expm1,
    aten.log: jnp.log,
    aten.log2: jnp.log2,
    aten.log10: jnp.log10,
    aten.log1p: jnp.log1p,
    aten.sqrt: jnp.sqrt,
    aten.rsqrt: lax.rsqrt,
    aten.sin: jnp.sin,
    aten.cos: jnp.cos,
    aten.tan: jnp.tan,
    aten.asin: jnp.arcsin,
    aten.acos: jnp.arccos,
    aten.atan: jnp.arctan,
    aten.sinh: jnp.sinh,
    aten.cosh: jnp.cosh,
    aten.tanh: jnp.tanh,
    aten.asinh: jnp.arcsinh,
    aten.acosh: jnp.arccosh,
    aten.atanh: jnp.arctanh,
    aten.sigmoid: jax.nn.sigmoid,
    aten.erf: jax.scipy.special.erf,
    aten.erfc: jax.scipy.special.erfc,
    aten.erfinv: jax.scipy.special.erfinv,
    aten.lgamma: jax.scipy.special.gammaln,
    aten.digamma: lambda x: jnp.where(
        x == 0, jnp.copysign(jnp.inf, -x), jax.scipy.special.digamma(x)
    ),
    aten.ceil: jnp.ceil,
    aten.floor: jnp.floor,
    aten.trunc: jnp.trunc,
    aten.frac: lambda x: x - jnp.trunc(x),
    aten.sign: _sign,
    aten.sgn: _sign,
    aten.reciprocal: jnp.reciprocal,
    aten.relu: lambda x: jnp.maximum(x, jnp.zeros((), x.dtype)),
    aten.logical_not: jnp.logical_not,
    aten.bitwise_not: jnp.invert,
    aten.isnan: jnp.isnan,
    aten.isinf: jnp.isinf,
    aten.isfinite: jnp.isfinite,
    aten.signbit: jnp.signbit,
    aten.silu: jax.nn.silu,
    aten.square: jnp.square,
    aten.positive: lambda x: x,
    aten.i0: jax.scipy.special.i0,
}

# Binary ops: aten op → jax function of the two promoted operands. (torch's xlogy(0, nan) is
# nan; jax's is 0.)
_BINARY = {
    aten.atan2: jnp.arctan2,
    aten.maximum: jnp.maximum,
    aten.minimum: jnp.minimum,
    aten.fmax: jnp.fmax,
    aten.fmin: jnp.fmin,
    aten.hypot: jnp.hypot,
    aten.copysign: jnp.copysign,
    aten.logical_and: jnp.logical_and,
    aten.logical_or: jnp.logical_or,
    aten.logical_xor: jnp.logical_xor,
    aten.bitwise_and: jnp.bitwise_and,
    aten.bitwise_or: jnp.bitwise_or,
    aten.bitwise_xor: jnp.bitwise_xor,
    aten.bitwise_left_shift: jnp.left_shift,
    aten.bitwise_right_shift: jnp.right_shift,
    aten.xlogy: lambda x, y: jnp.where(jnp.isnan(y), y, jax.scipy.special.xlogy(x, y)),
}

# Comparisons compute in the promoted dtype and return bool.
_COMPARE = {
    aten.eq: jnp.equal,
    aten.ne: jnp.not_equal,
    aten.lt: jnp.less,
    aten.le: jnp.less_equal,
    aten.gt: jnp.greater,
    aten.ge: jnp.greater_equal,
}

for _op, _fn in _UNARY.items():
    elementwise(_op)(_fn)
for _op, _fn in _BINARY.items():
    elementwise(_op)(_fn)
for _op, _fn in _COMPARE.items():
    elementwise(_op, compute="promoted")(_fn)
elementwise(aten.gcd.default)(jnp.gcd)  # gcd.int is size arithmetic
elementwise(aten.lcm.default)(jnp.lcm)
# The Python operators << and >> (their .int overloads are size arithmetic, not tensor ops).
elementwise(aten.__lshift__.Scalar, aten.__lshift__.Tensor)(jnp.left_shift)
elementwise(aten.__rshift__.Scalar, aten.__rshift__.Tensor)(jnp.right_shift)


@elementwise("prims.fma.default")  # Inductor's prim (Dynamo's addcmul_ in optimizer steps)
def fma(a, b, c):
    return a * b + c


@elementwise(aten.add)
def add(a, b, *, alpha=1):
    return a + _scaled(b, alpha)


@elementwise(aten.sub)
def sub(a, b, *, alpha=1):
    return a - _scaled(b, alpha)


@elementwise(aten.rsub)
def rsub(a, b, *, alpha=1):
    return b - _scaled(a, alpha)


def _scaled(x, alpha):
    """x * alpha, no product for a Python 1; a traced alpha (an integer argument passed to the
    module at run time) in x's dtype, as a Python alpha would be."""
    if isinstance(alpha, (bool, int, float)):
        return x if alpha == 1 else x * alpha
    return x * cast(alpha, x.dtype)


@register_lowering(aten.mul, needs_ctx=True)
@takes_traced_scalars
def mul(ctx, a, b):
    """a * b in torch's promoted dtype. A bool operand times a float is `where(p, y, y * 0)`:
    multiplied as written, XLA's simplifier turns convert(p) * y into select(p, y, 0), which
    drops torch's False * inf = nan (and the sign of False * -y)."""
    dtype = accumulation_dtype(ctx.compute_dtype())
    if _is_bool_array(b) and jnp.issubdtype(dtype, jnp.inexact):
        a, b = b, a
    y = cast(b, dtype)
    if _is_bool_array(a) and jnp.issubdtype(dtype, jnp.inexact):
        return cast(jnp.where(a, y, y * jnp.zeros((), dtype)), ctx.out_dtype)
    return cast(jnp.multiply(cast(a, dtype), y), ctx.out_dtype)


def _is_bool_array(v) -> bool:
    return getattr(v, "dtype", None) == jnp.bool_


@elementwise(aten.div.Tensor, aten.div.Scalar, aten.true_divide.Tensor, aten.true_divide.Scalar)
def div(a, b):
    return a / b


@register_lowering(aten.div.Tensor_mode, aten.div.Scalar_mode, needs_ctx=True)
@takes_traced_scalars
def div_mode(ctx, a, b, *, rounding_mode=None):
    out = ctx.out_dtype
    a, b = cast(a, accumulation_dtype(out)), cast(b, accumulation_dtype(out))
    if rounding_mode is None:
        return (a / b).astype(out)
    if rounding_mode == "floor":
        return jnp.floor_divide(a, b).astype(out)
    if jnp.issubdtype(out, jnp.integer):  # "trunc" on integers: C division
        return lax.div(*jnp.broadcast_arrays(a, b))
    return jnp.trunc((a / b).astype(out))  # torch truncates the quotient rounded to its dtype


@elementwise(aten.floor_divide)
def floor_divide(a, b):
    return jnp.floor_divide(a, b)


@elementwise(aten.remainder)
def remainder(a, b):
    return jnp.remainder(a, b)


@elementwise(aten.fmod)
def fmod(a, b):
    return jnp.fmod(a, b)


@elementwise(aten.pow)
def pow_(a, b):
    if not jnp.issubdtype(a.dtype, jnp.integer):
        return jnp.power(a, b)
    # torch: an integer to a negative power is 1/a truncated (0 unless a is 1 or -1).
    negative = b < 0
    powered = _integer_power(a, jnp.where(negative, jnp.zeros((), b.dtype), b))
    inverse = jnp.where(jnp.abs(a) == 1, jnp.where(b % 2 == 0, jnp.ones((), a.dtype), a), 0)
    return jnp.where(negative, inverse.astype(a.dtype), powered)


def _integer_power(a, b):
    """a ** b for integers b >= 0, squaring over every bit of b and wrapping as torch does
    (jnp.power reads only b's low 6 bits: 7 ** (2**24 + 1) came back 7). A constant b takes
    as many steps as it has bits."""
    steps = jnp.iinfo(b.dtype).bits - 1  # b >= 0: its sign bit is clear
    if not isinstance(b, jax.core.Tracer):
        steps = int(np.max(np.asarray(b), initial=0)).bit_length()
    result = jnp.ones_like(a)
    for _ in range(steps):
        result = jnp.where((b & 1) == 1, result * a, result)
        a, b = a * a, b >> 1
    return result


@register_lowering(aten.nextafter, needs_ctx=True)
def nextafter(ctx, a, b):
    """The next value after `a` toward `b` in the result's own dtype: a 16-bit float steps by
    its own ulp (computed in float32 and rounded back, nextafter(1, 2) would stay 1)."""
    return jnp.nextafter(cast(a, ctx.out_dtype), cast(b, ctx.out_dtype))


@elementwise(aten.round.default)
def round_(x):
    return jnp.round(x)


@elementwise(aten.round.decimals)
def round_decimals(x, *, decimals=0):
    scale = 10.0**decimals
    return jnp.round(x * scale) / scale


@register_lowering(
    aten.where.self,
    aten.where.ScalarSelf,
    aten.where.ScalarOther,
    aten.where.Scalar,
    needs_ctx=True,
)
def where(ctx, condition, a, b):
    dtype = ctx.out_dtype
    return jnp.where(condition, cast(a, dtype), cast(b, dtype))


@register_lowering(aten.clamp.default, aten.clamp.Tensor, needs_ctx=True)
@takes_traced_scalars
def clamp(ctx, x, min=None, max=None):
    dtype = ctx.compute_dtype()
    x = cast(x, dtype)
    if min is not None:
        x = jnp.maximum(x, cast(min, dtype))
    if max is not None:
        x = jnp.minimum(x, cast(max, dtype))
    return cast(x, ctx.out_dtype)


@elementwise(aten.clamp_min)
def clamp_min(x, low):
    return jnp.maximum(x, low)


@elementwise(aten.clamp_max)
def clamp_max(x, high):
    return jnp.minimum(x, high)


@elementwise(aten.lerp)
def lerp(start, end, weight):
    """torch's two-sided formula: exact at weight 1, and eager's value where start or end is
    infinite (start + weight * (end - start) gave NaN for lerp(inf, 1, 0.7), eager -inf)."""
    diff = end - start
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))


@elementwise(aten.addcmul)
def addcmul(x, a, b, *, value=1):
    return x + value * a * b


@elementwise(aten.addcdiv)
def addcdiv(x, a, b, *, value=1):
    return x + value * a / b


def _gelu(x, approximate):
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
        return 0.5 * x * (1 + jnp.tanh(inner))
    return 0.5 * x * (1 + jax.scipy.special.erf(x / math.sqrt(2)))


@elementwise(aten.gelu)
def gelu(x, *, approximate="none"):
    return _gelu(x, approximate)


@elementwise(aten.gelu_backward)
def gelu_backward(grad, x, *, approximate="none"):
    _, vjp = jax.vjp(lambda v: _gelu(v, approximate), x)
    return vjp(grad)[0]


@elementwise(aten.sigmoid_backward)
def sigmoid_backward(grad, y):
    return grad * y * (1 - y)


@elementwise(aten.tanh_backward)
def tanh_backward(grad, y):
    return grad * (1 - y * y)


@elementwise(aten.threshold_backward)
def threshold_backward(grad, x, threshold):
    return jnp.where(x <= threshold, jnp.zeros((), grad.dtype), grad)


@elementwise(aten.silu_backward)
def silu_backward(grad, x):
    s = jax.nn.sigmoid(x)
    return grad * s * (1 + x * (1 - s))


@elementwise(aten.hardtanh)
def hardtanh(x, min_val=-1.0, max_val=1.0):
    return jnp.clip(x, min_val, max_val)


@elementwise(aten.leaky_relu)
def leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


@elementwise(aten.elu)
def elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    return jnp.where(x > 0, x * scale, alpha * scale * jnp.expm1(x * input_scale))


@elementwise(aten.softplus)
def softplus(x, beta=1.0, threshold=20.0):
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta)


@elementwise(aten.hardsigmoid)
def hardsigmoid(x):
    return jnp.clip(x / 6 + 0.5, 0, 1)


@elementwise(aten.hardswish)
def hardswish(x):
    return x * jnp.clip(x / 6 + 0.5, 0, 1)


@elementwise(aten.mish)
def mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


@register_lowering(aten.complex.default, needs_ctx=True)
def complex_(ctx, real, imag):
    return lax.complex(*jnp.broadcast_arrays(real, imag)).astype(ctx.out_dtype)


@register_lowering(aten.polar.default, needs_ctx=True)
def polar(ctx, abs_, angle):
    """abs * cos(angle) + i abs * sin(angle), each product rounded as torch's kernel rounds it."""
    abs_, angle = jnp.broadcast_arrays(abs_, angle)
    return lax.complex(abs_ * jnp.cos(angle), abs_ * jnp.sin(angle)).astype(ctx.out_dtype)
