"""What the nn lowering tests (tests/lowering/test_nn_ops_*.py) share: tolerances, random
inputs, and the one-op case runner (fallback="error", so a missing rule fails)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import check_against_eager

aten = torch.ops.aten
STRICT = {"fallback": "error"}
F32 = {"rtol": 1e-5, "atol": 1e-5}
BF16 = {"rtol": 2e-2, "atol": 2e-2}


def rand(*shape, dtype=torch.float32, seed=0):
    """A seeded standard-normal tensor of `shape`, in `dtype`."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def tokens(*shape, high=10, seed=0):
    """Seeded random class indices in [0, high) of `shape`."""
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def case(name, fn, *args, tol=F32):
    """A pytest param (fn, args, tol) named `name`, for `run`."""
    return pytest.param(fn, args, tol, id=name)


def run(fn, args, tol):
    """Check `fn(*args)` compiled with fallback="error" against eager torch."""
    check_against_eager(fn, *args, options=STRICT, **tol)
