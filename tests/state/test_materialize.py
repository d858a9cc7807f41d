"""`tpu_inductor.materialize`: a model built on the meta device, made on a mesh of 8 virtual CPU
devices (subprocesses: the device count is fixed when jax starts) module by module, against the
same model built eagerly and placed by `tpu_inductor.shard`: its values, its training, its peak
host memory; and the errors.

Values: a torch model (each layer draws in `reset_parameters()`, in construction order) comes
out bitwise equal to the eager build from the same seed, tied weights included. A Hugging Face
model cannot: eagerly every layer's constructor draws first and `post_init` draws again for the
whole model, while materialization draws module by module, so each random tensor is compared
in distribution (its mean within a quarter of its standard deviation, its standard deviation
within 15%: for the smallest, 512 elements, about 4 and 3.4 standard errors of the difference)
and every constant tensor and recomputed buffer (norms, rotary `inv_freq`) bitwise. Its
training is then compared from equal values (the eager model loads the materialized one's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import tpu_inductor
from tpu_inductor.exc import OptionError

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PRELUDE = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import json, sys, torch, torch.nn as nn, tpu_inductor
from tests import hf_zoo
mesh = tpu_inductor.Mesh({"data": 8})
plan = tpu_inductor.sharding_plans.fsdp("data")
"""

# Both models built twice from seed 0: on meta and materialized, eagerly and sharded; then 3
# compiled AdamW steps of each (the Hugging Face one from the materialized values).
_PARITY = """
def build(name):
    if name == "llama":
        cls, config = hf_zoo._config("llama", hf_zoo.TINY)
        return cls(config).eval()
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64),
                          nn.Linear(64, 64), nn.Linear(64, 16))
    model[4].weight = model[2].weight  # tied
    return model

def stats(model):
    return {n: [t.double().mean().item(), t.double().std().item() if t.numel() > 1 else 0.0]
            for n, t in model.state_dict().items()}

def train(model):
    torch._dynamo.reset()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    tpu_inductor.shard_optimizer_state(optimizer)
    forward = torch.compile(model, backend="tpu_inductor")
    step = torch.compile(optimizer.step, backend="tpu_inductor")
    g = torch.Generator().manual_seed(1)
    if name == "llama":
        ids = torch.randint(0, hf_zoo.VOCAB, (2, 8), generator=g)
        loss_of = lambda: forward(input_ids=ids, labels=ids, use_cache=False).loss
    else:
        x = torch.randn(8, 16, generator=g)
        loss_of = lambda: forward(x).square().mean()
    losses = []
    for _ in range(3):
        loss = loss_of()
        loss.backward()
        step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses

name = sys.argv[1]
torch.manual_seed(0)
with torch.device("meta"):
    built = build(name)
tpu_inductor.materialize(built, mesh, plan)
torch.manual_seed(0)
eager = build(name)
tpu_inductor.sync(built)
result = {"stats": [stats(built), stats(eager)]}
result["bitwise"] = {n: torch.equal(t, eager.state_dict()[n]) for n, t in built.state_dict().items()}
if name == "llama":
    eager.load_state_dict(built.state_dict())
    cls, config = hf_zoo._config("llama", hf_zoo.TINY)
    config.tie_word_embeddings = True
    with torch.device("meta"):
        tied = cls(config)
    tpu_inductor.materialize(tied, mesh, plan)
    result["tied"] = tied.lm_head.weight is tied.model.embed_tokens.weight
else:
    result["tied"] = built[4].weight is built[2].weight
tpu_inductor.shard(eager, mesh, plan)
result["losses"] = [train(built), train(eager)]
print(json.dumps(result))
"""


def _run(code: str, *args: str, timeout: int = 300) -> dict:
    command = [sys.executable, "-c", _PRELUDE + code, *args]
    done = subprocess.run(command, cwd=_ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", ["mlp", "llama"])
def test_a_model_built_on_meta_equals_the_eager_build_and_trains_as_it(name):
    result = _run(_PARITY, name)
    built, eager = result["stats"]
    assert result["tied"]  # tied parameters stay one tensor
    if name == "mlp":
        assert all(result["bitwise"].values()), result["bitwise"]
    else:
        random = [n for n, (_, std) in eager.items() if std > 0 and not n.endswith("inv_freq")]
        assert len(random) == 2 * 7 + 2, random  # q k v o gate up down per layer, embed, head
        for n in random:
            (mean, std), (eager_mean, eager_std) = built[n], eager[n]
            assert abs(mean - eager_mean) <= 0.25 * eager_std, (n, built[n], eager[n])
            assert abs(std / eager_std - 1) <= 0.15, (n, built[n], eager[n])
        constant = [n for n in eager if n not in random]
        assert all(result["bitwise"][n] for n in constant), result["bitwise"]
    materialized, placed = result["losses"]
    for a, b in zip(materialized, placed, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), result["losses"]


# ~200 MiB of float32 parameters, placed FSDP over 8 devices: the process's peak host memory
# (VmHWM, reset first) above its memory before, jax and the mesh's client started by a warm-up.
_PEAK = """
def build():
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(12)])

def status(key):
    line = next(line for line in open("/proc/self/status") if line.startswith(key))
    return int(line.split()[1]) * 1024

with torch.device("meta"):
    warm = nn.Sequential(nn.Linear(64, 64))
tpu_inductor.materialize(warm, mesh, plan)
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
torch.manual_seed(0)
if sys.argv[1] == "materialize":
    with torch.device("meta"):
        model = build()
    tpu_inductor.materialize(model, mesh, plan)
    host = None
else:
    model = build()
    host = status("VmRSS:") - before  # the whole model on the host, before any shard exists
    tpu_inductor.shard(model, mesh, plan)
parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
growth = status("VmHWM:") - before
print(json.dumps({"growth": growth, "host": host, "parameter_bytes": parameter_bytes}))
"""


def test_materializing_holds_one_layer_on_the_host_beyond_the_shards():
    """On the CPU the devices' shards are host memory too, so the bound is the parameters (the
    shards) plus one layer being initialized (and its shards' copies on their way) and a little
    overhead. An eager build holds the whole model on the host before `shard` moves it (tensor
    by tensor, each host copy released as its shards land: its peak is not twice the model
    either), which on an accelerator is host memory materializing never needs."""
    built = _run(_PEAK, "materialize")
    eager = _run(_PEAK, "eager")
    total, layer = built["parameter_bytes"], 2048 * 2049 * 4
    figures = {
        "parameters": total / 2**20,
        "materialize peak growth": built["growth"] / 2**20,
        "eager build": eager["host"] / 2**20,
        "eager build + shard peak growth": eager["growth"] / 2**20,
    }
    assert built["growth"] <= total + 2 * layer + 32 * 2**20, figures
    assert eager["host"] >= 0.95 * total, figures


# Errors: nothing is placed or moved before them (each model's first module raises).


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


class _Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def reset_parameters(self):
        nn.init.ones_(self.weight)  # (inv_freq forgotten)


def test_a_built_model_is_told_to_use_shard():
    with pytest.raises(OptionError, match=r"has no tensor on the meta device.*tpu_inductor\.shard"):
        tpu_inductor.materialize(nn.Linear(4, 4), tpu_inductor.Mesh({"data": 1}), {})


def test_a_module_without_initialization_is_named_with_what_to_define():
    with torch.device("meta"):
        model = nn.Sequential(_Scale(), nn.Linear(4, 4))
    with pytest.raises(OptionError, match=r"module '0' \(_Scale\) has meta tensors \(scale\).*"):
        tpu_inductor.materialize(model, tpu_inductor.Mesh({"data": 1}), {})
    with torch.device("meta"):
        model = nn.Sequential(_Rotary())
    with pytest.raises(OptionError, match=r"_Rotary\) left inv_freq unwritten.*reset_parameters"):
        tpu_inductor.materialize(model, tpu_inductor.Mesh({"data": 1}), {})
