"""FlexAttention's XLA form with and without skipping the blocks the block mask does not list
(lowering/ops/flex_attention_blocks.py): a training step's forward and backward compiled both
ways, their executables' temporaries (PJRT's compiled memory stats) and the step's seconds,
interleaved, median of `--repeat`, one process.

    .venv/bin/python tools/bench_flex_blocks.py [--length 2048] [--heads 4] [--dim 64] \
        [--mask causal|documents] [--repeat 7]

"Dense" is the form without skipping (every block computed and masked, query rows in blocks
of 512), reached by making the block tables unusable to the lowering; the share of blocks
skipped is the block mask's own `sparsity()`. Caches are off and each form compiles once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _mask(kind: str, length: int):
    def causal(b, h, q, kv):
        return q >= kv

    if kind == "causal":
        return causal
    import torch

    documents = torch.arange(length) * 4 // length  # four packed documents

    def packed(b, h, q, kv):
        return causal(b, h, q, kv) & (documents[q] == documents[kv])

    return packed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--mask", default="causal", choices=("causal", "documents"))
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from tpu_inductor.lowering.ops import flex_attention_blocks

    import tpu_inductor
    from tpu_inductor.cache import stores
    from tpu_inductor.runtime import compiled_graph, devices

    tpu_inductor.enable_flex_attention_training()
    length = args.length
    block_mask = create_block_mask(_mask(args.mask, length), None, None, length, length, "cpu")
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, args.heads, length, args.dim, generator=g) for _ in range(4)]

    def attend(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask)

    def step(fn):
        q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
        fn(q, k, v).backward(inputs[3])

    listed = flex_attention_blocks.listed_blocks
    steps, temporaries = {}, {}
    for form in ("listed", "dense"):
        flex_attention_blocks.listed_blocks = listed if form == "listed" else lambda *a: None
        torch._dynamo.reset()
        stores.memory_cache.clear()
        devices.forget_executables()
        made, init = [], compiled_graph.CompiledGraph.__init__

        def record(graph, *a, init=init, made=made, **k):
            init(graph, *a, **k)
            made.append(graph)

        compiled_graph.CompiledGraph.__init__ = record
        options = {"fallback": "error", "cache": False}
        fn = torch.compile(attend, backend="tpu_inductor", options=options, fullgraph=True)
        step(fn)
        compiled_graph.CompiledGraph.__init__ = init
        steps[form] = fn
        stats = [g.executable.get_compiled_memory_stats().temp_size_in_bytes for g in made]
        temporaries[form] = stats
    flex_attention_blocks.listed_blocks = listed
    seconds = {form: [] for form in steps}
    for _ in range(args.repeat):
        for form, fn in steps.items():
            start = time.perf_counter()
            step(fn)
            seconds[form].append(time.perf_counter() - start)
    median = {form: statistics.median(s) for form, s in seconds.items()}
    print(
        json.dumps(
            {
                "length": length,
                "mask": args.mask,
                "blocks_skipped_percent": block_mask.sparsity(),
                "temporaries_forward_backward_bytes": temporaries,
                "median_step_seconds": median,
                "listed_over_dense": median["listed"] / median["dense"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
