"""`tpu-inductor bench`: eager vs Inductor vs tpu_inductor, measured honestly in one process.

Per case (a model, for inference or a training step) every mode gets a cold first call
(compile caches off: Inductor in a fresh cache directory, tpu_inductor with `cache=False`),
then warm-up calls, then N timed samples taken interleaved (eager, inductor, tpu_inductor,
eager, ...) so that all modes see the same machine. A sample averages `number` calls, chosen
in warm-up so that one sample lasts at least 5 ms (tiny overhead cases need many calls), and
follows at least 20 ms of untimed calls of the same mode: torch's OpenMP threads spin for a
while after an eager or Inductor call, and a sample must not pay for another mode's threads.

Reported per case and mode: median and interquartile range of the samples; speedups against
eager and Inductor (their median / this median); the cold first call, for tpu_inductor broken
into stages from `debug.records` (Dynamo + AOTAutograd is what remains of the first call after
our stages and one execution, the second call's time); the FLOP/s achieved (torch's
FlopCounterMode count of one eager step) against a numpy sgemm peak measured in the same run;
max abs difference from eager (inference); and the CPU that other processes used during
warm-up and samples (from /proc), flagged when it exceeds 10% of the machine.

A training step is forward + backward + AdamW; the optimizer step runs in eager torch in every
mode, each mode on its own copy of the model.

The shapes cases (`shapes-generate`, `shapes-train`, `shapes-precompile`) run bench_shapes'
workloads instead: compiles, seconds and padded share per shape policy and Inductor.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import logging
import math
import os
import statistics
import time
from collections.abc import Callable

import torch

from tpu_inductor.bench import models as bench_models
from tpu_inductor.bench.report import _geomeans, _machine, _one_line, _versions, _warnings
from tpu_inductor.debug import records as debug
from tpu_inductor.exc import BenchError

log = logging.getLogger(__name__)

MODES = ("eager", "inductor", "tpu_inductor")
SCHEMA = "tpu-inductor-bench/1"
_MIN_SAMPLE_S = 0.005  # a timed sample repeats the call until it lasts at least this long
# Untimed calls of a mode right before each of its samples, at least this long: the previous
# mode's worker threads (torch's OpenMP, XLA's Eigen) spin for a few ms after their last call
# and would otherwise bill the next mode's sample for it.
_SETTLE_S = 0.02
_MAX_NUMBER = 10_000


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one benchmark run measures."""

    models: tuple[str, ...] = bench_models.STANDARD_SET
    modes: tuple[str, ...] = MODES
    runs: int = 10  # timed samples per mode
    warmup: int = 2  # untimed calls per mode after the first
    train: bool = False  # also time a training step per model
    peak_size: int = 2048  # n of the n x n numpy sgemm that measures the machine's peak
    threads: int | None = None  # torch.set_num_threads, if given
    cold: bool = True  # first calls with compile caches off (False: the caches as they are)


def progress_steps(settings: Settings) -> int:
    """How many times `run` calls `progress` (for a progress bar's total)."""
    tasks = sum(len(_tasks(bench_models.resolve(name), settings.train)) for name in settings.models)
    return 1 + tasks * (2 * len(settings.modes) + settings.runs)


def run(settings: Settings, progress: Callable[[str], None] = lambda _step: None) -> dict:
    """Run the benchmark; returns the report (see `SCHEMA`, written as JSON by the CLI)."""
    specs = [bench_models.resolve(name) for name in settings.models]  # bad names fail first
    unknown = [m for m in settings.modes if m not in MODES]
    if unknown or not settings.modes:
        what = f"unknown mode(s) {unknown}" if unknown else "no modes given (--modes is empty)"
        raise BenchError(f"tpu-inductor bench: {what}; modes: {', '.join(MODES)}.")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    progress(f"sgemm peak ({settings.peak_size}x{settings.peak_size})")
    peak = sgemm_peak(settings.peak_size)
    pjrt_device = _import_compilers(settings.modes)
    cases = []
    for spec in specs:
        for task in _tasks(spec, settings.train):
            cases.append(_run_case(spec, task, settings, progress))
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": _machine(pjrt_device),
        "versions": _versions(),
        "settings": dataclasses.asdict(settings),
        "sgemm_peak_flops": peak,
        "cases": cases,
        "geomean": _geomeans(cases, settings.modes),
        "warnings": _warnings(cases),
    }


def _import_compilers(modes) -> str | None:
    """Import each compiler and start the PJRT client, so no case's first call pays for that;
    returns the PJRT device tpu_inductor runs on (None without that mode)."""
    if "inductor" in modes:
        import torch._inductor.compile_fx  # noqa: F401
    if "tpu_inductor" not in modes:
        return None
    from tpu_inductor.config import Options
    from tpu_inductor.exc import DeviceError
    from tpu_inductor.lowering import interpreter  # noqa: F401
    from tpu_inductor.runtime import devices

    wanted = Options.from_user().device  # TPU_INDUCTOR_DEVICE, as the cases' compiles see it
    try:
        return str(devices.select_device(wanted))
    except DeviceError:  # each case's tpu_inductor mode fails and says why
        return f"{wanted} (not present here)"


def _tasks(spec: bench_models.ModelSpec, train: bool) -> tuple[str, ...]:
    return ("inference", "train") if train and spec.kind == "model" else ("inference",)


# --- one case -------------------------------------------------------------------------------


def _run_case(spec, task: str, settings: Settings, progress) -> dict:
    case = {"model": spec.name, "task": task, "kind": spec.kind, "modes": {}}
    steps_left = 2 * len(settings.modes) + settings.runs
    with _names_the_model(spec.name, "building it"):
        model, inputs = bench_models.build(spec)
    if task == "train" and not _trainable(model):
        case["error"] = "no trainable parameters: training step skipped"
        for _ in range(steps_left):
            progress(f"{spec.name} {task}: skipped")
        return case
    torch._dynamo.reset()
    with torch.enable_grad() if task == "train" else torch.no_grad():
        with _names_the_model(spec.name, "calling it in eager torch"):
            reference = model(*inputs) if task == "inference" else None
        runners = {}
        for mode in settings.modes:
            progress(f"{spec.name} {task}: {mode} first call")
            try:
                runners[mode], case["modes"][mode] = _first_call(
                    mode, model, inputs, task, settings.cold
                )
            except Exception as e:  # one mode failing must not hide the others' numbers
                error = _error_text(e)
                log.warning("bench: %s %s %s failed: %s", spec.name, task, mode, error)
                case["modes"][mode] = {"error": error}
            if reference is not None and mode in runners:
                case["modes"][mode]["max_abs_err"] = _max_abs_diff(runners[mode][1], reference)
        numbers = {}
        with CpuLoad() as load:  # warm-up and samples: compiles are over, the window is longer
            for mode, (step, _out) in runners.items():
                progress(f"{spec.name} {task}: {mode} warm-up")
                numbers[mode] = _warm_up(step, settings.warmup)
            samples = _interleaved(
                {m: (runners[m][0], numbers[m]) for m in runners},
                settings.runs,
                lambda step: progress(f"{spec.name} {task}: {step}"),
            )
        for _ in range(len(settings.modes) - len(runners)):
            progress(f"{spec.name} {task}: failed mode")
        flops = _count_flops(_make_step("eager", model, inputs, task, cold=False))
    case["load"] = load.result
    case["flops"] = flops
    for mode, times in samples.items():
        case["modes"][mode].update(_stats(times), number=numbers[mode])
    _add_ratios(case)
    torch._dynamo.reset()
    return case


@contextlib.contextmanager
def _names_the_model(name: str, doing: str):
    """A failure of the user's model code (not one mode's compile) as a BenchError naming it."""
    try:
        yield
    except BenchError:
        raise
    except Exception as e:
        raise BenchError(
            f"tpu-inductor bench: {name} failed while {doing}: {_one_line(_error_text(e))}"
        ) from e


def _error_text(error: Exception) -> str:
    """ "Type: message" of what failed: for a compiler failure Dynamo wrapped, of its cause."""
    cause = getattr(error, "inner_exception", None) or error
    return f"{type(cause).__name__}: {cause}"


def _trainable(model) -> bool:
    return isinstance(model, torch.nn.Module) and any(p.requires_grad for p in model.parameters())


def _make_step(mode: str, model, inputs: tuple, task: str, cold: bool) -> Callable[[], object]:
    """A zero-argument callable: one inference call, or one training step on a model copy."""
    if task == "train":
        model = copy.deepcopy(model).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if mode == "eager":
        fn = model
    elif mode == "inductor":
        fn = torch.compile(model)
    else:
        options = {"cache": False} if cold else None
        fn = torch.compile(model, backend="tpu_inductor", options=options)
    if task == "inference":
        return lambda: fn(*inputs)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(fn(*inputs))
        loss.backward()
        optimizer.step()
        return loss

    return train_step


def _first_call(mode: str, model, inputs: tuple, task: str, cold: bool):
    """Make the mode's step, time its first call and the second; returns (step, output)."""
    step = _make_step(mode, model, inputs, task, cold)
    first_record = len(debug.records)
    caches = contextlib.nullcontext()
    if mode == "inductor" and cold:
        from torch._inductor.utils import fresh_cache

        caches = fresh_cache()
    with caches:
        start = time.perf_counter()
        out = step()
        cold_s = time.perf_counter() - start
    start = time.perf_counter()
    step()
    first_exec_s = time.perf_counter() - start
    result = {"cold_s": cold_s, "first_exec_s": first_exec_s}
    if mode == "tpu_inductor":
        records = debug.records[first_record:]
        stages: dict[str, float] = {}
        for record in records:
            for name, seconds in record.timings.items():
                stages[name] = stages.get(name, 0.0) + seconds
        stages["dynamo_aot"] = cold_s - sum(stages.values()) - first_exec_s
        result["cold_stages_s"] = stages
        result["compiled_graphs"] = len(records)
    return (step, out), result


def _warm_up(step, calls: int) -> int:
    """Run untimed calls; returns how many calls one timed sample should make."""
    seconds = 0.0
    for _ in range(max(calls, 1)):
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
    return min(_MAX_NUMBER, max(1, math.ceil(_MIN_SAMPLE_S / max(seconds, 1e-9))))


def _interleaved(steps: dict, runs: int, progress) -> dict[str, list[float]]:
    """`runs` rounds of one sample per mode, in order; seconds per call of each sample."""
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    for index in range(runs):
        progress(f"round {index + 1}/{runs}")
        for mode, (step, number) in steps.items():
            _settle(step)
            start = time.perf_counter()
            for _ in range(number):
                step()
            times[mode].append((time.perf_counter() - start) / number)
    return times


def _settle(step) -> None:
    """Untimed calls of one mode for at least `_SETTLE_S` (one call at least)."""
    end = time.perf_counter() + _SETTLE_S
    step()
    while time.perf_counter() < end:
        step()


def _stats(times: list[float]) -> dict:
    q1, _, q3 = (
        statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else times * 3
    )
    return {
        "median_s": statistics.median(times),
        "q1_s": q1,
        "q3_s": q3,
        "min_s": min(times),
        "max_s": max(times),
        "times_s": times,
    }


def _add_ratios(case: dict) -> None:
    modes = case["modes"]
    for name in ("eager", "inductor"):
        base = modes.get(name, {}).get("median_s")
        for result in modes.values():
            if base and "median_s" in result:
                result[f"vs_{name}"] = base / result["median_s"]


def _leaves(out) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def _loss(out) -> torch.Tensor:
    return sum(t.float().mean() for t in _leaves(out) if t.is_floating_point())


def _max_abs_diff(actual, expected) -> float | None:
    pairs = list(zip(_leaves(actual), _leaves(expected)))
    if len(pairs) != len(_leaves(expected)) or len(pairs) != len(_leaves(actual)):
        return None
    return max(((a.double() - e.double()).abs().max().item() for a, e in pairs), default=0.0)


def _count_flops(step) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return int(counter.get_total_flops())


def sgemm_peak(n: int, repeats: int = 3) -> float:
    """FLOP/s of the best of `repeats` numpy float32 n x n matmuls (the machine's BLAS peak)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    a @ b  # warm-up: threads started, pages touched
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


# --- machine load ---------------------------------------------------------------------------


class CpuLoad:
    """CPU used by this process and by all others over a block (Linux /proc; else no result)."""

    def __enter__(self) -> CpuLoad:
        self.result: dict = {}
        self._start = _cpu_times()
        return self

    def __exit__(self, *exc) -> None:
        end = _cpu_times()
        if self._start is None or end is None:
            return
        wall, busy, ours = (e - s for e, s in zip(end, self._start))
        cpus = os.cpu_count() or 1
        others = max(busy - ours, 0.0) / wall if wall > 0 else 0.0
        self.result = {
            "wall_s": wall,
            "cpus": cpus,
            "ours_cores": ours / wall if wall > 0 else 0.0,
            "others_cores": others,
            "others_fraction": min(others / cpus, 1.0),
        }


def _cpu_times() -> tuple[float, float, float] | None:
    """(wall seconds, busy CPU seconds of the machine, CPU seconds of this process)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            mine = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    busy = (user + nice + system + irq + softirq + steal) / tick
    ours = (int(mine[11]) + int(mine[12])) / tick  # utime, stime (fields 14 and 15)
    return time.monotonic(), busy, ours
