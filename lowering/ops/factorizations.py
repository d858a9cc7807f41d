"""Matrix factorizations and what is built on them: LU, Cholesky and QR, solves (general and
triangular), inverses, determinants, pseudo-inverse, matrix exponential, singular values
and symmetric eigenvalues.

Factorizations follow LAPACK's conventions (1-based int32 pivots, `info` outputs as getrf and
potrf report them). Factors that are unique only up to signs (SVD, eigenvectors) are left to
eager torch, since a different valid factorization would not match it; see the section at the
end. `_linalg_check_errors` is a no-op: a lowered graph cannot raise on a singular or
non-positive-definite input, so torch.linalg.inv/cholesky/solve of one give inf/NaN instead of
an error. The symmetric indefinite LDL^T factorization is ldl.py's.
"""

from __future__ import annotations

import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from .common import outputs_unread
from .linalg import matmul

aten = ops.aten


# ---- LU: factor, solve, det, inverse ----


def _lu(a):
    """(LU, 0-based int32 pivots, permutation) of a batch of matrices, as getrf computes them."""
    return lax.linalg.lu(a)


def _first_true(mask):
    """The 1-based index of the first True along the last axis, 0 where there is none."""
    if mask.shape[-1] == 0:
        return jnp.zeros(mask.shape[:-1], jnp.int32)
    first = jnp.argmax(mask, axis=-1).astype(jnp.int32) + 1
    return jnp.where(jnp.any(mask, axis=-1), first, 0).astype(jnp.int32)


def _lu_info(lu):
    """getrf's info: the 1-based index of the first exactly-zero pivot of U, else 0."""
    return _first_true(jnp.diagonal(lu, axis1=-2, axis2=-1) == 0)


def _mh(x):
    """The conjugate transpose of a batch of matrices."""
    return jnp.conj(jnp.swapaxes(x, -1, -2))


def _empty(ctx, index):
    """Zeros in the shape of output `index`: one torch leaves empty, or one no node reads."""
    val = ctx.out[index]
    return jnp.zeros(tuple(int(d) for d in val.shape), ctx.jax_dtype(val.dtype))


@register_lowering(aten.linalg_lu_factor_ex.default, supports=lambda n: n.kwargs.get("pivot", True))
def linalg_lu_factor_ex(a, *, pivot=True, check_errors=False):
    lu, piv, _ = _lu(a)
    return lu, piv + 1, _lu_info(lu)


@register_lowering(aten.linalg_lu.default, supports=lambda n: n.kwargs.get("pivot", True))
def linalg_lu(a, *, pivot=True):
    lu, _, perm = _lu(a)
    return _unpack(lu, perm)


def _unpack(lu, perm):
    m, n = lu.shape[-2:]
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    upper = jnp.triu(lu[..., :k, :])
    # A[perm] = L U, so A = P L U with P[perm[i], i] = 1.
    p = jnp.swapaxes(jnp.eye(m, dtype=lu.dtype)[perm], -1, -2)
    return p, lower, upper


@register_lowering(aten.lu_unpack.default, needs_ctx=True)
def lu_unpack(ctx, lu, pivots, unpack_data=True, unpack_pivots=True):
    m = lu.shape[-2]
    perm = lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)
    p, lower, upper = _unpack(lu, perm)
    return (
        p if unpack_pivots else _empty(ctx, 0),
        lower if unpack_data else _empty(ctx, 1),
        upper if unpack_data else _empty(ctx, 2),
    )


def _lu_solve(lu, piv, b, *, left=True, adjoint=False):
    """Solve with a getrf factorization: op(A) X = B (left) or X op(A) = B, op = id or ^H."""
    conj = jnp.iscomplexobj(lu)
    if left:
        return jsl.lu_solve((lu, piv), b, trans=(2 if conj else 1) if adjoint else 0)
    if adjoint:  # X A^H = B  <=>  A X^H = B^H
        return _mh(jsl.lu_solve((lu, piv), _mh(b), trans=0))
    # X A = B  <=>  A^T X^T = B^T
    return jnp.swapaxes(jsl.lu_solve((lu, piv), jnp.swapaxes(b, -1, -2), trans=1), -1, -2)


def _broadcast_batch(a, b):
    """`a` and `b` (matrices) broadcast to a common batch shape."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


@register_lowering(aten.linalg_lu_solve.default)
def linalg_lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    lu, b = _broadcast_batch(lu, b)
    pivots = jnp.broadcast_to(pivots, lu.shape[:-1]).astype(jnp.int32) - 1
    return _lu_solve(lu, pivots, b, left=left, adjoint=adjoint)


@register_lowering(aten._linalg_solve_ex.default, needs_ctx=True)
def linalg_solve_ex(ctx, a, b, *, left=True, check_errors=False):
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])
    rhs = b[..., None] if vector else b
    lu, piv, _ = _lu(a)  # LU, pivots and info keep A's batch shape; the solution broadcasts
    x = linalg_lu_solve(lu, piv + 1, rhs, left=left)
    x = x[..., 0] if vector else x
    shape = tuple(int(d) for d in ctx.out[0].shape)
    return x.reshape(shape), lu, piv + 1, _lu_info(lu)


@register_lowering(aten.linalg_inv_ex.default)
def linalg_inv_ex(a, *, check_errors=False):
    lu, piv, _ = _lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return _lu_solve(lu, piv, eye), _lu_info(lu)


def _lu_sign_and_diag(lu, piv):
    """(the permutation's sign, U's diagonal) of a getrf factorization."""
    swaps = jnp.sum(piv != jnp.arange(piv.shape[-1], dtype=piv.dtype), axis=-1)
    parity = jnp.where(swaps % 2 == 0, 1, -1).astype(lu.dtype)
    return parity, jnp.diagonal(lu, axis1=-2, axis2=-1)


def _det_lu(ctx, a):
    """getrf of the matrix torch's det and slogdet factor: A^T for a contiguous real A (it saves
    a copy; det(A^T) = det(A)), else A. Their backward solves with this factor, so it must match.
    """
    val = ctx.node.args[0].meta["val"]
    return _lu(jnp.swapaxes(a, -1, -2) if val.is_contiguous() and not val.is_complex() else a)


@register_lowering(aten._linalg_det.default, needs_ctx=True)
def linalg_det(ctx, a):
    lu, piv, _ = _det_lu(ctx, a)
    parity, diag = _lu_sign_and_diag(lu, piv)
    return parity * jnp.prod(diag, axis=-1), lu, piv + 1


@register_lowering(aten._linalg_slogdet.default, needs_ctx=True)
def linalg_slogdet(ctx, a):
    lu, piv, _ = _det_lu(ctx, a)
    parity, diag = _lu_sign_and_diag(lu, piv)
    size = jnp.abs(diag)
    sign = parity * jnp.prod(jnp.where(size == 0, 0, diag / jnp.where(size == 0, 1, size)), -1)
    return sign, jnp.sum(jnp.log(size), axis=-1), lu, piv + 1


@register_lowering(aten._linalg_check_errors.default)
def linalg_check_errors(info, api_name, *, is_matrix):
    return None


# ---- Cholesky and triangular solves ----


def _cholesky_lower(a, upper):
    """The lower Cholesky factor, reading the triangle torch reads (upper: A's upper one)."""
    return lax.linalg.cholesky(_mh(a) if upper else a, symmetrize_input=False)


def _potrf_info(a, factor):
    """potrf's info: the order of the first leading minor that is not positive-definite, else 0.

    jax's factor is all NaN on failure, so the order is found from the leading minors'
    determinants (computed only when the factorization failed).
    """
    ok = jnp.all(jnp.isfinite(factor), axis=(-2, -1))
    n = a.shape[-1]

    def failed_order(a):
        a = jnp.tril(a) + _mh(jnp.tril(a, -1))  # the Hermitian matrix potrf reads
        k = jnp.arange(n)
        keep = (k[:, None, None] >= k[None, :, None]) & (k[:, None, None] >= k[None, None, :])
        eye = jnp.eye(n, dtype=a.dtype)
        minors = jnp.where(keep, a[..., None, :, :], eye)  # minor k: A[:k+1, :k+1], else identity
        sign, logdet = jnp.linalg.slogdet(minors)
        return _first_true(~((jnp.real(sign) > 0) & jnp.isfinite(logdet)))

    return lax.cond(
        jnp.all(ok),
        lambda a: jnp.zeros(ok.shape, jnp.int32),
        lambda a: jnp.where(ok, 0, failed_order(a)),
        a,
    )


@register_lowering(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(a, *, upper=False, check_errors=False):
    lower = _cholesky_lower(a, upper)
    info = _potrf_info(_mh(a) if upper else a, lower)
    return (_mh(lower) if upper else lower), info


def cholesky(a, upper=False):
    lower = _cholesky_lower(a, upper)
    return _mh(lower) if upper else lower


if hasattr(aten, "cholesky"):  # torch 2.14 removed the deprecated aten::cholesky
    register_lowering(aten.cholesky.default)(cholesky)


def _triangular_solve(a, b, *, lower, left=True, unit=False, transpose=False):
    a, b = _broadcast_batch(a, b)
    return lax.linalg.triangular_solve(
        a, b, left_side=left, lower=lower, transpose_a=transpose, unit_diagonal=unit
    )


def _cholesky_factor_solve(factor, b, upper):
    """Solve A X = B where A = L L^H (upper=False) or U^H U, from the factor alone."""
    lower = _mh(factor) if upper else factor
    y = _triangular_solve(lower, b, lower=True)
    return _triangular_solve(_mh(lower), y, lower=False)


@register_lowering(aten.cholesky_solve.default)
def cholesky_solve(b, factor, upper=False):
    return _cholesky_factor_solve(factor, b, upper)


@register_lowering(aten.cholesky_inverse.default)
def cholesky_inverse(factor, upper=False):
    factor = jnp.triu(factor) if upper else jnp.tril(factor)
    eye = jnp.broadcast_to(jnp.eye(factor.shape[-1], dtype=factor.dtype), factor.shape)
    return _cholesky_factor_solve(factor, eye, upper)


@register_lowering(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    return _triangular_solve(a, b, lower=not upper, left=left, unit=unitriangular)


@register_lowering(aten.triangular_solve.default)
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    x = _triangular_solve(a, b, lower=not upper, unit=unitriangular, transpose=transpose)
    return x, jnp.broadcast_to(a, x.shape[:-2] + a.shape[-2:])


# ---- matrix functions ----


@register_lowering(aten.linalg_householder_product.default)
def linalg_householder_product(a, tau):
    return lax.linalg.householder_product(a, tau)


@register_lowering(aten.linalg_pinv.atol_rtol_tensor, needs_ctx=True)
def linalg_pinv(ctx, a, *, atol=None, rtol=None, hermitian=False):
    # torch's get_atol_rtol: rtol defaults to eps * max(m, n), or 0 where atol > 0 is given.
    real = jnp.real(a).dtype
    default_rtol = jnp.finfo(real).eps * max(a.shape[-2:])
    atol_ = jnp.zeros((), real) if atol is None else atol.astype(real)
    if rtol is not None:
        rtol_ = rtol.astype(real)
    elif atol is not None:
        rtol_ = jnp.where(atol_ > 0, 0, default_rtol).astype(real)
    else:
        rtol_ = jnp.asarray(default_rtol, real)
    if hermitian:
        s, u = jnp.linalg.eigh(a, symmetrize_input=False)
        size = jnp.abs(s)
        largest = jnp.max(size, axis=-1, keepdims=True, initial=0)
        tol = jnp.maximum(atol_[..., None], rtol_[..., None] * largest)
        inv = jnp.where(size > tol, 1 / s, 0).astype(a.dtype)
        return matmul(u * inv[..., None, :], _mh(u))
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    tol = jnp.maximum(atol_[..., None], rtol_[..., None] * s[..., :1])
    inv = jnp.where(s > tol, 1 / s, 0).astype(a.dtype)
    return matmul(_mh(vh) * inv[..., None, :], _mh(u))


@register_lowering(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(a):
    """exp(A) by Pade approximation with scaling and squaring (torch uses a Taylor form: the
    two agree to rounding on matrices whose exponential is representable)."""
    return jsl.expm(a)


# ---- decompositions unique only up to signs ----
# SVD and eigenvectors: MKL (torch) and jax's LAPACK pick different signs on about 1 in 5
# random matrices, so only nodes whose vectors go unused (svdvals, eigvalsh, matrix norms and
# ranks) are lowered; the others fall back to eager (the partitioner asks `supports`).
# linalg_eig (eigenvalue order and phases are implementation choices) is left to eager.
# Householder QR is deterministic (dlarfg fixes the signs) and agrees with torch on CPU, where
# jax calls LAPACK; other platforms use other QR algorithms, so it is registered for CPU only.


@register_lowering(aten._linalg_svd.default, needs_ctx=True, supports=outputs_unread((0, 2)))
def linalg_svdvals(ctx, a, full_matrices=False, compute_uv=True, *, driver=None):
    return _empty(ctx, 0), jnp.linalg.svd(a, compute_uv=False), _empty(ctx, 2)


@register_lowering(aten._linalg_eigh.default, needs_ctx=True, supports=outputs_unread((1,)))
def linalg_eigvalsh(ctx, a, UPLO="L", compute_v=True):  # noqa: N803 (torch's argument name)
    _, values = lax.linalg.eigh(a, lower=UPLO == "L", symmetrize_input=False)
    return values, _empty(ctx, 1)


@register_lowering(aten.linalg_qr.default, platform="cpu", needs_ctx=True)
def linalg_qr(ctx, a, mode="reduced"):
    if mode == "r":
        return _empty(ctx, 0), jnp.linalg.qr(a, mode="r")
    return jnp.linalg.qr(a, mode=mode)


@register_lowering(aten.geqrf.default)
def geqrf(a):
    """LAPACK's geqrf: R on and above the diagonal, the Householder vectors below it, and their
    scalar factors. jax exports no geqrf (jnp.linalg.qr's "raw" mode returns its transpose)."""
    from jax._src.lax.linalg import geqrf as jax_geqrf

    return jax_geqrf(a)


@register_lowering(aten.ormqr.default)
def ormqr(a, tau, other, left=True, transpose=False):
    """`other` multiplied by Q (Q^H when transposing) of geqrf's reflectors `a` and `tau`."""
    return lax.linalg.ormqr(a, tau, other, left=left, transpose=transpose)
