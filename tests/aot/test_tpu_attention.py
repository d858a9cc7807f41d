"""Default options, compiled ahead of time for a TPU (as `tpu-inductor compile --platform tpu`):
every attention of the zoo's Llama, GPT-2, a grouped-query Mistral with a sliding window and
BERT with a padding mask is the Splash kernel, and no module holds a sequence x sequence tensor (the fusions are
on by default for platform tpu: config.FUSION_DEFAULTS). Head dims 64 and 128; 512 tokens, and 2048 in the slow run (`make test-slow`). The kernel's numbers at these shapes: tests/lowering/
test_attention_interpret.py.
"""

from __future__ import annotations

import json
import re

import pytest

from tests import hf_zoo
from tpu_inductor.aot import artifact
from tpu_inductor.aot import compile as aot_compile

LAYERS = 2


def _model(name: str, length: int):
    if name == "mistral":  # a sliding window of half the sequence: Splash's LocalMask
        return hf_zoo.gqa_mistral(
            LAYERS, max_position_embeddings=2 * length, sliding_window=length // 2
        )
    heads = {"llama": 2, "gpt2": 4, "bert": 4}[name]  # hidden 256: head dims 128, 64, 64
    size = hf_zoo.Size(hidden=256, layers=LAYERS, heads=heads, seq=length, batch=2)
    model, _ = hf_zoo.build(name, size)
    return model


def _check(tmp_path, monkeypatch, name: str, length: int):
    monkeypatch.delenv("TPU_INDUCTOR_FUSION", raising=False)  # the defaults, whatever is set
    model = _model(name, length)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    specs = [f"input_ids:int64[2,{length}]"]
    if name == "bert":
        specs.append(f"attention_mask:int64[2,{length}]")  # a padding mask
    options = {"cache": False, "dump_dir": str(tmp_path / "d")}
    inputs = [artifact.parse_input(s) for s in specs]
    aot_compile.compile_model(model, inputs, tmp_path / "a", platform="tpu", options=options)
    text = (tmp_path / "a/buckets/0/module.mlir").read_text()
    assert "tpu_custom_call" in text
    square = re.findall(rf"tensor<[0-9x]*\b{length}x{length}x[^>]*>", text)
    assert not square, sorted(set(square))
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "d").rglob("compile.json")]
    assert record["kernel_choices"] == {"tpu.splash": LAYERS}


@pytest.mark.parametrize("length", [512, pytest.param(2048, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["llama", "gpt2", "mistral", "bert"])
def test_every_attention_is_splash(tmp_path, monkeypatch, name, length):
    _check(tmp_path, monkeypatch, name, length)
