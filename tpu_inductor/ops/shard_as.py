"""`tpu_inductor::shard_as`: a sharding constraint on a value inside compiled code.

    shard_as(x, mesh, spec) -> x's values, to be split over `mesh` by `spec`

`mesh` and `spec` travel as text ("data=2,model=4"; "data,-,model": one entry per dim, "-"
where the dim is whole): the op is a plain torch.library op that Dynamo and AOTAutograd trace into the graph, and
the lowering (lowering/ops/sharding.py) makes it Shardy's `sharding_constraint`. Eagerly it is
a copy. Its gradient is constrained the same way, so the backward graph is split as the
forward is. `tpu_inductor.mark_sharding` calls it inside compiled code.
"""

from __future__ import annotations

import torch

from tpu_inductor.sharding.mesh import Mesh, Spec

_NAME = "tpu_inductor::shard_as"


@torch.library.custom_op(_NAME, mutates_args=())
def _shard_as(x: torch.Tensor, mesh: str, spec: str) -> torch.Tensor:
    return x.clone()


@_shard_as.register_fake
def _shard_as_fake(x, mesh, spec):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    ctx.mesh, ctx.spec = inputs[1], inputs[2]


def _backward(ctx, grad):
    return torch.ops.tpu_inductor.shard_as(grad, ctx.mesh, ctx.spec), None, None


_shard_as.register_autograd(_backward, setup_context=_setup_context)


def shard_as(x: torch.Tensor, mesh: Mesh, spec: Spec) -> torch.Tensor:
    """`x` constrained to be split over `mesh` by `spec` (a partition spec)."""
    return torch.ops.tpu_inductor.shard_as(x, str(mesh), encode_spec(spec))


def encode_spec(spec: Spec) -> str:
    return ",".join("-" if axis is None else axis for axis in spec)


def decode(mesh: str, spec: str) -> tuple[Mesh, Spec]:
    """The op's (mesh, spec) arguments as a Mesh and a partition spec."""
    axes = tuple((name, int(size)) for name, size in (a.split("=") for a in mesh.split(",")))
    return Mesh(axes), tuple(None if axis == "-" else axis for axis in spec.split(",") if axis)


def is_constraint(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.tpu_inductor.shard_as.default
