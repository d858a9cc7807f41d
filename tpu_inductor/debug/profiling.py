"""Profiling's hooks: named host ranges and per-graph figures, while a profile is on.

`active` is the one flag the hot paths read (a compiled graph's call, an eager region, a
compile stage): off, each pays that check and nothing else. On (`tpu_inductor.profile`, in
tune/profile.py), each
range is both a jax profiler annotation (in the jax trace that Perfetto and TensorBoard's
profile plugin open) and a `torch.profiler.record_function` (in a `torch.profiler` trace), named
`tpu_inductor <what> <graph>` with the graph's name as logs, compile records and dump folders
use it (`forward_3`; the dump folder is `<record id>_forward_3`):

  call      one call of a compiled graph, around the three below
  send      its arguments put on the device (the transfer in)
  execute   the executable run, to its results ready
  receive   its results brought back to torch and written into the inputs it mutates
  compile   one compile stage of a record (lower, pjrt_compile, cache lookup, ...)
  eager     a graph PJRT failed to compile, run in eager torch; a split graph's call (its
            compiled regions' own calls nested inside)

Per graph, `figures` adds up what the calls tell (`called`) and the compiles (`compiled`). This
module imports none of the other rooms: the runtime hands it plain numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses

active = False  # whether a profile is on: the hooks read it and nothing else when it is not


@dataclasses.dataclass
class GraphFigures:
    """What one graph did while profiled: sums over its calls, and its compiles."""

    calls: int = 0
    host_s: float = 0.0  # call time outside `execute`: sending, receiving, Python
    device_s: float = 0.0  # `execute`: from dispatch to its results ready
    crossed_bytes: int = 0  # host <-> device, as the transfer ledger counts them
    compiles: int = 0  # PJRT compiles (a cache hit is not one)
    compile_s: float = 0.0  # every compile stage's time (lower, compile, cache lookup)
    need_bytes: int = 0  # per device, the largest a call needs beyond the resident state
    collective_bytes: int = 0  # per device, what its calls' collectives moved over a mesh


figures: dict[str, GraphFigures] = {}


def start() -> None:
    """Figures from zero, ranges on."""
    global active
    figures.clear()
    active = True


def stop() -> None:
    global active
    active = False


@contextlib.contextmanager
def span(what: str, graph: str):
    """A named host range, in jax's trace and in torch.profiler's."""
    import jax
    import torch

    name = f"tpu_inductor {what} {graph}"
    with jax.profiler.TraceAnnotation(name), torch.profiler.record_function(name):
        yield


def called(
    graph: str, host_s: float, device_s: float, crossed: int, need: int, collective: int = 0
) -> None:
    """One call of `graph`: its host and device seconds, bytes crossed, memory need, and the
    bytes its collectives moved per device."""
    found = figures.setdefault(graph, GraphFigures())
    found.collective_bytes += collective
    found.calls += 1
    found.host_s += host_s
    found.device_s += device_s
    found.crossed_bytes += crossed
    found.need_bytes = max(found.need_bytes, need)


def compiled(graph: str, stage: str, seconds: float) -> None:
    """A compile stage of `graph` took `seconds` (a "pjrt_compile" stage is one compile)."""
    found = figures.setdefault(graph, GraphFigures())
    found.compiles += stage == "pjrt_compile"
    found.compile_s += seconds
