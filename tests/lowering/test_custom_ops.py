"""Custom ops as a public surface: `tpu_inductor.register_lowering("namespace::op")`.

A user's `torch.library` custom op with a jax rule compiles whole under fallback="error"
(forward, and a backward made of other ops), equal to eager; one without a rule runs in eager
torch, the warning (or the fallback="error" message) naming it and the API; registrations that
would clash, or name no op, fail at registration; the rules' sources are in the cache key.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest
import torch

import tpu_inductor
from tests.helpers import assert_same
from tpu_inductor import lowering
from tpu_inductor.cache import key
from tpu_inductor.config import Options
from tpu_inductor.debug import records as debug
from tpu_inductor.exc import RegistrationError, UnsupportedOpError

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

STRICT = {"fallback": "error"}


@torch.library.custom_op("tpu_inductor_test::scaled_softplus", mutates_args=())
def scaled_softplus(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.nn.functional.softplus(x) * scale


@scaled_softplus.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * torch.sigmoid(x) * ctx.scale, None


def _save(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


scaled_softplus.register_autograd(_backward, setup_context=_save)


@tpu_inductor.register_lowering("tpu_inductor_test::scaled_softplus", needs_ctx=True)
def _scaled_softplus(ctx, x, scale):
    return (jnp.logaddexp(x, 0.0) * scale).astype(ctx.out_dtype)


@torch.library.custom_op("tpu_inductor_test::without_rule", mutates_args=())
def without_rule(x: torch.Tensor) -> torch.Tensor:
    return x.flip(0) + 1


@without_rule.register_fake
def _(x):
    return torch.empty_like(x)


def _model(x, w):
    return torch.ops.tpu_inductor_test.scaled_softplus(x @ w, 0.5).sum(-1)


def test_registered_custom_op_compiles_whole_forward_and_backward():
    x = torch.randn(5, 4)
    w = torch.randn(4, 3, requires_grad=True)
    compiled = torch.compile(_model, backend="tpu_inductor", options=STRICT, fullgraph=True)
    first = len(debug.records)
    got = compiled(x, w)
    (got_grad,) = torch.autograd.grad(got.sum(), w)
    want = _model(x, w)
    (want_grad,) = torch.autograd.grad(want.sum(), w)
    assert_same(got, want)
    assert_same(got_grad, want_grad)
    records = debug.records[first:]
    assert len(records) == 2  # forward and backward, each one region
    assert all(r.status == "ok" and not r.fallback and "." not in r.graph for r in records)


def test_custom_op_without_a_rule_is_named_in_the_warning(caplog):
    def fn(x):
        return torch.ops.tpu_inductor_test.without_rule(x * 2) * 3

    x = torch.randn(4, 3)
    compiled = torch.compile(fn, backend="tpu_inductor", fullgraph=True)
    with caplog.at_level(logging.WARNING, logger="tpu_inductor.partition"):
        assert_same(compiled(x), fn(x))
    warning = "\n".join(r.getMessage() for r in caplog.records)
    assert "tpu_inductor_test.without_rule.default x1" in warning
    assert "Custom ops without a rule: tpu_inductor_test::without_rule" in warning
    assert "@tpu_inductor.register_lowering('tpu_inductor_test::without_rule')" in warning
    torch._dynamo.reset()
    strict = torch.compile(fn, backend="tpu_inductor", options=STRICT, fullgraph=True)
    with pytest.raises(Exception, match="register_lowering") as raised:
        strict(x)
    assert UnsupportedOpError.__name__ in str(raised.value)  # Dynamo wraps the backend's error


def test_aten_ops_without_a_rule_get_no_custom_op_hint():
    from tpu_inductor.partition import _custom_ops_hint

    assert _custom_ops_hint({"aten.nonzero.default": ["f.py"], "_operator.getitem": []}) == ""
    assert _custom_ops_hint({"torch.ops.higher_order.cond": [], "a.b.c": []}) == ""


def test_registration_that_would_replace_a_rule_fails_whole():
    with pytest.raises(RegistrationError, match="already has a lowering"):
        tpu_inductor.register_lowering("aten::hypot")(lambda a, b: a)
    with pytest.raises(RegistrationError, match="already has a lowering"):
        tpu_inductor.register_lowering("tpu_inductor_test::scaled_softplus")(lambda x, s: x)
    with pytest.raises(RegistrationError, match="namespace::op"):
        tpu_inductor.register_lowering("::nothing")
    with pytest.raises(RegistrationError, match="no overload 'nope'"):
        tpu_inductor.register_lowering("tpu_inductor_test::without_rule.nope")


def test_an_op_defined_after_its_rule_is_found_by_name():
    @tpu_inductor.register_lowering("tpu_inductor_test::defined_later")
    def _later(x):
        return jnp.sin(x) * 2

    @torch.library.custom_op("tpu_inductor_test::defined_later", mutates_args=())
    def later(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2

    later.register_fake(lambda x: torch.empty_like(x))
    fn = lambda x: torch.ops.tpu_inductor_test.defined_later(x) + 1  # noqa: E731
    x = torch.randn(6)
    compiled = torch.compile(fn, backend="tpu_inductor", options=STRICT, fullgraph=True)
    assert_same(compiled(x), fn(x))


def test_user_rules_are_in_the_cache_key():
    """A rule registered (or edited: its source is hashed) is another key."""
    device = tpu_inductor.runtime.devices.select_device()
    before = dict(key.context_entries(Options(), device))["user_rules"]
    assert before == lowering.user_rules_fingerprint() != ""

    @tpu_inductor.register_lowering("tpu_inductor_test::keyed")
    def _keyed(x):
        return x

    after = dict(key.context_entries(Options(), device))["user_rules"]
    assert after != before
