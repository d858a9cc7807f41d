"""Benchmark the attention fusion on and off: compile seconds, steady-state milliseconds and
the executable's temporaries (PJRT's compiled memory stats), per form and length.

    .venv/bin/python tools/bench_fuse_attention.py [--lengths 512,2048] [--repeat 5]

Forms: Hugging Face Llama's eager attention (GQA 8 query / 2 KV heads by repeat_kv, a causal
float bias built in the graph, softmax in float32), the same with a padding mask given, and
SDPA with repeated K/V. Caches are off; each configuration compiles once in this process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.attention_forms import _repeat_kv, _tril  # noqa: E402
from tpu_inductor import runtime  # noqa: E402

HEADS, KV_HEADS, DIM = 8, 2, 64


def llama_eager(q, k, v, m):
    k, v = _repeat_kv(k, HEADS), _repeat_kv(v, HEADS)
    bias = torch.where(_tril(q, k), 0.0, torch.finfo(q.dtype).min)
    s = torch.matmul(q, k.transpose(2, 3)) * DIM**-0.5 + bias
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def llama_eager_padded(q, k, v, m):
    k, v = _repeat_kv(k, HEADS), _repeat_kv(v, HEADS)
    s = torch.matmul(q, k.transpose(2, 3)) * DIM**-0.5 + m
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def sdpa_repeat_kv(q, k, v, m):
    k, v = _repeat_kv(k, HEADS), _repeat_kv(v, HEADS)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


FORMS = {"llama_eager": llama_eager, "llama_eager_padded": llama_eager_padded}
FORMS["sdpa_repeat_kv"] = sdpa_repeat_kv

_temps: list[int] = []
_compile = runtime.compile_stablehlo


def _recording_compile(module, device):
    """runtime.compile_stablehlo, noting each executable's temporaries (bench only)."""
    executable = _compile(module, device)
    _temps.append(executable.get_compiled_memory_stats().temp_size_in_bytes)
    return executable


def measure(fn, length: int, fuse: bool, repeat: int) -> dict:
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, length, DIM)
    k, v = (torch.randn(1, KV_HEADS, length, DIM) for _ in range(2))
    m = torch.where(torch.rand(1, 1, length, length) < 0.9, 0.0, torch.finfo(torch.float32).min)
    torch._dynamo.reset()
    options = {"cache": False, "fallback": "error", "fusion": {"attention": fuse}}
    compiled = torch.compile(fn, backend="tpu_inductor", options=options)
    _temps.clear()
    with torch.no_grad():
        start = time.perf_counter()
        compiled(q, k, v, m)
        compile_s = time.perf_counter() - start
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            compiled(q, k, v, m)
            times.append(time.perf_counter() - start)
    return {
        "compile_s": compile_s,
        "step_ms": 1e3 * statistics.median(times),
        "temp_mib": sum(_temps) / 2**20,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--forms", default=",".join(FORMS))
    args = parser.parse_args(argv)
    runtime.compile_stablehlo = _recording_compile
    print("form                 length fusion  compile_s  step_ms  temp_MiB")
    for name in args.forms.split(","):
        for length in map(int, args.lengths.split(",")):
            for fuse in (False, True):
                r = measure(FORMS[name], length, fuse, args.repeat)
                print(
                    f"{name:20} {length:6} {'on' if fuse else 'off':6} {r['compile_s']:9.2f} "
                    f"{r['step_ms']:8.1f} {r['temp_mib']:9.1f}"
                )


if __name__ == "__main__":
    main()
