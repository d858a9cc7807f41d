"""Rules added for issue 20's OpInfo gap, where the OpInfo run cannot check values: fractional
max pooling draws its window offsets (the entries compare shapes only), so here the offsets
are given and values, indices and the input gradient are compared with eager's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_same

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

STRICT = {"backend": "tpu_inductor", "options": {"fallback": "error"}, "fullgraph": True}


@pytest.mark.parametrize(
    ("nd", "shape", "kernel", "output"),
    [
        (2, (2, 3, 9, 9), 3, (4, 5)),
        (2, (3, 7, 8), (2, 3), 3),
        (3, (2, 2, 6, 7, 8), 2, (3, 4, 5)),
        (3, (2, 5, 5, 5), (3, 2, 2), 2),
    ],
    ids=["2d", "2d-unbatched", "3d", "3d-unbatched"],
)
def test_fractional_max_pool_matches_eager(nd, shape, kernel, output):
    """Values, indices and the input gradient, with the samples given (a NaN included: it
    wins its window, as in torch's scan)."""
    pool = F.fractional_max_pool2d if nd == 2 else F.fractional_max_pool3d
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen)
    x.view(-1)[5] = float("nan")
    planes = (shape[0], shape[1]) if len(shape) == nd + 2 else (1, shape[0])
    samples = torch.rand(*planes, nd, generator=gen)

    def fn(x, samples):
        return pool(x, kernel, output_size=output, return_indices=True, _random_samples=samples)

    compiled = torch.compile(fn, **STRICT)
    results = []
    for f in (fn, compiled):
        xs = x.clone().requires_grad_()
        out, index = f(xs, samples)
        out.nan_to_num().sum().backward()
        results.append((out, index, xs.grad))
    assert_same(results[1], results[0])
