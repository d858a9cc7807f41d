"""What `make mutation` mutates, which tests may kill each file's mutants, and the named mutants.

A named mutant is a bug that was once written (or planted by a probe) and went unseen: it is
applied as a text replacement and must be killed, by name, on every run. Its `original` must
occur exactly once in its file (tests/tools/test_mutation_tools.py checks it), so a rewritten rule
fails loudly instead of leaving the mutant silently inapplicable.
"""

from __future__ import annotations

import dataclasses

# Rule file → the tests that cover it (pytest paths; a mutant runs the ones that execute it).
TARGETS: dict[str, tuple[str, ...]] = {
    "lowering/ops/pointwise.py": ("tests/lowering/test_pointwise.py",),
    "lowering/ops/reduction.py": ("tests/lowering/test_reductions.py",),
    "lowering/ops/indexing.py": ("tests/lowering/test_indexing.py",),
    "lowering/ops/shape.py": ("tests/lowering/test_shape_ops.py",),
    "lowering/ops/conv.py": ("tests/lowering/test_nn_ops_conv.py",),
    "lowering/ops/normalization.py": ("tests/lowering/test_nn_ops_norm.py",),
    "lowering/ops/pooling.py": ("tests/lowering/test_nn_ops_pooling.py",),
    "lowering/ops/embedding.py": ("tests/lowering/test_nn_ops_embedding.py",),
    "lowering/ops/sdpa.py": ("tests/lowering/test_nn_ops_sdpa.py",),
    "lowering/ops/losses.py": ("tests/lowering/test_nn_ops_losses.py",),
    # The passes: what bucketing masks, and the shape policy it extends.
    "passes/bucket_rules.py": ("tests/passes/test_bucketing.py",),
    "passes/bucket_rules_dims.py": ("tests/passes/test_bucketing.py",),
    "passes/bucket_rules_slices.py": ("tests/passes/test_bucketing.py",),
    "passes/bucket_rules_index.py": ("tests/passes/test_bucketing.py",),
    "passes/bucket_rules_nn.py": ("tests/passes/test_bucketing.py",),
    "passes/bucket_shapes.py": ("tests/passes/test_bucketing.py",),
    "passes/bucket_policy.py": ("tests/passes/test_bucket_policy.py",),
    "passes/shapes.py": ("tests/passes/test_shape_policy.py",),
}


@dataclasses.dataclass(frozen=True)
class Named:
    """A hand-written mutant: `original` replaced by `mutated` in `path`."""

    name: str
    path: str
    original: str
    mutated: str


NAMED: tuple[Named, ...] = (
    Named(
        "min.dim returns the last index among ties",
        "lowering/ops/reduction.py",
        "return _index_reduce(x, dim, keepdim, jnp.argmin, jnp.min)",
        "return _index_reduce(x, dim, keepdim, lambda v, axis, keepdims: v.shape[axis] - 1 - "
        "jnp.argmin(jnp.flip(v, axis), axis=axis, keepdims=keepdims), jnp.min)",
    ),
    Named(
        "masked_fill routes its fill value through float32",
        "lowering/ops/indexing.py",
        "out = jnp.where(mask, cast(value, x.dtype), x)",
        "out = jnp.where(mask, cast(cast(value, jnp.float32), x.dtype), x)",
    ),
    Named(
        "nll_loss's backward credits targets equal to ignore_index",
        "lowering/ops/losses.py",
        "value = jnp.where(keep, -w.astype(x.dtype) * g, jnp.zeros((), x.dtype))",
        "value = -w.astype(x.dtype) * g",
    ),
    Named(
        "lerp takes the one-sided formula (NaN where eager's is infinite)",
        "lowering/ops/pointwise.py",
        "return jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))",
        "return start + weight * diff",
    ),
    Named(
        "nextafter of 16-bit floats steps by float32's ulp",
        "lowering/ops/pointwise.py",
        "return jnp.nextafter(cast(a, ctx.out_dtype), cast(b, ctx.out_dtype))",
        "return jnp.nextafter(a.astype(jnp.float32), b.astype(jnp.float32)).astype(ctx.out_dtype)",
    ),
    Named(
        "integer pow reads only the exponent's low 6 bits (jnp.power)",
        "lowering/ops/pointwise.py",
        "powered = _integer_power(a, jnp.where(negative, jnp.zeros((), b.dtype), b))",
        "powered = jnp.power(a, jnp.where(negative, jnp.zeros((), b.dtype), b))",
    ),
)
