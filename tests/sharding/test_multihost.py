"""Two processes on loopback, 4 virtual CPU devices each, one 8-device mesh
(tests/multihost_run.py): a sharded training step equals eager torch's, and a process that dies
or stalls makes its peer fail with an error naming it within 60 s."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.helpers import start_pair
from tpu_inductor.exc import OptionError
from tpu_inductor.sharding import distributed


def _job(*extra_for_process_1: str, steps: int = 3, both=(), ends=True) -> tuple[list, float]:
    """Both processes' (returncode, stdout, stderr), and when process 0 ended (time.time()).
    `both`: arguments for both processes, `extra_for_process_1` for process 1 after them;
    `ends`: process 1 ends by itself (waited for), else it is killed once process 0 ended."""
    procs = start_pair(
        lambda rank, port: [
            *(sys.executable, "-m", "tests.multihost_run", str(rank), port),
            *("--steps", str(steps), *both, *(extra_for_process_1 if rank else ())),
        ]
    )
    try:
        out0, err0 = procs[0].communicate(timeout=240)
        ended = time.time()
        if ends:  # a healthy peer: let it shut down on its own
            procs[1].wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out1, err1 = procs[1].communicate(timeout=60)
    return [(procs[0].returncode, out0, err0), (procs[1].returncode, out1, err1)], ended


def test_a_sharded_training_step_over_two_processes_equals_eager():
    results, _ = _job()
    for returncode, out, err in results:
        assert returncode == 0, err[-3000:]
        row = json.loads(out.splitlines()[-1])
        for loss, expected in row["losses"]:
            assert abs(loss - expected) <= 1e-5 * abs(expected)
        assert row["param_diff"] < 1e-6
        # the model lives on the devices: each process's hold half its parameters (every one
        # split over the 8)
        assert row["resident"] == row["parameter_bytes"] // 2, row


@pytest.mark.parametrize(
    "how, names_it",
    [
        ("--die-after", "Task 1 heartbeat timeout"),  # jax's coordination service
        ("--stall-after", "for process(es) [1] of 2, which did not reach it"),  # our watchdog
    ],
)
def test_a_process_that_dies_or_stalls_makes_its_peer_fail_naming_it_within_60_s(how, names_it):
    results, ended = _job(how, "1", steps=50, ends=False)
    returncode, _, err = results[0]
    assert returncode != 0
    assert names_it in err, err[-3000:]
    (stopped,) = [
        float(line.split()[-1]) for line in results[1][1].splitlines() if "stopped at" in line
    ]
    assert ended - stopped < 60  # the job's timeout is 20 s


def test_processes_whose_random_seeds_differ_fail_instead_of_drawing_other_numbers():
    """Each process sends the seed of a random graph's call to its own devices: on a graph's
    first call the processes check they agree (a silently different mask otherwise)."""
    same, _ = _job(both=("--dropout-seed", "7"))
    kept = []
    for returncode, out, err in same:
        assert returncode == 0, err[-3000:]
        kept.append(json.loads(out.splitlines()[-1])["kept"])
    assert kept[0] == kept[1] and 0 < kept[0] < 64
    differ, _ = _job("--dropout-seed", "8", both=("--dropout-seed", "7"))
    for returncode, _, err in differ:
        assert returncode != 0
        assert "differs between processes" in err, err[-3000:]
        assert "torch.manual_seed" in err


def test_initialize_checks_its_arguments_before_joining():
    with pytest.raises(OptionError, match="process_id=2 must be in 0..1"):
        distributed.initialize("127.0.0.1:1234", 2, 2)
    with pytest.raises(OptionError, match="expected 'host:port'"):
        distributed.initialize("localhost", 2, 0)
    with pytest.raises(OptionError, match="num_processes=0"):
        distributed.initialize("127.0.0.1:1234", 0, 0)
