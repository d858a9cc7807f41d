"""One process of a two-process job on loopback (4 virtual CPU devices each, one 8-device
mesh): `python -m tests.multihost_run PROCESS_ID PORT [--die-after N]`.

Trains an MLP with FSDP over the 8 devices for a few steps (a compiled forward and backward and
a compiled SGD step) and prints, as JSON, each step's loss and the largest difference of the
parameters from the same steps in eager torch (on this process alone). `--die-after N`: the
process exits abruptly after N steps; `--stall-after N`: it stops there, alive (its peer must
fail within the timeout either way). `--dropout-seed S`: instead, a dropout graph after
`torch.manual_seed(S)` (processes whose seeds differ must fail, not draw other numbers).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import torch  # noqa: E402

import tpu_inductor  # noqa: E402
from tpu_inductor.sharding import distributed
from tpu_inductor.sharding import plans as sharding_plans  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("process_id", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("--die-after", type=int)
    parser.add_argument("--stall-after", type=int)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dropout-seed", type=int, help="run a dropout graph after this seed")
    args = parser.parse_args(argv)
    distributed.initialize(f"127.0.0.1:{args.port}", 2, args.process_id, timeout_s=20)
    if args.dropout_seed is not None:
        return _dropout(args.process_id, args.dropout_seed)
    torch.manual_seed(0)  # the same model, batch and seeds in every process
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    reference = copy.deepcopy(model)
    mesh = tpu_inductor.Mesh({"data": 8})
    tpu_inductor.shard(model, mesh, sharding_plans.fsdp("data", min_elements=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    forward = torch.compile(model, backend="tpu_inductor", options={"cache": False})
    step = torch.compile(optimizer.step, backend="tpu_inductor", options={"cache": False})
    x, target = torch.randn(16, 16), torch.randn(16, 8)
    losses = []
    for i in range(args.steps):
        if args.die_after is not None and i == args.die_after:
            print(f"stopped at {time.time()}", flush=True)
            os._exit(9)
        if args.stall_after is not None and i == args.stall_after:
            print(f"stopped at {time.time()}", flush=True)
            time.sleep(600)  # alive, heartbeats sent, never reaching the next step
        tpu_inductor.mark_sharding(x, mesh, ("data", None))
        loss = (forward(x) - target).square().mean()
        loss.backward()
        step()
        optimizer.zero_grad()
        expected = (reference(x) - target).square().mean()
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        losses.append([loss.item(), expected.item()])
    # what this process's devices hold of the model: its half (each of its 4 devices an eighth)
    resident = sum(d["parameters"] for d in tpu_inductor.memory()["devices"].values())
    tpu_inductor.sync(model)  # (placed on the mesh, the model lives there: gathered home)
    diff = max(
        (p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())
    )
    print(
        json.dumps(
            {
                "process": args.process_id,
                "losses": losses,
                "param_diff": diff,
                "resident": resident,
                "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            }
        ),
        flush=True,
    )
    return 0


def _dropout(process_id: int, seed: int) -> int:
    """A random graph over the 8-device mesh after `torch.manual_seed(seed)`: prints which of
    the batch's entries it kept (the same in both processes when their seeds agree)."""
    torch.manual_seed(seed)
    mesh = tpu_inductor.Mesh({"data": 8})
    x = tpu_inductor.mark_sharding(torch.ones(16, 4), mesh, ("data", None))
    dropout = torch.compile(
        lambda x: torch.nn.functional.dropout(x, 0.5),
        backend="tpu_inductor",
        options={"cache": False},
    )
    kept = (dropout(x) != 0).sum().item()
    print(json.dumps({"process": process_id, "kept": kept}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
