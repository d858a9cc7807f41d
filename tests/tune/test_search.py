"""`tpu-inductor tune --mesh`: the named plans a script receives through `auto_mesh` and
`shard(model, mesh, "auto")`, each plan's bytes per device from shapes alone, plans refused
before compiling when they cannot fit the stated memory (tune/search.py), and on 8 virtual CPU
devices (processes of their own: the count is fixed when jax starts) a tuned config's plan
reaching an unmodified Llama training script, and the whole search on it (slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import tpu_inductor
from tpu_inductor import cli
from tpu_inductor.config import Options
from tpu_inductor.exc import OptionError, PlanDoesNotFitError, TpuInductorError
from tpu_inductor.sharding import named
from tpu_inductor.sharding import shard as sharding
from tpu_inductor.sharding.mesh import Mesh
from tpu_inductor.tune import search, tune

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "tests" / "tune" / "programs" / "llama_mesh.py"
MESH = Mesh({"data": 2, "model": 4})


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def test_memory_sizes_parse():
    assert search.parse_bytes("2GiB") == 2 * 2**30
    assert search.parse_bytes("1.5 MiB") == 3 * 2**19
    assert search.parse_bytes("512mb") == 512 * 10**6
    assert search.parse_bytes("4096") == 4096
    with pytest.raises(OptionError, match="give bytes with a unit"):
        search.parse_bytes("2 parsecs")


def test_each_named_plan_s_bytes_per_device_come_from_shapes_and_specs():
    model = _llama()
    found = named.survey(model, MESH)
    parameters = dict(model.named_parameters())
    whole = sum(map(_bytes, parameters.values()))
    buffers = sum(_bytes(b) for b in model.buffers())
    assert found["data"] == {"parameters": whole, "trainable": whole, "buffers": buffers}
    # FSDP over data=2: every parameter of 1024 elements or more halved (all dims here are even)
    fsdp = sum(_bytes(p) // (2 if p.numel() >= 1024 else 1) for p in parameters.values())
    assert found["fsdp"]["parameters"] == fsdp
    # tensor parallel over model=4: the projections a quarter each, embeddings and norms whole
    projections = [p for n, p in parameters.items() if n.endswith("proj.weight")]
    assert len(projections) == 7
    split = sum(map(_bytes, projections))
    assert found["tensor_parallel"]["parameters"] == whole - split + split // 4
    # both: the projections over model and data (an eighth), the rest halved over data
    rest = [p for n, p in parameters.items() if not n.endswith("proj.weight")]
    both = split // 8 + sum(_bytes(p) // (2 if p.numel() >= 1024 else 1) for p in rest)
    assert found["fsdp_tensor_parallel"]["parameters"] == both
    assert "no stacked expert weights" in found["expert_parallel"]["error"]


def test_expert_parallel_splits_an_moe_s_stacked_experts_and_its_attention_over_model():
    from tests import hf_zoo

    model, _ = hf_zoo.build("mixtral")
    given = named.specs("expert_parallel", model, MESH)
    experts = [n for n, p in model.named_parameters() if ".experts." in n and p.ndim == 3]
    assert experts and all(given[n] == ("model",) for n in experts)
    assert given["model.layers.0.self_attn.o_proj.weight"] == (None, "model")
    found = named.survey(model, MESH)
    whole = dict(model.named_parameters())
    expert_bytes = sum(_bytes(whole[n]) for n in experts)
    # a quarter of the experts on each device, and attention's projections split too
    assert found["expert_parallel"]["parameters"] < (
        found["data"]["parameters"] - expert_bytes * 3 // 4
    )


def test_shard_auto_places_by_the_configured_plan(monkeypatch):
    """Without a config, "auto" keeps the weights whole on the given mesh; with one, the
    config's mesh (auto_mesh) and plan; a plan name that is not one is an error naming them."""
    model = _llama()
    monkeypatch.delenv("TPU_INDUCTOR_SHARDING", raising=False)
    monkeypatch.delenv("TPU_INDUCTOR_CONFIG", raising=False)
    mesh = tpu_inductor.auto_mesh({"data": 8})
    assert mesh == Mesh({"data": 8})
    sharding.shard(model, mesh, "auto")
    q = model.model.layers[0].self_attn.q_proj.weight
    assert sharding.placement(q) is None and named.surveys[-1]["plan"] == "data"
    monkeypatch.setenv("TPU_INDUCTOR_SHARDING", '{"mesh": "data=2,model=4", "plan": "fsdp"}')
    assert tpu_inductor.auto_mesh({"data": 8}) == MESH
    monkeypatch.setenv("TPU_INDUCTOR_SHARDING", '{"plan": "tensor_parallel"}')
    sharding.shard(model, MESH, "auto")
    assert sharding.placement(q).spec == ("model", None)
    assert named.surveys[-1]["mesh"] == "data=2,model=4"
    monkeypatch.setenv("TPU_INDUCTOR_SHARDING", '{"plan": "zero3"}')
    with pytest.raises(OptionError, match="'zero3' is not one of data, fsdp, tensor_parallel"):
        sharding.shard(model, MESH, "auto")


def _survey(optimizer=torch.optim.AdamW) -> tuple[torch.nn.Module, dict]:
    model = _llama()
    named.surveys[:] = [{"mesh": str(MESH), "plan": "data", "plans": named.survey(model, MESH)}]
    named.note_optimizer(optimizer(model.parameters(), lr=1e-3))
    return model, named.surveys[-1]


def _record(survey: dict, peak: float = 0.0, collective: float = 0.0) -> dict:
    """A defaults' or a plan's record as search reads it (figures: what figures_of returns)."""
    graphs = {"forward_0": {"need_bytes": 1000}, "backward_1": {"need_bytes": 5000}}
    figures = {"peak_bytes": peak, "collective_bytes": collective}
    return {"sharding": survey, "graphs": graphs, "figures": figures}


def test_an_estimate_counts_parameters_gradients_and_the_optimizer_s_state():
    model, survey = _survey()
    whole = sum(map(_bytes, model.parameters())) + sum(map(_bytes, model.buffers()))
    trainable = sum(map(_bytes, model.parameters()))
    data = search.estimate(survey, "data", _record(survey))
    assert data == {
        "parameters": whole,
        "gradients": trainable,
        "optimizer_state": 2 * trainable,  # AdamW: exp_avg, exp_avg_sq
        "total": whole + 3 * trainable,
        "call_need": 5000,  # measured for the defaults' plan: its largest call's
    }
    assert search.estimate(survey, "fsdp", _record(survey))["call_need"] is None
    inference = {"sharding": survey, "graphs": {"forward_0": {"need_bytes": 1000}}}
    assert search.estimate(survey, "data", inference)["gradients"] == 0
    _, survey = _survey(torch.optim.SGD)  # no momentum: no state
    assert search.estimate(survey, "data", _record(survey))["optimizer_state"] == 0


def test_a_plan_that_cannot_fit_the_stated_memory_is_refused_before_compiling():
    """Refused plans are never run (run_plan not called for them); their figures are in the
    row; the plan that fits with the fewest collective bytes is chosen."""
    _, survey = _survey()
    before = _record(survey, peak=9e9, collective=0)
    applies = [n for n, shares in survey["plans"].items() if "error" not in shares]
    totals = {n: search.estimate(survey, n, before)["total"] for n in applies}
    memory = (totals["tensor_parallel"] + totals["fsdp"]) // 2  # FSDP and 2-D fit, TP not
    assert totals["fsdp_tensor_parallel"] < totals["fsdp"] < memory < totals["tensor_parallel"]
    ran = []

    def run_plan(name):
        ran.append(name)
        collective = {"fsdp": 10.0, "fsdp_tensor_parallel": 20.0}[name]
        return _record(survey, peak=memory - 1, collective=collective)

    chosen, rows = search.search(before, lambda r: r["figures"], run_plan, memory)
    assert chosen == "fsdp" and ran == ["fsdp", "fsdp_tensor_parallel"]
    status = {r["plan"]: r["status"] for r in rows}
    assert status == {
        "data": "refused",
        "fsdp": "chosen",
        "tensor_parallel": "refused",
        "fsdp_tensor_parallel": "ran",
        "expert_parallel": "does not apply",
    }
    assert next(r for r in rows if r["plan"] == "data")["figures"] == before["figures"]
    assert "figures" not in next(r for r in rows if r["plan"] == "tensor_parallel")
    tp = next(r for r in rows if r["plan"] == "tensor_parallel")
    assert f"needs at least {totals['tensor_parallel']:,} bytes per device" in tp["reason"]
    assert "optimizer_state" in tp["reason"] and f"the target has {memory:,}" in tp["reason"]
    with pytest.raises(PlanDoesNotFitError, match="refused before compiling") as refused:
        search.check_fits("tensor_parallel", tp["estimate"], memory)
    assert refused.value.figures["total"] == totals["tensor_parallel"]


def test_a_plan_over_the_memory_once_compiled_is_not_chosen_and_none_fitting_is_an_error():
    _, survey = _survey()
    before = _record(survey, peak=100, collective=0)
    # every plan's estimate fits; measured, only the defaults' peak (100) does
    chosen, rows = search.search(
        before, lambda r: r["figures"], lambda name: _record(survey, peak=10**9), 10**8
    )
    assert chosen == "data"
    assert {r["status"] for r in rows if r["plan"] not in ("data", "expert_parallel")} == {
        "did not fit once compiled"
    }
    with pytest.raises(PlanDoesNotFitError, match="no sharding plan fits 1,000 bytes") as e:
        search.search(before, lambda r: r["figures"], lambda name: pytest.fail(name), 1000)
    assert e.value.figures["fsdp"]["total"] > 1000


def test_memory_without_a_mesh_and_a_mesh_without_an_auto_shard_are_errors(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("print('nothing placed')\n")
    with pytest.raises(TpuInductorError, match="--memory-per-device needs a --mesh"):
        tune.tune(str(script), [], tmp_path / "a", None, 5.0, None, 2**30)
    with pytest.raises(OptionError, match="placed no model with tpu_inductor.shard"):
        tune.tune(str(script), [], tmp_path / "b", None, 5.0, "data=2")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "TPU_INDUCTOR_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    return env


@pytest.mark.parametrize(
    ("program", "plan", "optimizer"),
    [
        ("llama_mesh.py", "tensor_parallel", {"kind": "AdamW", "states": 2}),
        pytest.param(
            "moe_mesh.py",
            "expert_parallel",
            {"kind": "SGD", "states": 0},
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_tuned_config_s_plan_reaches_an_unmodified_script_on_8_devices(
    tmp_path, program, plan, optimizer
):
    """tuned.json's sharding record: the program (a Llama; an MoE, its experts over "model":
    slow), which checks itself against eager, builds its mesh with auto_mesh and places with
    shard(model, mesh, "auto"); recorded, its model was placed by the config's plan on the
    config's mesh, and its collectives moved bytes."""
    config = tmp_path / "tuned.json"
    placed = {"mesh": "data=2,model=4", "plan": plan}
    config.write_text(json.dumps({"sharding": placed}))
    assert Options.from_user({"config": str(config)}).sharding.plan == plan
    env = {**_env(), "TPU_INDUCTOR_CONFIG": str(config), "TPU_INDUCTOR_CACHE": "0"}
    command = [sys.executable, "-m", "tpu_inductor.tune.record", str(tmp_path), "0"]
    command += [str(LLAMA.parent / program), "1"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 steps on mesh data=2,model=4: equal to eager" in done.stdout
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["sharding"]["plan"] == plan
    assert record["sharding"]["mesh"] == "data=2,model=4"
    assert record["sharding"]["optimizer"] == optimizer
    measured = sum(g["collective_bytes"] for g in record["graphs"].values())
    # as a TPU would move them: the all-reduces every device slices are reduce-scatters there
    assert 0 < record["accelerator_collective_bytes"] <= measured
    figures = tune.figures(record, "tpu")
    assert figures["collective_bytes"] == record["accelerator_collective_bytes"]
    assert tune.figures(record)["collective_bytes"] == measured


@pytest.mark.slow
def test_acceptance_tune_searches_the_plans_of_a_llama_on_8_devices(tmp_path, monkeypatch):
    """The third acceptance program: tune --mesh data=2,model=4 --memory-per-device 1.5MiB.
    Data parallelism (the defaults: AdamW's state and the gradients whole on every device) is
    refused before compiling; of the plans that ran and fit, the chosen one's per-device peak
    beats the defaults'; each run checked its results against eager."""
    for key, value in _env().items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "tuned"
    command = ["tune", "--out", str(out), "--budget", "20", "--mesh", "data=2,model=4"]
    command += ["--memory-per-device", "1.5MiB", str(LLAMA), "2"]
    assert cli.main(command) == 0
    facts = json.loads((out / "tune.json").read_text())
    status = {r["plan"]: r["status"] for r in facts["plans"]}
    assert status["data"] == "refused" and status["expert_parallel"] == "does not apply"
    chosen = facts["config"]["sharding"]["plan"]
    assert status[chosen] == "chosen" and chosen != "data"
    assert not (out / "plan-data").exists()  # refused: never run as a candidate
    before, after = facts["before"], facts["after"]
    assert after["peak_bytes"] < before["peak_bytes"]
    assert after["peak_bytes"] <= 1.5 * 2**20
    assert "| data | refused |" in (out / "report.md").read_text()


def test_a_plan_whose_run_fails_is_its_row_and_not_chosen():
    _, survey = _survey()
    before = _record(survey, peak=100, collective=50)

    def run_plan(name):
        if name == "fsdp":
            raise TpuInductorError("tpu-inductor tune: llama.py failed (exit 1): not eager's")
        return _record(survey, peak=100, collective=10)

    chosen, rows = search.search(before, lambda r: r["figures"], run_plan, None)
    fsdp = next(r for r in rows if r["plan"] == "fsdp")
    assert fsdp["status"] == "failed" and "not eager's" in fsdp["reason"]
    assert chosen == "tensor_parallel"  # the first of the fewest collective bytes

    def fails(name):
        raise TpuInductorError(f"{name} failed")

    failing = {**before, "sharding": {**survey, "plan": "none of them"}}  # the defaults' too
    with pytest.raises(TpuInductorError, match="no sharding plan ran on mesh .*fsdp failed"):
        search.search(failing, lambda r: r["figures"], fails, None)


def test_for_another_platform_the_measured_plan_figures_are_marked_estimates(monkeypatch):
    monkeypatch.setattr(tune, "figures", lambda record, platform=None: record["figures"])
    _, survey = _survey()
    before = {**_record(survey, peak=100, collective=5), "platform": "cpu"}

    def run(platform):
        return tune.propose_sharding(
            before, "data=2,model=4", None, lambda n: _record(survey, 100, 10), platform
        )

    config, rows, notes, estimates = run("tpu")
    assert config == {"mesh": "data=2,model=4", "plan": "data"}
    assert any("estimates for tpu, whose compiler is not here" in e for e in estimates)
    assert not any("estimates for" in e for e in run("cpu")[3])
    assert "lower bounds" in estimates[0]  # the shapes' figures, on every platform
