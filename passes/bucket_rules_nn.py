"""Padding rules of the neural-network ops: layer norm and its backward, softmax's backward,
embedding's backward, nll_loss and CPU flash attention (masking the padded keys).
"""

from __future__ import annotations

import math

import sympy
import torch

from .bucket_proof import Refused, size_expr

aten = torch.ops.aten


def _layer_norm_layouts(b, node, x, normalized):
    layout = b.layout(x)
    k = len(normalized)
    if any(b._padded(f) for f in layout[len(layout) - k :]):
        raise Refused(f"{node.name}: layer norm over a padded dim")
    return layout, k


def _layer_norm(b, node):
    layout, k = _layer_norm_layouts(b, node, node.args[0], node.args[1])
    stats = layout[: len(layout) - k] + ((sympy.Integer(1),),) * k
    return [layout, stats, stats]


def _layer_norm_backward(b, node):
    layout, k = _layer_norm_layouts(b, node, node.args[1], node.args[2])
    leading = list(range(len(layout) - k))
    for index in (0, 1, 3, 4):  # grad, x, mean, rstd: the weight and bias grads sum over rows
        b.replace_input(node, index, b.mask(node, node.args[index], leading, 0))
    params = tuple((size_expr(d),) for d in node.args[1].meta["val"].shape[len(layout) - k :])
    return [layout, params, params]


def _softmax_backward(b, node):
    grad, out, dim = node.args[:3]
    dim %= len(b.layout(grad))
    b.replace_input(node, 0, b.mask(node, grad, [dim], 0))
    b.replace_input(node, 1, b.mask(node, out, [dim], 0))
    return b.layout(grad)


def _embedding_backward(b, node):
    grad, indices = node.args[:2]
    b.replace_input(node, 0, b.mask(node, grad, list(range(len(b.layout(indices)))), 0))
    return tuple((size_expr(d),) for d in node.meta["val"].shape)


def _nll_forward(b, node):
    x, target, _, reduction, ignore_index = node.args[:5]
    b.replace_input(node, 0, b.mask(node, x, [0], 0))
    b.replace_input(node, 1, b.mask(node, target, [0], ignore_index))
    return [b.layout(target) if reduction == 0 else (), ()]


def _nll_backward(b, node):
    b.replace_input(node, 2, b.mask(node, node.args[2], [0], node.args[5]))
    return b.layout(node.args[1])


def attention(b, node):
    """Attention, forward and backward: padded keys get a -inf bias (causal attention over one
    padded length needs none: real queries never see them); every padded operand, and the
    padding of a given mask, is made neutral, so that 0 · NaN never reaches a real position."""
    backward = node.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    q, k, v = node.args[1:4] if backward else node.args[:3]
    causal = node.args[7 if backward else 4] if len(node.args) > (7 if backward else 4) else False
    lq, lk, lv = b.layout(q), b.layout(k), b.layout(v)
    if node.args[6 if backward else 3] if len(node.args) > (6 if backward else 3) else 0:
        raise Refused(f"{node.name}: attention with dropout over padded dims")
    given = node.kwargs.get("attn_mask")
    if isinstance(given, torch.fx.Node) and b._has_padding(given):
        # its padding may hold anything (+inf from a padded input): neutral there, so that a
        # padded row's weights stay finite and 0 · their gradient stays 0
        neutral = True if given.meta["val"].dtype == torch.bool else 0.0
        dims = list(range(len(b.layout(given))))
        node.kwargs = {**node.kwargs, "attn_mask": b.mask(node, given, dims, neutral)}
    if b._padded(lk[2]) and not (causal and lq[2] == lk[2]):
        if causal:
            raise Refused(f"{node.name}: attention over padded keys, causal across lengths")
        _mask_keys(b, node, k, lk)  # forward and backward alike: the weights of padded keys are 0
    for index, a in enumerate(node.args[: 6 if backward else 3]):
        if isinstance(a, torch.fx.Node):
            b.replace_input(node, index, b.mask(node, a, list(range(len(b.layout(a)))), 0))
    if backward:
        return [lq, lk, lv]
    return [(*lq[:3], lv[3]), lq[:3]]


def _mask_keys(b, node, k, lk):
    """Non-causal attention over padded keys: a -inf bias on them, added to the node's mask."""
    valid = b.valid_positions(node, lk[2], device=k.meta["val"].device)
    valid = b.insert(node, aten.view.default, (valid, [1, 1, 1, -1]))
    given = node.kwargs.get("attn_mask")
    if given is not None and given.meta["val"].dtype == torch.bool:
        mask = b.insert(node, aten.logical_and.default, (given, valid))
    else:
        mask = b.insert(node, aten.where.Scalar, (valid, 0.0, -math.inf))
        if given is not None:
            mask = b.insert(node, aten.add.Tensor, (given, mask))
    node.kwargs = {**node.kwargs, "attn_mask": mask}
    b.ctx.rewrites["key_masks"] += 1


RULES = {
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _softmax_backward,
    aten.embedding_dense_backward.default: _embedding_backward,
    aten.nll_loss_forward.default: _nll_forward,
    aten.nll_loss_backward.default: _nll_backward,
    aten._scaled_dot_product_flash_attention_for_cpu.default: attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: attention,
}
