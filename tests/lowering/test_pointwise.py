"""Pointwise rules against eager torch: properties over shapes (0-d, size 1, broadcasting),
dtypes (float32, bfloat16, int64, bool) and scalar operands, plus edge values per unary op.

An op is checked on every dtype eager torch accepts it for (`_accepts`); the property
tests compile all ops of a family into one graph so that a random shape costs one compile.
"""

from __future__ import annotations

import functools

import torch
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import BroadcastableShapes, mutually_broadcastable_shapes

from tests.helpers import (
    assert_same,
    check_against_eager,
    check_many_against_eager,
    eager_accepts,
)
from tests.strategies import FLOAT64_EDGES, INT_EDGES, PROPERTY, seeds, shapes, values

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)

# Tolerances: (rtol, atol) per dtype, then per (op, dtype) where an op needs more.
TOLERANCES = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}
OP_TOLERANCES = {
    ("lgamma", torch.float32): (1e-5, 1e-4),
    ("digamma", torch.float32): (1e-5, 1e-4),
    ("erfinv", torch.float32): (1e-5, 1e-5),
    ("tan", torch.float32): (1e-5, 1e-5),
    ("cosh", torch.float32): (3e-6, 1e-5),
    ("sinh", torch.float32): (3e-6, 1e-5),
    ("pow", torch.float32): (1e-5, 1e-5),
    ("lgamma", torch.bfloat16): (3e-2, 3e-2),
    ("digamma", torch.bfloat16): (3e-2, 3e-2),
    ("tan", torch.bfloat16): (3e-2, 3e-2),
    # eager CPU rounds alpha * b to bfloat16 before adding; we round once (as torch on GPU).
    ("add_alpha", torch.bfloat16): (1.6e-2, 6.3e-2),
    ("sub_alpha", torch.bfloat16): (1.6e-2, 6.3e-2),
}

UNARY = {
    name: getattr(torch, name)
    for name in (
        "abs neg exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sin cos tan asin acos atan sinh "
        "cosh tanh asinh acosh atanh sigmoid erf erfc erfinv lgamma digamma ceil floor trunc frac "
        "sign sgn reciprocal relu logical_not bitwise_not isnan isinf isfinite signbit square "
        "positive i0 round"
    ).split()
}
UNARY |= {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
    "round_2": functools.partial(torch.round, decimals=2),
    "hardtanh": torch.nn.functional.hardtanh,
    "leaky_relu": torch.nn.functional.leaky_relu,
    "elu": torch.nn.functional.elu,
    "softplus": torch.nn.functional.softplus,
    "hardsigmoid": torch.nn.functional.hardsigmoid,
    "hardswish": torch.nn.functional.hardswish,
    "mish": torch.nn.functional.mish,
}

BINARY = {
    name: getattr(torch, name)
    for name in (
        "add sub mul div rsub atan2 maximum minimum fmax fmin hypot copysign nextafter "
        "logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor remainder fmod "
        "floor_divide pow xlogy"
    ).split()
}
BINARY |= {
    "add_alpha": functools.partial(torch.add, alpha=2),
    "sub_alpha": functools.partial(torch.sub, alpha=3),
    "div_floor": functools.partial(torch.div, rounding_mode="floor"),
    "div_trunc": functools.partial(torch.div, rounding_mode="trunc"),
}
COMPARE = {name: getattr(torch, name) for name in ("eq", "ne", "lt", "le", "gt", "ge")}
# Ops whose second operand must be nonzero (integer division by zero raises in torch).
DIVIDES = {"div", "div_floor", "div_trunc", "remainder", "fmod", "floor_divide"}

EDGE_VALUES = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.7, 1e-30, 1e30, 88.0, float("inf")]
EDGE_VALUES += [float("-inf"), float("nan"), 0.999, -0.999, 2.0, -7.0]
# Ops checked at finite edge values only, with the reason.
FINITE_ONLY = {
    "gelu": "eager's CPU kernel returns nan at +inf (0 * inf inside); ours returns the limit",
}


def _tol(name: str, dtype: torch.dtype) -> dict:
    rtol, atol = OP_TOLERANCES.get((name, dtype), TOLERANCES.get(dtype, (0, 0)))
    return {"rtol": rtol, "atol": atol}


@functools.cache
def _accepts(table: str, name: str, *dtypes: torch.dtype) -> bool:
    """Whether eager torch implements the op for these operand dtypes."""
    fn = {"unary": UNARY, "binary": BINARY, "compare": COMPARE}[table][name]
    return eager_accepts(fn, *[torch.ones(2, dtype=d) for d in dtypes])


def test_unary_edge_values():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.tensor(EDGE_VALUES, dtype=dtype)
        fns = {
            n: _finite_only(f) if n in FINITE_ONLY else f
            for n, f in UNARY.items()
            if _accepts("unary", n, dtype)
        }
        check_many_against_eager(fns, x, tolerance=_tol)


# Integers past float32's 2**24 and float64's 2**53, int64's extremes, and small ones.
BIG_INTS = [1, 7, -7, *INT_EDGES]
# float64 values that float32 rounds (or cannot hold at all) beside the float edge values;
# no subnormals: XLA:CPU flushes them to zero (README, Limits).
FLOAT64_VALUES = [*FLOAT64_EDGES, 2**60 + 2.0**8] + EDGE_VALUES
# float64 results agree to a few ulps: a result that went through float32 is off by ~1e-8.
FLOAT64_TOL = (1e-13, 1e-14)


def _pairs(points, dtype):
    """Every (a, b) pair of `points` as two flat tensors (len(points)**2 elements each)."""
    v = torch.tensor(points, dtype=dtype)
    return v.repeat_interleave(len(points)), v.repeat(len(points))


def _edge_tol(name: str, dtype: torch.dtype) -> dict:
    rtol, atol = FLOAT64_TOL if dtype == torch.float64 else (None, None)
    return _tol(name, dtype) if rtol is None else {"rtol": rtol, "atol": atol}


def test_binary_edge_values():
    """Every pair of edge values through every binary op and comparison: NaN, ±inf, -0.0,
    zero divisors, tiny and huge operands; float64 values float32 cannot hold, kept to a few
    ulps; int64 past 2**24 and 2**53 exactly (integer division by zero raises in torch, so
    the integer dividing ops get nonzero divisors)."""
    for dtype, points in (
        (torch.float32, EDGE_VALUES),
        (torch.bfloat16, EDGE_VALUES),
        (torch.float64, FLOAT64_VALUES),
        (torch.int64, BIG_INTS),
    ):
        a, b = _pairs(points, dtype)
        nonzero = torch.where(b == 0, torch.ones((), dtype=dtype), b)
        fns = {}
        for n, f in {**BINARY, **{f"cmp_{n}": f for n, f in COMPARE.items()}}.items():
            if _accepts(
                "compare" if n.startswith("cmp_") else "binary",
                n.removeprefix("cmp_"),
                dtype,
                dtype,
            ):
                integer_division = n in DIVIDES and not dtype.is_floating_point
                fns[n] = lambda a, b, nz, f=f, i=integer_division: f(a, nz if i else b)
        for n in ("fmod", "remainder") if dtype.is_floating_point else ():
            fns[n] = lambda a, b, nz, f=BINARY[n]: f(a, _finite_quotient_divisors(a, b))
        check_many_against_eager(fns, a, b, nonzero, tolerance=_edge_tol)


aten = torch.ops.aten
# Ternary ops, activation gradients and activations at arguments other than their defaults:
# name → fn(x, a, b, g), g a gradient.
TERNARY = {
    "lerp": lambda x, a, b, g: torch.lerp(x, a, 0.3),
    "lerp_tensor": lambda x, a, b, g: torch.lerp(x, a, b),
    "addcmul": lambda x, a, b, g: torch.addcmul(x, a, b),
    "addcmul_value": lambda x, a, b, g: torch.addcmul(x, a, b, value=-0.5),
    "addcdiv": lambda x, a, b, g: torch.addcdiv(x, a, b),
    "addcdiv_value": lambda x, a, b, g: torch.addcdiv(x, a, b, value=2.5),
    "sigmoid_backward": lambda x, a, b, g: aten.sigmoid_backward(g, torch.sigmoid(x)),
    "tanh_backward": lambda x, a, b, g: aten.tanh_backward(g, torch.tanh(x)),
    "silu_backward": lambda x, a, b, g: aten.silu_backward(g, x),
    "threshold_backward": lambda x, a, b, g: aten.threshold_backward(g, x, 0.5),
    "gelu_backward": lambda x, a, b, g: aten.gelu_backward(g, x),
    "gelu_backward_tanh": lambda x, a, b, g: aten.gelu_backward(g, x, approximate="tanh"),
    "hardtanh": lambda x, a, b, g: torch.nn.functional.hardtanh(x, -2.0, 0.5),
    "leaky_relu": lambda x, a, b, g: torch.nn.functional.leaky_relu(x, 0.2),
    "elu": lambda x, a, b, g: aten.elu(x, 0.5, 2.0, 1.5),
    "softplus": lambda x, a, b, g: torch.nn.functional.softplus(x, beta=2.0, threshold=3.0),
    "round_negative_decimals": lambda x, a, b, g: torch.round(x * 100, decimals=-1),
}


def test_ternary_ops_and_activation_gradients():
    """Edge values included (NaN, ±inf, -0.0, zero divisors for addcdiv)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        args = [values((64,), dtype, seed, edges=seed % 2 == 0) for seed in range(4)]
        check_many_against_eager(TERNARY, *args, tolerance=_edge_tol)


def _finite_quotient_divisors(a, b):
    """b, with 1 where a / b overflows: there eager's vectorized CPU fmod and remainder
    (a - trunc(a / b) * b) return NaN for fmod(1e30, 1e-30), ours the exact remainder (numpy's)."""
    return torch.where((a / b).isinf() & a.isfinite() & (b != 0), torch.ones((), dtype=b.dtype), b)


def test_unary_edge_values_of_64_bit_values():
    """float64 values float32 cannot hold (kept to a few ulps) and int64 past 2**53, exactly."""
    for dtype, points in ((torch.float64, FLOAT64_VALUES), (torch.int64, BIG_INTS)):
        x = torch.tensor(points, dtype=dtype)
        fns = {n: f for n, f in UNARY.items() if _accepts("unary", n, dtype)}
        fns = {n: _finite_only(f) if n in FINITE_ONLY else f for n, f in fns.items()}
        check_many_against_eager(fns, x, tolerance=_edge_tol)


def _finite_only(fn):
    return lambda x: fn(torch.where(x.isinf(), torch.zeros((), dtype=x.dtype), x))


@PROPERTY
@given(shape=shapes(), dtype=st.sampled_from(DTYPES), seed=seeds(), edges=st.booleans())
@example(shape=(), dtype=torch.float32, seed=0, edges=False)
@example(shape=(), dtype=torch.int64, seed=1, edges=True)
@example(shape=(3, 0, 2), dtype=torch.bfloat16, seed=2, edges=False)
@example(shape=(7, 300), dtype=torch.float32, seed=3, edges=True)  # past a thousand elements
@example(shape=(1100,), dtype=torch.int64, seed=4, edges=True)
def test_unary(shape, dtype, seed, edges):
    fns = {n: _finite_only(f) if n in FINITE_ONLY else f for n, f in UNARY.items()}
    fns = {n: f for n, f in fns.items() if _accepts("unary", n, dtype)}
    check_many_against_eager(fns, values(shape, dtype, seed, edges=edges), tolerance=_tol)


@PROPERTY
@given(
    shapes=mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=4),
    dtypes=st.tuples(st.sampled_from(DTYPES), st.sampled_from(DTYPES)),
    seed=seeds(),
    edges=st.booleans(),
)
@example(
    shapes=BroadcastableShapes(((1200,), ()), (1200,)),
    dtypes=(torch.int64, torch.int64),
    seed=0,
    edges=True,
)
@example(
    shapes=BroadcastableShapes(((3, 1, 400), (5, 1)), (3, 5, 400)),
    dtypes=(torch.float32, torch.bfloat16),
    seed=1,
    edges=True,
)
@example(
    shapes=BroadcastableShapes(((0, 3), (1, 3)), (0, 3)),
    dtypes=(torch.bool, torch.int64),
    seed=2,
    edges=False,
)
@example(  # a bool tensor times inf: XLA's simplifier made False * inf 0, torch's is nan
    shapes=BroadcastableShapes(((64,), (64,)), (64,)),
    dtypes=(torch.bool, torch.float32),
    seed=3,
    edges=True,
)
def test_binary_broadcast_and_promotion(shapes, dtypes, seed, edges):
    """Tensor ⊕ tensor with broadcasting and torch's type promotion (int × float, bf16 × f32),
    edge values included (NaN, ±inf, -0.0, zero divisors, integers past 2**53)."""
    a = values(shapes.input_shapes[0], dtypes[0], seed, edges=edges)
    b = values(shapes.input_shapes[1], dtypes[1], seed + 1, edges=edges, nonzero=True)
    fns = {n: f for n, f in BINARY.items() if _accepts("binary", n, *dtypes)}
    for n in {"fmod", "remainder"} & set(fns):
        fns[n] = lambda a, b, f=fns[n]: f(a, _finite_quotient_divisors(a, b))
    fns |= {f"cmp_{n}": f for n, f in COMPARE.items() if _accepts("compare", n, *dtypes)}
    check_many_against_eager(fns, a, b, tolerance=_tol)


@PROPERTY
@given(
    shape=shapes(),
    dtype=st.sampled_from(DTYPES),
    scalar=st.sampled_from([2, -3, 0.5, -1.25, True, 0, -0.0, float("inf"), 2**40 + 1]),
    seed=seeds(),
)
@example(shape=(), dtype=torch.int64, scalar=2**53 + 1, seed=0)
@example(shape=(2, 600), dtype=torch.float32, scalar=float("nan"), seed=1)
@example(shape=(4, 4, 4), dtype=torch.bool, scalar=float("inf"), seed=558)  # False * inf is nan
def test_scalar_operands(shape, dtype, scalar, seed):
    """Python scalars on either side: an int or float scalar promotes only across categories;
    zero, -0.0, inf, NaN and integers past float32's and float64's mantissas among them."""
    x = values(shape, dtype, seed)
    fns = {
        f"{n}{side}": (lambda x, f=f: f(x, scalar))
        if side == "_r"
        else (lambda x, f=f: f(scalar, x))
        for n, f in BINARY.items()
        for side in ("_r", "_l")
        if n not in ("rsub", "nextafter", "xlogy")
    }
    fns |= {f"cmp_{n}": (lambda x, f=f: f(x, scalar)) for n, f in COMPARE.items()}
    fns = {
        n: f for n, f in fns.items() if eager_accepts(f, x) and not _divides_by_zero(n, x, scalar)
    }
    if dtype == torch.bool and scalar is True:  # eager says bool, torch's meta kernel int64
        fns.pop("pow_r", None)
    check_many_against_eager(fns, x, tolerance=_tol)


def test_16_bit_ops_take_python_scalars_at_float32_and_round_once():
    """A Python scalar operand of a bfloat16/float16 op enters the float32 computation as it is,
    and the result is rounded once: what Inductor and torch's CUDA kernels do. torch's CPU
    kernels round some scalars to the tensor's dtype first (bfloat16 `x + 1001` adds 1000, so
    -2.5 + 1001 gives 996 there and 1000 here and in Inductor): no tolerance covers that step,
    so the expected values are spelled out."""
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.tensor([3.0, 1.0, -2.5, 7.0], dtype=dtype)
        fns = {
            "add": (lambda x: x + 1001, lambda w: w + 1001),
            "sub": (lambda x: x - 1001.3, lambda w: w - 1001.3),
            "rsub": (lambda x: 1001 - x, lambda w: 1001 - w),
            "fmod": (lambda x: torch.fmod(x, 2.01), lambda w: torch.fmod(w, 2.01)),
        }
        for name, (fn, at_float32) in fns.items():
            expected = at_float32(x.float()).to(dtype)
            compiled = torch.compile(fn, backend="tpu_inductor", options={"cache": False})
            assert torch.equal(compiled(x), expected), (name, dtype, compiled(x), expected)


def _divides_by_zero(name: str, x: torch.Tensor, scalar) -> bool:
    """Integer division by an integer zero raises in torch: of a scalar by x, or of x by 0."""
    if name.removesuffix("_l").removesuffix("_r") not in DIVIDES or x.is_floating_point():
        return False
    return name.endswith("_l") or (scalar == 0 and not isinstance(scalar, float))


@PROPERTY
@given(
    shapes=mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=3, max_side=4),
    dtype=st.sampled_from((torch.float32, torch.bfloat16, torch.int64)),
    seed=seeds(),
)
def test_where_and_clamp(shapes, dtype, seed):
    c_shape, a_shape, b_shape = shapes.input_shapes
    cond = values(c_shape, torch.bool, seed)
    a, b = values(a_shape, dtype, seed + 1), values(b_shape, torch.float32, seed + 2)
    lo, hi = values(b_shape, dtype, seed + 3), values(b_shape, dtype, seed + 4) + 5
    fns = {
        "where": lambda c, a, b, lo, hi: torch.where(c, a, b),
        "where_scalar": lambda c, a, b, lo, hi: torch.where(c, a, 2),
        "where_scalars": lambda c, a, b, lo, hi: torch.where(c, 1.5, -1),
        "clamp": lambda c, a, b, lo, hi: torch.clamp(a, -2, 3),
        "clamp_float_bounds": lambda c, a, b, lo, hi: torch.clamp(a, min=-1.5),
        "clamp_tensors": lambda c, a, b, lo, hi: torch.clamp(a, lo, hi),
        "clamp_min": lambda c, a, b, lo, hi: torch.clamp_min(a, lo),
        "clamp_max": lambda c, a, b, lo, hi: torch.clamp_max(a, 1),
    }
    check_many_against_eager(fns, cond, a, b, lo, hi, tolerance=_tol)


def test_complex_operands():
    """Complex arguments, including real results of them (abs: the modulus, not |real|)."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, 5, dtype=torch.complex64, generator=gen) * 2
    w = torch.randn(2, 5, dtype=torch.complex64, generator=gen) + 0.5
    x = torch.randn(5, generator=gen)
    tol = lambda name, dtype: {"rtol": 1e-5, "atol": 1e-5}  # noqa: E731
    unary = {n: f for n, f in UNARY.items() if _accepts("unary", n, torch.complex64)}
    # isfinite: make_fx keeps its complex composite's in-place bitwise_and_ (see below)
    fns = {n: lambda z, w, x, f=f: f(z) for n, f in unary.items() if n != "isfinite"}
    for n, f in BINARY.items():
        if _accepts("binary", n, torch.complex64, torch.complex64):
            fns[n] = lambda z, w, x, f=f: f(z, w)
        if _accepts("binary", n, torch.complex64, torch.float32):
            fns[f"{n}_real"] = lambda z, w, x, f=f: f(z, x)
    assert {"abs", "sgn", "mul", "div"} <= set(fns)
    check_many_against_eager(fns, z, w, x, tolerance=tol)
    z[0, :3] = torch.tensor([complex(float("inf"), 0), complex(0, float("nan")), 1e30j])
    isfinite = torch.compile(torch.isfinite, backend="tpu_inductor", options={"fallback": "error"})
    assert_same(isfinite(z), torch.isfinite(z))


def test_shift_operators():
    """x << n and x >> n (aten.__lshift__/__rshift__), including shifts past the bit width."""
    fns = {
        "lshift": lambda x, t: x << 3,
        "rshift": lambda x, t: x >> 1,
        "lshift_tensor": lambda x, t: x << t,
        "rshift_tensor": lambda x, t: x >> t,
        "overshift": lambda x, t: (x << 9, x >> 9),  # past 8 bits
    }
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64):
        x = torch.tensor([7, -7, 1, 0, 100, -128]).to(dtype)
        t = torch.tensor([0, 1, 3, 7, 2, 9]).to(dtype)
        check_many_against_eager(fns, x, t, options={"fallback": "error"})


def test_xlogy_of_a_python_scalar():
    """torch's decomposition of xlogy(scalar, y) makes the scalar with prims.scalar_tensor."""
    y = torch.tensor([0.0, float("nan"), 2.0, 0.5])
    for x in (0.0, 3.0):
        fn = lambda y, x=x: torch.xlogy(x, y)  # noqa: E731
        compiled = torch.compile(fn, backend="tpu_inductor", options={"fallback": "error"})
        assert_same(compiled(y), fn(y))
    scalar = torch.ops.prims.scalar_tensor.default
    check_against_eager(
        lambda y: y * scalar(2.5, dtype=torch.float64, device=y.device),
        y,
        options={"fallback": "error"},
    )


def test_gcd_and_lcm():
    a = torch.tensor([12, -18, 0, 0, 7, 100, -45, 1])
    b = torch.tensor([8, 24, 5, 0, 13, -75, -30, 1])
    fns = {"gcd": torch.gcd, "lcm": torch.lcm}
    for dtype in (torch.int32, torch.int64, torch.int16):
        check_many_against_eager(fns, a.to(dtype), b.to(dtype), options={"fallback": "error"})


def test_cpu_sin_and_cos_polynomials_are_within_2_5_ulp():
    """XLA:CPU's float32 sin/cos (lowering/ops/cpu_math.py) against float64: next to every
    multiple of pi/2 up to the polynomials' limit (where a rough reduction loses all relative
    accuracy) and at random points, signed zeros included."""
    import jax
    import numpy as np
    from tpu_inductor.lowering.ops import cpu_math

    quadrants = np.arange(1, int(cpu_math.REDUCTION_LIMIT * 2 / np.pi) + 1)
    near = (quadrants * (np.pi / 2)).astype(np.float32)
    spread = np.random.default_rng(0).uniform(0, cpu_math.REDUCTION_LIMIT, 100_000)
    x = np.concatenate(
        [np.nextafter(near, np.float32(0)), near, np.nextafter(near, np.float32(np.inf)), spread]
    ).astype(np.float32)
    x = np.concatenate([x, -x, np.float32([0.0, 1e-30, 0.25, np.pi / 4])])
    for polynomial, reference in (
        (cpu_math.polynomial_sin, np.sin),
        (cpu_math.polynomial_cos, np.cos),
    ):
        got = np.asarray(jax.jit(polynomial)(x)).astype(np.float64)
        want = reference(x.astype(np.float64))
        ulps = np.abs(got - want) / np.spacing(np.abs(want).astype(np.float32))
        worst = int(np.argmax(ulps))
        assert ulps[worst] <= 2.5, f"{reference.__name__}({x[worst]!r}): {ulps[worst]:.1f} ulp"
    assert np.signbit(np.asarray(jax.jit(cpu_math.polynomial_sin)(np.float32([-0.0])))).all()


def test_sin_and_cos_past_the_cpu_polynomials_range_match_eager():
    """A tensor with any element past the limit (or infinite, NaN) takes XLA's own op whole."""
    sin_cos = lambda x: (torch.sin(x), torch.cos(x))  # noqa: E731
    check_against_eager(sin_cos, torch.tensor([1e20, -3e9, 1e6, 8192.5, 0.5, -0.0]))
    check_against_eager(sin_cos, torch.tensor([0.5, -2.0, float("inf"), float("nan")]))
    check_against_eager(sin_cos, torch.linspace(-8192, 8192, 1001))  # the polynomials
    # subnormals (XLA:CPU reads them as zero: sin passes x through) and signed zeros, exactly
    check_against_eager(sin_cos, torch.tensor([1e-45, -1e-40, 1e-38, -0.0, 0.0]), rtol=0, atol=0)


def test_sin_and_cos_have_a_cpu_rule_and_a_portable_one():
    """The CPU module picks between the polynomials and XLA's op at run time; TPU's is XLA's."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from tpu_inductor.lowering import stablehlo

    x = torch.randn(8)
    gm = make_fx(lambda x: torch.sin(x) + torch.cos(x))(x)
    cpu, tpu = (stablehlo.lower(gm, [x], platform=p).text for p in ("cpu", "tpu"))
    assert "stablehlo.case" in cpu or "stablehlo.if" in cpu
    assert "stablehlo.sine" in tpu and "stablehlo.case" not in tpu and "stablehlo.if" not in tpu


def test_clamp_takes_its_bound_as_a_runtime_value():
    """An integer bound that changes between calls is passed to the compiled graph (clamp's
    rule takes traced scalars): one compile serves every value after Dynamo's first."""
    from tpu_inductor.runtime import devices

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, n: torch.clamp(x, max=n) * 2, backend="tpu_inductor")
    x = torch.linspace(-3, 3, 13)
    compiled(x, 1)
    before = devices.stats["pjrt_compiles"]
    for n in (2, 3, 0):
        torch.testing.assert_close(compiled(x, n), torch.clamp(x, max=n) * 2)
    assert devices.stats["pjrt_compiles"] - before <= 1  # 0: a module compiled before here
    torch._dynamo.reset()
