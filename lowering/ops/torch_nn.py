"""PyTorch's own custom ops outside aten (the `torch_nn` namespace): the chunked linear +
cross-entropy loss behind `F.linear_cross_entropy`.

The chunked ops compute `cross_entropy(input @ weight^T + bias, target)` a batch chunk at a
time so the logits are never whole; XLA needs no chunking to keep them out of memory on its
own terms, so the rule computes the loss in one go, accumulating in the op's `acc_dtype`. The
scalar-reduction op can also return gradients precomputed in its forward (when the graph was
traced with inputs that require grad): those are not lowered, the rule declines such a node
and it runs in eager torch, reported. Registered by name: the ops are defined when
torch.nn.functional is imported.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..registry import register_lowering
from .linalg import matmul

_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _loss(x, linear_weight, target, bias, weight, reduction, ignore_index, smoothing, acc):
    """torch's cross_entropy of the logits, class probabilities by index, with label smoothing
    spread over the classes (weighted by `weight`) and `ignore_index` rows left out."""
    from .losses import _nll

    logits = matmul(x.astype(acc), linear_weight.astype(acc).T)
    if bias is not None:
        logits = logits + bias.astype(acc)
    logp = jax.nn.log_softmax(logits, axis=-1)
    w = None if weight is None else weight.astype(acc)
    code = _REDUCTIONS[reduction]
    nll, total = _nll(logp, target, w, code, ignore_index)
    if not smoothing:
        return nll
    keep = target != ignore_index
    per_class = logp if w is None else logp * w
    smooth = jnp.where(keep, -jnp.sum(per_class, axis=-1), 0)
    if code == 1:
        smooth = jnp.sum(smooth) / (total if w is not None else jnp.sum(keep))
    elif code == 2:
        smooth = jnp.sum(smooth)
    return (1 - smoothing) * nll + smoothing / logp.shape[-1] * smooth


def _no_precomputed_grads(node) -> bool:
    """compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad all False."""
    return not any(node.args[12:15])


@register_lowering(
    "torch_nn._linear_cross_entropy_batch_chunked.default",
    needs_ctx=True,
    supports=_no_precomputed_grads,
)
def linear_cross_entropy_chunked(
    ctx, x, linear_weight, target, bias, weight, reduction, ignore_index, smoothing, *_
):
    """The mean or sum loss; the three gradient slots are the empty (0, 0) tensors torch
    returns when they are not precomputed."""
    acc = ctx.jax_dtype(ctx.node.args[10])
    loss = _loss(x, linear_weight, target, bias, weight, reduction, ignore_index, smoothing, acc)
    empty = [jnp.zeros(v.shape, ctx.jax_dtype(v.dtype)) for v in ctx.out[1:]]
    return (loss.astype(ctx.out_dtype), *empty)


@register_lowering(
    "torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default", needs_ctx=True
)
def linear_cross_entropy_chunked_none(
    ctx, x, linear_weight, target, bias, weight, ignore_index, chunk, policy, acc
):
    """Per-sample losses (reduction "none", no smoothing)."""
    acc = ctx.jax_dtype(acc)
    loss = _loss(x, linear_weight, target, bias, weight, "none", ignore_index, 0.0, acc)
    return loss.astype(ctx.out_dtype)
