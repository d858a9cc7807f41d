"""TorchTitan's own Llama 3, Qwen 3 and DeepSeek-V3 model code (FlexAttention, a causal +
packed-document block mask; DeepSeek-V3's MoE) compiled whole by tpu_inductor, one training
step against eager torch.

torchtitan is not a dependency of the project (its package pulls datasets, tensorboard and
wandb); its model code imports with a few packages installed apart (Triton, about 1 GB, only
imported by its MoE token dispatcher; nothing of it runs here):

    pip install --no-deps --target /tmp/tt torchtitan==0.3.0 spmd_types==0.2.3 \\
        torch_checkpointing tyro einops docstring_parser triton
    .venv/bin/python tools/check_torchtitan.py --path /tmp/tt [--layers 2] [--models llama3,qwen3,deepseek_v3]

Per model: the debug config cut to `--layers` layers, random weights (seeded), batch 2 × 256
tokens of two packed documents; the compiled forward and backward (`fallback="error"`,
`fullgraph=True`) against eager torch (`set_stance("force_eager")`: TorchTitan wraps
flex_attention in its own torch.compile, whose Inductor CPU kernel has no backward). Prints the
loss both ways, the output's and the worst parameter gradient's relative difference, and the
PJRT compiles. DeepSeek-V3's experts compute in bfloat16 (TorchTitan casts to it for
`torch._grouped_mm`), so their gradients agree to bfloat16's rounding, not float32's; its token
dispatcher's custom op is lowered here as a user would (`_lower_titan_ops`).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import sys


def _lower_titan_ops() -> None:
    """TorchTitan's own custom op of its MoE token dispatcher, lowered as a user would
    (README: 'Lowering a custom op'): `out.scatter_add(0, index, src)`, which XLA's scatter
    computes deterministically (16-bit values added in float32)."""
    import jax.numpy as jnp

    import tpu_inductor

    @tpu_inductor.register_lowering("torchtitan::deterministic_scatter_add")
    def _scatter_add(out, index, src):
        where = list(jnp.indices(index.shape, sparse=True))
        where[0] = index
        wide = jnp.promote_types(out.dtype, jnp.float32)
        added = out.astype(wide).at[tuple(where)].add(src.astype(wide))
        return added.astype(out.dtype)


def check(name: str, layers: int) -> dict:
    import torch

    import tpu_inductor

    tpu_inductor.enable_flex_attention_training()
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
    gaps = {
        n: ((p.grad - q.grad).norm() / q.grad.norm()).item()
        for (n, p), q in zip(model.named_parameters(), reference.parameters())
    }
    worst = max(gaps, key=gaps.get)
    return {
        "model": name,
        "layers": layers,
        "loss": loss,
        "eager_loss": expected_loss,
        "output_relative": ((found - expected).norm() / expected.norm()).item(),
        "worst_gradient_relative": gaps[worst],
        "worst_gradient": worst,
        "pjrt_compiles": tpu_inductor.compiles() - before,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default="/tmp/tt", help="where torchtitan was installed")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--models", default="llama3,qwen3,deepseek_v3")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.path)
    _lower_titan_ops()
    for name in args.models.split(","):
        print(json.dumps(check(name, args.layers)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
