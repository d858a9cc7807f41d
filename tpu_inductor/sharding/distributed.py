"""Several processes, one mesh: PJRT's multi-process runtime (`jax.distributed`) under
torch.compile.

    tpu_inductor.sharding.distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=rank)
    mesh = tpu_inductor.Mesh({"data": 8})      # every process's devices, in jax.devices() order

Each process runs the same torch program; a mesh then spans the devices of all of them, each
process places the shards its own devices hold, and XLA's collectives (gloo on the CPU) connect
them. Call `initialize` before the first compile (PJRT clients are made once).

A process that dies, or stops answering, makes the others fail within `timeout_s`: jax's
coordination service ends a process whose peers stopped sending heartbeats, naming them (its
own default waits 100 s), and a watchdog here ends one that waited `timeout_s` in a mesh
execution for a peer that is alive but stalled (jax would wait forever, jax-ml/jax#38503),
naming the processes that did not reach that execution.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time

from tpu_inductor.exc import DeviceError, OptionError

_KEY = "tpu_inductor/executions/"


@dataclasses.dataclass
class _Job:
    num_processes: int
    process_id: int
    timeout_s: float
    client: object  # jax's DistributedRuntimeClient: the coordination key-value store
    executions: int = 0  # mesh executions this process has started
    published: int = 0  # the count the key-value store holds (the watchdog publishes it)
    agreements: int = 0  # `agree` calls so far (the same sequence in every process)
    waiting_since: float | None = None  # when the running one started; None: none runs


_job: _Job | None = None


def initialize(
    coordinator: str, num_processes: int, process_id: int, *, timeout_s: float = 60
) -> None:
    """Join the job of `num_processes` processes whose coordinator (process 0) listens at
    `coordinator` ("host:port"); this is process `process_id`."""
    global _job
    if _job is not None:
        raise DeviceError(
            "tpu_inductor.sharding.distributed.initialize was called twice in one process."
        )
    if not (isinstance(num_processes, int) and num_processes >= 1):
        raise OptionError(
            f"tpu_inductor.sharding.distributed: num_processes={num_processes!r}: a positive int."
        )
    if not (isinstance(process_id, int) and 0 <= process_id < num_processes):
        raise OptionError(
            f"tpu_inductor.sharding.distributed: process_id={process_id!r} must be in 0..{num_processes - 1}."
        )
    if not (isinstance(coordinator, str) and coordinator.rpartition(":")[2].isdigit()):
        raise OptionError(
            f"tpu_inductor.sharding.distributed: coordinator={coordinator!r}: expected 'host:port'."
        )
    import jax
    from jax._src import distributed, xla_bridge

    if xla_bridge.backends_are_initialized():
        raise DeviceError(
            "tpu_inductor.sharding.distributed.initialize must come before the first compile or jax "
            "call: this process's PJRT clients exist already and cannot join a job."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes,
        process_id,
        initialization_timeout=int(timeout_s),
        heartbeat_timeout_seconds=max(int(timeout_s) // 3, 2),
    )
    _job = _Job(num_processes, process_id, timeout_s, distributed.global_state.client)
    threading.Thread(target=_watch, args=(_job,), name="tpu_inductor-watchdog", daemon=True).start()


def active() -> bool:
    """Whether this process is part of a multi-process job."""
    return _job is not None


def agree(what: str, value: str) -> None:
    """Check that every process has the same `value` of `what` (called at the same point of
    the same program in each, e.g. a graph's random seed on its first call: a seed that
    differs between processes would give each process's devices other random numbers, a
    silently wrong result). A DeviceError names the processes that differ, or that did not
    reach this point within `timeout_s`."""
    job = _job
    if job is None:
        return
    job.agreements += 1
    key = f"{_KEY}agree/{job.agreements}/"
    job.client.key_value_set(key + str(job.process_id), value)
    for peer in range(job.num_processes):
        if peer == job.process_id:
            continue
        try:
            theirs = job.client.blocking_key_value_get(key + str(peer), int(job.timeout_s * 1000))
        except Exception as error:
            raise DeviceError(
                f"tpu_inductor.sharding.distributed: process {peer} did not reach the check of {what} "
                f"within {job.timeout_s:.0f} s ({error}): it stalled, died or runs another "
                "program."
            ) from error
        if theirs != value:
            raise DeviceError(
                f"tpu_inductor.sharding.distributed: {what} differs between processes: {value} in "
                f"process {job.process_id}, {theirs} in process {peer}. Every process must run "
                "the same program from the same state: call torch.manual_seed(s) with the same "
                "s in each."
            )


def execution_started() -> None:
    """Before a mesh execution: counted (the watchdog publishes the count, so a peer's
    watchdog can tell who lags; no RPC on the call path)."""
    job = _job
    if job is None:
        return
    job.executions += 1
    job.waiting_since = time.monotonic()


def execution_finished() -> None:
    if _job is not None:
        _job.waiting_since = None


def _watch(job: _Job) -> None:
    """Publish this process's execution count; end the process when a mesh execution has
    waited `timeout_s` (a stalled peer). A tick is at most 1 s, far below `timeout_s`, so a
    peer that reached the execution has published it before anyone's timeout runs out."""
    while True:
        time.sleep(min(1.0, job.timeout_s / 4))
        started = job.executions
        if started != job.published:
            try:
                job.client.key_value_set(
                    f"{_KEY}{job.process_id}", str(started), allow_overwrite=True
                )
                job.published = started
            except Exception:  # the service is gone: its own heartbeat check ends the job
                pass
        since = job.waiting_since
        if since is None or time.monotonic() - since < job.timeout_s:
            continue
        behind = []
        for peer in range(job.num_processes):
            if peer == job.process_id:
                continue
            try:
                reached = int(job.client.key_value_try_get(f"{_KEY}{peer}"))
            except Exception:  # not published yet (NOT_FOUND), or the service is gone
                reached = 0
            if reached < job.executions:
                behind.append(peer)
        sys.stderr.write(
            f"tpu_inductor: process {job.process_id} waited {job.timeout_s:.0f} s in mesh "
            f"execution {job.executions} for process(es) {behind or 'unknown'} of "
            f"{job.num_processes}, which did not reach it: stalled or dead. Exiting: a "
            "collective cannot be cancelled, and waiting longer would hang the job.\n"
        )
        sys.stderr.flush()
        os._exit(70)
