"""Batched `generate()` with padding masks, bucketed: four requests of two left-padded prompts
(lengths 5, 9, 13, 20) and 32 new tokens each, on the test zoo's GPT-2 or Llama (built from a
config, no download), through tpu_inductor (pow2 buckets) and then Inductor, in one process.

    taskset -c 0 python examples/batched_generate.py [--model gpt2|llama] [--tokens 32]

Prints each backend's total time, compiles included (both caches empty: fresh directories), its
compiles, and whether the tokens equal eager's. Run from the repository root (it imports
tests/hf_zoo.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.getcwd())
os.environ["TPU_INDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()

import tpu_inductor  # noqa: E402
from tests import hf_zoo  # noqa: E402

LENGTHS = (5, 9, 13, 20)


def requests(seed: int = 0):
    """Two prompts per request, the second left-padded by a third of its length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(1, hf_zoo.VOCAB, (2, n), generator=g)
        mask = torch.ones(2, n, dtype=torch.long)
        ids[1, : n // 3], mask[1, : n // 3] = 0, 0
        out.append((ids, mask))
    return out


def run(model, batch, tokens: int):
    return [
        model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False)
        for ids, mask in batch
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    model, _ = hf_zoo.build(args.model, hf_zoo.Size(seq=64))
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    batch = requests()
    expected = run(model, batch, args.tokens)
    eager_forward = model.forward
    for backend in ("tpu_inductor", "inductor"):
        torch._dynamo.reset()
        options = {"shapes": {"policy": "pow2"}} if backend == "tpu_inductor" else None
        model.forward = torch.compile(eager_forward, backend=backend, options=options)
        stats = torch._dynamo.utils.counters["stats"]
        compiles, graphs = tpu_inductor.compiles(), stats["unique_graphs"]
        start = time.perf_counter()
        got = run(model, batch, args.tokens)
        seconds = time.perf_counter() - start
        same = all(torch.equal(a, b) for a, b in zip(got, expected))
        pjrt = f", {tpu_inductor.compiles() - compiles} PJRT compiles" * (backend != "inductor")
        print(
            f"{args.model} {backend}: {seconds:.1f} s, {stats['unique_graphs'] - graphs} Dynamo "
            f"graphs{pjrt}, tokens equal: {same}"
        )
    model.forward = eager_forward


if __name__ == "__main__":
    main()
