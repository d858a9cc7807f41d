"""Process memory of a Llama training step: eager torch against tpu_inductor on one device and
under FSDP on 8 virtual CPU devices (issue 38's acceptance run), each in its own process, and
FSDP over two processes of 4 devices each on loopback (`fsdp2x4`: a row per process).

    .venv/bin/python tools/bench_memory.py [--hidden 1024 --layers 6 --vocab 8192]
                               [--batch 8 --seq 64 --steps 3] [--runs eager,one,fsdp8,fsdp2x4]

Per run: peak RSS (getrusage), steady RSS after the last step, the host bytes still held by
parameter, gradient and optimizer storages (their resident pages, from /proc/self/pagemap's
view through mincore), and tpu_inductor.memory(): resident bytes per device and host_held.
The step: compiled forward and backward, a compiled AdamW step, `host_sync="explicit"`.
On this machine the devices' bytes are host memory too: RSS counts them once, the ledger keeps
them apart. Prints one markdown table; `--json` writes the figures.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _model(args):
    import torch
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(2.6875 * args.hidden),
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        num_key_value_heads=max(args.hidden // 256, 1),
        max_position_embeddings=2 * args.seq,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).train()


def _state_tensors(model, optimizer):
    tensors = [*model.parameters()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if hasattr(v, "untyped_storage") and v.numel() > 1]
    return tensors


def _host_state_bytes(tensors) -> int:
    """The host bytes the state's storages hold (resident pages of each storage's memory)."""
    from tpu_inductor.runtime.host_sync import host_sync

    held = 0
    for tensor in tensors:
        held += host_sync.resident_bytes(tensor)
    return held


def run_one(args) -> dict:
    """One run in this process (the child)."""
    import torch

    model = _model(args)
    built = _rss()
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    mesh = None
    if args.run == "fsdp2x4":  # this process's 4 devices of 8, the other process the rest
        import tpu_inductor

        tpu_inductor.distributed.initialize(f"127.0.0.1:{args.port}", 2, args.rank, timeout_s=120)
    if args.run == "eager":
        forward = model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        step = optimizer.step
    else:
        import tpu_inductor
        from tpu_inductor.sharding import plans

        options = {"host_sync": "explicit"}
        if args.run.startswith("fsdp"):
            mesh = tpu_inductor.Mesh({"data": 8 if args.run == "fsdp2x4" else int(args.run[4:])})
            tpu_inductor.shard(model, mesh, plans.fsdp("data"))
        forward = torch.compile(model, backend="tpu_inductor", options=options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        if mesh is not None:
            tpu_inductor.shard_optimizer_state(optimizer)
        step = torch.compile(optimizer.step, backend="tpu_inductor", options=options)
    losses, after_step = [], []
    phases = {"placed": _peak()}  # the peak so far after each phase of the first step
    for _ in range(args.steps):
        if mesh is not None:
            tpu_inductor.mark_sharding(ids, mesh, ("data", None))
        loss = forward(input_ids=ids, labels=ids).loss
        phases.setdefault("forward", _peak())
        loss.backward()
        phases.setdefault("backward", _peak())
        step()
        phases.setdefault("optimizer step", _peak())
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if args.trim:
            ctypes.CDLL(None).malloc_trim(0)
        after_step.append((_rss(), _peak()))
    figures = {
        "built_rss": built,
        "rss_and_peak_after_each_step": after_step,
        "first_step_peaks": phases,
        "run": args.run,
        "state_bytes": 4 * state,  # parameters, gradients, two AdamW moments (float32)
        "parameter_bytes": state,
        "steady_rss": _rss(),
        "peak_rss": _peak(),
        "losses": losses,
    }
    if args.run != "eager":
        import tpu_inductor

        ledger = tpu_inductor.memory()
        figures["host_state_bytes"] = _host_state_bytes(_state_tensors(model, optimizer))
        figures["device_resident"] = {d: v["total"] for d, v in ledger["devices"].items()}
        figures["device_kinds"] = {d: v for d, v in ledger["devices"].items()}
        figures["host_held"] = ledger["host_held"]["total"]
        # XLA's estimate of each device's step peak: resident + the largest executable's need
        figures["device_peaks"] = ledger["peak"]
    return figures


def _children(run: str, argv) -> list[dict]:
    """The figures of `run` from its process (fsdp2x4: from each of its two)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if run.startswith("fsdp"):
        count = 4 if run == "fsdp2x4" else int(run[4:])
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"
    command = [sys.executable, __file__, *(argv or sys.argv[1:]), "--run", run]
    ranks = (0, 1) if run == "fsdp2x4" else (None,)
    port = str(_free_port())
    children = [
        subprocess.Popen(
            command + ([] if rank is None else ["--rank", str(rank), "--port", port]),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in ranks
    ]
    rows = []
    for rank, child in zip(ranks, children):
        out, err = child.communicate()
        if child.returncode:
            sys.exit(f"run {run} (process {rank}) failed:\n{err[-4000:]}")
        row = json.loads(out.strip().splitlines()[-1])
        row["run"] = run if rank is None else f"{run} process {rank}"
        rows.append(row)
    return rows


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _table(rows: list[dict]) -> str:
    mib = 2**20
    eager = next((r["peak_rss"] for r in rows if r["run"] == "eager"), None)
    lines = [
        "| run | steady RSS MiB | peak RSS MiB | peak / eager | host state MiB "
        "| per-device resident MiB (max) | state / devices MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        devices = r.get("device_resident") or {}
        count = max(len(devices), 1)
        lines.append(
            f"| {r['run']} | {r['steady_rss'] / mib:.0f} | {r['peak_rss'] / mib:.0f} "
            f"| {r['peak_rss'] / eager:.2f}x | "
            + (f"{r['host_state_bytes'] / mib:.1f}" if "host_state_bytes" in r else "")
            + " | "
            + (f"{max(devices.values()) / mib:.1f}" if devices else "")
            + f" | {r['state_bytes'] / count / mib:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--runs", default="eager,one,fsdp8")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # the child's one run
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--trim",
        action="store_true",
        help="give the C heap's free memory back after each step (malloc_trim): what XLA:CPU's "
        "freed buffers leave in glibc's arenas is then not counted as held",
    )
    args = parser.parse_args(argv)
    if args.run:
        print(json.dumps(run_one(args)))
        return
    rows = []
    for run in args.runs.split(","):
        rows += _children(run, argv)
    if not any(r["run"] == "eager" for r in rows):
        sys.exit("--runs needs eager (the ratio's base)")
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
