"""The attention op's per-platform kernels, measured here: how many attentions a TPU lowering
runs as Splash kernels per model, and what grouped-query folding saves a decode step.

    .venv/bin/python tools/bench_attention_kernels.py kernels [--models llama,gpt2,bert,mixtral]
        [--seq 512] [--hidden 256] [--heads 2]
    .venv/bin/python tools/bench_attention_kernels.py decode [--cache 4096] [--new 1]
        [--hidden 512]

`kernels`: tests/hf_zoo.py's models (2 layers, batch 1, fusion on) compiled for TPU by the AOT
compiler (lowering only: no TPU here), each lowering's `kernel_choices` (kernels chosen,
fallbacks and why; lowering/ops/attention_kernels.py). `decode`: a Llama (GQA 8/2, 1 layer) one
decode step against a KV cache of `--cache` tokens, fusion off and on, the executable's
temporaries (XLA's memory analysis), checked equal to eager.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpu_inductor.lowering.ops import attention_kernels  # noqa: E402

from tests import hf_zoo  # noqa: E402
from tpu_inductor.aot import artifact
from tpu_inductor.aot import compile as aot_compile
from tpu_inductor.cache import stores
from tpu_inductor.runtime import devices  # noqa: E402


def tpu_kernel_choices(
    name: str, size: hf_zoo.Size, attn: str | None = None, options: dict | None = None
) -> dict[str, int]:
    """The attention choices of `name`'s TPU lowering (inference; the `attn` implementation if
    given) under the compile `options`, by default attention fusion on."""
    model, _ = hf_zoo.build(name, size)
    model.config.use_cache = False
    if attn:
        model.set_attn_implementation(attn)
    before = collections.Counter(attention_kernels.counters)
    inputs = [artifact.parse_input(f"input_ids:int64[{size.batch},{size.seq}]")]
    options = options or {"fusion": {"attention": True}, "cache": False}
    with tempfile.TemporaryDirectory() as out:
        aot_compile.compile_model(
            model, inputs, Path(out) / "artifact", platform="tpu", options=options
        )
    return dict(attention_kernels.counters - before)


@contextlib.contextmanager
def recorded_temporaries():
    """A list that collects the temporaries (bytes) of every executable PJRT compiles inside."""
    temporaries, compile_stablehlo = [], devices.compile_stablehlo

    def recording(module, device):
        executable = compile_stablehlo(module, device)
        temporaries.append(executable.get_compiled_memory_stats().temp_size_in_bytes)
        return executable

    devices.compile_stablehlo = recording
    try:
        yield temporaries
    finally:
        devices.compile_stablehlo = compile_stablehlo


def decode_llama(cached: int, hidden: int, heads: int = 8, kv_heads: int = 2):
    """A seeded float32 Llama (1 layer, GQA `heads`/`kv_heads`) and its KV cache after a
    prompt of `cached` tokens."""
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=hf_zoo.VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2 * cached,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        ids = torch.randint(0, hf_zoo.VOCAB, (1, cached))
        past = model(input_ids=ids, use_cache=True).cache
    return model, past


def decode_temporaries(cached: int, new: int, hidden: int) -> dict[bool, tuple[int, torch.Tensor]]:
    """Fusion off (False) and on (True) → (the temporaries in bytes, the logits) of one decode
    step of `new` tokens against `cached`; None → (0, eager's logits)."""
    model, past = decode_llama(cached, hidden)
    tokens = torch.randint(0, hf_zoo.VOCAB, (1, new))

    def step(m):
        return m(input_ids=tokens, cache=copy.deepcopy(past)).logits

    results = {}
    with torch.no_grad(), recorded_temporaries() as temporaries:
        results[None] = (0, step(model))
        for fuse in (False, True):
            temporaries.clear()
            stores.memory_cache.clear()
            devices.forget_executables()
            torch._dynamo.reset()
            options = {"cache": False, "fallback": "error", "fusion": {"attention": fuse}}
            logits = step(torch.compile(model, backend="tpu_inductor", options=options))
            results[fuse] = (sum(temporaries), logits)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("kernels", "decode"))
    parser.add_argument("--models", default="llama,gpt2,bert,mixtral")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--cache", type=int, default=4096)
    parser.add_argument("--new", type=int, default=1)
    args = parser.parse_args(argv)
    if args.what == "kernels":
        hidden = args.hidden or 256
        size = hf_zoo.Size(hidden=hidden, layers=2, heads=args.heads, seq=args.seq, batch=1)
        for name in args.models.split(","):
            print(f"{name:10} head dim {hidden // args.heads}: {tpu_kernel_choices(name, size)}")
        return
    results = decode_temporaries(args.cache, args.new, args.hidden or 512)
    eager = results[None][1]
    for fuse in (False, True):
        temps, logits = results[fuse]
        error = float((logits - eager).abs().max())
        print(
            f"decode {args.new} against {args.cache}, fusion {'on' if fuse else 'off'}: "
            f"temporaries {temps / 2**20:.2f} MiB (max error {error:.1e})"
        )


if __name__ == "__main__":
    main()
