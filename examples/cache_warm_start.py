"""The persistent compile cache, measured: a model's first call in a fresh process, cold (empty
cache directory) and then warm (the entries the cold run wrote).

    python examples/cache_warm_start.py [--runs 3] [--model quickstart-gpt] [--train]

`--model` is any `tpu-inductor bench` model (the quickstart GPT by default); `--train` makes the
first call a training step (forward and backward) instead of an inference call.

Prints the first-call time and the PJRT-compile (cold) or deserialize (warm) stage of each run,
and the ratios. Each run is its own Python process, as a restarted job would be; both caches
(ours and torch's AOTAutogradCache) start empty in each cold run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = """
import json, sys, time
import torch
from tpu_inductor.bench import models as bench_models
from tpu_inductor.debug import records
model, inputs = bench_models.build(bench_models.resolve({model!r}))
compiled = torch.compile(model, backend="tpu_inductor", options={{"cache_dir": {cache_dir!r}}})


def output(out):
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if hasattr(out, "logits") else out[0]


start = time.perf_counter()
if {train!r}:
    model.train()
    output(compiled(*inputs)).float().mean().backward()
    first = time.perf_counter() - start
    error = None  # a training step: the gradients are checked by the test suite, not here
else:
    with torch.no_grad():
        out = output(compiled(*inputs))
        first = time.perf_counter() - start
        error = (out - output(model(*inputs))).abs().max().item()
stages = {{}}
for record in records.records:
    for name, seconds in record.timings.items():
        stages[name] = stages.get(name, 0.0) + seconds
decisions = [
    record.cache.get("decision") + ("+aot_autograd_hit" if record.cache.get("aot_autograd") else "")
    for record in records.records
]
print(json.dumps({{"first_call": first, "error": error, "stages": stages, "decisions": decisions}}))
"""


def _run(cache_dir: str, model: str, train: bool) -> dict:
    code = _CHILD.format(model=model, train=train, cache_dir=cache_dir)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "torch")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="cold/warm pairs (median reported)")
    parser.add_argument("--model", default="quickstart-gpt", help="a `tpu-inductor bench` model")
    parser.add_argument("--train", action="store_true", help="a training step, not inference")
    args = parser.parse_args()
    cold, warm = [], []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache_dir:
            cold.append(_run(cache_dir, args.model, args.train))
            warm.append(_run(cache_dir, args.model, args.train))
    for label, runs in (("cold", cold), ("warm", warm)):
        for run in runs:
            print(
                f"{label}: first call {run['first_call']:.2f} s, stages "
                + ", ".join(f"{k} {v:.3f} s" for k, v in run["stages"].items())
                + f", cache {run['decisions']}"
                + ("" if run["error"] is None else f", max error {run['error']:.1e}")
            )
    compile_cold = statistics.median(r["stages"].get("pjrt_compile", 0.0) for r in cold)
    load_warm = statistics.median(r["stages"].get("cache_load", 0.0) for r in warm)
    first_cold = statistics.median(r["first_call"] for r in cold)
    first_warm = statistics.median(r["first_call"] for r in warm)
    print(
        f"PJRT compile (cold) {compile_cold:.3f} s vs cache load (warm) {load_warm:.3f} s: "
        f"{compile_cold / load_warm:.1f}x"
    )
    print(
        f"first call: cold {first_cold:.2f} s vs warm {first_warm:.2f} s: "
        f"{first_cold / first_warm:.2f}x"
    )


if __name__ == "__main__":
    main()
