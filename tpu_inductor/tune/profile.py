"""`with tpu_inductor.profile(dir):` and `tpu-inductor profile SCRIPT [ARGS]`: where a step goes.

Inside the block, jax's profiler traces the devices and the host (`dir/plugins/profile/<run>/`:
`*.xplane.pb` for TensorBoard's profile plugin, `perfetto_trace.json.gz` for Perfetto), and
every compiled graph's call, compile stage and eager region is a named host range there and in
`torch.profiler` (debug/profiling.py names them). At its end, a table per graph (calls, device
and host milliseconds, bytes crossed, compiles, the memory a call needs per device, and over a
mesh the bytes its collectives moved per device) and the
process's figures (compiles, bytes crossed by kind, per-device peak estimate, each bucketed
graph's buckets and padded share) are written to
`dir/profile.md` and `dir/profile.json`, and kept on the object the block yields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from tpu_inductor.debug import profiling
from tpu_inductor.exc import TpuInductorError
from tpu_inductor.runtime import buckets, devices, ledger, memory


@dataclasses.dataclass
class Profile:
    """What a profile found: `graphs` (name → figures), the process's `totals`, the trace."""

    dir: Path
    graphs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    totals: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def trace(self) -> Path | None:
        """The Perfetto trace (Chrome JSON, gzipped) of the last run in `dir`."""
        found = sorted(self.dir.glob("plugins/profile/*/perfetto_trace.json.gz"))
        return found[-1] if found else None

    def markdown(self) -> str:
        """The per-graph table and the process's figures, as markdown."""
        lines = [
            "| graph | calls | device ms | host ms | bytes crossed | compiles | compile s "
            "| need bytes/device | collective bytes/device |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, g in self.graphs.items():
            lines.append(
                f"| {name} | {g['calls']} | {g['device_ms']:.2f} | {g['host_ms']:.2f} "
                f"| {g['crossed_bytes']:,} | {g['compiles']} | {g['compile_s']:.2f} "
                f"| {g['need_bytes']:,} | {g['collective_bytes']:,} |"
            )
        t = self.totals
        peak = ", ".join(f"{d} {b:,} bytes" for d, b in t["peak_bytes"].items()) or "-"
        lines += [
            "",
            f"compiles: {t['compiles']}; bytes crossed: {t['crossed_bytes']:,} "
            f"({_kinds(t['transfers'])}); peak per device (estimate): {peak}",
        ]
        for b in t["buckets"]:
            lines.append(
                f"bucketed {b['graph']}: {len(b['buckets'])} bucket(s) "
                f"{', '.join(b['buckets'])}; padded share {b['padded_share']:.1%}"
            )
        lines.append(f"trace: {self.trace}")
        return "\n".join(lines) + "\n"


def _kinds(transfers: dict) -> str:
    parts = [f"{d} {k} {n:,}" for d, kinds in _directions(transfers) for k, n in kinds.items() if n]
    return ", ".join(parts) or "none"


def _crossed(transfers: dict) -> int:
    return sum(n for _, kinds in _directions(transfers) for n in kinds.values())


def _directions(transfers: dict):
    """(direction, {kind: bytes}) of a `transfers()` dict (its "calls" count left out)."""
    return ((d, kinds) for d, kinds in transfers.items() if isinstance(kinds, dict))


@contextlib.contextmanager
def profile(dir: str | os.PathLike, *, python: bool = False):
    """Profile the block into `dir`: a trace (jax's profiler, with tpu_inductor's ranges; with
    `python`, every Python call too) and a table per graph (profile.md, profile.json). Yields
    the `Profile`, filled at the end. The process's transfer ledger, memory peak and bucket
    report start again from zero at its start (reset_transfers, reset_memory_peak)."""
    import jax

    if profiling.active:
        raise TpuInductorError("tpu_inductor.profile: a profile is on already; nest none")
    found = Profile(Path(dir))
    found.dir.mkdir(parents=True, exist_ok=True)
    compiles = devices.stats["pjrt_compiles"]
    ledger.reset()
    memory.reset_peak()
    buckets.clear_report()
    options = jax.profiler.ProfileOptions()
    # Python's tracer (every Python call a range) fills the trace's 1,000,000 events within a
    # step, the ranges of the graphs dropped: on only when asked for.
    options.python_tracer_level = int(python)
    jax.profiler.start_trace(str(found.dir), create_perfetto_trace=True, profiler_options=options)
    profiling.start()
    try:
        yield found
    finally:
        profiling.stop()
        jax.profiler.stop_trace()
        transfers = ledger.transfers()
        found.graphs = {
            name: {
                "calls": g.calls,
                "device_ms": 1e3 * g.device_s,
                "host_ms": 1e3 * g.host_s,
                "crossed_bytes": g.crossed_bytes,
                "compiles": g.compiles,
                "compile_s": g.compile_s,
                "need_bytes": g.need_bytes,
                "collective_bytes": g.collective_bytes,
            }
            for name, g in profiling.figures.items()
        }
        found.totals = {
            "compiles": devices.stats["pjrt_compiles"] - compiles,
            "crossed_bytes": _crossed(transfers),
            "transfers": transfers,
            "peak_bytes": memory.memory()["peak"],
            "buckets": buckets.report(),
        }
        facts = {"graphs": found.graphs, "totals": found.totals, "trace": str(found.trace)}
        (found.dir / "profile.json").write_text(json.dumps(facts, indent=1) + "\n")
        (found.dir / "profile.md").write_text(found.markdown())


def run_script(script: str, args: list[str]) -> None:
    """Run a Python file as `python SCRIPT ARGS` would (as __main__, its argv, its folder on
    sys.path); its own `sys.exit(0)` ends it quietly."""
    saved = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        sys.argv, sys.path[:] = saved


def add_subcommands(commands) -> None:
    """Add `tpu-inductor profile` to the CLI."""
    import argparse

    parser = commands.add_parser(
        "profile",
        help="run a script under tpu_inductor.profile: a Perfetto trace and a table per graph",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="tpu_inductor_profile", help="the profile's folder")
    parser.add_argument("--python", action="store_true", help="trace every Python call too")
    parser.add_argument("script", help="the Python file to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    parser.set_defaults(run=_main)


def _main(args) -> int:
    if not Path(args.script).is_file():
        raise FileNotFoundError(f"no such script: {args.script}")
    with profile(args.out, python=args.python) as found:
        run_script(args.script, args.args)
    print(found.markdown(), end="")
    return 0
