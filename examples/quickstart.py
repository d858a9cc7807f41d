"""Quickstart: a small GPT-style decoder compiled with `torch.compile(backend="tpu_inductor")`.

Runs on the best PJRT device present (TPU > GPU > CPU). Prints the device, the largest
difference from eager PyTorch, the first-call (compile) time and steady-state latency.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        heads = [t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(batch, seq, width)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm blocks, a tied-free LM head."""

    def __init__(self, vocab=4096, d_model=512, n_layers=4, n_heads=8, max_seq=128, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_seq, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, n_heads, dropout) for _ in range(n_layers)])
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(positions))))


def make_model_and_inputs(batch: int = 8, seq: int = 128, **config) -> tuple[GPT, torch.Tensor]:
    """The quickstart model (eval mode, seeded) and a batch of token ids."""
    torch.manual_seed(0)
    model = GPT(max_seq=seq, **config).eval()
    return model, torch.randint(0, model.tok.num_embeddings, (batch, seq))


def _median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()

    from tpu_inductor.runtime import devices

    model, idx = make_model_and_inputs(args.batch, args.seq)
    compiled = torch.compile(model, backend="tpu_inductor")
    print(f"device: {devices.select_device('auto')}")
    with torch.no_grad():
        start = time.perf_counter()
        out = compiled(idx)
        first_call = time.perf_counter() - start
        expected = model(idx)
        print(f"max abs error vs eager: {(out - expected).abs().max().item():.3e}")
        print(f"first call (compile + run): {first_call:.2f} s")
        eager_ms, compiled_ms = [], []
        for _ in range(args.runs):  # interleaved: both see the same machine load
            eager_ms.append(_median_ms(lambda: model(idx), 1))
            compiled_ms.append(_median_ms(lambda: compiled(idx), 1))
        eager, ours = statistics.median(eager_ms), statistics.median(compiled_ms)
        print(
            f"steady state (median of {args.runs}): eager {eager:.1f} ms, "
            f"tpu_inductor {ours:.1f} ms ({eager / ours:.2f}x)"
        )


if __name__ == "__main__":
    main()
