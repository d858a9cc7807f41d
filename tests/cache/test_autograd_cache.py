"""torch's AOTAutogradCache carrying our graphs: a warm start skips AOTAutograd and lowering.

"A fresh process" is emulated in-process: Dynamo reset and our memory cache emptied, so the
second compile finds only the two disk caches (torch's AOTAutograd entries, our executables).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from tests.backend.test_fallback import _uses_unsupported_op
from tests.helpers import assert_same, grads_of
from tpu_inductor import decompositions
from tpu_inductor.cache import stores
from tpu_inductor.debug import records


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).softmax(-1)


def _fresh_start() -> None:
    torch._dynamo.reset()
    stores.memory_cache.clear()
    counters.clear()
    decompositions.table.cache_clear()


def _compile(model, cache_dir, **options):
    return torch.compile(
        model, backend="tpu_inductor", options={"cache_dir": str(cache_dir), **options}
    )


@pytest.fixture
def net():
    torch.manual_seed(0)
    return _Net(), torch.randn(8, 16)


def test_inference_warm_start_hits_aot_autograd_cache_and_skips_lowering(net, tmp_path):
    model, x = net
    with torch.no_grad():
        _fresh_start()
        assert_same(_compile(model, tmp_path)(x), model(x))
        assert counters["aot_autograd"]["autograd_cache_saved"] == 1
        _fresh_start()
        first_record = len(records.records)
        assert_same(_compile(model, tmp_path)(x), model(x))
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    (record,) = records.records[first_record:]
    assert record.cache["aot_autograd"] == "hit" and record.cache["decision"] == "disk_hit"
    assert "lower" not in record.timings and "pjrt_compile" not in record.timings
    assert "_table" not in vars(decompositions.table()), "a warm start built decompositions"


def test_training_warm_start_gives_eager_gradients(net, tmp_path):
    model, x = net
    expected = grads_of(model, model(x).square().sum())
    for _ in range(2):  # cold, then warm from both caches
        _fresh_start()
        trained = copy.deepcopy(model)
        loss = _compile(trained, tmp_path)(x).square().sum()
        assert_same(grads_of(trained, loss), expected)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    kinds = {r.graph.split("_")[0] for r in records.records[-2:]}
    assert kinds == {"forward", "backward"}
    assert all(r.cache.get("aot_autograd") == "hit" for r in records.records[-2:])


def test_our_entry_gone_means_a_recompile_not_an_error(net, tmp_path):
    model, x = net
    with torch.no_grad():
        _fresh_start()
        _compile(model, tmp_path / "ours")(x)
        shutil.rmtree(tmp_path / "ours")  # torch's entry stays, ours is gone
        _fresh_start()
        first_record = len(records.records)
        assert_same(_compile(model, tmp_path / "ours")(x), model(x))
    gone, recompiled = records.records[first_record:]
    assert gone.status == "failed" and "not in the compile cache" in gone.error
    assert recompiled.cache["decision"] == "miss" and "lower" in recompiled.timings
    assert counters["aot_autograd"]["autograd_cache_hit"] == 0


def test_other_options_are_another_aot_autograd_key(net, tmp_path):
    model, x = net
    with torch.no_grad():
        _fresh_start()
        _compile(model, tmp_path)(x)
        _fresh_start()
        assert_same(_compile(model, tmp_path, x64="narrow")(x), model(x))
    assert counters["aot_autograd"]["autograd_cache_miss"] == 1
    assert counters["aot_autograd"]["autograd_cache_hit"] == 0


def test_split_graph_is_not_stored_and_still_runs(tmp_path, caplog):
    x = torch.randn(16)
    # torch's loggers do not propagate to the root, where caplog listens: listen on this one
    log = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
    log.addHandler(caplog.handler)
    with caplog.at_level(logging.INFO, logger=log.name), contextlib.ExitStack() as undo:
        undo.callback(log.removeHandler, caplog.handler)
        for _ in range(2):
            _fresh_start()
            compiled = torch.compile(
                _uses_unsupported_op, backend="tpu_inductor", options={"cache_dir": str(tmp_path)}
            )
            assert_same(compiled(x), _uses_unsupported_op(x))
    assert counters["aot_autograd"]["autograd_cache_hit"] == 0
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 1
    assert any("a split graph" in r.getMessage() for r in caplog.records)


def test_cache_off_leaves_aot_autograd_cache_alone(net, tmp_path):
    model, x = net
    with torch.no_grad():
        _fresh_start()
        _compile(model, tmp_path, cache=False)(x)
    assert counters["aot_autograd"]["autograd_cache_miss"] == 0
    assert counters["aot_autograd"]["autograd_cache_saved"] == 0


def test_warm_start_applies_buffer_mutations(tmp_path):
    """BatchNorm in training mode: running statistics are input mutations AOTAutograd's cached
    wrappers must apply, as the traced ones do."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten()
    )
    x = torch.randn(4, 3, 8, 8)
    reference = copy.deepcopy(model)
    expected = grads_of(reference, reference(x).sum())
    for _ in range(2):  # cold, then warm from both caches
        _fresh_start()
        trained = copy.deepcopy(model)
        grads = grads_of(trained, _compile(trained, tmp_path)(x).sum())
        assert_same(grads, expected, atol=1e-4, rtol=1e-4)  # the conv bias's is ~0 (BN follows)
        assert_same(trained[1].running_mean, reference[1].running_mean)
        assert_same(trained[1].num_batches_tracked, reference[1].num_batches_tracked)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1


def test_cache_key_does_not_import_inductor_code_generators(tmp_path):
    """A fresh process: the cold compile stores an entry, and Inductor's codegen stays unloaded."""
    code = (
        "import sys, torch\n"
        "from torch._dynamo.utils import counters\n"
        f"f = torch.compile(lambda x: x.sin() * 2, backend='tpu_inductor', "
        f"options={{'cache_dir': {str(tmp_path)!r}}})\n"
        "x = torch.randn(5)\n"
        "torch.testing.assert_close(f(x), x.sin() * 2)\n"
        "assert counters['aot_autograd']['autograd_cache_saved'] == 1, counters['aot_autograd']\n"
        "codegen = ('torch._inductor.codegen.cpp', 'torch._inductor.select_algorithm')\n"
        "loaded = [m for m in codegen if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "from torch._inductor import codecache\n"
        "codecache.init_backend_registration()  # outside our backend call: registers\n"
        "assert all(m in sys.modules for m in codegen)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
