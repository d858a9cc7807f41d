"""The benchmark's model zoo: built-in names → (model, example inputs), or the user's factory.

Every builder seeds torch and builds its model with random weights (Hugging Face models from
small configs: nothing is downloaded). `resolve(name)` accepts a built-in name or
`module:factory`, where `factory()` returns `(model, example_inputs)`; the model is called as
`model(*example_inputs)`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from tpu_inductor.exc import BenchError

# The examples directory of a source checkout (the quickstart model lives there).
_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A benchmark case: how to build the model and its inputs, and what it measures."""

    name: str
    build: Callable[[], tuple[nn.Module, tuple]]
    description: str
    # "model": a steady-state latency case; "overhead": a per-call overhead microbenchmark.
    kind: str = "model"


def resolve(name: str) -> ModelSpec:
    """The spec of a built-in model name or of a `module:factory` string."""
    if name in BUILTINS:
        return BUILTINS[name]
    if ":" in name:
        return ModelSpec(name, _factory(name), f"user factory {name}")
    raise BenchError(
        f"tpu-inductor bench: unknown model {name!r}. Built-in models: "
        f"{', '.join(BUILTINS)}; or give your own as module:factory (a function returning "
        "(model, example_inputs))."
    )


def build(spec: ModelSpec) -> tuple[nn.Module, tuple]:
    """Build a spec's model and inputs (seeded), checking the factory's return value."""
    torch.manual_seed(0)
    built = spec.build()
    if not (isinstance(built, tuple) and len(built) == 2):
        raise BenchError(
            f"tpu-inductor bench: {spec.name} returned {type(built).__name__}; a model factory "
            "must return (model, example_inputs)."
        )
    model, inputs = built
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not callable(model) or not isinstance(inputs, (tuple, list)):
        raise BenchError(
            f"tpu-inductor bench: {spec.name} returned ({type(model).__name__}, "
            f"{type(inputs).__name__}); expected a callable model and a tuple of inputs."
        )
    return model, tuple(inputs)


def _factory(name: str) -> Callable[[], tuple]:
    module_name, _, attr = name.partition(":")

    def load():
        if os.getcwd() not in sys.path:  # like `python -m`: the user's modules sit in the cwd
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise BenchError(f"tpu-inductor bench: cannot import {module_name!r}: {e}") from e
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise BenchError(
                f"tpu-inductor bench: {module_name!r} has no function {attr!r} "
                "(module:factory names a function returning (model, example_inputs))."
            )
        return factory()

    return load


# --- built-in models ------------------------------------------------------------------------


def _quickstart_gpt():
    path = _EXAMPLES / "quickstart.py"
    if not path.is_file():
        raise BenchError(
            f"tpu-inductor bench: quickstart-gpt needs {path} (a source checkout of tpu_inductor)."
        )
    module_spec = importlib.util.spec_from_file_location("tpu_inductor_quickstart", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    model, idx = module.make_model_and_inputs(batch=8, seq=128)
    return model, (idx,)


def _mlp():
    model = nn.Sequential(
        nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 512)
    )
    return model.eval(), (torch.randn(64, 512),)


def _cnn():
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    )
    return model.eval(), (torch.randn(16, 3, 32, 32),)


_HF_SIZE = dict(vocab_size=4096, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_BATCH, _SEQ = 4, 128


def _token_ids(vocab: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, vocab, (_BATCH, _SEQ)),)


def _gpt2():
    import transformers

    config = transformers.GPT2Config(
        n_layer=4, n_embd=256, n_head=4, n_positions=_SEQ, use_cache=False, **_HF_SIZE
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval(), _token_ids(config.vocab_size)


def _bert():
    import transformers

    config = transformers.BertConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=_SEQ,
        **_HF_SIZE,
    )
    model = transformers.AutoModel.from_config(config)
    return model.eval(), _token_ids(config.vocab_size)


def _llama():
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        max_position_embeddings=_SEQ,
        use_cache=False,
        **_HF_SIZE,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval(), _token_ids(config.vocab_size)


def _qwen3_moe_decoder():
    """Qwen3-MoE from a small config, d128 L4, 4 experts with 2 per token, running its default
    experts (transformers' grouped_mm_fallback op in float32, lowered to a ragged dot)."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        num_hidden_layers=4,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=_SEQ,
        use_cache=False,
        attn_implementation="sdpa",
        **_HF_SIZE,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _qwen3_moe():
    model = _qwen3_moe_decoder()
    return model, _token_ids(model.config.vocab_size)


def _moe_layer():
    layer = _qwen3_moe_decoder().model.layers[0].mlp  # router, top-k and the 4 experts
    return layer, (torch.randn(_BATCH, _SEQ, layer.gate.weight.shape[-1]),)


class _OneOp(nn.Module):
    def forward(self, x):
        return x + 1


def _overhead_1op():
    return _OneOp(), (torch.randn(8),)


def _overhead_100param():
    # 50 Linear(4, 4): 100 parameter tensors, each tiny, so transfer per parameter dominates.
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(50)]).eval(), (torch.randn(1, 4),)


BUILTINS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("quickstart-gpt", _quickstart_gpt, "examples/quickstart.py GPT, d512 L4, 8x128"),
        ModelSpec("mlp", _mlp, "MLP 512-2048-2048-512, batch 64"),
        ModelSpec("cnn", _cnn, "2 conv+BN+pool layers, 16x3x32x32"),
        ModelSpec("gpt2", _gpt2, "HF GPT-2 from config, d256 L4, 4x128"),
        ModelSpec("bert", _bert, "HF BERT from config, d256 L4, 4x128"),
        ModelSpec("llama", _llama, "HF Llama from config, d256 L4 GQA, 4x128"),
        ModelSpec(
            "moe-layer", _moe_layer, "Qwen3-MoE's sparse MoE block, d128 4 experts top-2, 4x128"
        ),
        ModelSpec(
            "qwen3-moe", _qwen3_moe, "HF Qwen3-MoE from config, d128 L4 4 experts top-2, 4x128"
        ),
        ModelSpec("overhead-1op", _overhead_1op, "x + 1 on 8 floats", kind="overhead"),
        ModelSpec(
            "overhead-100param", _overhead_100param, "50 Linear(4,4): 100 params", kind="overhead"
        ),
    )
}

# What `tpu-inductor bench` and `make bench` run when no model is named.
STANDARD_SET: tuple[str, ...] = tuple(BUILTINS)
