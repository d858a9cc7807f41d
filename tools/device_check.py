"""The one prepared check for a lent accelerator: a training step of the zoo's GPT-2 on the PJRT
device, against eager torch — correctness, the transfer ledger and the step time.

    .venv/bin/python tools/device_check.py [--device auto] [--model auto] [--steps 5] [--runs 7]
        [--host-sync explicit] [--out F]

`--model`: "gpt2" (tests/hf_zoo.py's GPT-2 at its LARGE size: needs transformers) or
"quickstart" (examples/quickstart.py's pure-torch GPT, batch 8 × 128); "auto" takes GPT-2 where
transformers is installed.

`--device auto` takes the best PJRT platform present (a GPU's or TPU's; here "cpu-copy", the
CPU device that copies every crossing as an accelerator does). Each step: the compiled forward
(`backend="tpu_inductor"`), `loss.backward()`, a compiled AdamW step. Checked against eager
torch on the CPU: every step's loss (relative difference reported, and passed under
`--rtol`). The steady-state ledger (`tpu_inductor.transfers()` of the last step) says what
crossed by kind: parameters, optimizer state and saved activations must be 0 bytes sent, and
under `--host-sync explicit` (the default) nothing but the loss, the outputs and one-element
counters may come back (`state_fetched_bytes`: gradients and written state, 0). Timed,
interleaved, median of `--runs`: ours, eager on the CPU, and where torch has CUDA, torch's own
CUDA eager and Inductor. Prints one JSON object (also written to `--out`).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tpu_inductor  # noqa: E402
from tpu_inductor.bench import models as bench_models
from tpu_inductor.runtime import devices  # noqa: E402


def _workload(name: str) -> tuple[torch.nn.Module, dict, Callable]:
    """(model, its keyword inputs, loss of the model's output) for `--model`."""
    import torch.nn.functional as F

    if name == "gpt2":
        from tests import hf_zoo

        model, inputs = hf_zoo.build("gpt2", hf_zoo.LARGE)
        return model, {**inputs, "labels": inputs["input_ids"]}, lambda out, _: out.loss
    model, (idx,) = bench_models.build(bench_models.resolve("quickstart-gpt"))
    for module in model.modules():  # eager's random masks are not ours: compare without
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return (
        model,
        {"idx": idx},
        lambda logits, b: F.cross_entropy(logits.flatten(0, 1), b["idx"].flatten()),
    )


def _trainer(model, batch: dict, loss_of: Callable, compile_with: dict | None):
    """One training step of `model` (a closure; returns the loss), compiled as asked."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    forward, update = model, optimizer.step
    if compile_with is not None:
        forward, update = (
            torch.compile(model, **compile_with),
            torch.compile(update, **compile_with),
        )

    def step() -> torch.Tensor:
        loss = loss_of(forward(**batch), batch)
        loss.backward()
        update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _synchronized(step):
    """`step`, waiting for CUDA's queue (torch's CUDA calls return before the work is done)."""

    def run():
        loss = step()
        torch.cuda.synchronize()
        return loss

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default="auto", choices=["auto", "gpt2", "quickstart"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--host-sync", default="explicit", choices=["explicit", "each_call"])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    ours = args.device
    if ours == "auto":  # the CPU alone: its copying device, as an accelerator crosses
        best = devices.select_device("auto").platform
        ours = "cpu-copy" if best == "cpu" else best
    if args.model == "auto":
        args.model = "gpt2" if importlib.util.find_spec("transformers") else "quickstart"
    model, batch, loss_of = _workload(args.model)
    model.train()
    reference = copy.deepcopy(model)
    options = {"backend": "tpu_inductor", "options": {"device": ours, "host_sync": args.host_sync}}
    steps = {
        "eager_cpu": _trainer(reference, batch, loss_of, None),
        "tpu_inductor": _trainer(model, batch, loss_of, options),
    }
    if torch.cuda.is_available():
        on_cuda = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
        for mode, compile_with in (("eager_cuda", None), ("inductor_cuda", {})):
            trainer = _trainer(copy.deepcopy(reference).cuda(), on_cuda, loss_of, compile_with)
            steps[mode] = _synchronized(trainer)
    losses: dict[str, list[float]] = {mode: [] for mode in steps}
    for _ in range(args.steps):  # the first compiles
        for mode, step in steps.items():
            tpu_inductor.reset_transfers()
            losses[mode].append(float(step()))
            if mode == "tpu_inductor":
                ledger = tpu_inductor.transfers()
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    for _ in range(args.runs):
        for mode, step in steps.items():
            start = time.perf_counter()
            step()
            times[mode].append((time.perf_counter() - start) * 1e3)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["tpu_inductor"], losses["eager_cpu"]))
    sent, fetched = ledger["host_to_device"], ledger["device_to_host"]
    counters = 4 * len(list(model.parameters()))  # AdamW's one-element step counts
    tpu_inductor.sync()
    report = {
        "device": str(devices.select_device(ours)),
        "model": args.model,
        "torch": torch.__version__,
        "load_average": os.getloadavg()[0],
        "losses": losses,
        "loss_worst_relative_difference": worst,
        "losses_equal": worst <= args.rtol,
        "steady_step_ledger": ledger,
        "host_sync": args.host_sync,
        "state_sent_bytes": sent["parameter"] + sent["saved"],
        "state_fetched_bytes": fetched["mutation"] + fetched["saved"] - counters,
        "ms_per_step_median": {mode: statistics.median(v) for mode, v in times.items()},
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    state_home = report["state_fetched_bytes"] if args.host_sync == "explicit" else 0
    ok = report["losses_equal"] and report["state_sent_bytes"] == 0 and state_home == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
