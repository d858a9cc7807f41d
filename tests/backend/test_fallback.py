"""What the backend leaves to eager torch and how it says so: ops without a rule (one warning,
or an error naming them under fallback="error"), split graphs, data-dependent scalars and
writes, higher-order ops, meta inputs, rules with a wrong dtype, graphs PJRT cannot compile.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from tests.helpers import assert_same, backend_error, compile_tpu, forget_compiles, grads_of
from tpu_inductor.exc import (
    DeviceError,
    LoweringError,
    RegistrationError,
    UnsupportedOpError,
)
from tpu_inductor.runtime import devices

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@torch.library.custom_op("tpu_inductor_test::unlowered", mutates_args=())
def unlowered(x: torch.Tensor) -> torch.Tensor:
    """An op no lowering rule will ever exist for: it must run in eager torch."""
    return torch.special.bessel_j0(x) * 3


@unlowered.register_fake
def _(x):
    return torch.empty_like(x)


def _uses_unsupported_op(x):
    return unlowered(x.cos() * 3) + x.sin()


def test_unsupported_op_falls_back_to_eager_with_one_warning(caplog):
    x = torch.randn(16)
    with caplog.at_level(logging.WARNING, logger="tpu_inductor"):
        out = compile_tpu(_uses_unsupported_op)(x)
    assert_same(out, _uses_unsupported_op(x))
    warnings = [r.getMessage() for r in caplog.records if "without a lowering" in r.getMessage()]
    assert len(warnings) == 1 and "tpu_inductor_test.unlowered.default x1" in warnings[0]


@torch.library.custom_op("tpu_inductor_test::unlowered_sub", mutates_args=())
def unlowered_sub(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a - b


@unlowered_sub.register_fake
def _(a, b):
    return torch.empty_like(a)


def test_split_graph_writes_inputs_back_after_the_eager_ops_that_read_them():
    """A buffer read by an eager op, then updated in place: the op sees the old value (the
    compiled region before it, which computes the update, must not write it back early)."""

    class Running(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("running", torch.ones(4))

        def forward(self, x):
            h = x * 2
            out = unlowered_sub(h, self.running)  # the buffer before the update below
            self.running.mul_(0.5).add_(h.mean(0), alpha=0.5)
            return out

    model, reference = Running(), Running()
    x = torch.full((2, 4), 3.0)
    assert_same(compile_tpu(model)(x), reference(x))
    assert_same(model.running, reference.running)


@pytest.mark.parametrize("dynamic", [False, True])
def test_eager_ops_of_a_split_graph_get_their_inputs_in_the_traced_layout(dynamic):
    """A region's result read by an eager op has the layout it was traced with: the eager op's
    own result follows it, and a later view (valid for the traced strides only) must work."""

    def f(x):
        y = unlowered((x * 2).t())  # its result takes the transposed layout of its argument
        return y.t().view(-1) + 1  # a flat view exists only for that layout

    compiled = torch.compile(f, backend="tpu_inductor", dynamic=dynamic)
    for x in (torch.randn(4, 6), torch.randn(5, 7)):
        assert_same(compiled(x), f(x))


def test_strict_mode_lists_missing_op_with_source_line():
    f = compile_tpu(_uses_unsupported_op, fallback="error")
    message = str(backend_error(UnsupportedOpError, f, torch.randn(16)))
    assert "tpu_inductor_test.unlowered.default (1x)" in message
    assert "test_fallback.py" in message and "unlowered(x.cos() * 3)" in message


def test_python_arithmetic_on_data_dependent_scalars_is_evaluated(caplog):
    """int() of a captured scalar (math.trunc) and a scalar condition (torch.sym_ite) are size
    arithmetic the interpreter evaluates, not ops left to eager torch."""

    def f(x):
        return x + (x.sum() > 0).item(), x.view(int(x.new_ones(1).item() * 2.5), -1)

    x = torch.randn(4, 5)
    with (
        torch._dynamo.config.patch(capture_scalar_outputs=True),
        caplog.at_level(logging.WARNING, logger="tpu_inductor"),
    ):
        for got, want in zip(compile_tpu(f)(x), f(x)):
            assert_same(got, want)
    assert "_local_scalar_dense" in caplog.text  # .item() itself runs in eager torch
    assert "trunc" not in caplog.text and "sym_ite" not in caplog.text


def test_data_dependent_mask_writes_run_in_eager_instead_of_failing():
    """index_put with a mask whose count is data-dependent: the rule's support check cannot
    decide its layout (no guard on an unbacked size), so the write runs in eager torch."""

    def f(x, m):
        y = x.clone()
        y[m] = y[m] * 10
        return y, x[m].sum()

    x, m = torch.randn(6, 5), torch.randn(6, 5) > 0
    leaf = x.clone().requires_grad_()
    with torch._dynamo.config.patch(
        capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True
    ):
        y, total = compile_tpu(f)(leaf, m)
        (y.sum() + total).backward()
    want_leaf = x.clone().requires_grad_()
    want_y, want_total = f(want_leaf, m)
    (want_y.sum() + want_total).backward()
    assert_same((y, total, leaf.grad), (want_y, want_total, want_leaf.grad))


def test_higher_order_ops_are_named_as_such_when_refused():
    def f(x):
        return torch.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (x,))

    error = backend_error(UnsupportedOpError, compile_tpu(f, fallback="error"), torch.randn(3))
    assert "torch.ops.higher_order.cond (1x)" in str(error)
    assert "torch.where can replace a torch.cond" in str(error)


def test_meta_inputs_run_in_eager_and_other_devices_are_refused(caplog):
    x = torch.randn(3, 4, device="meta")
    with caplog.at_level(logging.WARNING, logger="tpu_inductor"):
        out = compile_tpu(lambda x: x.sum(0) + 1)(x)
    assert (out.device.type, out.shape) == ("meta", (4,))
    assert "meta tensors" in caplog.text
    from tpu_inductor import backend

    with pytest.raises(DeviceError, match=r"graph input 1 is a tensor on meta.*\.cpu\(\)"):
        backend._require_cpu_tensors([torch.ones(1), x])


def test_rule_with_wrong_dtype_names_node_and_source_line():
    from tpu_inductor.lowering.registry import register_lowering

    @torch.library.custom_op("tpu_inductor_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @twice.register_fake
    def _(x):
        return torch.empty_like(x)

    @register_lowering(torch.ops.tpu_inductor_test.twice.default)
    def wrong_twice(x):
        return (x * 2).astype("int32")  # torch keeps float32: the interpreter must catch this

    with pytest.raises(RegistrationError, match="already has a lowering"):
        register_lowering(torch.ops.tpu_inductor_test.twice.default)(wrong_twice)

    def user_fn(x):
        return twice(x) + 1

    error = backend_error(LoweringError, compile_tpu(user_fn), torch.randn(3))
    assert "dtype int32, torch computes torch.float32" in str(error)
    assert "test_fallback.py" in str(error) and "twice(x)" in str(error)


def test_mismatched_input_dtypes_are_named_when_a_result_dtype_is_wrong():
    """Eager rejects an int64 input to a float layer; the meta kernels do not, so the
    interpreter's dtype check is where it shows: the message names the inputs' dtypes."""
    error = backend_error(LoweringError, compile_tpu(nn.Linear(4, 2)), torch.ones(3, 4).long())
    assert "from inputs of dtypes ['float32', 'int64', 'float32']" in str(error)
    assert "pass inputs of the dtype the model expects" in str(error)


def test_a_graph_pjrt_cannot_compile_runs_in_eager_torch_with_a_warning(monkeypatch, caplog):
    """fallback="eager": a PJRT compile failure (here: every module) is a warning naming the
    graph, and the graph runs in eager torch, equal to eager; fallback="error" raises."""
    from tpu_inductor.exc import CompileError

    def fails(_module, _device):
        raise CompileError("PJRT failed (a test)")

    monkeypatch.setattr(devices, "compile_stablehlo", fails)
    forget_compiles()  # another test in this worker may have compiled the same graph
    x = torch.randn(4, 3)
    model = torch.nn.Linear(3, 2)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tpu_inductor", options={"cache": False})
    with caplog.at_level(logging.WARNING, logger="tpu_inductor"):
        out = compiled(x)
        grads = grads_of(model, out.sum())  # the backward graph too
    assert_same(out, model(x))
    assert_same(grads, grads_of(model, model(x).sum()))
    assert caplog.text.count("runs in eager torch") == 2 and "a test" in caplog.text
    torch._dynamo.reset()  # symbolic sizes: compiled per bucket at call time, padded there
    dynamic = torch.compile(lambda t, n: t.softmax(-1) * n, backend="tpu_inductor", dynamic=True)
    for rows in (3, 5, 6):
        t = torch.randn(rows, 7)
        assert_same(dynamic(t, rows), t.softmax(-1) * rows)
    torch._dynamo.reset()
    strict = torch.compile(
        model, backend="tpu_inductor", options={"cache": False, "fallback": "error"}
    )
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="a test"):
        strict(x)
