"""A model placed on a mesh by tpu_inductor.shard lives on its devices only: its host tensors
hold no memory, every eager read of one raises the error that names tpu_inductor.sync (which
brings the values home, bitwise), and FSDP training holds per device about a device's share of
the state. On 8 virtual CPU devices, in a subprocess (tests/state/device_state_run.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args: str) -> dict:
    command = [sys.executable, "-m", "tests.state.device_state_run", *args]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_placed_model_holds_no_host_memory_and_every_eager_read_names_the_sync():
    found = _run("placed")
    # at most the partial pages at the ends of a storage: under 1% of the parameters here
    assert found["held"] <= 0.01 * found["nbytes"], found
    for path, outcome in found["reads"].items():
        assert "tpu_inductor.sync()" in outcome, (path, outcome)
        assert "tpu_inductor.shard placed it on a device mesh" in outcome, (path, outcome)
    # AdamW's moments of placed parameters: made as zeros on the devices, split as their
    # parameters, no host memory but the partial end pages (tpu_inductor.shard_optimizer_state)
    assert found["moments_held"] <= 0.01 * 2 * found["nbytes"], found
    assert found["moments_split_as_parameters"] and found["moments_zero"]
    assert found["equal"]  # synced: the values placed, bitwise
    assert found["saved"] > found["nbytes"]  # and torch.save writes them


def test_fsdp_training_equals_one_device_and_holds_a_devices_share_of_the_state():
    found = _run("trained", "20")
    one, fsdp = found["one"], found["fsdp"]
    for a, b in zip(fsdp["losses"], one["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b), (fsdp["losses"], one["losses"])
    # within the sharding tests' bound: twice what compiling alone moves them from eager's
    assert found["parameter_difference"] <= 2 * found["compiled_difference"], found
    state = fsdp["state_bytes"]
    # parameters, gradients and AdamW's moments: none of them held on the host
    assert fsdp["host_bytes"] <= 0.01 * state, fsdp
    # each device holds its eighth of them (every tensor's first dim divides by 8), within 5%
    for resident in fsdp["resident"]:
        assert abs(resident - state / 8) <= 0.05 * state / 8, (fsdp["resident"], state / 8)
    assert len(fsdp["resident"]) == 8
