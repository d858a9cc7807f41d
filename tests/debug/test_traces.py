"""Structured traces, tlparse and TORCH_LOGS (in a child process: both are read at torch
import), and our names in torch's logging registry.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

# ---------------------------------------------------------------------------------------------
# Structured traces, tlparse and TORCH_LOGS (in a child process: both are read at torch import).

_TRACED = textwrap.dedent(
    """
    import torch
    model = torch.nn.Linear(4, 3)
    out = torch.compile(model, backend="tpu_inductor", options={"cache": False})(torch.randn(2, 4))
    out.sum().backward()
    """
)


def test_structured_trace_shows_stages_in_tlparse_and_torch_logs(tmp_path):
    trace = tmp_path / "trace"
    env = dict(os.environ, TORCH_TRACE=str(trace), TORCH_LOGS="+tpu_inductor")
    done = subprocess.run(
        [sys.executable, "-c", _TRACED], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # TORCH_LOGS="+tpu_inductor": our loggers at DEBUG, the graphs artifact included.
    assert "[__tpu_inductor_graphs] forward_0 aten_forward.py:" in done.stderr
    assert "tpu_inductor: compiled forward_0" in done.stderr  # INFO lines of compile_fx
    tlparse = Path(sys.executable).with_name("tlparse")
    tlparse = str(tlparse) if tlparse.exists() else shutil.which("tlparse")
    assert tlparse, "tlparse is missing: pip install tlparse (it is in the `test` extra)"
    (log_file,) = trace.iterdir()
    out = tmp_path / "tl_out"
    subprocess.run(
        [tlparse, str(log_file), "-o", str(out), "--overwrite", "--no-browser"],
        capture_output=True,
        timeout=120,
        check=True,
    )
    names = {p.name for p in (out / "-_0_0_0").iterdir()}
    for stage in ("aten_forward_py", "pass_cleanup_diff", "stablehlo_mlir", "optimized_hlo_txt"):
        assert any("tpu_inductor_" in n and stage in n for n in names), (stage, sorted(names))
    assert any("tpu_inductor_dynamo_0_0_dynamo_graph_py" in n for n in names)
    assert any("aten_backward_py" in n for n in names)
    assert "tpu_inductor_" in (out / "index.html").read_text()


def test_torch_set_logs_knows_our_log_names():
    torch._logging.set_logs(modules={"tpu_inductor_lowering": logging.DEBUG})
    try:
        assert logging.getLogger("tpu_inductor.lowering").level == logging.DEBUG
        assert logging.getLogger("tpu_inductor.cache.stores").getEffectiveLevel() > logging.DEBUG
    finally:
        torch._logging.set_logs()
    assert logging.getLogger("tpu_inductor.lowering").level == logging.NOTSET
