"""A training step of the zoo Llama on 1, 2, 4 and 8 virtual CPU devices: step time (median of
several), per-device memory (arguments and temporaries of the forward, backward and
AdamW-step executables; the optimizer's state split like the parameters) and bytes communicated per step (the collectives of both), under FSDP over a
`data` axis with the batch split over it.

    .venv/bin/python tools/bench_sharding.py [--steps 8] [--size large|tiny]

Virtual CPU devices share this machine's cores: the time shows what the partitioning costs
here, not the speed-up of real chips; the memory and communication columns are what a TPU
would see.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tpu_inductor  # noqa: E402
from tests import hf_zoo  # noqa: E402
from tpu_inductor.debug import report
from tpu_inductor.sharding import plans as sharding_plans  # noqa: E402


def _step_figures(devices: int, size: hf_zoo.Size, steps: int) -> dict:
    torch._dynamo.reset()
    model, inputs = hf_zoo.build("llama", size)
    model.train()
    mesh = tpu_inductor.Mesh({"data": devices})  # one device: a mesh of one, for its report
    tpu_inductor.shard(model, mesh, sharding_plans.fsdp("data"))
    dump = tempfile.mkdtemp(prefix=f"bench_sharding_{devices}_")
    options = {"dump_dir": dump}
    forward = torch.compile(model, backend="tpu_inductor", options=options)
    optimizer = tpu_inductor.shard_optimizer_state(
        torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    )
    step = torch.compile(optimizer.step, backend="tpu_inductor", options=options)
    ids = inputs["input_ids"]
    times = []
    for _ in range(steps + 2):
        tpu_inductor.mark_sharding(ids, mesh, ("data", None))
        start = time.perf_counter()
        forward(input_ids=ids, labels=ids).loss.backward()
        step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    memory, communicated = 0, 0
    for c in report.load_run(dump):
        comm = c.get("communication")
        if comm and c["graph"].split("_")[0] in ("forward", "backward", "inference"):
            memory += (
                comm["per_device_bytes"]["arguments"] + comm["per_device_bytes"]["temporaries"]
            )
            communicated += sum(e["bytes"] for e in comm["collectives"].values())
    return {
        "devices": devices,
        "step_ms": 1000 * statistics.median(times[2:]),
        "per_device_bytes": memory,
        "communicated_bytes": communicated,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", choices=("tiny", "large"), default="large")
    args = parser.parse_args()
    size = hf_zoo.Size(hidden=128, layers=4, heads=8, seq=64, batch=8)
    if args.size == "tiny":
        size = hf_zoo.Size(batch=8)
    load = os.getloadavg()[0]
    print(f"zoo Llama {size}, FSDP + batch over data; load {load:.2f} on {os.cpu_count()} cores")
    print("devices  step ms  per-device bytes (fw+bw+step args+temps)  communicated bytes / step")
    for devices in (1, 2, 4, 8):
        row = _step_figures(devices, size, args.steps)
        print(
            f"{row['devices']:>7}  {row['step_ms']:7.1f}  {row['per_device_bytes']:>40,}  "
            f"{row['communicated_bytes']:>25,}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
