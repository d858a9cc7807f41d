"""The shape policy end to end (passes/shapes.py, dispatch.py): graphs with symbolic sizes
compile once per signature, at that signature's sizes; integer inputs that are values only are
module arguments, not one compile per value; the compiles kept per graph are bounded."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from tests.helpers import assert_same, grads_of
from tpu_inductor.debug import records
from tpu_inductor.exc import LoweringError

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _compile(fn, **options):
    return torch.compile(fn, backend="tpu_inductor", options=options or None)


def test_symbolic_sizes_compile_per_size_and_log_it(caplog):
    def f(x):
        return (x * 2).sum(0) + x.shape[0]

    compiled = _compile(f, shapes={"policy": "exact"})  # pow2 would bucket it: 5 and 7 share 8
    with caplog.at_level(logging.INFO, logger="tpu_inductor"):
        for n in (3, 5, 7, 5):
            x = torch.randn(n, 4)
            assert_same(compiled(x), f(x))
    assert any("recompiling for new input sizes" in r.getMessage() for r in caplog.records)


def test_symbolic_graph_is_lowered_at_each_size_not_the_first_traced():
    """Rules read result shapes from node metadata: of a symbolic graph, for the size compiled."""
    pos = torch.nn.Embedding(32, 4)
    norm = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8))

    def f(x, y):
        return (
            x.new_zeros(x.shape[0] + 1),
            torch.full((x.shape[0], 2), 3.0),
            x + pos(torch.arange(x.shape[0])),
            norm(y),
        )

    compiled = _compile(f)
    for n in (3, 5, 7, 9):  # 5: automatic dynamic makes the graph symbolic; 7, 9: its sizes
        x, y = torch.randn(n, 4), torch.randn(n, 6)
        for got, want in zip(compiled(x, y), f(x, y)):
            assert_same(got, want)


def test_specializing_a_graph_makes_every_value_concrete_sizes_and_numbers_alike():
    """passes.shapes.concretize gives each node its value at the inputs: a value-only input and
    a size read from a tensor become ints (torch 2.11's FakeTensorProp left them symbolic, which
    the lowering refused), tensors their sizes; the lowering's check then passes."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from tpu_inductor.lowering import stablehlo
    from tpu_inductor.passes import shapes

    def fn(x, n):
        return x.reshape(-1)[:n] * x.shape[0]

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(4, 3), 5)
    assert shapes.is_symbolic(gm)
    specialized = shapes.concretize(gm, [torch.randn(6, 2), 7])
    values = {n.name: n.meta.get("val") for n in specialized.graph.nodes}
    assert values["n_1"] == 7 and type(values["n_1"]) is int
    assert values["sym_size_int_1"] == 6 and type(values["sym_size_int_1"]) is int
    assert tuple(values["x_1"].shape) == (6, 2) and tuple(values["mul_2"].shape) == (7,)
    assert not shapes.is_symbolic(specialized)
    stablehlo.require_concrete(specialized)
    assert shapes.is_symbolic(gm)  # the traced graph is left as it was


def test_size_arithmetic_of_symbolic_graphs_is_evaluated_not_left_to_eager():
    """torch.sym_sum (HF's dynamic RoPE sums sizes with it) is size arithmetic, not an op."""

    def f(x, y):
        return torch.zeros(torch.sym_sum([x.shape[0], x.shape[1], y.shape[0]])) + 1

    compiled = torch.compile(f, backend="tpu_inductor", options={"fallback": "error"}, dynamic=True)
    for rows, cols in ((2, 3), (4, 5)):
        x, y = torch.randn(rows, cols), torch.randn(rows + 1)
        assert_same(compiled(x, y), f(x, y))


def test_checks_on_sizes_are_evaluated_not_left_to_eager():
    """torch._check on sizes (aten._assert_scalar in the graph) holds for every size Dynamo's
    guards let through: evaluated at lowering, it splits no graph."""

    def f(x, n):
        torch._check(n >= 2)
        torch._check(x.shape[0] % 2 == 0)
        return x[:n] * 2 + 1

    compiled = torch.compile(f, backend="tpu_inductor", options={"fallback": "error"}, dynamic=True)
    for size in (4, 6, 8):
        x = torch.randn(size)
        assert_same(compiled(x, size // 2), f(x, size // 2))


def _compiles_of(fn, calls) -> int:
    """Call `fn` = (compiled, eager) on each of `calls`, checking results; the compiles made."""
    before = len(records.records)
    for args in calls:
        assert_same(fn[0](*args), fn[1](*args))
    return sum(record.status != "failed" for record in records.records[before:])


def test_integer_values_are_module_arguments_not_one_compile_per_value():
    """Dynamo makes an int argument that changes symbolic; used only as a value (a step counter),
    it is passed to the module, not compiled in: 10 values, 2 compiles (static, then symbolic)."""

    def f(x, step):
        return (
            x * step + (step * 2 - 1),
            x * 0.99**step,  # the power: through scalar_tensor
            x.clamp(min=step) + torch.full_like(x, step),
            torch.div(x, step, rounding_mode="floor"),
            torch.add(x, x, alpha=step) - torch.sub(x, x, alpha=step // 2),
            x * ((-step) // 4) + (step % 3) - (step % -5),  # floor semantics, as Python's
        )

    compiled = _compile(f)
    for x in (torch.randn(4), torch.arange(4, dtype=torch.int32)):
        torch._dynamo.reset()
        assert _compiles_of((compiled, f), [(x, step) for step in range(2, 12)]) == 2


def test_integer_values_past_32_bits_are_compiled_in_under_x64_narrow():
    """Narrowed to int32, a module argument would wrap: under x64="narrow" each value compiles."""

    def f(x, i):
        return x * i, x + (i - 2**32)

    calls = [(torch.ones(3), 2**32 + k) for k in (3, 4, 5)]
    assert _compiles_of((_compile(f, x64="narrow"), f), calls) == 3

    def sized(x, n):  # n is a size here: compiled once per value, still right
        return torch.full((3,), n) + x.sum(), (x * n, n + 1)

    assert _compiles_of((_compile(sized), sized), [(torch.randn(4), n) for n in range(2, 5)]) == 3


def test_integer_values_saved_for_the_backward_are_module_arguments_too():
    """The forward returns the int (saved for the backward): it goes back as the int."""
    linear = nn.Linear(8, 8)

    def step(x, i):
        return linear(x) * i + i

    compiled, x = _compile(step), torch.randn(4, 8)
    before = len(records.records)
    for i in range(2, 8):
        got = grads_of(linear, compiled(x, i).sum())
        want = grads_of(linear, step(x, i).sum())
        assert_same(got, want)
    assert len(records.records) - before == 4  # forward and backward: static, then symbolic


def test_integer_values_fall_back_to_constants_when_they_fail_to_lower(monkeypatch, caplog):
    from tpu_inductor import lowering

    lower = lowering.lower

    def refusing(gm, inputs, *, scalar_inputs=frozenset(), **kwargs):
        if scalar_inputs:
            raise LoweringError("refused for the test")
        return lower(gm, inputs, **kwargs)

    monkeypatch.setattr(lowering, "lower", refusing)

    def f(x, step):
        return x * step

    with caplog.at_level(logging.WARNING, logger="tpu_inductor"):
        calls = [(torch.randn(4), step) for step in range(2, 6)]
        assert _compiles_of((_compile(f), f), calls) == 4  # one per value, as before
    assert "integer inputs [1] compiled in as constants" in caplog.text
    assert "refused for the test" in caplog.text


def test_compiles_per_size_are_bounded(monkeypatch, caplog):
    """A graph with symbolic sizes keeps its most recently used compiles; a dropped size that
    comes back compiles again (or hits the compile cache), still right."""
    compiled = _compile(lambda x: x * 2, cache=False, shapes={"max_compiles": 2})
    before = len(records.records)
    with caplog.at_level(logging.WARNING, logger="tpu_inductor"):
        for n in (2, 3, 4, 5, 3, 2):
            assert_same(compiled(torch.ones(n)), torch.full((n,), 2.0))
    graph = next(  # the symbolic graph Dynamo traced at size 3
        r.graph for r in records.records[before:] if "once per size here" in (r.recompile or "")
    )
    assert f"{graph} has been compiled for more than 2 input sizes" in caplog.text
    assert caplog.text.count("has been compiled for more than") == 1  # one warning


def test_a_size_compiled_before_is_not_compiled_again_by_a_more_dynamic_graph():
    """(4,10) (4,20) (3,20) (4,10) (4,20): Dynamo makes 3 graphs (static, then dim 1, then both
    dims symbolic); the last two sizes run in the most dynamic graph, whose modules at those
    sizes are the ones compiled already: 3 PJRT compiles for 3 distinct sizes, as Inductor."""
    from tpu_inductor.runtime import devices

    def f(x):
        return (x.softmax(-1) * 2).sum(0)

    compiled = _compile(f, shapes={"policy": "exact"})
    before = devices.stats["pjrt_compiles"]
    for shape in ((4, 10), (4, 20), (3, 20), (4, 10), (4, 20)):
        x = torch.randn(shape)
        assert_same(compiled(x), f(x))
    assert devices.stats["pjrt_compiles"] - before == 3
