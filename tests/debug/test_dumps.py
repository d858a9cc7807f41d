"""Dump folders (debug/records.py): numbered stage files, readable graphs, StableHLO and HLO,
compile.json, pass diffs, cache hits and fallback regions.
"""

from __future__ import annotations

import json

import pytest
import torch
from tpu_inductor.lowering import torch_mlir

from tests.debug import dump_run
from tests.debug.dump_run import folders
from tests.helpers import assert_same, check_against_eager, compile_aten
from tpu_inductor import cli, config
from tpu_inductor.cache import stores
from tpu_inductor.debug import records, report
from tpu_inductor.exc import OptionError


def test_each_compile_has_its_numbered_stages(run_dump):
    dump, compiles, _ = run_dump
    # Sizes 2 and 5 each trace a forward and a backward graph; 7 specializes the symbolic pair.
    assert len(compiles) == 6
    assert len(folders(compiles, "forward")) == len(folders(compiles, "backward")) == 3
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
    folder = dump / folders(compiles, "forward")[0]["folder"]
    dynamo = (folder / "00_dynamo_graph.py").read_text()
    aten = (folder / "01_aten_forward.py").read_text()
    for text in (dynamo, aten):
        compile(text, "graph", "exec")  # valid Python
        assert "f32[2, 4]" in text and "SOURCE-LINE-MARK" in text
        assert f"# File: {dump_run.__file__}" in text  # where Block is defined
    assert "torch.ops.aten.addmm.default" in aten and "torch.ops.aten.mul.Tensor" in aten


def test_stablehlo_with_and_without_locations_and_optimized_hlo(run_dump):
    dump, compiles, _ = run_dump
    folder = dump / folders(compiles, "forward")[0]["folder"]
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
    # The fusions as compiled: the CPU's defaults, not "unset"
    assert first["options"]["fusion"] == {"attention": False, "matmuls": False, "norms": False}
    # The specialization at size 7 is filed under the symbolic graph's Dynamo compile id.
    assert compiles[-1]["compile_id"] == compiles[-3]["compile_id"] == "0/1"


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
        stores.memory_cache.clear()
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


def test_compile_json_is_replaced_whole(tmp_path):
    record = records.CompileRecord("forward_x", (), dump_path=tmp_path)
    records._write_compile_json(record)
    before = (tmp_path / "compile.json").stat().st_ino
    record.status = "ok"
    records._write_compile_json(record)
    assert (tmp_path / "compile.json").stat().st_ino != before  # a new file, renamed in
    assert json.loads((tmp_path / "compile.json").read_text())["status"] == "ok"
    assert [p.name for p in tmp_path.iterdir()] == ["compile.json"]


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
