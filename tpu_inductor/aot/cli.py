"""`tpu-inductor compile | run | inspect`: the ahead-of-time compiler's commands (aot/compile.py,
aot/loader.py)."""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path

import torch

from tpu_inductor.aot import artifact as aot
from tpu_inductor.aot import buckets as aot_buckets
from tpu_inductor.aot import compile as aot_compile
from tpu_inductor.aot import loader as aot_loader
from tpu_inductor.cache.serialize import dtype_name
from tpu_inductor.exc import OptionError
from tpu_inductor.progress import progress_bar
from tpu_inductor.sharding.mesh import Mesh, Plan, parse_mesh, parse_shard


def add_subcommands(commands) -> None:
    """Add `compile`, `run` and `inspect` to the `tpu-inductor` parser."""
    comp = commands.add_parser("compile", help="compile a model ahead of time into a directory")
    comp.add_argument("target", help="module:factory (returns an nn.Module) or a saved .pt2")
    comp.add_argument("--input", action="append", required=True, metavar="NAME:DTYPE[SHAPE]")
    comp.add_argument("--bucket", action="append", default=[], metavar="DIM=A,B,C")
    comp.add_argument(
        "--plan", metavar="FILE", help="buckets from an auto bucket plan (tpu_inductor.save_plans)"
    )
    comp.add_argument("--platform", choices=sorted(aot.PLATFORMS))
    comp.add_argument("--x64", choices=("keep", "narrow"), default="keep")
    comp.add_argument(
        "--mesh", metavar="AXIS=N[,AXIS=N]", help="split the inputs over a device mesh"
    )
    comp.add_argument(
        "--shard",
        action="append",
        default=[],
        metavar="NAME:SPEC",
        help="an input's mesh axis (or -) per dim; default: its first dim over the first axis",
    )
    comp.add_argument("--out", required=True)
    comp.set_defaults(run=_cli_compile)
    run = commands.add_parser("run", help="run an artifact on inputs from an .npz file")
    run.add_argument("directory")
    run.add_argument("--input", required=True, help=".npz file with one array per input name")
    run.add_argument("--out", help="write the outputs to this .npz file")
    run.set_defaults(run=_cli_run)
    inspect = commands.add_parser("inspect", help="describe an artifact directory")
    inspect.add_argument("directory")
    inspect.set_defaults(run=_cli_inspect)


def _cli_compile(args) -> int:
    if "" not in sys.path:
        sys.path.insert(0, "")  # module:factory targets are found from the current directory
    inputs = [aot.parse_input(text) for text in args.input]
    buckets = aot_buckets.buckets_from_plan(args.plan, inputs) if args.plan else {}
    buckets.update(aot.parse_bucket(text) for text in args.bucket)  # --bucket wins
    if args.shard and not args.mesh:
        raise OptionError("tpu-inductor: --shard needs a --mesh to split over.")
    plan = None
    if args.mesh:
        shards = tuple(parse_shard(text) for text in args.shard)
        plan = Plan(parse_mesh(args.mesh), shards)

    total = math.prod(len(sizes) for sizes in buckets.values())
    with progress_bar(total, unit="bucket") as advance:
        path = aot_compile.compile_model(
            aot_compile.load_target(args.target),
            inputs,
            args.out,
            buckets=buckets,
            platform=args.platform,
            x64=args.x64,
            plan=plan,
            command=shlex.join(["tpu-inductor", *sys.argv[1:]]),
            progress=advance,
        )
    print(f"wrote {path.parent}")
    return 0


def _cli_run(args) -> int:
    import numpy as np

    artifact = aot_loader.load(args.directory)
    with np.load(args.input) as data:
        values = {name: torch.from_numpy(data[name]) for name in data.files}
    from torch.utils._pytree import tree_flatten

    outputs, _ = tree_flatten(artifact(**values))
    for number, out in enumerate(outputs):
        print(f"output {number}: {dtype_name(out.dtype)}{list(out.shape)}")
    if args.out:
        path = args.out if args.out.endswith(".npz") else f"{args.out}.npz"  # as np.savez names it
        np.savez(path, *[o.detach().numpy() for o in outputs])
        print(f"wrote {path}")
    return 0


def _cli_inspect(args) -> int:
    directory = Path(args.directory)
    manifest = aot_loader.read_manifest(directory)
    print(f"artifact:  {directory}  (format {manifest['format']})")
    mesh = Mesh(tuple(map(tuple, manifest["mesh"]))) if manifest.get("mesh") else "none"
    print(f"platform:  {manifest['platform']}   x64: {manifest['x64']}   mesh: {mesh}")
    print("versions:  " + ", ".join(f"{k} {v}" for k, v in manifest["versions"].items()))
    for spec in manifest["inputs"]:
        print(f"input:     {spec['name']}: {spec['dtype']}{spec['shape']}")
    padding = manifest.get("padding") or {}
    if "refused" in padding:
        print(f"padding:   none, every bucket serves its exact sizes: {padding['refused']}")
    for number, entry in enumerate(manifest["entries"]):
        outs = ", ".join(f"{s['dtype']}{s['shape']}" for s in entry["lowered"]["output_specs"])
        exe = "executable" if entry["executable"] else "StableHLO only"
        serves = f"  serves {_served(manifest, entry)}" if entry.get("padded") else ""
        print(f"bucket {number}:  {entry['sizes'] or 'static'}{serves} → {outs}  ({exe})")
    present = [directory / n for n in manifest["files"] if (directory / n).is_file()]
    total = sum(p.stat().st_size for p in present)
    missing = len(manifest["files"]) - len(present)
    print(
        f"files:     {len(manifest['files'])}, {total / 2**20:.1f} MiB"
        + (f" ({missing} missing: the artifact is damaged)" if missing else "")
    )
    return 0


def _served(manifest: dict, entry: dict) -> str:
    """The sizes a padded bucket serves, per dim: from above the next smaller bucket to its own."""
    ranges = []
    for dim, size in entry["sizes"].items():
        below = [b for b in manifest["buckets"][dim] if aot_buckets.SMALLEST <= b < size]
        ranges.append(f"{dim}={max(below) + 1 if below else aot_buckets.SMALLEST}..{size}")
    return " ".join(ranges)
