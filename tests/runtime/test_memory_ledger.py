"""The memory ledger (tpu_inductor.memory(), runtime/memory.py) against real numbers: resident
parameters and optimizer state per device, the stale host bytes under host_sync="explicit",
XLA's memory analysis per executable (in compile.json and `tpu-inductor explain`), and a
parameter split over 8 virtual CPU devices counted by its shard on each."""

from __future__ import annotations

import gc
import json
import mmap
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import tpu_inductor
from tpu_inductor.debug import report

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICE = "cpu:0"


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _on_device(kind: str) -> int:
    return tpu_inductor.memory()["devices"].get(DEVICE, {}).get(kind, 0)


def _stale(kind: str) -> int:
    return tpu_inductor.memory()["host_held"]["stale"][kind]


def test_a_compiled_linear_holds_its_parameters_on_the_device():
    torch._dynamo.reset()  # (an earlier test's graphs, collected mid-test, would move `before`)
    gc.collect()
    model = nn.Linear(64, 32)
    before = _on_device("parameters")
    compiled = torch.compile(model, backend="tpu_inductor", options={"device": "cpu-copy"})
    with torch.no_grad():
        compiled(torch.randn(8, 64))
        compiled(torch.randn(8, 64))
    assert _on_device("parameters") - before == _nbytes(model.parameters())
    ledger = tpu_inductor.memory()
    assert ledger["devices"][DEVICE]["total"] == sum(
        n for kind, n in ledger["devices"][DEVICE].items() if kind != "total"
    )
    assert ledger["peak"][DEVICE] > ledger["devices"][DEVICE]["total"]
    del compiled, model  # the graph's device copies go with the parameters
    torch._dynamo.reset()
    assert _on_device("parameters") == before


def test_an_adamw_step_keeps_parameters_and_moments_on_the_device_and_none_on_the_host():
    model = nn.Linear(512, 256)
    parameters = _nbytes(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    options = {"device": "cpu-copy", "host_sync": "explicit"}
    forward = torch.compile(model, backend="tpu_inductor", dynamic=False, options=options)
    step = torch.compile(optimizer.step, backend="tpu_inductor", dynamic=False, options=options)
    tpu_inductor.sync()
    before = tpu_inductor.memory()
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        forward(torch.randn(8, 512)).sum().backward()
        step()
    after = tpu_inductor.memory()

    def grew(where: str, kind: str) -> int:
        if where == "device":
            return after["devices"][DEVICE][kind] - before["devices"].get(DEVICE, {}).get(kind, 0)
        return after["host_held"]["stale"][kind] - before["host_held"]["stale"][kind]

    assert grew("device", "parameters") == parameters
    # both moments, and AdamW's step counters (one float32 each, written on the host as well)
    assert 2 * parameters <= grew("device", "optimizer_state") <= 2 * parameters + 4 * 2
    assert grew("device", "gradients") == parameters  # the last backward's
    # The host storages left stale gave their memory back: at most the two partial pages at
    # the ends of each (weight and bias of the parameters, of the gradients, of each moment).
    page = mmap.PAGESIZE
    assert grew("host", "parameters") <= 2 * 2 * page
    assert grew("host", "optimizer_state") <= 2 * 2 * 2 * page
    assert grew("host", "gradients") <= 2 * 2 * page
    assert after["host_held"]["total"] <= 16 * page < parameters / 8
    assert tpu_inductor.sync() == 4 * parameters  # weights, gradients, both moments
    synced = tpu_inductor.memory()
    assert synced["host_held"]["stale"] == dict.fromkeys(synced["host_held"]["stale"], 0)
    # the device copies stay current after a sync: still held on the device
    assert synced["devices"][DEVICE]["parameters"] == after["devices"][DEVICE]["parameters"]


def test_the_memory_analysis_is_recorded_in_compile_json_and_explained(tmp_path):
    def chain(x, a, b, c):
        return torch.relu(torch.relu(x @ a) @ b) @ c

    options = {"device": "cpu-copy", "dump_dir": str(tmp_path)}
    compiled = torch.compile(chain, backend="tpu_inductor", dynamic=False, options=options)
    x, a, b, c = (torch.randn(128, 128) for _ in range(4))
    tpu_inductor.reset_memory_peak()
    compiled(x, a, b, c)
    (summary,) = [json.loads(p.read_text()) for p in tmp_path.glob("*/compile.json")]
    analysis = summary["memory"]
    assert analysis["temporaries"] > 0
    assert analysis["arguments"] == _nbytes([x, a, b, c])
    assert analysis["outputs"] == _nbytes([x])
    # nothing of it is resident: a call needs its arguments, temporaries and output
    assert analysis["need"] == analysis["arguments"] + analysis["temporaries"] + analysis["outputs"]
    ledger = tpu_inductor.memory()
    (ran,) = [e for e in ledger["executables"] if e["calls_since_reset"]]
    assert ran["analysis"] == {k: v for k, v in analysis.items() if k != "need"}
    resident = ledger["devices"].get(DEVICE, {}).get("total", 0)
    assert ledger["peak"][DEVICE] == resident + analysis["need"]
    assert "memory per device: arguments 262.1 KB, temporaries" in report.explain(tmp_path)


def test_a_parameter_split_over_8_devices_counts_an_eighth_on_each():
    code = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import json, torch, tpu_inductor
model = torch.nn.Linear(64, 32)
tpu_inductor.shard(model, tpu_inductor.Mesh({"model": 8}), {"weight": ("model", None)})
compiled = torch.compile(model, backend="tpu_inductor")
with torch.no_grad():
    compiled(torch.randn(4, 64))
ledger = tpu_inductor.memory()
print(json.dumps({d: kinds["parameters"] for d, kinds in ledger["devices"].items()}))
"""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    per_device = json.loads(done.stdout.splitlines()[-1])
    weight, bias = 64 * 32 * 4, 32 * 4
    assert per_device == {f"cpu:{i}": weight // 8 + bias for i in range(8)}, per_device
