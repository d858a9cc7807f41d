"""Buffers a graph writes are donated: the executable updates them in place on the device.

On a device whose arrays are copies of the torch tensors ("cpu-copy" here, a TPU or GPU) a
module that writes an input (a static KV cache, batch-norm statistics) donates it: XLA aliases
the written result to the argument's buffer instead of allocating a second one and copying the
rest into it. The argument's array is gone after the call; its tensor's device copy is the
result. These tests check the executable's own memory analysis (the aliased bytes), that every
call equals eager torch with eager writes in between, and the two paths that must not read a
donated array: another tensor's array handed in (copied first) and a call that fails.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tpu_inductor
from tests.helpers import WritesBuffers
from tpu_inductor.debug import records
from tpu_inductor.runtime import compiled_graph, devices, residency

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _compile(model, device: str):
    return torch.compile(model, backend="tpu_inductor", options={"device": device})


def _written_bytes(model) -> int:
    return sum(b.numel() * b.element_size() for b in model.buffers())


def test_written_buffers_are_updated_in_place_and_equal_eager(compiled_graphs):
    model = WritesBuffers()
    reference = copy.deepcopy(model)
    compiled = _compile(model, "cpu-copy")
    for step in range(5):
        if step == 3:  # an eager write between calls: the next call must read it
            model.cache.mul_(-2)
            reference.cache.mul_(-2)
        x, position = torch.randn(8, 16), torch.tensor([step])
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, position), reference(x, position))
        for (name, b), expected in zip(model.named_buffers(), reference.buffers()):
            torch.testing.assert_close(b, expected, msg=name)
    (graph,) = compiled_graphs
    written = _written_bytes(model)
    assert graph.executable.get_compiled_memory_stats().alias_size_in_bytes == written
    record = next(r for r in reversed(records.records) if r.transfers)
    assert record.transfers["donated_bytes"] == written


def test_the_zero_copy_cpu_donates_nothing(compiled_graphs):
    """There the arrays are the torch tensors' own memory, which XLA must not take over."""
    model = WritesBuffers()
    with torch.no_grad():
        _compile(model, "cpu")(torch.randn(8, 16), torch.tensor([0]))
    (graph,) = compiled_graphs
    assert graph.lowered.donated == ()
    assert graph.executable.get_compiled_memory_stats().alias_size_in_bytes == 0


def test_the_zero_copy_cpu_under_explicit_host_sync_donates_the_arrays_xla_owns(compiled_graphs):
    """Under host_sync="explicit" a written buffer's current values are XLA's own array after
    the first call (the host tensor left stale): later calls update it in place, as a TPU's
    would (measured 2026-12-07 on issue 38's Llama: the optimizer steps after the first no
    longer raise the peak RSS, 3,146 → 3,054 MiB). An argument that reads a torch tensor's
    memory (the first call's, one after a sync and an eager write) is copied first: XLA
    never takes torch's memory over (donated, jaxlib 0.10.2 aborts the process at exit)."""
    model = WritesBuffers()
    reference = copy.deepcopy(model)
    options = {"device": "cpu", "host_sync": "explicit"}
    compiled = torch.compile(model, backend="tpu_inductor", options=options)
    for step in range(5):
        if step == 3:  # brought home, written eagerly: the next call sends it again
            tpu_inductor.sync(model)
            model.cache.mul_(-2)
            reference.cache.mul_(-2)
        x, position = torch.randn(8, 16), torch.tensor([step])
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, position), reference(x, position))
    tpu_inductor.sync(model)
    for (name, b), expected in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, expected, msg=name)
    (graph,) = compiled_graphs
    assert graph.executable.get_compiled_memory_stats().alias_size_in_bytes == (
        _written_bytes(model)
    )


def test_a_graph_that_writes_a_buffer_sees_every_earlier_write_with_two_graphs(compiled_graphs):
    """Two graphs write one buffer in turn (a prefill and a decode step): each takes the device
    copy the other's donated call left, never a deleted one."""
    cache = torch.zeros(4, 8)

    def prefill(cache, x):
        cache[:2].copy_(x)
        return cache.sum(0)

    def decode(cache, x, position):
        cache.index_copy_(0, position, x)
        return cache.sum(0)

    first, step = _compile(prefill, "cpu-copy"), _compile(decode, "cpu-copy")
    expected = cache.clone()
    for i in range(3):
        x, y = torch.randn(2, 8), torch.randn(1, 8)
        torch.testing.assert_close(first(cache, x), prefill(expected, x))
        position = torch.tensor([2 + i % 2])
        torch.testing.assert_close(step(cache, y, position), decode(expected, y, position))
        torch.testing.assert_close(cache, expected)
    assert [g.lowered.donated for g in compiled_graphs] == [(0,), (0,)]


def _writes_its_input():
    """A CompiledGraph of `x.add_(1); return x * 2` on cpu-copy, made directly."""
    from tpu_inductor import lowering

    def f(x):
        x.add_(1)
        return x * 2

    gm = torch.fx.experimental.proxy_tensor.make_fx(
        torch.func.functionalize(f, remove="mutations_and_views")
    )(torch.zeros(4))
    device = devices.select_device("cpu-copy")
    lowered = lowering.lower(gm, [torch.zeros(4)], donate_writes=True)
    assert lowered.donated == (0,)
    return compiled_graph.CompiledGraph(devices.compile_module(lowered, device), lowered, device)


def test_a_device_tensor_handed_to_a_donating_graph_keeps_its_array():
    graph = _writes_its_input()
    array = graph._transfer.to_device(torch.arange(4.0))
    kept = residency.DeviceTensor(
        array, (4,), torch.float32, graph._transfer.to_torch, graph._transfer.key
    )
    (out,) = graph([kept])
    assert torch.equal(out, (torch.arange(4.0) + 1) * 2)
    assert not array.is_deleted()
    assert torch.equal(kept.host(), torch.arange(4.0) + 1)  # written back, as any input


def _failing(arrays):
    """An execution that takes its donated arguments, then fails (out of memory)."""
    arrays[0].delete()
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")


def test_a_failed_call_leaves_no_deleted_array_as_the_current_copy():
    graph = _writes_its_input()
    x = torch.zeros(4)
    graph([x])
    assert residency.mirrors.get(x, graph._transfer.key) is not None  # the written copy
    run, graph._run = graph._run, _failing
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        graph([x])
    assert residency.mirrors.get(x, graph._transfer.key) is None
    graph._run = run
    tpu_inductor.reset_transfers()
    (out,) = graph([x])  # the host tensor, unwritten by the failed call, is sent again
    assert torch.equal(x, torch.full((4,), 2.0)) and torch.equal(out, torch.full((4,), 4.0))
