"""One shared eager-vs-compiled comparison for every test (no copies of it elsewhere)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tpu_inductor.compile_fx import compile_graph
from tpu_inductor.config import Options

# Every op through our lowering: with eager fallback, a rule that went missing would still pass.
STRICT = {"fallback": "error"}


def compile_aten(fn: Callable, args: Sequence, options: dict | None = None) -> Callable:
    """Trace `fn` to an ATen graph (make_fx, no Dynamo) and compile it; returns f(*args).

    Ops without a rule are an error unless `options` says otherwise ({"fallback": "eager"}).
    """
    gm = make_fx(fn, tracing_mode="fake")(*args)
    compiled = compile_graph(gm, list(args), Options.from_user({**STRICT, **(options or {})}))
    return lambda *call_args: _unflatten(fn, args, compiled(list(call_args)))


def forget_compiles() -> None:
    """Forget what this process compiled (the memory cache, the executables kept per module):
    a test that counts or intercepts compiles must not find another test's graph compiled."""
    from tpu_inductor.cache import stores
    from tpu_inductor.runtime import devices

    stores.memory_cache.clear()
    devices.forget_executables()


def functional(fn: Callable) -> Callable:
    """`fn` with its in-place ops made functional, as AOTAutograd traces them for the backend:
    make_fx alone keeps `x.uniform_()` or a composite's `bitwise_and_`, which have no rule.
    (Not for fns that call torch.autograd.grad: functionalized tensors carry no grad.)"""
    return torch.func.functionalize(fn, remove="mutations")


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


def check_many_against_eager(fns: dict[str, Callable], *args, tolerance=None, options=None):
    """Compile every fn of `fns` into one graph (one compile for many ops) and compare each
    result with eager; a mismatch names the fn. `tolerance(name, dtype)` → {"rtol", "atol"}.
    """
    if not fns:
        return
    names = sorted(fns)

    def graph(*xs):
        return tuple(fns[name](*xs) for name in names)

    from torch.utils import _pytree as pytree

    results = graph(*args)
    labels, expected = [], []
    for name, result in zip(names, results):
        leaves = pytree.tree_leaves(result)
        labels += [name] if len(leaves) == 1 else [f"{name}[{i}]" for i in range(len(leaves))]
        expected += leaves
    actual = compile_aten(graph, args, options)(*args)
    actual = actual if isinstance(actual, tuple) else (actual,)
    assert len(actual) == len(expected), (len(actual), len(expected))
    for name, got, want in zip(labels, actual, expected):
        tol = tolerance(name.split("[")[0], want.dtype) if tolerance else {}
        try:
            assert_same(got, want, **tol)
        except AssertionError as e:
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            raise AssertionError(f"{name} on inputs of shapes {shapes}: {e}") from None


def eager_accepts(fn: Callable, *args) -> bool:
    """Whether eager torch implements `fn` for these arguments (their dtypes, mostly)."""
    try:
        fn(*args)
    except (RuntimeError, TypeError, NotImplementedError, ZeroDivisionError, IndexError):
        return False
    return True


def grads_of(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Backpropagate `loss` and return a copy of every parameter's gradient, by name."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def backend_error(expected: type, fn, *args) -> Exception:
    """The error our backend raised inside Dynamo (which wraps it in BackendCompilerFailed)."""
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        fn(*args)
    assert isinstance(info.value.inner_exception, expected), info.value
    return info.value.inner_exception


class WritesBuffers(torch.nn.Module):
    """Buffers a graph writes on every call: batch-norm statistics and a cache written at a
    position (`forward(x, position)`, x of 16 features)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.register_buffer("cache", torch.zeros(6, 16))

    def forward(self, x, position):
        h = self.norm(self.linear(x))
        self.cache.index_copy_(0, position, h[:1])
        return h.sum(-1) + self.cache.sum()


def compile_tpu(fn: Callable, **options) -> Callable:
    """`torch.compile(fn, backend="tpu_inductor")` with `options` (None when there are none)."""
    return torch.compile(fn, backend="tpu_inductor", options=options or None)


def start_pair(command: Callable[[int, str], list[str]]) -> list:
    """Two processes on loopback (rank 0 and 1, `command(rank, port)` each, a free port),
    started from the repository root without XLA_FLAGS (each sets its own device count); the
    caller waits for them and kills what is left (subprocess.Popen, text pipes)."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return [
        subprocess.Popen(
            command(rank, port),
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
