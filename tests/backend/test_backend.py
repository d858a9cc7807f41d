"""The backend end to end: entry point, options, dispatch, caching, the CLI, XLA's options
(fallback: test_fallback.py; mutations and views: test_views.py; parameters:
test_parameters.py; the shape policy: tests/passes/test_shape_policy.py)."""

from __future__ import annotations

import gc
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import assert_same, compile_tpu
from tpu_inductor.cache import stores
from tpu_inductor.config import Options
from tpu_inductor.debug import records as debug
from tpu_inductor.exc import (
    OptionError,
)
from tpu_inductor.runtime import compiled_graph, devices, transfer

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_backend_found_through_entry_point_without_import():
    code = (
        "import sys, torch\n"
        "assert 'tpu_inductor' in torch._dynamo.list_backends(), torch._dynamo.list_backends()\n"
        "assert 'tpu_inductor' not in sys.modules\n"
        "f = torch.compile(lambda x: x.sin() * 2, backend='tpu_inductor')\n"
        "x = torch.randn(5)\n"
        "torch.testing.assert_close(f(x), x.sin() * 2)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("device", ["cpu", "cpu-copy"])
def test_64_bit_arguments_keep_their_dtype_without_jaxlibs_dlpack_entry_points(device, monkeypatch):
    """A jax without the C dlpack entry points (the public import, then a device_put, which
    narrow 64-bit arrays without x64: seen on jax 0.11) still sends int64 and float64 as they
    are: the module, lowered at those dtypes, takes them."""

    original = transfer.Transfer.__init__

    def without_entry_points(self, device):
        original(self, device)
        self._import = None

    monkeypatch.setattr(transfer.Transfer, "__init__", without_entry_points)
    table, ids = torch.randn(50, 4), torch.tensor([[3, 49], [0, 7]])
    scale = torch.tensor([2.5], dtype=torch.float64)

    def fn(table, ids, scale):
        return table[ids] * scale.float(), ids + 2**40

    f = torch.compile(fn, backend="tpu_inductor", options={"device": device, "cache": False})
    for got, want in zip(f(table, ids, scale), fn(table, ids, scale)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", ["cpu", "cpu-copy"])
def test_one_device_calls_run_through_jaxs_cpp_dispatch_with_eagers_numbers(device):
    """After its first call a graph runs without returning to Python for the execution (one
    fast-path miss per graph: the fast path held), over every kind of argument: numpy views
    (float32, int32, bool), tensors `to_device` sends (int64, bfloat16, a transposed view, a
    lazy negation, one that requires grad)."""
    from tpu_inductor.runtime import execution

    def fn(a, b, mask, ids, h, t, n, w):
        scaled = torch.where(mask, a * b.float(), -a)
        return scaled[ids] + h.float().sum() + t.sum(0) + n + w

    def arguments(seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        return (
            torch.randn(6, 3, generator=g),
            torch.randint(-9, 9, (6, 3), generator=g, dtype=torch.int32),
            torch.rand(6, 3, generator=g) > 0.5,
            torch.randint(0, 6, (3,), generator=g),
            torch.randn(4, generator=g).bfloat16(),
            torch.randn(3, 3, generator=g).t(),
            torch.randn(3, generator=g)._neg_view(),
            torch.randn(3, generator=g).requires_grad_(),
        )

    f = torch.compile(fn, backend="tpu_inductor", options={"device": device, "cache": False})
    f(*arguments(0))
    graph = [o for o in gc.get_objects() if type(o) is compiled_graph.CompiledGraph][-1]
    assert graph._run.fast_path is not None
    execution.stats.clear()
    for seed in range(1, 6):
        torch.testing.assert_close(f(*arguments(seed)), fn(*arguments(seed)))
    assert execution.stats["misses"] == 0


def test_unknown_option_names_key_and_allowed():
    with pytest.raises(OptionError, match=r"unknown option 'devise'.*Allowed options: .*device"):
        Options.from_user({"devise": "cpu"})


def test_bad_option_value_lists_allowed_values():
    with pytest.raises(OptionError, match=r"'fallback' has value 'never'.*'eager', 'error'"):
        Options.from_user({"fallback": "never"})
    with pytest.raises(OptionError, match="mode='fastest'.*'reduce-overhead'"):
        Options.from_user(None, "fastest")


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune"])
def test_every_torch_compile_mode_is_accepted(mode):
    """Hugging Face's static-cache recipe passes mode="reduce-overhead"; it must compile."""
    f = torch.compile(lambda x: x.sin() * 2, backend="tpu_inductor", mode=mode)
    x = torch.randn(5)
    torch.testing.assert_close(f(x), x.sin() * 2)


def test_env_var_gives_default_and_option_overrides(monkeypatch):
    monkeypatch.setenv("TPU_INDUCTOR_FALLBACK", "error")
    assert Options.from_user().fallback == "error"
    assert Options.from_user({"fallback": "eager"}).fallback == "eager"
    monkeypatch.setenv("TPU_INDUCTOR_RESIDENT_PARAMS", "maybe")
    with pytest.raises(OptionError, match="TPU_INDUCTOR_RESIDENT_PARAMS='maybe'"):
        Options.from_user()


def test_bad_option_raises_through_torch_compile():
    f = compile_tpu(lambda x: x + 1, device="quantum")
    with pytest.raises(Exception, match="'device' has value 'quantum'"):
        f(torch.ones(2))


def test_seen_shapes_never_relower_or_recompile():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = compile_tpu(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert_same(compiled(x), model(x))
        records, misses = len(debug.records), stores.counters["miss"]
        for _ in range(3):
            y = torch.randn(4, 8)
            assert_same(compiled(y), model(y))
    assert len(debug.records) == records
    assert stores.counters["miss"] == misses


def test_identical_graph_compiled_twice_hits_memory_cache():
    model = nn.Sequential(nn.Linear(6, 3), nn.Tanh())
    x = torch.randn(2, 6)
    with torch.no_grad():
        compile_tpu(model)(x)
        hits = stores.counters["hit"]
        torch._dynamo.reset()
        assert_same(compile_tpu(model)(x), model(x))
    assert stores.counters["hit"] == hits + 1


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # jax's warning at the fork
def test_compiling_in_a_forked_child_is_an_error_not_a_hang():
    import multiprocessing

    compiled = compile_tpu(nn.Linear(8, 8), shapes={"policy": "exact"})  # a new size compiles
    with torch.no_grad():
        compiled(torch.randn(4, 8))  # the parent's PJRT client exists
    context = multiprocessing.get_context("fork")
    errors = context.Queue()

    def child():
        try:
            with torch.no_grad():
                compiled(torch.randn(3, 8))  # a new size: a compile
            errors.put("no error")
        except Exception as e:
            errors.put(str(getattr(e, "inner_exception", e)))

    process = context.Process(target=child)
    process.start()
    process.join(120)
    assert process.exitcode == 0, "the child hung or crashed"
    message = errors.get(timeout=5)
    assert "PJRT cannot compile in a forked child" in message and "'spawn'" in message


def test_cli_version_and_devices():
    out = subprocess.run(
        [sys.executable, "-m", "tpu_inductor.cli", "devices"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "cpu: 1 device(s)" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "tpu_inductor.cli", "--version"], capture_output=True, text=True
    )
    assert out.stdout.startswith("tpu-inductor ")


def test_cpu_convolutions_are_not_given_to_ynnpack(tmp_path):
    """Our per-executable XLA options: XLA's own convolutions (2-3.6x faster here than YNNPACK's
    for the backward), YNNPACK still for dots and reductions."""
    model = nn.Sequential(
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16 * 16, 4)
    )
    x = torch.randn(4, 32, 16, 16)
    compiled = compile_tpu(model, device="cpu", dump_dir=str(tmp_path), cache=False)
    with torch.no_grad():
        assert_same(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    (hlo,) = tmp_path.glob("*/*_optimized_hlo.txt")
    text = hlo.read_text()
    ynn_bodies = re.findall(r'calls=(%[\w.\-]+).*"kind":"__ynn_fusion"', text)
    bodies = {
        name: re.search(re.escape(name) + r" .*?\n}", text, re.S).group(0) for name in ynn_bodies
    }
    assert ynn_bodies and not any("convolution(" in body for body in bodies.values())


def test_cpu_flash_attention_is_traced_whole_forward_and_backward(tmp_path):
    """SDPA reaches our rules as one op each way (GQA too), not as its math decomposition."""
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 16, requires_grad=True) for _ in range(2))

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    compiled = compile_tpu(attention, dump_dir=str(tmp_path), cache=False)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = attention(q, k, v)
    assert_same(out, expected, rtol=1e-5, atol=2e-5)
    for got, want in zip(grads, torch.autograd.grad(expected.square().sum(), (q, k, v))):
        assert_same(got, want, rtol=1e-4, atol=1e-4)
    forward = "".join(p.read_text() for p in tmp_path.glob("*/*_aten_forward.py"))
    backward = "".join(p.read_text() for p in tmp_path.glob("*/*_aten_backward.py"))
    assert "_scaled_dot_product_flash_attention_for_cpu.default" in forward
    assert "_scaled_dot_product_flash_attention_for_cpu_backward.default" in backward
    assert "_softmax" not in forward + backward


def test_xla_flags_naming_the_option_win_over_ours(monkeypatch):
    device = devices.select_device("cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=-reduce")
    assert devices._placement(device)[1].env_option_overrides == []
