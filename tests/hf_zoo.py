"""Hugging Face models built from tiny configs with random weights (nothing is downloaded).

`build(name, size)` returns a seeded float32 model in eval mode and its keyword inputs, for the
model tests and the torch-mlir differential test. Dropout is off so a training step is
deterministic. Mixture-of-experts models (`MOE`) run the experts implementation `build` is
given: "batched_mm" unless told (static shapes: gather the selected experts' weights, batched
matmul; the torch-mlir differential test needs it), or None for the model's default,
"grouped_mm" (a grouped matmul over tokens sorted by expert: `aten._grouped_mm` in bfloat16,
transformers' `grouped_mm_fallback` custom op otherwise).
"""

from __future__ import annotations

import dataclasses

import torch

VOCAB = 128


@dataclasses.dataclass(frozen=True)
class Size:
    """The knobs every config shares."""

    hidden: int = 32
    layers: int = 2
    heads: int = 4
    seq: int = 8
    batch: int = 2


TINY = Size()
LARGE = Size(hidden=128, layers=4, heads=8, seq=64, batch=2)

MODELS = ("gpt2", "bert", "llama", "t5", "vit", "mixtral")
TRAINABLE = ("gpt2", "bert", "llama")  # the ones the issue asks a training step of
MOE = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe", "qwen2_moe")


def _decoder_kwargs(s: Size) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=s.hidden,
        intermediate_size=2 * s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.heads // 2,  # grouped-query attention
        max_position_embeddings=2 * s.seq,
        attn_implementation="sdpa",
    )


def _config(name: str, s: Size):
    import transformers as tf

    if name == "gpt2":
        return tf.GPT2LMHeadModel, tf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=2 * s.seq,
            n_embd=s.hidden,
            n_layer=s.layers,
            n_head=s.heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="sdpa",
        )
    if name == "bert":
        return tf.BertForMaskedLM, tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=s.hidden,
            num_hidden_layers=s.layers,
            num_attention_heads=s.heads,
            intermediate_size=2 * s.hidden,
            max_position_embeddings=2 * s.seq,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="sdpa",
        )
    if name == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(**_decoder_kwargs(s))
    if name == "mixtral":
        return tf.MixtralForCausalLM, tf.MixtralConfig(
            **_decoder_kwargs(s), num_local_experts=4, num_experts_per_tok=2
        )
    if name in MOE and name not in MODELS:
        return _moe_config(tf, name, s)
    if name == "t5":
        return tf.T5ForConditionalGeneration, tf.T5Config(
            vocab_size=VOCAB,
            d_model=s.hidden,
            d_kv=s.hidden // s.heads,
            d_ff=2 * s.hidden,
            num_layers=s.layers,
            num_decoder_layers=s.layers,
            num_heads=s.heads,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        )
    if name == "vit":
        return tf.ViTForImageClassification, tf.ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            hidden_size=s.hidden,
            num_hidden_layers=s.layers,
            num_attention_heads=s.heads,
            intermediate_size=2 * s.hidden,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=10,
            attn_implementation="sdpa",
        )
    raise ValueError(f"unknown model {name!r}; known: {', '.join(dict.fromkeys(MODELS + MOE))}")


def _moe_config(tf, name: str, s: Size):
    """Qwen3-MoE, DeepSeek-V3 (a dense first layer, a shared expert, group-limited routing,
    multi-head latent attention), GPT-OSS (expert biases, attention sinks: eager attention,
    sliding-window layers), OLMoE (query/key norms over all heads) and Qwen2-MoE (a gated
    shared expert): 4 experts, 2 per token."""
    kwargs = dict(**_decoder_kwargs(s), num_experts_per_tok=2, moe_intermediate_size=s.hidden // 2)
    head = s.hidden // s.heads
    if name == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(**kwargs, num_experts=4, head_dim=head)
    if name == "olmoe":
        kwargs.pop("moe_intermediate_size")
        kwargs["intermediate_size"] = s.hidden // 2  # OLMoE's experts' width
        return tf.OlmoeForCausalLM, tf.OlmoeConfig(**kwargs, num_experts=4, eos_token_id=0)
    if name == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
            **kwargs, num_experts=4, shared_expert_intermediate_size=s.hidden
        )
    if name == "deepseek_v3":
        kwargs.update(num_key_value_heads=s.heads, q_lora_rank=None, kv_lora_rank=2 * head)
        return tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            **kwargs,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            qk_rope_head_dim=head // 2,
            qk_nope_head_dim=head // 2,
            v_head_dim=head,
        )
    kwargs.pop("moe_intermediate_size")
    kwargs["attn_implementation"] = "eager"  # transformers has no sdpa path with sinks
    layer_types = ["sliding_attention", "full_attention"] * s.layers
    return tf.GptOssForCausalLM, tf.GptOssConfig(
        **kwargs,
        num_local_experts=4,
        head_dim=head,
        sliding_window=s.seq // 2,
        layer_types=layer_types[: s.layers],
    )


def gqa_mistral(layers: int, **config):
    """A Mistral with grouped-query attention 8:2 at head dim 128 (hidden 256), seeded, in eval
    mode (the TPU attention tests'); `config`: MistralConfig's other arguments (a sliding
    window, the positions)."""
    import transformers as tf

    config = tf.MistralConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, attn_implementation="sdpa",
        **config,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.MistralForCausalLM(config).eval()


def build(
    name: str, size: Size = TINY, experts: str | None = "batched_mm"
) -> tuple[torch.nn.Module, dict]:
    """A seeded, randomly initialised float32 model (eval mode) and its keyword inputs; an MoE
    model runs the `experts` implementation (None: the model's default)."""
    cls, config = _config(name, size)
    torch.manual_seed(0)
    model = cls(config).eval()
    if name in MOE and experts is not None:
        model.set_experts_implementation(experts)
    if name == "gpt2":  # its class name maps to no loss; the warning would break Dynamo's graph
        model.loss_type = "ForCausalLM"
    g = torch.Generator().manual_seed(1)
    shape = (size.batch, size.seq)
    if name == "vit":
        return model, {"pixel_values": torch.randn(size.batch, 3, 16, 16, generator=g)}
    inputs = {"input_ids": torch.randint(0, VOCAB, shape, generator=g)}
    if name == "t5":
        inputs["decoder_input_ids"] = torch.randint(0, VOCAB, shape, generator=g)
    if name != "bert":
        inputs["use_cache"] = False
    return model, inputs
