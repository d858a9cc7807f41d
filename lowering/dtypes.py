"""torch dtype ↔ jax dtype, and the 64-bit policy.

Policy "keep": lowering runs under `jax.enable_x64(True)`, so int64 indices and float64 math
are computed as torch computes them. Policy "narrow": the same trace with x64 off, where jax
narrows int64→int32 and float64→float32 (faster on TPU, wrong past 2**31 elements).
"""

from __future__ import annotations

import torch

_TORCH_TO_NUMPY_NAME = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.bool: "bool",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}

_NARROW = {
    torch.int64: torch.int32,
    torch.float64: torch.float32,
    torch.complex128: torch.complex64,
}


def is_supported(dtype: torch.dtype) -> bool:
    """Whether tensors of this dtype can cross into a lowered graph."""
    return dtype in _TORCH_TO_NUMPY_NAME


def to_jax(dtype: torch.dtype):
    """The jax/numpy dtype of a torch dtype."""
    import jax.numpy as jnp

    try:
        return jnp.dtype(_TORCH_TO_NUMPY_NAME[dtype])
    except KeyError:
        raise TypeError(f"tpu_inductor: torch dtype {dtype} has no jax equivalent") from None


def narrowed(dtype: torch.dtype, x64: str) -> torch.dtype:
    """The dtype a value of `dtype` has inside a lowered graph under the 64-bit policy."""
    return _NARROW.get(dtype, dtype) if x64 == "narrow" else dtype


def x64_scope(x64: str):
    """The jax config scope under which graphs are traced for this 64-bit policy."""
    import jax

    enable_x64 = getattr(jax, "enable_x64", None)
    if enable_x64 is None:  # older jax: the same State object, not yet re-exported
        from jax._src.config import enable_x64
    return enable_x64(x64 == "keep")


def constant(value, x64: str):
    """A torch tensor constant (a get_attr in the graph) as a jax array; other values unchanged."""
    if not isinstance(value, torch.Tensor):
        return value
    import jax.numpy as jnp

    tensor = value.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        array = jnp.asarray(tensor.view(torch.int16).numpy()).view(jnp.bfloat16)
    else:
        array = jnp.asarray(tensor.numpy())
    return array.astype(to_jax(narrowed(tensor.dtype, x64)))
