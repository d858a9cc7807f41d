"""Tensor parallel × data parallel training of a Llama built from a config, on 8 virtual CPU
devices (a TPU slice's chips are the same mesh: only the device count changes).

    python examples/tensor_parallel.py

Prints each step's loss and the collectives XLA's SPMD partitioner inserted (`tpu-inductor
explain` on the dump folder shows them per graph).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax

import tempfile

import torch
import transformers

import tpu_inductor
from tpu_inductor.debug import report
from tpu_inductor.sharding import plans as sharding_plans

config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=4, attn_implementation="sdpa",
)  # fmt: skip
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).train()

mesh = tpu_inductor.Mesh({"data": 2, "model": 4})
tpu_inductor.shard(model, mesh, sharding_plans.tensor_parallel("model"))
dump = tempfile.mkdtemp(prefix="tensor_parallel_")
forward = torch.compile(model, backend="tpu_inductor", options={"dump_dir": dump})
optimizer = tpu_inductor.shard_optimizer_state(torch.optim.AdamW(model.parameters(), lr=1e-3))
step = torch.compile(optimizer.step, backend="tpu_inductor")

for i in range(5):
    ids = torch.randint(0, config.vocab_size, (8, 32))
    tpu_inductor.mark_sharding(ids, mesh, ("data", None))  # the batch over the data axis
    loss = forward(input_ids=ids, labels=ids).loss
    loss.backward()
    step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {i}: loss {loss.item():.4f}")

print(report.explain(dump))
