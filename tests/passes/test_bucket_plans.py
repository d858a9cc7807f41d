"""Bucket plans at work (the `auto` policy: passes/bucket_policy.py's BucketPlan, used by
tpu_inductor/runtime/buckets.py): a pair of symbols of one graph (batch x length) bucketed at its
joint boundaries, in this process and in a new one reading the plan file. Compiles are counted
(PJRT compiles), not timed; every result equals eager's with NaN in the padding."""

from __future__ import annotations

import json

import pytest
import torch
from tpu_inductor.passes.bucket_policy import BucketPlan, BucketPolicy

import tpu_inductor
from tests.helpers import assert_same, forget_compiles
from tpu_inductor import cli
from tpu_inductor.aot import artifact
from tpu_inductor.aot import buckets as aot_buckets
from tpu_inductor.aot import loader as aot_loader
from tpu_inductor.exc import OptionError
from tpu_inductor.runtime import buckets as bucketing

NAN_PADDING = {"pad_with": "nan"}
# Batch x length pairs of one run: pow2 buckets them as (4, 64) and (8, 16), 2 compiles.
PAIRS = [(3, 40), (3, 38), (6, 12), (6, 10), (7, 11), (3, 40)]


def _new_process() -> None:
    """As a new process: no Dynamo graph, no executable in memory, no plan read yet."""
    torch._dynamo.reset()
    forget_compiles()  # another test in this worker may have compiled the same graph
    bucketing.forget_plans()


@pytest.fixture(autouse=True)
def _fresh():
    _new_process()
    yield
    _new_process()


class _TwoDims(torch.nn.Module):
    def forward(self, x):
        return x.softmax(1).sum(0)  # reads across both padded dims


def make_model() -> torch.nn.Module:
    """The factory `tpu-inductor compile tests.passes.test_bucket_plans:make_model` builds."""
    return _TwoDims()


def _two_dims(x):
    return _TwoDims()(x)


def _run(shapes: dict, pairs) -> tuple[dict, int]:
    """The model compiled under `shapes` at each (batch, length): what the bucketed graph
    reports, and the PJRT compiles it made."""
    torch._dynamo.reset()
    options = {"shapes": shapes, "fallback": "error", "cache": False}
    compiled = torch.compile(make_model(), backend="tpu_inductor", options=options)
    before = tpu_inductor.compiles()
    for b, n in pairs:
        x = torch.randn(b, n)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        torch._dynamo.maybe_mark_dynamic(x, 1)
        assert_same(compiled(x), _two_dims(x), atol=1e-6, rtol=1e-5)
    return bucketing.report()[-1], tpu_inductor.compiles() - before


def _served(joint: dict, pairs) -> set[str]:
    """The buckets a plan's joint entry gives `pairs`, as the report names them."""
    batch, length = (BucketPolicy("sizes", sizes=b) for b in joint["boundaries"])
    return {str((batch.bucket(b), length.bucket(n))) for b, n in pairs}


def test_the_joint_plan_is_chosen_saved_and_used_by_a_new_process(tmp_path):
    plan = tmp_path / "plan.json"
    shapes = {"policy": "auto", "plan": str(plan), **NAN_PADDING}
    first, first_compiles = _run(shapes, PAIRS)  # no plan yet: as pow2
    assert set(first["buckets"]) == {"(4, 64)", "(8, 16)"} and first_compiles == 2
    assert tpu_inductor.save_plans() == [str(plan)]
    doc = json.loads(plan.read_text())
    (joint,) = doc["joint"]
    assert joint["symbols"] == ["L['x'].size()[0]", "L['x'].size()[1]"]
    assert sum(c for *_, c in joint["histogram"]) == len(PAIRS)
    # Each key alone would bucket otherwise: the pair's boundaries must win.
    for key, single in zip(joint["symbols"], ([8], [64])):
        doc["symbols"][key]["boundaries"] = single
    plan.write_text(json.dumps(doc))
    _new_process()  # the plan read from its file
    second, second_compiles = _run(shapes, PAIRS)
    assert set(second["buckets"]) == _served(joint, PAIRS)
    assert second_compiles <= first_compiles  # never more compiles than pow2
    assert second["padded_share"] < first["padded_share"]


def test_precompile_takes_the_joint_plans_bucket_pairs(tmp_path):
    """Batch and length precompiled from a saved joint plan: every pair of its boundaries,
    then a new run of the same sizes compiles nothing."""
    from tpu_inductor.config import Options

    shapes = {"policy": "auto", "plan": str(tmp_path / "plan.json"), **NAN_PADDING}
    _run(shapes, PAIRS)
    tpu_inductor.save_plans()
    (joint,) = json.loads((tmp_path / "plan.json").read_text())["joint"]
    _new_process()
    options = {"shapes": shapes, "fallback": "error", "cache": False}
    compiled = torch.compile(make_model(), backend="tpu_inductor", options=options)
    record = Options.from_user(options).shapes
    batch, length = joint["boundaries"]
    tops = {"B": batch[-1], "S": length[-1]}
    before = tpu_inductor.compiles()
    buckets = tpu_inductor.precompile(
        compiled, (torch.randn(2, 5),), {"B": {0: 0}, "S": {0: 1}}, tops, record
    )
    assert buckets == [{"B": b, "S": n} for b in batch for n in length]
    assert tpu_inductor.compiles() - before == len(buckets)
    with tpu_inductor.no_compiles(), torch.no_grad():  # precompiled without grad, as served
        for b, n in PAIRS:
            x = torch.randn(b, n)
            torch._dynamo.maybe_mark_dynamic(x, 0), torch._dynamo.maybe_mark_dynamic(x, 1)
            assert_same(compiled(x), _two_dims(x), atol=1e-6, rtol=1e-5)


class _ThreeDims(torch.nn.Module):
    def forward(self, x):
        return x.softmax(2).sum(1)  # reads across the padded dims 1 and 2


# Batch x length x width of one run: pow2 buckets them as (4, 64, 8) and (8, 16, 32).
TRIPLES = [(3, 40, 5), (3, 38, 6), (6, 12, 20), (6, 10, 18), (7, 11, 19), (3, 40, 5)]


def test_a_joint_plan_of_three_symbols_is_chosen_saved_and_used_by_a_new_process(tmp_path):
    plan = tmp_path / "plan.json"
    options = {"shapes": {"policy": "auto", "plan": str(plan), **NAN_PADDING}, "cache": False}

    def run() -> tuple[dict, int]:
        torch._dynamo.reset()
        compiled = torch.compile(_ThreeDims(), backend="tpu_inductor", options=options)
        before = tpu_inductor.compiles()
        for sizes in TRIPLES:
            x = torch.randn(sizes)
            for dim in range(3):
                torch._dynamo.maybe_mark_dynamic(x, dim)
            assert_same(compiled(x), _ThreeDims()(x), atol=1e-6, rtol=1e-5)
        return bucketing.report()[-1], tpu_inductor.compiles() - before

    first, first_compiles = run()  # no plan yet: as pow2
    assert len(first["buckets"]) == first_compiles == 2, first
    tpu_inductor.save_plans()
    (joint,) = json.loads(plan.read_text())["joint"]
    assert joint["symbols"] == [f"L['x'].size()[{d}]" for d in range(3)]
    assert sorted(tuple(row[:3]) for row in joint["histogram"]) == sorted(set(TRIPLES))
    _new_process()  # the plan read from its file
    second, second_compiles = run()
    policies = [BucketPolicy("sizes", sizes=b) for b in joint["boundaries"]]
    served = {str(tuple(p.bucket(n) for p, n in zip(policies, t))) for t in TRIPLES}
    assert set(second["buckets"]) == served
    assert second_compiles <= first_compiles  # never more compiles than pow2
    assert second["padded_share"] < first["padded_share"]


def test_the_aot_compiler_takes_the_plans_buckets(tmp_path):
    plan, out = tmp_path / "plan.json", tmp_path / "artifact"
    _run({"policy": "auto", "plan": str(plan)}, PAIRS)
    assert tpu_inductor.save_plans() == [str(plan)]
    (joint,) = json.loads(plan.read_text())["joint"]
    args = ["compile", "tests.passes.test_bucket_plans:make_model", "--input", "x:float32[B,S]"]
    assert cli.main([*args, "--plan", str(plan), "--out", str(out)]) == 0
    manifest = aot_loader.read_manifest(out)
    assert manifest["buckets"] == dict(zip("BS", joint["boundaries"]))
    assert all(e["padded"] for e in manifest["entries"])
    loaded, before = aot_loader.load(out, pad_with="nan"), tpu_inductor.compiles()
    for b, n in PAIRS:
        x = torch.randn(b, n)
        assert_same(loaded(x), _two_dims(x), atol=1e-6, rtol=1e-5)
    assert tpu_inductor.compiles() == before  # every size served by a compiled bucket


def test_a_plan_that_names_no_input_dim_says_what_it_has(tmp_path):
    plan = tmp_path / "plan.json"
    BucketPlan(boundaries={"L['x'].size()[1]": (16,)}).save(plan)
    specs = [artifact.parse_input("ids:int64[B,S]")]
    with pytest.raises(OptionError, match=r"no boundaries for the named dims .*L\['x'\]"):
        aot_buckets.buckets_from_plan(plan, specs)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        aot_buckets.buckets_from_plan(tmp_path / "typo.json", specs)


class _Lengths(torch.nn.Module):
    def forward(self, x):
        return x.softmax(1).sum(1)


def test_precompile_from_a_plan_compiles_its_buckets_and_nothing_after(tmp_path):
    from tpu_inductor.config import Options

    shapes = {"policy": "auto", "plan": str(tmp_path / "plan.json"), **NAN_PADDING}
    options = {"shapes": shapes, "fallback": "error"}
    lengths = [20, 21, 22, 23, 40, 41, 42, 20]

    def serve(compiled):
        for n in lengths:
            x = torch.randn(2, n)
            torch._dynamo.maybe_mark_dynamic(x, 1)
            assert_same(compiled(x), _Lengths()(x), atol=1e-6, rtol=1e-5)

    serve(torch.compile(_Lengths(), backend="tpu_inductor", options=options))
    tpu_inductor.save_plans()
    chosen = json.loads((tmp_path / "plan.json").read_text())["symbols"]["L['x'].size()[1]"]
    _new_process()
    compiled = torch.compile(_Lengths(), backend="tpu_inductor", options=options)
    before = tpu_inductor.compiles()
    record = Options.from_user(options).shapes
    buckets = tpu_inductor.precompile(compiled, (torch.randn(2, 5),), {0: 1}, 42, record)
    assert buckets == chosen["boundaries"] == [23, 42]  # pow2 would be 32 and 64
    assert tpu_inductor.compiles() - before == len(buckets)
    warm = tpu_inductor.compiles()
    serve(compiled)
    assert tpu_inductor.compiles() == warm
