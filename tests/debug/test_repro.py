"""Reproducers of failed compiles (debug/repro.py) and `tpu-inductor repro`."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import compile_aten, forget_compiles
from tpu_inductor import cli
from tpu_inductor.debug import records, report, repro
from tpu_inductor.exc import CompileError
from tpu_inductor.runtime import devices

# ---------------------------------------------------------------------------------------------
# Reproducers.

BAD_MODULE = """module @bad {
  func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.custom_call @tpu_inductor_no_such_target(%arg0) : (tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""


class _Lowered:  # what a record is shown of a lowered module
    text = BAD_MODULE
    bytecode = b""
    platform = "cpu"


def test_failed_compile_writes_a_reproducer_that_reproduces(capsys):
    record = records.CompileRecord("forward_x", (((4,), "torch.float32"),))
    device = devices.select_device("cpu")
    record.show(_Lowered)  # the lower stage showed it
    with pytest.raises(CompileError) as caught:
        record.run("pjrt_compile", lambda: devices.compile_stablehlo(BAD_MODULE, device))
    path = Path(
        str(caught.value).split("reproducer (the StableHLO module) is in ")[1].split(";")[0]
    )
    assert (path / "module.mlir").read_text() == BAD_MODULE
    assert json.loads((path / "repro.json").read_text())["platform"] == "cpu"
    command = repro.repro_command(path)
    assert command in str(caught.value)
    here = Path('$(dirname "$0")')
    assert (path / "repro.sh").read_text() == f"#!/bin/sh\n{repro.repro_command(here)}\n"
    assert cli.main(["repro", str(path)]) == 1
    assert "tpu_inductor_no_such_target" in capsys.readouterr().out
    # The one-line command, as printed, recompiles it and fails the same way.
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "reproduced:" in done.stdout
    shutil.rmtree(path)


def test_compile_failure_error_names_the_reproducer_in_the_dump(tmp_path, monkeypatch):
    real = devices.compile_stablehlo
    monkeypatch.setattr(devices, "compile_stablehlo", lambda _module, dev: real(BAD_MODULE, dev))
    forget_compiles()  # another test in this worker may have compiled the same graph
    x = torch.randn(4)
    with pytest.raises(CompileError, match=str(tmp_path)) as caught:
        compile_aten(torch.sin, [x], {"dump_dir": str(tmp_path), "cache": False})
    (c,) = report.load_run(tmp_path)
    repro = tmp_path / c["folder"] / "repro"
    assert str(repro) in str(caught.value)
    assert "stablehlo.sine" in (repro / "module.mlir").read_text()  # the graph's own module
    assert c["status"] == "failed" and "tpu_inductor_no_such_target" in c["error"]
    assert c["error"].startswith("pjrt_compile: CompileError")
    assert set(c["timings"]) >= {"lower", "pjrt_compile"}  # the failed stage's time too
