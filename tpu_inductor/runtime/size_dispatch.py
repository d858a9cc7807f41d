"""Size dispatch: a graph with symbolic sizes runs the executable compiled for its call's sizes.

The shape passes (passes/shapes.py, passes/bucket_shapes.py) decide which sizes a graph is
compiled at; this is the runtime half (buckets.py pads inputs to a bucket first): per call, the input signature picks a compiled executable, compiling one (through
the compile cache) the first time a signature comes. Integer inputs that are values only are
passed as 0-d int64 tensors, not compiled in: a new value is not a new signature. Should such a
graph fail to lower, they are compiled in (once per value) from then on, with a warning.

The `shapes.max_compiles` most recently used compiles are kept (a warning says when one is
dropped). Inside `compiling_ahead(pool)` (tpu_inductor.precompile) a signature not compiled yet
is handed to the pool and the call stops with `CompilingAhead`: compiles of several signatures
then overlap (PJRT's compile releases the GIL), and a later call of a signature waits for its
compile. Inside `no_compiles()` a compile raises UnexpectedCompileError instead (a serving loop
after warm-up), and so does the first call of a graph Dynamo traced there (`new_trace`),
whose executables the caches may serve; under torch.compiler.set_stance("fail_on_recompile") a
graph's compile for new sizes raises too. Also the signature helpers every stage keys on.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from typing import Any

import torch

from tpu_inductor.exc import UnexpectedCompileError
from tpu_inductor.runtime.lru import RecentlyUsed

log = logging.getLogger(__name__)

_AHEAD: contextvars.ContextVar[Executor | None] = contextvars.ContextVar("ahead", default=None)
_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("no_compiles", default=False)


class CompilingAhead(Exception):
    """A call stopped inside `compiling_ahead`: its graph's compile went to the pool."""


@contextlib.contextmanager
def compiling_ahead(pool: Executor) -> Iterator[None]:
    """Calls in this block hand a compile their sizes need to `pool` and raise CompilingAhead
    (the graphs before it in the call ran; none after it did)."""
    token = _AHEAD.set(pool)
    try:
        yield
    finally:
        _AHEAD.reset(token)


@contextlib.contextmanager
def no_compiles() -> Iterator[None]:
    """In this block (this thread), a graph that would compile (missing the memory and disk
    caches) raises UnexpectedCompileError naming the graph and its sizes instead: a serving
    loop asserts that warm-up (tpu_inductor.precompile) left nothing to compile. A call
    waiting for a compile precompile started in the background is not a compile."""
    token = _STRICT.set(True)
    try:
        yield
    finally:
        _STRICT.reset(token)


def check_compile_allowed(graph: str, inputs: tuple, bucketing: dict | None) -> None:
    """Raise UnexpectedCompileError inside `no_compiles()`."""
    if _STRICT.get():
        bucket = f" (bucketing: {bucketing})" if bucketing else ""
        raise UnexpectedCompileError(
            f"tpu_inductor: {graph} would compile for inputs {inputs}{bucket} inside "
            "tpu_inductor.no_compiles(): warm this size up first (tpu_inductor.precompile "
            "with a `largest` that covers it, or a bucket policy whose buckets hold it)"
        )


def check_recompile_allowed(graph: str, inputs: tuple) -> None:
    """Raise UnexpectedCompileError under torch.compiler.set_stance("fail_on_recompile") when a
    graph that has an executable would make another (new sizes): Dynamo's stance covers its
    own traces, this our compiles per size."""
    stance = torch._dynamo.eval_frame._stance.stance  # set_stance's (no public getter)
    if stance == "fail_on_recompile":
        raise UnexpectedCompileError(
            f"tpu_inductor: {graph} would compile again for inputs {input_signature(inputs)} "
            'under torch.compiler.set_stance("fail_on_recompile"): warm this size up first '
            "(tpu_inductor.precompile with a `largest` that covers it)"
        )


@contextlib.contextmanager
def new_trace() -> Iterator[Callable[[Callable], Callable]]:
    """Around the backend's compile of a graph Dynamo just traced; yields `wrap(compiled)`.
    Inside `no_compiles()` the graph compiles (our caches may serve it: the trace and our
    passes are the cost) and its first call raises UnexpectedCompileError, from the caller's
    frame (raised inside Dynamo's backend call, it would reach the caller as Dynamo's
    BackendCompilerFailed); its later calls run."""
    if not _STRICT.get():
        yield lambda compiled: compiled
        return
    token = _STRICT.set(False)
    try:
        yield _refusing_first_call
    finally:
        _STRICT.reset(token)


def _refusing_first_call(compiled: Callable) -> Callable:
    graph = str(torch._guards.CompileContext.current_compile_id() or "a graph")
    refused = []

    def run(*args, **kwargs):
        if not refused:
            refused.append(True)
            raise UnexpectedCompileError(
                f"tpu_inductor: Dynamo traced graph {graph} inside tpu_inductor.no_compiles() "
                "(a guard failed: a new shape, dtype or Python value; our caches may serve "
                "its executables, the trace itself is the cost): warm it up before the block "
                "(tpu_inductor.precompile; torch._dynamo.mark_dynamic for the dims that vary)"
            )
        return compiled(*args, **kwargs)

    run.__dict__.update(getattr(compiled, "__dict__", {}))
    return run


class SizeDispatch:
    """A boxed callable (a list of inputs in, a list out) over one graph with symbolic sizes.

    `compile(inputs, scalars)` compiles the graph for concrete `inputs`, whose positions in
    `scalars` are value-only integers given as 0-d tensors; `name` names it in warnings.
    """

    def __init__(
        self,
        compile: Callable[[Sequence[Any], frozenset[int]], Callable[[list], list]],
        name: str,
        scalars: frozenset[int],
        max_compiles: int,
    ):
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__, not the class
        self._compile = compile
        self._name = name
        self._scalars = scalars
        self._max_compiles = max_compiles
        self._compiled = RecentlyUsed(max_compiles)
        self._pending: dict[tuple, Future] = {}  # signatures compiling in a pool
        self._warned = False

    def __call__(self, args: list) -> list:
        scalars = self._scalars
        passed = []  # (0-d tensor, the int it stands for)
        for position in scalars:
            passed.append((torch.tensor(args[position]), args[position]))
            args[position] = passed[-1][0]
        outs = self._call(args, scalars)
        for tensor, number in passed:  # an input returned as it is (saved for the backward)
            outs = [number if out is tensor else out for out in outs]
        return outs

    def _call(self, args: list, scalars: frozenset[int]) -> list:
        key = (input_signature(args), strides(args))
        compiled = self._compiled.get(key)
        if compiled is None:  # the compile record logs why (which input, which dim)
            pending, pool = self._pending.get(key), _AHEAD.get()
            if pending is None and len(self._compiled):
                check_recompile_allowed(self._name, args)
            if pending is None and pool is not None:
                run = contextvars.copy_context().run  # the bucket this call's record names
                self._pending[key] = pool.submit(run, self._compile, list(args), scalars)
                self._pending[key].add_done_callback(self._say_if_failed)
                raise CompilingAhead(self._name)
            try:
                compiled = pending.result() if pending is not None else self._compile(args, scalars)
            except Exception as e:  # a rule, or size arithmetic the trace cannot do
                if not scalars:
                    raise
                log.warning(
                    "tpu_inductor: %s: integer inputs %s compiled in as constants (each new value "
                    "compiles again): passed as tensors, they failed to lower: %s",
                    self._name,
                    sorted(scalars),
                    e,
                )
                self._scalars = frozenset()
                for position in scalars:
                    args[position] = int(args[position])
                return self._call(args, frozenset())
            finally:
                self._pending.pop(key, None)
            self._keep(key, compiled)
        return compiled(args)

    def _say_if_failed(self, future: Future) -> None:
        """Log a compile handed to a pool that failed (in the background no call may wait)."""
        error = future.exception()
        if error is not None:
            log.warning(
                "tpu_inductor: %s: a compile ahead of its calls failed (a call of these sizes "
                "raises it): %s",
                self._name,
                error,
            )

    def _keep(self, key: tuple, compiled: Callable[[list], list]) -> None:
        if self._compiled.put(key, compiled) and not self._warned:
            self._warned = True
            log.warning(
                "tpu_inductor: %s has been compiled for more than %d input sizes; the least "
                "recently used are dropped (compiled again if they come back). Pad inputs "
                "to a few fixed sizes, or raise options={'shapes': {'max_compiles': N}}.",
                self._name,
                self._max_compiles,
            )


def input_signature(inputs: Sequence[Any]) -> tuple:
    """Per input, (shape, dtype) of a tensor, or the value itself."""
    return tuple(
        (tuple(int(d) for d in v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else v
        for v in inputs
    )


def strides(inputs: Sequence[Any]) -> tuple:
    """The tensor inputs' strides: rules may lower by layout (det factors a contiguous A^T)."""
    return tuple(tuple(v.stride()) if isinstance(v, torch.Tensor) else None for v in inputs)


def is_concrete(value) -> bool:
    """Whether an input (a tensor, or a number) has no symbolic size or value."""
    if isinstance(value, torch.Tensor):
        return all(isinstance(d, int) for d in value.shape)
    return not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def placeholder_values(gm: torch.fx.GraphModule) -> list | None:
    """The traced values of a graph's inputs (None if one has none)."""
    values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return None if any(v is None for v in values) else values
