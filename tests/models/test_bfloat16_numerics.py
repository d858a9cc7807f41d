"""One bfloat16 training step of every model the tests build, as close to float32 as eager's.

The Hugging Face zoo (tests/hf_zoo.py: dense models, and the mixture-of-experts decoders with
their default experts and with batched experts) and the small GPT of tests/models/test_models:
the logits, the loss and every parameter's gradient of a compiled bfloat16 step are no further
from a float32 run of the same weights than twice eager bfloat16's distance plus one rounding
(tests/numerics.py). MoE models run a batch whose routing bfloat16 cannot flip (see there),
at the zoo's tiny size and at 64 tokens a layer. A few cases run in CI; the rest carry the
`slow` marker.
"""

from __future__ import annotations

import pytest
import torch

from tests import hf_zoo, numerics
from tests.models.test_models import _batch, _gpt

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

pytest.importorskip("transformers")

SLOW = pytest.mark.slow
FAST = {"llama", "qwen2_moe-default", "olmoe-batched_mm"}
# 64 tokens a layer, where a near tie in some token's routing is the rule (slow)
MEDIUM = hf_zoo.Size(hidden=64, seq=32)
CASES = [(name, None) for name in hf_zoo.MODELS if name not in hf_zoo.MOE] + [
    (name, experts) for name in hf_zoo.MOE for experts in (None, "batched_mm")
]


def _id(name: str, experts: str | None) -> str:
    return name if name not in hf_zoo.MOE else f"{name}-{experts or 'default'}"


def _batch_maker(name: str, inputs: dict):
    """Batches like the zoo's, drawn from `seed`, with the labels a training step needs."""

    def make(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        batch = {
            k: torch.randint(0, hf_zoo.VOCAB, v.shape, generator=gen)
            if not v.is_floating_point()
            else torch.randn(v.shape, generator=gen)
            for k, v in inputs.items()
            if isinstance(v, torch.Tensor)
        }
        labels = torch.randint(0, 10, (2,), generator=gen) if name == "vit" else None  # batch 2
        return {**inputs, **batch, "labels": batch["input_ids"] if labels is None else labels}

    return make


@pytest.mark.parametrize(
    ("name", "experts", "size"),
    [
        pytest.param(n, e, hf_zoo.TINY, id=_id(n, e), marks=() if _id(n, e) in FAST else SLOW)
        for n, e in CASES
    ]
    + [
        pytest.param(n, e, MEDIUM, id=f"{_id(n, e)}-medium", marks=SLOW)
        for n, e in CASES
        if n in hf_zoo.MOE
    ],
)
def test_hf_model_bfloat16_step_is_as_close_to_float32_as_eager(name, experts, size):
    model, inputs = hf_zoo.build(name, size, experts=experts)
    batch = numerics.decisive_batch(model, _batch_maker(name, inputs))
    numerics.assert_as_close_as_eager(numerics.bfloat16_step_errors(model, batch))


def test_small_gpt_bfloat16_step_is_as_close_to_float32_as_eager():
    tokens, targets = _batch()

    def run(fn, batch):
        return fn(batch["tokens"], batch["targets"])

    errors = numerics.bfloat16_step_errors(_gpt(), {"tokens": tokens, "targets": targets}, run)
    numerics.assert_as_close_as_eager(errors)
