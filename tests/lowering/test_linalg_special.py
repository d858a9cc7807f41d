"""Linear algebra, FFT and special-function rules against eager torch (float32).

Each group compiles many ops into one graph (one compile per group). Factorization outputs
that OpInfo never sees (LU, pivots, info) are compared too, including `info` on singular and
non-positive-definite inputs, and the decompositions we leave to eager (SVD and eigenvector
signs differ between LAPACKs) are checked to stay unlowered.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import check_against_eager, check_many_against_eager, compile_aten
from tpu_inductor.exc import UnsupportedOpError

TOL = {"rtol": 1e-4, "atol": 1e-5}
LOWERED = {"fallback": "error"}  # every op must be lowered by our rules, none run in eager
LA = torch.linalg


def _tol(name, dtype):
    return {"rtol": 1e-4, "atol": 1e-4} if dtype.is_floating_point or dtype.is_complex else {}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_norms_and_distances():
    g = _gen()
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    b1, b2 = torch.randn(3, 4, 2, generator=g), torch.randn(3, 2, 5, generator=g)
    fns = {f"vector_norm_{o}": (lambda x, y, b1, b2, o=o: LA.vector_norm(x, o, dim=1))
           for o in (2, 1, 0, 3, 0.5, float("inf"), float("-inf"))}  # fmt: skip
    fns |= {
        "vector_norm_all_keepdim": lambda x, y, b1, b2: LA.vector_norm(x, 2, None, True),
        "matrix_norm_fro": lambda x, y, b1, b2: LA.matrix_norm(x),
        "dist_3": lambda x, y, b1, b2: torch.dist(x, y, 3),
        "cdist_1": lambda x, y, b1, b2: torch.cdist(x, y, p=1),
        "cdist_2": lambda x, y, b1, b2: torch.cdist(x, y),
        "pdist": lambda x, y, b1, b2: torch.nn.functional.pdist(x),
        "normalize": lambda x, y, b1, b2: torch.nn.functional.normalize(x),
        "addbmm": lambda x, y, b1, b2: torch.addbmm(x, b1, b2, beta=0.5, alpha=2),
    }
    check_many_against_eager(fns, x, y, b1, b2, tolerance=_tol, options=LOWERED)


def test_cdist_matrix_product_form():
    g = _gen(1)
    x1, x2 = torch.randn(2, 30, 3, generator=g), torch.randn(2, 27, 3, generator=g)
    x2[:, 0] = x1[:, 0]  # a zero distance: the clamp in torch's expansion must match
    cdist = torch.ops.aten._cdist_forward.default  # what AOTAutograd's decompositions leave
    check_against_eager(lambda a, b: cdist(a, b, 2.0, None), x1, x2, **TOL, options=LOWERED)
    check_against_eager(lambda a, b: cdist(a, b, 2.0, 2), x1, x2, **TOL, options=LOWERED)


def _well_conditioned(g, *shape):
    n = shape[-1]
    return torch.randn(*shape, generator=g) + n * torch.eye(n)


def test_lu_family():
    g = _gen(2)
    a = torch.randn(2, 4, 4, generator=g)
    b, v = torch.randn(2, 4, 3, generator=g), torch.randn(2, 4, generator=g)
    fns = {
        "det": lambda a, b, v: LA.det(a),
        "slogdet": lambda a, b, v: LA.slogdet(a),
        "inv_ex": lambda a, b, v: LA.inv_ex(a),
        "solve": lambda a, b, v: LA.solve(a, b),
        "solve_vector": lambda a, b, v: LA.solve(a, v),
        "solve_right": lambda a, b, v: LA.solve(a, b.mT, left=False),
        "solve_ex_all": lambda a, b, v: torch.ops.aten._linalg_solve_ex(a, b),
        "lu_factor_ex": lambda a, b, v: LA.lu_factor_ex(a),
        "lu": lambda a, b, v: LA.lu(a),
        "lu_unpack": lambda a, b, v: torch.lu_unpack(*LA.lu_factor(a)),
        "lu_solve": lambda a, b, v: LA.lu_solve(*LA.lu_factor(a), b),
        "lu_solve_adjoint": lambda a, b, v: LA.lu_solve(*LA.lu_factor(a), b, adjoint=True),
        "lu_solve_right": lambda a, b, v: LA.lu_solve(*LA.lu_factor(a), b.mT, left=False),
        "lu_solve_right_adj": lambda a, b, v: LA.lu_solve(
            *LA.lu_factor(a), b.mT, left=False, adjoint=True
        ),
        "solve_triangular": lambda a, b, v: LA.solve_triangular(a.triu(), b, upper=True),
        "solve_triangular_right": lambda a, b, v: LA.solve_triangular(
            a.tril(), b.mT, upper=False, left=False, unitriangular=True
        ),
        "triangular_solve": lambda a, b, v: torch.triangular_solve(b, a, transpose=True),
    }
    check_many_against_eager(fns, a, b, v, tolerance=_tol, options=LOWERED)


# Eager factors A^T for a contiguous real A, else A.
_DET_LAYOUTS = {
    "contiguous": lambda g: _well_conditioned(g, 4, 4),
    "transposed": lambda g: _well_conditioned(g, 4, 4).mT,
    "batched": lambda g: _well_conditioned(g, 2, 5, 5),
    "batch_expanded": lambda g: _well_conditioned(g, 6, 6).expand(2, 6, 6),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
@pytest.mark.parametrize("layout", sorted(_DET_LAYOUTS))
def test_det_and_slogdet_factors_and_gradients(dtype, layout):
    """det and slogdet return eager's LU and pivots (of A^T or of A), which their backward
    solves with: returning A's factors for a contiguous A gave wrong gradients silently."""
    a = _DET_LAYOUTS[layout](_gen(8)).to(dtype).requires_grad_()
    aten = torch.ops.aten
    factors = lambda m: (*aten._linalg_det(m), *aten._linalg_slogdet(m))  # noqa: E731
    check_against_eager(factors, a, **TOL, options=LOWERED)

    def grads(m):  # the backward's diag_embed (decomposed by the backend) runs in eager here
        loss = LA.det(m).abs().sum() + LA.slogdet(m).logabsdet.sum()
        return torch.autograd.grad(loss, m)[0]

    check_against_eager(grads, a, **TOL, options={"fallback": "eager"})


def test_solve_broadcasts_a_over_b():
    """LU, pivots and info keep A's batch shape (as torch's meta says); the solution broadcasts."""
    g = _gen(9)
    a = _well_conditioned(g, 4, 4).requires_grad_()
    b = torch.randn(3, 4, 2, generator=g, requires_grad=True)
    solve_ex = torch.ops.aten._linalg_solve_ex
    both = lambda a, b: (*solve_ex(a, b), *solve_ex(a[None], b.mT, left=False))  # noqa: E731
    check_against_eager(both, a, b, **TOL, options=LOWERED)

    def grads(a, b):
        return torch.autograd.grad(LA.solve(a, b).square().sum(), (a, b))

    check_against_eager(grads, a, b, **TOL, options=LOWERED)


def test_lu_of_rectangular_and_singular_matrices():
    g = _gen(3)
    singular = torch.randn(3, 3, generator=g)
    singular[:, 2] = 0  # getrf reports info = 3
    wide = torch.randn(2, 3, 5, generator=g)
    check_against_eager(lambda a: LA.lu_factor_ex(a), singular, **TOL, options=LOWERED)
    check_against_eager(lambda a: (*LA.lu_factor_ex(a), *LA.lu(a)), wide, **TOL, options=LOWERED)


def _spd(g, *shape):
    m = torch.randn(*shape, generator=g)
    return m @ m.mT + shape[-1] * torch.eye(shape[-1])


def test_cholesky_family_and_unique_decompositions():
    g = _gen(4)
    a, b = _spd(g, 2, 4, 4), torch.randn(2, 4, 2, generator=g)
    a[..., 0, 3] += 0.5  # not symmetric: each rule must read the triangle torch reads
    tall, tau = torch.randn(5, 3, generator=g), torch.rand(3, generator=g)
    fns = {
        "cholesky_ex": lambda a, b, t, tau: LA.cholesky_ex(a),
        "cholesky_ex_upper": lambda a, b, t, tau: LA.cholesky_ex(a, upper=True),
        "cholesky_upper": lambda a, b, t, tau: torch.cholesky(a, upper=True),
        "cholesky_inverse": lambda a, b, t, tau: torch.cholesky_inverse(LA.cholesky(a)),
        "cholesky_inverse_upper": lambda a, b, t, tau: torch.cholesky_inverse(
            LA.cholesky(a, upper=True), upper=True
        ),
        "cholesky_solve": lambda a, b, t, tau: torch.cholesky_solve(b, LA.cholesky(a)),
        "pinv": lambda a, b, t, tau: LA.pinv(t),
        "pinv_atol": lambda a, b, t, tau: LA.pinv(t, atol=0.5),
        "pinv_hermitian": lambda a, b, t, tau: LA.pinv(a.tril() + a.tril(-1).mT, hermitian=True),
        "householder_product": lambda a, b, t, tau: LA.householder_product(t, tau),
        "qr": lambda a, b, t, tau: LA.qr(t),
        "qr_complete": lambda a, b, t, tau: LA.qr(t, mode="complete"),
        "qr_r": lambda a, b, t, tau: LA.qr(t, mode="r")[1],
        "svdvals": lambda a, b, t, tau: LA.svdvals(t),
        "eigvalsh": lambda a, b, t, tau: LA.eigvalsh(a),
        "eigvalsh_upper": lambda a, b, t, tau: LA.eigvalsh(a, UPLO="U"),
        "matrix_rank": lambda a, b, t, tau: LA.matrix_rank(t),
        "nuclear_norm": lambda a, b, t, tau: LA.matrix_norm(t, "nuc"),
    }
    check_many_against_eager(fns, a, b, tall, tau, tolerance=_tol, options=LOWERED)


def _ldl_cases(g):
    """Matrices that take each Bunch-Kaufman branch: plain 1x1 pivots, interchanges, 2x2 blocks
    (small diagonals), a zero column (info), and a non-symmetric one (only its lower triangle
    is read)."""
    sym = torch.randn(4, 6, 6, generator=g)
    sym = sym + sym.mT
    sym[1].diagonal().mul_(0.01)
    sym[2, :, 0] = sym[2, 0, :] = 0
    sym[3] = torch.randn(6, 6, generator=g)
    return sym


def test_ldl_factor_solve_and_matrix_exp():
    g = _gen(7)
    a, b = _ldl_cases(g), torch.randn(4, 6, 2, generator=g)
    ld, pivots, info = LA.ldl_factor_ex(a)
    interchanged = (pivots > 0) & (pivots != torch.arange(1, 7, dtype=torch.int32))
    assert bool((pivots < 0).any()) and bool(interchanged.any())
    assert info.tolist() == [0, 0, 1, 0]  # every branch above is taken by eager's own factor
    solvable = a[[0, 1, 3]]
    fns = {
        "ldl_factor_ex": lambda a, s, b: LA.ldl_factor_ex(a),
        "ldl_factor": lambda a, s, b: LA.ldl_factor(s),
        "ldl_solve": lambda a, s, b: LA.ldl_solve(*LA.ldl_factor(s), b[:3]),
        "ldl_solve_broadcast": lambda a, s, b: LA.ldl_solve(*LA.ldl_factor(s[0]), b[:3]),
        "ldl_factor_empty": lambda a, s, b: LA.ldl_factor_ex(a[:, :0, :0]),
        "matrix_exp": lambda a, s, b: torch.linalg.matrix_exp(a * 0.3),
    }
    check_many_against_eager(fns, a, solvable, b, tolerance=_tol, options=LOWERED)


def test_cholesky_info_names_the_failing_minor():
    a = torch.eye(4)
    a[2, 2] = -1.0  # leading minors of order 1 and 2 are positive-definite, order 3 is not
    batch = torch.stack([torch.eye(4), a])
    check_against_eager(lambda m: LA.cholesky_ex(m).info, batch, options=LOWERED)
    check_against_eager(lambda m: LA.cholesky_ex(m, upper=True).info, batch, options=LOWERED)


def test_sign_ambiguous_factors_stay_in_eager():
    a = torch.randn(4, 4, generator=_gen(5))
    for fn in (LA.svd, LA.eigh, LA.eig):
        with pytest.raises(UnsupportedOpError):
            compile_aten(fn, (a,), {"fallback": "error"})


def test_effectful_error_checks_compile_whole():
    """torch.linalg.inv/solve/cholesky check `info` through an effectful op (effect tokens)."""
    a, b = _spd(_gen(6), 3, 3), torch.randn(3, 2)

    def fn(a, b):
        return LA.inv(a), LA.solve(a, b), LA.cholesky(a)

    compiled = torch.compile(fn, backend="tpu_inductor", options={"fallback": "error"})
    torch.testing.assert_close(compiled(a, b), fn(a, b), **TOL)


def test_fft():
    g = _gen(7)
    x = torch.randn(3, 8, 6, generator=g)
    z = torch.randn(3, 8, 6, dtype=torch.complex64, generator=g)
    fft = torch.fft
    fns = {
        "fft": lambda x, z: fft.fft(x),
        "fft_ortho_n": lambda x, z: fft.fft(z, n=5, dim=1, norm="ortho"),
        "ifft": lambda x, z: fft.ifft(z),
        "ifft_forward": lambda x, z: fft.ifft(z, norm="forward"),
        "fft2": lambda x, z: fft.fft2(z),
        "ifftn": lambda x, z: fft.ifftn(z, s=(4, 7), norm="ortho"),
        "rfft": lambda x, z: fft.rfft(x),
        "rfftn": lambda x, z: fft.rfftn(x, norm="forward"),
        "irfft": lambda x, z: fft.irfft(z),
        "irfft_odd": lambda x, z: fft.irfft(z, n=9, norm="ortho"),
        "irfftn": lambda x, z: fft.irfftn(z, s=(8, 10)),
        "hfft": lambda x, z: fft.hfft(z),
        "ihfft": lambda x, z: fft.ihfft(x),
        "ihfft2": lambda x, z: fft.ihfft2(x),
    }
    check_many_against_eager(fns, x, z, tolerance=_tol, options=LOWERED)


def test_fft_frequencies():
    fft = torch.fft
    fns = {f"{f.__name__}_{n}": lambda x, f=f, n=n: f(n, 0.3) * x
           for f in (fft.fftfreq, fft.rfftfreq) for n in (1, 6, 7)}  # fmt: skip
    fns["fftfreq_f64"] = lambda x: torch.fft.fftfreq(5, dtype=torch.float64) * x
    check_many_against_eager(fns, torch.ones(()), tolerance=_tol, options=LOWERED)


def test_fft_gradients_and_complex_views():
    """FFT backward (abs of a complex result goes through view_as_real) and the views."""
    g = _gen(10)
    x = torch.randn(3, 8, generator=g)
    z = torch.randn(3, 5, dtype=torch.complex64, generator=g)
    fft = torch.fft

    def views(x):
        return torch.view_as_real(fft.fft(x)), torch.view_as_complex(torch.stack([x, -x], -1))

    check_against_eager(views, x, **TOL, options=LOWERED)

    def grads(x, z):  # through the backend: make_fx leaves the backward's in-place ops
        loss = fft.fft(x).abs().sum() + fft.rfft(x, norm="ortho").abs().sum()
        loss = loss + fft.irfft(z).square().sum() + torch.view_as_real(fft.fft(z)).sum()
        return torch.autograd.grad(loss, (x, z))

    compiled = torch.compile(grads, backend="tpu_inductor", options=LOWERED)
    inputs = x.requires_grad_(), z.requires_grad_()
    torch.testing.assert_close(compiled(*inputs), grads(*inputs), **TOL)


def test_special_functions():
    x = torch.tensor([-8.5, -3.3, -2.0, -0.5, 0.0, 0.3, 1.7, 5.0, 8.9, 30.0])
    q = torch.tensor([0.5, 1.0, 2.5, 3.0, 4.0, 2.0, 1.1, 7.0, 0.2, 12.0])
    sp = torch.special
    fns = {f"polygamma_{n}": (lambda x, q, n=n: torch.polygamma(n, x)) for n in range(5)}
    fns |= {
        "zeta": lambda x, q: sp.zeta(q + 1, x),
        "zeta_scalar": lambda x, q: sp.zeta(3.0, x),
        "igamma": lambda x, q: torch.igamma(q, x.abs()),
        "igammac": lambda x, q: torch.igammac(q, x.abs()),
        "erfcx": lambda x, q: sp.erfcx(x),
        "ndtri": lambda x, q: sp.ndtri(q / 13),
        "i0e": lambda x, q: sp.i0e(x),
        "i1": lambda x, q: sp.i1(x / 4),
        "i1e": lambda x, q: sp.i1e(x),
        "modified_bessel_i0": lambda x, q: sp.modified_bessel_i0(x / 4),
        "modified_bessel_i1": lambda x, q: sp.modified_bessel_i1(x / 4),
        "spherical_bessel_j0": lambda x, q: sp.spherical_bessel_j0(x),
    }
    check_many_against_eager(fns, x, q, tolerance=_tol, options=LOWERED)


def test_zeta_domain_checks_in_cephes_order():
    """Where x and q are both outside the domain, x decides, as in torch's Cephes port
    (x < 1: NaN before q a non-positive integer: inf); the OpInfo bool sample zeta(0, 0)."""
    x, q = torch.meshgrid(
        torch.tensor([0.0, 0.5, 1.0, 2.0, 2.5]), torch.tensor([-2.0, -1.5, 0.0, 1.0]), indexing="ij"
    )
    check_against_eager(torch.special.zeta, x.reshape(-1), q.reshape(-1), options=LOWERED)


def test_bf16_linear_adds_the_bias_before_rounding():
    """torch adds the bias in the float32 accumulator and rounds once; rounding the product to
    bfloat16 first, then adding, moved about 30% of the results by one bfloat16 step."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(*s, generator=gen).mul(3).bfloat16() for s in ((64, 32), (48, 32), (48,))
    )
    once = torch.nn.functional.linear(x.float(), w.float(), b.float()).bfloat16()
    ours = compile_aten(torch.nn.functional.linear, (x, w, b))(x, w, b)
    assert (ours == once).float().mean() > 0.99


def test_integer_addmm_family_reads_beta_and_alpha_as_integers():
    g = _gen(8)
    bias, m, v = (torch.randint(-5, 5, s, generator=g) for s in ((4,), (4, 3), (3,)))
    b1, b2 = (
        torch.randint(-5, 5, (2, 4, 3), generator=g),
        torch.randint(-5, 5, (2, 3, 2), generator=g),
    )
    fns = {
        "addmv": lambda bias, m, v, b1, b2: torch.addmv(bias, m, v, beta=0.2, alpha=0.6),
        "addmv_2": lambda bias, m, v, b1, b2: torch.addmv(bias, m, v, beta=1.5, alpha=2.7),
        "addbmm": lambda bias, m, v, b1, b2: torch.addbmm(m[:, :2], b1, b2, beta=2.9, alpha=0.5),
    }
    check_many_against_eager(fns, bias, m, v, b1, b2, tolerance=_tol, options=LOWERED)
