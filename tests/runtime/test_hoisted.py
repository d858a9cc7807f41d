"""Weights made once per parameter version (passes/hoist_weights.py, tpu_inductor/runtime/hoisted.py):
at inference the concatenated weights of merged matmuls are made on the device when a source
changes, not on every call, and give eager torch's numbers before and after every change.
Run on the non-zero-copy CPU device (`cpu-copy`), where a stale copy shows as a wrong number.
"""

from __future__ import annotations

import pytest
import torch
from tpu_inductor.passes import hoist_weights

import tpu_inductor
from tests import hf_zoo
from tests.helpers import assert_same
from tpu_inductor.runtime import hoisted, residency

aten = torch.ops.aten


def _options(merge: bool, device: str = "cpu-copy") -> dict:
    return {"cache": False, "fallback": "error", "fusion": {"matmuls": merge}, "device": device}


def _logits(compiled, kwargs) -> torch.Tensor:
    with torch.no_grad():
        return compiled(**kwargs).logits


@pytest.mark.parametrize("name", ["llama", "bert"])
@pytest.mark.parametrize("device", ["cpu-copy", "cpu"])
def test_inference_makes_the_weights_once_and_moves_only_inputs_and_outputs(name, device):
    model, kwargs = hf_zoo.build(name)
    model.eval()
    eager = _logits(model, kwargs)
    torch._dynamo.reset()
    unfused = _logits(
        torch.compile(model, backend="tpu_inductor", options=_options(False, device)), kwargs
    )
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tpu_inductor", options=_options(True, device))
    made = hoisted.stats["made"]
    first = _logits(compiled, kwargs)
    assert hoisted.stats["made"] == made + 1  # one inference graph, its weights made once
    tpu_inductor.reset_transfers()
    steady = [_logits(compiled, kwargs) for _ in range(3)]
    moved = tpu_inductor.transfers()
    assert hoisted.stats["made"] == made + 1, "made again with no parameter changed"
    assert moved["host_to_device"]["parameter"] == 0, moved
    assert moved["host_to_device"]["argument"] == 3 * sum(
        v.numel() * v.element_size() for v in kwargs.values() if isinstance(v, torch.Tensor)
    )
    assert moved["device_to_host"]["output"] == 3 * eager.numel() * eager.element_size()
    for out in (first, *steady):
        assert_same(out, unfused, rtol=1e-6, atol=1e-6)
        assert_same(out, eager)


def test_a_changed_source_weight_is_made_again():
    """An in-place write to one of the concatenated weights, and a parameter replaced by a new
    tensor: each next call makes the weights again and gives eager's new numbers."""
    model, kwargs = hf_zoo.build("llama")
    model.eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tpu_inductor", options=_options(True))
    _logits(compiled, kwargs)
    made = hoisted.stats["made"]
    attention = model.model.layers[1].self_attn
    with torch.no_grad():
        attention.k_proj.weight.mul_(-1.5)
    assert_same(_logits(compiled, kwargs), _logits(model, kwargs))
    assert hoisted.stats["made"] == made + 1
    attention.v_proj.weight = torch.nn.Parameter(torch.randn_like(attention.v_proj.weight))
    assert_same(_logits(compiled, kwargs), _logits(model, kwargs))
    assert hoisted.stats["made"] == made + 2


def test_sources_only_the_prologue_reads_are_not_kept_on_the_device():
    """Once the concatenation is made, the device copies of its sources are dropped (they would
    double the weights' memory): no mirror of q_proj's weight, and the prologue holds none."""
    model, kwargs = hf_zoo.build("llama")
    model.eval()
    torch._dynamo.reset()
    _logits(torch.compile(model, backend="tpu_inductor", options=_options(True)), kwargs)
    attention = model.model.layers[0].self_attn
    assert not residency.mirrors.has_copy(attention.q_proj.weight)
    assert residency.mirrors.has_copy(attention.o_proj.weight)  # the main graph reads it


def test_a_training_step_concatenates_in_the_graph():
    """A training graph's parameters change every step: nothing is hoisted out of it."""
    model, kwargs = hf_zoo.build("llama")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tpu_inductor", options=_options(True))
    made = hoisted.stats["made"]
    compiled(**kwargs, labels=kwargs["input_ids"]).loss.backward()
    assert hoisted.stats["made"] == made


def _graph(fn, *args) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*args)


def test_split_takes_marked_work_on_static_inputs_only():
    """A marked cat of two static inputs is split out (its sources not read by the rest are
    named); one that reads a per-call input stays in the graph; results are the graph's."""

    def fn(x, w1, w2, b):
        weights = torch.cat([w1, w2])  # marked, static sources: hoisted
        mixed = torch.cat([b, x[0]])  # marked, reads x: stays
        return x @ weights.t() + b, mixed.sum() * w2.sum()

    args = [torch.randn(3, 4), torch.randn(2, 4), torch.randn(5, 4), torch.randn(7)]
    gm = _graph(fn, *args)
    for node in gm.graph.nodes:
        if node.target is aten.cat.default:
            node.meta[hoist_weights.MARK] = True
    assert hoist_weights.split(gm, frozenset(), 4) is None  # nothing static
    split = hoist_weights.split(gm, frozenset({1, 2, 3}), 4)
    assert split.sources == (1, 2) and split.prologue_only == (1,)  # w2 is read by the rest
    made = split.prologue(*args[1:3])
    assert_same(made[0], torch.cat(args[1:3]))
    assert_same(split.main(*args, *made), fn(*args))
    cats = [n for n in split.main.graph.nodes if n.target is aten.cat.default]
    assert len(cats) == 1  # the mixed one


def test_the_dumps_show_both_halves(tmp_path):
    """The prologue is a compile record of its own (`<graph>_weights`) with its graph, the
    main graph's record shows the graph it runs; the prologue's per-call transfers are 0."""
    from tpu_inductor.debug import report

    model, kwargs = hf_zoo.build("llama")
    torch._dynamo.reset()
    options = {**_options(True), "dump_dir": str(tmp_path)}
    _logits(torch.compile(model, backend="tpu_inductor", options=options), kwargs)
    prologue, main = sorted(report.load_run(tmp_path), key=lambda c: c["folder"])
    assert prologue["graph"] == main["graph"] + "_weights"
    assert any(f.endswith("_hoisted_prologue.py") for f in prologue["files"])
    assert any(f.endswith("_hoisted_main.py") for f in main["files"])
    assert prologue["transfers"]["kept_on_device"] == 4  # Q/K/V and gate/up of both layers
    assert not any(prologue["transfers"]["per_call"]["host_to_device"].values())


def test_a_bucketed_graph_at_two_lengths_makes_its_weights_once():
    """dynamic=True (pow2 buckets): the main graph's true sizes come after the made weights;
    logits equal eager at both lengths, and the weights are made once for both."""
    model, kwargs = hf_zoo.build("llama")
    model.eval()
    torch._dynamo.reset()
    options = _options(True)
    compiled = torch.compile(model, backend="tpu_inductor", options=options, dynamic=True)
    made = hoisted.stats["made"]
    for length in (5, 11):
        ids = kwargs["input_ids"][:, :length].contiguous()  # one Dynamo graph for both
        with torch.no_grad():
            assert_same(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
    assert hoisted.stats["made"] == made + 1
