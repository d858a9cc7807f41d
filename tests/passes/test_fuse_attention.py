"""The attention fusion (passes/fuse_attention.py) on a corpus of attention forms.

Every case compiles its form twice, with the fusion on and off, and checks: the fused results
(and gradients) equal the unfused compile's (float32: 1e-6; bfloat16: the unfused graph rounds
its scores to bfloat16 where the op keeps float32, so bfloat16's tolerance) and eager torch's;
the fusion rewrote the form's attention into the one op, or did not where KNOWN_MISSES says
why. The rate over the whole corpus is computed from the same table.
"""

from __future__ import annotations

import collections
import math
import re

import pytest
import torch
from tpu_inductor.passes import pipeline

from tests.attention_forms import BY_NAME, FORMS, inputs
from tests.helpers import assert_same

# (form, dtype, training, symbolic lengths)
CASES = (
    [(f.name, torch.float32, False, False) for f in FORMS]
    + [
        (name, torch.bfloat16, False, False)
        for name in ("div_add_mask", "float32_softmax", "masked_fill_min", "causal_bias")
        + ("gqa_causal", "decode_tril", "sdpa_causal", "sdpa_float_mask", "sdpa_gqa")
    ]
    + [
        (name, dtype, True, False)
        for name in ("sdpa", "sdpa_causal", "sdpa_float_mask", "sdpa_gqa", "sdpa_repeat_kv")
        for dtype in (torch.float32, torch.bfloat16)
    ]
    + [(name, torch.float32, True, False) for name in ("div_plain", "causal_tril")]
    + [
        (name, torch.float32, False, True)
        for name in ("add_mask", "where_mask", "gqa_plain", "sdpa_causal", "sdpa_float_mask")
    ]
    + [("sdpa_causal", torch.float32, True, True)]
)

# Forms the fusion leaves as they are, and why.
KNOWN_MISSES = {
    ("div_plain", torch.float32, True, False): "training: the forward saves its softmax for "
    "the written-out backward (fusing needs the joint graph: not done)",
    ("causal_tril", torch.float32, True, False): "training, as div_plain",
}

# Cases whose causal mask is built in the graph at concrete sizes: the flag replaces it.
CAUSAL_FROM_MASK = {
    "causal_tril", "causal_tril_min", "causal_arange", "causal_bias", "causal_and_full",
    "decode_tril", "decode_arange", "decode_bias", "gqa_causal", "sdpa_tril_mask",
    "sdpa_decode_tril",
}  # fmt: skip
GQA_FOLDED = {"gqa_plain", "gqa_causal", "mqa_expand", "sdpa_repeat_kv"}


def _case_id(case):
    name, dtype, training, symbolic = case
    return "-".join(
        [name, str(dtype).removeprefix("torch."), *(["train"] * training), *(["sym"] * symbolic)]
    )


def _compile_and_run(case, fuse: bool):
    """(results, gradients or (), fuse_attention's rewrites) of one compile of the case."""
    name, dtype, training, symbolic = case
    form = BY_NAME[name]
    torch.manual_seed(0)
    q, k, v, mask = inputs(form, dtype, grad=training)
    torch._dynamo.reset()
    options = {"cache": False, "fallback": "error", "fusion": {"attention": fuse}}
    if symbolic:
        options["shapes"] = {"policy": "exact"}
        for t, dims in ((q, (2,)), (k, (2,)), (v, (2,)), (mask, (2, 3))):
            for d in dims if t is not None else ():
                torch._dynamo.maybe_mark_dynamic(t, d)  # the lengths; the head dim stays
    compiled = torch.compile(form.fn, backend="tpu_inductor", options=options)
    before = collections.Counter(pipeline.counters)
    with torch.set_grad_enabled(training):
        out = compiled(q, k, v, mask)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v)) if training else ()
    rewrites = _rewrites_since(before)
    eager = form.fn(q, k, v, mask)
    return out.detach(), grads, rewrites, eager.detach()


def _fused_and_unfused(model, kwargs) -> tuple[dict, dict]:
    """({fuse: logits}, {fuse: fuse_attention's rewrites}) of `model(**kwargs)` compiled with
    attention fusion on (True) and off (False)."""
    logits, counts = {}, {}
    for fuse in (True, False):
        torch._dynamo.reset()
        before = collections.Counter(pipeline.counters)
        options = {"cache": False, "fallback": "error", "fusion": {"attention": fuse}}
        with torch.no_grad():
            compiled = torch.compile(model, backend="tpu_inductor", options=options)
            logits[fuse] = compiled(**kwargs).logits
        counts[fuse] = _rewrites_since(before)
    return logits, counts


def _rewrites_since(before: collections.Counter) -> dict[str, int]:
    """fuse_attention's rewrites (the pipeline's process-wide counters) since `before`."""
    return {
        key.removeprefix("fuse_attention."): count - before[key]
        for key, count in pipeline.counters.items()
        if key.startswith("fuse_attention.") and count > before[key]
    }


def _tolerance(dtype):
    return dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_form(case):
    name, dtype, training, symbolic = case
    fused, fused_grads, rewrites, eager = _compile_and_run(case, fuse=True)
    unfused, unfused_grads, unfused_rewrites, _ = _compile_and_run(case, fuse=False)
    assert not unfused_rewrites
    assert_same(fused, unfused, **_tolerance(dtype))
    assert_same(fused_grads, unfused_grads, **_tolerance(dtype))
    assert_same(fused, eager, **_tolerance(dtype) if dtype != torch.float32 else {})
    forward = rewrites.get("written_out", 0) + rewrites.get("sdpa_forward", 0)
    rewritten = forward == 1 and (not training or rewrites.get("sdpa_backward", 0) == 1)
    assert rewritten == (case not in KNOWN_MISSES), rewrites
    if rewritten and not symbolic:  # a causal mask is evaluated at concrete sizes only
        causal = rewrites.get("causal_mask", 0)
        assert causal == (name in CAUSAL_FROM_MASK) * (2 if training else 1), rewrites
    if rewritten:
        assert rewrites.get("gqa_folded", 0) == 2 * (name in GQA_FOLDED), rewrites


def test_corpus_rate():
    """At least 40 cases, at least 95% of them rewritten to the one op (test_form checks each
    case's outcome against KNOWN_MISSES, so the rate is measured, not assumed)."""
    assert set(KNOWN_MISSES) <= set(CASES)
    rate = 1 - len(KNOWN_MISSES) / len(CASES)
    assert len(CASES) >= 40
    assert rate >= 0.95, f"{len(CASES) - len(KNOWN_MISSES)}/{len(CASES)} = {rate:.1%}"


def test_empty_rows_stay_nan():
    """A written-out softmax over a row whose keys are all -inf is NaN; the op keeps it so
    (the SDPA kernels and _safe_softmax give 0, and so does the op for them)."""
    keep = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    keep[..., 1, :] = False
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    for name, nan in (("where_mask", True), ("safe_softmax", False)):
        torch._dynamo.reset()
        fn = BY_NAME[name].fn
        options = {"cache": False, "fusion": {"attention": True}}
        out = torch.compile(fn, backend="tpu_inductor", options=options)(q, k, v, keep)
        assert torch.isnan(out[..., 1, :]).all() == nan and not torch.isnan(out[..., 0, :]).any()
        assert_same(out, fn(q, k, v, keep))


def test_op_gradients_and_fake():
    """The op's eager kernels against autograd's numerical gradient (float64), its fake kernel
    against them (opcheck), for GQA, a decode diagonal and both mask kinds."""
    from tpu_inductor.ops.attention import ops

    for mask in (None, torch.rand(5, 7) > 0.3, torch.randn(2, 1, 5, 7, dtype=torch.float64)):
        q = torch.randn(2, 4, 5, 8, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 2, 7, 8, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 2, 7, 3, dtype=torch.float64, requires_grad=True)
        torch.library.opcheck(ops.attention.default, (q, k, v, mask, 0.3, 2, False))
        assert torch.autograd.gradcheck(
            lambda q, k, v, mask=mask: ops.attention(q, k, v, mask, 0.3, 2)[0], (q, k, v)
        )
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=_with_tril(mask, 5, 7, 2), scale=0.3, enable_gqa=True
        )
        assert_same(ops.attention(q, k, v, mask, 0.3, 2)[0], expected)


def _with_tril(mask, length, count, diagonal):
    keep = torch.ones(length, count, dtype=torch.bool).tril(diagonal)
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, -math.inf)


def test_option_is_validated_and_in_the_cache_key():
    from tpu_inductor.config import Options
    from tpu_inductor.exc import OptionError

    off, on = Options.from_user({}), Options.from_user({"fusion": {"attention": True}})
    assert pipeline.identity(on) != pipeline.identity(off.on_platform("cpu"))
    assert off.cache_key_entries()["fusion"]["attention"] is None  # the platform's default
    assert off.on_platform("cpu").fusion.attention is False  # off on the CPU, on a TPU on
    assert off.on_platform("tpu").fusion.attention is True
    with pytest.raises(OptionError, match="fusion"):
        Options.from_user({"fusion": {"attention": "yes"}})
    with pytest.raises(OptionError, match="attention"):
        Options.from_user({"fusion": {"atention": True}})


@pytest.mark.parametrize(
    "name, attentions, causal, gqa",
    [("gpt2", 2, 0, 0), ("llama", 2, 0, 4), ("t5", 6, 2, 0), ("bert", 2, 0, 0)],
)
def test_hugging_face_eager_attention(name, attentions, causal, gqa):
    """Hugging Face models from configs with attn_implementation="eager" and a padding mask:
    every attention layer becomes the one op (Llama's repeated K/V folded; a causal mask with
    padding stays a mask, a pure one becomes the flag); logits equal the unfused compile's."""
    from tests import hf_zoo

    logits, counts = {}, {}
    for fuse in (True, False):
        model, kwargs = hf_zoo.build(name)
        model.set_attn_implementation("eager")
        mask = torch.ones_like(kwargs["input_ids"])
        mask[0, :2] = 0
        kwargs["attention_mask"] = mask
        torch._dynamo.reset()
        before = collections.Counter(pipeline.counters)
        options = {"cache": False, "fallback": "error", "fusion": {"attention": fuse}}
        with torch.no_grad():
            logits[fuse] = torch.compile(model, backend="tpu_inductor", options=options)(
                **kwargs
            ).logits
        counts[fuse] = _rewrites_since(before)
    assert counts[False] == {}
    assert counts[True].get("written_out") == attentions, counts[True]
    assert counts[True].get("causal_mask", 0) == causal, counts[True]
    assert counts[True].get("gqa_folded", 0) == gqa, counts[True]
    assert_same(logits[True], logits[False], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "attn, policy, training",
    [("sdpa", "pow2", False), ("sdpa", "pow2", True), ("eager", "exact", False)],
    ids=["sdpa", "sdpa-training", "eager"],
)
def test_llama_symbolic_lengths(attn, policy, training):
    """Llama with the fusion on at symbolic lengths, two of them: the op's results keep the
    [B, L, H, D] strides of the CPU SDPA kernels they replace, which the model's later views
    rely on when the graph's sizes are made concrete (passes/shapes.py refused them); written-
    out attention's scale, a graph input at dynamic=True, is applied to q. Logits, loss and
    every gradient equal eager torch's; repeated K/V are folded unless bucketed. (Bucketed
    written-out attention is not fused: the masks bucket_shapes adds on padded keys are no
    step of the pattern table.)"""
    from tests import hf_zoo
    from tests.helpers import grads_of

    model, _ = hf_zoo.build("llama")
    model.set_attn_implementation(attn)
    torch._dynamo.reset()
    options = {"cache": False, "fallback": "error", "fusion": {"attention": True}}
    options["shapes"] = {"policy": policy}
    compiled = torch.compile(model, backend="tpu_inductor", options=options, dynamic=True)
    before = collections.Counter(pipeline.counters)
    g = torch.Generator().manual_seed(2)
    for length in (8, 11):
        ids = torch.randint(0, hf_zoo.VOCAB, (2, length), generator=g)
        with torch.set_grad_enabled(training):
            out, expected = (
                m(input_ids=ids, labels=ids, use_cache=False) for m in (compiled, model)
            )
        assert_same(out.logits, expected.logits)
        if training:
            assert_same(grads_of(model, out.loss), grads_of(model, expected.loss))
    rewrites = _rewrites_since(before)
    forward = "sdpa_forward" if attn == "sdpa" else "written_out"
    assert rewrites.get(forward, 0) >= 2, rewrites  # both layers, in every compile
    assert (rewrites.get("sdpa_backward", 0) >= 2) == training, rewrites
    if policy == "exact":  # bucketed, K/V are masked on padded keys after their repeat
        assert rewrites.get("gqa_folded", 0) >= 4, rewrites


@pytest.mark.parametrize("mask_shape", [None, (5, 7), (2, 1, 1, 7), (2, 4, 5, 7), (1, 1, 5, 7)])
@pytest.mark.parametrize("kv_heads, diagonal", [(4, None), (2, 0), (1, 2), (2, None)])
def test_op_lowering_against_its_kernels(mask_shape, kv_heads, diagonal):
    """The op's lowering (grouped-query heads folded into K/V's, no repeat) and its backward's
    against the eager kernels, for every mask layout and causal diagonal."""
    from tests.helpers import check_against_eager
    from tpu_inductor.ops.attention import ops

    q = torch.randn(2, 4, 5, 8)
    k, v = torch.randn(2, kv_heads, 7, 8), torch.randn(2, kv_heads, 7, 3)
    grad = torch.randn(2, 4, 5, 3)

    def forward_and_backward(q, k, v, grad, *mask):
        mask = mask[0] if mask else None
        out, lse = ops.attention(q, k, v, mask, 0.3, diagonal)
        return out, lse, *ops.attention_backward(grad, q, k, v, out, lse, mask, 0.3, diagonal)

    masks = () if mask_shape is None else (torch.randn(mask_shape),)
    check_against_eager(forward_and_backward, q, k, v, grad, *masks, rtol=1e-5, atol=1e-5)


def test_op_lowering_keeps_scores_in_float32(tmp_path):
    """A bool mask and a causal diagonal become a float32 bias: under x64="keep" a jax where of
    Python floats is float64, which made every score float64 (twice the temporaries)."""
    from tpu_inductor.ops.attention import ops

    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    mask = torch.rand(5, 7) > 0.3

    def fn(q, k, v, mask):
        return ops.attention(q, k, v, mask, 0.3, 2)[0]

    torch._dynamo.reset()
    options = {"cache": False, "fallback": "error", "dump_dir": str(tmp_path)}
    assert_same(
        torch.compile(fn, backend="tpu_inductor", options=options)(q, k, v, mask), fn(q, k, v, mask)
    )
    stablehlo = "".join(p.read_text() for p in tmp_path.rglob("*_stablehlo.mlir"))
    assert "tensor<1x2x10x7xf32>" in stablehlo  # the grouped scores
    assert not re.search(r"tensor<[0-9x]+xf64>", stablehlo)  # (a float64 constant is fine)


@pytest.mark.parametrize("name, causal", [("bert", 0), ("llama", 2)])
def test_padding_mask_becomes_a_mask_over_keys(name, causal):
    """A Hugging Face padding mask (SDPA attention, the first sequence left-padded): the and of
    HF's per-batch key mask with its size-only terms becomes the mask over keys alone, its
    causal tril the flag (the forms the TPU's kernel takes); logits equal the unfused ones."""
    from tests import hf_zoo

    model, kwargs = hf_zoo.build(name)
    mask = torch.ones_like(kwargs["input_ids"])
    mask[0, :3] = 0
    kwargs["attention_mask"] = mask
    logits, counts = _fused_and_unfused(model, kwargs)
    assert counts[True].get("key_mask") == 2, counts[True]
    assert counts[True].get("causal_mask", 0) == causal, counts[True]
    assert_same(logits[True], logits[False], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("padding", [False, True], ids=["causal", "padded"])
def test_sliding_window_becomes_the_ops_window(padding):
    """Mistral's sliding window (3 keys over 8 tokens; with a left-padded batch, and-ed with
    the padding mask): the op's diagonal and window, the band Splash's LocalMask keeps;
    logits equal the unfused ones."""
    import transformers as tf

    config = tf.MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=3,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "use_cache": False}
    if padding:
        kwargs["attention_mask"] = torch.ones_like(ids)
        kwargs["attention_mask"][0, :5] = 0
    logits, counts = _fused_and_unfused(model, kwargs)
    assert counts[True].get("sliding_window") == 2, counts[True]
    assert counts[True].get("key_mask", 0) == 2 * padding, counts[True]
    assert_same(logits[True], logits[False], rtol=1e-6, atol=1e-6)
