"""The TPU's decode kernel for the attention op: one query row per sequence against a static
KV cache (Hugging Face's StaticCache decode step) by jax's paged attention Pallas kernel
(`jax.experimental.pallas.ops.tpu.paged_attention`). lowering/ops/attention_kernels.py's TPU
rule asks `refusal` first for a query length of 1, and takes Splash or the XLA form where it
refuses.

The cache needs no copy: the kernel's pages are [kv heads, pages, page size, head dim], and
[B, Hkv, S, D] read as B*Hkv heads of S/page-size pages is a reshape (the page size a multiple
of 16, the bfloat16 tile's rows), every head's page table arange(S/page size). q [B, H, 1, D]
is [1, B*H, D]: query head b*H + h is in group (b*H + h) // g = b*Hkv + h // g, its sequence's
K/V head (g = H / Hkv). So the B sequences are one sequence of the kernel, of one length: the
keys j < n. A causal diagonal d gives n = d + 1; a mask over keys gives n on the device, and the
kernel runs where every sequence's mask keeps exactly keys 0 .. n-1 (n > 0; a decode step's
mask without padding). Where it does not (a left-padded batch) the XLA form runs: a `lax.cond`
on the device, both branches compiled, one executed; the choice key says so.

What it refuses, and why: float32 and any dtype but bfloat16 (the kernel converts each K/V
page it loads to bfloat16, `MultiPageAsyncCopyDescriptor._maybe_dequantize`: float32 K/V come
out 1e-3 from float32 attention; bfloat16 ones lose nothing), a window (its keys are no
prefix), a logsumexp read (a backward: the kernel returns none and has no VJP), a cache length
not a multiple of 16. The kernel applies no scale: q is scaled in float32 and passed in
float32, which the kernel reads its queries in anyway, so the scale rounds nothing.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp

from ..dtypes import x64_scope
from . import attention as xla_form

_PAGES = (128, 64, 32, 16)  # page sizes tried, largest first: multiples of bfloat16's 16-row tile
_BLOCK = 512  # keys per compute block, at most (pages_per_compute_block * page size)

KEY = "paged_attention"
MASKED_KEY = "paged_attention (the XLA form, chosen at run time, where the mask keeps no prefix)"


def refusal(q, k, v, mask, keys, causal_diagonal, window, lse_read: bool) -> str | None:
    """Why the decode kernel cannot compute this attention (None: it can); q has one row,
    `keys` the keys `mask` keeps ([N, S], None where it is no bool mask over keys)."""
    if lse_read:
        return "its logsumexp is read (a backward: the decode kernel has no VJP)"
    if q.dtype != jnp.bfloat16:
        return f"dtype {q.dtype} (the decode kernel reads K/V pages as bfloat16)"
    if q.ndim < 3 or q.shape[:-3] != k.shape[:-3] or k.shape != v.shape:
        return f"q {q.shape}, k {k.shape}, v {v.shape} are no [..., H, 1, D] against a cache"
    if q.shape[-3] % k.shape[-3]:
        return f"{q.shape[-3]} query heads over {k.shape[-3]} K/V heads"
    if window is not None:
        return f"window {window} (the decode kernel keeps a prefix of the cache)"
    if causal_diagonal is not None and causal_diagonal < 0:
        return f"causal diagonal {causal_diagonal} keeps no key"
    if mask is not None and keys is None:
        return f"a {mask.dtype} mask of shape {tuple(mask.shape)} (not a bool mask over keys)"
    if k.shape[-2] % _PAGES[-1]:
        return f"cache length {k.shape[-2]} is not a multiple of the {_PAGES[-1]}-key pages"
    return None


def _pages(count: int) -> tuple[int, int]:
    """(page size, pages per compute block) for a cache of `count` keys."""
    size = next(p for p in _PAGES if count % p == 0)
    pages = count // size
    block = max(b for b in range(1, pages + 1) if pages % b == 0 and b * size <= _BLOCK)
    return size, block


def _decode(q, k, v, scale, length, interpret):
    """The kernel's attention of q [..., H, 1, D] over keys 0 .. length-1 of k, v
    [..., Hkv, S, D] (`length` a traced int32 or an int), in float32, [..., H, 1, D]."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    count, dim = k.shape[-2:]
    size, block = _pages(count)
    pages = [t.reshape(-1, count // size, size, dim) for t in (k, v)]  # a reshape: no copy
    rows = (q.astype(jnp.float32) * scale).reshape(1, -1, dim)
    lengths = jnp.reshape(jnp.asarray(length, jnp.int32), (1,))
    table = jnp.arange(count // size, dtype=jnp.int32)[None]
    interpreted = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with x64_scope("narrow"), interpreted:
        out = paged_attention(rows, *pages, lengths, table, pages_per_compute_block=block)
    return out.reshape(q.shape)


def attention(ctx, q, k, v, mask, keys, scale, causal_diagonal, empty_rows_nan, *, interpret):
    """The op's (out, logsumexp) by the decode kernel (`refusal` None), out in float32;
    logsumexp is NaN (its readers refused)."""
    count = k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    last = count if causal_diagonal is None else min(causal_diagonal + 1, count)
    nan_lse = jnp.full((*q.shape[:-1],), jnp.nan, jnp.float32)
    if mask is None:
        return _decode(q, k, v, scale, last, interpret), nan_lse
    keep = keys.reshape(-1, count) & (jnp.arange(count) < last)
    length = jnp.sum(keep[0], dtype=jnp.int32)
    prefix = (length > 0) & jnp.all(keep == (jnp.arange(count) < length))

    def kernel(q, k, v):
        return _decode(q, k, v, scale, length, interpret), nan_lse

    def xla(q, k, v):
        out, lse = xla_form.attention(
            ctx, q, k, v, mask, scale, causal_diagonal, empty_rows_nan, None
        )
        return out.reshape(q.shape).astype(jnp.float32), lse.reshape(nan_lse.shape)

    return jax.lax.cond(prefix, kernel, xla, q, k, v)
