"""`tpu_inductor::norm`: the one op the norm fusion (passes/fuse_norms.py) rewrites a written-out
RMSNorm or LayerNorm into.

    norm(x, weight, bias, eps, centered, divide, normed_dtype) -> (out, mean, scale)

Over the last dim of x, in float32 for 16-bit floats (float64 inputs: float64):

    mean  = mean(x) if centered else 0            LayerNorm subtracts it, RMSNorm does not
    var   = mean((x - mean)²)
    scale = sqrt(var + eps) if divide else rsqrt(var + eps)
    h     = (x - mean) / scale  or  (x - mean) * scale,  then h.to(normed_dtype)
    out   = h * weight + bias                     (each if given; torch's type promotion)

`mean` and `scale` ([..., 1], the accumulation dtype) are what an AOTAutograd forward saves for
its backward (the pass hands them to the backward graph in place of the nodes that computed
them). `divide` keeps a `/ sqrt` norm's own arithmetic, so the op is what the graph computed.
`normed_dtype` is the dtype of h as the graph had it before the weight: Hugging Face's
`.to(input_dtype)`, or the input's own for a norm written without casts. `eps` is a 0-d tensor:
at symbolic sizes Dynamo passes a module's float attribute in as a graph input.

The eager CPU kernel below is the reference math; the compiled form is the lowering rule
(lowering/ops/norm.py). No autograd: the op appears only in AOTAutograd's graphs, after the
backward was derived from the unfused forward.
"""

from __future__ import annotations

import torch

_NAME = "tpu_inductor::norm"


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@torch.library.custom_op(_NAME, mutates_args=())
def norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: torch.Tensor,
    centered: bool,
    divide: bool,
    normed_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xa = x.to(_acc(x.dtype))
    mean = xa.mean(-1, keepdim=True) if centered else xa.new_zeros((*x.shape[:-1], 1))
    centered_x = xa - mean if centered else xa
    var = (centered_x * centered_x).mean(-1, keepdim=True) + eps.to(xa.dtype)
    scale = torch.sqrt(var) if divide else torch.rsqrt(var)
    h = (centered_x / scale if divide else centered_x * scale).to(normed_dtype)
    out = h if weight is None else h * weight
    return (out if bias is None else out + bias), mean, scale


@norm.register_fake
def _norm_fake(x, weight, bias, eps, centered, divide, normed_dtype):
    dtype = normed_dtype
    for t in (weight, bias):
        dtype = dtype if t is None else torch.promote_types(dtype, t.dtype)
    stats = (*x.shape[:-1], 1)
    acc = _acc(x.dtype)
    return (
        x.new_empty(x.shape, dtype=dtype),
        x.new_empty(stats, dtype=acc),
        x.new_empty(stats, dtype=acc),
    )


ops = torch.ops.tpu_inductor
