"""The table of lowering rules: ATen overload → a jax function that computes it.

    @register_lowering(aten.add.Tensor, aten.add.Scalar, needs_ctx=True)
    def add(ctx, a, b, *, alpha=1): ...

An OpOverloadPacket (`aten.add`) expands to all its overloads. Registering an overload twice
for the same platform is an error (import order must never decide which rule wins). A rule
registered with `platform="tpu"` overrides the portable rule on that platform only. An op that
exists only once some other module defines it (Inductor's `prims.fma`, made when Inductor's
prims are imported, which Dynamo does for the graphs that use it) is registered by its name,
"prims.fma.default", and found by name.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable

import torch
from torch._ops import OpOverload, OpOverloadPacket

from ..exc import RegistrationError
from .python_targets import INTERPRETER_TARGETS

RULE_MODULES = (
    "pointwise",
    "cpu_math",
    "reduction",
    "shape",
    "indexing",
    "linalg",
    "fft",
    "special",
    "nn",
    "attention",
    "resample",
    "statistics",
    "random",
    "creation",
    "moe",
)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One registered lowering: `fn(*args, **kwargs)`, or `fn(ctx, *args, **kwargs)`."""

    fn: Callable
    op: OpOverload | str  # a name: an op not defined at import time
    platform: str | None
    needs_ctx: bool
    uses_rng: bool
    supports: Callable[[torch.fx.Node], bool] | None = None  # None: every node of the op


_RULES: dict[OpOverload | str, dict[str | None, Rule]] = {}
_loaded = False


def _overloads(op) -> Iterable[OpOverload | str]:
    if isinstance(op, (OpOverload, str)):
        return (op,)
    if isinstance(op, OpOverloadPacket):
        return tuple(getattr(op, name) for name in op.overloads())
    raise RegistrationError(f"register_lowering expects ATen ops, got {op!r} ({type(op).__name__})")


def register_lowering(
    *ops,
    platform: str | None = None,
    needs_ctx: bool = False,
    uses_rng: bool = False,
    supports: Callable[[torch.fx.Node], bool] | None = None,
):
    """Register the decorated function as the lowering of every overload of `ops`.

    `supports(node)`, when given, says which nodes of the op the rule can lower (e.g. not those
    with data-dependent output shapes); the partitioner leaves the others to eager torch.
    """

    def decorate(fn: Callable) -> Callable:
        for op in ops:
            for overload in _overloads(op):
                by_platform = _RULES.setdefault(overload, {})
                if platform in by_platform:
                    other = by_platform[platform].fn
                    raise RegistrationError(
                        f"{overload} already has a lowering for platform {platform!r} "
                        f"({other.__module__}.{other.__qualname__}); {fn.__module__}."
                        f"{fn.__qualname__} would replace it. Remove one of them."
                    )
                by_platform[platform] = Rule(fn, overload, platform, needs_ctx, uses_rng, supports)
        return fn

    return decorate


def load_rules() -> None:
    """Import every rule family once (this is where jax is first imported)."""
    global _loaded
    if not _loaded:
        for name in RULE_MODULES:
            importlib.import_module(f"{__package__}.ops.{name}")
        _loaded = True


def lookup(op, platform: str | None = None) -> Rule | None:
    """The rule for `op` on `platform` (a platform override first, else the portable rule)."""
    load_rules()
    by_platform = _RULES.get(op) or _RULES.get(str(op))
    if not by_platform:
        return None
    return by_platform.get(platform) or by_platform.get(None)


def registered_ops() -> list[OpOverload | str]:
    """Every ATen overload with at least one rule (by name, those defined by other modules)."""
    load_rules()
    return sorted(_RULES, key=str)


def node_op(node: torch.fx.Node):
    """The op a node runs: its target, or the op a `with_effects(token, op, ...)` node wraps."""
    if node.target is torch.ops.higher_order.with_effects:
        return node.args[1]
    return node.target


def supported(node: torch.fx.Node, platform: str | None = None) -> bool:
    """Whether the interpreter can lower this call_function node (the partitioner asks)."""
    if node.op != "call_function":
        return False
    if node.target in INTERPRETER_TARGETS:
        return True
    op = node_op(node)
    rule = lookup(op, platform) if isinstance(op, OpOverload) else None
    if rule is None or (rule.supports is not None and not _rule_supports(rule, node)):
        return False
    return _values_supported(node)


def takes_traced_scalars(node: torch.fx.Node, platform: str | None = None) -> bool:
    """Whether the node's rule takes a traced 0-d value where the op has a scalar argument
    (rules marked with `ops.common.takes_traced_scalars`)."""
    rule = lookup(node.target, platform) if isinstance(node.target, OpOverload) else None
    return rule is not None and getattr(rule.fn, "takes_traced_scalars", False)


def draws_random(node: torch.fx.Node, platform: str | None = None) -> bool:
    """Whether the node's rule draws random numbers (from the module's per-call seed)."""
    op = node_op(node) if node.op == "call_function" else None
    rule = lookup(op, platform) if isinstance(op, OpOverload) else None
    return rule is not None and rule.uses_rng


def _rule_supports(rule: Rule, node: torch.fx.Node) -> bool:
    """A rule's `supports` predicate; one that cannot decide (e.g. a size that depends on the
    data, on which no guard can be placed) leaves the node to eager torch."""
    try:
        return bool(rule.supports(node))
    except Exception:
        return False


def _values_supported(node: torch.fx.Node) -> bool:
    from . import dtypes

    vals = node.meta.get("val")
    for val in vals if isinstance(vals, (tuple, list)) else (vals,):
        if isinstance(val, torch.Tensor) and (
            not dtypes.is_supported(val.dtype) or val.layout != torch.strided or val.is_sparse
        ):
            return False
    return True


def core_aten_ops() -> list[OpOverload]:
    """Every overload torch tags as part of the core ATen opset."""
    found = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if torch.Tag.core in op.tags:
                found.append(op)
    return sorted(found, key=str)


def core_aten_coverage() -> tuple[list[OpOverload], list[OpOverload]]:
    """(covered, missing) core ATen overloads (a rule, or evaluated by the interpreter)."""
    core = core_aten_ops()
    covered = [op for op in core if op in INTERPRETER_TARGETS or lookup(op) is not None]
    return covered, [op for op in core if op not in covered]
