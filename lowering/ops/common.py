"""Helpers shared by the rule families: dtype casts, dims, layouts, elementwise registration."""

from __future__ import annotations

import operator
from collections.abc import Callable

import jax.numpy as jnp

from ..registry import register_lowering


def cast(x, dtype):
    """A jax array of `dtype` from an array or a Python scalar.

    A Python int outside an integer dtype's range wraps around, as a 64-bit value does when
    narrowed (x64="narrow") or as torch does for small integer dtypes.
    """
    if hasattr(x, "dtype"):
        return x.astype(dtype)
    if type(x) is int and jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        x = (x - int(info.min)) % (int(info.max) - int(info.min) + 1) + int(info.min)
    return jnp.asarray(x, dtype=dtype)


def dim(d: int, rank: int) -> int:
    """torch's dim argument (negative allowed; rank-0 tensors accept 0 and -1) as an axis."""
    return d % rank if rank else 0


def dims(ds, rank: int) -> tuple[int, ...]:
    """A dim list (None or [] meaning all dims) as sorted axes."""
    if ds is None or (isinstance(ds, (list, tuple)) and len(ds) == 0):
        return tuple(range(rank))
    if isinstance(ds, int):
        ds = (ds,)
    return tuple(sorted({dim(d, rank) for d in ds}))


def elementwise(*ops, compute: str = "auto", platform: str | None = None):
    """Register `fn(*arrays, **kwargs)` for `ops`, with torch's type promotion around it.

    Tensor and scalar arguments are cast to the op's computation dtype (the result dtype when
    it is floating, else the promoted dtype; compute="promoted" forces the latter; float32 for
    16-bit floats, as torch computes them) and the result to the node's dtype. `platform`: a
    rule for that lowering platform only (see registry.register_lowering).
    """

    def decorate(fn: Callable) -> Callable:
        @register_lowering(*ops, needs_ctx=True, platform=platform)
        def rule(ctx, *args, **kwargs):
            dtype = ctx.promoted_dtype() if compute == "promoted" else ctx.compute_dtype()
            dtype = accumulation_dtype(dtype)
            arrays = [cast(a, dtype) if _is_value(a) else a for a in args]
            return cast(fn(*arrays, **kwargs), ctx.out_dtype)

        rule.__name__ = rule.__qualname__ = fn.__name__
        takes_traced_scalars(rule)
        return fn

    return decorate


def takes_traced_scalars(rule: Callable) -> Callable:
    """Mark a rule whose scalar arguments may be traced 0-d arrays: integer inputs passed to the
    module at run time rather than compiled in (lowering/specialize.py)."""
    rule.takes_traced_scalars = True
    return rule


def _is_value(a) -> bool:
    return hasattr(a, "dtype") or isinstance(a, (bool, int, float, complex))


def accumulation_dtype(dtype):
    """The dtype torch accumulates reductions of `dtype` in (float32 for 16-bit floats)."""
    if dtype in (jnp.bfloat16, jnp.float16):
        return jnp.float32
    return dtype


def outputs_unread(positions):
    """`supports` for a rule that computes some results only: whether no user of the node
    reads the results at `positions` (the others are placeholders of the right shape)."""

    def supports(node):
        return all(
            user.target is operator.getitem and (user.args[1] not in positions or not user.users)
            for user in node.users
        )

    return supports


def _results(ctx, values):
    """Each value reshaped and cast to the node's result; None where the node expects None.

    The node's metadata, not `output_mask`, decides which results exist: torch's meta
    functions sometimes promise a tensor that its eager kernel leaves out.
    """
    return tuple(
        None if val is None else v.reshape(val.shape).astype(ctx.jax_dtype(val.dtype))
        for v, val in zip(values, ctx.out)
    )


def _f32(x):
    """x in the dtype torch accumulates it in (float32 for 16-bit floats)."""
    return x.astype(accumulation_dtype(x.dtype))


def _ntuple(value, n: int) -> tuple[int, ...]:
    values = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return tuple(values * n if len(values) == 1 else values)


def reads_result(node, index: int) -> bool:
    """Whether anything reads result `index` of a node that returns several."""
    return any(u.target is operator.getitem and u.args[1] == index and u.users for u in node.users)
