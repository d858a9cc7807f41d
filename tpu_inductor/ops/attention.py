"""`tpu_inductor::attention`: the one attention op the fusion passes rewrite attention into.

    attention(q, k, v, mask, scale, causal_diagonal=None, empty_rows_nan=False, window=None)
        -> (out, lse)
    attention_backward(grad, q, k, v, out, lse, mask, scale, causal_diagonal=None, window=None)
        -> (dq, dk, dv)

q is [..., H, L, D]; k and v are [..., Hkv, S, D] and [..., Hkv, S, Dv] with H a multiple of
Hkv (grouped-query attention: query heads h*g .. h*g+g-1 read key/value head h, the repeated
heads are never built). `mask` (None, bool: True keeps a key, or float: added to the scores)
broadcasts to [..., H, L, S]. `causal_diagonal` d keeps key j for query i when j <= i + d
(0: torch's is_causal; S - L: a decode step's queries at the end of the keys); `window` w
(with a diagonal: a sliding window) keeps only the w keys i + d - w < j <= i + d. Scores are
`scale * q·kᵀ` (scale None: 1/sqrt(D)), softmax in float32 (float64 inputs: float64); `lse`
(that dtype, [..., H, L]) is the logsumexp over keys.
A row whose every key is masked out gives 0 and lse 0 (torch's SDPA kernels and
`_safe_softmax`), or NaN with `empty_rows_nan` (a written-out `softmax` over such a row).

The eager CPU kernels below are the reference math; the compiled form is the lowering rule
(lowering/ops/attention.py), which reuses the SDPA rules' computation. Autograd is registered
for q, k and v; a mask that needs a gradient is refused with a clear error.
"""

from __future__ import annotations

import math

import torch

from tpu_inductor.exc import UnsupportedOpError

_NAME = "tpu_inductor::attention"


def _acc(t: torch.Tensor) -> torch.Tensor:
    """`t` in the dtype attention accumulates in: float32 for 16-bit floats."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _keys_for(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t`'s heads repeated to q's head count, in the accumulation dtype."""
    groups = q.shape[-3] // t.shape[-3]
    return _acc(t.repeat_interleave(groups, dim=-3) if groups > 1 else t)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1 / math.sqrt(q.shape[-1]) if scale is None else scale


def _scores(q, k, mask, scale, causal_diagonal, window=None):
    scores = torch.matmul(_acc(q), _keys_for(q, k).transpose(-1, -2)) * _scale(q, scale)
    if causal_diagonal is not None:
        length, count = scores.shape[-2:]
        ones = torch.ones(length, count, dtype=torch.bool, device=q.device)
        keep = ones.tril(causal_diagonal)
        if window is not None:
            keep &= ~ones.tril(causal_diagonal - window)
        scores = scores.masked_fill(~keep, -torch.inf)
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask
        )
    return scores


@torch.library.custom_op(_NAME, mutates_args=())
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    causal_diagonal: int | None = None,
    empty_rows_nan: bool = False,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _scores(q, k, mask, scale, causal_diagonal, window)
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    lse = lse.masked_fill(empty, 0.0)
    out = torch.matmul(torch.exp(scores - lse[..., None]), _keys_for(q, v))
    out = out.masked_fill(empty[..., None], torch.nan if empty_rows_nan else 0.0)
    return out.to(q.dtype), lse


@attention.register_fake
def _attention_fake(q, k, v, mask, scale, causal_diagonal=None, empty_rows_nan=False, window=None):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(q.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32))


@torch.library.custom_op(_NAME + "_backward", mutates_args=())
def attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    causal_diagonal: int | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weights = torch.exp(_scores(q, k, mask, scale, causal_diagonal, window) - lse[..., None])
    g = _acc(grad)
    d_weights = torch.matmul(g, _keys_for(q, v).transpose(-1, -2))
    d_scores = weights * (d_weights - (g * _acc(out)).sum(-1, keepdim=True)) * _scale(q, scale)
    dq = torch.matmul(d_scores, _keys_for(q, k))
    dk = torch.matmul(d_scores.transpose(-1, -2), _acc(q))
    dv = torch.matmul(weights.transpose(-1, -2), g)
    return dq.to(q.dtype), _sum_groups(dk, k).to(k.dtype), _sum_groups(dv, v).to(v.dtype)


@attention_backward.register_fake
def _attention_backward_fake(
    grad, q, k, v, out, lse, mask, scale, causal_diagonal=None, window=None
):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous


def _sum_groups(grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The gradient of `t`'s repeated heads for `t`: each head's copies summed."""
    heads = t.shape[-3]
    if grad.shape[-3] == heads:
        return grad
    return grad.unflatten(-3, (heads, grad.shape[-3] // heads)).sum(-3)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, scale, causal_diagonal, _, window = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], mask)
    ctx.scale, ctx.causal_diagonal, ctx.window = scale, causal_diagonal, window


def _backward(ctx, grad_out, _grad_lse):
    if ctx.needs_input_grad[3]:
        raise UnsupportedOpError(
            f"{_NAME}: the mask needs a gradient, which this op does not compute; leave a "
            "learned attention bias out of the fusion (options={'fusion': {'attention': False}})."
        )
    q, k, v, out, lse, mask = ctx.saved_tensors
    grads = attention_backward(
        grad_out, q, k, v, out, lse, mask, ctx.scale, ctx.causal_diagonal, ctx.window
    )
    return (*grads, None, None, None, None, None)


attention.register_autograd(_backward, setup_context=_setup_context)

ops = torch.ops.tpu_inductor
