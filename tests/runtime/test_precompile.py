"""Warm-up for serving (tpu_inductor.precompile, tpu_inductor.no_compiles): every bucket compiled
up front, its PJRT compiles overlapping in a pool of threads or left running in the background,
and a serving loop that proves nothing compiles after warm-up. Compiles are counted (kept
executables forgotten and the disk cache off, so another test's module is not reused), never
timed; every result equals eager's with NaN in the padding."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import tpu_inductor
from tests.helpers import assert_same, forget_compiles
from tpu_inductor.debug import records as debug
from tpu_inductor.exc import OptionError, UnexpectedCompileError
from tpu_inductor.runtime import buckets as bucketing
from tpu_inductor.runtime import devices

SHAPES = {"policy": "pow2", "min_bucket": 8, "pad_with": "nan"}
LENGTHS = (3, 9, 17, 33, 64, 50, 8)  # buckets 8, 16, 32, 64


def _new_process() -> None:
    torch._dynamo.reset()
    forget_compiles()  # another test in this worker may have compiled the same graph


@pytest.fixture(autouse=True)
def _fresh():
    _new_process()
    yield
    _new_process()


def _shapes():
    from tpu_inductor.config import Options

    return Options.from_user({"shapes": SHAPES}).shapes


class _Broken(torch.nn.Module):
    """Two graphs per call (a graph break between them), both with a symbolic length."""

    def forward(self, x):
        h = torch.tanh(x).softmax(-1)
        torch._dynamo.graph_break()
        return (h * 2).cumsum(-1).sum(-1)


def _compiled(model):
    options = {"shapes": SHAPES, "fallback": "error", "cache": False}
    return torch.compile(model, backend="tpu_inductor", options=options)


def _serve(compiled, model, lengths=LENGTHS):
    with torch.no_grad():
        for n in lengths:
            x = torch.randn(2, n)
            torch._dynamo.maybe_mark_dynamic(x, 1)
            assert_same(compiled(x), model(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("workers", [1, 4])
def test_precompile_compiles_each_bucket_once_and_serving_compiles_nothing(workers):
    """Two graphs (a graph break) x four buckets: 8 PJRT compiles, in threads or not; then
    every length served inside no_compiles(), equal to eager; each compile's record names the
    bucket of its own inputs (the pool's compiles record the call that handed them over)."""
    model = _Broken()
    compiled = _compiled(model)
    before, records = tpu_inductor.compiles(), len(debug.records)
    buckets = tpu_inductor.precompile(
        compiled, (torch.randn(2, 5),), {0: 1}, 64, _shapes(), workers=workers
    )
    assert buckets == [8, 16, 32, 64]
    assert tpu_inductor.compiles() - before == 2 * len(buckets)
    for record in debug.records[records:]:
        (bucket,) = record.bucketing["bucket"].values()
        shapes = [v[0] for v in record.inputs if isinstance(v, tuple)]
        assert shapes[0] == (2, bucket), (record.inputs, record.bucketing)
    with tpu_inductor.no_compiles():
        _serve(compiled, model)
    assert tpu_inductor.compiles() - before == 2 * len(buckets)


def test_a_compile_inside_no_compiles_raises_naming_the_graph_and_sizes():
    model = _Broken()
    compiled = _compiled(model)
    tpu_inductor.precompile(compiled, (torch.randn(2, 5),), {0: 1}, 16, _shapes(), workers=2)
    _serve(compiled, model, (3, 16))
    x = torch.randn(2, 40)
    torch._dynamo.maybe_mark_dynamic(x, 1)
    with pytest.raises(UnexpectedCompileError, match=r"(?s)inputs.*\(2, 64\).*precompile"):
        with tpu_inductor.no_compiles(), torch.no_grad():
            compiled(x)
    _serve(compiled, model, (40,))  # outside the block it compiles, and is right


def test_background_precompile_serves_at_once_and_a_second_call_waits_for_all():
    """`background=True` returns with the first graph's compiles in flight; a call of a bucket
    still compiling waits for it (its second graph, after the break, compiles then); precompile
    again compiles the other buckets' second graphs and leaves nothing to compile."""
    model = _Broken()
    compiled = _compiled(model)
    before = tpu_inductor.compiles()
    example = (torch.randn(2, 5),)
    tpu_inductor.precompile(
        compiled, example, {0: 1}, 64, _shapes(), background=True, workers=1
    )  # one thread, beside this one
    with torch.no_grad():
        x = torch.randn(2, 30)
        torch._dynamo.maybe_mark_dynamic(x, 1)
        assert_same(compiled(x), model(x), atol=1e-6, rtol=1e-5)  # its second graph compiles
    tpu_inductor.precompile(compiled, example, {0: 1}, 64, _shapes())
    assert tpu_inductor.compiles() - before == 8
    with tpu_inductor.no_compiles():
        _serve(compiled, model)
    assert bucketing.report()[-1]["buckets"].keys() == {"(8,)", "(16,)", "(32,)", "(64,)"}


def _masked(ids, mask):
    return (ids.float().tanh() * mask).softmax(1).sum(0)


def test_batch_and_length_are_precompiled_together_and_serve_every_pair():
    """Named groups of dims: the batch of both inputs, their length; every pair of buckets."""
    shapes = {"policy": "pow2", "min_bucket": 4, "pad_with": "nan"}
    options = {"shapes": shapes, "fallback": "error", "cache": False}
    compiled = torch.compile(_masked, backend="tpu_inductor", options=options)
    from tpu_inductor.config import Options

    record = Options.from_user({"shapes": shapes}).shapes
    example = (torch.randint(0, 9, (2, 5)), torch.ones(2, 5))
    groups = {"B": {0: 0, 1: 0}, "S": {0: 1, 1: 1}}
    before = tpu_inductor.compiles()
    buckets = tpu_inductor.precompile(compiled, example, groups, {"B": 8, "S": 32}, record)
    assert buckets == [{"B": b, "S": s} for b in (4, 8) for s in (4, 8, 16, 32)]
    assert tpu_inductor.compiles() - before == len(buckets)
    with tpu_inductor.no_compiles(), torch.no_grad():  # precompiled without grad, as served
        for b, n in ((3, 5), (8, 32), (5, 17), (2, 3)):
            ids, mask = torch.randint(0, 9, (b, n)), (torch.rand(b, n) > 0.3).float()
            for t in (ids, mask):
                torch._dynamo.maybe_mark_dynamic(t, 0), torch._dynamo.maybe_mark_dynamic(t, 1)
            assert_same(compiled(ids, mask), _masked(ids, mask), atol=1e-6, rtol=1e-5)
    with pytest.raises(OptionError, match="names"):
        tpu_inductor.precompile(compiled, example, groups, {"B": 8}, record)


def test_bench_shapes_names_a_bad_workload(capsys):
    from tpu_inductor import cli

    assert cli.main(["bench-shapes", "--workloads", "precompile,serve"]) == 2
    assert "['serve']: not of ('generate', 'train', 'precompile')" in capsys.readouterr().err


class _Step(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.proj(x)).softmax(1).sum(1).pow(2).mean()


@pytest.mark.parametrize("workers", [1, 3])
def test_training_graphs_are_precompiled_and_a_training_loop_compiles_nothing(workers):
    """backward=True: each bucket's forward and backward graphs (2 x 3 compiles), no .grad
    written; then training steps at lengths in those buckets: loss and gradients equal eager's,
    nothing compiled."""
    torch.manual_seed(0)
    model, reference = _Step(), _Step()
    reference.load_state_dict(model.state_dict())
    compiled = _compiled(model)
    before = tpu_inductor.compiles()
    example = (torch.randn(2, 5, 8),)
    buckets = tpu_inductor.precompile(
        compiled, example, {0: 1}, 32, _shapes(), workers=workers, backward=True
    )
    assert buckets == [8, 16, 32] and tpu_inductor.compiles() - before == 6
    assert all(p.grad is None for p in model.parameters())
    with tpu_inductor.no_compiles():
        for n in (5, 20, 32, 9):
            x = torch.randn(2, n, 8)
            torch._dynamo.maybe_mark_dynamic(x, 1)
            loss, want = compiled(x), reference(x)
            loss.backward(), want.backward()
            assert_same(loss, want, atol=1e-5, rtol=1e-4)
            for p, q in zip(model.parameters(), reference.parameters()):
                assert_same(p.grad, q.grad, atol=1e-5, rtol=1e-4)
    frozen = _compiled(lambda x: x.softmax(1))  # no parameters, an input without grad
    with pytest.raises(OptionError, match="needs a gradient"):
        tpu_inductor.precompile(frozen, example, {0: 1}, 8, _shapes(), backward=True, workers=1)


def test_a_compile_that_fails_in_the_background_is_logged_and_raised_by_its_call(
    monkeypatch, caplog
):
    from tpu_inductor.exc import CompileError

    def fail(lowered, device):
        raise CompileError("PJRT failed (a test)")

    model = _Broken()
    compiled = _compiled(model)
    monkeypatch.setattr(devices, "compile_module", fail)
    with caplog.at_level(logging.WARNING, logger="tpu_inductor.runtime.size_dispatch"):
        tpu_inductor.precompile(
            compiled, (torch.randn(2, 5),), {0: 1}, 8, _shapes(), background=True
        )
        x = torch.randn(2, 8)
        torch._dynamo.maybe_mark_dynamic(x, 1)
        with pytest.raises(CompileError, match="a test"), torch.no_grad():
            compiled(x)
        for thread in threading.enumerate():  # the pool's threads log before they end
            if thread.name.startswith("tpu_inductor-precompile"):
                thread.join()
    assert "a compile ahead of its calls failed" in caplog.text and "a test" in caplog.text


def test_no_compiles_sees_a_dynamo_retrace_that_the_caches_serve():
    """Dynamo traces again (its caches reset: a guard that failed does the same); our cache
    serves the executable, no PJRT compile, and the retrace still raises inside the block."""

    def f(x):
        return x.sin() * 2

    compiled = torch.compile(f, backend="tpu_inductor", dynamic=False)
    x = torch.randn(4)
    compiled(x)
    torch._dynamo.reset()
    before = tpu_inductor.compiles()
    with pytest.raises(UnexpectedCompileError, match="Dynamo traced graph"):
        with tpu_inductor.no_compiles():
            compiled(x)
    assert tpu_inductor.compiles() == before
    with tpu_inductor.no_compiles():  # traced now: served
        assert_same(compiled(x), f(x))


def test_fail_on_recompile_is_honoured_by_a_new_bucket():
    """Under torch.compiler.set_stance("fail_on_recompile") a bucket compiled before serves and
    a new one raises (Dynamo does not trace again: our compile per bucket is the recompile)."""
    model = _Broken()
    compiled = _compiled(model)
    _serve(compiled, model, (3, 9))
    before = tpu_inductor.compiles()
    with torch.compiler.set_stance("fail_on_recompile"):
        _serve(compiled, model, (5, 16, 12))  # buckets 8 and 16
        with pytest.raises(UnexpectedCompileError, match="fail_on_recompile"):
            _serve(compiled, model, (20,))
    assert tpu_inductor.compiles() == before
    _serve(compiled, model, (20,))  # outside it compiles, and is right
