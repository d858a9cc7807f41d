"""Reproducers of failed PJRT compiles: a folder with the StableHLO module, the facts of the
compile and the one-line command (`tpu-inductor repro`) that compiles it again."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tpu_inductor.debug.recompiles import describe_input


def repro_command(path: Path) -> str:
    """The one-line command that recompiles a reproducer folder."""
    return f'{sys.executable} -m tpu_inductor.cli repro "{path}"'


def write_reproducer(record, module_text: str, platform: str, error: str) -> Path:
    """Write module.mlir, repro.json and repro.sh into the record's (a debug.records.CompileRecord)
    dump folder, or a temp one."""
    if record.dump_path is not None:
        path = record.dump_path / "repro"
        path.mkdir(exist_ok=True)
    else:
        path = Path(tempfile.mkdtemp(prefix=f"tpu_inductor_repro_{record.graph}_"))
    (path / "module.mlir").write_text(module_text)
    facts = {"platform": platform, "graph": record.graph, "error": error}
    facts["inputs"] = [describe_input(v) for v in record.inputs]
    (path / "repro.json").write_text(json.dumps(facts, indent=1) + "\n")
    here = Path('$(dirname "$0")')
    (path / "repro.sh").write_text(f"#!/bin/sh\n{repro_command(here)}\n")
    return path
