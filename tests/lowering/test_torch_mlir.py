"""torch-mlir as a second frontend: the option, the fallback chain, and a differential test.

The real models' forward graphs (tests/hf_zoo.py) are lowered both by our rules and by
torch-mlir, both modules are compiled by PJRT, and the results are compared with each other and
with eager. Without torch-mlir installed, only the typed "not installed" error is tested.
"""

from __future__ import annotations

import copy
import logging
import sys

import pytest
import torch
import torch.nn as nn
from tpu_inductor.lowering import registry, stablehlo, torch_mlir

from tests import hf_zoo
from tests.helpers import assert_same, grads_of
from tpu_inductor import lowering
from tpu_inductor.config import Options
from tpu_inductor.debug import records as debug
from tpu_inductor.exc import FrontendUnavailableError, OptionError
from tpu_inductor.runtime import compiled_graph, devices

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

needs_torch_mlir = pytest.mark.skipif(
    not torch_mlir.available(),
    reason="torch-mlir is not installed (pip install -e '.[torch-mlir]')",
)
TOL = {"rtol": 1e-4, "atol": 1e-4}
TORCH_MLIR = {"lowering": "torch-mlir", "fallback": "error"}


def _compile(fn, **options):
    return torch.compile(fn, backend="tpu_inductor", options=options)


# --- the option and the missing-package error ------------------------------------------------


def test_lowering_option_values_and_env(monkeypatch):
    assert Options.from_user().lowering == "own"
    assert Options.from_user({"lowering": "torch-mlir"}).lowering == "torch-mlir"
    with pytest.raises(OptionError, match=r"'lowering' has value 'mlir'.*'own', 'torch-mlir'"):
        Options.from_user({"lowering": "mlir"})
    monkeypatch.setenv("TPU_INDUCTOR_LOWERING", "torch-mlir")
    assert Options.from_user().lowering == "torch-mlir"
    assert Options.from_user({"lowering": "torch-mlir"}).cache_key_entries()["lowering"] == (
        "torch-mlir"
    )


@pytest.mark.parametrize("options", [{"lowering": "torch-mlir"}, {"fallback": "torch-mlir"}])
def test_missing_torch_mlir_is_a_typed_error(monkeypatch, options):
    monkeypatch.setitem(sys.modules, "torch_mlir", None)  # `import torch_mlir` now fails
    with pytest.raises(FrontendUnavailableError, match=r"pip install -e '\.\[torch-mlir\]'"):
        torch_mlir.require()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        _compile(lambda x: x.sin(), **options)(torch.randn(3))
    assert isinstance(info.value.inner_exception, FrontendUnavailableError)


# --- lowering="torch-mlir" end to end --------------------------------------------------------


@needs_torch_mlir
def test_torch_mlir_lowering_is_used_and_matches_eager():
    def f(x, n: int):
        return torch.softmax(x @ x.T, -1).cumsum(0) * n, x.to(torch.int64).sum()

    x = torch.randn(5, 3)
    first = len(debug.records)
    assert_same(_compile(f, **TORCH_MLIR)(x, 3), f(x, 3), **TOL)
    records = debug.records[first:]
    assert records and all(r.options["lowering"] == "torch-mlir" for r in records)


@needs_torch_mlir
def test_torch_mlir_refuses_random_ops_it_would_not_seed_from_torch():
    """Its random ops draw XLA's stream, the same in every process whatever torch.manual_seed
    says: refused by name (seeded runs were not repeatable, and different seeds drew alike)."""

    def f(x):
        return torch.rand_like(x) + torch.nn.functional.dropout(x, 0.5)

    with pytest.raises(Exception, match=r"ignore torch's generator.*aten.rand"):
        _compile(f, lowering="torch-mlir")(torch.ones(4))


def test_attention_draws_random_numbers_only_with_dropout():
    """Attention ops are tagged seeded for their dropout_p: without dropout they draw nothing,
    so the torch-mlir frontend need not refuse them."""
    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    plain = graph.call_function(flash, (q, k, v))
    zero = graph.call_function(flash, (q, k, v, 0.0))
    dropout = graph.call_function(flash, (q, k, v, 0.1))
    keyword = graph.call_function(flash, (q, k, v), {"dropout_p": 0.1})
    rand = graph.call_function(torch.ops.aten.rand_like.default, (q,))
    draws = [torch_mlir._draws_random_numbers(n) for n in (plain, zero, dropout, keyword, rand)]
    assert draws == [False, False, True, True, True]


@needs_torch_mlir
def test_torch_mlir_training_step_drops_none_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    compiled_model = copy.deepcopy(model)
    tokens = torch.randint(0, 16, (3, 5))  # an int input: its gradient is a None output
    expected = model(tokens).square().mean()
    actual = _compile(compiled_model, **TORCH_MLIR)(tokens).square().mean()
    assert_same(actual, expected, **TOL)
    assert_same(grads_of(compiled_model, actual), grads_of(model, expected), **TOL)


@needs_torch_mlir
def test_torch_mlir_writes_back_buffer_mutations():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    compiled_model = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert_same(_compile(compiled_model, **TORCH_MLIR)(x), model(x), **TOL)
    assert_same(dict(compiled_model.named_buffers()), dict(model.named_buffers()), **TOL)


# --- the fallback chain: own rules → torch-mlir → eager --------------------------------------

torch.library.define("tpu_inductor_test::opaque", "(Tensor x) -> Tensor")


@torch.library.impl("tpu_inductor_test::opaque", "cpu")
def _opaque(x):
    return x * 2 + 1


@torch.library.register_fake("tpu_inductor_test::opaque")
def _(x):
    return torch.empty_like(x)


def _chain(x):
    # sin: taken from our rules by the test; opaque: no frontend knows it, so eager torch.
    return torch.ops.tpu_inductor_test.opaque(x.sin().exp()).cos()


@needs_torch_mlir
def test_fallback_chain_own_then_torch_mlir_then_eager(monkeypatch, caplog):
    ours = registry.supported

    def supported(node, platform=None):
        return node.target is not torch.ops.aten.sin.default and ours(node, platform)

    for module in (registry, lowering):  # what missing_ops asks, and the public face
        monkeypatch.setattr(module, "supported", supported)
    x = torch.randn(6)
    first = len(debug.records)
    with caplog.at_level(logging.INFO, logger="tpu_inductor"):
        assert_same(_compile(_chain, fallback="torch-mlir", cache=False)(x), _chain(x))
    frontends = sorted(
        (r.graph.split(".")[-1][:-2], r.options["lowering"], r.status)
        for r in debug.records[first:]
    )
    assert frontends == [
        ("fused", "own", "ok"),  # exp, before the opaque op
        ("fused", "own", "ok"),  # cos, after it
        ("torch_mlir", "torch-mlir", "failed"),  # the opaque op: eager torch
        ("torch_mlir", "torch-mlir", "ok"),  # sin
    ]
    messages = [r.getMessage() for r in caplog.records]
    assert any("(aten.sin.default) lowered by torch-mlir" in m for m in messages)
    assert any(
        "(tpu_inductor_test.opaque.default) runs in eager torch: torch-mlir could not" in m
        for m in messages
    )


# --- differential: the real models' forward graphs lowered both ways -------------------------


def _forward_graph(model, inputs):
    """The ATen inference graph AOTAutograd hands the backend, and the real inputs of one call."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from tpu_inductor import decompositions

    captured = []

    def capture(gm, _example_inputs):
        def call(*args):
            captured.append((gm, list(args)))
            return gm(*args)

        return make_boxed_func(call)

    backend = aot_autograd(
        fw_compiler=capture,
        decompositions=decompositions.table(),
        keep_inference_input_mutations=True,
    )
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(**inputs)
    (graph,) = captured
    return graph


def _run(frontend, gm, args, device):
    lowered = frontend.lower(gm, args, platform=device.lowering_platform)
    executable = devices.compile_stablehlo(lowered.bytecode, device)
    return compiled_graph.CompiledGraph(executable, lowered, device)(
        list(args)
    )  # it clears its list


@needs_torch_mlir
@pytest.mark.parametrize("name", hf_zoo.MODELS)
def test_forward_graph_lowered_both_ways_agrees(name):
    gm, args = _forward_graph(*hf_zoo.build(name))
    device = devices.select_device("cpu")
    with torch.no_grad():
        expected = list(gm(*args))
        ours = _run(stablehlo, gm, args, device)
        theirs = _run(torch_mlir, gm, args, device)
    assert_same(ours, expected, **TOL)
    assert_same(theirs, expected, **TOL)
    assert_same(theirs, ours, **TOL)
