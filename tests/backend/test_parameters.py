"""Parameters the compiled graph keeps on the device: one set per module instance, freed with
the model, following in-place changes and writes that bypass the version counter, sent once
rather than per call.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
import torch.nn as nn

from tests.helpers import assert_same, compile_tpu, grads_of
from tpu_inductor.runtime import ledger, transfer

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_threads_calling_two_instances_of_one_module_each_get_their_own_parameters():
    """Dynamo compiles the class's forward once; its graph serves both instances, whose
    parameters it holds resident: one thread's refresh must not feed the other's call."""
    import threading

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)) for _ in range(2)]
    compiled = [compile_tpu(m) for m in models]
    x = torch.randn(4, 32)
    with torch.no_grad():
        expected = [m(x) for m in models]
        for c in compiled:
            c(x)  # compiled before the threads start
    wrong = [0, 0]

    def work(i):
        with torch.no_grad():
            for _ in range(300):
                wrong[i] += not torch.allclose(compiled[i](x), expected[i], atol=1e-5)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [0, 0]


def test_a_deleted_model_frees_its_parameters():
    """Resident parameters are not kept alive by the compiled graph (nor is their memory)."""
    import weakref

    def run():
        model = nn.Linear(64, 64)
        with torch.no_grad():
            compile_tpu(model)(torch.randn(2, 64))
        return weakref.ref(model.weight)

    weight = run()
    gc.collect()
    assert weight() is None


def _update_in_place(model):
    model.weight.mul_(3)
    model.bias.add_(1)


def _replace_storage(model):
    model.weight.data = torch.randn(4, 4)  # same object and version, another storage


@pytest.mark.parametrize("change", [_update_in_place, _replace_storage])
def test_resident_parameters_follow_changes(change):
    model = nn.Linear(4, 4)
    compiled = compile_tpu(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        compiled(x)
        change(model)
        assert_same(compiled(x), model(x))


def test_training_forward_saves_no_transposed_weight(compiled_graphs):
    """Saved tensors are module results, which XLA materializes: `weight.t()` must be recomputed
    in the backward (a view), not saved; parameters saved for it pass through uncopied."""
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    loss = compile_tpu(model)(x).sum()
    forward = compiled_graphs[0].lowered
    result_shapes = {spec.shape for spec in forward.output_specs}
    assert not result_shapes & {(8, 16), (16, 4)}, result_shapes  # the weights' transposes
    assert any(slot.input is not None for slot in forward.outputs)
    expected = grads_of(model, model(x).sum())
    model.zero_grad()
    assert_same(grads_of(model, loss), expected)


def _count_transfers(monkeypatch) -> list[tuple[int, ...]]:
    sent: list[tuple[int, ...]] = []
    to_device = transfer.Transfer.to_device

    def counting(self, tensor, sharding=None):
        sent.append(tuple(tensor.shape))
        return to_device(self, tensor, sharding)

    argument = transfer.Transfer.argument

    def counting_host_arrays(self, tensor):  # sent by jax's C++ fast path
        array = argument(self, tensor)
        if isinstance(array, np.ndarray):
            sent.append(tuple(tensor.shape))
        return array

    monkeypatch.setattr(transfer.Transfer, "to_device", counting)
    monkeypatch.setattr(transfer.Transfer, "argument", counting_host_arrays)
    return sent


def _copying_transfers(monkeypatch) -> None:
    """Transfers as on an accelerator: every array a copy (device_put), none reads torch's memory."""
    init = transfer.Transfer.__init__

    def copying(self, device):
        init(self, device)
        self.on_cpu = False

    monkeypatch.setattr(transfer.Transfer, "__init__", copying)


@pytest.mark.parametrize("copies", [False, True], ids=["cpu_zero_copy", "accelerator_copies"])
def test_parameters_are_transferred_once_not_per_call(monkeypatch, copies):
    if copies:
        _copying_transfers(monkeypatch)
    sent = _count_transfers(monkeypatch)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])  # 10 parameters
    compiled = compile_tpu(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        compiled(x)
        first = len(sent)
        sent.clear()
        assert_same(compiled(x), model(x))
        assert first >= 11 and sent == [(2, 4)], sent  # second call: only the activation
        model[0].weight.add_(1)  # sent again (a new version): zero-copy, a new view of it
        sent.clear()
        ledger.reset()
        assert_same(compiled(x), model(x))
        assert sorted(sent) == [(2, 4), (4, 4)], sent
        assert ledger.transfers()["host_to_device"]["parameter"] == 4 * 4 * 4
        model[1].weight.data = torch.randn(4, 4)  # another storage: sent again either way
        sent.clear()
        assert_same(compiled(x), model(x))
        assert sorted(sent) == [(2, 4), (4, 4)], sent


def _write_through_data(model):
    model[0].weight.data.mul_(2)  # bypasses the version counter


def _write_flat_buffer(model):
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    torch.nn.utils.vector_to_parameters(flat, model.parameters())  # misaligned views of flat
    return flat


def test_cpu_parameters_see_writes_that_bypass_the_version_counter():
    """Zero-copy arrays read the memory; copies (channels_last, misaligned views) are re-sent."""
    conv = nn.Sequential(nn.Conv2d(3, 4, 3)).to(memory_format=torch.channels_last)
    linear = nn.Sequential(nn.Linear(3, 3))
    flat = _write_flat_buffer(linear)
    x, y = torch.randn(1, 3, 5, 5), torch.randn(2, 3)
    compiled_conv, compiled_linear = compile_tpu(conv), compile_tpu(linear)
    with torch.no_grad():
        compiled_conv(x), compiled_linear(y)
        _write_through_data(conv)
        _write_through_data(linear)
        flat.add_(1.0)
        assert_same(compiled_conv(x), conv(x))
        assert_same(compiled_linear(y), linear(y))


@pytest.mark.parametrize("copies", [False, True], ids=["cpu_zero_copy", "accelerator_copies"])
def test_inference_tensor_parameters(monkeypatch, copies):
    """Parameters made under inference_mode have no version counter."""
    if copies:
        _copying_transfers(monkeypatch)
    with torch.inference_mode():
        model = nn.Linear(4, 4)
        x = torch.randn(2, 4)
        assert_same(compile_tpu(model)(x), model(x))
