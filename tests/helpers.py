"""One shared eager-vs-compiled comparison for every test (no copies of it elsewhere)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tpu_inductor.compile_fx import compile_graph
from tpu_inductor.config import Options


def compile_aten(fn: Callable, args: Sequence, options: dict | None = None) -> Callable:
    """Trace `fn` to an ATen graph (make_fx, no Dynamo) and compile it; returns f(*args)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    compiled = compile_graph(gm, list(args), Options.from_user(options))
    return lambda *call_args: _unflatten(fn, args, compiled(list(call_args)))


def _unflatten(fn, args, flat):
    return flat[0] if len(flat) == 1 else tuple(flat)


def assert_same(actual, expected, *, rtol: float | None = None, atol: float | None = None):
    """Compare (nested) results with torch.testing.assert_close, dtypes and shapes included."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def check_against_eager(fn: Callable, *args, rtol=None, atol=None, options=None):
    """Run `fn` eagerly and compiled through our lowering; assert the results match."""
    expected = fn(*args)
    actual = compile_aten(fn, args, options)(*args)
    if isinstance(expected, (list, tuple)):
        actual = tuple(actual) if isinstance(actual, (list, tuple)) else (actual,)
        expected = tuple(expected)
    assert_same(actual, expected, rtol=rtol, atol=atol)
    return actual


def grads_of(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Backpropagate `loss` and return a copy of every parameter's gradient, by name."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
