"""Helpers shared by the rule families: dtype casts, dims, elementwise registration."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from ..registry import register_lowering


def cast(x, dtype):
    """A jax array of `dtype` from an array or a Python scalar."""
    return jnp.asarray(x, dtype=dtype) if not hasattr(x, "dtype") else x.astype(dtype)


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


def elementwise(*ops, compute: str = "auto"):
    """Register `fn(*arrays, **kwargs)` for `ops`, with torch's type promotion around it.

    Tensor and scalar arguments are cast to the op's computation dtype (the result dtype when
    it is floating, else the promoted dtype; compute="promoted" forces the latter) and the
    result to the node's dtype.
    """

    def decorate(fn: Callable) -> Callable:
        @register_lowering(*ops, needs_ctx=True)
        def rule(ctx, *args, **kwargs):
            dtype = ctx.promoted_dtype() if compute == "promoted" else ctx.compute_dtype()
            arrays = [cast(a, dtype) if _is_value(a) else a for a in args]
            return cast(fn(*arrays, **kwargs), ctx.out_dtype)

        rule.__name__ = rule.__qualname__ = fn.__name__
        return fn

    return decorate


def _is_value(a) -> bool:
    return hasattr(a, "dtype") or isinstance(a, (bool, int, float, complex))


def accumulation_dtype(dtype):
    """The dtype torch accumulates reductions of `dtype` in (float32 for 16-bit floats)."""
    if dtype in (jnp.bfloat16, jnp.float16):
        return jnp.float32
    return dtype
