"""CPU flash attention, forward and backward (lowering/ops/sdpa.py), against eager torch.

Each case calls one ATen overload directly, so the traced graph holds exactly that op; the
compile runs with fallback="error", so a missing rule fails instead of running in eager torch.
"""

from __future__ import annotations

import pytest
import torch

from tests.lowering.nn_helpers import BF16, aten, rand, run

# --- attention -------------------------------------------------------------------------------

# name, (B, H, L, S, E), is_causal, mask kind (None, "float", "-inf", "empty_row"), scale;
# H: heads, or (query heads, key/value heads) for grouped-query attention (enable_gqa)
_ATTENTION = [
    ("plain", (2, 3, 16, 16, 8), False, None, None),
    ("grouped_query", (2, (4, 2), 12, 12, 8), True, None, None),
    ("causal", (2, 3, 16, 16, 8), True, None, None),
    ("causal_short_query", (1, 2, 6, 16, 8), True, None, 0.3),
    ("float_mask", (2, 2, 8, 12, 4), False, "float", None),
    ("neg_inf_mask", (2, 2, 8, 12, 4), False, "-inf", 0.5),
    ("fully_masked_row", (2, 2, 8, 12, 4), False, "empty_row", None),
]


def _attention_inputs(shape, mask_kind, dtype=torch.float32):
    b, h, length, keys, e = shape
    h, kv_heads = (h, h) if isinstance(h, int) else h
    q, k, v = (
        rand(b, h, length, e, dtype=dtype),
        rand(b, kv_heads, keys, e, dtype=dtype, seed=1),
        rand(b, kv_heads, keys, e, dtype=dtype, seed=2),
    )
    mask = None
    if mask_kind is not None:
        mask = rand(length, keys, seed=3)
        mask[:, 0] = 1.0  # no fully masked row...
        if mask_kind != "float":  # a boolean mask, as SDPA passes it to this kernel
            mask = torch.zeros_like(mask).masked_fill(mask < 0, float("-inf"))
        if mask_kind == "empty_row":  # ...unless asked for
            mask[2] = float("-inf")
        mask = mask.to(dtype)
    return q, k, v, mask


@pytest.mark.parametrize(
    "name, shape, causal, mask_kind, scale", _ATTENTION, ids=[a[0] for a in _ATTENTION]
)
def test_flash_attention_for_cpu(name, shape, causal, mask_kind, scale):
    q, k, v, mask = _attention_inputs(shape, mask_kind)

    def attention(q, k, v, mask):
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )

    run(attention, (q, k, v, mask), {"rtol": 1e-5, "atol": 2e-5})


@pytest.mark.parametrize(
    "name, shape, causal, mask_kind, scale", _ATTENTION, ids=[a[0] for a in _ATTENTION]
)
def test_flash_attention_for_cpu_backward(name, shape, causal, mask_kind, scale):
    q, k, v, mask = _attention_inputs(shape, mask_kind)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )
    grad = rand(*out.shape, seed=4)

    def backward(grad, q, k, v, out, lse, mask):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )

    run(backward, (grad, q, k, v, out, lse, mask), {"rtol": 1e-4, "atol": 1e-4})


def test_flash_attention_bf16():
    q, k, v, _ = _attention_inputs((2, 2, 16, 16, 8), None, torch.bfloat16)
    run(
        lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True),
        (q, k, v),
        BF16,
    )
