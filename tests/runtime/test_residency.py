"""Data stays on the device: saved activations, parameters and written state do not round-trip.

Every test runs on the zero-copy CPU device and on "cpu-copy", where every crossing is a copy
as on an accelerator: a missed write-back or a stale device copy gives a wrong number there.
The transfer ledger (tpu_inductor.transfers) counts bytes as an accelerator pays them.
"""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
import torch.nn as nn

import tpu_inductor
from tests import hf_zoo
from tests.helpers import WritesBuffers
from tpu_inductor.debug import report
from tpu_inductor.runtime import buckets, compiled_graph
from tpu_inductor.runtime.residency import DeviceTensor

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

DEVICES = ["cpu", "cpu-copy"]


def _compile(fn, device: str, dynamic: bool = False):
    """Sizes static unless asked: Dynamo would make a model's sizes dynamic once another test
    ran the same code at other sizes (bucketed graphs are tested on their own below)."""
    return torch.compile(fn, backend="tpu_inductor", dynamic=dynamic, options={"device": device})


def _steady(step, calls: int = 2) -> dict:
    """The ledger of the last of `calls` calls of `step()` (the first ones compile)."""
    for _ in range(calls):
        tpu_inductor.reset_transfers()
        step()
    return tpu_inductor.transfers()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_training_with_a_compiled_optimizer_step_keeps_state_on_the_device(name, device):
    """20 AdamW steps equal eager's; in the steady state no parameter, optimizer state, saved
    activation or gradient crosses to the device, and no saved activation comes back to the
    host."""
    model, inputs = hf_zoo.build(name)
    model.train()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    forward, step = _compile(model, device), _compile(optimizer.step, device)
    labels = inputs["input_ids"]
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for i in range(20):
        tpu_inductor.reset_transfers()
        loss = forward(**inputs, labels=labels).loss
        loss.backward()
        step()
        optimizer.zero_grad(set_to_none=True)
        expected = reference(**inputs, labels=labels).loss
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
        if i >= 2:
            moved = tpu_inductor.transfers()
            assert moved["host_to_device"]["parameter"] == 0, moved
            assert moved["host_to_device"]["saved"] == 0, moved
            # the gradients the backward returned are not sent again to the optimizer step
            assert moved["host_to_device"]["argument"] < parameter_bytes / 10, moved
            # the token ids and the loss's gradient, 1.0; not the zeros autograd makes for the
            # logits' gradient (the loss alone is backward'ed)
            ids = labels.numel() * labels.element_size()
            assert moved["host_to_device"]["argument"] == ids + 4, moved
            assert moved["device_to_host"]["saved"] == 0, moved
            assert moved["device_to_host"]["materialized"] == 0, moved
    # Adam divides by the root of tiny second moments: rounding differences in near-zero
    # gradients (biases) move a weight by up to ~2e-5 in 20 steps, with an eager step as well.
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=n)
    state = optimizer.state_dict()["state"]  # current on the host after compiled steps
    for index, q in enumerate(reference.parameters()):
        expected = reference_optimizer.state[q]["exp_avg"]
        torch.testing.assert_close(state[index]["exp_avg"], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_a_zero_output_gradient_is_sent_once_and_others_every_time(device):
    """A forward returning (loss, logits), trained on the loss: autograd hands the backward
    zeros for the logits' gradient on every step; the device keeps zeros of its own. A step
    that does differentiate the logits sends them, and every step's gradients equal eager's."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 32))
    reference = copy.deepcopy(model)

    def forward(module, x):
        logits = module(x)
        return logits.square().mean(), logits

    compiled = _compile(lambda x: forward(model, x), device)
    x, weights = torch.randn(4, 8), torch.randn(4, 32)
    logits_bytes = 4 * 32 * 4
    for step in range(6):
        tpu_inductor.reset_transfers()
        for run in (compiled, lambda x: forward(reference, x)):
            loss, logits = run(x)
            (loss + (logits * weights).sum() if step == 3 else loss).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
            p.grad = q.grad = None
        sent = tpu_inductor.transfers()["host_to_device"]["argument"]
        if step >= 1:  # x and the loss's gradient; the logits' only where they are not zeros
            assert sent == x.numel() * 4 + 4 + (logits_bytes if step == 3 else 0)


@pytest.mark.parametrize("device", DEVICES)
def test_the_kept_zeros_are_not_a_view_of_the_first_zero_gradient(device):
    """The zeros a backward keeps are its own: writing the tensor they were made from later (a
    gradient the user passed to `backward`) does not change them (zero-copy CPU included)."""
    model = nn.Linear(4, 3)
    compiled = _compile(model, device)
    x = torch.randn(2, 4)
    first = torch.zeros(2, 3)
    compiled(x).backward(first)
    first.fill_(7.0)  # the user's tensor, written after the call
    model.weight.grad = None
    compiled(x).backward(torch.zeros(2, 3))
    assert not model.weight.grad.any()


@pytest.mark.parametrize("device", DEVICES)
def test_values_crossing_a_graph_break_reach_the_next_graph_on_the_device(device):
    """Across a graph break the second graph takes the first's output, and the first graph's
    backward the gradient the second's backward returns, from the device: neither is sent."""
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
    reference = copy.deepcopy(model)

    def forward(module, x):
        h = module[1](module[0](x))
        torch._dynamo.graph_break()
        return module[2](h).square().sum()

    compiled = _compile(lambda x: forward(model, x), device)
    x = torch.randn(16, 8)
    for _ in range(3):
        tpu_inductor.reset_transfers()
        compiled(x).backward()
        forward(reference, x).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
            p.grad = q.grad = None
    # sent: x and the loss's gradient; not the hidden state into the second forward (the
    # break's eager code reads it on the host, the device keeps its copy), nor its gradient
    # into the first backward
    moved = tpu_inductor.transfers()
    assert moved["host_to_device"]["argument"] == x.numel() * 4 + 4, moved


@pytest.mark.parametrize("device", DEVICES)
def test_saved_activations_stay_on_the_device_and_equal_eager(device):
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    compiled = _compile(model, device)
    x = torch.randn(8, 16)

    def step():
        compiled(x).square().sum().backward()

    moved = _steady(step)
    reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad / 2, q.grad)  # two backward calls accumulated
    assert moved["host_to_device"]["saved"] == 0 and moved["device_to_host"]["saved"] == 0
    assert moved["device_to_host"]["materialized"] == 0
    # What crosses: x and the output's gradient in, the output and the gradients out.
    grads = sum(p.numel() * 4 for p in model.parameters())
    assert moved["host_to_device"]["argument"] == x.numel() * 4 + 8 * 4 * 4
    assert moved["device_to_host"]["output"] == 8 * 4 * 4 + grads


def _kept_on_device(output: torch.Tensor) -> list[DeviceTensor]:
    """The saved activations of the compiled graph that made `output` that are DeviceTensors."""
    node = output.grad_fn
    while "CompiledFunction" not in type(node).__name__:
        node = node.next_functions[0][0]
    return [t for t in node.saved_tensors if type(t) is DeviceTensor]


@pytest.mark.parametrize("device", DEVICES)
def test_a_bucketed_graph_keeps_its_saved_activations_padded_on_the_device(device):
    """Symbolic sizes, bucketed: the forward's saved activations stay padded on the device and
    the backward of the same bucket takes them as they are (none crosses to the host)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    compiled = _compile(model, device, dynamic=True)
    for rows in (5, 7, 6):  # one pow2 bucket, 8
        x = torch.randn(rows, 16)
        model.zero_grad()
        reference.zero_grad()
        tpu_inductor.reset_transfers()
        compiled(x).square().sum().backward()
        moved = tpu_inductor.transfers()
        reference(x).square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        assert (
            moved["device_to_host"]["saved"] == 0 and moved["device_to_host"]["materialized"] == 0
        )
        # What still crosses back: the padded copy of x the backward makes (x is returned by
        # the forward as a saved input, sliced to its true size on the host).
        assert moved["host_to_device"]["saved"] <= 8 * 16 * 4, moved
    assert [b["buckets"] for b in buckets.report() if b["symbols"]][-1]


@pytest.mark.parametrize("device", DEVICES)
def test_a_saved_activation_read_by_eager_code_gives_its_values(device):
    """Eager code that reads a saved activation kept on the device gets its values (copied to
    the host once, counted), and the backward that follows stays right."""
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    reference = copy.deepcopy(model)
    compiled = _compile(model, device)
    x = torch.randn(5, 6)
    out = compiled(x)
    kept = _kept_on_device(out)
    assert kept
    tpu_inductor.reset_transfers()
    expected_hidden = torch.tanh(reference[0](x))
    assert any(torch.allclose(t * 1, expected_hidden, atol=1e-6) for t in kept)  # eager reads
    moved = tpu_inductor.transfers()
    assert moved["device_to_host"]["materialized"] == sum(t.numel() * 4 for t in kept)
    out.sum().backward()  # the backward takes the arrays, not the host copies
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_device_tensor_reads_as_its_values():
    compiled = _compile(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), "cpu-copy")
    kept = _kept_on_device(compiled(torch.randn(2, 3)))[0]
    values = kept.host()
    assert type(values) is torch.Tensor and values.shape == kept.shape
    assert torch.equal(kept + 0, values) and torch.equal(kept.clone(), values)
    buffer = io.BytesIO()
    torch.save(kept, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer), values)
    assert "DeviceTensor(" in repr(kept)
    assert (kept.numpy() == values.numpy()).all() and kept.tolist() == values.tolist()
    assert kept.data_ptr() == 0  # no host memory to point at, never a stale address


def test_the_mirrors_identity_map_keys_by_identity_and_forgets_dead_keys():
    """Mirrors' map: equal tensors are other keys, a value replaced keeps one entry, a key
    that dies drops its entry (a new tensor at its address finds nothing), pop and clear."""
    import gc

    from tpu_inductor.runtime.residency import WeakIdentityMap

    table = WeakIdentityMap()
    a, b = torch.zeros(3), torch.zeros(3)
    table[a] = "a"
    table[a] = "a2"
    table[b] = "b"
    assert (table.get(a), table.get(b), len(table)) == ("a2", "b", 2)
    assert a in table and torch.zeros(3) not in table and table.get(torch.ones(1)) is None
    del a
    gc.collect()
    assert len(table) == 1 and all(table.get(torch.zeros(3)) is None for _ in range(50))
    assert table.pop(b) == "b" and table.pop(b, "gone") == "gone" and len(table) == 0
    c = torch.ones(2)
    table[c] = "c"
    table.clear()
    assert c not in table and len(table) == 0
    del c
    gc.collect()  # (its callback finds no entry to drop)
    assert len(table) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_buffers_written_by_a_graph_are_current_and_not_sent_again(device):
    model = WritesBuffers()
    reference = copy.deepcopy(model)
    compiled = _compile(model, device)
    for step in range(5):
        x, position = torch.randn(8, 16), torch.tensor([step])
        tpu_inductor.reset_transfers()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, position), reference(x, position))
        for (name, b), expected in zip(model.named_buffers(), reference.buffers()):
            torch.testing.assert_close(b, expected, msg=name)  # read from eager code
        moved = tpu_inductor.transfers()
        if step:
            assert moved["host_to_device"]["parameter"] == 0, moved
        # the norm's statistics whole, the cache by the row written and its index
        statistics = sum(b.numel() * b.element_size() for b in model.norm.buffers())
        assert moved["device_to_host"]["mutation"] == statistics + 16 * 4 + 8
    for (name, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, expected, msg=name)
    model.cache.zero_()  # an eager write: the next call must see it
    reference.cache.zero_()
    x, position = torch.randn(8, 16), torch.tensor([2])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, position), reference(x, position))


@pytest.mark.parametrize("device", DEVICES)
def test_buffers_a_graph_writes_leave_the_resident_parameters_as_they_were(device, monkeypatch):
    """The written buffers (BN statistics, the cache) change every call; the parameters'
    resident state is made once, on the first call, not again per call for their sake."""
    made = []
    resend = compiled_graph.CompiledGraph._resend
    monkeypatch.setattr(
        compiled_graph.CompiledGraph,
        "_resend",
        lambda graph, *a: made.append(graph) or resend(graph, *a),
    )
    model = WritesBuffers()
    reference = copy.deepcopy(model)
    compiled = _compile(model, device)
    for step in range(4):
        x, position = torch.randn(8, 16), torch.tensor([step])
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, position), reference(x, position))
    assert len(made) == 1, made


@pytest.mark.parametrize("device", DEVICES)
def test_an_eager_write_to_a_parameter_is_sent_again(device):
    model = nn.Linear(4, 4)
    compiled = _compile(model, device)
    x = torch.randn(3, 4)
    with torch.no_grad():
        compiled(x)
        model.weight.mul_(2)
        tpu_inductor.reset_transfers()
        torch.testing.assert_close(compiled(x), model(x))
    assert tpu_inductor.transfers()["host_to_device"]["parameter"] == 4 * 4 * 4


def test_the_static_cache_recipe_gives_eager_tokens_without_sending_the_cache(
    tmp_path, monkeypatch
):
    """Hugging Face's documented recipe: mode="reduce-overhead", fullgraph, static cache
    (torch.compile takes a mode or options, not both: the options come from the environment),
    with host copies current after each call (test_host_sync.py has the mode's own default)."""
    monkeypatch.setenv("TPU_INDUCTOR_DEVICE", "cpu-copy")
    monkeypatch.setenv("TPU_INDUCTOR_HOST_SYNC", "each_call")
    monkeypatch.setenv("TPU_INDUCTOR_DUMP_DIR", str(tmp_path))
    model, inputs = hf_zoo.build("llama")
    prompt = inputs["input_ids"][:1]
    expected = model.generate(
        prompt, max_new_tokens=6, do_sample=False, cache_implementation="static"
    )
    model.forward = torch.compile(
        model.forward,
        backend="tpu_inductor",
        mode="reduce-overhead",
        fullgraph=True,
    )
    model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static")
    tpu_inductor.reset_transfers()  # a second generate: the weights are on the device already
    generated = model.generate(
        prompt,
        max_new_tokens=6,
        do_sample=False,
        cache_implementation="static",
        return_dict_in_generate=True,
    )
    assert torch.equal(generated.sequences, expected)
    moved = tpu_inductor.transfers()
    layers = generated.past_key_values.layers
    cache_bytes = sum(t.numel() * t.element_size() for x in layers for t in (x.keys, x.values))
    # The cache is made by the prefill graph (StaticLayer's lazy initialization, traced) and
    # taken from the device by every decode step: never sent (what is sent besides the token
    # ids: the layers' int64 length counters). Each call brings the host's copy up to date by
    # the entries it wrote (written_parts.py): all six move less than half the cache once
    # (whole write-backs moved it six times over).
    assert moved["calls"] == 6 and moved["host_to_device"]["argument"] < 1000  # token ids
    assert moved["host_to_device"]["parameter"] < cache_bytes / 100
    assert 0 < moved["device_to_host"]["mutation"] < cache_bytes / 2
    records = [json.loads(p.read_text()) for p in tmp_path.glob("*/compile.json")]
    assert records and all(r["transfers"] is not None for r in records if r["status"] == "ok")
    # the decode step updates the cache in place on the device (donated, not allocated twice)
    assert any(r["transfers"]["donated_bytes"] > 0 for r in records if r["status"] == "ok")
    assert "transfers: per call to device" in report.explain(tmp_path)


def test_saved_on_device_off_returns_saved_activations_to_the_host():
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    compiled = torch.compile(
        model, backend="tpu_inductor", options={"device": "cpu-copy", "saved_on_device": False}
    )
    out = compiled(torch.randn(5, 6))
    assert not _kept_on_device(out)
    tpu_inductor.reset_transfers()
    out = compiled(torch.randn(5, 6))
    out.sum().backward()
    moved = tpu_inductor.transfers()
    assert moved["device_to_host"]["saved"] > 0 and moved["host_to_device"]["saved"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_saved_after_compiled_steps_holds_the_current_state(device):
    """Parameters and optimizer state a compiled AdamW step wrote, and buffers a compiled
    forward wrote, saved with torch.save and loaded into fresh objects, equal eager's."""
    # (no bias before the norm: its gradient is 0 up to rounding, which Adam amplifies)
    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    forward, step = _compile(model, device), _compile(optimizer.step, device)
    for _ in range(3):
        x = torch.randn(8, 16)
        forward(x).pow(2).mean().backward()  # (a sum after batch norm is constant)
        step()
        optimizer.zero_grad(set_to_none=True)
        reference(x).pow(2).mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    saved.seek(0)
    loaded = torch.load(saved)
    fresh = copy.deepcopy(reference)
    fresh.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    fresh.load_state_dict(loaded["model"])
    for (name, value), expected in zip(fresh.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-5, msg=name)
    expected_state = reference_optimizer.state_dict()["state"]
    for index, state in loaded["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                state[key], expected_state[index][key], rtol=1e-4, atol=1e-6, msg=key
            )


def test_the_prepared_device_check_passes_on_the_copying_cpu(tmp_path):
    """tools/device_check.py is what a lent GPU or TPU runs: it must work before one is lent."""
    from tools import device_check

    out = tmp_path / "check.json"
    assert (
        device_check.main(["--model", "gpt2", "--steps", "3", "--runs", "1", "--out", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    assert report["device"].endswith("copied)") and report["losses_equal"]
    assert report["state_sent_bytes"] == 0 and report["steady_step_ledger"]["calls"] == 3
    assert report["host_sync"] == "explicit" and report["state_fetched_bytes"] == 0
