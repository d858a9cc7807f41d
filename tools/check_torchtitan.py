"""TorchTitan's own Llama 3 and Qwen 3 model code (FlexAttention, a causal + packed-document
block mask) compiled whole by tpu_inductor, one training step against eager torch.

torchtitan is not a dependency of the project (its package pulls datasets, tensorboard and
wandb); its model code imports with a few packages installed apart (Triton, about 1 GB, only
imported by its MoE token dispatcher; nothing of it runs here):

    pip install --no-deps --target /tmp/tt torchtitan==0.3.0 spmd_types==0.2.3 \\
        torch_checkpointing tyro einops docstring_parser triton
    .venv/bin/python tools/check_torchtitan.py --path /tmp/tt [--layers 2] [--models llama3,qwen3]

Per model: the debug config cut to `--layers` layers, random weights (seeded), batch 2 × 256
tokens of two packed documents; the compiled forward and backward (`fallback="error"`,
`fullgraph=True`) against eager torch (`set_stance("force_eager")`: TorchTitan wraps
flex_attention in its own torch.compile, whose Inductor CPU kernel has no backward). Prints the
loss both ways, the output's and the worst parameter gradient's relative difference, and the
PJRT compiles.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import sys


def check(name: str, layers: int) -> dict:
    import torch

    import tpu_inductor
    from tpu_inductor.ops.flex_attention import enable_flex_attention_training

    enable_flex_attention_training()
    config = importlib.import_module(f"torchtitan.models.{name}").model_registry("debugmodel").model
    config.layers = config.layers[:layers]
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    positions = torch.cat([torch.arange(100), torch.arange(156)]).unsqueeze(0).repeat(2, 1)
    with torch.compiler.set_stance("force_eager"):
        masks = model.get_attention_masks(positions)
    tokens = torch.randint(0, 2048, (2, 256), generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)

    def step(forward):
        out = forward(tokens, positions, masks)
        loss = out.float().square().mean()
        loss.backward()
        return out.detach(), loss.item()

    before = tpu_inductor.compiles()
    with torch.compiler.set_stance("force_eager"):
        expected, expected_loss = step(reference)
    options = {"fallback": "error"}
    compiled = torch.compile(model, backend="tpu_inductor", options=options, fullgraph=True)
    found, loss = step(compiled)
    pairs = zip(model.parameters(), reference.parameters())
    return {
        "model": name,
        "layers": layers,
        "loss": loss,
        "eager_loss": expected_loss,
        "output_relative": ((found - expected).norm() / expected.norm()).item(),
        "worst_gradient_relative": max(
            ((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in pairs
        ),
        "pjrt_compiles": tpu_inductor.compiles() - before,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default="/tmp/tt", help="where torchtitan was installed")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--models", default="llama3,qwen3")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.path)
    for name in args.models.split(","):
        print(json.dumps(check(name, args.layers)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
