"""The persistent compile cache, measured: the quickstart GPT's first call in a fresh process,
cold (empty cache directory) and then warm (the entry the cold run wrote).

    python examples/cache_warm_start.py [--runs 3]

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
from pathlib import Path

_CHILD = """
import json, sys, time
import torch
sys.path.insert(0, {examples!r})
from quickstart import make_model_and_inputs
from tpu_inductor import debug
model, idx = make_model_and_inputs()
compiled = torch.compile(model, backend="tpu_inductor", options={{"cache_dir": {cache_dir!r}}})
with torch.no_grad():
    start = time.perf_counter()
    out = compiled(idx)
    first = time.perf_counter() - start
    error = (out - model(idx)).abs().max().item()
stages = {{}}
for record in debug.records:
    for name, seconds in record.timings.items():
        stages[name] = stages.get(name, 0.0) + seconds
decisions = [
    record.cache.get("decision") + ("+aot_autograd_hit" if record.cache.get("aot_autograd") else "")
    for record in debug.records
]
print(json.dumps({{"first_call": first, "error": error, "stages": stages, "decisions": decisions}}))
"""


def _run(cache_dir: str) -> dict:
    code = _CHILD.format(examples=str(Path(__file__).parent), cache_dir=cache_dir)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "torch")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="cold/warm pairs (median reported)")
    args = parser.parse_args()
    cold, warm = [], []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache_dir:
            cold.append(_run(cache_dir))
            warm.append(_run(cache_dir))
    for label, runs in (("cold", cold), ("warm", warm)):
        for run in runs:
            print(
                f"{label}: first call {run['first_call']:.2f} s, stages "
                + ", ".join(f"{k} {v:.3f} s" for k, v in run["stages"].items())
                + f", cache {run['decisions']}, max error {run['error']:.1e}"
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
