"""Mixture-of-experts: grouped matmuls (`aten._grouped_mm`, transformers' `grouped_mm_fallback`).

A grouped matmul multiplies consecutive slices of one operand by one matrix each; the slices
end at `offs` (cumulative sizes, one per group, a runtime value). It lowers to XLA's ragged dot
(`lax.ragged_dot_general`), whose group sizes are runtime values too: a new routing of tokens to
experts runs the same executable, and nothing is padded per group. The four forms
`torch._grouped_mm` defines, by operand ranks (g groups, offsets over the ragged dim):

    2-D x 3-D  [m, k] x [g, k, n] -> [m, n]     rows of the lhs grouped (the MoE forward)
    2-D x 2-D  [m, k] x [k, n] -> [g, m, n]     the contracted dim grouped (weight gradients)
    3-D x 2-D  [g, m, k] x [k, n] -> [m, n]     columns of the rhs grouped
    3-D x 3-D  [g, m, k] x [g, k, n] -> [g, m, n]   no offsets: a batched matmul

Rows (or columns) past the last offset are zeros; torch leaves them uninitialised. Offsets
are taken as given: torch does not check them on every device either (decreasing offsets give
zero-size groups here). Products accumulate in float32 for 16-bit floats at HIGHEST precision,
as the other matmuls do (linalg.py). `grouped_mm_fallback` and its backward are transformers'
custom ops (transformers/integrations/moe.py), registered by name: they exist once transformers
is imported, which tpu_inductor never does.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from torch._ops import ops

from ..registry import register_lowering
from .common import accumulation_dtype

aten = ops.aten
_HIGHEST = lax.Precision.HIGHEST


def _sizes(offs, total: int):
    """Group sizes from cumulative offsets, as int32 (ragged dot's group-size dtype)."""
    ends = jnp.clip(offs.astype(jnp.int32), 0, total)
    return jnp.maximum(jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32)), 0)


def _ragged(lhs, rhs, sizes, contracting, lhs_ragged: int, rhs_group: tuple[int, ...]):
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(contracting, ((), ())),
        lhs_ragged_dimensions=(lhs_ragged,),
        rhs_group_dimensions=rhs_group,
    )
    acc = accumulation_dtype(lhs.dtype)  # XLA:CPU has no bf16 x bf16 -> f32 ragged dot
    return lax.ragged_dot_general(
        lhs.astype(acc), rhs.astype(acc), sizes, numbers, precision=_HIGHEST
    )


def grouped_mm(a, b, offs):
    """torch._grouped_mm's product, in the accumulation dtype (see the module docstring)."""
    if a.ndim == 3 and b.ndim == 3:
        acc = accumulation_dtype(a.dtype)
        return jnp.matmul(a, b, precision=_HIGHEST, preferred_element_type=acc)
    if a.ndim == 2 and b.ndim == 3:  # rows of a grouped
        return _ragged(a, b, _sizes(offs, a.shape[0]), ((1,), (1,)), 0, (0,))
    if a.ndim == 2 and b.ndim == 2:  # the contracted dim grouped
        return _ragged(a, b, _sizes(offs, a.shape[1]), ((1,), (0,)), 1, ())
    # 3-D x 2-D, columns of b grouped: out^T = b^T [n, k] (rows grouped) x a^T [g, k, m]
    out_t = _ragged(b.T, jnp.swapaxes(a, 1, 2), _sizes(offs, b.shape[1]), ((1,), (1,)), 0, (0,))
    return out_t.T


def _no_bias(node) -> bool:
    """The rule lowers _grouped_mm without a bias (torch rejects one on every device today)."""
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    return bias is None


@register_lowering(aten._grouped_mm.default, needs_ctx=True, supports=_no_bias)
def _grouped_mm(ctx, a, b, offs=None, bias=None, out_dtype=None):
    return grouped_mm(a, b, offs).astype(ctx.out_dtype)


@register_lowering("transformers.grouped_mm_fallback.default", needs_ctx=True)
def grouped_mm_fallback(ctx, x, weight, offs):
    """transformers' float32 expert matmul: input [S, k] sorted by expert, weight [g, k, n]."""
    return grouped_mm(x, weight, offs).astype(ctx.out_dtype)


@register_lowering("transformers.grouped_mm_fallback_backward.default")
def grouped_mm_fallback_backward(x, weight, offs, grad):
    """Its backward: (grad @ weight[g]^T per group, x[group]^T @ grad[group] per group)."""
    grad_x = grouped_mm(grad, jnp.swapaxes(weight, 1, 2), offs)
    grad_weight = grouped_mm(x.T, grad, offs)
    return grad_x.astype(x.dtype), grad_weight.astype(weight.dtype)


# Expert parallelism (`tpu_inductor::expert_mm`, tpu_inductor/ops/expert.py). XLA:CPU in jaxlib
# 0.10.2 has no ragged all-to-all ("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU
# ThunkEmitter"), so rows travel by the dense all-to-all, in blocks sized for the worst case:
# nothing is dropped, whatever the routing.


def _span(lo, hi, start, end):
    """Start and length of the row range [lo, hi) ∩ [start, end) (broadcast)."""
    first = jnp.maximum(lo, start)
    return first, jnp.maximum(jnp.minimum(hi, end) - first, 0)


def _blocks(rows, first, count, block: int):
    """[len(first), block, ...]: block d holds rows[first[d] : first[d] + count[d]], then zeros."""
    r = jnp.arange(block)
    index = jnp.clip(first[:, None] + r, 0, rows.shape[0] - 1)
    keep = (r < count[:, None]).reshape(*index.shape, *(1,) * (rows.ndim - 1))
    return jnp.where(keep, rows[index], jnp.zeros((), rows.dtype))


def expert_parallel_mm(x, weight, offs, mesh_text: str, axis: str):
    """`grouped_mm(x, weight, offs)` (2-d x 3-d) with `weight`'s experts split over mesh axis
    `axis`, inside `jax.shard_map` over the whole mesh. The sorted rows are split over every
    mesh axis, `axis` innermost, so the devices along `axis` (an expert group) hold one
    contiguous range of them; the rows of each expert group are that range's. Each device:

    1. from the expert boundaries (replicated) finds which of its rows each device along
       `axis` owns the experts of (contiguous: the rows are sorted) and sends them there, in a
       block of its whole row count (all-to-all);
    2. packs what it received in sender order, which is the global order, so its experts' rows
       lie together as ragged dot wants them, and multiplies by its experts' weights;
    3. sends each sender's results back (all-to-all) and puts them at their rows.

    Each row's product is computed whole on one device from the same operands as on one
    device; rows past the last offset give zeros. Differentiable by jax (all-to-all transposes
    to all-to-all, the gathers to scatter-adds): `expert_mm_backward` is its vjp."""
    import jax
    from jax.sharding import AbstractMesh, PartitionSpec

    from tpu_inductor.ops.shard_as import decode

    mesh, _ = decode(mesh_text, "")
    sizes, names = dict(mesh.axes), mesh.names
    others = tuple(n for n in names if n != axis)
    devices, experts = sizes[axis], weight.shape[0]
    local = experts // devices
    groups = int(np.prod([sizes[n] for n in others], dtype=int))
    total = x.shape[0]
    pad = -total % (groups * devices)
    block = (total + pad) // (groups * devices)  # rows per device
    group_rows = block * devices
    ends = jnp.cumsum(_sizes(offs, total))  # as the one-device rule reads the offsets
    starts = ends - _sizes(offs, total)

    def body(rows, weights, starts, ends):
        group = 0
        for name in others:
            group = group * sizes[name] + lax.axis_index(name)
        me = lax.axis_index(axis)
        base = group * group_rows
        d = jnp.arange(devices)
        owned_lo = jnp.maximum(starts[d * local], base)  # rows device d's experts take
        owned_hi = jnp.minimum(ends[d * local + local - 1], base + group_rows)
        held_lo = base + d * block  # rows device d holds
        first, count = _span(held_lo[me], held_lo[me] + block, owned_lo, owned_hi)
        sent = _blocks(rows, first - held_lo[me], count, block)
        received = lax.all_to_all(sent, axis, 0, 0, tiled=True)
        _, counts = _span(held_lo, held_lo + block, owned_lo[me], owned_hi[me])
        upto = jnp.cumsum(counts)
        p = jnp.arange(devices * block)
        sender = jnp.clip(jnp.searchsorted(upto, p, side="right"), 0, devices - 1)
        offset = jnp.clip(p - (upto - counts)[sender], 0, block - 1)
        packed = received[sender, offset]
        mine = me * local + jnp.arange(local)
        _, group_sizes = _span(starts[mine], ends[mine], base, base + group_rows)
        product = _ragged(packed, weights, group_sizes, ((1,), (1,)), 0, (0,))
        returned = _blocks(product, upto - counts, counts, block)
        back = lax.all_to_all(returned, axis, 0, 0, tiled=True)
        row = held_lo[me] + jnp.arange(block)
        owner = jnp.clip(jnp.searchsorted(owned_hi, row, side="right"), 0, devices - 1)
        owned = (row >= owned_lo[owner]) & (row < owned_hi[owner])
        value = back[owner, jnp.clip(row - first[owner], 0, block - 1)]
        return jnp.where(owned[:, None], value, jnp.zeros((), value.dtype))

    abstract = AbstractMesh(tuple(sizes[n] for n in names), names)
    split_rows, whole = PartitionSpec((*others, axis)), PartitionSpec()
    run = jax.shard_map(
        body,
        mesh=abstract,
        in_specs=(split_rows, PartitionSpec(axis), whole, whole),
        out_specs=split_rows,
    )
    rows = jnp.pad(x, ((0, pad), (0, 0)))
    return run(rows, weight, starts, ends)[:total]


@register_lowering("tpu_inductor.expert_mm.default", needs_ctx=True)
def expert_mm(ctx, x, weight, offs, mesh, axis):
    """A grouped matmul with its experts split over `axis`: rows dispatched by all-to-all."""
    return expert_parallel_mm(x, weight, offs, mesh, axis).astype(ctx.out_dtype)


@register_lowering("tpu_inductor.expert_mm_backward.default")
def expert_mm_backward(x, weight, offs, grad, mesh, axis):
    """Its backward: the vjp of the same dispatch (gradients travel the same all-to-alls; the
    weight gradient of each device's experts is summed over the other mesh axes)."""
    import jax

    acc = accumulation_dtype(x.dtype)

    def product(x, weight):
        return expert_parallel_mm(x, weight, offs, mesh, axis)

    _, pullback = jax.vjp(product, x.astype(acc), weight.astype(acc))
    grad_x, grad_weight = pullback(grad.astype(acc))
    return grad_x.astype(x.dtype), grad_weight.astype(weight.dtype)
