"""Shape bucketing on Hugging Face models built from configs (tests/hf_zoo.py): properties over
sizes and policies.

GPT-2, BERT, Llama and T5 at drawn lengths under a drawn policy, with and without an attention
mask (a masked prefix in one row), the padding filled with zeros, NaN or +inf (and the largest
integer in integer inputs): inference outputs, and a training step's loss and every gradient,
equal eager's at the true sizes (float32: atol 1e-5, rtol 1e-4) and the exact-size compile's to
a few ulp of each result's scale. A graph the pass refuses (it says why) must still be exact;
only T5 may be refused. Few examples each: every one costs several compiles.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import hf_zoo
from tests.helpers import assert_same, grads_of
from tests.strategies import PROPERTY
from tpu_inductor.runtime import buckets

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

MODELS = ("gpt2", "bert", "llama", "t5")
# One layer (every op kind, half the compile); 64 positions: every bucket below fits them.
SIZE = hf_zoo.Size(seq=32, layers=1)
# The costliest cases (40-75 s each on a loaded 2-core machine) run with `make test-slow`;
# BERT's training step also runs in tests/passes/test_bucketing.py's masked training test.
SLOW = {("bert", True), ("t5", True)}
KINDS = [
    pytest.param(
        name,
        train,
        id=f"{name}-{'training' if train else 'inference'}",
        marks=[pytest.mark.slow] if (name, train) in SLOW else [],
    )
    for train in (False, True)
    for name in MODELS
]
POLICIES = (
    {"policy": "pow2", "min_bucket": 8},
    {"policy": "multiple", "multiple": 8},
    {"policy": "sizes", "sizes": [12, 24, 40]},
)
# caplog is cleared per example; Dynamo is reset per example
FEW = settings(
    PROPERTY, max_examples=1, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
CASES = dict(
    lengths=st.lists(st.integers(3, 30), min_size=2, max_size=2, unique=True),
    shapes=st.sampled_from(POLICIES),
    masked=st.booleans(),
    pad_with=st.sampled_from(["zeros", "nan", "inf"]),
)
TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}
ULPS = 16  # sums over a padded dim add the same real terms, maybe in another order


def _kwargs(name: str, inputs: dict, n: int, masked: bool, train: bool) -> dict:
    """The model's inputs at length `n`, each length dim marked dynamic."""
    kwargs = {k: v[:, :n].clone() if k.endswith("input_ids") else v for k, v in inputs.items()}
    if masked:
        kwargs["attention_mask"] = torch.ones(2, n, dtype=torch.long)
        kwargs["attention_mask"][0, :3] = 0
    if train and name != "bert":
        kwargs["labels"] = kwargs["input_ids"].clone()
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(value, 1)
    return kwargs


def _results(name: str, model, kwargs: dict, train: bool, params) -> dict[str, torch.Tensor]:
    """Inference: every tensor output; training: the loss and every gradient of `params`'s
    parameters (the module `model` runs)."""
    if not train:
        with torch.no_grad():
            out = model(**kwargs)
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    out = model(**kwargs)
    loss = out.logits.square().mean() if name == "bert" else out.loss
    return {"loss": loss.detach(), **grads_of(params, loss)}


def _run(name: str, shapes: dict, lengths, masked: bool, train: bool, caplog) -> list[dict]:
    """The model compiled under `shapes`, at each length: its results, checked against eager's
    (a model built the same way, run eagerly) as they come."""
    model, inputs = hf_zoo.build(name, SIZE)
    reference, _ = hf_zoo.build(name, SIZE)
    if train:
        model.train(), reference.train()
    options = {"shapes": shapes, "fallback": "error"}
    compiled = torch.compile(model, backend="tpu_inductor", options=options)
    runs = []
    with caplog.at_level(logging.INFO, logger="tpu_inductor.passes.bucket_shapes"):
        for n in lengths:
            kwargs = _kwargs(name, inputs, n, masked, train)
            got = _results(name, compiled, kwargs, train, model)
            want = _results(
                name, reference, _kwargs(name, inputs, n, masked, train), train, reference
            )
            assert got.keys() == want.keys()
            for key in want:
                assert_same(got[key], want[key], **TOLERANCE)
            runs.append(got)
    return runs


def _check(name: str, shapes: dict, lengths, masked: bool, pad_with: str, train: bool, caplog):
    torch._dynamo.reset()
    caplog.clear()
    buckets.clear_report()
    bucketed = _run(name, {**shapes, "pad_with": pad_with}, lengths, masked, train, caplog)
    refusals = [r.getMessage() for r in caplog.records if "not bucketing" in r.getMessage()]
    if name == "t5":  # relative-position buckets may be refused: then with a reason, and exact
        assert all(r.split(": ", 1)[1].strip() for r in refusals)
    else:
        assert refusals == [], refusals
        assert buckets.report(), "no graph was bucketed"
    torch._dynamo.reset()
    (exact,) = _run(name, {"policy": "exact"}, lengths[-1:], masked, train, caplog)
    scales = _scales(exact)
    for key, a in exact.items():  # at the length the bucket served second
        b = bucketed[-1][key]
        if not a.dtype.is_floating_point:
            assert torch.equal(a, b), key
            continue
        assert (a - b).abs().max() <= ULPS * torch.finfo(a.dtype).eps * scales[key], key


def _scales(results: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each float result's scale for the ulp comparison: the largest magnitude among the results
    of its module (a parameter's gradient shares it with its siblings': a weight's and its
    bias's gradients sum the same upstream gradient, and one that cancels to rounding noise,
    as BERT's key bias does — softmax does not see it — is rounded at its weight's scale)."""
    largest: dict[str, torch.Tensor] = {}
    floats = {k: v for k, v in results.items() if v.dtype.is_floating_point}
    for key, value in floats.items():
        module = key.rpartition(".")[0] or key
        top = value.abs().max() if value.numel() else torch.zeros(())
        largest[module] = torch.maximum(largest.get(module, top), top)
    tiny = torch.finfo(torch.float32).tiny
    return {k: largest[k.rpartition(".")[0] or k].clamp_min(tiny) for k in floats}


@pytest.mark.parametrize("name, train", KINDS)
@FEW
@given(**CASES)
def test_bucketed_equals_eager_and_the_exact_compile(
    name, train, lengths, shapes, masked, pad_with, caplog
):
    _check(name, shapes, lengths, masked, pad_with, train, caplog)
