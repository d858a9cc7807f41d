"""`tpu_inductor::expert_mm` and its backward: a grouped matmul run expert-parallel.

    expert_mm(x, weight, offs, mesh, axis) -> out             [S, k] x [E, k, n] -> [S, n]
    expert_mm_backward(x, weight, offs, grad, mesh, axis) -> (grad_x, grad_weight)

The rows of `x` are sorted by expert and end at `offs` (cumulative, one per expert), as for
`torch._grouped_mm`'s 2-d x 3-d form; `weight`'s expert dim is split over mesh axis `axis`.
The sharding pass (passes/annotate_sharding.py) puts these ops in place of a grouped matmul
whose expert weights a plan split that way; the lowering (lowering/ops/moe.py) sends each row
to the devices holding its expert (all-to-all), multiplies there and sends the results back.
`mesh` travels as text ("data=2,expert=4", as `shard_as`'s). Eagerly (and as the one-device
reference) they are the grouped matmul itself; rows past the last offset give zeros.
"""

from __future__ import annotations

import torch


def _groups(offs: torch.Tensor, rows: int) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) per non-empty group, sizes as the lowering takes them."""
    ends = offs.clamp(0, rows).tolist()
    groups, start = [], 0
    for expert, end in enumerate(ends):
        if end > start:
            groups.append((expert, start, end))
        start = max(start, end)
    return groups


@torch.library.custom_op("tpu_inductor::expert_mm", mutates_args=())
def _expert_mm(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, mesh: str, axis: str
) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], weight.shape[2])
    for expert, start, end in _groups(offs, x.shape[0]):
        out[start:end] = x[start:end] @ weight[expert]
    return out


@_expert_mm.register_fake
def _expert_mm_fake(x, weight, offs, mesh, axis):
    return x.new_empty(x.shape[0], weight.shape[2])


@torch.library.custom_op("tpu_inductor::expert_mm_backward", mutates_args=())
def _expert_mm_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    grad: torch.Tensor,
    mesh: str,
    axis: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_weight = torch.zeros_like(x), torch.zeros_like(weight)
    for expert, start, end in _groups(offs, x.shape[0]):
        grad_x[start:end] = grad[start:end] @ weight[expert].T
        grad_weight[expert] = x[start:end].T @ grad[start:end]
    return grad_x, grad_weight


@_expert_mm_backward.register_fake
def _expert_mm_backward_fake(x, weight, offs, grad, mesh, axis):
    return torch.empty_like(x), torch.empty_like(weight)
