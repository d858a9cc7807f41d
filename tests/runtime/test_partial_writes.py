"""A written input's host copy is updated by the part the graph wrote, not the whole new value.

A static KV cache is written one position per decode step: the module returns the new entries
(read back from the new cache, at the indices as the device used them) and the runtime writes
them into the host tensor; the whole new cache stays on the device as its copy. Checked against
eager torch on both CPU devices after every call, read from eager code (the host tensor) and
from the next compiled graph (the device copy), with the bytes the ledger counts.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tpu_inductor
from tpu_inductor import lowering
from tpu_inductor.cache import serialize

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

DEVICES = ("cpu", "cpu-copy")


class WritesRows(nn.Module):
    """A cache of 32 rows of 8 written at positions (`index_copy_`), by index
    (`cache[index] = rows`) or in a slice (`cache[start:start + 2] = rows`)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.register_buffer("cache", torch.zeros(32, 8))

    def forward(self, rows, index):
        if self.how == "index_copy":
            self.cache.index_copy_(0, index, rows)
        elif self.how == "index_put":
            self.cache[index] = rows
        else:
            self.cache[3:5] = rows
        return self.cache.sum(0) * 1.0


def _compile(model, device: str):
    return torch.compile(model, backend="tpu_inductor", options={"device": device})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["index_copy", "index_put", "slice"])
def test_the_host_copy_gets_the_rows_written_and_equals_eager(device, how):
    model = WritesRows(how)
    reference = copy.deepcopy(model)
    compiled = _compile(model, device)
    for step in range(5):
        if step == 3:  # an eager write between calls: the next call reads it
            model.cache.add_(1.5)
            reference.cache.add_(1.5)
        rows, index = torch.randn(2, 8), torch.tensor([step, 7 + step])
        with torch.no_grad():
            torch.testing.assert_close(compiled(rows, index), reference(rows, index))
        torch.testing.assert_close(model.cache, reference.cache)  # the host tensor, eager
        if step >= 1:  # steady state: the rows written come back, not the 1 KB cache
            moved = tpu_inductor.transfers()["device_to_host"]["mutation"]
            assert moved == 2 * 8 * 4 + (0 if how == "slice" else 2 * 8)
        tpu_inductor.reset_transfers()


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_and_negative_indices_leave_host_and_device_equal(device):
    """Two writes to one row: whichever the device kept, the host holds the same; a negative
    index is the row from the end, on both."""
    model = WritesRows("index_put")
    compiled = _compile(model, device)
    read = _compile(lambda cache: cache * 1.0, device)
    with torch.no_grad():
        compiled(torch.randn(3, 8), torch.tensor([4, -1, 4]))
        on_device = read(model.cache)  # the device copy (the write-back's mirror)
    torch.testing.assert_close(model.cache, on_device)
    assert model.cache[31].abs().sum() > 0 and model.cache[4].abs().sum() > 0


def test_the_lowering_returns_the_part_and_keeps_it_through_serialization():
    gm = torch.fx.symbolic_trace(_Writes())
    inputs = [torch.zeros(32, 8), torch.randn(2, 8), torch.tensor([1, 5])]
    lowered = lowering.lower(_functional(gm, inputs), inputs)
    (write,) = lowered.partial_writes
    assert write.position == 0 and write.indices[0] is not None and write.slice is None
    assert lowered.output_specs[write.piece].shape == (2, 8)
    data = serialize.lowered_to_json(lowered)
    again = serialize.lowered_from_json(data, lowered.bytecode, lowered.text)
    assert again.partial_writes == lowered.partial_writes


class _Writes(nn.Module):
    def forward(self, cache, rows, index):
        return (cache.index_copy_(0, index, rows).sum(),)


def _functional(gm, inputs):
    """AOTAutograd's inference graph of `gm` (input writes as `copy_` into the placeholder)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def keep(graph, _inputs):
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    with torch.no_grad():
        aot_module_simplified(gm, inputs, fw_compiler=keep, keep_inference_input_mutations=True)(
            *inputs
        )
    return graphs[0]


@pytest.mark.parametrize("device", DEVICES)
def test_rows_written_at_symbolic_counts_come_back_at_their_true_size(device):
    """A graph with symbolic sizes (bucketed) writing n rows: the host gets those n rows."""

    def write(cache, rows, index):
        cache.index_copy_(0, index, rows)
        return cache.sum(0)

    cache, reference = torch.zeros(32, 4), torch.zeros(32, 4)
    compiled = torch.compile(
        write, backend="tpu_inductor", dynamic=True, options={"device": device}
    )
    for count in (3, 5, 6, 7):
        rows, index = torch.randn(count, 4), torch.arange(count) + 2 * count
        tpu_inductor.reset_transfers()
        torch.testing.assert_close(compiled(cache, rows, index), write(reference, rows, index))
        torch.testing.assert_close(cache, reference)
        moved = tpu_inductor.transfers()["device_to_host"]["mutation"]
        assert moved == count * (4 * 4 + 8)  # the rows and their int64 indices
