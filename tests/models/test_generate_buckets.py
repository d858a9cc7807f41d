"""Hugging Face `generate()` on padded batches, bucketed (issue 40): a batch of prompts padded to
one length with an attention mask, as every batched request arrives. The decode step's graph uses
the cache's length as a number (the new token's position, the causal mask's `kv_idx <= q_idx`)
and reads the mask at the keys' positions: bucketed, the numbers are the true lengths and the
mask shares the cache's bucket (passes/bucket_values.py, BucketLayout.ties).

Per case: the tokens equal eager's, and the PJRT compiles are at most twice the number of pow2
buckets the prompt and cache lengths span, per batch size (a bucket's boundary can be crossed
by the prompt graph and the decode graph, and Dynamo's first trace of each is static). The
left-padded batch runs in CI; the other cases (`make test-slow`) cost a minute or more each.
"""

from __future__ import annotations

import pytest
import torch

from tests import hf_zoo
from tpu_inductor.config import Options
from tpu_inductor.runtime import buckets, devices

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

LENGTHS = (5, 9, 13, 20)
OPTIONS = {"shapes": {"policy": "pow2"}, "fallback": "error"}
POW2 = buckets.policy_of(Options.from_user(OPTIONS).shapes)
# generate()'s arguments per case, and the batch size of each request
CASES = {
    "left-padded": ({}, (2, 2, 2, 2)),
    "right-padded": ({}, (2, 2, 2, 2)),
    "beam-search": ({"num_beams": 2}, (2, 2, 2, 2)),
    "seeded-sampling": ({"do_sample": True, "top_k": 20}, (2, 2, 2, 2)),
    "repetition-penalty": ({"repetition_penalty": 1.3}, (2, 2, 2, 2)),
    "static-cache": ({"cache_implementation": "static"}, (2, 3, 2, 4)),
}


def _request(n: int, batch: int, side: str, g: torch.Generator):
    """`batch` prompts of length `n`, the last third of row 1 (its first third, left) padding."""
    ids = torch.randint(1, hf_zoo.VOCAB, (batch, n), generator=g)
    mask = torch.ones(batch, n, dtype=torch.long)
    pad = slice(n - n // 3, n) if side == "right" else slice(0, n // 3)
    ids[1, pad], mask[1, pad] = 0, 0
    return ids, mask


def _spanned(new_tokens: int) -> int:
    """How many pow2 buckets the prompt lengths and the cache's lengths span."""
    lengths = {n + k for n in LENGTHS for k in range(new_tokens)}
    return len({POW2.bucket(n, None) for n in lengths})


def _bound(name: str, new_tokens: int, batches) -> int:
    """At most twice the buckets spanned, per batch size. T5's decoder step reads the encoder's
    states: it compiles per pair of a prompt's bucket and a decoder length's bucket."""
    if name != "t5":
        return 2 * _spanned(new_tokens) * len(set(batches))
    prompts = {POW2.bucket(n, None) for n in LENGTHS}
    decoded = {POW2.bucket(k, None) for k in range(1, new_tokens + 1)}
    return 2 * len(prompts) * len(decoded) * len(set(batches))


def _check(name: str, case: str, new_tokens: int) -> None:
    extra, batches = CASES[case]
    model, _ = hf_zoo.build(name, hf_zoo.Size(seq=64))
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    g = torch.Generator().manual_seed(0)
    side = "right" if case == "right-padded" else "left"
    requests = [_request(n, b, side, g) for n, b in zip(LENGTHS, batches)]
    how = {"max_new_tokens": new_tokens, "do_sample": False, **extra}

    def generate(ids, mask):
        torch.manual_seed(7)  # the same draws, eager and compiled
        return model.generate(ids, attention_mask=mask, **how)

    expected = [generate(*r) for r in requests]
    model.forward = torch.compile(model.forward, backend="tpu_inductor", options=OPTIONS)
    before = devices.stats["pjrt_compiles"]
    for request, want in zip(requests, expected):
        assert torch.equal(generate(*request), want)
    compiles = devices.stats["pjrt_compiles"] - before
    assert compiles <= _bound(name, new_tokens, batches), compiles


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_left_padded_batch_generates_eagers_tokens_in_few_compiles(name):
    """Four prompts' lengths, 32 new tokens: at most 8 compiles (38 per exact size before)."""
    _check(name, "left-padded", 32)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != "left-padded"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generation_cases_generate_eagers_tokens_in_few_compiles(name, case):
    _check(name, case, 16)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "t5"])
def test_a_moe_decoder_and_an_encoder_decoder_generate_eagers_tokens(name):
    _check(name, "left-padded", 16)
