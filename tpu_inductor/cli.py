"""The `tpu-inductor` command: `--version`, `devices`, `ops`, `repro`, and the subcommands of
other rooms.

Each module named in `SUBCOMMAND_MODULES` provides `add_subcommands(commands)`, which adds its
argparse subparsers and sets `run=` on each (a function args -> exit code). `main` turns the
typed errors of tpu_inductor (and missing or unreadable paths) into a message and exit code 2,
and stops quietly when its output's reader goes away.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from tpu_inductor.exc import TpuInductorError
from tpu_inductor.version import __version__

# Modules of this package that add subcommands (each: add_subcommands(commands)).
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "cache.cli",
    "aot.cli",
    "bench.cli",
    "bench.shapes",
    "debug.report",
    "tune.profile",
    "tune.tune",
)


def _devices(_args) -> int:
    from tpu_inductor.runtime import devices

    platforms = devices.available_platforms()
    best = devices.select_device("auto")
    for name, found in platforms.items():
        marker = "  (default)" if name == best.platform else ""
        print(f"{name}: {len(found)} device(s){marker}")
        for device in found:
            print(f"  {device.id}: {getattr(device, 'device_kind', name)}")
    return 0


def _ops(args) -> int:
    from tpu_inductor.lowering import registry

    covered, missing = registry.core_aten_coverage()
    if args.list:
        for op in registry.registered_ops():
            print(op)
    total = len(covered) + len(missing)
    print(f"registered ATen overloads: {len(registry.registered_ops())}")
    print(f"core ATen opset: {len(covered)}/{total} covered ({100 * len(covered) / total:.1f}%)")
    if missing:
        print("missing core ATen overloads:")
        for op in missing:
            print(f"  {op}")
    return 0


def _repro(args) -> int:
    """Compile a reproducer's module.mlir (debug.repro.write_reproducer) for its platform."""
    import json
    from pathlib import Path

    from tpu_inductor.exc import CompileError
    from tpu_inductor.runtime import devices

    root = Path(args.repro_dir)
    facts = json.loads((root / "repro.json").read_text())
    try:
        devices.compile_stablehlo(
            (root / "module.mlir").read_text(), devices.select_device(facts["platform"])
        )
    except CompileError as e:
        print(f"reproduced: {e}")
        return 1
    print("compiled without error: the failure did not reproduce")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpu-inductor", description="tpu_inductor: compile PyTorch programs for PJRT devices."
    )
    parser.add_argument("--version", action="version", version=f"tpu-inductor {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("devices", help="list the PJRT platforms and devices found").set_defaults(
        run=_devices
    )
    ops = commands.add_parser("ops", help="registered lowerings and core ATen coverage")
    ops.add_argument("--list", action="store_true", help="print every registered overload")
    ops.set_defaults(run=_ops)
    repro = commands.add_parser("repro", help="recompile a failed compile's reproducer")
    repro.add_argument("repro_dir")
    repro.set_defaults(run=_repro)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"{__package__}.{name}").add_subcommands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; a user error (a typed error, a bad path) is one line on stderr, exit 2."""
    args = build_parser().parse_args(argv)
    try:
        code = args.run(args)
        sys.stdout.flush()  # here, where a reader that left is caught, not at exit
        return code
    except TpuInductorError as e:
        print(e, file=sys.stderr)
    except BrokenPipeError:  # the reader left (`tpu-inductor cache ls | head`): stop quietly
        # Python's own flush at exit would fail again and print a traceback; send it nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (
        FileNotFoundError,
        FileExistsError,
        NotADirectoryError,
        IsADirectoryError,
        PermissionError,
    ) as e:
        print(f"tpu-inductor: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
