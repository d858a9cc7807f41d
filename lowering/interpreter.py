"""Runs an ATen FX graph inside a jax trace, one lowering rule per node.

Every node runs under `jax.named_scope(node.name)` so HLO op names lead back to the graph, and
every result is checked against `node.meta["val"]` (rank, static dims, dtype under the 64-bit
policy): a rule that gets type promotion or shapes wrong fails here, naming the node, its ATen
op and the user's source line, instead of computing a silently wrong answer.

Size arithmetic (`aten.sym_size`, `operator.mul` on sizes, `torch._check`s) is evaluated in
Python (python_targets.py): the graph's sizes are concrete by the time it is lowered.

A random op's key is folded from the per-call seed by the op's stream, which the pass pipeline
stamps on every node before any pass runs (`meta["rng_stream"]`, the node's name then; a graph
lowered without the pipeline uses the node's name): a pass that inserts or removes nodes, or a
disabled pass, leaves torch.manual_seed's streams as they were.
"""

from __future__ import annotations

import collections
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._ops import OpOverload

from ..exc import LoweringError, UnsupportedOpError
from . import dtypes, registry
from .python_targets import INTERPRETER_TARGETS, PYTHON_TARGETS

aten = torch.ops.aten


def source_line(node: torch.fx.Node) -> str:
    """The user's innermost frame recorded on the node: 'File "f.py", line 3, in fn: code'."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = next((c for c in lines[i + 1 :] if c and set(c) - set("^~ ")), "")
            return f"{lines[i]}: {code}" if code else lines[i]
    return "<no source line recorded>"


class LoweringContext:
    """What a rule registered with `needs_ctx=True` may ask about the node it lowers."""

    def __init__(
        self,
        node: torch.fx.Node,
        x64: str,
        rng: Callable[[int], Any] | None,
        choices: collections.Counter | None = None,
        interpret_kernels: bool = False,
    ):
        self.node = node
        self.x64 = x64
        self._rng = rng
        self._choices = choices
        # Pallas kernels run in interpret mode: a TPU's rules executed on this host (tests)
        self.interpret_kernels = interpret_kernels

    def chose(self, what: str) -> None:
        """Count a choice the rule made (a kernel, or a fallback and why): the lowered module's
        `kernel_choices`."""
        if self._choices is not None:
            self._choices[what] += 1

    @property
    def out(self):
        """The node's fake result (a FakeTensor, or a tuple of them)."""
        return self.node.meta["val"]

    def jax_dtype(self, dtype: torch.dtype):
        return dtypes.to_jax(dtypes.narrowed(dtype, self.x64))

    @property
    def out_dtype(self):
        """The jax dtype of the node's (first) tensor result."""
        out = self.out
        if isinstance(out, (tuple, list)):
            out = next(v for v in out if isinstance(v, torch.Tensor))
        return self.jax_dtype(out.dtype)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.out.shape)

    def promoted_dtype(self):
        """torch's type promotion over the node's tensor and scalar arguments."""
        from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

        vals = [_promotion_value(a) for a in self.node.args]
        vals = [v for v in vals if v is not None]
        if not any(isinstance(v, torch.Tensor) for v in vals):
            return self.out_dtype
        _, result = elementwise_dtypes(
            *vals, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
        )
        return self.jax_dtype(result)

    def compute_dtype(self):
        """The dtype an elementwise op computes in: the result's if floating, else promoted.

        A real result of complex arguments (abs) is computed on the complex values.
        """
        import jax.numpy as jnp

        out = self.out_dtype
        if jnp.issubdtype(out, jnp.complexfloating):
            return out
        promoted = self.promoted_dtype()
        if jnp.issubdtype(out, jnp.floating) and not jnp.issubdtype(promoted, jnp.complexfloating):
            return out
        return promoted

    def rng_key(self):
        """A jax PRNG key unique to this node, derived from the per-call seed input."""
        if self._rng is None:
            raise LoweringError(
                f"{self.node.target} uses randomness but was registered without uses_rng=True"
            )
        return self._rng(rng_stream(self.node))


def _promotion_value(arg):
    """An argument as torch's type promotion sees it (symbolic scalars by their kind)."""
    if isinstance(arg, torch.fx.Node):
        arg = arg.meta.get("val")
    if isinstance(arg, torch.Tensor) or type(arg) in (bool, int, float, complex):
        return arg
    if isinstance(arg, torch.SymBool):
        return True
    if isinstance(arg, torch.SymInt):
        return 1
    if isinstance(arg, torch.SymFloat):
        return 1.0
    return None


def rng_stream(node: torch.fx.Node) -> int:
    """The number a random node's key is folded in by: a digest of its stream name."""
    return zlib.crc32(str(node.meta.get("rng_stream", node.name)).encode()) & 0x7FFFFFFF


def missing_ops(gm: torch.fx.GraphModule, platform: str | None = None) -> dict[str, list[str]]:
    """ATen ops of `gm` with no rule: op name → the source lines where it is used."""
    missing: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and not registry.supported(node, platform):
            missing.setdefault(op_name(node.target), []).append(source_line(node))
    return missing


def op_name(target) -> str:
    """How an FX call target is spelled in messages: `aten.add.Tensor`,
    `torch.ops.higher_order.cond`, or a Python function's qualified name."""
    from torch._ops import HigherOrderOperator

    if isinstance(target, HigherOrderOperator):
        return f"torch.ops.higher_order.{target.name()}"
    if isinstance(target, OpOverload):
        return str(target)
    return f"{getattr(target, '__module__', None) or 'builtins'}.{target.__qualname__}"


class GraphRunner:
    """Evaluates `gm` on jax values; records what the caller needs to rebuild torch outputs."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        *,
        x64: str,
        platform: str | None = None,
        interpret_kernels: bool = False,
    ):
        """`platform`: whose rules lower the graph; `interpret_kernels`: their Pallas kernels in
        interpret mode, so that a TPU's lowering runs (and is checked) on any host."""
        self.gm = gm
        self.x64 = x64
        self.platform = platform
        self.interpret_kernels = interpret_kernels
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.uses_rng = any(
            (rule := _rule_of(n, platform)) is not None and rule.uses_rng for n in gm.graph.nodes
        )
        # Filled by run(): input index → value to write back into that input; the rules'
        # choices (LoweringContext.chose).
        self.mutations: dict[int, Any] = {}
        # input index → the part of it the write changes (written_parts.Part), where known
        self.written_parts: dict[int, Any] = {}
        self.choices: collections.Counter = collections.Counter()

    def run(
        self,
        inputs: Sequence[Any],
        rng: Callable[[int], Any] | None = None,
        also: Sequence[torch.fx.Node] = (),
    ) -> list[Any]:
        """Evaluate the graph; returns the flat output list (jax arrays, Python values, None),
        followed by the values of the nodes `also` names."""
        env: dict[torch.fx.Node, Any] = {}
        placeholder_index = {node: i for i, node in enumerate(self.placeholders)}
        self.mutations, self.written_parts = {}, {}
        self.choices.clear()
        for node, value in zip(self.placeholders, inputs):
            env[node] = value
        load = lambda arg: torch.fx.node.map_arg(arg, env.__getitem__)  # noqa: E731
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                return [*flatten(load(node.args[0])), *(env[n] for n in also)]
            if node.op == "get_attr":
                env[node] = dtypes.constant(_fetch_attr(self.gm, node.target), self.x64)
                continue
            if node.op != "call_function":
                raise LoweringError(f"node {node.name}: unsupported FX node kind {node.op!r}")
            args, kwargs = load(node.args), load(node.kwargs)
            if writes_input(node, placeholder_index):
                env[node] = self._record_mutation(node, args, placeholder_index, load)
                continue
            env[node] = self._call(node, args, kwargs, rng)
        raise LoweringError("graph has no output node")

    def _record_mutation(self, node, args, placeholder_index, load):
        import jax.numpy as jnp

        from . import written_parts

        dst, src = args[0], args[1]
        value = jnp.broadcast_to(jnp.asarray(src), dst.shape).astype(dst.dtype)
        position = placeholder_index[node.args[0]]
        self.mutations[position] = value
        part = written_parts.part(node, load, value)
        if part is not None:
            self.written_parts[position] = part
        return value

    def _call(self, node, args, kwargs, rng):
        import jax

        target = node.target
        if target in PYTHON_TARGETS:
            return PYTHON_TARGETS[target](*args, **kwargs)
        rule = _rule_of(node, self.platform)
        if rule is None:
            raise UnsupportedOpError(
                f"no lowering for {target} at node {node.name} ({source_line(node)}); "
                "add a rule in lowering/ops/ or compile with options={'fallback': 'eager'}."
            )
        token = None
        if target is torch.ops.higher_order.with_effects:  # (token, op, *args): thread the token
            token, _, *args = args
        try:
            with jax.named_scope(node.name):
                if rule.needs_ctx:
                    ctx = LoweringContext(node, self.x64, rng, self.choices, self.interpret_kernels)
                    result = rule.fn(ctx, *args, **kwargs)
                else:
                    result = rule.fn(*args, **kwargs)
        except (LoweringError, UnsupportedOpError):
            raise
        except Exception as e:
            raise LoweringError(
                f"lowering {target} failed at node {node.name} ({source_line(node)}): "
                f"{type(e).__name__}: {e}"
            ) from e
        if token is not None:
            result = (token, *result) if isinstance(result, (tuple, list)) else (token, result)
        self._check(node, result)
        return result

    def _check(self, node, result) -> None:
        expected = node.meta.get("val")
        if expected is None:
            return
        if isinstance(expected, (tuple, list)):
            if not isinstance(result, (tuple, list)) or len(result) != len(expected):
                raise LoweringError(
                    f"node {node.name} ({node.target}, {source_line(node)}): the rule returned "
                    f"{type(result).__name__} but the graph expects {len(expected)} results"
                )
            for i, (exp, got) in enumerate(zip(expected, result)):
                self._check_one(node, exp, got, f"result {i}")
        else:
            self._check_one(node, expected, result, "result")

    def _check_one(self, node, expected, got, what: str) -> None:
        if not isinstance(expected, torch.Tensor):
            return
        where = f"node {node.name} ({node.target}, {source_line(node)})"
        if got is None or not hasattr(got, "shape"):
            raise LoweringError(f"{where}: {what} should be a tensor, the rule returned {got!r}")
        want_dtype = dtypes.to_jax(dtypes.narrowed(expected.dtype, self.x64))
        if got.dtype != want_dtype:
            inputs = [
                str(a.meta["val"].dtype).removeprefix("torch.")
                for a in node.all_input_nodes
                if isinstance(a.meta.get("val"), torch.Tensor)
            ]
            raise LoweringError(
                f"{where}: {what} has dtype {got.dtype}, torch computes {expected.dtype} "
                f"(expected jax dtype {want_dtype}) from inputs of dtypes {inputs}. If eager "
                "torch rejects those dtypes together (e.g. an int64 input to a float layer), pass "
                "inputs of the dtype the model expects; otherwise fix the rule's type promotion."
            )
        want_shape = tuple(expected.shape)
        if len(got.shape) != len(want_shape) or any(
            isinstance(w, int) and w != g for w, g in zip(want_shape, got.shape)
        ):
            raise LoweringError(
                f"{where}: {what} has shape {tuple(got.shape)}, torch computes {want_shape}."
            )


def writes_input(node: torch.fx.Node, placeholders) -> bool:
    """Whether `node` is AOTAutograd's write into a graph input: `copy_` into a placeholder."""
    return (
        node.op == "call_function"
        and node.target is aten.copy_.default
        and node.args[0] in placeholders
    )


def _rule_of(node: torch.fx.Node, platform):
    op = registry.node_op(node) if node.op == "call_function" else None
    if not isinstance(op, registry.RULE_TARGETS) or op in INTERPRETER_TARGETS:
        return None
    return registry.lookup(op, platform)


def _fetch_attr(gm: torch.fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def flatten(value):
    """Yield the leaves of nested tuples/lists."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from flatten(item)
    else:
        yield value
