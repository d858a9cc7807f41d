"""`tpu-inductor bench`: its arguments, and the run that measures (bench/harness.py), prints and
writes the report (bench/report.py); shapes cases go to bench/shapes.py.
"""

from __future__ import annotations

import errno
import os
import sys

from tpu_inductor.bench import harness
from tpu_inductor.bench import models as bench_models
from tpu_inductor.bench.harness import MODES, Settings, progress_steps
from tpu_inductor.bench.report import markdown, plot, write_outputs
from tpu_inductor.progress import progress_bar


def add_subcommands(commands) -> None:
    """Add `tpu-inductor bench` to the CLI."""
    import argparse

    from tpu_inductor.bench import shapes as bench_shapes

    parser = commands.add_parser(
        "bench",
        help="benchmark eager, Inductor and tpu_inductor on built-in or your own models",
        description=harness.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help="built-in names (see --list), module:factory, or shapes cases (shapes-generate, "
        "shapes-train, shapes-precompile: bench-shapes' workloads); default: the standard set",
    )
    parser.add_argument("--modes", help=f"comma-separated (default: all, {','.join(MODES)})")
    parser.add_argument("--runs", type=_positive, default=10, help="timed samples per mode")
    parser.add_argument("--warmup", type=_positive, default=2, help="warm-up calls per mode")
    parser.add_argument("--train", action="store_true", help="also time a training step")
    parser.add_argument("--threads", type=_positive, help="torch.set_num_threads(N)")
    parser.add_argument(
        "--warm-caches",
        action="store_true",
        help="time first calls with the compile caches as they are (default: caches off)",
    )
    parser.add_argument("--peak-size", type=_positive, default=2048, help="sgemm peak n")
    parser.add_argument("--json", metavar="F", help="write the report as JSON")
    parser.add_argument("--markdown", metavar="F", help="also write the markdown table to F")
    parser.add_argument("--plot", metavar="F.png", help="write speedup bars (needs matplotlib)")
    parser.add_argument("--list", action="store_true", help="list the built-in models and exit")
    bench_shapes.add_arguments(parser)
    parser.set_defaults(run=_main)


def _positive(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _main(args) -> int:
    from tpu_inductor.bench import shapes as bench_shapes

    if args.list:
        for spec in bench_models.BUILTINS.values():
            print(f"{spec.name:20} {spec.kind:9} {spec.description}")
        for case, workload in bench_shapes.CASES.items():
            print(f"{case:20} {'shapes':9} bench-shapes' {workload} workload, per shape policy")
        return 0
    shapes_workloads = bench_shapes.workloads_of(args.models)
    if shapes_workloads:
        return bench_shapes.main(args, shapes_workloads)
    settings = Settings(
        models=tuple(args.models) or bench_models.STANDARD_SET,
        modes=tuple(m.strip() for m in (args.modes or ",".join(MODES)).split(",") if m.strip()),
        runs=args.runs,
        warmup=args.warmup,
        train=args.train,
        peak_size=args.peak_size,
        threads=args.threads,
        cold=not args.warm_caches,
    )
    _prepare_outputs({"--json": args.json, "--markdown": args.markdown, "--plot": args.plot})
    with progress_bar(progress_steps(settings)) as progress:  # a BenchError: cli.main reports it
        report = harness.run(settings, progress)
    text = markdown(report)
    write_outputs(report, text, args.json, args.markdown)
    if args.plot:
        if not plot(report, args.plot):
            print(
                "note: no chart written: install matplotlib (pip install -e '.[bench]')",
                file=sys.stderr,
            )
    return 0


def _prepare_outputs(paths: dict[str, str | None]) -> None:
    """Create the folders of the output files (option → path) before the run: a path that
    cannot be written fails now, not after minutes of benchmarking (cli.main reports it)."""
    from pathlib import Path

    for option, path in paths.items():
        if not path:
            continue
        folder = Path(path).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"cannot write {option} {path}: a part of its folder is a file",
                str(folder),
            ) from None
        if Path(path).is_dir():
            raise IsADirectoryError(errno.EISDIR, f"{option} names a folder; give a file", path)
        if not os.access(folder, os.W_OK):
            raise PermissionError(errno.EACCES, f"cannot write {option} there", path)
