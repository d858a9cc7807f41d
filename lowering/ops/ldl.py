"""Symmetric indefinite LDL^T (Bunch-Kaufman): linalg_ldl_factor_ex and linalg_ldl_solve, as
LAPACK's sytf2 / sytrs compute them (real matrices only).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from .factorizations import _broadcast_batch

aten = ops.aten


# ---- symmetric indefinite LDL^T (Bunch-Kaufman) ----
# LAPACK's sytf2 with uplo="L", the unblocked sytrf every sample size here takes: the same pivot
# tests (alpha = (1 + sqrt(17)) / 8), the same 1x1 or 2x2 steps, interchanges applied to the
# trailing submatrix only, 1-based pivots negative for a 2x2 block. The trailing submatrix is
# kept whole and exactly symmetric (each update is computed on the lower triangle and mirrored),
# so a step reads rows and columns alike. Real matrices only: complex ones decline.

_BK_ALPHA = (1 + math.sqrt(17)) / 8


def _sym_lower(m):
    """The symmetric matrix whose lower triangle is m's."""
    return jnp.tril(m) + jnp.swapaxes(jnp.tril(m, -1), -1, -2)


def _sytf2_step(k, state):
    """Column k of sytf2 (nothing where the previous step was a 2x2 pivot)."""
    kept, piv, info, skip = state
    n = kept.shape[-1]
    idx = jnp.arange(n)
    col = jnp.abs(kept[:, k])
    absakk = col[k]
    below = jnp.where(idx > k, col, -1)
    imax = jnp.argmax(below)
    colmax = jnp.where(k < n - 1, below[imax], 0)
    zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
    rowmax = jnp.max(jnp.where((idx >= k) & (idx != imax), jnp.abs(kept[imax]), -1))
    keep_k = (absakk >= _BK_ALPHA * colmax) | (absakk >= _BK_ALPHA * colmax * (colmax / rowmax))
    one_by_one = keep_k | (jnp.abs(kept[imax, imax]) >= _BK_ALPHA * rowmax)
    kp = jnp.where(zero | keep_k, k, imax)
    two = ~zero & ~one_by_one
    kk = jnp.where(two, k + 1, k)
    perm = idx.at[kk].set(kp).at[kp].set(kk)
    trailing = (idx[:, None] >= k) & (idx[None, :] >= k)
    a = jnp.where(trailing, kept[perm][:, perm], kept)  # rows and columns kk, kp interchanged
    # a 1x1 pivot: A22 -= x x^T / d, then the column scaled to L's
    d11 = 1 / a[k, k]
    x = jnp.where(idx > k, a[:, k], 0)
    one = a + _sym_lower(x[:, None] * (-d11 * x)[None, :])
    one = _set_column(one, k, x * d11, idx > k)
    # a 2x2 pivot on rows k, k+1
    d21 = a[k + 1, k]
    e11, e22 = a[k + 1, k + 1] / d21, a[k, k] / d21
    d21 = (1 / (e11 * e22 - 1)) / d21
    c0 = jnp.where(idx >= k + 2, a[:, k], 0)
    c1 = jnp.where(idx >= k + 2, a[:, k + 1], 0)
    wk, wkp1 = d21 * (e11 * c0 - c1), d21 * (e22 * c1 - c0)
    pair = a - _sym_lower(c0[:, None] * wk[None, :] + c1[:, None] * wkp1[None, :])
    pair = _set_column(_set_column(pair, k, wk, idx >= k + 2), k + 1, wkp1, idx >= k + 2)
    done = jnp.where(zero, a, jnp.where(two, pair, one))
    pivot = jnp.where(two, -(kp + 1), kp + 1).astype(jnp.int32)
    new_piv = piv.at[k].set(pivot)
    new_piv = jnp.where(two, new_piv.at[k + 1].set(pivot), new_piv)
    new_info = jnp.where(zero & (info == 0), k + 1, info).astype(jnp.int32)
    return (
        jnp.where(skip, kept, done),
        jnp.where(skip, piv, new_piv),
        jnp.where(skip, info, new_info),
        ~skip & two,
    )


def _set_column(a, k, values, rows):
    """a with column k (and, mirrored, row k) set to `values` where `rows`."""
    column = jnp.where(rows, values, a[:, k])
    return a.at[:, k].set(column).at[k, :].set(column)


def _sytrf_lower(a):
    n = a.shape[-1]
    if n == 0:
        return a, jnp.zeros(0, jnp.int32), jnp.zeros((), jnp.int32)
    state = (_sym_lower(a), jnp.zeros(n, jnp.int32), jnp.zeros((), jnp.int32), jnp.array(False))
    a, piv, info, _ = lax.fori_loop(0, n, _sytf2_step, state)
    return jnp.tril(a), piv, info


def _real_input(node):
    return not node.args[0].meta["val"].is_complex()


def _batched(fn, *args):
    """fn (on one matrix's arguments) mapped over the leading batch dims of args[0]."""
    for _ in range(args[0].ndim - 2):
        fn = jax.vmap(fn)
    return fn(*args)


@register_lowering(aten.linalg_ldl_factor_ex.default, supports=_real_input)
def linalg_ldl_factor_ex(a, *, hermitian=False, check_errors=False):
    return _batched(_sytrf_lower, a)


def _sytrs_lower(ld, piv, b):
    """Solve A X = B with sytrf's factor: L D Y = P B forward, then L^T X = Y backward."""
    n = ld.shape[-1]
    idx = jnp.arange(n)

    def swap(b, i, j):
        perm = idx.at[i].set(j).at[j].set(i)
        return b[perm]

    def forward(k, state):
        b, skip = state
        p = piv[k]
        two = p < 0
        # 1x1: swap k, p-1; eliminate below k; divide by D(k, k)
        one = swap(b, k, p - 1)
        one = one - jnp.where(idx[:, None] > k, ld[:, k, None], 0) * one[k]
        one = one.at[k].set(one[k] / ld[k, k])
        # 2x2: swap k+1, -p-1; eliminate below k+1 with both columns; solve the 2x2 block
        pair = swap(b, k + 1, -p - 1)
        below = idx[:, None] >= k + 2
        pair = pair - jnp.where(below, ld[:, k, None], 0) * pair[k]
        pair = pair - jnp.where(below, ld[:, k + 1, None], 0) * pair[k + 1]
        akm1k = ld[k + 1, k]
        akm1, ak = ld[k, k] / akm1k, ld[k + 1, k + 1] / akm1k
        denom = akm1 * ak - 1
        bkm1, bk = pair[k] / akm1k, pair[k + 1] / akm1k
        pair = pair.at[k].set((ak * bkm1 - bk) / denom).at[k + 1].set((akm1 * bk - bkm1) / denom)
        done = jnp.where(two, pair, one)
        return jnp.where(skip, b, done), ~skip & two

    def backward(step, state):
        b, skip = state
        k = n - 1 - step
        p = piv[k]
        two = p < 0
        lower = jnp.where(idx[:, None] > k, ld, 0)
        b_k = b[k] - lower[:, k] @ b
        one = swap(b.at[k].set(b_k), k, p - 1)
        pair = b.at[k].set(b_k).at[k - 1].set(b[k - 1] - lower[:, k - 1] @ b)
        pair = swap(pair, k, -p - 1)
        done = jnp.where(two, pair, one)
        return jnp.where(skip, b, done), ~skip & two

    b, _ = lax.fori_loop(0, n, forward, (b, jnp.array(False)))
    b, _ = lax.fori_loop(0, n, backward, (b, jnp.array(False)))
    return b


@register_lowering(aten.linalg_ldl_solve.default, supports=_real_input)
def linalg_ldl_solve(ld, pivots, b, *, hermitian=False):
    ld, b = _broadcast_batch(ld, b)
    pivots = jnp.broadcast_to(pivots, ld.shape[:-1]).astype(jnp.int32)
    return _batched(_sytrs_lower, ld, pivots, b)
