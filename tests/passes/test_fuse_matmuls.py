"""Same-input matmul merging (passes/fuse_matmuls.py) on Hugging Face models from configs.

Each model is compiled with the merge on and off and trained one step: logits, loss and every
parameter's gradient equal the unfused compile's (float32 1e-6) and eager torch's; the merge
rewrote exactly the groups the model has (Q/K/V and gate/up in the forward, their weights'
gradients in the backward), and nothing with it off.
"""

from __future__ import annotations

import collections

import pytest
import torch
from tpu_inductor.passes import pipeline

from tests import hf_zoo
from tests.fusion_checks import (
    assert_dumped_rewrite,
    assert_option_validated_and_keyed,
    llama_trained_at_two_lengths,
    rewrites_since,
)
from tests.helpers import assert_same, grads_of

# model -> (shared_input groups, shared_right groups, matmuls merged), forward and backward
# together, for hf_zoo's two layers: Llama's q/k/v and gate/up per layer (and their weights'
# gradients), BERT's q/k/v (addmm, biased), GPT-2 none (c_attn is already one weight).
EXPECTED = {
    "llama": (4, 4, 20),
    "bert": (2, 2, 12),
    "gpt2": (0, 0, 0),
}


def _train_step(name: str, options: dict):
    """(logits, loss, gradients by name, fuse_matmuls' rewrites) of one compiled step."""
    model, kwargs = hf_zoo.build(name)
    torch._dynamo.reset()
    before = collections.Counter(pipeline.counters)
    compiled = torch.compile(model, backend="tpu_inductor", options=options)
    out = compiled(**kwargs, labels=kwargs["input_ids"])
    grads = grads_of(model, out.loss)
    return (out.logits.detach(), out.loss.detach()), grads, rewrites_since("matmuls", before)


def _options(merge: bool) -> dict:
    return {"cache": False, "fallback": "error", "fusion": {"matmuls": merge}}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_training_step_equals_unfused_and_eager(name):
    merged, merged_grads, rewrites = _train_step(name, _options(True))
    unfused, unfused_grads, unfused_rewrites = _train_step(name, _options(False))
    assert unfused_rewrites == {}
    inputs, rights, matmuls = EXPECTED[name]
    assert rewrites.get("shared_input", 0) == inputs, rewrites
    assert rewrites.get("shared_right", 0) == rights, rewrites
    assert rewrites.get("matmuls", 0) == matmuls, rewrites
    assert_same(merged, unfused, rtol=1e-6, atol=1e-6)
    assert merged_grads.keys() == unfused_grads.keys()
    assert_same(merged_grads, unfused_grads, rtol=1e-6, atol=1e-6)
    model, kwargs = hf_zoo.build(name)
    eager = model(**kwargs, labels=kwargs["input_ids"])
    assert_same(merged, (eager.logits.detach(), eager.loss.detach()))
    assert_same(merged_grads, grads_of(model, eager.loss))


def test_training_at_symbolic_lengths():
    """Llama trained at two lengths with dynamic=True (bucketed, pow2): the forward's groups
    and the backward's weight gradients merge (bucketing masks each gradient's x on its own:
    equal nodes, one group); logits, loss and every gradient equal eager torch's."""
    rewrites = llama_trained_at_two_lengths(_options(True), "matmuls")
    assert rewrites.get("shared_input") == 4 and rewrites.get("shared_right") == 4, rewrites


def test_independent_members_only():
    """Of matmuls sharing x, one that reads another's result is not merged with it (that would
    be a cycle); the rest are, and every result equals eager torch's."""
    from tests.helpers import check_against_eager

    def fn(x, w1, w2, g1, g2, bias):
        a, b = x @ w1.t(), x @ w2.t()  # shared input, weights: merged
        c, d = g1 @ x, g2 @ x  # shared right operand: merged
        e = (g2 + c.sum()) @ x  # reads c: stays on its own
        f = torch.addmm(bias, x, w1.t()) + torch.addmm(bias, x, w2.t())  # broadcast bias: apart
        return a, b, c, d, e, f

    before = collections.Counter(pipeline.counters)
    args = [torch.randn(5, 4), torch.randn(3, 4), torch.randn(3, 4)]
    args += [torch.randn(6, 5), torch.randn(6, 5), torch.randn(1)]
    check_against_eager(fn, *args, options={"fusion": {"matmuls": True}})
    assert rewrites_since("matmuls", before) == {"shared_input": 1, "shared_right": 1, "matmuls": 4}


def test_equal_inputs_are_one_input():
    """Inputs computed twice alike (one target, equal arguments) are one shared input; ones
    whose arguments differ only in a number's type or sign are not."""
    from tests.helpers import check_against_eager

    def fn(x, w1, w2, w3, w4):
        a, b = (x * 2) @ w1.t(), (x * 2) @ w2.t()  # equal: merged
        c, d = (x * 2.0) @ w3.t(), (x * -0.0) @ w4.t()  # 2.0 is not 2, -0.0 not 0.0
        e = (x * 0.0) @ w1.t()
        return a, b, c, d, e

    before = collections.Counter(pipeline.counters)
    args = [torch.randn(5, 4)] + [torch.randn(3, 4) for _ in range(4)]
    check_against_eager(fn, *args, options={"fusion": {"matmuls": True}})
    assert rewrites_since("matmuls", before) == {"shared_input": 1, "matmuls": 2}


def test_dump_shows_the_rewrite(tmp_path):
    """The merge is in the dumps: the pass's graph and its diff from the graph before it."""
    assert_dumped_rewrite(
        tmp_path,
        "matmuls",
        {"shared_input": 4, "matmuls": 10},
        added=("aten.cat.default", 4),
        removed=("aten.mm.default", 10),
    )


def test_option_is_validated_and_in_the_cache_key():
    assert_option_validated_and_keyed("matmuls")
