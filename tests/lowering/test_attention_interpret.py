"""The TPU lowering of the attention op run, not only emitted: its rules (Splash attention,
lowering/ops/attention_kernels.py) evaluated on this CPU with the Pallas kernels in interpret
mode (`GraphRunner(..., interpret_kernels=True)`), forward and backward, at the shapes the zoo's
models give the op, against eager attention in float64: one test per mask kind. float32 is
within 1e-5 of it; bfloat16 no further from it than eager bfloat16 attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from tpu_inductor.lowering.interpreter import GraphRunner

from tests.helpers import assert_same
from tpu_inductor.ops.attention import ops


def _op_forward_and_backward(scale, diagonal, window, backward=True):
    """The op's forward and backward, as fuse_attention emits them for a training step (or
    its forward alone, an inference graph's)."""

    def fn(q, k, v, grad, *mask):
        m = mask[0] if mask else None
        out, lse = ops.attention(q, k, v, m, scale, diagonal, False, window)
        if not backward:
            return (out,)
        grads = ops.attention_backward(grad, q, k, v, out, lse, m, scale, diagonal, window)
        return (out, *grads)

    return fn


def _interpreted(fn, args):
    """`fn`'s ATen graph lowered by the TPU's rules, kernels interpreted, run here; and the
    choices the rules made."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    runner = GraphRunner(gm, x64="keep", platform="tpu", interpret_kernels=True)
    arrays = [jnp.asarray(t.float().numpy()).astype(_jax_dtype(t.dtype)) for t in args]
    results = jax.jit(lambda *a: runner.run(a))(*arrays)
    got = [torch.from_numpy(np.array(r.astype(jnp.float32))).to(_torch_dtype(r)) for r in results]
    return got, dict(runner.choices)


def _jax_dtype(dtype):
    return {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.bool: jnp.bool_}[dtype]


def _torch_dtype(a):
    return {jnp.float32: torch.float32, jnp.bfloat16: torch.bfloat16}[a.dtype.type]


def _eager(q, k, v, grad, keep, scale, dtype):
    """Eager SDPA in `dtype` (K/V heads repeated, the mask a bool keep-mask): its output and
    the gradients of q, k and v; a row that keeps no key gives 0."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    groups = q.shape[-3] // k.shape[-3]
    keys, values = (t.repeat_interleave(groups, -3) for t in leaves[1:])
    out = torch.nn.functional.scaled_dot_product_attention(
        leaves[0], keys, values, attn_mask=keep, scale=scale
    )
    if keep is not None:  # SDPA's math gives NaN where a row keeps nothing: the op gives 0
        out = torch.where(keep.any(-1, keepdim=True), out, torch.zeros((), dtype=dtype))
    out.backward(grad.to(dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def _padded(pad: int) -> slice:
    """The keys `pad` drops: the first `pad`, or the last `-pad` where it is negative."""
    return slice(None, pad) if pad >= 0 else slice(pad, None)


def _keep(length, count, diagonal, window, padding, batch):
    """The bool keep-mask eager attention reads: a causal diagonal (and window) and/or keys
    padded at the start (`padding[b]` keys of sequence b), broadcast to [B, 1, L, S]."""
    keep = torch.ones(batch, 1, length, count, dtype=torch.bool)
    ones = torch.ones(length, count, dtype=torch.bool)
    if diagonal is not None:
        keep &= ones.tril(diagonal)
    if window is not None:
        keep &= ~ones.tril(diagonal - window)
    for b, pad in enumerate(padding or ()):
        keep[b, ..., _padded(pad)] = False
    return None if diagonal is None and not padding else keep


def _check(
    heads,
    kv_heads,
    length,
    count,
    dim,
    diagonal=None,
    padding=None,
    window=None,
    backward=True,
    chosen="tpu.splash",
    **bfloat16,
):
    """The op at these sizes, forward and (`backward`) backward: the TPU's rules interpreted
    against eager float64 (`bfloat16={"slack": r}`: bfloat16 inputs, each result's mean error
    at most r times eager bfloat16's); `chosen`: the rules' one choice, for every call."""
    dtype = torch.bfloat16 if bfloat16 else torch.float32
    bf16_slack = bfloat16.get("slack")
    batch, scale = 2, dim**-0.5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, length, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, count, dim, generator=g) for _ in range(2))
    grad = torch.randn(batch, heads, length, dim, generator=g)
    args = [t.to(dtype) for t in (q, k, v, grad)]
    mask = []
    if padding:  # the op's mask over keys alone, [B, 1, 1, S] (fuse_attention's key mask)
        keys = torch.ones(batch, 1, 1, count, dtype=torch.bool)
        for b, pad in enumerate(padding):
            keys[b, ..., _padded(pad)] = False
        mask = [keys]
    fn = _op_forward_and_backward(scale, diagonal, window, backward)
    got, choices = _interpreted(fn, [*args, *mask])
    assert choices == {chosen: 2 if backward else 1}
    keep = _keep(length, count, diagonal, window, padding, batch)
    exact = _eager(*args, keep, scale, torch.float64)[: len(got)]
    if dtype == torch.float32:
        for a, e in zip(got, exact):
            assert_same(a.double(), e, rtol=1e-5, atol=1e-5 * float(e.abs().max()))
        return
    eager = _eager(*args, keep, scale, dtype)[: len(got)]
    for a, e, x in zip(got, eager, exact):
        assert a.dtype == dtype
        ours, theirs = ((t.double() - x).abs().mean() for t in (a, e))
        assert ours <= theirs * bf16_slack, (ours, theirs)


def test_causal_llama_head_dim_128():
    """Llama's causal self-attention at prefill (heads 4, head dim 128, 512 tokens)."""
    _check(4, 4, 512, 512, 128, diagonal=0)


def test_full_gpt2_bert_head_dim_64():
    """Full attention, head dim 64 (BERT without a padding mask; a head dim under the 128
    lanes the kernel pads itself)."""
    _check(4, 4, 512, 512, 64)


def test_gqa_causal():
    """Grouped-query attention 8:2 (Mistral's, Qwen's), K/V read unrepeated."""
    _check(8, 2, 256, 256, 128, diagonal=0)


def test_padding_segment_ids_bert():
    """BERT's padding mask: keys dropped per sequence become Splash's segment ids."""
    _check(4, 4, 512, 512, 64, padding=(0, 100))


def test_padding_and_causal_empty_rows():
    """A left-padded causal batch: the padded queries' rows keep no key (the op gives 0 and
    no gradient there; the kernel, which takes no empty row, reads the dropped keys)."""
    _check(4, 2, 256, 256, 128, diagonal=0, padding=(0, 130))


def test_sliding_window():
    """Mistral's sliding window (128 keys) over 512 tokens: Splash's LocalMask."""
    _check(8, 2, 512, 512, 128, diagonal=0, window=128)


def test_sliding_window_with_padding():
    """A sliding window over a left-padded batch: the padded queries' windows keep no key."""
    _check(4, 2, 256, 256, 64, diagonal=0, window=100, padding=(0, 130))


def test_right_padding_and_causal():
    """Keys padded at the end of a causal batch: every row keeps its first keys."""
    _check(4, 2, 256, 256, 128, diagonal=0, padding=(0, -100))


def test_decode_diagonal():
    """Queries at the end of a longer KV cache (a causal diagonal S - L)."""
    _check(4, 2, 128, 512, 128, diagonal=384)


@pytest.mark.parametrize("padding", [None, (0, 100)], ids=["causal", "causal_padding"])
def test_bfloat16_no_further_from_float64_than_eager(padding):
    """Head dim 64: the scale 1/8 is exact, and every result (out, dq, dk, dv) is no further
    from float64 than eager bfloat16 attention (mean error: the largest is one rounding)."""
    _check(4, 2, 256, 256, 64, diagonal=0, padding=padding, slack=1.0)


def test_bfloat16_head_dim_128_scales_queries_in_float32():
    """Head dim 128: 1/sqrt(128) is no power of two, so the queries are scaled and passed in
    float32 (rounded to bfloat16 they made out 1.07x and dq 1.33x eager's mean error): every
    result no further from float64 than eager bfloat16 attention."""
    _check(4, 2, 256, 256, 128, diagonal=0, slack=1.0)


PAGED = "tpu.paged_attention"
PAGED_MASKED = f"{PAGED} (the XLA form, chosen at run time, where the mask keeps no prefix)"


@pytest.mark.parametrize(
    "kv_heads, dim, diagonal, padding, chosen",
    [
        (2, 128, None, (-212, -212), PAGED_MASKED),  # a static cache's mask: keys 0 .. 299
        (2, 128, None, (100, -212), PAGED_MASKED),  # left padded: the XLA form at run time
        (4, 64, 299, None, PAGED),  # a causal diagonal: keys 0 .. 299, head dim 64
        (1, 128, None, None, PAGED),  # multi-query, the whole cache
    ],
    ids=["static_cache_mask", "left_padded", "diagonal_head_dim_64", "mqa_full"],
)
def test_decode_kernel_bfloat16(kv_heads, dim, diagonal, padding, chosen):
    """A decode step (one query row against a 512-key cache) by jax's paged attention kernel:
    no further from float64 than eager bfloat16 attention (the kernel's q scaled in float32)."""
    _check(8, kv_heads, 1, 512, dim, diagonal, padding, backward=False, chosen=chosen, slack=1.0)


def test_decode_float32_splash_padded_rows():
    """float32 decode: the paged kernel reads K/V as bfloat16 (refused), so Splash computes it
    with the query row padded to a 128-row block; within 1e-5, forward and backward."""
    _check(8, 2, 1, 512, 128, None, (-212, -212), chosen="tpu.splash (query rows padded 1 -> 128)")
