"""Sizes used as numbers in bucketed graphs (passes/bucket_values.py): a cache position
`arange(1) + n`, a causal mask over `arange(n + 1)`, positions from a mask's cumsum, `x * n`,
`full([2], n)` compute with the true size (a runtime input), one compile per bucket, every
result eager's with NaN and the largest integer in the padding; a use that needs the size at
compile time is refused with the op that reads it. And a mask read at the keys' positions
shares the keys' bucket (one compile where the mask's own bucket would make two)."""

from __future__ import annotations

import logging

import pytest
import torch
from tpu_inductor.passes import pipeline

from tests.helpers import assert_same
from tpu_inductor.runtime import buckets as bucketing
from tpu_inductor.runtime import devices

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

POW2 = {"policy": "pow2", "pad_with": "nan"}


def _compile(fn, **kwargs):
    options = {"shapes": POW2, "fallback": "error"}
    return torch.compile(fn, backend="tpu_inductor", options=options, **kwargs)


def _positions(x, mask):
    """What a decoder computes from its lengths: x [b, n, 4], mask [b, n] (0 where left-padded)."""
    n = x.shape[1]
    q = torch.arange(1) + n  # the next token's position: the cache's length
    kv = torch.arange(n + 1)  # the keys' positions, the new token's included
    causal = kv[None, :] <= q[:, None]
    pos = mask.cumsum(-1) - 1 + n  # positions from a mask's cumsum, offset by a length
    scaled = (x * n).sum(1) / (n + 1)  # a length as a factor; a sum over the padded dim
    return x * n, pos, causal, q, torch.full((2,), n - 1), scaled


@pytest.mark.parametrize("lengths", [(3, 5, 6, 11, 7)])
def test_sizes_used_as_numbers_are_the_true_sizes_one_compile_per_bucket(lengths):
    bucketing.clear_report()
    compiled = _compile(_positions)
    before, rewritten = (
        devices.stats["pjrt_compiles"],
        pipeline.counters["bucket_shapes.true_values"],
    )
    for n in lengths:
        x, mask = torch.randn(2, n, 4), torch.ones(2, n, dtype=torch.long)
        mask[1, : n // 2] = 0
        torch._dynamo.maybe_mark_dynamic(x, 1)
        torch._dynamo.maybe_mark_dynamic(mask, 1)
        for got, want in zip(compiled(x, mask), _positions(x, mask)):
            assert_same(got, want, atol=1e-5, rtol=1e-5)
    served = bucketing.report()[-1]["buckets"]
    # x's length and the mask's, one bucket each: 3 has 4, 5 to 7 share 8, 11 has 16
    assert set(served) == {"(4, 4)", "(8, 8)", "(16, 16)"}, served
    assert devices.stats["pjrt_compiles"] - before == 3
    assert pipeline.counters["bucket_shapes.true_values"] > rewritten


def test_a_size_the_op_needs_at_compile_time_is_refused_with_the_op(caplog):
    def f(x, table):
        return table[x.shape[0] - 1] * x.sum(0)  # a row chosen by the length: select's index

    compiled = _compile(f)
    table = torch.randn(16, 4)
    with caplog.at_level(logging.INFO, logger="tpu_inductor.passes.bucket_shapes"):
        for n in (3, 5):
            x = torch.randn(n, 4)
            torch._dynamo.maybe_mark_dynamic(x, 0)
            assert_same(compiled(x, table), f(x, table))
    assert "not bucketing" in caplog.text and "aten.select.int" in caplog.text


def _read_at_keys(keys, mask):
    """A decode step's mask read: the mask [b, m] at the keys' positions 0..s (m == s + 1)."""
    kv = torch.arange(keys.shape[1] + 1)
    step = torch.ones(keys.shape[0], 1, keys.shape[2])
    k = torch.cat([keys, step], 1)  # the cache and the new token: [b, s + 1, d]
    rows = torch.arange(keys.shape[0])[:, None]
    seen = mask[rows, kv[None, :]].to(k.dtype)  # as HF's padding mask is read
    return (k.sum(-1) * seen).sum(-1)


def test_a_mask_read_at_the_keys_positions_shares_their_bucket():
    """Cache 8 and 12, masks 9 and 13: one bucket (mask 16, cache 15), not (16, 8) and (16, 16)."""
    compiled = _compile(_read_at_keys)
    compiled(torch.randn(2, 3, 4), torch.ones(2, 4, dtype=torch.long))  # Dynamo's static trace
    before = devices.stats["pjrt_compiles"]
    for s in (8, 12):
        keys, mask = torch.randn(2, s, 4), torch.randint(0, 2, (2, s + 1))
        torch._dynamo.maybe_mark_dynamic(keys, 1)
        torch._dynamo.maybe_mark_dynamic(mask, 1)
        assert_same(compiled(keys, mask), _read_at_keys(keys, mask), atol=1e-5, rtol=1e-5)
    assert devices.stats["pjrt_compiles"] - before == 1
