"""Benchmark mixture-of-experts: one MoE layer and one MoE decoder, inference and a training
step, in eager torch, Inductor and tpu_inductor, in one process.

    .venv/bin/python tools/bench_moe.py [--repeat 10] [--dtype float32] [--threads N] [--out F]

The layer is the first sparse MoE block of a Qwen3-MoE decoder (tests/hf_zoo.py's LARGE size:
hidden 128, 4 experts, 2 per token, 128 tokens), the model the whole decoder with its loss.
Both run the model's default experts ("grouped_mm": transformers' grouped_mm_fallback in
float32, aten._grouped_mm in bfloat16). Every timed call takes the next of 4 batches with
other tokens, so each is routed differently; the compile counts after the timed calls show
that no routing compiled again (Dynamo graphs; for tpu_inductor also PJRT executables).
Reported: the first call (compile included) and the median steady-state call, in ms, with
the machine's load average before and after (on a shared machine, `--threads 1` under
`taskset -c N` keeps torch's OpenMP threads from spinning against other processes).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tpu_inductor  # noqa: E402
from tests import hf_zoo  # noqa: E402

BATCHES = 4
BACKENDS = ("eager", "inductor", "tpu_inductor")


def _batches(size: hf_zoo.Size) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (size.batch, size.seq)
    return [torch.randint(0, hf_zoo.VOCAB, shape, generator=gen) for _ in range(BATCHES)]


def _model_step(model, train: bool):
    def step(ids):
        if not train:
            with torch.no_grad():
                return model(input_ids=ids, use_cache=False).logits
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach()

    return step


def _layer_step(model, layer, train: bool):
    embed = model.model.embed_tokens

    def step(ids):
        hidden = embed(ids).detach()
        if not train:
            with torch.no_grad():
                return layer(hidden)
        layer.zero_grad(set_to_none=True)
        hidden.requires_grad_()
        out = layer(hidden)
        out.float().square().mean().backward()
        return hidden.grad

    return step


def _compiled(module, backend: str):
    if backend == "eager":
        return module
    if backend == "inductor":
        return torch.compile(module, backend="inductor")
    options = {"fallback": "error", "cache": False}
    return torch.compile(module, backend="tpu_inductor", options=options, fullgraph=True)


def measure(case: str, train: bool, backend: str, dtype, repeat: int) -> dict:
    torch._dynamo.reset()
    counters.clear()
    size = hf_zoo.LARGE
    model, _ = hf_zoo.build("qwen3_moe", size, experts=None)
    model = copy.deepcopy(model).to(dtype).train(train)
    batches = _batches(size)
    if case == "layer":
        layer = model.model.layers[0].mlp
        step = _layer_step(model, _compiled(layer, backend), train)
    else:
        step = _model_step(_compiled(model, backend), train)
    compiles = tpu_inductor.compiles()
    start = time.perf_counter()
    step(batches[0])
    first_ms = 1e3 * (time.perf_counter() - start)
    for ids in batches[1:]:  # every routing once before timing
        step(ids)
    times = []
    for i in range(repeat):
        start = time.perf_counter()
        step(batches[i % BATCHES])
        times.append(time.perf_counter() - start)
    return {
        "first_ms": first_ms,
        "step_ms": 1e3 * statistics.median(times),
        "graphs": counters["stats"]["unique_graphs"],
        "pjrt": tpu_inductor.compiles() - compiles if backend == "tpu_inductor" else None,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--cases", default="layer,model")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads")
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    lines = [
        f"MoE bench: Qwen3-MoE (hf_zoo LARGE), {args.dtype}, {torch.get_num_threads()} threads, "
        f"median of {args.repeat} calls over {BATCHES} routings, load average {load:.1f}",
        "",
        "| case | step | backend | first call ms | steady ms | Dynamo graphs | PJRT compiles |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for case in args.cases.split(","):
        for train in (False, True):
            for backend in args.backends.split(","):
                r = measure(case, train, backend, dtype, args.repeat)
                pjrt = "" if r["pjrt"] is None else str(r["pjrt"])
                line = (
                    f"| {case} | {'train' if train else 'infer'} | {backend} | "
                    f"{r['first_ms']:.0f} | {r['step_ms']:.2f} | {r['graphs']} | {pjrt} |"
                )
                lines.append(line)
                print(line, flush=True)
    lines.append(f"\nload average after: {os.getloadavg()[0]:.1f}")
    print(lines[-1])
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
