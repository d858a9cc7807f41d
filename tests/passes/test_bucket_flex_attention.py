"""FlexAttention under shape bucketing (passes/bucket_rules_flex.py): sequence lengths padded to
their bucket, the padded keys masked in mask_mod, padded query rows kept out of every result
and gradient, with the padding filled with NaN (`pad_with="nan"`) so a padded value that
reached a real position would show. Forward and gradients equal eager's (float32, 1e-5
relative) at three lengths of one bucket, compiled once (one forward, one backward);
bfloat16 no further from a float64 run than eager bfloat16; fuse_attention (on, as on a TPU)
leaves the op alone.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
from tpu_inductor.passes import pipeline

import tpu_inductor
from tpu_inductor import enable_flex_attention_training

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

HEADS, DIM, LENGTHS = 4, 16, (150, 200, 256)  # one pow2 bucket (256), two 128-blocks each


def _causal(b, h, q, kv):
    return q >= kv


def _sliding(b, h, q, kv):
    return (q >= kv) & (q - kv <= 40)


def _documents(length: int):
    """Per batch row, ids of packed documents (TorchTitan's cumsum of position restarts)."""
    cuts = [(length // 3, length // 2), (length // 4, 3 * length // 4)]
    rows = [
        torch.cat([torch.arange(a), torch.arange(b - a), torch.arange(length - b)]) for a, b in cuts
    ]
    return torch.cumsum((torch.stack(rows) == 0).int(), dim=1) - 1


def _alibi(score, b, h, q, kv):
    return score - torch.exp2(-(h + 1.0)) * (q - kv).abs()


def _softcap(score, b, h, q, kv):
    return 20 * torch.tanh(score / 20)


def _document_mask(length):
    ids = _documents(length)
    return and_masks(_causal, lambda b, h, q, kv: ids[b, q] == ids[b, kv])


CASES = {  # mask_mod of a length (None: every key), score_mod, kv heads
    "no mask, soft-capping": (None, _softcap, HEADS),
    "causal": (lambda n: _causal, None, HEADS),
    "sliding window, gqa": (lambda n: _sliding, None, 2),
    "documents, causal": (_document_mask, None, HEADS),
    "alibi, causal": (lambda n: _causal, _alibi, HEADS),
}


def _attend(score_mod, gqa):
    def attend(q, k, v, block_mask):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)

    return attend


def _run(fn, inputs, block_mask):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs, block_mask)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype))
    return [out.detach(), *(t.grad for t in inputs)]


def _compiled(attend):
    options = {"fallback": "error", "shapes": {"policy": "pow2", "pad_with": "nan"}}
    options["fusion"] = {"attention": True}  # as on a TPU: it must leave the op alone
    return torch.compile(
        attend, backend="tpu_inductor", options=options, dynamic=True, fullgraph=True
    )


@pytest.mark.parametrize("case", CASES)
def test_bucketed_lengths_equal_eager_and_compile_once(case):
    enable_flex_attention_training()
    make_mask, score_mod, kv_heads = CASES[case]
    attend = _attend(score_mod, kv_heads != HEADS)
    compiled = _compiled(attend)
    before, rewrites = tpu_inductor.compiles(), dict(pipeline.counters)
    g = torch.Generator().manual_seed(0)
    for length in LENGTHS:
        block_mask = None
        if make_mask is not None:
            block_mask = create_block_mask(make_mask(length), 2, None, length, length, "cpu")
        q = torch.randn(2, HEADS, length, DIM, generator=g)
        k, v = (torch.randn(2, kv_heads, length, DIM, generator=g) for _ in range(2))
        expected = _run(attend, (q, k, v), block_mask)
        found = _run(compiled, (q, k, v), block_mask)
        for name, e, f in zip(("output", "dq", "dk", "dv"), expected, found):
            relative = ((f - e).norm() / e.norm()).item()
            assert relative <= 1e-5, (case, length, name, relative)
    assert tpu_inductor.compiles() - before == 2  # one forward and one backward, for 3 lengths
    added = {k: v - rewrites.get(k, 0) for k, v in pipeline.counters.items()}
    assert added.get("bucket_shapes.key_masks", 0) == 2  # the forward's mask_mod and backward's
    assert not any(k.startswith("fuse_attention.") and v for k, v in added.items()), added


@pytest.mark.parametrize("case", ["documents, causal", "alibi, causal"])
def test_bucketed_bfloat16_no_further_from_float64_than_eager(case):
    enable_flex_attention_training()
    make_mask, score_mod, kv_heads = CASES[case]
    attend = _attend(score_mod, False)
    compiled = _compiled(attend)
    g = torch.Generator().manual_seed(1)
    for length in LENGTHS[:2]:
        block_mask = create_block_mask(make_mask(length), 2, None, length, length, "cpu")
        inputs = [torch.randn(2, HEADS, length, DIM, generator=g) for _ in range(3)]
        exact = _run(attend, [t.double() for t in inputs], block_mask)
        half = [t.bfloat16() for t in inputs]
        eager, found = _run(attend, half, block_mask), _run(compiled, half, block_mask)
        for name, x, e, f in zip(("output", "dq", "dk", "dv"), exact, eager, found):
            ours, theirs = _gap(f, x), _gap(e, x)
            assert ours <= 2 * theirs + 2**-8, (case, length, name, ours, theirs)


def _gap(found, exact):
    return ((found.double() - exact).norm() / exact.norm()).item()
