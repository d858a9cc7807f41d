"""The table of lowering rules: ATen overload → a jax function that computes it.

    @register_lowering(aten.add.Tensor, aten.add.Scalar, needs_ctx=True)
    def add(ctx, a, b, *, alpha=1): ...

An OpOverloadPacket (`aten.add`) expands to all its overloads. Registering an overload twice
for the same platform is an error (import order must never decide which rule wins). A rule
registered with `platform="tpu"` overrides the portable rule on that platform only. An op that
exists only once some other module defines it (Inductor's `prims.fma`, made when Inductor's
prims are imported, which Dynamo does for the graphs that use it) is registered by its name,
"prims.fma.default", and found by name.

Users lower their own `torch.library` custom ops through `register_user_lowering` (exported as
`tpu_inductor.register_lowering("namespace::op")`): the same table, with every built-in rule
loaded first (a clash is an error at registration, not at the first compile), and each user
rule's source in `user_rules_fingerprint()`, which the compile cache's key holds (an edited
rule is a different program; our own rules are in the key through our package's sources).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
from collections.abc import Callable, Iterable

import torch
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

from ..exc import RegistrationError
from .python_targets import INTERPRETER_TARGETS

# What a rule can be registered for: ATen overloads and higher-order ops (flex_attention).
RULE_TARGETS = (OpOverload, HigherOrderOperator)

RULE_MODULES = (
    "pointwise",
    "cpu_math",
    "reduction",
    "shape",
    "indexing",
    "linalg",
    "factorizations",
    "ldl",
    "fft",
    "special",
    "conv",
    "normalization",
    "pooling",
    "embedding",
    "sdpa",
    "losses",
    "attention",
    "attention_kernels",
    "norm",
    "resample",
    "statistics",
    "random",
    "creation",
    "moe",
    "flex_attention",
    "flex_attention_kernels",
    "torch_nn",
    "sharding",
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
_USER_RULES: list[Rule] = []
_loaded = False


def _overloads(op) -> Iterable[OpOverload | str]:
    if isinstance(op, str) and "::" in op:
        return _named_overloads(op)
    if isinstance(op, (OpOverload, HigherOrderOperator, str)):
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

    overloads = [overload for op in ops for overload in _overloads(op)]

    def decorate(fn: Callable) -> Callable:
        for overload in overloads:  # all checked before any is registered
            other = _RULES.get(overload, {}).get(platform) or _RULES.get(str(overload), {}).get(
                platform
            )
            if other is not None:
                raise RegistrationError(
                    f"{overload} already has a lowering for platform {platform!r} "
                    f"({other.fn.__module__}.{other.fn.__qualname__}); {fn.__module__}."
                    f"{fn.__qualname__} would replace it. Remove one of them."
                )
        for overload in overloads:
            rule = Rule(fn, overload, platform, needs_ctx, uses_rng, supports)
            _RULES.setdefault(overload, {})[platform] = rule
        return fn

    return decorate


def _named_overloads(name: str) -> tuple[OpOverload | str, ...]:
    """The overloads a name "namespace::op" or "namespace::op.overload" means: those of the op
    defined now, else the name an op defined later will have ("namespace.op.default" unless
    another overload is named)."""
    namespace, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    if not namespace or not op:
        raise RegistrationError(
            f"expected 'namespace::op' or 'namespace::op.overload', got {name!r}"
        )
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
    except AttributeError:  # not defined yet: found by name once it is
        return (f"{namespace}.{op}.{overload or 'default'}",)
    if overload:
        if overload not in packet.overloads():
            raise RegistrationError(
                f"{namespace}::{op} has no overload {overload!r}; it has {packet.overloads()}"
            )
        return (getattr(packet, overload),)
    return _overloads(packet)


def register_user_lowering(op, *, needs_ctx: bool = False, supports=None):
    """`register_lowering` for a user's op (a torch.library custom op, by "namespace::op" or
    the op object): every built-in rule is loaded first, so a clash with one fails here."""
    load_rules()
    register = register_lowering(op, needs_ctx=needs_ctx, supports=supports)

    def decorate(fn: Callable) -> Callable:
        register(fn)
        _USER_RULES.append(Rule(fn, str(op), None, needs_ctx, False, supports))
        return fn

    return decorate


def user_rules_fingerprint() -> str:
    """A digest of the rules users registered (op, function and its source), "" for none."""
    if not _USER_RULES:
        return ""
    digest = hashlib.sha256()
    for rule in _USER_RULES:
        try:
            source = inspect.getsource(rule.fn)
        except (OSError, TypeError):  # no source file (a REPL): its bytecode and constants
            code = rule.fn.__code__
            source = repr((code.co_code, code.co_consts, code.co_names))
        name = f"{rule.fn.__module__}.{rule.fn.__qualname__}"
        digest.update(f"{rule.op}\0{name}\0{rule.needs_ctx}\0{source}\0".encode())
    return digest.hexdigest()


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
    rule = lookup(op, platform) if isinstance(op, RULE_TARGETS) else None
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
