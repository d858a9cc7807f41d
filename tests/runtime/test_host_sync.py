"""options={"host_sync": "explicit"}: written state and gradients stay on the device.

Every test runs on the zero-copy CPU device and on "cpu-copy" (every crossing a copy, as on an
accelerator). What a test checks on the host it reads after `tpu_inductor.sync()`; before it,
every stale tensor must raise the error that names the sync, never give its old values.
"""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import tpu_inductor
from tests import hf_zoo
from tests.helpers import forget_compiles
from tpu_inductor.runtime import devices

DEVICES = ["cpu", "cpu-copy"]
STALE = "call tpu_inductor.sync()"


@pytest.fixture(autouse=True)
def _fresh():
    """Own graphs per test; nothing left stale for the next one."""
    torch._dynamo.reset()
    yield
    tpu_inductor.sync()


def _compile(fn, device: str):
    options = {"device": device, "host_sync": "explicit"}
    return torch.compile(fn, backend="tpu_inductor", dynamic=False, options=options)


def _trained(model: nn.Module, device: str, lr: float) -> tuple:
    """(eager copy of `model`, AdamW of each, the compiled forward, the compiled step)."""
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=lr, foreach=False)
    forward, step = _compile(model, device), _compile(optimizer.step, device)
    return reference, optimizer, reference_optimizer, forward, step


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _raises_stale(read) -> None:
    with pytest.raises(RuntimeError, match=r"tpu_inductor\.sync\(\)"):
        read()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_training_step_moves_the_batch_and_the_loss(name, device):
    """20 AdamW steps equal eager's. In the steady state the step sends the token ids and the
    loss's gradient and brings home the outputs (loss, logits) and AdamW's step counters (4
    bytes each): parameters, gradients, moments and saved activations move 0 bytes. A sync
    brings home exactly the parameters and both moments, and the steps after it still send
    nothing (the sync keeps the tensors' versions: the device copies stay current)."""
    model, inputs = hf_zoo.build(name)
    model.train()
    reference, optimizer, reference_optimizer, forward, step = _trained(model, device, 1e-3)
    labels = inputs["input_ids"]
    parameters = list(model.parameters())
    for i in range(20):
        tpu_inductor.reset_transfers()
        out = forward(**inputs, labels=labels)
        out.loss.backward()
        step()
        optimizer.zero_grad(set_to_none=True)
        expected = reference(**inputs, labels=labels).loss
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        torch.testing.assert_close(out.loss.detach(), expected.detach(), rtol=1e-5, atol=0)
        moved = tpu_inductor.transfers()
        if i == 10:
            synced = tpu_inductor.sync()
            assert synced == 3 * _nbytes(parameters)  # weights, exp_avg, exp_avg_sq
        if i >= 2:
            assert moved["host_to_device"] == {
                "argument": _nbytes([labels]) + 4,
                "parameter": 0,
                "saved": 0,
            }, moved
            outputs = _nbytes([out.loss, out.logits])
            assert moved["device_to_host"] == {
                "output": outputs,
                "saved": 0,
                "mutation": 4 * len(parameters),
                "materialized": 0,
                "synced": 0,
            }, moved
    _raises_stale(lambda: parameters[0].sum())
    tpu_inductor.sync()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=n)
    state = optimizer.state_dict()["state"]
    for index, q in enumerate(reference.parameters()):
        expected = reference_optimizer.state[q]["exp_avg"]
        torch.testing.assert_close(state[index]["exp_avg"], expected, rtol=1e-4, atol=1e-6)


def _norm_model():
    # (no bias before the norm: its gradient is 0 up to rounding, which Adam amplifies)
    return nn.Sequential(nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16), nn.Linear(16, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_every_stale_tensor_raises_until_synced_then_reads_current(device):
    """A parameter, a buffer a forward wrote, a gradient, AdamW's moments and a checkpoint
    save each raise before the sync (an eager write too, leaving the values as they were);
    one-element state (counters) reads current all along. `sync(model)` brings the model home
    and leaves the optimizer stale; `sync(optimizer)` the rest; both equal eager."""
    torch.manual_seed(0)
    model = _norm_model()
    reference, optimizer, reference_optimizer, forward, step = _trained(model, device, 1e-2)
    for i in range(3):
        x = torch.randn(8, 16)
        forward(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        if i < 2:
            step()
            optimizer.zero_grad(set_to_none=True)
            reference_optimizer.step()
            reference_optimizer.zero_grad(set_to_none=True)
    weight, norm = model[0].weight, model[1]
    moments = optimizer.state[weight]
    for read in (
        lambda: weight.sum(),
        lambda: norm.running_mean.clone(),
        lambda: print(weight.grad),
        lambda: moments["exp_avg"].norm(),
        lambda: torch.save(model.state_dict(), io.BytesIO()),
        lambda: weight.detach().view(-1)[0].item(),
    ):
        _raises_stale(read)
    with pytest.raises(RuntimeError, match="a gradient a compiled backward returned"):
        weight.grad.numpy()
    with torch.no_grad():
        _raises_stale(lambda: weight.mul_(0))
    assert norm.num_batches_tracked.item() == 3
    assert moments["step"].item() == 2
    tpu_inductor.sync(model)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    _raises_stale(lambda: moments["exp_avg"].sum())
    tpu_inductor.sync(optimizer)
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    saved.seek(0)
    loaded = torch.load(saved)["state"]
    expected = reference_optimizer.state_dict()["state"]
    for index, state in loaded.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                state[key], expected[index][key], rtol=1e-4, atol=1e-6, msg=key
            )


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_accumulated_over_two_backward_calls_raise_and_keep_the_first(device):
    """Eager autograd adds a second backward's gradients on the host, which the stale ones
    cannot be: it raises (naming host_sync="each_call"), and the first gradients stay intact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    forward = _compile(model, device)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    forward(x).sum().backward()
    with pytest.raises(
        RuntimeError, match="accumulate gradients that way on one device, compile with"
    ):
        forward(y).sum().backward()
    reference(x).sum().backward()
    tpu_inductor.sync()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_the_static_cache_stays_on_the_device_through_generate(device, monkeypatch):
    """The static-cache recipe (mode="reduce-overhead") under host_sync="explicit": eager's
    tokens; the cache never crosses, each way (only its one-element length counters come
    home, which generate reads); read before a sync it raises, after it equals eager's."""
    monkeypatch.setenv("TPU_INDUCTOR_DEVICE", device)
    monkeypatch.setenv("TPU_INDUCTOR_HOST_SYNC", "explicit")
    model, inputs = hf_zoo.build("llama")
    prompt = inputs["input_ids"][:1]
    how = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    expected = model.generate(prompt, **how, return_dict_in_generate=True)
    model.forward = torch.compile(
        model.forward, backend="tpu_inductor", mode="reduce-overhead", fullgraph=True
    )
    model.generate(prompt, **how)
    tpu_inductor.sync()  # (the first generate's cache)
    tpu_inductor.reset_transfers()
    generated = model.generate(prompt, **how, return_dict_in_generate=True)
    assert torch.equal(generated.sequences, expected.sequences)
    moved = tpu_inductor.transfers()
    layers = generated.past_key_values.layers
    cache = [t for layer in layers for t in (layer.keys, layer.values)]
    # the decode steps' mutations: one 8-byte counter per layer and call
    assert moved["calls"] == 6 and moved["device_to_host"]["mutation"] <= 6 * 8 * len(layers)
    assert moved["host_to_device"]["parameter"] < 64
    _raises_stale(lambda: cache[0].sum())
    assert tpu_inductor.sync() == _nbytes(cache)
    expected_cache = [t for x in expected.past_key_values.layers for t in (x.keys, x.values)]
    for value, reference in zip(cache, expected_cache):
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6)


class _WritesAView(nn.Module):
    """A buffer that is a view into a larger storage, and a one-element counter."""

    def __init__(self):
        super().__init__()
        self.register_buffer("whole", torch.zeros(8, 4))
        self.part = self.whole[2:6]
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.part.add_(x)
        self.count.add_(1)
        return x * 2


@pytest.mark.parametrize("device", DEVICES)
def test_a_written_view_of_a_larger_storage_is_written_on_the_host(device):
    """Only a tensor that is its whole storage is left stale: a view is brought up to date
    each call (counted), as is a one-element tensor; both read current without a sync."""
    module, reference = _WritesAView(), _WritesAView()
    compiled = _compile(module, device)
    for _ in range(3):
        x = torch.randn(4, 4)
        tpu_inductor.reset_transfers()
        torch.testing.assert_close(compiled(x), reference(x))
        torch.testing.assert_close(module.whole, reference.whole)
        assert module.count.item() == reference.count.item()
    assert tpu_inductor.transfers()["device_to_host"]["mutation"] == 4 * 4 * 4 + 4


def test_sync_takes_tensors_modules_and_optimizers_only():
    assert tpu_inductor.sync() == 0
    assert tpu_inductor.sync(torch.ones(3), nn.Linear(2, 2)) == 0
    with pytest.raises(TypeError, match="tensors, modules and optimizers; got int"):
        tpu_inductor.sync(42)


def test_without_a_compiler_it_warns_and_brings_host_copies_up_to_date(tmp_path):
    """Where the stale mark cannot be built (no C++ compiler), the option warns once and the
    host copies are current after each call, as with host_sync="each_call"."""
    script = textwrap.dedent(
        """
        import torch, torch.nn as nn, tpu_inductor
        from tpu_inductor.runtime import host_sync
        host_sync._torch_marks = lambda: None  # the shim's road, also on a CUDA build of torch
        model = nn.Linear(4, 4)
        reference = nn.Linear(4, 4)
        reference.load_state_dict(model.state_dict())
        options = {"device": "cpu-copy", "host_sync": "explicit", "cache": False}
        f = torch.compile(model, backend="tpu_inductor", options=options)
        f(torch.ones(2, 4)).sum().backward()
        reference(torch.ones(2, 4)).sum().backward()
        torch.testing.assert_close(model.weight.grad, reference.weight.grad)
        print("ok")
        """
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-compiler"), "XDG_CACHE_HOME": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
    assert run.stderr.count("host_sync='explicit' needs to mark host storages stale") == 1


@pytest.mark.parametrize("clear", [0, 1], ids=["torch_2_13", "before_2_13"])
def test_each_shim_marks_a_storage_and_clears_it_with_its_values(clear, tmp_path):
    """Both clears of the C++ shim (torch 2.13's method; the private flag a torch 2.11 has)
    build against this torch's header, and each leaves a marked storage raising on reads and
    writes, then readable with its values after the clear."""
    import ctypes

    from tpu_inductor.runtime import host_sync

    source = host_sync._MARK + host_sync._CLEARS[clear]
    library = ctypes.CDLL(str(host_sync._compiled(source, host_sync._library(source, tmp_path))))
    library.tpu_inductor_mark_stale.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    library.tpu_inductor_clear_stale.argtypes = [ctypes.c_void_p]
    tensor = torch.arange(6.0)
    key = tensor.untyped_storage()._cdata
    library.tpu_inductor_mark_stale(key, b"stale here")
    with pytest.raises(RuntimeError, match="stale here"):
        tensor.sum()
    with pytest.raises(RuntimeError, match="stale here"):
        tensor.add_(1)
    library.tpu_inductor_clear_stale(key)
    torch.testing.assert_close(tensor, torch.arange(6.0))
    tensor.add_(1)  # writable again
    assert tensor.sum().item() == 21.0


@pytest.mark.parametrize("device", DEVICES)
def test_arguments_go_as_numpy_views_beside_stale_state_and_stale_ones_as_device_values(device):
    """With state left stale (a compiled step wrote it), a plain host argument still crosses as
    a numpy view for jax's C++ fast path; a stale tensor never does (its host memory raises):
    it is the device array holding its current values."""
    import numpy as np

    from tpu_inductor.runtime import devices, transfer
    from tpu_inductor.runtime.host_sync import host_sync

    model = nn.Linear(4, 4)
    _compile(model, device)(torch.ones(2, 4)).sum().backward()
    assert model.weight.grad is not None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _compile(optimizer.step, device)()
    moves = transfer.Transfer(devices.select_device(device))
    assert moves.argument(torch.ones(3)).__class__ is np.ndarray
    weight = model.weight.detach()  # (no grad to require: only its staleness sends it otherwise)
    assert host_sync.is_stale(weight)
    stale = moves.argument(weight)
    assert stale.__class__ is not np.ndarray
    tpu_inductor.sync()
    torch.testing.assert_close(torch.from_numpy(np.asarray(stale)), model.weight.detach())


def test_reduce_overhead_means_explicit_sync_unless_told(monkeypatch):
    from tpu_inductor.config import Options

    assert Options.from_user().host_sync == "each_call"
    assert Options.from_user(None, "max-autotune").host_sync == "each_call"
    assert Options.from_user(None, "reduce-overhead").host_sync == "explicit"
    monkeypatch.setenv("TPU_INDUCTOR_HOST_SYNC", "each_call")
    assert Options.from_user(None, "reduce-overhead").host_sync == "each_call"


@torch.library.custom_op("tpu_inductor_test::host_sync_scaled", mutates_args=())
def _scaled(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An op without a lowering rule: the split graph runs it in eager torch."""
    return x * weight.sum()


@_scaled.register_fake
def _(x, weight):
    return torch.empty_like(x)


def _scaled_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    return grad * weight.sum(), (grad * x).sum() * torch.ones_like(weight)


_scaled.register_autograd(
    _scaled_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs)
)


class _EagerOpModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        return _scaled(self.linear(x), self.linear.weight)


@pytest.mark.parametrize("device", DEVICES)
def test_eager_ops_of_a_split_graph_read_current_values(device):
    """An op without a rule, run by eager torch inside the compiled graph, reads a weight a
    compiled AdamW step left stale: the split graph brings it home first (counted as synced),
    and the results equal eager's."""
    torch.manual_seed(0)
    model = _EagerOpModel()
    reference, optimizer, reference_optimizer, forward, step = _trained(model, device, 1e-2)
    for i in range(3):
        x = torch.randn(3, 6)
        tpu_inductor.reset_transfers()
        out = forward(x)
        expected = reference(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        if i > 0:  # the weight the previous step wrote (not the bias: no eager op reads it)
            assert tpu_inductor.transfers()["device_to_host"]["synced"] == 6 * 6 * 4
        out.pow(2).mean().backward()
        expected.pow(2).mean().backward()
        step()
        reference_optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference_optimizer.zero_grad(set_to_none=True)


def test_a_graph_run_by_eager_torch_reads_current_values(monkeypatch):
    """A graph PJRT could not compile runs in eager torch (fallback="eager"): the weights a
    compiled step left stale are brought home before it reads them."""
    from tpu_inductor.exc import CompileError

    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    options = {"device": "cpu-copy", "host_sync": "explicit", "cache": False}
    step = torch.compile(optimizer.step, backend="tpu_inductor", options=options)
    x = torch.randn(4, 5)
    model(x).sum().backward()
    step()
    with torch.no_grad():
        reference.weight -= 0.5 * torch.ones(3, 1) * x.sum(0)
        reference.bias -= 0.5 * 4
    _raises_stale(lambda: model.weight.sum())

    def fails(_module, _device):
        raise CompileError("PJRT failed (a test)")

    monkeypatch.setattr(devices, "compile_stablehlo", fails)
    forget_compiles()  # another test in this worker may have compiled the same graph
    forward = torch.compile(lambda t: model(t) * 2, backend="tpu_inductor", options=options)
    torch.testing.assert_close(forward(x), reference(x) * 2)
    torch.testing.assert_close(model.weight, reference.weight)  # home: no longer stale


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="madvise gives pages back on Linux"
)
def test_a_stale_storage_gives_its_memory_back_and_a_sync_brings_the_values_home():
    """Left stale, a 64 MiB tensor's host pages go back to the system (the process's resident
    memory falls by about as much, the ledger's held bytes to the two partial end pages at
    most); shared memory (another process may map it) is kept; a sync writes the values back."""
    import jax
    import numpy as np

    from tpu_inductor.runtime.host_sync import host_sync

    device = devices.select_device("cpu-copy")
    values = torch.randn(16, 1024, 1024)
    tensor = values.clone()
    array = jax.device_put(values.numpy(), device.device)
    to_host = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    before = _resident()
    assert host_sync.defer(tensor, array, device.key, to_host)
    given_back = before - _resident()
    assert given_back >= 60 * 2**20, given_back
    assert host_sync.resident_bytes(tensor) <= 2 * 4096
    _raises_stale(tensor.sum)
    assert tpu_inductor.sync(tensor) == values.numel() * 4
    torch.testing.assert_close(tensor, values, rtol=0, atol=0)
    assert host_sync.resident_bytes(tensor) == values.numel() * 4

    shared = torch.ones(1024, 1024).share_memory_()  # another process may map it: kept
    assert host_sync.defer(
        shared, jax.device_put(np.ones((1024, 1024), np.float32)), device.key, to_host
    )
    assert host_sync.resident_bytes(shared) == 4 * 2**20
    tpu_inductor.sync(shared)
