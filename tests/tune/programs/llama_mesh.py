"""A Llama trained on 8 virtual CPU devices (tpu-inductor tune's acceptance program for --mesh):
the mesh from `tpu_inductor.auto_mesh` (the tuned config's, else data=8), the model placed by
`tpu_inductor.shard(model, mesh, "auto")` (the tuned config's plan, else the weights whole),
the AdamW state split like the parameters, the batch over "data"; a compiled forward and
backward and a compiled optimizer step, every step's loss and the final weights checked against
the same loop in eager torch. Arguments: STEPS (default 3)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import copy  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

import tpu_inductor  # noqa: E402

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
torch.manual_seed(0)
config = transformers.LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, vocab_size=256, max_position_embeddings=64,
)  # fmt: skip
model = transformers.LlamaForCausalLM(config)
reference = copy.deepcopy(model)
mesh = tpu_inductor.auto_mesh({"data": 8})
tpu_inductor.shard(model, mesh, "auto")
optimizer = tpu_inductor.shard_optimizer_state(
    torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
)
reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
forward = torch.compile(model, backend="tpu_inductor")
step = torch.compile(optimizer.step, backend="tpu_inductor")
generator = torch.Generator().manual_seed(0)
for _ in range(steps):
    ids = torch.randint(0, 256, (8, 16), generator=generator)
    expected = reference(ids, labels=ids).loss
    expected.backward()
    reference_optimizer.step()
    reference_optimizer.zero_grad()
    tpu_inductor.mark_sharding(ids, mesh, ("data", None))
    loss = forward(ids, labels=ids).loss
    loss.backward()
    step()
    optimizer.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
tpu_inductor.sync(model)
for got, want in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
print(f"{steps} steps on mesh {mesh}: equal to eager")
