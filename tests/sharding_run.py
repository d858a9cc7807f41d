"""Sharded training under torch.compile, run in a process of its own (the device count is fixed
when jax starts): `python -m tests.sharding_run MODEL PLAN... --steps N --dump DIR`.

Sets XLA_FLAGS for 8 virtual CPU devices before jax loads, trains the zoo model MODEL (a
compiled forward and backward, a compiled AdamW step) on one device and then under each PLAN,
and prints one JSON line per plan: an inference call's logits against the one-device
run's, each step's loss, the largest relative difference of the losses, the first step's
gradients and the parameters from the one-device run (and, as the yardstick, of the
one-device run's parameters from eager PyTorch's), the PJRT compiles and Dynamo graphs traced
after the first step, the compile records' communication reports from the dump folder, and
the grouped matmuls made expert-parallel in the first graph of each kind.

Plans: dp (batch over data=8), fsdp (parameters and batch over data=8), tp (tensor parallel
over model=8), tp_dp (tensor parallel over model=4, batch over data=2), ep (the zoo MoE's 4 stacked
experts over expert=4, batch over data=2).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import torch  # noqa: E402

import tpu_inductor  # noqa: E402
from tpu_inductor.debug import report
from tpu_inductor.sharding import plans as sharding_plans  # noqa: E402

from . import hf_zoo  # noqa: E402

SIZE = hf_zoo.Size(batch=8)


def _plans():
    mesh = tpu_inductor.Mesh
    return {
        "dp": (mesh({"data": 8}), {}, ("data", None)),
        "fsdp": (mesh({"data": 8}), sharding_plans.fsdp("data"), ("data", None)),
        "tp": (mesh({"model": 8}), sharding_plans.tensor_parallel("model"), ()),
        "tp_dp": (
            mesh({"data": 2, "model": 4}),
            sharding_plans.tensor_parallel("model"),
            ("data", None),
        ),
        "ep": (
            mesh({"data": 2, "expert": 4}),
            sharding_plans.expert_parallel("expert"),
            ("data", None),
        ),
    }


@dataclasses.dataclass
class Run:
    logits: torch.Tensor  # of an inference call first
    losses: list[float]
    model: torch.nn.Module  # after the AdamW steps
    gradients: list[torch.Tensor]  # of the first step
    new: tuple[int, int]  # (PJRT compiles, Dynamo graphs traced) after the first step


def train(model, inputs, steps: int, placed=None, options=None, compiled=True) -> Run:
    """`steps` AdamW steps of `model`, compiled (forward, backward and the step) or eager."""
    torch._dynamo.reset()
    inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if placed is not None:
        mesh, plan, input_spec = placed
        tpu_inductor.shard(model, mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    if placed is not None:
        tpu_inductor.shard_optimizer_state(optimizer)
    forward, step = model, optimizer.step
    if compiled:
        forward = torch.compile(model, backend="tpu_inductor", options=options)
        step = torch.compile(optimizer.step, backend="tpu_inductor", options=options)
    losses, gradients, compiles_after_first, traced_after_first = [], [], 0, 0
    traced = torch._dynamo.utils.counters["stats"]
    for i in range(-1, steps):
        if placed is not None and input_spec:
            tpu_inductor.mark_sharding(inputs["input_ids"], mesh, input_spec)
        if i < 0:
            with torch.no_grad():
                logits = forward(**inputs).logits
            continue
        loss = forward(**inputs, labels=inputs["input_ids"]).loss
        loss.backward()
        if i == 0:  # (state on a mesh lives on its devices: brought home to read)
            tpu_inductor.sync(model)
            gradients = [p.grad.clone() for p in model.parameters()]
        step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if i == 0:
            compiles_after_first = tpu_inductor.compiles()
            traced_after_first = traced["unique_graphs"]
    new = (
        tpu_inductor.compiles() - compiles_after_first,
        traced["unique_graphs"] - traced_after_first,
    )
    tpu_inductor.sync(model)
    return Run(logits, losses, model, gradients, new)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _largest(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest `_relative` difference of paired tensors."""
    return max(_relative(x.detach(), y.detach()) for x, y in zip(a, b))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("plans", nargs="+")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dump", required=True)
    parser.add_argument("--experts", default="batched_mm", help="an MoE model's implementation")
    args = parser.parse_args(argv)
    model, inputs = hf_zoo.build(args.model, SIZE, experts=args.experts)
    model.train()
    one = train(copy.deepcopy(model), inputs, args.steps)
    # What compiling alone moves the parameters from eager's (Adam's first steps divide each
    # gradient by its own magnitude: reduction-order differences in near-zero gradients move
    # those weights by up to twice the learning rate, however small the differences are).
    eager = train(copy.deepcopy(model), inputs, args.steps, compiled=False)
    for name in args.plans:
        dump = Path(args.dump) / name
        options = {"dump_dir": str(dump)}
        run = train(copy.deepcopy(model), inputs, args.steps, _plans()[name], options)
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(run.losses, one.losses))
        graphs, expert = {}, {}
        for c in report.load_run(dump):
            if c.get("communication"):
                graphs[c["graph"]] = c["communication"]
            rewrites = c.get("pass_rewrites", {}).get("annotate_sharding", {})
            expert.setdefault(c["graph"].rsplit("_", 1)[0], rewrites.get("expert_parallel", 0))
        print(
            json.dumps(
                {
                    "plan": name,
                    "logits_rel_diff": _relative(run.logits, one.logits),
                    "losses": run.losses,
                    "loss_rel_diff": loss_diff,
                    "grad_rel_diff": _largest(run.gradients, one.gradients),
                    "param_rel_diff": _largest(
                        list(run.model.parameters()), list(one.model.parameters())
                    ),
                    "compiled_param_rel_diff": _largest(
                        list(one.model.parameters()), list(eager.model.parameters())
                    ),
                    "compiles_after_first_step": run.new[0],
                    "graphs_traced_after_first_step": run.new[1],
                    "communication": graphs,
                    "expert_parallel": expert,  # first graph of each kind: matmuls rewritten
                    "parameter_bytes": sum(p.numel() * 4 for p in model.parameters()),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
