"""A serving loop over precompiled buckets: requests of 1-8 prompts of 8-512 tokens, left-padded
with an attention mask, scored by a GPT-2 built from a config (no download).

    python examples/serve.py [--requests 200] [--hidden 64] [--layers 2] [--inductor]

Warm-up compiles every (batch, length) bucket pair once (`tpu_inductor.precompile`, pow2).
Then every request runs inside `tpu_inductor.no_compiles()` and
`torch.compiler.set_stance("fail_on_recompile")`: a compile, ours or a Dynamo retrace, raises.
The loop asserts that no PJRT compile happened and that the logits at the real positions equal
eager's. Prints the warm-up time and the latency per request (p50, p99); `--inductor` runs the
same requests through Inductor (`dynamic=True`, warmed up on the same bucket sizes) in the same
process after ours, for the comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import tpu_inductor

BATCH, LENGTH = 8, 512  # the largest request


class Scorer(torch.nn.Module):
    """Next-token logits of a padded batch: positions from the mask, as HF's generate makes them."""

    def __init__(self, hidden: int, layers: int):
        super().__init__()
        config = transformers.GPT2Config(
            vocab_size=512, n_positions=LENGTH, n_embd=hidden, n_layer=layers, n_head=4
        )
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        self.lm = transformers.GPT2LMHeadModel(config).eval()

    def forward(self, ids, mask):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.lm(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        return out.logits


def requests(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` requests: 1-8 prompts of 8-512 tokens, each row left-padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        b = int(torch.randint(1, BATCH + 1, (), generator=g))
        n = int(torch.randint(8, LENGTH + 1, (), generator=g))
        ids = torch.randint(1, 512, (b, n), generator=g)
        mask = torch.ones(b, n, dtype=torch.long)
        for row in range(b):
            pad = int(torch.randint(0, n // 2 + 1, (), generator=g))
            ids[row, :pad], mask[row, :pad] = 0, 0
        out.append((ids, mask))
    return out


def _marked(ids, mask):
    """The batch and length dims marked as varying (a batch of one is its own graph's)."""
    for t in (ids, mask):
        for dim in (0, 1) if len(t) > 1 else (1,):
            torch._dynamo.maybe_mark_dynamic(t, dim)
    return ids, mask


def serve(compiled, batch: list, check=None) -> list[float]:
    """Each request's latency in ms (compiled results checked against `check` if given)."""
    latencies = []
    with torch.no_grad():
        for ids, mask in batch:
            ids, mask = _marked(ids.clone(), mask.clone())
            start = time.perf_counter()
            logits = compiled(ids, mask)
            latencies.append((time.perf_counter() - start) * 1e3)
            if check is not None:
                want = check(ids, mask)
                real = mask.bool()
                assert torch.allclose(logits[real], want[real], atol=1e-4, rtol=1e-4)
    return latencies


def _summary(name: str, warm_s: float, latencies: list[float]) -> None:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    print(
        f"{name}: warm-up {warm_s:.1f} s; {len(ordered)} requests: p50 "
        f"{statistics.median(ordered):.2f} ms, p99 {p99:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--inductor", action="store_true", help="then the same through Inductor")
    args = parser.parse_args()
    model = Scorer(args.hidden, args.layers)
    batch = requests(args.requests)

    options = {"shapes": {"policy": "pow2"}, "fallback": "error"}
    compiled = torch.compile(model, backend="tpu_inductor", options=options)
    start = time.perf_counter()
    # batches of 2-8 and lengths of 2-512, every pair of buckets; a batch of one is a graph of
    # its own (Dynamo specializes size 1): its lengths' buckets
    example = (torch.randint(1, 512, (2, 16)), torch.ones(2, 16, dtype=torch.long))
    groups = {"B": {0: 0, 1: 0}, "S": {0: 1, 1: 1}}
    buckets = tpu_inductor.precompile(compiled, example, groups, {"B": BATCH, "S": LENGTH})
    single = tuple(t[:1] for t in example)
    buckets += tpu_inductor.precompile(compiled, single, {0: 1, 1: 1}, LENGTH)
    warm_s = time.perf_counter() - start
    warm = tpu_inductor.compiles()
    print(f"precompiled {len(buckets)} bucket pairs: {tpu_inductor.compiles()} PJRT compiles")
    with tpu_inductor.no_compiles(), torch.compiler.set_stance("fail_on_recompile"):
        latencies = serve(compiled, batch, check=model)
    assert tpu_inductor.compiles() == warm, "a request compiled after warm-up"
    print(f"0 compiles over {len(batch)} requests after precompile")
    _summary("tpu_inductor", warm_s, serve(compiled, batch) if args.inductor else latencies)

    if args.inductor:
        inductor = torch.compile(model, dynamic=True)
        start = time.perf_counter()
        serve(inductor, [(ids.repeat(b, 1)[:b], m.repeat(b, 1)[:b]) for b, ids, m in _sizes()])
        _summary("inductor", time.perf_counter() - start, serve(inductor, batch))


def _sizes():
    """One request per bucket pair (the sizes Inductor is warmed up on)."""
    for b in (1, 2, 4, 8):
        for n in (8, 16, 32, 64, 128, 256, 512):
            yield b, torch.randint(1, 512, (1, n)), torch.ones(1, n, dtype=torch.long)


if __name__ == "__main__":
    main()
