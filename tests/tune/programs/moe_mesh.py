"""A mixture-of-experts decoder (the zoo's Mixtral: 4 stacked experts, grouped matmuls) trained on
8 virtual CPU devices, for `tpu-inductor tune --mesh`'s expert_parallel plan: the mesh from
`tpu_inductor.auto_mesh` (else data=8), the model placed by `shard(model, mesh, "auto")`, the
batch over "data"; a compiled forward and backward and a compiled SGD step, every loss and the final
weights checked against eager torch. Arguments: STEPS (default 2)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import sys  # noqa: E402

import torch  # noqa: E402

from tests import hf_zoo  # noqa: E402
from tests.tune.programs.mesh_training import train_against_eager  # noqa: E402

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 2
model, inputs = hf_zoo.build("mixtral", hf_zoo.Size(batch=8), experts="grouped_mm")
model.train()
train_against_eager(
    model,
    lambda parameters: torch.optim.SGD(parameters, lr=0.1),
    [inputs["input_ids"]] * steps,
    weights_atol=1e-5,
    use_cache=False,
)
