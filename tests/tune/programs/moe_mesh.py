"""A mixture-of-experts decoder (the zoo's Mixtral: 4 stacked experts, grouped matmuls) trained on
8 virtual CPU devices, for `tpu-inductor tune --mesh`'s expert_parallel plan: the mesh from
`tpu_inductor.auto_mesh` (else data=8), the model placed by `shard(model, mesh, "auto")`, the
batch over "data"; a compiled forward and backward and a compiled SGD step, every loss and the final
weights checked against eager torch. Arguments: STEPS (default 2)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import copy  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

import tpu_inductor  # noqa: E402
from tests import hf_zoo  # noqa: E402

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 2
model, inputs = hf_zoo.build("mixtral", hf_zoo.Size(batch=8), experts="grouped_mm")
model.train()
reference = copy.deepcopy(model)
mesh = tpu_inductor.auto_mesh({"data": 8})
tpu_inductor.shard(model, mesh, "auto")
optimizer = tpu_inductor.shard_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1))
reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
forward = torch.compile(model, backend="tpu_inductor")
step = torch.compile(optimizer.step, backend="tpu_inductor")
ids = inputs["input_ids"]
for _ in range(steps):
    expected = reference(ids, labels=ids, use_cache=False).loss
    expected.backward()
    reference_optimizer.step()
    reference_optimizer.zero_grad()
    tpu_inductor.mark_sharding(ids, mesh, ("data", None))
    loss = forward(ids, labels=ids, use_cache=False).loss
    loss.backward()
    step()
    optimizer.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
tpu_inductor.sync(model)
for got, want in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
print(f"{steps} steps on mesh {mesh}: equal to eager")
