"""Real Hugging Face architectures through `torch.compile(..., backend="tpu_inductor")`.

Each model (tests/hf_zoo.py: tiny configs, random seeded weights) must compile whole: with
fallback="error" an op without a rule fails the test, Dynamo must record no graph break, and
every compile record must have succeeded without an eager region. Inference logits match eager
at rtol/atol 1e-4; GPT-2, BERT and Llama also match a training step (loss and every gradient).
Larger variants carry the `slow` marker.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from tests import hf_zoo
from tests.helpers import assert_same, grads_of
from tpu_inductor.debug import records as debug

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

pytest.importorskip("transformers")

STRICT = {"fallback": "error"}
TOL = {"rtol": 1e-4, "atol": 1e-4}
SIZES = [
    pytest.param(hf_zoo.TINY, id="tiny"),
    pytest.param(hf_zoo.LARGE, id="large", marks=pytest.mark.slow),
]


def _compile_whole(model: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """The model compiled strictly, and the number of compile records before it ran."""
    return torch.compile(model, backend="tpu_inductor", options=STRICT), len(debug.records)


def _assert_compiled_whole(first_record: int, graphs: int) -> None:
    """No graph break, one Dynamo graph, and `graphs` ATen graphs compiled with no eager region."""
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    records = debug.records[first_record:]
    assert len(records) == graphs, [r.graph for r in records]
    for record in records:
        assert record.status == "ok" and not record.fallback, (record.graph, record.error)
        assert "." not in record.graph  # "forward_3.fused_0" would be a partitioned region


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", hf_zoo.MODELS)
def test_inference_logits_match_eager(name, size):
    model, inputs = hf_zoo.build(name, size)
    compiled, first = _compile_whole(copy.deepcopy(model))
    with torch.no_grad():
        expected = model(**inputs).logits
        actual = compiled(**inputs).logits
    assert_same(actual, expected, **TOL)
    _assert_compiled_whole(first, graphs=1)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", hf_zoo.TRAINABLE)
def test_training_step_matches_eager(name, size):
    model, inputs = hf_zoo.build(name, size)
    model.train()
    inputs["labels"] = inputs["input_ids"]
    compiled_model = copy.deepcopy(model)
    compiled, first = _compile_whole(compiled_model)
    expected = model(**inputs).loss
    actual = compiled(**inputs).loss
    assert_same(actual, expected, **TOL)
    expected_grads, actual_grads = grads_of(model, expected), grads_of(compiled_model, actual)
    assert len(actual_grads) == len(list(model.parameters()))
    assert_same(actual_grads, expected_grads, **TOL)
    _assert_compiled_whole(first, graphs=2)  # forward and backward
