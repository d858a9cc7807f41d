"""Reduction rules against eager torch: properties over shapes (0-d, size 1, empty dims, over a
thousand elements), dims (random subsets, negative), keepdim, dtypes and values (ties, NaN,
±inf, -0.0, integers past 2**53); every reduction of a drawn case is compiled in one graph.
"""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from tests.helpers import check_many_against_eager, eager_accepts
from tests.strategies import PROPERTY, seeds, shapes, values

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)

# Tolerances: (rtol, atol) per result dtype, then per (op, dtype) where an op needs more.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}
OP_TOLERANCES = {
    ("var", torch.bfloat16): (3e-2, 3e-2),
    ("std", torch.bfloat16): (3e-2, 3e-2),
    ("var_mean", torch.bfloat16): (3e-2, 3e-2),
    ("cumsum", torch.bfloat16): (3e-2, 5e-2),  # eager accumulates in bfloat16, we in float32
    ("cumprod", torch.bfloat16): (3e-2, 5e-2),
    # eager rounds each partial product to bfloat16 (3.5% off float64 over 40 values), ours
    # rounds once (0.3%)
    ("prod", torch.bfloat16): (5e-2, 1e-2),
}


def _tol(name: str, dtype: torch.dtype) -> dict:
    rtol, atol = OP_TOLERANCES.get((name, dtype), TOLERANCES.get(dtype, (0, 0)))
    return {"rtol": rtol, "atol": atol}


def _finite(x):
    """x with ±inf as 0: eager's var_mean (a Welford pass) returns a NaN mean for an input with
    an inf, where torch.mean, Inductor and ours return the inf."""
    return torch.where(x.isinf(), torch.zeros((), dtype=x.dtype), x) if x.is_floating_point() else x


def _over_dims(dims, keepdim):
    """Reductions over a list of dims."""
    return {
        "sum": lambda x: torch.sum(x, dims, keepdim=keepdim),
        "mean": lambda x: torch.mean(x, dims, keepdim=keepdim),
        "amax": lambda x: torch.amax(x, dims, keepdim=keepdim),
        "amin": lambda x: torch.amin(x, dims, keepdim=keepdim),
        "var": lambda x: torch.var(x, dims, keepdim=keepdim),
        "var_pop": lambda x: torch.var(x, dims, correction=0, keepdim=keepdim),
        "std": lambda x: torch.std(x, dims, keepdim=keepdim),
        "var_mean": lambda x: torch.var_mean(_finite(x), dims, keepdim=keepdim),
        "logsumexp": lambda x: torch.logsumexp(x, dims, keepdim=keepdim),
        "any": lambda x: torch.any(x, dims, keepdim=keepdim),
        "all": lambda x: torch.all(x, dims, keepdim=keepdim),
        "sum_int_to_float": lambda x: torch.sum(x, dims, keepdim=keepdim, dtype=torch.float32),
    }


def _along_dim(d, keepdim):
    """Reductions and scans along one dim."""
    return {
        "argmax": lambda x: torch.argmax(x, d, keepdim=keepdim),
        "argmin": lambda x: torch.argmin(x, d, keepdim=keepdim),
        "max_dim": lambda x: torch.max(x, d, keepdim=keepdim),
        "min_dim": lambda x: torch.min(x, d, keepdim=keepdim),
        "prod": lambda x: torch.prod(x, d, keepdim=keepdim),
        "softmax": lambda x: torch.softmax(x, d),
        "log_softmax": lambda x: torch.log_softmax(x, d),
        "cumsum": lambda x: torch.cumsum(x, d),
        "cumprod": lambda x: torch.cumprod(x, d),
    }


WHOLE = {
    "sum_all": torch.sum,
    "mean_all": torch.mean,
    "max_all": torch.max,
    "min_all": torch.min,
    "argmax_all": torch.argmax,
    "argmin_all": torch.argmin,
    "argmax_all_keepdim": lambda x: torch.argmax(x, keepdim=True),
    "argmin_all_keepdim": lambda x: torch.argmin(x, keepdim=True),
    "prod_all": torch.prod,
    "any_all": torch.any,
    "all_all": torch.all,
    "var_all": torch.var,  # correction left out: None, which means 1
    "std_all": torch.std,
    "var_mean_all": lambda x: torch.var_mean(_finite(x)),
    "logsumexp_all": lambda x: torch.logsumexp(x, list(range(x.dim()))),
}


@st.composite
def cases(draw):
    shape = draw(st.one_of(shapes(), shapes(min_side=1, max_side=2, max_dims=4)))
    rank = len(shape)
    dims = draw(st.lists(st.integers(-rank, rank - 1), min_size=1, max_size=rank, unique=True))
    dims = [d for i, d in enumerate(dims) if d % rank not in {e % rank for e in dims[:i]}]
    dtype = draw(st.sampled_from(DTYPES))
    return shape, dims, draw(st.booleans()), dtype, draw(seeds()), draw(st.booleans())


@PROPERTY
@given(case=cases())
@example(case=((), [0], False, torch.float32, 0, False))
@example(case=((), [-1], True, torch.int64, 1, True))
@example(case=((3, 0, 2), [1], False, torch.float32, 2, False))  # reduced over an empty dim
@example(case=((0, 4), [1], True, torch.int64, 3, False))  # an empty result
@example(case=((3, 500), [1], False, torch.float32, 4, True))  # past a thousand elements
@example(case=((1200,), [0], False, torch.int64, 5, True))
@example(case=((40, 30), [0, 1], True, torch.bfloat16, 6, False))
def test_reductions(case):
    shape, dims, keepdim, dtype, seed, edges = case
    x = values(shape, dtype, seed, edges=edges)
    fns = _over_dims(dims, keepdim) | _along_dim(dims[0], keepdim)
    fns = {n: f for n, f in fns.items() if eager_accepts(f, x)}
    check_many_against_eager(fns, x, tolerance=_tol)


@PROPERTY
@given(shape=shapes(), dtype=st.sampled_from(DTYPES), seed=seeds(), edges=st.booleans())
@example(shape=(), dtype=torch.int64, seed=0, edges=True)
@example(shape=(0, 3), dtype=torch.float32, seed=1, edges=False)
@example(shape=(2, 700), dtype=torch.float32, seed=2, edges=True)
def test_whole_tensor_reductions(shape, dtype, seed, edges):
    x = values(shape, dtype, seed, edges=edges)
    fns = {n: f for n, f in WHOLE.items() if eager_accepts(f, x)}
    check_many_against_eager(fns, x, tolerance=_tol)


def test_index_reductions_return_the_first_of_tied_values():
    """max.dim, min.dim, argmax and argmin pick the first index among equal values (NaNs
    included), as torch does: a rule that picks the last one is wrong on every tie."""
    nan = float("nan")
    rows = torch.tensor([[3, 1, 1, 3], [2, 2, 2, 2], [0, 5, 0, 5], [-7, 4, 4, -7]])
    inputs = [rows.to(dtype) for dtype in (torch.int64, torch.float32, torch.bfloat16, torch.bool)]
    inputs.append(torch.tensor([[nan, 1.0, nan], [2.0, nan, nan], [1.0, 1.0, 0.0]]))
    fns = {}
    for d, keepdim in ((1, False), (0, True), (-1, True)):
        for name, fn in _along_dim(d, keepdim).items():
            for i, x in enumerate(inputs):
                if name in ("argmax", "argmin", "max_dim", "min_dim") and eager_accepts(fn, x):
                    fns[f"{name}_{d}_{i}"] = lambda *xs, fn=fn, i=i: fn(xs[i])
    check_many_against_eager(fns, *inputs, tolerance=lambda name, dtype: _tol("", dtype))


def test_nan_propagates():
    x = torch.tensor([[1.0, float("nan"), 3.0], [4.0, 5.0, -1.0]])
    fns = _over_dims([1], False) | _along_dim(1, False) | WHOLE
    fns.pop("any"), fns.pop("all"), fns.pop("any_all")
    check_many_against_eager(fns, x, tolerance=_tol)


def test_softmax_backward():
    x = torch.randn(3, 5, dtype=torch.float32)
    grad = torch.randn(3, 5)
    check_many_against_eager(
        {
            "softmax": lambda x, g: torch.ops.aten._softmax_backward_data(
                torch.softmax(x, 1), g, 1, torch.float32
            ),
            "log_softmax": lambda x, g: torch.ops.aten._log_softmax_backward_data(
                torch.log_softmax(x, 1), g, 1, torch.float32
            ),
        },
        x,
        grad,
        tolerance=_tol,
    )
