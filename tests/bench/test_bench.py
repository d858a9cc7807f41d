"""The benchmark harness: every mode measured, sane fields, JSON schema, factories, errors.

No assertion here is about speed: only that the harness measures what it says it measures.
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics

import pytest
import torch
import torch.nn as nn

from tpu_inductor import cli
from tpu_inductor.bench import harness as bench
from tpu_inductor.bench import models as bench_models
from tpu_inductor.bench import report as bench_report
from tpu_inductor.exc import BenchError
from tpu_inductor.runtime import devices

_MLP_FLOPS = 2 * 64 * (512 * 2048 + 2048 * 2048 + 2048 * 512)  # the three matmuls of `mlp`


def tiny_factory():
    """A user model for `tests.bench.test_bench:tiny_factory` (module:factory loading)."""
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), (torch.randn(3, 8),)


def no_params_factory():
    return (lambda x: x * 2), torch.randn(4)


@pytest.fixture(scope="module")
def mlp_report():
    settings = bench.Settings(models=("mlp",), runs=2, warmup=1, peak_size=128, cold=False)
    steps = []
    report = bench.run(settings, steps.append)
    assert len(steps) == bench.progress_steps(settings)
    return report


def test_every_mode_measured_with_sane_fields(mlp_report):
    (case,) = mlp_report["cases"]
    assert (case["model"], case["task"], case["kind"]) == ("mlp", "inference", "model")
    assert list(case["modes"]) == list(bench.MODES)
    assert case["flops"] == _MLP_FLOPS
    for mode, r in case["modes"].items():
        assert "error" not in r, r
        assert len(r["times_s"]) == 2 and all(t > 0 for t in r["times_s"])
        assert r["median_s"] == statistics.median(r["times_s"])
        assert r["min_s"] <= r["q1_s"] <= r["median_s"] <= r["q3_s"] <= r["max_s"]
        assert r["cold_s"] > 0 and r["first_exec_s"] > 0 and r["number"] >= 1
        assert r["max_abs_err"] < 1e-4, mode  # every compiled mode agrees with eager
        for base in ("eager", "inductor"):
            expected = case["modes"][base]["median_s"] / r["median_s"]
            assert r[f"vs_{base}"] == pytest.approx(expected)
    assert case["modes"]["eager"]["vs_eager"] == pytest.approx(1.0)


def test_cold_stages_of_tpu_inductor_add_up(mlp_report):
    r = mlp_report["cases"][0]["modes"]["tpu_inductor"]
    stages = r["cold_stages_s"]
    assert r["compiled_graphs"] >= 1
    assert stages["lower"] > 0 and stages["pjrt_compile"] > 0
    assert sum(stages.values()) + r["first_exec_s"] == pytest.approx(r["cold_s"])


def test_report_json_schema(mlp_report):
    report = json.loads(json.dumps(mlp_report))  # JSON-serializable as it stands
    assert report["schema"] == bench.SCHEMA
    assert set(report) >= {
        "created", "machine", "versions", "settings", "sgemm_peak_flops", "cases", "geomean",
        "warnings",
    }  # fmt: skip
    assert report["sgemm_peak_flops"] > 0
    assert report["machine"]["torch_threads"] == torch.get_num_threads()
    assert report["settings"]["models"] == ["mlp"]
    load = report["cases"][0]["load"]
    assert set(load) == {"wall_s", "cpus", "ours_cores", "others_cores", "others_fraction"}
    assert load["wall_s"] > 0 and load["ours_cores"] >= 0 and load["others_cores"] >= 0
    assert 0 <= load["others_fraction"] <= 1
    geomean = report["geomean"]["inference"]
    ratios = report["cases"][0]["modes"]
    for mode in bench.MODES:  # one model: the geometric mean is its ratio
        assert geomean[mode]["vs_eager"] == pytest.approx(ratios[mode]["vs_eager"])


def test_markdown_has_a_row_per_mode(mlp_report):
    text = bench_report.markdown(mlp_report)
    assert "| model | task | mode | median |" in text
    for mode in bench.MODES:
        assert f"| mlp | inference | {mode} |" in text
    assert "Cold first call of tpu_inductor by stage" in text


def test_cli_module_factory_with_training(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = cli.main(
        [
            "bench", "tests.bench.test_bench:tiny_factory", "--modes", "eager,tpu_inductor",
            "--runs", "2", "--warmup", "1", "--peak-size", "64", "--train",
            "--json", str(out), "--markdown", str(tmp_path / "r.md"),
            "--plot", str(tmp_path / "r.png"),
        ]
    )  # fmt: skip
    assert code == 0
    captured = capsys.readouterr()
    stdout = captured.out
    assert "| tests.bench.test_bench:tiny_factory | train | tpu_inductor |" in stdout
    assert (tmp_path / "r.md").read_text() in stdout
    report = json.loads(out.read_text())
    assert [c["task"] for c in report["cases"]] == ["inference", "train"]
    for case in report["cases"]:
        assert list(case["modes"]) == ["eager", "tpu_inductor"]
        assert all(r["median_s"] > 0 for r in case["modes"].values())
        assert "vs_inductor" not in case["modes"]["eager"]
    # Linear(8,16) + Linear(16,4) on 3 rows; training adds the backward's two matmuls per layer.
    assert report["cases"][0]["flops"] == 2 * 3 * (8 * 16 + 16 * 4)
    assert report["cases"][1]["flops"] == 3 * report["cases"][0]["flops"] - 2 * 3 * 8 * 16
    png = tmp_path / "r.png"
    if importlib.util.find_spec("matplotlib") is None:  # no chart, and the CLI says why
        assert not png.exists() and "no chart written: install matplotlib" in captured.err
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_skipped_without_parameters():
    no_params, tiny = (
        "tests.bench.test_bench:no_params_factory",
        "tests.bench.test_bench:tiny_factory",
    )
    settings = bench.Settings(
        models=(no_params, tiny), modes=("eager",), runs=1, warmup=1, train=True, peak_size=64,
    )  # fmt: skip
    report = bench.run(settings)
    inference, train, _, tiny_train = report["cases"]
    assert inference["modes"]["eager"]["median_s"] > 0
    assert "no trainable parameters" in train["error"] and not train["modes"]
    # The model that trained still has its geometric mean; the skipped one is named.
    assert tiny_train["modes"]["eager"]["vs_eager"] == pytest.approx(1.0)
    assert report["geomean"]["train"]["eager"] == {
        "vs_eager": pytest.approx(1.0),
        "left_out": {"vs_eager": [no_params]},
    }
    assert (
        "Geometric mean over models (train): eager 1.00x vs eager, - vs inductor "
        f"(1 of 2 models left out, without a result: {no_params})." in bench_report.markdown(report)
    )


def test_bad_model_name_lists_builtins(capsys):
    with pytest.raises(BenchError, match=r"unknown model 'resnet9000'.*quickstart-gpt.*mlp"):
        bench_models.resolve("resnet9000")
    assert cli.main(["bench", "resnet9000", "--peak-size", "64"]) == 2
    assert "Built-in models: quickstart-gpt, mlp, cnn" in capsys.readouterr().err


def test_bad_factory_and_mode_are_clear_errors():
    with pytest.raises(BenchError, match=r"'tests.bench.test_bench' has no function 'nope'"):
        bench_models.build(bench_models.resolve("tests.bench.test_bench:nope"))
    with pytest.raises(BenchError, match=r"cannot import 'no_such_module_xyz'"):
        bench_models.build(bench_models.resolve("no_such_module_xyz:f"))
    with pytest.raises(BenchError, match=r"unknown mode.*'xla'.*eager, inductor, tpu_inductor"):
        bench.run(bench.Settings(models=("mlp",), modes=("eager", "xla")))


def test_builtin_zoo_builds_and_runs_eagerly():
    for name, spec in bench_models.BUILTINS.items():
        model, inputs = bench_models.build(spec)
        with torch.no_grad():
            leaves = bench._leaves(model(*inputs))
        assert leaves and all(torch.isfinite(t).all() for t in leaves), name


def test_a_failing_mode_is_reported_and_the_others_still_measured(monkeypatch):
    real_first_call = bench._first_call

    def first_call(mode, *args):
        if mode == "tpu_inductor":
            raise RuntimeError("boom\nsecond line of a long compiler error")
        return real_first_call(mode, *args)

    monkeypatch.setattr(bench, "_first_call", first_call)
    settings = bench.Settings(
        models=("tests.bench.test_bench:tiny_factory",), modes=("eager", "tpu_inductor"), runs=2,
        warmup=1, peak_size=64,
    )  # fmt: skip
    steps = []
    report = bench.run(settings, steps.append)
    assert len(steps) == bench.progress_steps(settings)
    modes = report["cases"][0]["modes"]
    assert modes["tpu_inductor"] == {
        "error": "RuntimeError: boom\nsecond line of a long compiler error"
    }
    assert modes["eager"]["median_s"] > 0
    assert (
        "tests.bench.test_bench:tiny_factory (inference): tpu_inductor failed: RuntimeError: boom"
        in report["warnings"]
    )
    text = bench_report.markdown(report)
    assert "| tpu_inductor | RuntimeError: boom |" in text and "second line" not in text


def test_a_compile_failure_shows_its_cause_and_the_header_the_configured_device(monkeypatch):
    absent = next((p for p in ("tpu", "gpu") if p not in devices.available_platforms()), None)
    if absent is None:
        pytest.skip("this machine has both a TPU and a GPU: no absent device to ask for")
    monkeypatch.setenv("TPU_INDUCTOR_DEVICE", absent)
    settings = bench.Settings(
        models=("overhead-1op",), modes=("eager", "tpu_inductor"), runs=1, warmup=1,
        peak_size=64,
    )  # fmt: skip
    report = bench.run(settings)
    assert report["machine"]["pjrt_device"] == f"{absent} (not present here)"
    cause = f"DeviceError: tpu_inductor: device '{absent}' was requested"
    assert report["cases"][0]["modes"]["tpu_inductor"]["error"].startswith(cause)
    text = bench_report.markdown(report)
    assert f"PJRT {absent} (not present here);" in text
    assert f"| tpu_inductor | {cause}" in text and f"tpu_inductor failed: {cause}" in text


@pytest.mark.parametrize("option", ["--json", "--markdown", "--plot"])
def test_an_output_path_that_cannot_be_written_fails_before_the_run(
    tmp_path, capsys, monkeypatch, option
):
    monkeypatch.setattr(bench, "run", lambda *_: pytest.fail("benchmarked before the check"))
    (tmp_path / "file").touch()
    bad = tmp_path / "file" / "out"
    fine = {"--json": tmp_path / "new" / "r.json", "--markdown": tmp_path / "new2" / "r.md"}
    argv = ["bench", "mlp", option, str(bad)]
    for other, path in fine.items():
        if other != option:
            argv += [other, str(path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"cannot write {option} {bad}: a part of its folder is a file" in err


def exploding_factory():
    raise RuntimeError("factory exploded")


def exploding_forward_factory():
    class Exploding(nn.Module):
        def forward(self, x):
            raise ValueError("forward exploded")

    return Exploding(), (torch.randn(2),)


_FORWARD = "tests.bench.test_bench:exploding_forward_factory"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["tests.bench.test_bench:exploding_factory"], "tests.bench.test_bench:exploding_factory failed "
         "while building it: RuntimeError: factory exploded"),
        ([_FORWARD], f"{_FORWARD} failed while calling it in eager torch: ValueError: forward "
         "exploded"),
        (["mlp", "--modes", " , "], "no modes given \\(--modes is empty\\); modes: eager, "),
    ],
)  # fmt: skip
def test_a_model_or_mode_error_is_one_line_naming_it(capsys, argv, message):
    assert cli.main(["bench", *argv, "--runs", "1", "--peak-size", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar, if any
    assert re.fullmatch(f"tpu-inductor bench: {message}.*", err), err


def test_a_bad_count_says_what_it_wants(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["bench", "--runs", "abc"])
    assert exit.value.code == 2
    assert "argument --runs: must be a positive integer, got 'abc'" in capsys.readouterr().err


def test_shapes_cases_run_bench_shapes_workloads(tmp_path, capsys):
    """`tpu-inductor bench shapes-train` is bench-shapes' train workload: one report, the
    modes asked (the compiles counted, the padded share of a bucketing policy)."""
    path = tmp_path / "shapes.json"
    argv = ["bench", "shapes-train", "--steps", "2", "--max-length", "8", "--modes", "pow2"]
    assert cli.main([*argv, "--json", str(path)]) == 0
    (run,) = json.loads(path.read_text())["runs"]
    assert (run["workload"], run["model"], run["mode"]) == ("train", "gpt2", "pow2")
    assert run["compiles"] >= 1 and run["padded_share"] is not None
    assert "| train | gpt2 | pow2 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["shapes-train", "mlp"], "bench: the shapes cases \\['shapes-train'\\] run apart from "
         "models; give \\['mlp'\\] in another"),
        (["shapes-generate", "--modes", "eager"], "--modes 'eager': shapes cases take modes of "
         "\\('exact', 'pow2', 'auto', 'inductor'\\)"),
    ],
)  # fmt: skip
def test_a_shapes_case_error_is_one_line_naming_it(capsys, argv, message):
    assert cli.main(["bench", *argv]) == 2
    assert re.fullmatch(message + ".*", capsys.readouterr().err.strip()), message


def test_moe_cases_compile_whole_and_train():
    """The MoE layer and the Qwen3-MoE decoder, inference and a training step: tpu_inductor
    compiles each as one graph (forward and backward for a step) and infers as eager does."""
    settings = bench.Settings(
        models=("moe-layer", "qwen3-moe"), modes=("eager", "tpu_inductor"), runs=1, warmup=1,
        train=True, peak_size=64, cold=False,
    )  # fmt: skip
    report = bench.run(settings)
    cases = {(c["model"], c["task"]): c for c in report["cases"]}
    assert set(cases) == {(m, t) for m in settings.models for t in ("inference", "train")}
    for (model, task), case in cases.items():
        ours = case["modes"]["tpu_inductor"]
        assert "error" not in case and "error" not in ours, (model, task, case)
        assert ours["compiled_graphs"] == (1 if task == "inference" else 2), (model, task)
        assert ours["median_s"] > 0 and case["modes"]["eager"]["median_s"] > 0
        if task == "inference":
            assert ours["max_abs_err"] < 1e-4, (model, ours["max_abs_err"])
