"""A static-cache `generate()` per token: eager, Inductor and tpu_inductor (Hugging Face's recipe,
`mode="reduce-overhead"`, `fullgraph=True`), and what ours moved between host and device.

    .venv/bin/python tools/bench_decode.py [--models gpt2,llama] [--new 32] [--runs 5]

tests/hf_zoo.py's models at its LARGE size (d128, 4 layers), batch 2, an 8-token prompt; each
figure is the median over `--runs` interleaved generates of ms per new token (the prefill
included); every mode's tokens are checked against eager's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tpu_inductor  # noqa: E402
from tests import hf_zoo  # noqa: E402


def _modes(forward) -> dict:
    return {
        "eager": forward,
        "inductor": torch.compile(forward, backend="inductor", fullgraph=True),
        "tpu_inductor": torch.compile(
            forward, backend="tpu_inductor", mode="reduce-overhead", fullgraph=True
        ),
    }


def bench(name: str, new: int, runs: int) -> None:
    model, inputs = hf_zoo.build(name, hf_zoo.LARGE)
    prompt = inputs["input_ids"][:2, :8].contiguous()
    forward, modes = model.forward, _modes(model.forward)

    def generate(mode: str) -> torch.Tensor:
        model.forward = modes[mode]
        with torch.no_grad():
            return model.generate(
                prompt, max_new_tokens=new, do_sample=False, cache_implementation="static"
            )

    tokens = {mode: generate(mode) for mode in modes}  # compiles
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(runs):
        for mode in modes:
            tpu_inductor.reset_transfers()
            start = time.perf_counter()
            generate(mode)
            times[mode].append((time.perf_counter() - start) / new * 1e3)
            if mode == "tpu_inductor":
                moved = tpu_inductor.transfers()
    model.forward = forward
    same = all(torch.equal(t, tokens["eager"]) for t in tokens.values())
    medians = {mode: round(statistics.median(v), 3) for mode, v in times.items()}
    print(f"{name}: ms per token {medians}; tokens equal eager's: {same}")
    print(f"  ours per generate of {new}: {moved}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for name in args.models.split(","):
        bench(name, args.new, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
