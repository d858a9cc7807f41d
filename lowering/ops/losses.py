"""Loss functions: nll_loss (1-d and 2-d) and multilabel_margin_loss, forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from .common import _f32, _results

aten = ops.aten

# --- losses ----------------------------------------------------------------------------------


def _nll(x, target, weight, reduction, ignore_index):
    """(loss, total_weight) of torch's nll_loss; the class axis is 1 (0 for unbatched input)."""
    axis = 1 if x.ndim >= 2 else 0
    keep = target != ignore_index
    safe = jnp.where(keep, target, 0)
    picked = jnp.squeeze(jnp.take_along_axis(x, jnp.expand_dims(safe, axis), axis), axis)
    w = jnp.ones(safe.shape, x.dtype) if weight is None else jnp.take(weight, safe)
    w = jnp.where(keep, w, jnp.zeros((), x.dtype))
    losses = -picked * w
    total = jnp.sum(w)
    if reduction == 0:  # none: torch reports a zero total weight
        return losses, jnp.zeros((), x.dtype)
    loss = jnp.sum(losses)
    return (loss / total if reduction == 1 else loss), total


@register_lowering(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    return _nll(x, target, weight, reduction, ignore_index)


@register_lowering(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    """torch's kernel: -weight * grad (over the total weight for a mean) at each target's
    class; 0 elsewhere and for ignored targets, also when every target is ignored (the vjp
    of the mean was 0/0 = NaN there)."""
    axis = 1 if x.ndim >= 2 else 0
    keep = target != ignore_index
    safe = jnp.where(keep, target, 0)
    w = jnp.ones(safe.shape, x.dtype) if weight is None else jnp.take(weight, safe)
    g = grad.astype(x.dtype)
    if reduction == 1:
        g = g / total_weight.astype(x.dtype)
    value = jnp.where(keep, -w.astype(x.dtype) * g, jnp.zeros((), x.dtype))
    hit = jnp.expand_dims(safe, axis) == lax.broadcasted_iota(safe.dtype, x.shape, axis)
    return jnp.where(hit, jnp.expand_dims(value, axis), jnp.zeros((), x.dtype))


def _multilabel_margin(x, target, reduction):
    """(loss, is_target) of torch's multilabel_margin_loss: a row's target classes are its
    entries before the first -1; each pairs with every non-target class."""
    xf, classes = _f32(x), x.shape[-1]
    valid = jnp.cumsum(target == -1, axis=-1) == 0
    safe = jnp.where(valid, target, 0)
    is_target = jnp.any(valid[..., None] & (safe[..., None] == jnp.arange(classes)), axis=-2)
    picked = jnp.take_along_axis(xf, safe, axis=-1)
    margin = 1 - picked[..., :, None] + xf[..., None, :]  # (..., target j, class i)
    margin = jnp.where(valid[..., :, None] & ~is_target[..., None, :] & (margin > 0), margin, 0)
    losses = jnp.sum(margin, axis=(-2, -1)) / classes
    loss = losses if reduction == 0 else jnp.mean(losses) if reduction == 1 else jnp.sum(losses)
    return loss.astype(x.dtype), is_target.astype(x.dtype)


@register_lowering(aten.multilabel_margin_loss_forward.default, needs_ctx=True)
def multilabel_margin_loss_forward(ctx, x, target, reduction):
    # shaped as torch's meta says: (1,), not the kernel's (), for a 1-d input left unreduced
    return _results(ctx, _multilabel_margin(x, target, reduction))


@register_lowering(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad, x, target, reduction, is_target):
    forward = lambda x_: _multilabel_margin(x_, target, reduction)[0]  # noqa: E731
    loss, vjp = jax.vjp(forward, x)
    return vjp(grad.reshape(loss.shape).astype(loss.dtype))[0]
