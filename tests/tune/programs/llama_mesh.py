"""A Llama trained on 8 virtual CPU devices (tpu-inductor tune's acceptance program for --mesh):
the mesh from `tpu_inductor.auto_mesh` (the tuned config's, else data=8), the model placed by
`tpu_inductor.shard(model, mesh, "auto")` (the tuned config's plan, else the weights whole),
the AdamW state split like the parameters, the batch over "data"; a compiled forward and
backward and a compiled optimizer step, every step's loss and the final weights checked against
the same loop in eager torch. Arguments: STEPS (default 3)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import sys  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

from tests.tune.programs.mesh_training import train_against_eager  # noqa: E402

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
torch.manual_seed(0)
config = transformers.LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, vocab_size=256, max_position_embeddings=64,
)  # fmt: skip
model = transformers.LlamaForCausalLM(config)
generator = torch.Generator().manual_seed(0)
batches = [torch.randint(0, 256, (8, 16), generator=generator) for _ in range(steps)]
train_against_eager(
    model,
    lambda parameters: torch.optim.AdamW(parameters, lr=1e-3, foreach=False),
    batches,
    weights_atol=1e-4,
)
