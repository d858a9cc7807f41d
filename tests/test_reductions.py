"""Reduction rules against eager torch: properties over shapes (0-d, size 1), dims (random
subsets, negative), keepdim and dtypes; every reduction of a drawn case is compiled in one graph.
"""

from __future__ import annotations

import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

from tests.helpers import check_many_against_eager, eager_accepts

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
PROPERTY = settings(max_examples=15, deadline=None, phases=(Phase.explicit, Phase.generate))

# Tolerances: (rtol, atol) per result dtype, then per (op, dtype) where an op needs more.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}
OP_TOLERANCES = {
    ("var", torch.bfloat16): (3e-2, 3e-2),
    ("std", torch.bfloat16): (3e-2, 3e-2),
    ("var_mean", torch.bfloat16): (3e-2, 3e-2),
    ("cumsum", torch.bfloat16): (3e-2, 5e-2),  # eager accumulates in bfloat16, we in float32
    ("cumprod", torch.bfloat16): (3e-2, 5e-2),
}


def _tol(name: str, dtype: torch.dtype) -> dict:
    rtol, atol = OP_TOLERANCES.get((name, dtype), TOLERANCES.get(dtype, (0, 0)))
    return {"rtol": rtol, "atol": atol}


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
        "var_mean": lambda x: torch.var_mean(x, dims, keepdim=keepdim),
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
    "prod_all": torch.prod,
    "any_all": torch.any,
}


def _values(shape, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-4, 5, shape, generator=gen)  # ties for arg reductions


@st.composite
def cases(draw):
    shape = draw(array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4))
    rank = max(len(shape), 1)
    dims = draw(st.lists(st.integers(-rank, rank - 1), min_size=1, max_size=rank, unique=True))
    dims = [d for i, d in enumerate(dims) if d % rank not in {e % rank for e in dims[:i]}]
    return shape, dims, draw(st.booleans()), draw(st.sampled_from(DTYPES)), draw(st.integers())


@PROPERTY
@given(case=cases())
def test_reductions(case):
    shape, dims, keepdim, dtype, seed = case
    x = _values(shape, dtype, seed % 2**16)
    fns = _over_dims(dims, keepdim) | _along_dim(dims[0], keepdim)
    fns = {n: f for n, f in fns.items() if eager_accepts(f, x)}
    check_many_against_eager(fns, x, tolerance=_tol)


@PROPERTY
@given(
    shape=array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_whole_tensor_reductions(shape, dtype, seed):
    x = _values(shape, dtype, seed)
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
