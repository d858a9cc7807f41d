"""`lower(gm, inputs, ...) -> LoweredModule`: an ATen FX graph as a StableHLO module.

The graph is evaluated by the interpreter inside `jax.jit(...).trace(...)`, for the concrete
input shapes given (the graph's sizes are concrete: the shape pass specialized it; integer
inputs that are values only are passed as 0-d tensors: `scalar_inputs`), and lowered for one
PJRT platform. A symbolic size that reaches `lower` is a SymbolicSizeError naming the node. The LoweredModule
says how to call the module and rebuild torch's outputs: which graph inputs are tensors, what
each graph output is (a module result, an input, a view of a result, or a Python value), which
inputs the graph mutates, and whether it takes a per-call random seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..exc import LoweringError, SymbolicSizeError
from . import dtypes
from .interpreter import GraphRunner, flatten, writes_input
from .written_parts import PartialWrite


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape and torch dtype of one tensor crossing the module boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


@dataclasses.dataclass(frozen=True)
class OutputSlot:
    """One graph output: module result number `result`; else graph input number `input`
    returned as it is (no copy through the module); else a `view` (base number, size, stride,
    storage offset; in `view_dtype` if not the base's) of a module result, as eager returns
    `y, y[0]`, or of graph input `input` (`x[i]`); else the Python `value`."""

    result: int | None
    value: Any = None
    input: int | None = None
    view: tuple[int, tuple[int, ...], tuple[int, ...], int] | None = None
    view_dtype: torch.dtype | None = None


@dataclasses.dataclass(frozen=True)
class Shardings:
    """How a module's tensor arguments are split over a device mesh: the mesh's `axes` (name,
    size), and per tensor argument a partition spec (per dim, the mesh axis it is split over,
    or None), or None: open, the partitioner chooses (a saved activation, which comes as the
    forward left it). Results are replicated (every device holds them whole), except those of
    `separate_outputs` (saved activations that stay on the devices), which are open. XLA's
    SPMD partitioner (Shardy) splits the computation and inserts the collectives."""

    axes: tuple[tuple[str, int], ...]
    inputs: tuple[tuple[str | None, ...] | None, ...]

    def named(self, devices: Sequence[Any] = ()) -> tuple[Any, ...]:
        """jax shardings of the tensor arguments, then of one replicated value (the seed, the
        results): over `devices` in row-major order, or over an abstract mesh (no devices
        needed to lower) when none are given. The one place a jax mesh is built."""
        import numpy as np
        from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

        names = tuple(name for name, _ in self.axes)
        sizes = tuple(size for _, size in self.axes)
        if devices:
            mesh = Mesh(np.array(devices, dtype=object).reshape(sizes), names)
        else:
            mesh = AbstractMesh(sizes, names)
        return (
            *(
                None if spec is None else NamedSharding(mesh, PartitionSpec(*spec))
                for spec in self.inputs
            ),
            NamedSharding(mesh, PartitionSpec()),
        )


@dataclasses.dataclass
class LoweredModule:
    """A StableHLO module and how to call it from torch."""

    bytecode: bytes
    text: str
    platform: str
    tensor_inputs: tuple[int, ...]  # graph input positions passed to the module, in order
    input_specs: tuple[TensorSpec, ...]
    output_specs: tuple[TensorSpec, ...]  # one per module result, torch dtypes
    outputs: tuple[OutputSlot, ...]  # one per graph output
    mutations: tuple[tuple[int, int], ...]  # (graph input position, module result)
    uses_rng: bool  # the module's first argument is a per-call int32[2] seed
    x64: str  # the 64-bit policy it was lowered under
    text_with_locations: str = ""  # `text` with MLIR source locations (for dumps); "" if unknown
    shardings: Shardings | None = None  # None: one device
    # the rules' choices, counted: "tpu.splash", "tpu.xla: <why>" (lowering/ops/attention_kernels)
    kernel_choices: dict[str, int] = dataclasses.field(default_factory=dict)
    # module tensor arguments (indices into tensor_inputs) the executable takes over: a buffer
    # the graph writes, updated in place on the device (its array is deleted by the call)
    donated: tuple[int, ...] = ()
    # written inputs whose host copy is updated by the part written (written_parts.py)
    partial_writes: tuple[PartialWrite, ...] = ()

    @property
    def module_input_dtypes(self) -> tuple[torch.dtype, ...]:
        """torch dtypes of the module's tensor arguments (narrowed under x64="narrow")."""
        return tuple(dtypes.narrowed(s.dtype, self.x64) for s in self.input_specs)

    @property
    def module_output_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(dtypes.narrowed(s.dtype, self.x64) for s in self.output_specs)


def input_spec(value) -> TensorSpec | None:
    """The spec of a tensor input (None for Python scalars, which are specialized)."""
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(int(d) for d in value.shape), value.dtype)
    return None


def tensor_input_specs(inputs: Sequence[Any]) -> tuple[tuple[int, ...], tuple[TensorSpec, ...]]:
    """(positions of the tensor inputs, their specs): what a lowered module takes as arguments."""
    positions = tuple(i for i, v in enumerate(inputs) if isinstance(v, torch.Tensor))
    return positions, tuple(input_spec(inputs[i]) for i in positions)


def lower(
    gm: torch.fx.GraphModule,
    inputs: Sequence[Any],
    *,
    platform: str = "cpu",
    x64: str = "keep",
    scalar_inputs: frozenset[int] = frozenset(),
    shardings: Shardings | None = None,
    separate_outputs: frozenset[int] = frozenset(),
    donate_writes: bool = False,
) -> LoweredModule:
    """Lower `gm`, a graph whose sizes are concrete (the shape pass made them so), for `inputs`
    (tensors or fake tensors, and ints) on `platform`.

    `scalar_inputs`: positions of integer inputs given as 0-d int64 tensors, module arguments
    (the shape pass finds them: `passes.shapes.value_only_integer_inputs`). `shardings`: split
    the tensor inputs over a device mesh (None: one device). `separate_outputs`: graph outputs
    that get a module result of their own even where they view another output (activations
    saved for the backward, which stay on the device: no write can show through them).
    `donate_writes`: the inputs the graph writes (`copy_` into a placeholder) are donated, so
    the executable updates them in place instead of allocating and copying (on a device whose
    arrays are not the torch tensors' own memory: an accelerator, or a mesh's shards).
    """
    import jax

    from .prng import threefry_unrolled

    require_concrete(gm)
    runner = GraphRunner(gm, x64=x64, platform=platform)
    tensor_inputs, specs = tensor_input_specs(inputs)
    if shardings is None:  # an input nothing reads is no argument: it never crosses
        read = [bool(n.users) for n in gm.graph.nodes if n.op == "placeholder"]
        kept = [(p, s) for p, s in zip(tensor_inputs, specs) if read[p]]
        tensor_inputs, specs = tuple(p for p, _ in kept), tuple(s for _, s in kept)
    passed_through = _passed_through_inputs(gm, tensor_inputs)
    views, bases = _aliased_outputs(gm, passed_through, separate_outputs)
    written = _written_inputs(gm) if donate_writes else frozenset()
    donated = tuple(slot for slot, position in enumerate(tensor_inputs) if position in written)
    structure: dict[str, Any] = {}

    def fn(*args):
        values = list(inputs)
        if runner.uses_rng:
            seed, args = args[0], args[1:]
            data = jax.lax.bitcast_convert_type(seed, jax.numpy.uint32)
            base = jax.random.wrap_key_data(data, impl=threefry_unrolled())
            rng = lambda index: jax.random.fold_in(base, index)  # noqa: E731
        else:
            rng = None
        for position, arg in zip(tensor_inputs, args):
            values[position] = arg
        flat = runner.run(values, rng, also=bases)
        outputs, base_values = flat[: len(passed_through)], flat[len(passed_through) :]
        results, slots = [], []
        result_of = {}  # output number or base node → module result number
        for index, (value, source) in enumerate(zip(outputs, passed_through)):
            if source is not None:
                slots.append(OutputSlot(None, input=source))
            elif index in views:
                slots.append(None)  # filled below, once its base has a result number
            elif isinstance(value, jax.Array):
                result_of[index] = len(results)
                slots.append(OutputSlot(len(results)))
                results.append(value)
            else:
                slots.append(OutputSlot(None, value))
        mutations = []
        for position, value in runner.mutations.items():
            mutations.append((position, len(results)))
            results.append(value)
        for node, value in zip(bases, base_values):
            result_of[node] = len(results)
            results.append(value)
        partial, part_specs = [], []  # the written parts, their results' torch specs
        for position, part in runner.written_parts.items():
            indices = []
            for array, dtype in zip(part.indices, part.index_dtypes):
                indices.append(None if array is None else len(results))
                if array is not None:
                    results.append(array)
                    part_specs.append(TensorSpec(tuple(array.shape), dtype))
            piece = len(results)
            results.append(part.piece)
            part_specs.append(TensorSpec(tuple(part.piece.shape), inputs[position].dtype))
            partial.append(PartialWrite(position, piece, tuple(indices), part.slice))
        for index, (base, size, stride, offset, dtype) in views.items():
            if isinstance(base, _InputBase):
                view = (base.position, size, stride, offset)
                slots[index] = OutputSlot(None, input=base.position, view=view)
            else:
                view = (result_of[base], size, stride, offset)
                slots[index] = OutputSlot(None, view=view, view_dtype=dtype)
        structure.update(
            slots=tuple(slots),
            mutations=tuple(mutations),
            partial=tuple(partial),
            part_specs=tuple(part_specs),
        )
        if shardings is not None:  # the results the host reads whole; saved ones and the new
            # values of written inputs (an optimizer step's, split as their inputs) left open
            kept = {result_of[i] for i in separate_outputs if i in result_of}
            kept.update(result for _, result in mutations)
            replicated = shardings.named()[-1]
            results = [
                r if i in kept else jax.lax.with_sharding_constraint(r, replicated)
                for i, r in enumerate(results)
            ]
        return tuple(results)

    arg_specs = [
        jax.ShapeDtypeStruct(s.shape, dtypes.to_jax(dtypes.narrowed(s.dtype, x64))) for s in specs
    ]
    if runner.uses_rng:
        arg_specs.insert(0, jax.ShapeDtypeStruct((2,), jax.numpy.int32))
    with dtypes.x64_scope(x64):
        donate_argnums = tuple(slot + runner.uses_rng for slot in donated)
        jit_options = _jit_shardings(shardings, runner.uses_rng)
        traced = jax.jit(fn, keep_unused=True, donate_argnums=donate_argnums, **jit_options)
        traced = traced.trace(*arg_specs)
        lowered = traced.lower(lowering_platforms=(platform,))
    module = lowered.compiler_ir("stablehlo")
    output_specs = _output_specs(gm, structure["slots"], structure["mutations"], inputs, bases)
    output_specs += structure["part_specs"]
    from jax._src.interpreters import mlir

    return LoweredModule(
        bytecode=mlir.module_to_bytecode(module),
        text=str(module),
        platform=platform,
        tensor_inputs=tensor_inputs,
        input_specs=specs,
        output_specs=output_specs,
        outputs=structure["slots"],
        mutations=structure["mutations"],
        uses_rng=runner.uses_rng,
        x64=x64,
        text_with_locations=module.operation.get_asm(enable_debug_info=True),
        shardings=shardings,
        kernel_choices=dict(runner.choices),
        donated=donated,
        partial_writes=structure["partial"],
    )


def require_concrete(gm: torch.fx.GraphModule) -> None:
    """A SymbolicSizeError naming the first node whose metadata holds a symbolic size."""
    from .interpreter import source_line

    for node in gm.graph.nodes:
        for value in flatten(node.meta.get("val")):
            sizes = value.shape if isinstance(value, torch.Tensor) else (value,)
            if any(isinstance(d, (torch.SymInt, torch.SymFloat, torch.SymBool)) for d in sizes):
                raise SymbolicSizeError(
                    f"node {node.name} ({node.target}, {source_line(node)}) has a symbolic size "
                    f"or value ({value}): lowering takes graphs whose sizes are concrete. "
                    "Specialize the graph first (passes.shapes.concretize), as compile_fx does."
                )


def _jit_shardings(shardings: Shardings | None, uses_rng: bool) -> dict[str, Any]:
    """jax.jit's in_shardings over an abstract mesh (no devices needed to lower), the seed
    replicated; an open input's None (the partitioner chooses). The results' are set inside
    the module (`lower`)."""
    if shardings is None:
        return {}
    *inputs, replicated = shardings.named()
    if uses_rng:
        inputs.insert(0, replicated)
    return {"in_shardings": tuple(inputs)}


def _written_inputs(gm) -> frozenset[int]:
    """Positions of the placeholders the graph writes (AOTAutograd's `copy_` into an input)."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    return frozenset(
        placeholders[n.args[0]] for n in gm.graph.nodes if writes_input(n, placeholders)
    )


def _passed_through_inputs(gm, tensor_inputs) -> list[int | None]:
    """Per graph output: the tensor input it is (AOTAutograd saves inputs for the backward by
    returning them), else None. Returned as module results, XLA would copy them."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = {placeholders[i]: i for i in tensor_inputs}
    return [tensors.get(node) for node in flat_outputs(gm)]


def flat_outputs(gm) -> list:
    """The graph's outputs, flattened (nodes, or constants)."""
    return list(flatten(gm.graph.output_node().args[0]))


@dataclasses.dataclass(frozen=True)
class _InputBase:
    position: int  # the graph input whose storage an output views


def _aliased_outputs(
    gm, passed_through, separate: frozenset[int] = frozenset()
) -> tuple[dict[int, tuple], list[torch.fx.Node]]:
    """Graph outputs that share a storage (views of one another, of one intermediate, or of an
    input), as eager returns `y, y[0]`, `y[:3], y[1:]` or `x[i]`: output number → (its base: an
    output number, a node or an `_InputBase`; size, stride, storage offset, dtype if not the
    base's); and the base nodes that are not outputs (extra module results). The module computes
    each base once and the outputs are viewed from it at run time, so that a write through one
    shows through the others. (AOTAutograd rebuilds its views of inputs from the strides and
    offset of ours: a copy would put them at offset 0.) Outputs in `separate` are left out."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(val):
        return StorageWeakRef(val.untyped_storage())

    def covers(val) -> bool:  # the whole storage, row-major: what a module result is
        whole = val.untyped_storage().nbytes() == val.numel() * val.element_size()
        return whole and val.is_contiguous() and val.storage_offset() == 0

    outputs = flat_outputs(gm)
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in outputs]
    groups: dict[Any, list[int]] = {}
    for index, val in enumerate(vals):
        if (
            isinstance(val, torch.Tensor)
            and passed_through[index] is None
            and index not in separate
        ):
            groups.setdefault(storage(val), []).append(index)
    nodes = [n for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    of_inputs = {
        storage(n.meta["val"]): (position, n.meta["val"].dtype)
        for position, n in enumerate(placeholders)
        if isinstance(n.meta.get("val"), torch.Tensor)
    }
    views, bases = {}, []
    for key, members in groups.items():
        if key in of_inputs:
            position, dtype = of_inputs[key]
            for index in members:
                val = vals[index]
                if val.dtype == dtype:  # (a dtype view of an input stays a copy)
                    shape, stride = tuple(val.shape), tuple(val.stride())
                    views[index] = (_InputBase(position), shape, stride, val.storage_offset(), None)
            continue
        if len(members) < 2:
            continue
        base = next((i for i in members if covers(vals[i])), None)
        if base is None:
            node = next(
                (n for n in nodes if storage(n.meta["val"]) == key and covers(n.meta["val"])), None
            )
            if node is None:
                continue
            base = node
            bases.append(node)
        base_dtype = (vals[base] if isinstance(base, int) else base.meta["val"]).dtype
        for index in members:
            if index != base:
                val = vals[index]
                dtype = val.dtype if val.dtype != base_dtype else None
                views[index] = (
                    base,
                    tuple(val.shape),
                    tuple(val.stride()),
                    val.storage_offset(),
                    dtype,
                )
    return views, bases


def _output_specs(gm, slots, mutations, inputs, bases) -> tuple[TensorSpec, ...]:
    """torch dtypes of the module results, from the output node's metadata (and the inputs')."""
    flat_nodes = flat_outputs(gm)
    specs: list[TensorSpec | None] = []
    for node, slot in zip(flat_nodes, slots):
        if slot.result is None:
            continue
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            raise LoweringError(f"graph output {node} has no tensor metadata (meta['val'])")
        specs.append(TensorSpec(_static_shape(val.shape), val.dtype))
    for position, _ in mutations:
        specs.append(input_spec(inputs[position]))
    for node in bases:
        specs.append(TensorSpec(_static_shape(node.meta["val"].shape), node.meta["val"].dtype))
    return tuple(specs)


def _static_shape(shape) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else -1 for d in shape)
