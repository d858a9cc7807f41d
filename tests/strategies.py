"""Inputs for the property tests that reach the edges: shapes with empty dims and over a
thousand elements, values with ties, NaN, ±inf, -0.0, zero divisors, integers past 2**24 and
2**53, and float64 values float32 cannot hold.

Hypothesis draws each test's cases from its own seed (the profile is derandomized: a CI run is
reproducible; tests/conftest.py) and `PROPERTY` gives every test the profile's number of them
besides its explicit examples; each drawn case costs a compile, so shrinking is off.
"""

from __future__ import annotations

import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

PROPERTY = settings(deadline=None, phases=(Phase.explicit, Phase.generate))

# Planted among random values when a case asks for edge values.
FLOAT_EDGES = (float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e30, -1e-30)
FLOAT64_EDGES = (0.1, 1 / 3, 1e300, -1e-300, 2.0**53 + 2)
INT_EDGES = (0, -1, 2**24 + 1, -(2**31) - 7, 2**40 + 1, 2**53 + 1, -(2**62), 2**63 - 1)


def shapes(*, min_side: int = 0, max_side: int = 4, max_dims: int = 3):
    """Shapes of 1 to `max_dims` dims (0-d cases are explicit examples: drawn, they crowd out
    the rest), sides from `min_side` (0: empty dims)."""
    return array_shapes(min_dims=1, max_dims=max_dims, min_side=min_side, max_side=max_side)


def values(shape, dtype, seed: int, *, edges: bool = False, nonzero: bool = False):
    """Random values of `dtype` (integers small, so with ties), edge values planted in about a
    quarter of the elements when `edges`; `nonzero`: no integer zeros (torch raises on an
    integer division by zero; float zero divisors stay)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        x = torch.rand(shape, generator=gen) > 0.5
        return x | True if nonzero else x
    if dtype.is_floating_point or dtype.is_complex:
        x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
        pool = FLOAT_EDGES + (FLOAT64_EDGES if dtype == torch.float64 else ())
    else:
        x = torch.randint(-5, 6, shape, generator=gen).to(dtype)
        info = torch.iinfo(dtype)
        pool = tuple(v for v in INT_EDGES if info.min <= v <= info.max)
    if edges and x.numel():
        where = torch.rand(shape, generator=gen) < 0.25
        picks = torch.randint(0, len(pool), shape, generator=gen)
        x = torch.where(where, torch.tensor(pool, dtype=dtype)[picks], x)
    if nonzero and not x.is_floating_point():
        x = torch.where(x == 0, torch.ones((), dtype=dtype), x)
    return x


def seeds():
    return st.integers(0, 2**16)
