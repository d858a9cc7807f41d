"""The attention op's per-platform kernels (lowering/ops/attention_kernels.py).

The TPU lowering (Splash attention, the decode kernel) is produced here: `lower(...,
platform="tpu")` and the AOT compiler give StableHLO with the kernel's `tpu_custom_call`; its
numerics are checked in Pallas interpret mode against eager SDPA, forward and backward. Unsupported shapes and masks fall back
to the XLA form with the reason counted. Grouped-query folding: a Llama decode step against a
long KV cache, whose repeated K/V dominate its temporaries, compiled with fusion on and off.
"""

from __future__ import annotations

import collections
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from tpu_inductor.lowering import lower
from tpu_inductor.lowering.ops import attention_kernels

from tests import hf_zoo
from tests.helpers import assert_same
from tools.bench_attention_kernels import decode_temporaries
from tpu_inductor.aot import artifact
from tpu_inductor.aot import compile as aot_compile
from tpu_inductor.ops.attention import ops

SCALE = 0.3


def _forward_and_backward(mask, diagonal):
    def fn(q, k, v, grad, *masks):
        m = masks[0] if masks else mask
        out, lse = ops.attention(q, k, v, m, SCALE, diagonal)
        return out, lse, *ops.attention_backward(grad, q, k, v, out, lse, m, SCALE, diagonal)

    return fn


def _inputs(heads, kv_heads, length, count, dim, dtype=torch.float32, batch=1):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, length, dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, count, dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(batch, heads, length, dim, generator=g).to(dtype)


def _lowered_choices(platform, args, mask=None, diagonal=None):
    """(the StableHLO text of the op's forward and backward lowered for `platform`, the
    choices its rules made), the choices also counted process-wide."""
    fn = _forward_and_backward(mask, diagonal)
    masks = () if mask is None else (mask,)
    gm = make_fx(fn, tracing_mode="fake")(*args, *masks)
    before = collections.Counter(attention_kernels.counters)
    lowered = lower(gm, [*args, *masks], platform=platform)
    assert dict(attention_kernels.counters - before) == lowered.kernel_choices
    return lowered.text, lowered.kernel_choices


@pytest.mark.parametrize(
    "kv_heads, length, count, diagonal, dim, keys",
    [
        (2, 256, 256, 0, 128, False),
        (1, 128, 256, 128, 128, False),
        (4, 256, 384, None, 128, False),
        (4, 256, 256, None, 64, True),
    ],
    ids=["gqa_causal", "mqa_decode_diagonal", "mha_full", "head_dim_64_key_mask"],
)
def test_tpu_lowering_calls_splash(kv_heads, length, count, diagonal, dim, keys):
    """Forward and backward each become the kernel: one call forward; backward, the kernel's
    VJP (the forward again, its dq and dkv kernels). A bool mask over keys alone is the
    kernel's segment ids; a head dim under 128 the kernel pads itself (numbers:
    test_attention_interpret.py)."""
    args = _inputs(4, kv_heads, length, count, dim)
    mask = torch.rand(1, 1, 1, count) < 0.9 if keys else None
    text, choices = _lowered_choices("tpu", args, mask, diagonal)
    assert choices == {"tpu.splash": 2}
    assert text.count("tpu_custom_call") == 4


def _splash_against_sdpa(q, k, v, grad, diagonal, bound):
    """Splash in interpret mode (out, logsumexp, gradients) against eager SDPA in float32 of
    the same inputs, each within `bound` of the expected tensor's largest magnitude."""
    out, lse = attention_kernels.splash_attention(
        *map(_jax, (q, k, v)), SCALE, diagonal, interpret=True
    )
    grads = attention_kernels.splash_attention_grads(
        *map(_jax, (grad, q, k, v)), SCALE, diagonal, interpret=True
    )
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    groups = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(groups, 1) for t in leaves[1:])
    mask = None
    if diagonal is not None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(diagonal)
    expected = torch.nn.functional.scaled_dot_product_attention(
        leaves[0], keys, values, attn_mask=mask, scale=SCALE
    )
    expected.backward(grad.float())
    scores = leaves[0].detach().double() @ keys.detach().double().transpose(-1, -2) * SCALE
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    pairs = [(out, expected.detach()), (lse, torch.logsumexp(scores, -1).float())]
    for got, want in [*pairs, *((g, leaf.grad) for g, leaf in zip(grads, leaves))]:
        assert_same(_torch(got), want, rtol=bound, atol=bound * float(want.abs().max()))
    assert out.dtype == grads[0].dtype == _jax(q).dtype


def _jax(t):
    return jnp.asarray(t.float().numpy()).astype(
        jnp.bfloat16 if t.dtype == torch.bfloat16 else jnp.float32
    )


def _torch(a):
    return torch.from_numpy(np.array(a.astype(jnp.float32)))


@pytest.mark.parametrize(
    "kv_heads, length, count, diagonal, batch",
    [(2, 256, 256, 0, 1), (1, 128, 256, 128, 1), (2, 128, 256, None, 2)],
    ids=["gqa_causal", "mqa_decode_diagonal", "gqa_full_batch_2"],
)
def test_splash_numerics_in_interpret_mode_equal_eager(kv_heads, length, count, diagonal, batch):
    q, k, v, grad = _inputs(4, kv_heads, length, count, 128, batch=batch)
    _splash_against_sdpa(q, k, v, grad, diagonal, 1e-5)


def test_splash_numerics_bfloat16():
    """bfloat16 inputs (float32 accumulation inside the kernel, bfloat16 results)."""
    q, k, v, grad = _inputs(2, 1, 128, 128, 128, torch.bfloat16)
    _splash_against_sdpa(q, k, v, grad, 0, 1e-2)


@pytest.mark.parametrize(
    "shape, dtype, mask, diagonal, reason",
    [
        ((4, 2, 200, 200, 128), torch.float32, None, 0, "key length 200 is not a multiple"),
        (
            (4, 2, 1, 200, 128),
            torch.float32,
            None,
            199,
            "200 is not a multiple of the 128-wide"
            " blocks; decode kernel: its logsumexp is read (a backward",
        ),
        ((4, 2, 128, 128, 128), torch.float16, None, 0, "dtype float16"),
        ((4, 2, 128, 128, 128), torch.float32, "float", None, "a float32 mask tensor"),
        ((4, 2, 128, 128, 128), torch.float32, "bool", None, "a bool mask tensor"),
    ],
    ids=[
        "length_200",
        "decode_one_query",
        "float16",
        "padding_bias",
        "bool_mask",
    ],
)
def test_tpu_fallbacks_are_named(shape, dtype, mask, diagonal, reason):
    heads, kv_heads, length, count, dim = shape
    args = _inputs(heads, kv_heads, length, count, dim, dtype)
    if mask == "float":
        mask = torch.where(torch.rand(1, 1, length, count) < 0.9, 0.0, -torch.inf)
    elif mask == "bool":
        mask = torch.rand(length, count) < 0.9
    text, choices = _lowered_choices("tpu", args, mask, diagonal)
    assert "tpu_custom_call" not in text
    ((key, n),) = choices.items()
    assert n == 2 and key.startswith("tpu.xla: ") and reason in key, choices


def test_cuda_lowering_names_why_cudnn_is_not_used():
    """On this host (no cuDNN) the cuda lowering is the XLA form, saying why; float32 is
    refused before cuDNN is asked."""
    bf16 = _inputs(4, 2, 128, 128, 64, torch.bfloat16)
    text, choices = _lowered_choices("cuda", bf16, diagonal=0)
    assert "cudnn" not in text.lower()
    ((key, n),) = choices.items()
    assert n == 2 and key.startswith("cuda.xla: ") and "cuDNN" in key, choices
    _, choices = _lowered_choices("cuda", _inputs(4, 2, 128, 128, 64), diagonal=0)
    assert choices == {"cuda.xla: dtype float32 (cuDNN takes float16 and bfloat16)": 2}
    _, choices = _lowered_choices("cuda", bf16, torch.zeros(128, 128, dtype=torch.bfloat16))
    assert list(choices) == [
        "cuda.xla: a bfloat16 mask tensor (kept to the XLA form: its empty rows are exact)"
    ]


def test_llama_tpu_artifact_runs_splash_per_layer(tmp_path):
    """A Llama (head dim 128, GQA 2/1) compiled for TPU with fusion on: every layer's
    attention is the kernel, as its compile record says (the StableHLO shares one kernel
    function between the layers, so counting custom calls in it would undercount)."""
    model, _ = hf_zoo.build("llama", hf_zoo.Size(hidden=256, heads=2, seq=256, batch=1))
    model.config.use_cache = False
    options = {"fusion": {"attention": True}, "cache": False, "dump_dir": str(tmp_path / "d")}
    inputs = [artifact.parse_input("input_ids:int64[1,256]")]
    aot_compile.compile_model(model, inputs, tmp_path / "a", platform="tpu", options=options)
    assert "tpu_custom_call" in (tmp_path / "a/buckets/0/module.mlir").read_text()
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "d").rglob("compile.json")]
    assert record["kernel_choices"] == {"tpu.splash": 2}


def test_gqa_folding_drops_a_decode_steps_temporaries_by_the_group_factor():
    """A Llama decode step (GQA 8/2) against a 2048-token KV cache: unfused, XLA builds the
    repeated K/V (8 heads); fused, the op reads the 2 cached heads. Its temporaries (the
    executable's memory analysis) drop by about the group factor, 4 (measured 4.07 -> 1.06
    MiB). At prefill the scores, sequence² per head, dominate the XLA form's temporaries and
    the fold does not show (README, Attention fusion)."""
    results = decode_temporaries(2048, 1, 256)
    for fuse in (False, True):
        assert_same(results[fuse][1], results[None][1])
    assert results[False][0] > 3 * results[True][0], results


def test_decode_kernel_reads_the_cache_in_place():
    """A bfloat16 decode step (GQA 8:2, a 512-key cache): the decode kernel's pages are the
    cache reshaped (B*Hkv heads of 128-key pages), never a transposed copy of it."""
    q, k, v, _ = _inputs(8, 2, 1, 512, 128, torch.bfloat16, batch=2)

    def fn(q, k, v):
        return ops.attention(q, k, v, None, SCALE, None)[0]

    lowered = lower(make_fx(fn, tracing_mode="fake")(q, k, v), [q, k, v], platform="tpu")
    assert lowered.kernel_choices == {"tpu.paged_attention": 1}
    cache = "tensor<2x2x512x128xbf16>"
    assert lowered.text.count(f"({cache}) -> tensor<4x4x128x128xbf16>") == 2  # K's and V's
    assert not [x for x in lowered.text.splitlines() if "transpose" in x and cache in x]
    assert "tpu_custom_call" in lowered.text


def test_splash_padded_rows_with_given_segment_ids_keep_keys():
    """100 query rows (padded to Splash's 128) of documents given as segment ids, causal with
    a window of 20, the padded rows' windows holding none of their id's keys (the kernel's
    finite mask value keeps such a row finite, and its zero gradient adds nothing to dK and
    dV): out and gradients within 1e-5 of eager float64."""
    q, k, v, grad = _inputs(2, 1, 100, 512, 128)
    docs = torch.tensor([0] * 50 + [1] * 50 + [2] * 412, dtype=torch.int32)[None, None]
    ids = (jnp.asarray(docs[..., :100].numpy()), jnp.asarray(docs.numpy()))
    kw = dict(window=20, interpret=True, segment_ids=ids)
    out, _ = attention_kernels.splash_attention(*map(_jax, (q, k, v)), SCALE, 0, **kw)
    grads = attention_kernels.splash_attention_grads(*map(_jax, (grad, q, k, v)), SCALE, 0, **kw)
    rows, keys = torch.arange(100)[:, None], torch.arange(512)
    keep = (docs[0, 0, :100, None] == docs[0, 0]) & (keys <= rows) & (keys > rows - 20)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    kv = [t.repeat_interleave(2, 1) for t in leaves[1:]]
    expected = torch.nn.functional.scaled_dot_product_attention(
        leaves[0], *kv, attn_mask=keep, scale=SCALE
    )
    expected.backward(grad.double())
    for got, want in zip([out, *grads], [expected.detach(), *(t.grad for t in leaves)]):
        assert_same(_torch(got).double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
