"""Benchmark a fusion on and off: compile seconds, steady-state milliseconds and the
executables' temporaries (PJRT's compiled memory stats), per form or model and length.

    .venv/bin/python tools/bench_fuse_attention.py [--lengths 512,2048] [--repeat 5]
    .venv/bin/python tools/bench_fuse_attention.py --models llama,gpt2,bert,mixtral \
        [--attn sdpa,eager] [--lengths 512,4096] [--hidden 256 --heads 2]
    .venv/bin/python tools/bench_fuse_attention.py --fusion matmuls --models llama,gpt2,bert \
        --attn sdpa [--train] [--hidden 512]
    .venv/bin/python tools/bench_fuse_attention.py --fusion matmuls --hidden 2048 --lengths 1,512
    .venv/bin/python tools/bench_fuse_attention.py --fusion norms --models llama --attn sdpa \
        [--train] [--hidden 512]

Forms: Hugging Face Llama's eager attention (GQA 8 query / 2 KV heads by repeat_kv, a causal
float bias built in the graph, softmax in float32), the same with a padding mask given, and
SDPA with repeated K/V. Models: tests/hf_zoo.py's, at `MODEL_SIZE` (d128, 2 layers, 8 heads,
GQA 8/4 for the decoders, batch 1; `--hidden` and `--heads` change them), inference or with
`--train` a training step (forward and backward of the loss), with each `--attn`
implementation; `kernels`: the attentions the TPU lowering of the same model and options runs
as kernels, of those it lowered as the attention op (tools/bench_attention_kernels.py's
`tpu_kernel_choices`, inference; Splash needs head dims and lengths in multiples of 128).
`--fusion` is the option switched: `attention` (`fused` counts the attentions rewritten to the
op) or `matmuls` (passes/fuse_matmuls.py; `fused` counts the matmuls merged; its forms are
Q/K/V projections of `--hidden` features against three weights, and against one made outside
the graph for reference) or `norms` (passes/fuse_norms.py, with `--models`; `fused` counts the
norms rewritten to the op). Before the first, a one-op compile initializes jax. Caches are off;
each configuration compiles once in this process; the first call's seconds include Dynamo and
AOTAutograd.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpu_inductor.passes import pipeline  # noqa: E402

from tests import hf_zoo  # noqa: E402
from tests.attention_forms import _repeat_kv, _tril  # noqa: E402
from tools.bench_attention_kernels import tpu_kernel_choices  # noqa: E402
from tpu_inductor.cache import stores
from tpu_inductor.runtime import devices  # noqa: E402

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


def projections(x, wq, wk, wv):
    """Q/K/V projections, their weights graph inputs: what fusion.matmuls merges."""
    return x @ wq.t(), x @ wk.t(), x @ wv.t()


def projections_concatenated(x, wqkv):
    """The same against one weight made outside the graph (what hoisting the concatenation
    out of the graph, once per parameter version, would run)."""
    d = x.shape[-1]
    return (x @ wqkv.t()).split([d, d // 4, d // 4], -1)


MATMUL_FORMS = {"projections": projections, "projections_concatenated": projections_concatenated}

# per fusion option, the pass counters that say what it fused
_FUSED = {
    "attention": ("fuse_attention.written_out", "fuse_attention.sdpa_forward"),
    "matmuls": ("fuse_matmuls.matmuls",),
    "norms": ("fuse_norms.rms_norm", "fuse_norms.layer_norm"),
}
_temps: list[int] = []
_compile = devices.compile_stablehlo


def _recording_compile(module, device):
    """devices.compile_stablehlo, noting each executable's temporaries (bench only)."""
    executable = _compile(module, device)
    _temps.append(executable.get_compiled_memory_stats().temp_size_in_bytes)
    return executable


def _options(fuse: bool, fusion: str = "attention") -> dict:
    return {"cache": False, "fallback": "error", "fusion": {fusion: fuse}}


def _timed(call, repeat: int, fusion: str = "attention", train: bool = False) -> dict:
    """The first call's seconds, the median and the best of `repeat` more in ms, the
    temporaries (MiB) of what compiled (summed over its executables, counted), and what
    `fusion` fused, under no_grad unless `train`."""
    _temps.clear()
    stores.memory_cache.clear()  # an executable another configuration compiled is compiled again
    devices.forget_executables()
    before = collections.Counter(pipeline.counters)
    with torch.set_grad_enabled(train):
        start = time.perf_counter()
        call()
        compile_s = time.perf_counter() - start
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    fused = sum(pipeline.counters[k] - before[k] for k in _FUSED[fusion])
    return {
        "compile_s": compile_s,
        "step_ms": 1e3 * statistics.median(times),
        "best_ms": 1e3 * min(times),  # on a loaded machine the steadier of the two
        "temp_mib": sum(_temps) / 2**20,
        "executables": len(_temps),
        "fused": fused,
    }


def measure(fn, length: int, fuse: bool, repeat: int) -> dict:
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, length, DIM)
    k, v = (torch.randn(1, KV_HEADS, length, DIM) for _ in range(2))
    m = torch.where(torch.rand(1, 1, length, length) < 0.9, 0.0, torch.finfo(torch.float32).min)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tpu_inductor", options=_options(fuse))
    return _timed(lambda: compiled(q, k, v, m), repeat)


def measure_projections(fn, length: int, fuse: bool, repeat: int, *, hidden) -> dict:
    """`fn` of `length` tokens of `hidden` features; K/V a quarter of Q (GQA 8/2)."""
    torch.manual_seed(0)
    x = torch.randn(length, hidden)
    w = [torch.randn(n, hidden) for n in (hidden, hidden // 4, hidden // 4)]
    if fn is projections_concatenated:
        w = [torch.cat(w)]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tpu_inductor", options=_options(fuse, "matmuls"))
    return _timed(lambda: compiled(x, *w), repeat, "matmuls")


MODEL_SIZE = dict(layers=2, batch=1)


def measure_model(
    name: str, attn: str, length: int, fuse: bool, repeat: int, *, fusion, train, hidden, heads
) -> dict:
    size = hf_zoo.Size(**MODEL_SIZE, heads=heads, hidden=hidden, seq=length)
    model, kwargs = hf_zoo.build(name, size)
    model.set_attn_implementation(attn)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tpu_inductor", options=_options(fuse, fusion))
    if train:
        kwargs = {**kwargs, "labels": kwargs["input_ids"]}
        result = _timed(lambda: compiled(**kwargs).loss.backward(), repeat, fusion, train)
    else:
        result = _timed(lambda: compiled(**kwargs), repeat, fusion)
    choices = tpu_kernel_choices(name, size, attn, _options(fuse, fusion))
    result["kernels"] = (
        sum(n for key, n in choices.items() if key.startswith("tpu.") and ":" not in key),
        sum(choices.values()),
    )
    return result


def _row(label: str, length: int, fuse: bool, r: dict) -> str:
    kernels = "{}/{}".format(*r["kernels"]) if "kernels" in r else ""
    return (
        f"{label:20} {length:6} {'on' if fuse else 'off':6} {r['compile_s']:9.2f} "
        f"{r['step_ms']:8.1f} {r['best_ms']:8.1f} {r['temp_mib']:9.1f} {r['fused']:5} "
        f"{r['executables']:5} {kernels:>7}"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--forms", help="default: the fusion's forms (attention or projections)")
    parser.add_argument("--models", help="tests/hf_zoo.py names, instead of the forms")
    parser.add_argument("--attn", default="sdpa,eager", help="with --models")
    parser.add_argument(
        "--fusion", default="attention", choices=sorted(_FUSED), help="with --models"
    )
    parser.add_argument("--train", action="store_true", help="with --models: a training step")
    parser.add_argument("--hidden", type=int, default=128, help="with --models")
    parser.add_argument("--heads", type=int, default=8, help="with --models")
    args = parser.parse_args(argv)
    devices.compile_stablehlo = _recording_compile
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.models:
        configs = [
            (
                f"{name}/{attn}",
                functools.partial(
                    measure_model,
                    name,
                    attn,
                    fusion=args.fusion,
                    train=args.train,
                    hidden=args.hidden,
                    heads=args.heads,
                ),
            )
            for name in args.models.split(",")
            for attn in args.attn.split(",")
        ]
    elif args.fusion == "matmuls":
        forms = (args.forms or ",".join(MATMUL_FORMS)).split(",")
        configs = [
            (name, functools.partial(measure_projections, MATMUL_FORMS[name], hidden=args.hidden))
            for name in forms
        ]
    else:
        forms = (args.forms or ",".join(FORMS)).split(",")
        configs = [(name, functools.partial(measure, FORMS[name])) for name in forms]
    torch.compile(torch.neg, backend="tpu_inductor", options=_options(False))(torch.ones(2))
    print(
        "config               length fusion  compile_s  step_ms  best_ms  temp_MiB fused execs"
        + (" kernels" if args.models else "")
    )
    for label, run in configs:
        for length in lengths:
            for fuse in (False, True):
                print(_row(label, length, fuse, run(length, fuse, args.repeat)), flush=True)


if __name__ == "__main__":
    main()
