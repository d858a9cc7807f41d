"""Where one call of a 1-op compiled graph (`x + 1`, 8 floats) spends its time: the whole call
under a backend returning its input (Dynamo's guard and frame), backend="eager", Inductor and
tpu_inductor, and ours broken
into AOTAutograd's wrappers, our runtime's Python, the transfers and the PJRT execution; and
the floors: the transfers and the execution alone, as a Dynamo backend's whole graph, and
under AOTAutograd too (what any jax-backed backend pays), and after a Dynamo call that returns
its input, outside the frame (the excess over "alone" is the same: the core's caches).

    .venv/bin/python tools/bench_per_call.py [--rounds 15] [--calls 2000] [--device auto]

Every case is timed in one process, interleaved round by round; each figure is the median of
the rounds (µs per call). The pieces are timed on their own, so they add up only roughly.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpu_inductor.runtime import compiled_graph, devices, execution  # noqa: E402


def _compiled(backend: str, device: str):
    torch._dynamo.reset()
    options = {"options": {"cache": False, "device": device}} if backend == "tpu_inductor" else {}
    return torch.compile(lambda x: x + 1, backend=backend, **options)


def cases(x: torch.Tensor, device: str = "auto") -> dict:
    """name -> a no-argument call, built once (compiles here, not while timing)."""
    torch._dynamo.reset()  # Dynamo's guard and frame with nothing in them
    returns_input = torch.compile(lambda x: x + 1, backend=lambda gm, inputs: lambda *a: (a[0],))
    returns_input(x)
    timed = {"whole call, a backend returning x": lambda: returns_input(x)}
    for backend in ("eager", "inductor", "tpu_inductor"):
        compiled = _compiled(backend, device)
        compiled(x)
        timed[f"whole call, backend={backend}"] = lambda c=compiled: c(x)
    graph = [o for o in gc.get_objects() if type(o) is compiled_graph.CompiledGraph][-1]
    transfer, executable = graph._transfer, graph.executable
    array = transfer.to_device(x)
    result = executable.execute([array])[0]
    timed["ours: compiled_graph.CompiledGraph call"] = lambda: graph([x])
    timed["  argument (torch -> numpy view)"] = lambda: transfer.argument(x)
    timed["  to_device (torch -> jax, dlpack)"] = lambda: transfer.to_device(x)
    if graph._run.fast_path is not None:
        timed["  execute, jax's C++ fast path"] = lambda: graph._run.fast_path(array)
    timed["  execute, Python (+ result arrays)"] = lambda: executable.execute_sharded(
        [array]
    ).disassemble_into_single_device_arrays()
    timed["  to_torch (jax -> torch, dlpack)"] = lambda: transfer.to_torch(result)
    if graph._run.fast_path is not None:
        timed.update(_floors(x, graph, returns_input))
    return timed


def _floors(x: torch.Tensor, graph, returns_input) -> dict:
    """What the least a jax-backed call costs: the graph's transfer and dispatch with nothing
    else (the argument, the C++ fast path, the result's export), alone, as a Dynamo backend's
    whole graph, and as AOTAutograd's compiled graph under Dynamo."""
    from torch._dynamo.backends.common import aot_autograd

    argument, dispatch = graph._transfer.argument, graph._run.fast_path
    to_torch = graph._transfer.to_torch

    def body(t):
        return (to_torch(dispatch(argument(t))[0]),)

    def aot_compiler(gm, inputs):
        def run(args):
            return body(args[0])

        run._boxed_call = True
        return run

    timed = {"floor: argument, dispatch, to_torch alone": lambda: body(x)}
    for name, backend in (
        ("floor: Dynamo + that, no AOTAutograd", lambda gm, inputs: lambda *a: body(a[0])),
        ("floor: Dynamo + AOTAutograd + that", aot_autograd(fw_compiler=aot_compiler)),
    ):
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: x + 1, backend=backend)
        compiled(x)
        timed[name] = lambda c=compiled: c(x)
    # The body after a Dynamo call, outside its frame: whether the excess over "alone" is the
    # frame's or the core's caches (two working sets evicting each other).
    timed["floor: Dynamo returning x, then alone"] = lambda: (returns_input(x), body(x))
    return timed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--device", default="auto", help="tpu_inductor's device option")
    args = parser.parse_args(argv)
    timed = cases(torch.randn(8), args.device)
    samples: dict[str, list[float]] = {name: [] for name in timed}
    for call in timed.values():  # each call's first: the dispatch's own miss
        call()
    execution.stats.clear()
    for _ in range(args.rounds):
        for name, call in timed.items():
            for _ in range(100):
                call()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            samples[name].append((time.perf_counter() - start) / args.calls * 1e6)
    medians = {name: statistics.median(v) for name, v in samples.items()}
    device = devices.select_device(args.device)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {device}; µs per call")
    for name, value in medians.items():
        print(f"{name:45s} {value:8.2f}")
    ours, inductor = (
        medians["whole call, backend=tpu_inductor"],
        medians["whole call, backend=inductor"],
    )
    inner = medians["ours: compiled_graph.CompiledGraph call"]
    print(f"{'ours / Inductor':45s} {ours / inductor:8.2f}x")
    print(
        f"{'C++ fast path misses while timing (0: fast path)':45s} {execution.stats['misses']:8d}"
    )
    guard = medians["whole call, a backend returning x"]
    print(f"{'ours: guard and frame (a backend returning x)':45s} {guard:8.2f}")
    if "floor: argument, dispatch, to_torch alone" not in medians:  # (no C++ fast path: a mesh)
        print(f"{'ours: the rest beyond our runtime alone':45s} {ours - guard - inner:8.2f}")
        return 0
    alone = medians["floor: argument, dispatch, to_torch alone"]
    dynamo = medians["floor: Dynamo + that, no AOTAutograd"]
    aot = medians["floor: Dynamo + AOTAutograd + that"]
    in_turn = medians["floor: Dynamo returning x, then alone"]
    wrappers = aot - dynamo
    print(f"{'ours: AOTAutograd wrappers (floor: aot - no aot)':45s} {wrappers:8.2f}")
    print(f"{'ours: our runtime measured alone':45s} {inner:8.2f}")
    print(f"{'ours: the rest (working sets evicting)':45s} {ours - guard - wrappers - inner:8.2f}")
    print(f"{'floor: alone, in the frame, over alone':45s} {dynamo - guard - alone:8.2f}")
    print(f"{'floor: alone, after a Dynamo call, over alone':45s} {in_turn - guard - alone:8.2f}")
    print(f"{'ours over the AOTAutograd floor':45s} {ours - aot:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
