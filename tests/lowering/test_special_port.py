"""torch's own special-function algorithms ported to jax, against eager torch (float32).

Bessel J/Y, modified Bessel K (plain and scaled) and Airy Ai are Cephes rational and Chebyshev
fits with branch points; the orthogonal polynomials take a per-element degree n with torch's
early returns (n < 0, endpoints, trig forms for large n) before a recurrence. The inputs sit on
and around every branch: zero, negatives, branch points, large values, ±inf and NaN.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import check_many_against_eager

SP = torch.special
LOWERED = {"fallback": "error"}  # every op lowered by our rules, none run in eager
TIGHT = {"rtol": 1e-5, "atol": 1e-6}
# The trig forms amplify libm's last-ulp differences in acos/cos by n.
POLYNOMIAL_TOL = {"rtol": 1e-4, "atol": 1e-5}

UNARY = {
    "bessel_j0": SP.bessel_j0,
    "bessel_j1": SP.bessel_j1,
    "bessel_y0": SP.bessel_y0,
    "bessel_y1": SP.bessel_y1,
    "modified_bessel_k0": SP.modified_bessel_k0,
    "modified_bessel_k1": SP.modified_bessel_k1,
    "scaled_modified_bessel_k0": SP.scaled_modified_bessel_k0,
    "scaled_modified_bessel_k1": SP.scaled_modified_bessel_k1,
    "airy_ai": SP.airy_ai,
}

POLYNOMIALS = {
    name: getattr(SP, name)
    for name in [
        *(f"{shift}chebyshev_polynomial_{kind}" for shift in ("", "shifted_") for kind in "tuvw"),
        "hermite_polynomial_h",
        "hermite_polynomial_he",
        "laguerre_polynomial_l",
        "legendre_polynomial_p",
    ]
}
# torch returns an uninitialized value for NaN x and n >= 2 in these (its `T r;` is never
# assigned when the loop stops at once on NaN); ours return NaN. The others define NaN.
NAN_DEFINED = {"chebyshev_polynomial_t", "hermite_polynomial_h", "hermite_polynomial_he"}


def _edge_points():
    return torch.tensor(
        [0.0, -0.0, 1e-6, -1e-6, 1e-5, 2.0, -2.0, 2.09, -2.09, 2.0900002, 5.0, -5.0, 5.0000005,
         8.3203353, 8.4, 103.892, 104.0, 1e3, -1e3, 1e10, 1e30, -1e30, 3.4e38,
         float("inf"), float("-inf"), float("nan")]
    )  # fmt: skip


def test_bessel_and_airy_against_eager():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-30, 30, 1201), torch.randn(400, generator=g) * 1e3])
    x = torch.cat([x, _edge_points()])
    ints = torch.arange(-6, 7)  # int64 input: computed in float32, as torch promotes
    fns = {name: (lambda x, i, f=f: f(x)) for name, f in UNARY.items()}
    fns |= {f"{name}_int": (lambda x, i, f=f: f(i)) for name, f in UNARY.items()}
    check_many_against_eager(fns, x, ints, tolerance=lambda *_: TIGHT, options=LOWERED)


def _grid(xs, ns):
    x, n = torch.meshgrid(torch.tensor(xs), torch.tensor(ns), indexing="ij")
    return x.contiguous(), n.contiguous()


def test_polynomials_against_eager():
    xs = [-3.0, -2.5, -1.5, -1.0, -0.99999994, -0.9, -0.5, -0.3, -1e-10, 0.0, 1e-10, 0.1, 0.25,
          0.5, 0.7, 0.99999994, 1.0, 1.0000001, 1.5, 2.0, 7.0, -9.0, 1e3, -1e3,
          float("inf"), float("-inf")]  # fmt: skip
    ns = [-3.0, -1.0, -0.5, 0.0, 0.7, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0,
          12.0, 17.0, 25.0, 40.0, 1e30,
          float("inf"), float("-inf"), float("nan")]  # fmt: skip
    x, n = _grid(xs, ns)
    fns = {name: (lambda x, n, f=f: f(x, n)) for name, f in POLYNOMIALS.items()}
    check_many_against_eager(fns, x, n, tolerance=lambda *_: POLYNOMIAL_TOL, options=LOWERED)


def test_recurrences_dense():
    """Hermite, Laguerre and Legendre are the recurrence alone, so they match eager to the ulp
    (a 1/(k+1) reciprocal instead of the division is off by 10% near roots). Degrees cross
    Hermite's limit (NaN above 128), where its values have overflowed to NaN already.
    """
    xs = torch.cat([torch.linspace(-0.999, 0.999, 81), torch.tensor([-9.0, -2.0, 1.2, 4.0, 30.0])])
    ns = torch.cat([torch.arange(0.0, 41.0, 3.0), torch.tensor([60.0, 127.0, 128.0, 129.0, 300.0])])
    x, n = _grid(xs.tolist(), ns.tolist())
    names = ["hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
             "legendre_polynomial_p"]  # fmt: skip
    fns = {name: (lambda x, n, f=POLYNOMIALS[name]: f(x, n)) for name in names}
    check_many_against_eager(fns, x, n, tolerance=lambda *_: TIGHT, options=LOWERED)


def test_chebyshev_of_huge_degree():
    """n = 2e9: the trig form inside (-1, 1), and a recurrence that overflows to NaN (and
    stops there) outside; no loop runs to n. Inside, only points where acos is exact in both
    libraries are comparable (an ulp of acos times 2e9 is noise).
    """
    x, n = _grid([-3.0, -1.5, -0.5, 0.0, 0.5, 1.5, 3.0], [2e9, 2.5e9])
    chebyshev = {k: v for k, v in POLYNOMIALS.items() if "chebyshev" in k}
    fns = {name: (lambda x, n, f=f: f(x, n)) for name, f in chebyshev.items()}
    check_many_against_eager(fns, x, n, tolerance=lambda *_: POLYNOMIAL_TOL, options=LOWERED)


def test_polynomials_random_and_scalar_overloads():
    g = torch.Generator().manual_seed(1)
    x, n = torch.randn(64, generator=g) * 3, (torch.rand(64, generator=g) * 24 - 4).round()
    fns = {}
    for name, f in POLYNOMIALS.items():
        fns[name] = lambda x, n, f=f: f(x, n)
        fns[f"{name}_n_scalar"] = lambda x, n, f=f: f(x, 7)  # .n_scalar overload
        fns[f"{name}_x_scalar"] = lambda x, n, f=f: f(0.375, n)  # .x_scalar overload
    check_many_against_eager(fns, x, n, tolerance=lambda *_: POLYNOMIAL_TOL, options=LOWERED)


def test_polynomials_of_nan():
    x, n = _grid([float("nan")], [-1.0, 0.0, 1.0, 2.0, 3.0, 9.0])
    defined = {name: (lambda x, n, f=POLYNOMIALS[name]: f(x, n)) for name in NAN_DEFINED}
    check_many_against_eager(defined, x, n, tolerance=lambda *_: TIGHT, options=LOWERED)
    # Where torch's answer is undefined: 0 for n < 0, 1 for n == 0, NaN from n == 1 on.
    from tests.helpers import compile_aten

    names = sorted(set(POLYNOMIALS) - NAN_DEFINED)
    out = compile_aten(lambda x, n: tuple(POLYNOMIALS[k](x, n) for k in names), (x, n), LOWERED)
    for name, got in zip(names, out(x, n)):
        assert got[0, 0] == 0 and got[0, 1] == 1 and got[0, 2:].isnan().all(), (name, got)


@pytest.mark.parametrize("group", ["unary", "polynomials"])
def test_narrow_x64(group):
    """x64="narrow": the degree's int copy and the loop counter are int32."""
    options = {**LOWERED, "x64": "narrow"}
    if group == "unary":
        x = torch.cat([torch.linspace(-12, 12, 97), _edge_points()])
        fns = {name: (lambda x, f=f: f(x)) for name, f in UNARY.items()}
        check_many_against_eager(fns, x, tolerance=lambda *_: TIGHT, options=options)
    else:
        x, n = _grid([-2.0, -1.0, -0.4, 0.0, 0.3, 1.0, 1.7], [-1.0, 0.0, 1.0, 2.0, 5.0, 9.0, 1e30])
        fns = {name: (lambda x, n, f=f: f(x, n)) for name, f in POLYNOMIALS.items()}
        check_many_against_eager(fns, x, n, tolerance=lambda *_: POLYNOMIAL_TOL, options=options)


def test_float64():
    """Computed in float64 as torch does."""
    x = torch.cat([torch.linspace(-30, 30, 601), _edge_points()]).double()
    fns = {name: (lambda x, f=f: f(x)) for name, f in UNARY.items()}
    tol = {"rtol": 1e-12, "atol": 1e-13}
    check_many_against_eager(fns, x, tolerance=lambda *_: tol, options=LOWERED)
    x, n = _grid(
        [-2.0, -1.0, -0.4, 0.0, 0.3, 0.5, 1.0, 1.7], [-1.0, 0.0, 2.0, 9.0, 30.0, 512.0, 513.0]
    )
    fns = {name: (lambda x, n, f=f: f(x, n)) for name, f in POLYNOMIALS.items()}
    tol = {"rtol": 1e-9, "atol": 1e-10}
    check_many_against_eager(fns, x.double(), n.double(), tolerance=lambda *_: tol, options=LOWERED)
