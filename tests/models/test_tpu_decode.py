"""A static-cache decode step (Hugging Face's `generate(cache_implementation="static")`) of the
zoo's Llama and a grouped-query Mistral in bfloat16, through torch.compile's stages with the
TPU's fusion defaults, lowered for TPU: every attention is jax's paged attention kernel (the
decode kernel, lowering/ops/attention_decode.py) and no module holds a sequence x sequence
tensor. Its numbers: tests/lowering/test_attention_interpret.py's decode tests. (The AOT
compiler refuses a model that updates a cache in place, so the graphs are the backend's: each
lowering's graph and inputs, lowered again for TPU.)
"""

from __future__ import annotations

import re

import pytest
import torch
from tpu_inductor.lowering.ops import attention_decode

from tests import hf_zoo
from tests.helpers import forget_compiles
from tpu_inductor import lowering
from tpu_inductor.config import FUSION_DEFAULTS

LAYERS, PROMPT, NEW = 2, 8, 9  # a static cache of PROMPT + NEW - 1 = 16 keys: one page


def _model(name: str):
    if name == "mistral":  # no sliding window
        return hf_zoo.gqa_mistral(LAYERS, sliding_window=None)
    size = hf_zoo.Size(hidden=256, layers=LAYERS, heads=2, seq=PROMPT, batch=2)  # head dim 128
    return hf_zoo.build(name, size)[0]


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_static_cache_decode_calls_the_decode_kernel(monkeypatch, name):
    forget_compiles()
    model = _model(name).to(torch.bfloat16)
    lowered = []

    def lower(gm, inputs, **kw):  # the backend's lowering, and the same graph's for TPU
        lowered.append(lowering_lower(gm, inputs, **{**kw, "platform": "tpu"}))
        return lowering_lower(gm, inputs, **kw)

    lowering_lower = lowering.lower
    monkeypatch.setattr(lowering, "lower", lower)
    options = {"fusion": FUSION_DEFAULTS["tpu"], "cache": False}
    model.forward = torch.compile(model.forward, backend="tpu_inductor", options=options)
    prompt = torch.randint(0, hf_zoo.VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW,
            do_sample=False,
            cache_implementation="static",
        )
    decode = [m for m in lowered if attention_decode.MASKED_KEY in str(m.kernel_choices)]
    assert decode, [m.kernel_choices for m in lowered]
    for module in decode:
        assert module.kernel_choices == {f"tpu.{attention_decode.MASKED_KEY}": LAYERS}
        assert "tpu_custom_call" in module.text
        keys = PROMPT + NEW - 1
        assert not re.findall(rf"tensor<[0-9x]*\b{keys}x{keys}x[^>]*>", module.text)
