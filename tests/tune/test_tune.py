"""`tpu-inductor tune`: two runs of a program (the defaults, then the tuned config) in processes
of their own, the config file it writes loadable by options={"config": ...}, the report's HTML
page rendered by headless Chromium. The acceptance programs (tests/tune/programs/: a
variable-length GPT-2 training loop, a batched generate() loop, each checking its results
against eager torch inside) are slow; CI tunes a small one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from tpu_inductor.passes import bucket_policy

from tpu_inductor import cli
from tpu_inductor.config import Options
from tpu_inductor.exc import TpuInductorError
from tpu_inductor.tune import report, tune

PROGRAMS = Path(__file__).parent / "programs"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Each figure the less the better: the ones a bucket plan can improve.
IMPROVABLE = ("compiles", "padded_share", "peak_bytes", "graph_ms", "collective_bytes")

ROWS = textwrap.dedent(
    """
    import sys
    import torch

    w = torch.randn(8, 8)
    f = torch.compile(lambda x: torch.tanh(x @ w).sum(1), backend="tpu_inductor")
    for n in [int(v) for v in sys.argv[1].split(",")]:
        x = torch.randn(n, 8)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        torch.testing.assert_close(f(x), torch.tanh(x @ w).sum(1))
    """
)


def _tune(tmp_path, script: Path, *args: str, platform: str | None = None) -> dict:
    out = tmp_path / "tuned"
    command = ["tune", "--out", str(out), "--budget", "10"]
    command += ["--platform", platform] if platform else []
    assert cli.main([*command, str(script), *args]) == 0
    return json.loads((out / "tune.json").read_text())


def _beats(facts: dict) -> list[str]:
    before, after = facts["before"], facts["after"]
    return [k for k in IMPROVABLE if after[k] < before[k]]


def test_tune_proposes_a_bucket_plan_that_a_config_file_applies(tmp_path, capsys):
    script = tmp_path / "rows.py"
    script.write_text(ROWS)
    # rows 33..40 many times, 65 once: pow2 pads the 33..40 to 64 (and 65 to 128)
    facts = _tune(tmp_path, script, ",".join(["33", "36", "38", "40"] * 4 + ["65"]))
    options = Options.from_user({"config": facts["config_file"]})
    assert options.shapes.policy == "auto" and Path(options.shapes.plan).is_file()
    before, after = facts["before"], facts["after"]
    assert before["compiles"] == 2  # pow2: 64 and 128
    # the plan trades compiles against padding at the measured cost: never more compiles
    # than pow2, and fewer of them or less padding
    assert after["compiles"] <= before["compiles"]
    assert after["compiles"] < before["compiles"] or after["padded_share"] < before["padded_share"]
    assert not facts["estimates"]  # this machine's platform: the compile cost was measured
    assert "| PJRT compiles | 2 |" in capsys.readouterr().out
    assert (tmp_path / "tuned" / "report.html").is_file()


def test_a_compile_s_cost_is_measured_here_and_estimated_for_another_platform():
    """Measured: a compile's seconds over a padded position's device seconds (positions: the
    calls' pow2 buckets, as the defaults' run padded them); another platform's: the default."""
    record = {
        "platform": "cpu",
        "graphs": {
            "forward_0": {"compiles": 2, "compile_s": 3.0, "device_ms": 400.0},
            "backward_1": {"compiles": 2, "compile_s": 5.0, "device_ms": 600.0},
            "other_2": {"compiles": 1, "compile_s": 2.0, "device_ms": 9000.0},  # not bucketed
        },
        "totals": {"buckets": [{"graph": "forward_0"}, {"graph": "backward_1"}]},
    }
    plan = bucket_policy.BucketPlan(histogram={"n": {20: 3, 40: 1}})  # 3 x 32 + 1 x 64
    cost, how = tune.compile_cost("cpu", record, plan)
    assert cost == pytest.approx((10.0 / 5) / (1.0 / 160)) and how.startswith("measured on cpu")
    cost, how = tune.compile_cost("tpu", record, plan)
    assert cost == bucket_policy.DEFAULT_COMPILE_COST and how.startswith("estimate")


def test_a_failing_program_is_an_error_with_its_log(tmp_path, capsys):
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit('the program said no')\n")
    with pytest.raises(TpuInductorError, match="the program said no"):
        tune.tune(str(script), [], tmp_path / "tuned", None, 10.0)
    assert cli.main(["tune", "--out", str(tmp_path / "cli"), str(script)]) == 2
    assert "failed (exit 1)" in capsys.readouterr().err


def _facts() -> dict:
    figures = {key: 10.0 for key, _, _ in report.FIGURES}
    return {
        "script": "train.py <&>",
        "platform": "cpu",
        "ran_on": "cpu",
        "config": {"shapes": {"policy": "auto"}},
        "config_file": "tuned.json",
        "notes": ["bucket plan:", "  n: sizes 9..40 -> buckets [40]"],
        "estimates": [],
        "plans": [
            {"plan": "data", "status": "refused", "estimate": {"total": 9000}},
            {"plan": "fsdp", "status": "chosen", "estimate": {"total": 10}, "figures": figures},
        ],
        "before": figures,
        "after": {**figures, "compiles": 2.0, "padded_share": 0.0},
    }


def test_collective_bytes_scored_for_another_platform_are_labelled_estimates():
    label = "bytes collectives moved per device (over a mesh) (estimate for tpu)"
    measured, scored = _facts(), {**_facts(), "platform": "tpu"}
    for page in (report.markdown, report.html_page):
        assert label in page(scored) and "(estimate for" not in page(measured)


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no Chromium on this machine")
def test_the_html_report_renders_in_headless_chromium(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(report.html_page(_facts()))
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dom = subprocess.run(
        [*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    assert "tpu-inductor tune: train.py &lt;&amp;&gt;" in dom  # the script's name escaped
    bars = len(report.FIGURES)
    assert dom.count('class="bar defaults"') == dom.count('class="bar tuned"') == bars
    assert "<td>data</td><td>refused</td><td>9,000</td><td>-</td>" in dom  # the plan search
    assert "http" not in page.read_text()  # self-contained: nothing fetched
    shot = tmp_path / "shot.png"
    subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=800,1400", page.as_uri()],
        capture_output=True,
        timeout=120,
    )
    from PIL import Image

    pixels = Image.open(shot).convert("RGB").getdata()
    assert sum(p == (0x1E, 0x88, 0xE5) for p in pixels) > 1000  # the tuned bars are drawn


@pytest.mark.slow
@pytest.mark.parametrize(
    ("program", "args"), [("varlen_train.py", "24"), ("batched_generate.py", "6")]
)
def test_acceptance_the_tuned_config_beats_the_defaults(tmp_path, program, args):
    """Each program checks its results against eager torch itself (a run that differs fails
    the tune); the tuned run beats the defaults' on at least one figure."""
    facts = _tune(tmp_path, PROGRAMS / program, args)
    assert _beats(facts), (facts["before"], facts["after"])
