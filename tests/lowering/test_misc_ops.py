"""Rules added for OpInfo coverage by the lead: copy, unfold, diagonal_scatter, narrow_copy."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import check_against_eager

X = torch.randn(4, 5, 6)


@pytest.mark.parametrize(
    "fn, args",
    [
        (lambda x: x.unfold(1, 2, 2) * 1, (X,)),
        (lambda x: x.unfold(2, 3, 1) * 1, (X,)),
        (lambda x, s: torch.diagonal_scatter(x, s, 1, 0, 2), (X, torch.randn(5, 4))),
        (lambda x, s: torch.diagonal_scatter(x, s, -1, 1, 2), (X, torch.randn(4, 4))),
        (lambda x: torch.narrow_copy(x, 2, 1, 3) + 0, (X,)),
        (lambda x, y: torch.ops.aten.copy(x, y), (X, torch.randn(6).double())),
    ],
)
def test_against_eager(fn, args):
    check_against_eager(fn, *args)


@pytest.mark.parametrize("row, col, offset", [(4, 3, 0), (3, 5, -1), (4, 4, 2), (0, 3, 0)])
def test_tril_and_triu_indices(row, col, offset):
    def fn(x):  # x only gives the graph an input
        return torch.tril_indices(row, col, offset), torch.triu_indices(row, col, offset) + x

    check_against_eager(fn, torch.ones((), dtype=torch.int64), options={"fallback": "error"})
