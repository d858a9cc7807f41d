"""A call's plan on its own: `call_plan.plan_call` over small hand-made call descriptions (no
tensors, no jax, no executable): what each argument is and where its array comes from, where
each result goes, the write-backs, the graph outputs and the per-call ledger."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tpu_inductor.lowering import PartialWrite
from tpu_inductor.lowering.stablehlo import LoweredModule, OutputSlot, TensorSpec

from tpu_inductor.runtime import ledger
from tpu_inductor.runtime.call_plan import ArgumentKind, Destination, DeviceFacts, plan_call
from tpu_inductor.runtime.compiled_graph import GraphRoles

ONE_DEVICE = DeviceFacts(mesh=False, zero_copy=False, host_arguments=True)
ZERO_COPY_CPU = DeviceFacts(mesh=False, zero_copy=True, host_arguments=True)
MESH = DeviceFacts(mesh=True, zero_copy=False, host_arguments=False)
DEFAULT_ROLES = GraphRoles()
H2D, D2H = ledger.HOST_TO_DEVICE, ledger.DEVICE_TO_HOST


def _spec(*shape: int, dtype: torch.dtype = torch.float32) -> TensorSpec:
    return TensorSpec(shape, dtype)


def _module(
    inputs: dict[int, TensorSpec],
    results: list[TensorSpec],
    outputs: list[OutputSlot],
    **call,
) -> LoweredModule:
    """A call description: graph input position → spec of the tensor arguments, the module's
    result specs, the graph outputs, and `call` (mutations, partial_writes, donated, ...)."""
    return LoweredModule(
        bytecode=b"",
        text="",
        platform="cpu",
        tensor_inputs=tuple(inputs),
        input_specs=tuple(inputs.values()),
        output_specs=tuple(results),
        outputs=tuple(outputs),
        mutations=call.pop("mutations", ()),
        uses_rng=call.pop("uses_rng", False),
        x64=call.pop("x64", "keep"),
        **call,
    )


def _plan(lowered, roles=DEFAULT_ROLES, device=ONE_DEVICE, static_inputs=()):
    """plan_call, checked for what holds of every plan: each argument is found one way, each
    result goes one place, a second call plans the same, and the plan cannot be changed."""
    plan = plan_call(lowered, roles, device, static_inputs)
    found = [*plan.resident, *plan.sent, *plan.looked_up]
    assert sorted(a.slot for a in found) == list(range(len(lowered.tensor_inputs)))
    assert [r.index for r in plan.results] == list(range(len(lowered.output_specs)))
    assert plan == plan_call(lowered, roles, device, static_inputs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.uses_rng = not plan.uses_rng
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.arguments[0].cast = torch.float16
    return plan


def test_parameters_stay_resident_and_only_the_input_is_sent():
    # y = w @ x + b: w and b are parameters (static), x crosses on every call
    lowered = _module(
        {0: _spec(4, 4), 1: _spec(4), 2: _spec(4)}, [_spec(4)], [OutputSlot(result=0)]
    )
    plan = _plan(lowered, static_inputs=(0, 2))
    assert [a.kind for a in plan.arguments] == [
        ArgumentKind.PARAMETER,
        ArgumentKind.PLAIN,
        ArgumentKind.PARAMETER,
    ]
    assert plan.resident_positions == (0, 2)
    assert [a.sent_as for a in plan.resident] == ["parameter", "parameter"]
    (x,) = plan.sent
    assert (x.slot, x.position, x.cast, x.nbytes, x.host) == (1, 1, None, 16, True)
    assert plan.looked_up == () and plan.donated == ()
    (y,) = plan.results
    assert (y.goes, y.published, y.reader) == (Destination.HOST, True, "output")
    assert dict(plan.per_call) == {(H2D, "argument"): 16, (D2H, "output"): 16}
    assert [(r.result, r.input, r.value) for r in plan.returns] == [(0, None, None)]


def test_host_arguments_only_where_the_dispatch_takes_them():
    lowered = _module({0: _spec(8)}, [_spec(8)], [OutputSlot(result=0)])
    device = dataclasses.replace(ONE_DEVICE, host_arguments=False)
    assert [a.host for a in _plan(lowered, device=device).sent] == [False]
    assert [a.host for a in _plan(lowered).sent] == [True]


def test_a_narrowed_input_is_cast_and_counted_in_the_module_dtype():
    lowered = _module(
        {0: _spec(8, dtype=torch.int64)},
        [_spec(8, dtype=torch.int64)],
        [OutputSlot(result=0)],
        x64="narrow",
    )
    plan = _plan(lowered)
    (index,) = plan.sent
    assert (index.cast, index.nbytes) == (torch.int32, 32)
    (result,) = plan.results
    # cast back on the host, so never published as a mirror of the device's narrowed array
    assert (result.cast, result.nbytes, result.published) == (torch.int64, 64, False)


def test_saved_outputs_are_kept_on_the_device_and_a_saved_input_is_published():
    # a forward returns its output, a saved activation (result 1) and its input x (saved)
    lowered = _module(
        {0: _spec(2, 3)},
        [_spec(2, 3), _spec(2, 3)],
        [OutputSlot(result=0), OutputSlot(result=1), OutputSlot(result=None, input=0)],
    )
    plan = _plan(lowered, GraphRoles(saved_outputs=(1, 2)))
    assert [r.goes for r in plan.results] == [Destination.HOST, Destination.KEPT]
    assert [r.index for r in plan.kept] == [1]
    assert plan.kept[0].shape == (2, 3) and plan.kept[0].dtype == torch.float32
    (x,) = plan.sent
    assert (x.publish, x.host) == (True, False)  # its device array becomes the saved mirror
    assert plan.published_arguments == (x,)
    assert dict(plan.per_call) == {(H2D, "argument"): 24, (D2H, "output"): 24}

    fetched = _plan(lowered, GraphRoles(saved_outputs=(1, 2), keep_saved=False))
    assert fetched.kept == () and fetched.results[1].goes is Destination.HOST
    assert dict(fetched.per_call)[D2H, "saved"] == 24


def test_a_backward_looks_up_saved_activations_and_tangents():
    # a backward: saved activation (0), the gradient of the loss (1), of the logits (2)
    lowered = _module(
        {0: _spec(4), 1: _spec(), 2: _spec(4, 10)}, [_spec(4)], [OutputSlot(result=0)]
    )
    roles = GraphRoles(saved_inputs=(0,), tangent_inputs=(1, 2), mirror_outputs=True)
    plan = _plan(lowered, roles)
    assert [a.kind for a in plan.arguments] == [
        ArgumentKind.SAVED,
        ArgumentKind.TANGENT,
        ArgumentKind.TANGENT,
    ]
    assert plan.looked_up == plan.arguments and plan.sent == ()
    assert [a.sent_as for a in plan.looked_up] == ["saved", "argument", "argument"]
    assert [a.zeros for a in plan.looked_up] == [False, True, True]
    assert plan.outputs_by_memory and plan.published == (0,)
    assert dict(plan.per_call) == {(D2H, "output"): 16}  # a miss is counted when it happens


def test_inputs_from_other_graphs_are_looked_up_and_bumped_ones_marked():
    lowered = _module({0: _spec(4), 1: _spec(4)}, [_spec(4)], [OutputSlot(result=0)])
    plan = _plan(lowered, GraphRoles(mirrored_inputs=(1,), bumped_inputs=(1,)))
    assert [a.kind for a in plan.arguments] == [ArgumentKind.PLAIN, ArgumentKind.MIRRORED]
    assert [a.bumped for a in plan.arguments] == [False, True]
    assert [a.position for a in plan.looked_up] == [1]


def _written(buffer: TensorSpec, **call) -> LoweredModule:
    """Input 0 (`buffer`) written whole with result 1; input 1 (4 floats) read for result 0,
    the graph's output."""
    return _module(
        {0: buffer, 1: _spec(4)},
        [_spec(4), buffer],
        [OutputSlot(result=0)],
        mutations=((0, 1),),
        **call,
    )


def test_a_written_buffer_comes_from_its_device_copy_and_is_written_back_whole():
    # a static buffer, donated; a seed goes first among the module's arguments
    plan = _plan(_written(_spec(16), donated=(0,), uses_rng=True), static_inputs=(0,))
    buffer, x = plan.arguments
    assert (buffer.kind, buffer.sent_as, buffer.donated) == (
        ArgumentKind.WRITTEN,
        "parameter",
        True,
    )
    assert (buffer.slot, buffer.argument) == (0, 1)  # after the seed among the module's arguments
    assert plan.resident == () and plan.looked_up == (buffer,) and plan.donated == (buffer,)
    assert (x.kind, x.argument) == (ArgumentKind.PLAIN, 2)
    [write] = plan.write_backs
    assert (write.position, write.result, write.part, write.deferred) == (0, 1, None, False)
    assert plan.results[1].reader == "mutation" and plan.results[1].goes is Destination.HOST
    assert dict(plan.per_call) == {
        (H2D, "argument"): 16 + 8,  # x and the seed
        (D2H, "output"): 16,
        (D2H, "mutation"): 64,
    }


def test_a_donated_plain_argument_is_not_handed_to_the_dispatch_as_host_memory():
    lowered = _module(
        {0: _spec(4)}, [_spec(4)], [OutputSlot(result=None, input=0)], mutations=((0, 0),)
    )
    plan = _plan(lowered, GraphRoles(tangent_inputs=(0,)), static_inputs=())
    # written (so never a tangent: tangents are never donated), sent on every call
    (x,) = plan.sent
    assert (x.kind, x.zeros) == (ArgumentKind.PLAIN, False)
    donated = _module(
        {0: _spec(4)},
        [_spec(4)],
        [OutputSlot(result=None, input=0)],
        mutations=((0, 0),),
        donated=(0,),
    )
    assert [a.host for a in _plan(donated).sent] == [False]


def _partial_write(x64: str = "keep") -> LoweredModule:
    """A KV cache (input 0, 32 x 8) written at two rows: result 1 is the whole new cache,
    result 2 the rows written, result 3 their indices; result 0 the graph's output."""
    return _module(
        {0: _spec(32, 8), 1: _spec(2, 8), 2: _spec(2, dtype=torch.int64)},
        [_spec(8), _spec(32, 8), _spec(2, 8), _spec(2, dtype=torch.int64)],
        [OutputSlot(result=0)],
        mutations=((0, 1),),
        partial_writes=(PartialWrite(position=0, piece=2, indices=(3,)),),
        x64=x64,
    )


def test_a_partial_write_fetches_the_part_and_leaves_the_whole_on_the_device():
    plan = _plan(_partial_write(), static_inputs=(0,))
    assert [r.goes for r in plan.results] == [
        Destination.HOST,
        Destination.DEVICE,
        Destination.HOST,
        Destination.HOST,
    ]
    assert [r.reader for r in plan.results] == ["output", "device", "mutation", "mutation"]
    [write] = plan.write_backs
    assert write.part == PartialWrite(position=0, piece=2, indices=(3,)) and not write.deferred
    assert dict(plan.per_call)[D2H, "mutation"] == 2 * 8 * 4 + 2 * 8


def test_deferred_host_sync_leaves_written_values_on_the_device():
    roles = GraphRoles(defer_host=True)
    plan = _plan(_partial_write(), roles, static_inputs=(0,))
    assert [r.goes for r in plan.results[1:]] == [Destination.DEVICE] * 3
    assert [r.deferred for r in plan.results] == [False, True, True, True]
    [write] = plan.write_backs
    assert (write.part, write.deferred) == (None, True)  # the host copy is left stale
    assert dict(plan.per_call) == {(H2D, "argument"): 64 + 16, (D2H, "output"): 32}
    # over a mesh as well: state there lives on its devices
    meshed = _plan(_partial_write(), roles, MESH, static_inputs=(0,))
    assert meshed.write_backs[0].part is None and meshed.write_backs[0].deferred


def test_a_deferred_one_element_write_is_fetched():
    # a step count (one element): eager code reads it, so its host copy is kept current
    plan = _plan(_written(_spec(1)), GraphRoles(defer_host=True))
    counter = plan.results[1]
    assert (counter.reader, counter.goes, counter.deferred) == ("deferred", Destination.HOST, False)
    assert plan.write_backs[0].deferred is False
    assert dict(plan.per_call)[D2H, "mutation"] == 4


def test_deferred_gradients_are_left_stale_unless_viewed():
    # a backward under host_sync="explicit": gradient results 0 and 1; output 2 views result 1
    lowered = _module(
        {0: _spec(4)},
        [_spec(4), _spec(2, 2)],
        [
            OutputSlot(result=0),
            OutputSlot(result=1),
            OutputSlot(result=None, view=(1, (4,), (1,), 0)),
        ],
    )
    roles = GraphRoles(saved_inputs=(0,), mirror_outputs=True, defer_host=True)
    plan = _plan(lowered, roles)
    assert [r.goes for r in plan.results] == [Destination.STALE, Destination.HOST]
    assert [r.index for r in plan.stale] == [0] and plan.published == (0, 1)
    assert dict(plan.per_call) == {(D2H, "output"): 16}


def test_a_mesh_graph_publishes_its_outputs_but_sends_its_tangents():
    lowered = _module(
        {0: _spec(8, 8), 1: _spec(8), 2: _spec(8)},
        [_spec(8), _spec(8)],
        [OutputSlot(result=0), OutputSlot(result=1)],
    )
    roles = GraphRoles(saved_inputs=(0,), tangent_inputs=(1,), saved_outputs=(1,), defer_host=True)
    plan = _plan(lowered, roles, MESH)
    # the tangent is sent as any argument: its zeros would be one device's array
    assert [a.kind for a in plan.arguments] == [
        ArgumentKind.SAVED,
        ArgumentKind.PLAIN,
        ArgumentKind.PLAIN,
    ]
    assert [a.host for a in plan.sent] == [False, False]
    # its output is a mirror for the next graph on the mesh (moved between devices if split
    # otherwise there), not sent again
    assert plan.published == (0,) and [r.index for r in plan.kept] == [1]
    assert plan.stale == () and plan.prefetched == ()


def test_results_are_prefetched_together_where_copies_cross_a_link():
    lowered = _module(
        {0: _spec(4)}, [_spec(4), _spec(4)], [OutputSlot(result=0), OutputSlot(result=1)]
    )
    assert _plan(lowered).prefetched == (0, 1)
    assert _plan(lowered, device=ZERO_COPY_CPU).prefetched == ()
    one = _module({0: _spec(4)}, [_spec(4)], [OutputSlot(result=0)])
    assert _plan(one).prefetched == ()


def test_graph_outputs_views_and_values():
    lowered = _module(
        {0: _spec(4, 4)},
        [_spec(4, 4, dtype=torch.float16)],
        [
            OutputSlot(result=0),
            OutputSlot(result=None, view=(0, (8,), (1,), 0), view_dtype=torch.int8),
            OutputSlot(result=None, input=0, view=(0, (4,), (4,), 1)),
            OutputSlot(result=None, value=3),
        ],
    )
    plan = _plan(lowered)
    assert [(r.result, r.input, r.value) for r in plan.returns] == [
        (0, None, None),
        (None, None, None),
        (None, 0, None),
        (None, None, 3),
    ]
    view_of_result, view_of_input = plan.views
    assert (view_of_result.index, view_of_result.of_input, view_of_result.base) == (1, False, 0)
    assert (view_of_result.size, view_of_result.dtype) == ((8,), torch.int8)
    assert (view_of_input.index, view_of_input.of_input, view_of_input.offset) == (2, True, 1)
