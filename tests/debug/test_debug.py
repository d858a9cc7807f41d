"""Dumps, structured traces, recompile explanations, reproducers and the HTML report (debug.py,
report.py)."""

from __future__ import annotations

import html.parser
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tpu_inductor.lowering import torch_mlir

from tests.helpers import assert_same, check_against_eager, compile_aten
from tpu_inductor import cli, config
from tpu_inductor.cache import stores as cache
from tpu_inductor.debug import records as debug
from tpu_inductor.debug import report
from tpu_inductor.exc import CompileError, OptionError
from tpu_inductor.runtime import devices

SIZES = (2, 5, 7)  # static, then automatic dynamic (a symbolic graph), then a specialization


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x):
        hidden = self.proj(x)  # SOURCE-LINE-MARK
        return torch.relu(hidden) * 2


@pytest.fixture(scope="module")
def run_dump(tmp_path_factory):
    """Train-step a model through torch.compile at three batch sizes, dumping every compile."""
    dump = tmp_path_factory.mktemp("dump")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(
        model,
        backend="tpu_inductor",
        # the per-size records and explanations of the exact policy are what is checked
        options={"dump_dir": str(dump), "cache": False, "shapes": {"policy": "exact"}},
    )
    handler, logger = _Capture(), logging.getLogger("tpu_inductor.debug.records")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for n in SIZES:
            x = torch.randn(n, 4)
            actual = compiled(x)
            actual_grads = torch.autograd.grad(actual.sum(), list(model.parameters()))
            expected = model(x)
            expected_grads = torch.autograd.grad(expected.sum(), list(model.parameters()))
            assert_same(actual, expected)
            assert_same(actual_grads, expected_grads)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return dump, report.load_run(dump), handler.messages


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _folders(compiles, kind):
    return [c for c in compiles if c["graph"].startswith(kind)]


def test_each_compile_has_its_numbered_stages(run_dump):
    dump, compiles, _ = run_dump
    # Sizes 2 and 5 each trace a forward and a backward graph; 7 specializes the symbolic pair.
    assert len(compiles) == 6
    assert len(_folders(compiles, "forward")) == len(_folders(compiles, "backward")) == 3
    for c in compiles:
        kind = c["graph"].split("_")[0]
        assert c["files"] == [
            "00_dynamo_graph.py",
            f"01_aten_{kind}.py",
            "02_pass_cleanup.py",
            "02_pass_cleanup.diff",
            "03_stablehlo.mlir",
            "04_stablehlo_locations.mlir",
            "05_optimized_hlo.txt",
        ]
        assert sorted(p.name for p in (dump / c["folder"]).iterdir()) == sorted(
            [*c["files"], "compile.json"]
        )


def test_graph_files_are_readable_python_with_shapes_and_source_lines(run_dump):
    dump, compiles, _ = run_dump
    folder = dump / _folders(compiles, "forward")[0]["folder"]
    dynamo = (folder / "00_dynamo_graph.py").read_text()
    aten = (folder / "01_aten_forward.py").read_text()
    for text in (dynamo, aten):
        compile(text, "graph", "exec")  # valid Python
        assert "f32[2, 4]" in text and "SOURCE-LINE-MARK" in text
        assert f"# File: {__file__}" in text
    assert "torch.ops.aten.addmm.default" in aten and "torch.ops.aten.mul.Tensor" in aten


def test_stablehlo_with_and_without_locations_and_optimized_hlo(run_dump):
    dump, compiles, _ = run_dump
    folder = dump / _folders(compiles, "forward")[0]["folder"]
    plain = (folder / "03_stablehlo.mlir").read_text()
    located = (folder / "04_stablehlo_locations.mlir").read_text()
    assert "stablehlo.dot_general" in plain and "tensor<2x4xf32>" in plain
    assert "loc(" not in plain
    assert "loc(" in located and "addmm" in located  # named scopes lead back to ATen nodes
    assert "HloModule" in (folder / "05_optimized_hlo.txt").read_text()


def test_compile_json(run_dump):
    _, compiles, _ = run_dump
    first = compiles[0]
    assert first["status"] == "ok" and first["error"] is None
    assert first["inputs"] == ["float32[3, 4]", "float32[3]", "float32[2, 4]"]
    assert first["timings"]["lower"] > 0 and first["timings"]["pjrt_compile"] > 0
    assert first["cache"]["decision"] == "miss" and len(first["cache"]["key"]) == 64
    assert first["compile_id"] == "0/0"
    assert first["pass_rewrites"]["cleanup"]["alias_removed"] >= 0
    assert "dump_dir" not in first["options"] and first["options"]["x64"] == "keep"
    # The specialization at size 7 is filed under the symbolic graph's Dynamo compile id.
    assert compiles[-1]["compile_id"] == compiles[-3]["compile_id"] == "0/1"


def test_shape_change_recompile_is_explained(run_dump):
    _, compiles, messages = run_dump
    forward = _folders(compiles, "forward")
    assert [c["recompile_reason"] is not None for c in forward] == [False, True, True]
    # Size 5: Dynamo's new trace, with symbolic sizes, compared with its static trace at 2.
    retrace = forward[1]["recompile_reason"]
    assert retrace.startswith("Dynamo traced it again, with symbolic sizes: input 3 ")
    assert "input 3 (float32[2, 4] → float32[5, 4]): dim 0: 2 → 5" in retrace
    assert "torch._dynamo.mark_dynamic(input, 0) before the first call" in retrace
    # Size 7: the symbolic graph compiled for one more size.
    reason = forward[-1]["recompile_reason"]
    assert "input 3 (float32[5, 4] → float32[7, 4]): dim 0: 5 → 7" in reason
    assert "input 2 (a symbolic size or number): 5 → 7" in reason
    assert "pad input 3's dim 0 to a few fixed sizes, one compile each" in reason
    assert "bucket" not in retrace + reason  # not a knob torch.compile users have (yet)
    graphs = [c["graph"] for c in forward]
    lines = [m for m in messages if m.startswith("tpu_inductor: recompiling for new input")]
    assert f"({graphs[1]}, Dynamo's new trace of {graphs[0]}): {retrace}" in lines[0]
    assert f"tpu_inductor: recompiling for new input sizes ({graphs[2]}): {reason}" in lines


def test_recompiles_for_a_python_number_are_explained_as_such():
    def f(x, n):  # 12 // n (n could be 0, where Python raises) is not traced: compiled per value
        return x * (12 // n)

    compiled = torch.compile(f, backend="tpu_inductor", options={"cache": False})
    before = len(debug.records)
    for n in (2, 3, 4):
        compiled(torch.ones(2), n)
    retrace, again = (r.recompile for r in debug.records[before + 1 :])
    assert retrace.startswith("Dynamo traced it again: a Python number changed between calls")
    assert again.startswith("input 0 (a symbolic size or number): 3 → 4.")
    assert "pass a number that varies and sets no size as a 0-d tensor" in again


def test_explain_recompile_texts():
    old = (((8, 16), "torch.float32"), 3)
    new = (((12, 16), "torch.float32"), 3)
    assert debug.explain_recompile(old, new, same_graph=False) == (
        "input 0 (float32[8, 16] → float32[12, 16]): dim 0: 8 → 12. To avoid it: pad input 0's "
        "dim 0 to a few fixed sizes, one compile each (torch._dynamo.mark_dynamic(input, 0) "
        "before the first call spares Dynamo's new traces, not the compile per size)."
    )
    assert debug.explain_recompile(old, new, same_graph=True).endswith(
        "(a graph with symbolic sizes compiles once per size here)."
    )
    dtype = debug.explain_recompile(old, (((8, 16), "torch.bfloat16"), 3), same_graph=True)
    assert dtype.startswith("input 0 (float32[8, 16] → bfloat16[8, 16]): dtype torch.float32")
    assert "cast input 0 to float32" in dtype
    scalar = debug.explain_recompile(old, (old[0], 4), same_graph=False)
    assert scalar.startswith("input 1: 3 → 4.") and "as a 0-d tensor" in scalar
    option = debug.explain_recompile(
        old, old, same_graph=True, old_options={"x64": "keep"}, new_options={"x64": "narrow"}
    )
    assert option.startswith("option x64: 'keep' → 'narrow'.")


def test_recompile_is_explained_against_the_closest_earlier_compile(caplog):
    def fn(x):
        return x.sin() + 1

    torch._dynamo.reset()
    x = torch.randn(4)
    with caplog.at_level(logging.INFO, logger="tpu_inductor.debug.records"):
        keep = torch.compile(fn, backend="tpu_inductor", options={"cache": False})
        keep(x)
        keep(x.double())  # the latest compile: float64 input
        narrow = {"cache": False, "x64": "narrow"}
        torch.compile(fn, backend="tpu_inductor", options=narrow)(x)  # as the first, but x64
    first, latest, last = debug.records[-3:]
    assert latest.recompile.startswith("input 0 (float32[4] → float64[4])")
    assert last.recompile == (
        "option x64: 'keep' → 'narrow'. To avoid it: use the same options for every "
        "torch.compile of this model."
    )
    assert f"({last.graph}, the same graph as {first.graph}): option x64" in caplog.text


def test_identical_graph_from_a_static_recompile_says_mark_dynamic(tmp_path, caplog):
    torch._dynamo.reset()
    fn = torch.compile(
        lambda x: x * 2 + 1,
        backend="tpu_inductor",
        dynamic=False,
        options={"dump_dir": str(tmp_path), "cache": False},
    )
    with caplog.at_level(logging.INFO, logger="tpu_inductor.debug.records"):
        for n in (4, 6):
            x = torch.randn(n, 3)
            assert_same(fn(x), x * 2 + 1)
    compiles = report.load_run(tmp_path)
    assert [c["recompile_reason"] is None for c in compiles] == [True, False]
    assert "dim 0: 4 → 6" in compiles[1]["recompile_reason"]
    assert "torch._dynamo.mark_dynamic(input, 0)" in compiles[1]["recompile_reason"]
    assert f"({compiles[1]['graph']}, the same graph as {compiles[0]['graph']})" in caplog.text


def test_pass_dump_diff_shows_the_rewrite(tmp_path):
    def fn(x):
        unused = x + 1  # noqa: F841 (a dead node for cleanup to remove)
        return torch.ops.aten.alias.default(x) * 2

    check_against_eager(fn, torch.randn(3), options={"dump_dir": str(tmp_path), "cache": False})
    (c,) = report.load_run(tmp_path)
    assert c["files"][:3] == ["00_aten_graph.py", "01_pass_cleanup.py", "01_pass_cleanup.diff"]
    diff = (tmp_path / c["folder"] / "01_pass_cleanup.diff").read_text()
    assert diff.startswith("# pass cleanup: rewrites {'alias_removed': 1, 'dead_removed': 1}")
    removed = [line for line in diff.splitlines() if line.startswith("-  ")]
    assert any("aten.alias.default" in line for line in removed)
    assert any("aten.add.Tensor" in line for line in removed)
    after = (tmp_path / c["folder"] / "01_pass_cleanup.py").read_text()
    assert "alias" not in after and "aten.add" not in after and "aten.mul.Tensor" in after
    assert c["pass_rewrites"]["cleanup"] == {"alias_removed": 1, "dead_removed": 1}


def test_dump_dir_option_and_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TPU_INDUCTOR_DUMP_DIR", str(tmp_path))
    options = config.Options.from_user()
    assert options.dump_dir == str(tmp_path)
    assert "dump_dir" not in options.cache_key_entries()
    monkeypatch.delenv("TPU_INDUCTOR_DUMP_DIR")
    assert config.Options.from_user().dump_dir is None


def test_an_empty_dump_dir_is_an_error_not_the_current_directory(monkeypatch):
    with pytest.raises(OptionError, match="option 'dump_dir' is an empty path.*to dump nothing"):
        config.Options.from_user({"dump_dir": ""})
    monkeypatch.setenv("TPU_INDUCTOR_DUMP_DIR", "")
    with pytest.raises(OptionError, match="variable TPU_INDUCTOR_DUMP_DIR is an empty path"):
        config.Options.from_user()


def test_a_cache_hit_dumps_the_cached_stablehlo_and_optimized_hlo(tmp_path, monkeypatch):
    """A warm start (emulated in-process: Dynamo reset, memory cache emptied) dumps what it ran."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch"))
    model, x = torch.nn.Linear(4, 5), torch.randn(3, 4)
    for run in ("cold", "warm"):
        torch._dynamo.reset()
        cache.memory_cache.clear()
        options = {"dump_dir": str(tmp_path / run), "cache_dir": str(tmp_path / "ours")}
        with torch.no_grad():
            assert_same(torch.compile(model, backend="tpu_inductor", options=options)(x), model(x))
    (cold,), (warm,) = (report.load_run(tmp_path / run) for run in ("cold", "warm"))
    assert warm["cache"]["decision"] == "disk_hit" and warm["cache"]["aot_autograd"] == "hit"
    # torch's AOTAutogradCache hit too: no ATen graph, and compile.json says why.
    assert "ATen graph and passes" in warm["cache"]["stages_skipped"]
    assert warm["files"] == ["00_dynamo_graph.py", "01_stablehlo.mlir", "02_optimized_hlo.txt"]
    cold_folder, warm_folder = (
        tmp_path / "cold" / cold["folder"],
        tmp_path / "warm" / warm["folder"],
    )
    assert (warm_folder / "01_stablehlo.mlir").read_text() == (
        (cold_folder / "03_stablehlo.mlir").read_text()
    )
    assert "HloModule" in (warm_folder / "02_optimized_hlo.txt").read_text()
    # A memory hit (no AOTAutogradCache): the traced stages, then the cached ones, as compiled.
    options = {"dump_dir": str(tmp_path / "traced"), "cache_dir": str(tmp_path / "ours")}
    for _ in range(2):
        compile_aten(torch.sin, [x], options)
    first, second = report.load_run(tmp_path / "traced")
    assert second["cache"]["decision"] == "memory_hit" and "stages_skipped" not in second["cache"]
    assert second["files"] == first["files"] and "04_optimized_hlo.txt" in second["files"]


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
    record = debug.CompileRecord("forward_x", (((4,), "torch.float32"),))
    device = devices.select_device("cpu")
    record.show(_Lowered)  # the lower stage showed it
    with pytest.raises(CompileError) as caught:
        record.run("pjrt_compile", lambda: devices.compile_stablehlo(BAD_MODULE, device))
    path = Path(
        str(caught.value).split("reproducer (the StableHLO module) is in ")[1].split(";")[0]
    )
    assert (path / "module.mlir").read_text() == BAD_MODULE
    assert json.loads((path / "repro.json").read_text())["platform"] == "cpu"
    command = debug.repro_command(path)
    assert command in str(caught.value)
    here = Path('$(dirname "$0")')
    assert (path / "repro.sh").read_text() == f"#!/bin/sh\n{debug.repro_command(here)}\n"
    assert cli.main(["repro", str(path)]) == 1
    assert "tpu_inductor_no_such_target" in capsys.readouterr().out
    # The one-line command, as printed, recompiles it and fails the same way.
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "reproduced:" in done.stdout
    shutil.rmtree(path)


def test_compile_failure_error_names_the_reproducer_in_the_dump(tmp_path, monkeypatch):
    real = devices.compile_stablehlo
    monkeypatch.setattr(devices, "compile_stablehlo", lambda _module, dev: real(BAD_MODULE, dev))
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


# ---------------------------------------------------------------------------------------------
# explain and report.


def test_explain_summarizes_the_run(run_dump, capsys):
    dump, compiles, _ = run_dump
    assert cli.main(["explain", str(dump)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"6 compile(s) of 4 graph(s) in {dump}")
    assert "cache: 0 hit(s) of 6 (0%): miss 6" in out
    assert "time per stage (all compiles): lower " in out and "pjrt_compile " in out
    assert out.count("recompiled: ") == 4  # forward and backward at sizes 5 and 7
    for c in compiles:
        assert c["folder"] in out


def test_explain_and_report_skip_a_damaged_compile_json_and_name_it(
    run_dump, tmp_path, capsys, caplog
):
    dump, compiles, _ = run_dump
    good = compiles[0]["folder"]
    shutil.copytree(dump / good, tmp_path / good)
    text = (dump / good / "compile.json").read_text()
    damaged = {"900_cut": text[:40], "901_keyless": json.dumps({"id": 1, "graph": "g"})}
    for folder, content in damaged.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "compile.json").write_text(content)
    for command in ("explain", "report"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tpu_inductor.debug.report"):
            assert cli.main([command, str(tmp_path)]) == 0
        for folder in damaged:
            assert f"skipping {tmp_path / folder / 'compile.json'}, which is damaged" in caplog.text
        assert "missing key(s) cache, compile_id" in caplog.text
    assert f"1 compile(s) of 1 graph(s) in {tmp_path}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["explain", "report"])
def test_explain_and_report_of_a_missing_folder_are_an_error_naming_it(tmp_path, capsys, command):
    missing = tmp_path / "no_such_dump"
    assert cli.main([command, str(missing)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "No such dump folder" in err and str(missing) in err
    assert not missing.exists()


def test_compile_json_is_replaced_whole(tmp_path):
    record = debug.CompileRecord("forward_x", (), dump_path=tmp_path)
    debug._write_compile_json(record)
    before = (tmp_path / "compile.json").stat().st_ino
    record.status = "ok"
    debug._write_compile_json(record)
    assert (tmp_path / "compile.json").stat().st_ino != before  # a new file, renamed in
    assert json.loads((tmp_path / "compile.json").read_text())["status"] == "ok"
    assert [p.name for p in tmp_path.iterdir()] == ["compile.json"]


class _Page(html.parser.HTMLParser):
    """The parts of the report page the tests check."""

    def __init__(self):
        super().__init__()
        self.sections, self.links, self.bars, self.text = [], [], [], []
        self.external = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.sections.append(attrs["id"])
        if tag == "a":
            self.links.append(attrs["href"])
        if attrs.get("class") == "bar":
            self.bars.append(float(attrs["style"].removeprefix("width:").removesuffix("%")))
        for name in ("src", "href"):
            if "//" in attrs.get(name, ""):
                self.external.append(attrs[name])
        if tag in ("script", "link", "iframe", "img"):
            self.external.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def test_report_html_content(run_dump):
    dump, compiles, _ = run_dump
    path = report.write_report(dump)
    page = _Page()
    page.feed(path.read_text())
    text = "".join(page.text)
    assert page.sections == [c["folder"] for c in compiles]
    assert page.links == [f"{c['folder']}/{name}" for c in compiles for name in c["files"]]
    assert all((dump / link).is_file() for link in page.links)
    assert len(page.bars) == sum(len(c["timings"]) for c in compiles)
    assert max(page.bars) == 100.0 and min(page.bars) > 0
    assert page.external == []  # one self-contained file: no script, CDN or image
    assert text.count("Recompiled: ") == 4 and "decision: miss" in text
    assert "stablehlo.dot_general" in text  # stage files are embedded


def test_report_renders_in_headless_chromium(run_dump, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip(
            "chromium is not installed (apt-get install chromium); the HTML content "
            "test (test_report_html_content) still ran"
        )
    from PIL import Image

    dump, compiles, _ = run_dump
    url = report.write_report(dump).as_uri()
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(
        [*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "tpu_inductor compile report" in dom and compiles[0]["folder"] in dom
    shot = tmp_path / "report.png"
    subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1000,1400", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    image = Image.open(shot).convert("RGB")
    assert image.size == (1000, 1400)
    bar_pixels = sum(1 for p in image.getdata() if p == (0x1F, 0x6F, 0xEB))
    assert bar_pixels > 500  # the timing bars were laid out and painted


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


@torch.library.custom_op("tpu_inductor_test::eager_only", mutates_args=())
def _eager_only(x: torch.Tensor) -> torch.Tensor:
    """An op with no lowering rule: it always runs in eager torch."""
    return x.flip(0)


@_eager_only.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("fallback", ["eager", "torch-mlir"])
def test_fallback_regions_are_dumped_and_reported(tmp_path, capsys, fallback):
    if fallback == "torch-mlir" and not torch_mlir.available():
        pytest.skip("torch-mlir is not installed (pip install -e '.[torch-mlir]')")

    def fn(x):
        return torch.ops.tpu_inductor_test.eager_only(x.sin()).cos()

    torch._dynamo.reset()
    options = {"dump_dir": str(tmp_path), "cache": False, "fallback": fallback}
    compiled = torch.compile(fn, backend="tpu_inductor", options=options)
    x = torch.randn(5)
    assert_same(compiled(x), fn(x))
    compiles = report.load_run(tmp_path)
    # The regions before and after the eager op (and torch-mlir's failed try at the op itself,
    # reported only once those regions were compiled).
    fused = [c for c in compiles if c["graph"].split(".")[1].startswith("fused_")]
    assert len(fused) == 2 and len(compiles) == (2 if fallback == "eager" else 3)
    for c in compiles:
        (facts,) = c["fallback_ops"].values()
        assert facts["count"] == 1 and "no lowering rule" in facts["why"]
    for c in fused:
        assert c["files"][:6] == [  # the passes run on the whole graph, before partitioning
            "00_dynamo_graph.py",
            "01_aten_inference.py",
            "02_pass_cleanup.py",
            "02_pass_cleanup.diff",
            "03_partitioned.py",
            "04_region.py",
        ]
        (facts,) = c["fallback_ops"].values()
        assert "return torch.ops.tpu_inductor_test.eager_only" in facts["sites"][0]
    partitioned = (tmp_path / compiles[0]["folder"] / "03_partitioned.py").read_text()
    assert "torch.ops.tpu_inductor_test.eager_only.default" in partitioned
    assert cli.main(["explain", str(tmp_path)]) == 0
    assert (
        "ops run in eager torch: tpu_inductor_test.eager_only.default x1" in capsys.readouterr().out
    )


def test_unsupported_ops_under_fallback_error_leave_a_failed_compile_in_the_dump(tmp_path):
    def fn(x):
        return torch.ops.tpu_inductor_test.eager_only(x.sin()).cos()

    torch._dynamo.reset()
    options = {"dump_dir": str(tmp_path), "cache": False, "fallback": "error"}
    with pytest.raises(Exception, match="tpu_inductor_test.eager_only.default"):
        torch.compile(fn, backend="tpu_inductor", options=options)(torch.randn(5))
    (c,) = report.load_run(tmp_path)
    assert c["status"] == "failed" and c["inputs"] == ["float32[5]"]
    assert c["error"].startswith("partition: UnsupportedOpError: tpu_inductor: these ops")
    assert c["files"] == [  # the passes ran (on the whole graph); partitioning failed
        "00_dynamo_graph.py",
        "01_aten_inference.py",
        "02_pass_cleanup.py",
        "02_pass_cleanup.diff",
    ]
    assert "partition" in c["timings"] and c["fallback_ops"] == {}  # nothing ran in eager


def test_torch_set_logs_knows_our_log_names():
    torch._logging.set_logs(modules={"tpu_inductor_lowering": logging.DEBUG})
    try:
        assert logging.getLogger("tpu_inductor.lowering").level == logging.DEBUG
        assert logging.getLogger("tpu_inductor.cache.stores").getEffectiveLevel() > logging.DEBUG
    finally:
        torch._logging.set_logs()
    assert logging.getLogger("tpu_inductor.lowering").level == logging.NOTSET
