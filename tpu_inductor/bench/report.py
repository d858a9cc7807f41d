"""The benchmark's report (`tpu-inductor bench`, bench/harness.py's `run`): the machine and
versions it ran on, geometric means and warnings over the cases, and the outputs: the markdown
table, the speedup chart, the JSON file.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import sys

import torch

from tpu_inductor.version import __version__

NOISY = 0.10  # others' share of the machine's CPU above which a case is flagged as noisy
_MIN_LOAD_WINDOW_S = 0.5  # /proc counts 10 ms ticks: shorter windows say little about load


def _machine(pjrt_device: str | None) -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    machine = {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "platform": platform.platform(),
    }
    if pjrt_device is not None:
        machine["pjrt_device"] = pjrt_device
    return machine


def _versions() -> dict:
    import jax
    import numpy

    return {
        "tpu_inductor": __version__,
        "torch": torch.__version__,
        "jax": jax.__version__,
        "numpy": numpy.__version__,
        "python": sys.version.split()[0],
    }


def _geomeans(cases: list[dict], modes) -> dict:
    """Per task: the geometric mean over model cases (not overhead ones) of each mode's ratios,
    over the cases that have the ratio; the models of the others are listed as "left_out"."""
    result: dict[str, dict] = {}
    for task in dict.fromkeys(c["task"] for c in cases):
        rows = [c for c in cases if c["task"] == task and c["kind"] == "model"]
        for mode in modes:
            for ratio in ("vs_eager", "vs_inductor"):
                values = {c["model"]: c["modes"].get(mode, {}).get(ratio) for c in rows}
                measured = [v for v in values.values() if v]
                if not measured:
                    continue
                entry = result.setdefault(task, {}).setdefault(mode, {})
                entry[ratio] = math.exp(statistics.fmean(math.log(v) for v in measured))
                left_out = [model for model, v in values.items() if not v]
                if left_out:
                    entry.setdefault("left_out", {})[ratio] = left_out
    return result


def _others_share(case: dict) -> float | None:
    """Others' share of the machine's CPU while the case was timed; None if not measurable."""
    load = case.get("load", {})
    return load["others_fraction"] if load.get("wall_s", 0.0) >= _MIN_LOAD_WINDOW_S else None


def _warnings(cases: list[dict]) -> list[str]:
    warnings = []
    for case in cases:
        label = f"{case['model']} ({case['task']})"
        share = _others_share(case)
        if share is not None and share > NOISY:
            warnings.append(
                f"{label}: other processes used {share:.0%} of the machine's CPU while timing; "
                "contention flatters XLA and hurts eager and Inductor: rerun on a quiet machine."
            )
        for mode, result in case["modes"].items():
            if "error" in result:
                warnings.append(f"{label}: {mode} failed: {_one_line(result['error'])}")
        if "error" in case:
            warnings.append(f"{label}: {case['error']}")
    return warnings


def _one_line(text: str, limit: int = 160) -> str:
    """The first line of an error message, shortened, for a table cell or a warning."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(report: dict) -> str:
    """The report as markdown: a header, the results table, cold-start stages, warnings."""
    machine, versions = report["machine"], report["versions"]
    settings = report["settings"]
    lines = [
        f"## tpu-inductor bench, {report['created']}",
        "",
        f"{machine['cpu']}, {machine['cpus']} CPUs, torch threads {machine['torch_threads']}"
        + (f", PJRT {machine['pjrt_device']}" if "pjrt_device" in machine else "")
        + f"; torch {versions['torch']}, jax {versions['jax']}, tpu_inductor "
        f"{versions['tpu_inductor']}. Median of {settings['runs']} interleaved samples after "
        f"{settings['warmup']} warm-up calls; spread = interquartile range; speedup = that "
        "mode's median / this median. First call: compile caches "
        + ("off." if settings["cold"] else "as they were (--warm-caches)."),
        f"numpy sgemm peak ({settings['peak_size']}²): "
        f"{report['sgemm_peak_flops'] / 1e9:.1f} GFLOP/s.",
        "",
        "| model | task | mode | median | spread (IQR) | vs eager | vs inductor | first call "
        "| GFLOP/s | % peak | max abs err | others' CPU |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in report["cases"]:
        load = _others_share(case)
        load_text = "-" if load is None else f"{load:.0%}"
        if "error" in case:
            lines.append(f"| {case['model']} | {case['task']} | - | {case['error']} |||||||||")
        for mode, r in case["modes"].items():
            head = f"| {case['model']} | {case['task']} | {mode} "
            if "median_s" not in r:
                lines.append(head + f"| {_one_line(r.get('error', 'no samples'))} |||||||||")
                continue
            measured = case["kind"] == "model" and case["flops"]  # overhead cases: no FLOP/s
            rate = case["flops"] / r["median_s"] if measured else None
            peak = report["sgemm_peak_flops"]
            error = r.get("max_abs_err")
            lines.append(
                head + f"| {_time(r['median_s'])} | {_time(r['q3_s'] - r['q1_s'])} "
                f"| {_ratio(r.get('vs_eager'))} | {_ratio(r.get('vs_inductor'))} "
                f"| {_time(r['cold_s'])} | {'-' if rate is None else f'{rate / 1e9:.1f}'} "
                f"| {'-' if rate is None else f'{rate / peak:.0%}'} "
                f"| {'-' if error is None else f'{error:.1e}'} | {load_text} |"
            )
    for task, modes in report["geomean"].items():
        parts = [
            f"{mode} {_ratio(r.get('vs_eager'))} vs eager, {_ratio(r.get('vs_inductor'))} "
            "vs inductor"
            for mode, r in modes.items()
        ]
        models = [c for c in report["cases"] if c["task"] == task and c["kind"] == "model"]
        left_out = list(
            dict.fromkeys(
                m for r in modes.values() for ms in r.get("left_out", {}).values() for m in ms
            )
        )
        note = (
            f" ({len(left_out)} of {len(models)} models left out, without a result: "
            f"{', '.join(left_out)})"
            if left_out
            else ""
        )
        lines += ["", f"Geometric mean over models ({task}): " + "; ".join(parts) + note + "."]
    lines += _stage_table(report["cases"])
    if report["warnings"]:
        lines += ["", "Warnings:", *(f"- {w}" for w in report["warnings"])]
    return "\n".join(lines) + "\n"


def _stage_table(cases: list[dict]) -> list[str]:
    rows = [(c, c["modes"]["tpu_inductor"]) for c in cases if "tpu_inductor" in c["modes"]]
    rows = [(c, r) for c, r in rows if "cold_stages_s" in r]
    if not rows:
        return []
    names = list(dict.fromkeys(n for _, r in rows for n in r["cold_stages_s"]))
    names.sort(key=lambda n: n != "dynamo_aot")
    lines = [
        "",
        "Cold first call of tpu_inductor by stage (dynamo_aot: Dynamo + AOTAutograd + the rest, "
        "i.e. the first call less our stages and one execution):",
        "",
        "| model | task | first call | graphs | " + " | ".join(names) + " | first execution |",
        "|---|---|---:|---:|" + "---:|" * (len(names) + 1),
    ]
    for case, r in rows:
        stages = " | ".join(_time(r["cold_stages_s"].get(n)) for n in names)
        lines.append(
            f"| {case['model']} | {case['task']} | {_time(r['cold_s'])} | {r['compiled_graphs']} "
            f"| {stages} | {_time(r['first_exec_s'])} |"
        )
    return lines


def plot(report: dict, path: str) -> bool:
    """Speedup-vs-eager bars per case and mode as a PNG; False when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    cases = [c for c in report["cases"] if c["modes"]]
    modes = [m for m in report["settings"]["modes"] if m != "eager"]
    width = 0.8 / max(len(modes), 1)
    figure = Figure(figsize=(max(6.0, 1.1 * len(cases) + 2), 4.5), layout="constrained")
    axes = figure.add_subplot()
    for index, mode in enumerate(modes):
        values = [c["modes"].get(mode, {}).get("vs_eager", 0.0) for c in cases]
        positions = [i + (index - (len(modes) - 1) / 2) * width for i in range(len(cases))]
        bars = axes.bar(positions, values, width, label=mode)
        axes.bar_label(bars, fmt="%.2f", fontsize=7)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(
        range(len(cases)),
        [c["model"] + ("\n(train)" if c["task"] == "train" else "") for c in cases],
        fontsize=8,
    )
    axes.set_ylabel("speedup vs eager (higher is better)")
    busiest = max((_others_share(c) or 0.0 for c in cases), default=0.0)
    axes.set_title(
        f"tpu-inductor bench, {report['created'][:10]}, {report['machine']['cpu']}\n"
        f"other processes' CPU while timing: up to {busiest:.0%} of the machine",
        fontsize=10,
    )
    axes.legend()
    figure.savefig(path, dpi=120)
    return True


def write_outputs(report: dict, text: str, json_path: str | None, markdown_path: str | None):
    """Print a benchmark's table; write the report as JSON and the table as markdown if asked."""
    import json
    from pathlib import Path

    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
    if markdown_path:
        Path(markdown_path).write_text(text)
