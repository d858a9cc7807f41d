"""Per-platform kernels for `tpu_inductor::attention` and its backward (the op:
tpu_inductor/ops/attention.py).

The portable rules (`lowering/ops/attention.py`, "the XLA form": float32 scores, softmax by
logsumexp, grouped-query heads folded into K/V's) serve every platform; this module registers
overrides that choose a fused kernel where the kernel's constraints hold and fall back to the
XLA form elsewhere, naming why:

- `tpu`: the Splash attention Pallas kernel (`jax.experimental.pallas.ops.tpu.
  splash_attention`, one `tpu_custom_call` per call) when q's and K/V's leading dims agree, the
  dtype is float32 or bfloat16, both lengths are multiples of 128 (blocks of 512, 256 or 128
  that divide them), and the mask is one the kernel takes: none, a causal diagonal d >= 0 (its
  `CausalMask` offset; decode steps included) or with a window (a sliding window: its
  `LocalMask`), and/or a bool mask over keys alone
  ([..., 1, 1, S]: a padding mask, as fuse_attention leaves it) as the kernel's segment ids
  (kept keys 0, dropped 1; a query whose row keeps no key reads the dropped ones, since the
  kernel takes no empty row, and its results are replaced by the op's). Any other mask tensor
  (an additive bias, a mask with a query dim) is not. Head dims under the 128 lanes the kernel
  pads itself (jax-ml/jax#30861). Grouped-query and multi-query attention (the op's q heads
  a multiple of K/V's) read K/V unrepeated: the kernel maps each query head to its K/V head.
  The kernel applies no scale: q is scaled first, in float32, and rounded to its dtype where
  that rounds nothing (a power-of-two scale), else passed in float32 (`_scaled_queries`). A
  query length that is not a multiple of 128 is padded to one (zero rows, results dropped;
  counted `tpu.splash (query rows padded L -> P)`); the key length must be one. The
  backward is the kernel's own VJP (its dq and dkv kernels) taken through a recomputed
  forward: the kernel's backward that takes saved residuals is private to jax.
- `tpu`, one query row (a decode step against a static KV cache): jax's paged attention
  kernel first (lowering/ops/attention_decode.py: bfloat16, a prefix of the cache), else
  Splash with the row padded, else the XLA form, the reason naming both refusals.
- `cuda`: cuDNN's fused attention through `jax.nn.dot_product_attention(implementation=
  "cudnn")` (its BTNH layout, so q/k/v are transposed in and out) for float16/bfloat16,
  [B, H, L, D] attention, full or causal (no decode diagonal, no mask tensor: cuDNN would take
  one as a bias, and what it makes of a row the mask empties is not checked here). jax raises
  for shapes cuDNN does not take (and when no cuDNN is present, as on a lowering-only host);
  that exception is the reason of the fallback. Its logsumexp comes back in the output's dtype and
  is widened; the backward again differentiates the kernel (cuDNN's backward).
- `cpu` and anything else: the portable rules, unchanged.

Every choice is counted, per lowering in `LoweredModule.kernel_choices` (through
`LoweringContext.chose`; the compile record's `kernel_choices` in compile.json) and process-wide
in `counters` (like `passes.pipeline.counters`), and logged at INFO: keys `"<platform>.<kernel>"`
for a kernel chosen, `"<platform>.xla: <reason>"` for a fallback. That is how many attentions a
lowering runs as kernels (its StableHLO undercounts them: jax emits one function per distinct
kernel, called once per layer). With `LoweringContext.interpret_kernels` the same rules call
the kernel in Pallas interpret mode, which runs on any host: the tests run the TPU's lowering
on the CPU and check its numbers against eager torch.
"""

from __future__ import annotations

import collections
import functools
import logging
import math

import jax
import jax.numpy as jnp

from tpu_inductor.ops.attention import ops as ours

from ..dtypes import x64_scope
from ..registry import register_lowering
from . import attention as xla_form
from . import attention_decode as decode
from .common import _results, reads_result

log = logging.getLogger(__name__)

counters: collections.Counter = collections.Counter()

LANES = 128  # the TPU's vector width: Splash's blocks and head dims are multiples of it
_BLOCKS = (512, 256, 128)  # the block sizes tried, largest first
_SPLASH_DTYPES = (jnp.float32, jnp.bfloat16)
_CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)


def _count(ctx, platform: str, kernel: str, reason: str | None) -> bool:
    """Record one choice; True when the kernel was chosen (reason None)."""
    key = f"{platform}.{kernel}" if reason is None else f"{platform}.xla: {reason}"
    counters[key] += 1
    ctx.chose(key)
    log.info("attention on %s: %s", platform, kernel if reason is None else f"XLA ({reason})")
    return reason is None


def splash_refusal(q, k, v, mask, causal_diagonal, window=None) -> str | None:
    """Why the Splash kernel cannot compute this attention (None: it can)."""
    if q.ndim < 3 or q.shape[:-3] != k.shape[:-3] or k.shape[:-3] != v.shape[:-3]:
        return f"q {q.shape} and k {k.shape} have no common leading dims before [H, L, D]"
    if q.dtype not in _SPLASH_DTYPES:
        return f"dtype {q.dtype} (the kernel takes float32 and bfloat16)"
    if mask is not None and _kept_keys(q, mask) is None:
        return (
            f"a {mask.dtype} mask tensor of shape {tuple(mask.shape)} (the kernel takes a bool "
            "mask over keys alone, [..., 1, 1, S], as segment ids)"
        )
    if causal_diagonal is not None and causal_diagonal < 0:
        return f"causal diagonal {causal_diagonal} leaves rows without keys"
    if window is not None and window < 1:
        return f"window {window} keeps no key"
    if k.shape[-2] % LANES:
        return f"key length {k.shape[-2]} is not a multiple of the {LANES}-wide blocks"
    return None


def padded_rows(length: int) -> int:
    """The query rows Splash computes for `length`: the next multiple of its 128-row blocks
    (the rows added are zeros, their results dropped)."""
    return -(-length // LANES) * LANES


def _kept_keys(q, mask):
    """A bool `mask` that reads keys alone ([..., 1, 1, S], leading dims broadcasting to q's)
    as the keys kept, broadcast to [*q's leading dims, S]; None for any other mask."""
    shape = (1,) * (q.ndim - mask.ndim) + tuple(mask.shape)
    if mask.dtype != jnp.bool_ or len(shape) != q.ndim or shape[-3:-1] != (1, 1):
        return None
    if any(m not in (1, d) for m, d in zip(shape[:-3], q.shape[:-3])):
        return None
    return jnp.broadcast_to(mask.reshape(shape[:-3] + shape[-1:]), (*q.shape[:-3], shape[-1]))


def _segments(keep, length, causal_diagonal, window):
    """Splash's segment ids for kept keys [N, S] (a key attends where the ids are equal): kept
    keys 0, dropped 1; queries 0, but a query whose row keeps no key 1 (the kernel's softmax
    takes no empty row: so it reads dropped keys, which exist there, and its results are
    replaced after). Returns (the ids, the empty rows [N, L])."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    count = keep.shape[-1]
    rows = jnp.arange(length)
    # the keys row i may keep: first < j <= last
    last = rows + (count if causal_diagonal is None else causal_diagonal)
    first = rows + causal_diagonal - window if window is not None else jnp.full_like(rows, -1)
    kept = jnp.pad(jnp.cumsum(keep, -1, dtype=jnp.int32), ((0, 0), (1, 0)))  # kept below j
    at = lambda j: jnp.take(kept, jnp.clip(j, -1, count - 1) + 1, axis=-1)  # noqa: E731
    empty = at(last) == at(first)
    ids = splash.SegmentIds(q=empty.astype(jnp.int32), kv=(~keep).astype(jnp.int32))
    return ids, empty


def _given_segments(q_ids, kv_ids, length, count):
    """Splash's segment ids from ids given per query and per key, leading dims flattened; the
    padded query rows (`padded_rows`) take the last query's id, so they keep keys too."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    q_ids = q_ids.reshape(-1, q_ids.shape[-1])
    q_ids = jnp.pad(q_ids, ((0, 0), (0, length - q_ids.shape[-1])), mode="edge")
    return splash.SegmentIds(q=q_ids, kv=kv_ids.reshape(-1, count))


def _scaled_queries(q, scale):
    """q times `scale` for the kernel, which applies no scale: in q's dtype where that rounds
    nothing (float32 q, or a power-of-two scale: head dim 64's 1/8), else in float32 (bfloat16
    q / sqrt(128) would be rounded before the kernel: dq 1.33x eager's mean error from float64).
    The kernel takes float32 q beside bfloat16 K/V, and its output is then float32 (rounded
    to q's dtype after it, once); on a TPU its q·K and, in the backward, its dK and dV
    products then take a float32 operand."""
    scaled = q.astype(jnp.float32) * scale
    exact = q.dtype == jnp.float32 or math.frexp(scale)[0] == 0.5
    return scaled.astype(q.dtype) if exact else scaled


def _block(size: int) -> int:
    return next(b for b in _BLOCKS if size % b == 0)


@functools.cache
def _splash_kernel(heads, length, count, causal_diagonal, window, residuals, interpret):
    """The Splash kernel for [heads, length, D] queries against [.., count, D] keys."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (length, count)
    if causal_diagonal is None:
        one = splash.FullMask(shape)
    elif window is None:
        one = splash.CausalMask(shape, offset=causal_diagonal)
    else:  # keeps i + d - (window - 1) <= j <= i + d
        one = splash.LocalMask(shape, window_size=(window - 1, 0), offset=causal_diagonal)
    bq, bkv = _block(length), _block(count)
    blocks = splash.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    with jax.ensure_compile_time_eval():  # its mask tables are constants, not a trace's values
        return splash.make_splash_mha_single_device(
            splash.MultiHeadMask([one] * heads),
            block_sizes=blocks,
            save_residuals=residuals,
            interpret=interpret,
        )


def splash_attention(
    q,
    k,
    v,
    scale,
    causal_diagonal,
    mask=None,
    window=None,
    *,
    residuals=True,
    interpret=False,
    empty=0.0,
    segment_ids=None,
):
    """The op's attention by the Splash kernel: (out, logsumexp) for q [..., H, L, D], k and
    v [..., Hkv, S, D] and a mask over keys alone or None (`splash_refusal` None), or out
    alone with `residuals=False` (the form the kernel differentiates). A row that keeps no
    key gives `empty` and logsumexp 0. `interpret`: Pallas interpret mode (any host).
    `segment_ids`: instead of a mask, (the queries' [..., L], the keys' [..., S]) int32 ids, a
    query attending the keys of its id (a document mask; the caller leaves no row empty)."""
    heads, rows_given, _ = q.shape[-3:]
    lead, count, length = q.shape[:-3], k.shape[-2], padded_rows(q.shape[-2])
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scaled = _scaled_queries(q, scale)
    scaled = jnp.pad(scaled, [(0, 0)] * (q.ndim - 2) + [(0, length - rows_given), (0, 0)])
    flat = [t.reshape(-1, *t.shape[-3:]) for t in (scaled, k, v)]
    with x64_scope("narrow"):  # the kernel's index arithmetic mixes int32 with default ints
        kernel = _splash_kernel(heads, length, count, causal_diagonal, window, residuals, interpret)
        if mask is None and segment_ids is None:
            result, rows = jax.vmap(kernel)(*flat), None
        else:
            if mask is None:
                ids, rows = _given_segments(*segment_ids, length, count), None
            else:
                keep = _kept_keys(q, mask).reshape(-1, count)
                ids, rows = _segments(keep, length, causal_diagonal, window)
            result = jax.vmap(lambda q, k, v, i: kernel(q, k, v, segment_ids=i))(*flat, ids)
    out, lse = (result, None) if not residuals else (result[0], result[1][0])
    out = out.astype(q.dtype)  # float32 where the queries were passed in float32
    out, lse = out[..., :rows_given, :], None if lse is None else lse[..., :rows_given]
    if rows is not None:
        rows = rows[:, None, :rows_given]  # [N, 1, L]: every head
        out = jnp.where(rows[..., None], jnp.asarray(empty, out.dtype), out)
        lse = None if lse is None else jnp.where(rows, 0.0, lse)
    out = out.reshape(*lead, *out.shape[1:])
    return out if lse is None else (out, lse.reshape(*lead, *lse.shape[1:]))


def splash_attention_grads(
    grad,
    q,
    k,
    v,
    scale,
    causal_diagonal,
    mask=None,
    window=None,
    *,
    interpret=False,
    segment_ids=None,
):
    """(dq, dk, dv) by the Splash kernel's own VJP (its dq and dkv kernels)."""
    fwd = functools.partial(
        splash_attention,
        scale=scale,
        causal_diagonal=causal_diagonal,
        mask=mask,
        window=window,
        residuals=False,
        interpret=interpret,
        segment_ids=segment_ids,
    )
    with x64_scope("narrow"):
        out, vjp = jax.vjp(fwd, q, k, v)
        return vjp(grad.astype(out.dtype))


def _decoding(q, refusal: str | None) -> str | None:
    """For one query row (a decode step): why the decode kernel refused it (None: it takes
    it); for any other attention, "" (not asked)."""
    return refusal if q.ndim >= 3 and q.shape[-2] == 1 else ""


def _also(refusal: str | None, decoding: str) -> str | None:
    """Splash's refusal, and the decode kernel's where it was asked."""
    return f"{refusal}; decode kernel: {decoding}" if refusal and decoding else refusal


def _splash_key(q) -> str:
    """The choice key of a Splash call: its padded query rows, the work added, named."""
    rows = q.shape[-2] if q.ndim >= 3 else 0
    return f"splash (query rows padded {rows} -> {padded_rows(rows)})" if rows % LANES else "splash"


@register_lowering(ours.attention.default, platform="tpu", needs_ctx=True)
def attention_tpu(
    ctx, q, k, v, mask, scale, causal_diagonal=None, empty_rows_nan=False, window=None
):
    keys = None if mask is None else _kept_keys(q, mask)
    args = (q, k, v, mask, keys, causal_diagonal)
    decoding = _decoding(q, decode.refusal(*args, window, reads_result(ctx.node, 1)))
    if decoding is None:
        _count(ctx, "tpu", decode.KEY if mask is None else decode.MASKED_KEY, None)
        result = decode.attention(
            ctx, *args[:5], scale, causal_diagonal, empty_rows_nan, interpret=ctx.interpret_kernels
        )
        return _results(ctx, result)
    refusal = _also(splash_refusal(q, k, v, mask, causal_diagonal, window), decoding)
    if not _count(ctx, "tpu", _splash_key(q), refusal):
        return xla_form.attention(
            ctx, q, k, v, mask, scale, causal_diagonal, empty_rows_nan, window
        )
    empty = jnp.nan if empty_rows_nan else 0.0
    result = splash_attention(
        q, k, v, scale, causal_diagonal, mask, window, interpret=ctx.interpret_kernels, empty=empty
    )
    return _results(ctx, result)


@register_lowering(ours.attention_backward.default, platform="tpu", needs_ctx=True)
def attention_backward_tpu(
    ctx, grad, q, k, v, out, lse, mask, scale, causal_diagonal=None, window=None
):
    keys = None if mask is None else _kept_keys(q, mask)
    decoding = _decoding(q, decode.refusal(q, k, v, mask, keys, causal_diagonal, window, True))
    refusal = _also(splash_refusal(q, k, v, mask, causal_diagonal, window), decoding)
    if not _count(ctx, "tpu", _splash_key(q), refusal):
        return xla_form.attention_backward(
            ctx, grad, q, k, v, out, lse, mask, scale, causal_diagonal, window
        )
    grads = splash_attention_grads(
        grad, q, k, v, scale, causal_diagonal, mask, window, interpret=ctx.interpret_kernels
    )
    return _results(ctx, grads)


def cudnn_refusal(q, k, v, mask, causal_diagonal, window=None) -> str | None:
    """Why cuDNN's kernel is not tried for this attention (None: try it; jax checks the rest)."""
    if q.ndim != 4 or k.ndim != 4:
        return f"q {q.shape}: cuDNN takes [B, H, L, D] attention only"
    if q.dtype not in _CUDNN_DTYPES:
        return f"dtype {q.dtype} (cuDNN takes float16 and bfloat16)"
    if causal_diagonal not in (None, 0):
        return f"causal diagonal {causal_diagonal} (cuDNN's causal mask is the main diagonal)"
    if window is not None:
        return f"window {window} (kept to the XLA form: cuDNN's local window is unchecked)"
    if mask is not None:  # cuDNN would take it as a bias; a row it empties is unchecked there
        return f"a {mask.dtype} mask tensor (kept to the XLA form: its empty rows are exact)"
    return None


def _cudnn_forward(q, k, v, scale, causal_diagonal):
    """(out, logsumexp) by cuDNN; q/k/v [B, H, L, D] in, BTNH inside."""
    btnh = [jnp.swapaxes(t, 1, 2) for t in (q, k, v)]
    out, lse = jax.nn.dot_product_attention(
        *btnh,
        scale=scale,
        is_causal=causal_diagonal == 0,
        implementation="cudnn",
        return_residual=True,
    )
    return jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse, 1, 2).astype(jnp.float32)  # from BTN


def _cudnn_grads(grad, q, k, v, scale, causal_diagonal):
    """(dq, dk, dv) by cuDNN's backward kernel, the VJP of its forward."""
    fwd = lambda *qkv: _cudnn_forward(*qkv, scale, causal_diagonal)[0]  # noqa: E731
    _, vjp = jax.vjp(fwd, q, k, v)
    return vjp(grad.astype(q.dtype))


def _cudnn(platform_rule, *args):
    """(the cuDNN rule's values, None), or (None, why jax refused: it raises for a shape or
    dtype cuDNN lacks, and where no cuDNN is present, as on a lowering-only host)."""
    try:
        with x64_scope("narrow"):  # as for Splash: jax's kernel code assumes 32-bit defaults
            return platform_rule(*args), None
    except (RuntimeError, NotImplementedError, ValueError) as e:  # jax's words for "not here"
        return None, f"{type(e).__name__}: {e}"


@register_lowering(ours.attention.default, platform="cuda", needs_ctx=True)
def attention_cuda(
    ctx, q, k, v, mask, scale, causal_diagonal=None, empty_rows_nan=False, window=None
):
    result, refusal = None, cudnn_refusal(q, k, v, mask, causal_diagonal, window)
    if refusal is None:
        result, refusal = _cudnn(_cudnn_forward, q, k, v, scale, causal_diagonal)
    if not _count(ctx, "cuda", "cudnn", refusal):
        return xla_form.attention(
            ctx, q, k, v, mask, scale, causal_diagonal, empty_rows_nan, window
        )
    return _results(ctx, result)


@register_lowering(ours.attention_backward.default, platform="cuda", needs_ctx=True)
def attention_backward_cuda(
    ctx, grad, q, k, v, out, lse, mask, scale, causal_diagonal=None, window=None
):
    result, refusal = None, cudnn_refusal(q, k, v, mask, causal_diagonal, window)
    if refusal is None:
        result, refusal = _cudnn(_cudnn_grads, grad, q, k, v, scale, causal_diagonal)
    if not _count(ctx, "cuda", "cudnn", refusal):
        return xla_form.attention_backward(
            ctx, grad, q, k, v, out, lse, mask, scale, causal_diagonal, window
        )
    return _results(ctx, result)
