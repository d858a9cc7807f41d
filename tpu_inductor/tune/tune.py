"""`tpu-inductor tune SCRIPT [ARGS] [--mesh data=2,model=4 [--memory-per-device 2GiB]]
[--platform tpu] [--budget MIN]`: record, propose, prove.

1. Record: SCRIPT runs in a process of its own (tune/record.py) with the default options, its
   compile cache off, profiled, the `auto` bucket policy recording the sizes each symbol took
   (it buckets as the default pow2 until it has a plan, so this run is the defaults' run).
2. Propose: a bucket plan from those sizes (passes/bucket_policy.BucketPlan.replan: at most as
   many buckets as pow2 used, padded work traded against a cost per compile in padded
   positions), the cost of the target platform's compile: on this machine's own platform
   measured (a compile's seconds over a padded position's device seconds, both from the
   record); for another (`--platform tpu` here) bucket_policy's DEFAULT_COMPILE_COST, and the
   report says it is an estimate. Written as `tuned.json`, which `options={"config": ...}` (or
   TPU_INDUCTOR_CONFIG) loads; beside it what the record says of precompiling, host sync and
   fusion. With `--mesh`, the sharding plan too (tune/search.py: each named plan that applies
   and fits the stated memory runs once under the mesh; the least communication that fits is
   chosen), written as the config's `sharding` record, which a script that builds its mesh
   with `tpu_inductor.auto_mesh(...)` and places its model with `tpu_inductor.shard(model,
   mesh, "auto")` receives unchanged (sharding/named.py).
3. Prove: SCRIPT runs again in a new process with TPU_INDUCTOR_CONFIG=tuned.json; the report
   (report.md, report.html: tune/report.py) sets the two runs' figures side by side.

Each run gets half of `--budget` minutes (the search's runs too); a run that fails or overruns
is a TpuInductorError with the end of its log.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tpu_inductor.config import FUSION_DEFAULTS
from tpu_inductor.exc import TpuInductorError
from tpu_inductor.passes import bucket_policy
from tpu_inductor.sharding.mesh import parse_mesh
from tpu_inductor.tune import report, search


def run(script: str, args: list[str], out: Path, env: dict[str, str], budget_s: float) -> dict:
    """One recorded run of SCRIPT (tune/record.py) into `out`: its record.json."""
    out.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parents[2])  # where this tpu_inductor is imported from
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))}
    save = "1" if "TPU_INDUCTOR_CONFIG" not in env else "0"
    command = [sys.executable, "-m", "tpu_inductor.tune.record", str(out), save, script, *args]
    log = out / "run.log"
    try:
        with log.open("w") as sink:
            done = subprocess.run(command, env=env, stdout=sink, stderr=sink, timeout=budget_s)
    except subprocess.TimeoutExpired:
        raise TpuInductorError(
            f"tpu-inductor tune: {script} ran past its {budget_s / 60:.1f} minutes (half of "
            f"--budget); give a larger --budget or a shorter run. Its log: {log}"
        ) from None
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise TpuInductorError(
            f"tpu-inductor tune: {script} failed (exit {done.returncode}); its log ({log}) "
            f"ends:\n{tail}"
        )
    return json.loads((out / "record.json").read_text())


def figures(record: dict, platform: str | None = None) -> dict[str, float]:
    """A run's figures, each the less the better (report.FIGURES names them); for a target
    `platform` other than the one it ran on, the collective bytes as its pipeline would move
    them (record.py: an estimate)."""
    graphs, totals = record["graphs"].values(), record["totals"]
    collective = sum(g["collective_bytes"] for g in graphs)
    if platform not in (None, record["platform"]):
        collective = record.get("accelerator_collective_bytes", collective)
    shares = [b["padded_share"] for b in totals["buckets"]]
    return {
        "compiles": totals["compiles"],
        "padded_share": sum(shares) / len(shares) if shares else 0.0,
        "graph_ms": sum(g["device_ms"] + g["host_ms"] for g in graphs),
        "compile_s": sum(g["compile_s"] for g in graphs),
        "wall_s": record["wall_s"],
        "crossed_bytes": totals["crossed_bytes"],
        "collective_bytes": collective,
        "peak_bytes": max(totals["peak_bytes"].values(), default=0),
    }


def compile_cost(platform: str, record: dict, plan: bucket_policy.BucketPlan) -> tuple[float, str]:
    """A compile's price in padded positions on `platform`, and how it was found."""
    default = bucket_policy.DEFAULT_COMPILE_COST
    if platform != record["platform"]:
        return default, (
            f"estimate: a {platform} compile priced at {default:,.0f} padded positions "
            f"(bucket_policy.DEFAULT_COMPILE_COST), not measured: this machine is "
            f"{record['platform']}"
        )
    graphs = record["graphs"]
    bucketed = {b["graph"] for b in record["totals"]["buckets"]}
    compiles = sum(g["compiles"] for g in graphs.values())
    compile_s = sum(g["compile_s"] for g in graphs.values())
    device_s = sum(
        g["device_ms"] / 1e3 for name, g in graphs.items() if name.split(".")[0] in bucketed
    )
    pow2 = bucket_policy.BucketPolicy("pow2", min_bucket=1)
    positions = sum(c * pow2.bucket(n) for h in plan.histogram.values() for n, c in h.items())
    if not (compiles and device_s and positions):
        return default, "estimate: nothing measured to price a compile by (no bucketed call)"
    per_position = device_s / positions
    cost = compile_s / compiles / per_position
    return cost, (
        f"measured on {platform}: a compile {compile_s / compiles:.2f} s, a padded position "
        f"{1e9 * per_position:,.1f} ns of device time: {cost:,.0f} positions"
    )


def propose(
    record: dict, plan_path: Path, platform: str
) -> tuple[dict[str, Any], list[str], list[str]]:
    """(the tuned options, what the report says of them, which figures are estimates)."""
    config: dict[str, Any] = {}
    notes, estimates = [], []
    if plan_path.exists():
        plan = bucket_policy.BucketPlan.load(plan_path)
        cost, how = compile_cost(platform, record, plan)
        estimates += [how] if how.startswith("estimate") else []
        plan.replan(compile_cost=cost)
        plan.save(plan_path)
        config["shapes"] = {"policy": "auto", "plan": str(plan_path.resolve())}
        notes.append(f"bucket plan ({plan_path.name}), a compile's cost {how}:")
        for key, sizes in plan.histogram.items():
            seen = sorted(sizes)
            chosen = plan.boundaries.get(key, ())
            notes.append(
                f"  {key}: sizes {seen[0]}..{seen[-1]} ({len(seen)} distinct, "
                f"{sum(sizes.values())} calls) -> buckets {list(chosen) or 'exact'}"
            )
        notes.append(
            "precompile: these buckets can compile at start-up, in parallel, before the first "
            "step: tpu_inductor.precompile(fn, inputs, dims, largest, shapes=<the config's "
            "shapes>)"
        )
    else:
        notes.append("no symbolic size seen: no bucket plan (every graph compiled once)")
    written_back = record["totals"]["transfers"]["device_to_host"].get("mutation", 0)
    if written_back:
        notes.append(
            f"host_sync: {written_back:,} bytes the graphs wrote crossed back to the host; "
            "host_sync='explicit' keeps them on the device until tpu_inductor.sync() (not "
            "applied: it changes when host copies are current, so the program must sync)"
        )
    fusion = FUSION_DEFAULTS.get(platform, FUSION_DEFAULTS["cpu"])
    notes.append(f"fusion: left to the platform's defaults ({platform}: {fusion})")
    return config, notes, estimates


def _host_devices(flags: str, mesh) -> str:
    """XLA_FLAGS with as many CPU devices as `mesh` has (virtual ones: a CPU-only machine can
    run the mesh's programs; other platforms ignore the flag), unless the flags say already."""
    if "xla_force_host_platform_device_count" in flags:
        return flags
    count = math.prod(size for _, size in mesh.axes)
    return f"{flags} --xla_force_host_platform_device_count={count}".strip()


def propose_sharding(
    before: dict, mesh: str, memory: int | None, run_plan, platform: str
) -> tuple[dict[str, Any], list[dict], list[str], list[str]]:
    """(the config's sharding record, the search's rows, its notes, its estimates) for the
    target `platform`."""
    chosen, rows = search.search(before, lambda r: figures(r, platform), run_plan, memory)
    stated = f"{memory:,} bytes per device stated" if memory is not None else "no memory stated"
    notes = [
        f"sharding on mesh {mesh} ({stated}): plan {chosen!r}, the least collective bytes "
        "among the plans that fit; the script receives it through auto_mesh and "
        'shard(model, mesh, "auto") with TPU_INDUCTOR_CONFIG set to this file:'
    ]
    notes += [
        f"  {r['plan']}: {r['status']}" + (f" ({r['reason']})" if "reason" in r else "")
        for r in rows
    ]
    estimates = [
        "each plan's bytes per device before compiling (parameters, gradients, optimizer "
        "state) come from the shapes and the plan's specs; only the defaults' plan's "
        "call_need was measured, so the others' estimates are lower bounds"
    ]
    if platform != before["platform"]:
        estimates.append(
            f"each plan's peak and collective bytes per device: from {before['platform']}'s "
            f"compiled modules of the same partitioned program, estimates for {platform}, whose "
            "compiler is not here: the collective bytes count each all-reduce every device "
            f"slices as the reduce-scatter {platform}'s pipeline makes of it (a shard's bytes); "
            "the peaks are XLA:CPU's memory analysis, not the target's scheduling"
        )
    return {"mesh": mesh, "plan": chosen}, rows, notes, estimates


def tune(
    script: str,
    args: list[str],
    out: Path,
    platform: str | None,
    budget_min: float,
    mesh: str | None = None,
    memory: int | None = None,
):
    """Record, propose and prove (the module's text); returns the report's facts."""
    if memory is not None and mesh is None:
        raise TpuInductorError("tpu-inductor tune: --memory-per-device needs a --mesh to search")
    drop = ("TPU_INDUCTOR_CONFIG", "TPU_INDUCTOR_SHARDING")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["TPU_INDUCTOR_CACHE"] = "0"  # both runs compile cold: their compiles compare
    if mesh is not None:
        parsed = parse_mesh(mesh)
        mesh = str(parsed)
        env["TPU_INDUCTOR_SHARDING"] = json.dumps({"mesh": mesh})
        env["XLA_FLAGS"] = _host_devices(env.get("XLA_FLAGS", ""), parsed)
    plan_path = out / "bucket_plan.json"
    plan_path.unlink(missing_ok=True)
    recording = {
        **env,
        "TPU_INDUCTOR_SHAPES": json.dumps({"policy": "auto", "plan": str(plan_path)}),
    }
    before = run(script, args, out / "before", recording, budget_min * 30)
    target = platform or before["platform"]
    config, notes, estimates = propose(before, plan_path, target)
    rows = []
    if mesh is not None:

        def run_plan(name: str) -> dict:
            placed = json.dumps({"mesh": mesh, "plan": name})
            return run(
                script,
                args,
                out / f"plan-{name}",
                {**env, "TPU_INDUCTOR_SHARDING": placed},
                budget_min * 30,
            )

        config["sharding"], rows, more, guessed = propose_sharding(
            before, mesh, memory, run_plan, target
        )
        notes, estimates = notes + more, estimates + guessed
    tuned = out / "tuned.json"
    tuned.write_text(json.dumps(config, indent=1) + "\n")
    after = run(
        script, args, out / "after", {**env, "TPU_INDUCTOR_CONFIG": str(tuned)}, budget_min * 30
    )
    facts = {
        "script": " ".join([script, *args]),
        "platform": target,
        "ran_on": before["platform"],
        "config": config,
        "config_file": str(tuned),
        "notes": notes,
        "estimates": estimates,
        "plans": rows,
        "before": figures(before, target if mesh is not None else None),
        "after": figures(after, target if mesh is not None else None),
    }
    (out / "tune.json").write_text(json.dumps(facts, indent=1) + "\n")
    (out / "report.md").write_text(report.markdown(facts))
    (out / "report.html").write_text(report.html_page(facts))
    return facts


def add_subcommands(commands) -> None:
    """Add `tpu-inductor tune` to the CLI."""
    import argparse

    parser = commands.add_parser(
        "tune",
        help="run a script, propose a config (bucket plan, ...) and prove it on a second run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="tpu_inductor_tune", help="the report's folder")
    parser.add_argument(
        "--platform", choices=("cpu", "gpu", "tpu"), help="the target (default: this machine's)"
    )
    parser.add_argument("--budget", type=float, default=30.0, help="minutes for both runs")
    parser.add_argument("--mesh", help="search the sharding plans on this mesh: data=2,model=4")
    parser.add_argument(
        "--memory-per-device", help="refuse plans that cannot fit it (2GiB, 512MiB, bytes)"
    )
    parser.add_argument("script", help="the Python file to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    parser.set_defaults(run=_main)


def _main(args) -> int:
    if not Path(args.script).is_file():
        raise FileNotFoundError(f"no such script: {args.script}")
    memory = None if args.memory_per_device is None else search.parse_bytes(args.memory_per_device)
    facts = tune(
        args.script, args.args, Path(args.out), args.platform, args.budget, args.mesh, memory
    )
    print(report.markdown(facts), end="")
    return 0
