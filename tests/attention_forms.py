"""The attention corpus of tests/passes/test_fuse_attention.py: written-out forms as Inductor's
patterns and Hugging Face's `attn_implementation="eager"` write them, and SDPA calls.

Each form is `fn(q, k, v, mask)` on q [B, H, L, D], k and v [B, Hkv, S, D] (Hkv = H unless the
form says `kv_heads`), with the mask each form names (or none). `decode`: fewer queries than
keys (L < S).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Form:
    name: str
    fn: Callable
    mask: str | None = None  # None, "float" [B, 1, L, S] bias, "bool" [B, 1, L, S] keep-mask
    kv_heads: int | None = None  # fewer K/V heads (grouped-query attention) given to the form
    decode: bool = False  # L < S


def _scores(q, k):
    return torch.matmul(q, k.transpose(-1, -2))


def _tril(q, k):
    length, count = q.shape[-2], k.shape[-2]
    return torch.ones(length, count, dtype=torch.bool).tril(count - length)


def _repeat_kv(t, heads):
    """HF's repeat_kv: [B, Hkv, S, D] → [B, heads, S, D] by expand and reshape."""
    b, hkv, s, d = t.shape
    return t[:, :, None, :, :].expand(b, hkv, heads // hkv, s, d).reshape(b, heads, s, d)


def div_plain(q, k, v, m):  # Inductor's pattern 1
    return _scores(q, k).div(math.sqrt(q.shape[-1])).softmax(dim=-1).matmul(v)


def mul_plain(q, k, v, m):  # pattern 2: a mul by the scale
    return torch.matmul(torch.softmax(_scores(q, k) * 0.125, dim=-1), v)


def no_scale(q, k, v, m):
    return torch.softmax(_scores(q, k), -1) @ v


def scale_left(q, k, v, m):
    return torch.softmax(0.3 * _scores(q, k), -1) @ v


def add_mask(q, k, v, m):  # HF eager: scores * scaling + mask
    return torch.softmax(_scores(q, k) * q.shape[-1] ** -0.5 + m, -1) @ v


def div_add_mask(q, k, v, m):
    return torch.softmax(_scores(q, k) / 4.0 + m, -1) @ v


def mask_left(q, k, v, m):
    return torch.softmax(m + _scores(q, k), -1) @ v


def where_mask(q, k, v, m):
    return torch.softmax(torch.where(m, _scores(q, k) / 4.0, float("-inf")), -1) @ v


def where_fill(q, k, v, m):
    return torch.softmax(torch.where(~m, float("-inf"), _scores(q, k) / 4.0), -1) @ v


def masked_fill_inf(q, k, v, m):
    return torch.softmax(_scores(q, k).masked_fill(~m, float("-inf")), -1) @ v


def masked_fill_min(q, k, v, m):  # HF eager (BERT-era, GPT-2): masked_fill with finfo.min
    s = (_scores(q, k) * 0.25).masked_fill(~m, torch.finfo(q.dtype).min)
    return torch.softmax(s, -1) @ v


def float32_softmax(q, k, v, m):  # HF eager: softmax in float32, back to the input's dtype
    s = _scores(q, k) * 0.25 + m
    return F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def eval_dropout(q, k, v, m):  # dropout in eval: no node
    p = F.dropout(torch.softmax(_scores(q, k) * 0.25, -1), p=0.1, training=False)
    return p @ v


def causal_tril(q, k, v, m):
    s = _scores(q, k) / 4.0
    return torch.softmax(s.masked_fill(~_tril(q, k), float("-inf")), -1) @ v


def causal_tril_min(q, k, v, m):
    s = (_scores(q, k) / 4.0).masked_fill(~_tril(q, k), torch.finfo(q.dtype).min)
    return torch.softmax(s, -1) @ v


def causal_arange(q, k, v, m):  # kv_idx <= q_idx + (S - L), as masking_utils builds it
    length, count = q.shape[-2], k.shape[-2]
    keep = torch.arange(count)[None, :] <= torch.arange(length)[:, None] + (count - length)
    return torch.softmax(torch.where(keep, _scores(q, k) * 0.25, float("-inf")), -1) @ v


def causal_bias(q, k, v, m):  # HF's eager mask: where(causal, 0, finfo.min) added
    bias = torch.where(_tril(q, k), 0.0, torch.finfo(q.dtype).min).to(q.dtype)
    return torch.softmax(_scores(q, k) * 0.25 + bias, -1) @ v


def causal_and_full(q, k, v, m):  # a causal mask and-ed with an all-true padding mask
    keep = _tril(q, k) & torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    return torch.softmax(torch.where(keep, _scores(q, k) * 0.25, float("-inf")), -1) @ v


def two_biases(q, k, v, m):  # T5: a position bias and the mask, added one after the other
    bias = torch.arange(k.shape[-2], dtype=q.dtype)[None, :] * 0.01
    return torch.softmax(_scores(q, k) * 1.0 + bias + m, -1) @ v


# GPT-2's causal buffer (a module buffer in the model, a global here): a graph input sliced
_BUFFER = torch.tril(torch.ones(16, 16, dtype=torch.bool)).view(1, 1, 16, 16)


def sliced_buffer(q, k, v, m):
    length, count = q.shape[-2], k.shape[-2]
    keep = _BUFFER[:, :, count - length : count, :count]
    s = (_scores(q, k) / 4.0).masked_fill(~keep, torch.finfo(q.dtype).min)
    return torch.softmax(s, -1) @ v


def gqa_plain(q, k, v, m):
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    return torch.softmax(_scores(q, k) * 0.25, -1) @ v


def gqa_causal(q, k, v, m):
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    s = (_scores(q, k) * 0.25).masked_fill(~_tril(q, k), torch.finfo(q.dtype).min)
    return F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def mqa_expand(q, k, v, m):  # one K/V head broadcast by expand
    k, v = k[:, :1].expand_as(q), v[:, :1].expand(*q.shape[:2], *v.shape[2:])
    return torch.softmax(_scores(q, k) * 0.25, -1) @ v


def batched_3d(q, k, v, m):  # heads merged into the batch: bmm on 3-d tensors
    q3, k3, v3 = (t.flatten(0, 1) for t in (q, k, v))
    return torch.bmm(torch.softmax(torch.bmm(q3, k3.transpose(1, 2)) / 4.0, -1), v3)


def permuted_heads(q, k, v, m):  # q, k, v as [B, L, H, D] transposed in, output transposed out
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return (torch.softmax(_scores(q, k) * 0.25, -1) @ v).transpose(1, 2)


def key_pretransposed(q, k, v, m):  # kᵀ built by a permute that is no swap of the last two
    kt = k.permute(0, 2, 1, 3).permute(0, 2, 3, 1)
    return torch.softmax(torch.matmul(q, kt) * 0.25, -1) @ v


def safe_softmax(q, k, v, m):  # what SDPA's math kernel decomposes into
    s = torch.where(m, _scores(q, k) * 0.25, float("-inf"))
    return torch.ops.aten._safe_softmax(s, -1) @ v


def sdpa(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_causal(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_float_mask(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def sdpa_bool_mask(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def sdpa_scale(q, k, v, m):  # a non-default scale
    return F.scaled_dot_product_attention(q, k, v, scale=0.3)


def sdpa_gqa(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def sdpa_repeat_kv(q, k, v, m):  # HF's sdpa path without enable_gqa: repeated K/V
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def sdpa_tril_mask(q, k, v, m):  # a causal mask built in the graph, given as a mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_tril(q, k))


FORMS = (
    Form("div_plain", div_plain),
    Form("mul_plain", mul_plain),
    Form("no_scale", no_scale),
    Form("scale_left", scale_left),
    Form("add_mask", add_mask, mask="float"),
    Form("div_add_mask", div_add_mask, mask="float"),
    Form("mask_left", mask_left, mask="float"),
    Form("where_mask", where_mask, mask="bool"),
    Form("where_fill", where_fill, mask="bool"),
    Form("masked_fill_inf", masked_fill_inf, mask="bool"),
    Form("masked_fill_min", masked_fill_min, mask="bool"),
    Form("float32_softmax", float32_softmax, mask="float"),
    Form("eval_dropout", eval_dropout),
    Form("causal_tril", causal_tril),
    Form("causal_tril_min", causal_tril_min),
    Form("causal_arange", causal_arange),
    Form("causal_bias", causal_bias),
    Form("causal_and_full", causal_and_full),
    Form("decode_tril", causal_tril, decode=True),
    Form("decode_arange", causal_arange, decode=True),
    Form("decode_bias", causal_bias, decode=True),
    Form("two_biases", two_biases, mask="float"),
    Form("sliced_buffer", sliced_buffer),
    Form("sliced_buffer_decode", sliced_buffer, decode=True),
    Form("gqa_plain", gqa_plain, kv_heads=2),
    Form("gqa_causal", gqa_causal, kv_heads=2),
    Form("mqa_expand", mqa_expand),
    Form("batched_3d", batched_3d),
    Form("permuted_heads", permuted_heads),
    Form("key_pretransposed", key_pretransposed),
    Form("safe_softmax", safe_softmax, mask="bool"),
    Form("sdpa", sdpa),
    Form("sdpa_causal", sdpa_causal),
    Form("sdpa_float_mask", sdpa_float_mask, mask="float"),
    Form("sdpa_bool_mask", sdpa_bool_mask, mask="bool"),
    Form("sdpa_scale", sdpa_scale),
    Form("sdpa_gqa", sdpa_gqa, kv_heads=2),
    Form("sdpa_repeat_kv", sdpa_repeat_kv, mask="float", kv_heads=2),
    Form("sdpa_tril_mask", sdpa_tril_mask),
    Form("sdpa_decode_tril", sdpa_tril_mask, decode=True),
)
BY_NAME = {f.name: f for f in FORMS}


def inputs(form: Form, dtype=torch.float32, *, batch=2, heads=4, length=6, dim=16, grad=False):
    """Seeded q, k, v and the form's mask (every row keeps a key unless `empty_rows`)."""
    count = length + 3 if form.decode else length
    kv = form.kv_heads or heads
    q = torch.randn(batch, heads, length, dim, dtype=dtype, requires_grad=grad)
    k = torch.randn(batch, kv, count, dim, dtype=dtype, requires_grad=grad)
    v = torch.randn(batch, kv, count, dim, dtype=dtype, requires_grad=grad)
    keep = torch.rand(batch, 1, length, count) < 0.7
    keep[..., 0] = True
    mask = None
    if form.mask == "bool":
        mask = keep
    elif form.mask == "float":
        mask = torch.where(keep, torch.randn(keep.shape), torch.finfo(torch.float32).min)
        mask = mask.to(dtype)
    return q, k, v, mask
