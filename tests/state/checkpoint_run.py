"""Sharded checkpoints, run in processes of their own (the device count is fixed when jax
starts): `python -m tests.state.checkpoint_run MODE DIR [--process I --port P]`.

`save`: an MLP with FSDP over 8 devices, two compiled AdamW steps, an asynchronous save to
DIR/checkpoint with a third step run before it is waited for; writes DIR/saved.pt (the values
at the save, copied from the device arrays the save is handed), DIR/after.pt (the third step's
loss and every tensor after it). With --process (two processes, 4 devices each): the same to
DIR/checkpoint2, DIR/saved2.pt and DIR/after2.pt.
`load CASE...`: for each case a fresh model of other random values and a fresh AdamW, loaded
from DIR/checkpoint (from DIR/checkpoint2 with --from2, compared with saved2.pt and after2.pt):
`same` (FSDP over 8 devices), `mesh42` ({"data": 4, "model": 2} under a plan by names), `one`
(one device, nothing placed); prints per case, as JSON, the tensors that stayed on the devices
after the load, the largest difference from DIR/saved.pt (and whether all are bitwise equal),
then the third step's loss and every tensor after it against DIR/after.pt. With --process:
case `same` over two processes' 8 devices.
With --host-bytes N the save copies the shards to the host N bytes at a time after it returns
(the third step then waits for it: the count printed as `waits`).
`rss`: a model of 64 MiB (--mib) on 8 devices, saved synchronously, asynchronously and asynchronously
with a host budget of a twentieth of the state; prints the resident memory's growth at the
peak during each save, after it and after the heap's free memory is given back (malloc_trim),
as fractions of the state's bytes, and the times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

if "--process" in sys.argv:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
else:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import torch  # noqa: E402

import tpu_inductor  # noqa: E402
from tpu_inductor.runtime import pending_reads  # noqa: E402
from tpu_inductor.sharding import plans as sharding_plans  # noqa: E402
from tpu_inductor.state import device_state  # noqa: E402

PLACEMENTS = {
    "same": ({"data": 8}, sharding_plans.fsdp("data", min_elements=256)),
    "mesh42": (
        {"data": 4, "model": 2},
        {"0.weight": ("data", "model"), "3.weight": ("model", None), "5.weight": (None, "data")},
    ),
    "one": (None, None),
}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.LayerNorm(64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 8),
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 16, generator=generator), torch.randn(16, 8, generator=generator)


class Run:
    """A model placed as `case` says, its AdamW and their compiled step."""

    def __init__(self, case: str, seed: int):
        axes, plan = PLACEMENTS[case]
        self.model, self.mesh = _model(seed), axes and tpu_inductor.Mesh(axes)
        if self.mesh is not None:
            tpu_inductor.shard(self.model, self.mesh, plan)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        if self.mesh is not None:
            tpu_inductor.shard_optimizer_state(self.optimizer)
        self.forward = torch.compile(self.model, backend="tpu_inductor")
        self.update = torch.compile(self.optimizer.step, backend="tpu_inductor")

    def step(self, index: int) -> float:
        x, target = _batch(index)
        if self.mesh is not None:
            tpu_inductor.mark_sharding(x, self.mesh, (next(iter(self.mesh.names)), None))
        loss = (self.forward(x) - target).square().mean()
        loss.backward()
        self.update()
        self.optimizer.zero_grad()
        return loss.item()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and AdamW state tensor, by name (brought home first)."""
        found = {f"model/{n}": t for n, t in self.model.state_dict(keep_vars=True).items()}
        for name, parameter in self.model.named_parameters():
            for key, value in self.optimizer.state.get(parameter, {}).items():
                found[f"optimizer/{name}/{key}"] = value
        # (a tensor split over two processes is gathered by a collective each runs: in the
        # order given, the same in both)
        tpu_inductor.sync(*found.values())
        return {name: tensor.detach().clone() for name, tensor in found.items()}

    def on_devices(self) -> int:
        """How many of the tensors hold their values on the devices only."""
        values = [*self.model.parameters()]
        values += [v for state in self.optimizer.state.values() for v in state.values()]
        return sum(device_state.device_array(v) is not None for v in values)


def _compare(found: dict, expected: dict) -> dict:
    assert found.keys() == expected.keys(), (sorted(found), sorted(expected))
    diffs = {n: (found[n].double() - expected[n].double()).abs().max().item() for n in found}
    return {
        "bitwise": all(torch.equal(found[n], expected[n]) for n in found),
        "max_diff": max(diffs.values()),
        "worst": max(diffs, key=diffs.get),
    }


def save(folder: str, process: int | None, host_bytes: int | None) -> None:
    suffix = "" if process is None else "2"  # saved by two processes
    run = Run("same", seed=0)
    run.step(1)
    run.step(2)
    # The values at the save, copied home now: the next compiled step deletes the arrays it
    # replaces (a save must have copied them off the devices before it returns).
    saved = {name: _host(value) for name, value in _held(run).items()}
    path = os.path.join(folder, f"checkpoint{suffix}")
    start = time.perf_counter()
    handle = tpu_inductor.save_checkpoint(path, run.model, run.optimizer, host_bytes=host_bytes)
    returned = time.perf_counter() - start
    loss = run.step(3)  # before the save is waited for: it must not change what is written
    handle.wait()
    waits = pending_reads.stats["waits"]
    after = {"loss": loss, "tensors": run.tensors()}
    if process in (None, 0):
        torch.save(saved, os.path.join(folder, f"saved{suffix}.pt"))
        torch.save(after, os.path.join(folder, f"after{suffix}.pt"))
    row = {"process": process, "saved": path, "returned_s": returned, "waits": waits}
    print(json.dumps(row), flush=True)


def _held(run: Run) -> dict:
    """The values a save is handed: device arrays (immutable) or host copies, by name."""
    held = {f"model/{n}": t for n, t in run.model.state_dict(keep_vars=True).items()}
    for name, parameter in run.model.named_parameters():
        for key, value in run.optimizer.state[parameter].items():
            held[f"optimizer/{name}/{key}"] = value
    return {
        name: device_state.device_array(t)
        if device_state.device_array(t) is not None
        else t.detach().clone()
        for name, t in held.items()
    }


def _host(value) -> torch.Tensor:
    """A held value on the host (one split over two processes gathered by both)."""
    if isinstance(value, torch.Tensor):
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    if not value.is_fully_addressable:
        value = multihost_utils.process_allgather(value, tiled=True)
    return torch.from_numpy(np.array(value))


def load(folder: str, cases: list[str], suffix: str, process: int | None) -> None:
    saved = torch.load(os.path.join(folder, f"saved{suffix}.pt"))
    after = torch.load(os.path.join(folder, f"after{suffix}.pt"))
    for case in cases:
        run = Run(case, seed=1)
        path = os.path.join(folder, f"checkpoint{suffix}")
        tpu_inductor.load_checkpoint(path, run.model, run.optimizer)
        row = {"case": case, "process": process, "on_devices": run.on_devices()}
        row["restored"] = _compare(run.tensors(), saved)
        row["loss"], row["expected_loss"] = run.step(3), after["loss"]
        row["stepped"] = _compare(run.tensors(), after["tensors"])
        print(json.dumps(row), flush=True)


def rss(folder: str, mib: int) -> None:
    layers = (torch.nn.Linear(1024, 1024, bias=False) for _ in range(mib // 4))
    model = torch.nn.Sequential(*layers)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tpu_inductor.shard(model, tpu_inductor.Mesh({"data": 8}), sharding_plans.fsdp("data"))
    row = {"state_bytes": state_bytes}
    warm = os.path.join(folder, "warm-up")  # orbax's imports and thread pools, not measured
    tpu_inductor.save_checkpoint(warm, torch.nn.Linear(2, 2), asynchronous=False)
    budget = {"sync": None, "async": None, "budget": state_bytes // 20}
    for mode in ("sync", "async", "budget"):
        _trim()
        before = _rss()
        with _Peak() as peak:
            start = time.perf_counter()
            handle = tpu_inductor.save_checkpoint(
                os.path.join(folder, mode),
                model,
                asynchronous=mode != "sync",
                host_bytes=budget[mode],
            )
            returned = time.perf_counter() - start
            handle.wait()
            done = time.perf_counter() - start
        after = _rss()
        _trim()
        row[mode] = {
            "returned_s": returned,
            "done_s": done,
            "peak_growth": (peak.bytes - before) / state_bytes,
            "growth_after": (after - before) / state_bytes,
            "growth_after_trim": (_rss() - before) / state_bytes,
        }
    print(json.dumps(row), flush=True)


def _trim() -> None:
    """Give the heap's free memory back to the system (glibc keeps what the save freed)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


class _Peak:
    """The largest resident memory sampled (every millisecond) inside the `with`."""

    def __enter__(self):
        self.bytes, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.bytes = max(self.bytes, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("save", "load", "rss"))
    parser.add_argument("folder")
    parser.add_argument("cases", nargs="*")
    parser.add_argument("--process", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--from2", action="store_true", help="load what two processes saved")
    parser.add_argument("--host-bytes", type=int, help="save's host budget (bytes)")
    parser.add_argument("--mib", type=int, default=64, help="`rss`: the model's size")
    args = parser.parse_args(argv)
    if args.process is not None:
        tpu_inductor.distributed.initialize(f"127.0.0.1:{args.port}", 2, args.process)
    if args.mode == "save":
        save(args.folder, args.process, args.host_bytes)
    elif args.mode == "load":
        load(args.folder, args.cases, "2" if args.from2 else "", args.process)
    else:
        rss(args.folder, args.mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
