"""Lowering of `tpu_inductor::shard_as` (tpu_inductor/ops/shard_as.py): Shardy's sharding
constraint over the abstract mesh the op names (the module's arguments are annotated over the
same mesh by the lowering's `Shardings`); the partitioner moves data to match."""

from __future__ import annotations

import jax
import torch
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from tpu_inductor.ops.shard_as import decode

from ..registry import register_lowering


@register_lowering(torch.ops.tpu_inductor.shard_as.default)
def shard_as(x, mesh, spec):
    mesh, spec = decode(mesh, spec)
    abstract = AbstractMesh(tuple(n for _, n in mesh.axes), mesh.names)
    return jax.lax.with_sharding_constraint(x, NamedSharding(abstract, PartitionSpec(*spec)))
