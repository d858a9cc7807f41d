"""The backend end to end: entry point, options, caching, fallback, mutations, views, residency
(the shape policy's tests are in test_shape_policy.py)."""

from __future__ import annotations

import gc
import logging
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import assert_same, backend_error, grads_of
from tpu_inductor.cache import stores as cache
from tpu_inductor.config import Options
from tpu_inductor.debug import records as debug
from tpu_inductor.exc import (
    DeviceError,
    LoweringError,
    OptionError,
    RegistrationError,
    UnsupportedOpError,
)
from tpu_inductor.runtime import compiled_graph, devices, ledger, transfer

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _compile(fn, **options):
    return torch.compile(fn, backend="tpu_inductor", options=options or None)


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
    from tpu_inductor.runtime import transfer

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
    dispatch miss per graph: the fast path held), over every kind of argument: numpy views
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
    assert graph._run.dispatch is not None
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
    f = _compile(lambda x: x + 1, device="quantum")
    with pytest.raises(Exception, match="'device' has value 'quantum'"):
        f(torch.ones(2))


def test_seen_shapes_never_relower_or_recompile():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = _compile(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert_same(compiled(x), model(x))
        records, misses = len(debug.records), cache.counters["miss"]
        for _ in range(3):
            y = torch.randn(4, 8)
            assert_same(compiled(y), model(y))
    assert len(debug.records) == records
    assert cache.counters["miss"] == misses


def test_identical_graph_compiled_twice_hits_memory_cache():
    model = nn.Sequential(nn.Linear(6, 3), nn.Tanh())
    x = torch.randn(2, 6)
    with torch.no_grad():
        _compile(model)(x)
        hits = cache.counters["hit"]
        torch._dynamo.reset()
        assert_same(_compile(model)(x), model(x))
    assert cache.counters["hit"] == hits + 1


@torch.library.custom_op("tpu_inductor_test::unlowered", mutates_args=())
def unlowered(x: torch.Tensor) -> torch.Tensor:
    """An op no lowering rule will ever exist for: it must run in eager torch."""
    return torch.special.bessel_j0(x) * 3


@unlowered.register_fake
def _(x):
    return torch.empty_like(x)


def _uses_unsupported_op(x):
    return unlowered(x.cos() * 3) + x.sin()


def test_unsupported_op_falls_back_to_eager_with_one_warning(caplog):
    x = torch.randn(16)
    with caplog.at_level(logging.WARNING, logger="tpu_inductor"):
        out = _compile(_uses_unsupported_op)(x)
    assert_same(out, _uses_unsupported_op(x))
    warnings = [r.getMessage() for r in caplog.records if "without a lowering" in r.getMessage()]
    assert len(warnings) == 1 and "tpu_inductor_test.unlowered.default x1" in warnings[0]


@torch.library.custom_op("tpu_inductor_test::unlowered_sub", mutates_args=())
def unlowered_sub(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a - b


@unlowered_sub.register_fake
def _(a, b):
    return torch.empty_like(a)


def test_split_graph_writes_inputs_back_after_the_eager_ops_that_read_them():
    """A buffer read by an eager op, then updated in place: the op sees the old value (the
    compiled region before it, which computes the update, must not write it back early)."""

    class Running(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("running", torch.ones(4))

        def forward(self, x):
            h = x * 2
            out = unlowered_sub(h, self.running)  # the buffer before the update below
            self.running.mul_(0.5).add_(h.mean(0), alpha=0.5)
            return out

    model, reference = Running(), Running()
    x = torch.full((2, 4), 3.0)
    assert_same(_compile(model)(x), reference(x))
    assert_same(model.running, reference.running)


@pytest.mark.parametrize("dynamic", [False, True])
def test_eager_ops_of_a_split_graph_get_their_inputs_in_the_traced_layout(dynamic):
    """A region's result read by an eager op has the layout it was traced with: the eager op's
    own result follows it, and a later view (valid for the traced strides only) must work."""

    def f(x):
        y = unlowered((x * 2).t())  # its result takes the transposed layout of its argument
        return y.t().view(-1) + 1  # a flat view exists only for that layout

    compiled = torch.compile(f, backend="tpu_inductor", dynamic=dynamic)
    for x in (torch.randn(4, 6), torch.randn(5, 7)):
        assert_same(compiled(x), f(x))


def test_strict_mode_lists_missing_op_with_source_line():
    f = _compile(_uses_unsupported_op, fallback="error")
    message = str(backend_error(UnsupportedOpError, f, torch.randn(16)))
    assert "tpu_inductor_test.unlowered.default (1x)" in message
    assert "test_backend.py" in message and "unlowered(x.cos() * 3)" in message


def test_input_mutation_is_written_back():
    def f(buf, x):
        buf.add_(x)
        return buf * 2

    buf, x = torch.zeros(3), torch.arange(3.0)
    out = _compile(f)(buf, x)
    assert_same(buf, torch.arange(3.0))
    assert_same(out, torch.arange(3.0) * 2)


def _output_and_its_views(x):
    y = x * 2
    return y, y[0], y.t(), y.view(-1)[2:5]


def _views_of_an_intermediate(x):  # the base is no output: computed as a hidden module result
    y = x * 2
    return y.t(), y[:2], y[1:], y.view(torch.int32)[0]


@pytest.mark.parametrize("outputs", [_output_and_its_views, _views_of_an_intermediate])
@pytest.mark.parametrize("from_disk", [False, True], ids=["compiled", "disk_cache_hit"])
def test_outputs_that_share_a_storage_are_views_of_it(from_disk, outputs):
    """As in eager: a write through `y` shows through `y[0]` (computed once, viewed)."""
    x = torch.randn(3, 4)
    if from_disk:
        with torch.no_grad():
            _compile(outputs)(x)
        torch._dynamo.reset()
        cache.memory_cache.clear()  # the call description then comes back from its JSON
    hits = cache.counters["disk_hit"]
    with torch.no_grad():
        got_all = _compile(outputs)(x)
    assert cache.counters["disk_hit"] == hits + from_disk
    want_all = outputs(x)
    for got, want in zip(got_all, want_all):
        assert_same(got, want)
        assert (got.stride(), got.storage_offset()) == (want.stride(), want.storage_offset())
    got_all[0].fill_(7.0)
    want_all[0].fill_(7.0)
    for got, want in zip(got_all, want_all):
        assert_same(got, want)


def test_transposed_and_sliced_inputs_are_copied_not_misread():
    f = _compile(lambda a, b: a @ b + 1)
    base = torch.randn(6, 5)
    a, b = base.t()[:, 1:4], torch.randn(5, 4)[1:4]
    assert_same(f(a, b), a @ b + 1)


def test_views_of_results_computed_in_eager_stay_views_in_a_split_graph():
    """torch.cond runs in eager (a split graph): the view of its result must not be compiled
    into a region, which would return a copy."""

    def f(x, y):
        z = torch.cond(y.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (x,))
        return z, z.view(-1)[:3], z.t() * 2

    x, y = torch.randn(4, 5), torch.ones(4, 5)
    with torch.no_grad():
        z, v, w = _compile(f)(x, y)
    assert_same(w, x.sin().t() * 2)
    v.zero_()
    assert_same(z.view(-1)[:3], torch.zeros(3))
    assert v._base is z


def test_python_arithmetic_on_data_dependent_scalars_is_evaluated(caplog):
    """int() of a captured scalar (math.trunc) and a scalar condition (torch.sym_ite) are size
    arithmetic the interpreter evaluates, not ops left to eager torch."""

    def f(x):
        return x + (x.sum() > 0).item(), x.view(int(x.new_ones(1).item() * 2.5), -1)

    x = torch.randn(4, 5)
    with (
        torch._dynamo.config.patch(capture_scalar_outputs=True),
        caplog.at_level(logging.WARNING, logger="tpu_inductor"),
    ):
        for got, want in zip(_compile(f)(x), f(x)):
            assert_same(got, want)
    assert "_local_scalar_dense" in caplog.text  # .item() itself runs in eager torch
    assert "trunc" not in caplog.text and "sym_ite" not in caplog.text


def test_data_dependent_mask_writes_run_in_eager_instead_of_failing():
    """index_put with a mask whose count is data-dependent: the rule's support check cannot
    decide its layout (no guard on an unbacked size), so the write runs in eager torch."""

    def f(x, m):
        y = x.clone()
        y[m] = y[m] * 10
        return y, x[m].sum()

    x, m = torch.randn(6, 5), torch.randn(6, 5) > 0
    leaf = x.clone().requires_grad_()
    with torch._dynamo.config.patch(
        capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True
    ):
        y, total = _compile(f)(leaf, m)
        (y.sum() + total).backward()
    want_leaf = x.clone().requires_grad_()
    want_y, want_total = f(want_leaf, m)
    (want_y.sum() + want_total).backward()
    assert_same((y, total, leaf.grad), (want_y, want_total, want_leaf.grad))


def test_higher_order_ops_are_named_as_such_when_refused():
    def f(x):
        return torch.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (x,))

    error = backend_error(UnsupportedOpError, _compile(f, fallback="error"), torch.randn(3))
    assert "torch.ops.higher_order.cond (1x)" in str(error)
    assert "torch.where can replace a torch.cond" in str(error)


def test_an_input_of_another_layout_is_not_given_an_executable_lowered_for_the_first():
    """Rules may lower by input layout (det factors a contiguous A^T): strides are in the key."""

    def det_grad(a):
        return torch.autograd.grad(torch.linalg.det(a), a)[0]

    compiled = torch.compile(det_grad, backend="tpu_inductor", dynamic=False)
    a = torch.randn(4, 4) + 4 * torch.eye(4)
    for matrix in (a, a.t().contiguous().t()):  # the same values, transposed storage
        leaf = matrix.detach().requires_grad_()
        assert_same(
            compiled(leaf), det_grad(matrix.detach().requires_grad_()), rtol=1e-4, atol=1e-4
        )


def _same_views(got_all, want_all, base_got, base_want):
    for got, want in zip(got_all, want_all):
        assert_same(got, want)
        assert (got.stride(), got.storage_offset()) == (want.stride(), want.storage_offset())
        shares = got.untyped_storage().data_ptr() == base_got.untyped_storage().data_ptr()
        assert shares == (
            want.untyped_storage().data_ptr() == base_want.untyped_storage().data_ptr()
        )


def test_views_of_an_input_at_a_symbolic_offset_are_views_at_that_offset():
    """Dynamo makes `i` symbolic on the second call; AOTAutograd rebuilds a view of an input
    from the offset of ours: a copy put x[i] at row 0 for every i."""

    def f(x, i):
        return x[i], x[i:], x.narrow(1, i, 2)

    compiled, x = _compile(f), torch.arange(20.0).reshape(4, 5)
    for i in range(3):
        _same_views(compiled(x, i), f(x, i), x, x)


def test_views_of_a_region_input_in_a_split_graph_are_views_of_it():
    """y is computed in one region and viewed in the next (torch.cond splits the graph)."""

    def f(x):
        y = x + 1
        z = torch.cond(y.sum() > 0, lambda t: t * 2, lambda t: t * 3, (y,))
        return y, y[1:], y.t(), z.sum()

    x = torch.randn(6, 8)
    with torch.no_grad():
        got, want = _compile(f)(x), f(x)
    _same_views(got, want, got[0], want[0])
    got[0][1, 0] = 100.0
    assert got[1][0, 0] == 100.0 and got[2][0, 1] == 100.0


def test_conjugate_and_negative_view_inputs_are_read_with_their_sign():
    # x.conj() and torch._neg_view share the storage and set a lazy bit that dlpack drops.
    f = _compile(lambda x: x + 1)
    c = torch.tensor([1 + 2j, 3 - 4j]).conj()
    n = torch._neg_view(torch.tensor([1.0, 2.0]))
    assert_same(f(c), c + 1)
    assert_same(f(n), n + 1)
    g = _compile(lambda x: x.mul_(2))
    c_eager = torch.tensor([1 + 2j, 3 - 4j]).conj()
    g(c)
    assert_same(c, c_eager.mul_(2))


def test_meta_inputs_run_in_eager_and_other_devices_are_refused(caplog):
    x = torch.randn(3, 4, device="meta")
    with caplog.at_level(logging.WARNING, logger="tpu_inductor"):
        out = _compile(lambda x: x.sum(0) + 1)(x)
    assert (out.device.type, out.shape) == ("meta", (4,))
    assert "meta tensors" in caplog.text
    from tpu_inductor import backend

    with pytest.raises(DeviceError, match=r"graph input 1 is a tensor on meta.*\.cpu\(\)"):
        backend._require_cpu_tensors([torch.ones(1), x])


def test_threads_calling_two_instances_of_one_module_each_get_their_own_parameters():
    """Dynamo compiles the class's forward once; its graph serves both instances, whose
    parameters it holds resident: one thread's refresh must not feed the other's call."""
    import threading

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)) for _ in range(2)]
    compiled = [_compile(m) for m in models]
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
    import gc
    import weakref

    def run():
        model = nn.Linear(64, 64)
        with torch.no_grad():
            _compile(model)(torch.randn(2, 64))
        return weakref.ref(model.weight)

    weight = run()
    gc.collect()
    assert weight() is None


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # jax's warning at the fork
def test_compiling_in_a_forked_child_is_an_error_not_a_hang():
    import multiprocessing

    compiled = _compile(nn.Linear(8, 8), shapes={"policy": "exact"})  # a new size compiles
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


def _update_in_place(model):
    model.weight.mul_(3)
    model.bias.add_(1)


def _replace_storage(model):
    model.weight.data = torch.randn(4, 4)  # same object and version, another storage


@pytest.mark.parametrize("change", [_update_in_place, _replace_storage])
def test_resident_parameters_follow_changes(change):
    model = nn.Linear(4, 4)
    compiled = _compile(model)
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
    loss = _compile(model)(x).sum()
    forward = compiled_graphs[0].lowered
    result_shapes = {spec.shape for spec in forward.output_specs}
    assert not result_shapes & {(8, 16), (16, 4)}, result_shapes  # the weights' transposes
    assert any(slot.input is not None for slot in forward.outputs)
    expected = grads_of(model, model(x).sum())
    model.zero_grad()
    assert_same(grads_of(model, loss), expected)


def test_rule_with_wrong_dtype_names_node_and_source_line():
    from tpu_inductor.lowering.registry import register_lowering

    @torch.library.custom_op("tpu_inductor_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @twice.register_fake
    def _(x):
        return torch.empty_like(x)

    @register_lowering(torch.ops.tpu_inductor_test.twice.default)
    def wrong_twice(x):
        return (x * 2).astype("int32")  # torch keeps float32: the interpreter must catch this

    with pytest.raises(RegistrationError, match="already has a lowering"):
        register_lowering(torch.ops.tpu_inductor_test.twice.default)(wrong_twice)

    def user_fn(x):
        return twice(x) + 1

    error = backend_error(LoweringError, _compile(user_fn), torch.randn(3))
    assert "dtype int32, torch computes torch.float32" in str(error)
    assert "test_backend.py" in str(error) and "twice(x)" in str(error)


def test_mismatched_input_dtypes_are_named_when_a_result_dtype_is_wrong():
    """Eager rejects an int64 input to a float layer; the meta kernels do not, so the
    interpreter's dtype check is where it shows: the message names the inputs' dtypes."""
    error = backend_error(LoweringError, _compile(nn.Linear(4, 2)), torch.ones(3, 4).long())
    assert "from inputs of dtypes ['float32', 'int64', 'float32']" in str(error)
    assert "pass inputs of the dtype the model expects" in str(error)


def test_cli_version_and_devices():
    out = subprocess.run(
        [sys.executable, "-m", "tpu_inductor.cli", "devices"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "cpu: 1 device(s)" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "tpu_inductor.cli", "--version"], capture_output=True, text=True
    )
    assert out.stdout.startswith("tpu-inductor ")


def _count_transfers(monkeypatch) -> list[tuple[int, ...]]:
    sent: list[tuple[int, ...]] = []
    to_device = transfer.Transfer.to_device

    def counting(self, tensor, sharding=None):
        sent.append(tuple(tensor.shape))
        return to_device(self, tensor, sharding)

    argument = transfer.Transfer.argument

    def counting_host_arrays(self, tensor):  # sent by jax's C++ dispatch
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
    compiled = _compile(model)
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
    compiled_conv, compiled_linear = _compile(conv), _compile(linear)
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
        assert_same(_compile(model)(x), model(x))


def test_cpu_convolutions_are_not_given_to_ynnpack(tmp_path):
    """Our per-executable XLA options: XLA's own convolutions (2-3.6x faster here than YNNPACK's
    for the backward), YNNPACK still for dots and reductions."""
    model = nn.Sequential(
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16 * 16, 4)
    )
    x = torch.randn(4, 32, 16, 16)
    compiled = _compile(model, device="cpu", dump_dir=str(tmp_path), cache=False)
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

    compiled = _compile(attention, dump_dir=str(tmp_path), cache=False)
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


def test_a_graph_pjrt_cannot_compile_runs_in_eager_torch_with_a_warning(monkeypatch, caplog):
    """fallback="eager": a PJRT compile failure (here: every module) is a warning naming the
    graph, and the graph runs in eager torch, equal to eager; fallback="error" raises."""
    from tpu_inductor.exc import CompileError

    def fails(_module, _device):
        raise CompileError("PJRT failed (a test)")

    monkeypatch.setattr(devices, "compile_stablehlo", fails)
    x = torch.randn(4, 3)
    model = torch.nn.Linear(3, 2)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tpu_inductor", options={"cache": False})
    with caplog.at_level(logging.WARNING, logger="tpu_inductor"):
        out = compiled(x)
        grads = grads_of(model, out.sum())  # the backward graph too
    assert_same(out, model(x))
    assert_same(grads, grads_of(model, model(x).sum()))
    assert caplog.text.count("runs in eager torch") == 2 and "a test" in caplog.text
    torch._dynamo.reset()  # symbolic sizes: compiled per bucket at call time, padded there
    dynamic = torch.compile(lambda t, n: t.softmax(-1) * n, backend="tpu_inductor", dynamic=True)
    for rows in (3, 5, 6):
        t = torch.randn(rows, 7)
        assert_same(dynamic(t, rows), t.softmax(-1) * rows)
    torch._dynamo.reset()
    strict = torch.compile(
        model, backend="tpu_inductor", options={"cache": False, "fallback": "error"}
    )
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="a test"):
        strict(x)
