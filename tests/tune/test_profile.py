"""`tpu_inductor.profile` and `tpu-inductor profile`: the trace holds one "call" range per
compiled call (its send, execute and receive inside it), one per compile stage and eager
region, named as compile records name graphs; the table's figures add up to the process's
ledgers; ranges show in torch.profiler too; off, the hooks do nothing.

Perfetto's Python TraceProcessor fetches its trace_processor_shell binary from Google's storage
at first use, which this CI cannot reach: the test reads the trace jax writes for Perfetto
(perfetto_trace.json.gz, Chrome's JSON trace format, which Perfetto's UI and trace processor
open) itself.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tpu_inductor
from tests.backend.test_fallback import _uses_unsupported_op
from tests.helpers import assert_same, compile_tpu
from tpu_inductor import cli
from tpu_inductor.debug import profiling
from tpu_inductor.exc import TpuInductorError

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
STEPS = 3


def _slices(trace) -> list[dict]:
    """The complete ("X") events of a Chrome JSON trace that tpu_inductor named."""
    events = json.load(gzip.open(trace))["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e["name"].startswith("tpu_inductor ")]


def _train(model, x):
    step = compile_tpu(lambda x: model(x).square().mean())
    for _ in range(STEPS):
        step(x).backward()


@pytest.fixture
def model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_one_call_slice_per_compiled_call_and_the_table_adds_up(tmp_path, model):
    x = torch.randn(7, 8)  # a size no other test compiles: no compile of this process's cache
    compiles = tpu_inductor.compiles()
    with tpu_inductor.profile(tmp_path) as found:
        _train(model, x)
    graphs = found.graphs
    assert sorted(name.split("_")[0] for name in graphs) == ["backward", "forward"]
    slices = _slices(found.trace)
    counted = collections.Counter(s["name"] for s in slices)
    for name, figures in graphs.items():
        assert figures["calls"] == STEPS
        for what in ("call", "send", "execute", "receive"):
            assert counted[f"tpu_inductor {what} {name}"] == STEPS, (what, counted)
        assert counted[f"tpu_inductor compile {name} pjrt_compile"] == figures["compiles"] == 1
        assert figures["device_ms"] > 0 and figures["host_ms"] > 0
    # each call's execute range lies inside that call's range, on its thread
    calls = [s for s in slices if s["name"].startswith("tpu_inductor call ")]
    for execute in (s for s in slices if s["name"].startswith("tpu_inductor execute ")):
        graph = execute["name"].rsplit(" ", 1)[1]
        assert any(
            c["name"].endswith(f" {graph}")
            and c["tid"] == execute["tid"]
            and c["ts"] <= execute["ts"]
            and execute["ts"] + execute["dur"] <= c["ts"] + c["dur"]
            for c in calls
        )
    totals = found.totals
    assert totals["compiles"] == tpu_inductor.compiles() - compiles == 2
    crossed = tpu_inductor.transfers()
    every = sum(n for kinds in crossed.values() if isinstance(kinds, dict) for n in kinds.values())
    assert totals["crossed_bytes"] == every == sum(g["crossed_bytes"] for g in graphs.values())
    assert every > 0
    written = json.loads((tmp_path / "profile.json").read_text())
    assert written["graphs"] == graphs
    assert all(name in (tmp_path / "profile.md").read_text() for name in graphs)
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))  # TensorBoard's profile plugin


def test_ranges_show_in_torch_profiler(tmp_path, model):
    x = torch.randn(5, 8)
    with torch.profiler.profile() as torch_profile, tpu_inductor.profile(tmp_path) as found:
        _train(model, x)
    names = collections.Counter(e.name for e in torch_profile.events())
    for graph in found.graphs:
        assert names[f"tpu_inductor call {graph}"] == STEPS


def test_an_eager_region_is_a_range(tmp_path):
    x = torch.randn(16)
    with tpu_inductor.profile(tmp_path) as found:
        out = compile_tpu(_uses_unsupported_op)(x)
    assert_same(out, _uses_unsupported_op(x))
    counted = collections.Counter(s["name"].split(" ")[1] for s in _slices(found.trace))
    assert counted["eager"] == 1 and counted["call"] == len(found.graphs) >= 1


def test_off_the_hooks_do_nothing(monkeypatch, model):
    def no_range(*_):
        raise AssertionError("a range opened with profiling off")

    monkeypatch.setattr(profiling, "span", no_range)
    profiling.figures.clear()
    _train(model, torch.randn(5, 8))
    assert not profiling.active and profiling.figures == {}


def test_profiles_do_not_nest(tmp_path):
    with tpu_inductor.profile(tmp_path / "a"):
        with pytest.raises(TpuInductorError, match="on already"):
            with tpu_inductor.profile(tmp_path / "b"):
                pass


def test_the_profile_command_runs_a_script_with_its_arguments(tmp_path, capsys):
    script = tmp_path / "step.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import torch

            f = torch.compile(torch.sin, backend="tpu_inductor")
            for _ in range(int(sys.argv[1])):
                f(torch.ones(4))
            """
        )
    )
    out = tmp_path / "profile"
    assert cli.main(["profile", "--out", str(out), str(script), "2"]) == 0
    graphs = json.loads((out / "profile.json").read_text())["graphs"]
    assert [g["calls"] for g in graphs.values()] == [2]
    assert "| graph | calls |" in capsys.readouterr().out


def test_a_call_over_a_mesh_counts_its_collectives(tmp_path):
    """8 virtual devices (a process of its own: the count is fixed when jax starts): each call
    adds the bytes its compile record's collectives report gives."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    program = root / "tests" / "tune" / "programs" / "sharded_profile.py"
    done = subprocess.run(
        [sys.executable, str(program), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.splitlines()[-1])
    assert facts["reported"]
    for graph, per_call in facts["reported"].items():
        assert per_call > 0 and facts["graphs"][graph]["collective_bytes"] == 3 * per_call
