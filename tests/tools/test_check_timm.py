"""tools/check_timm.py's judgement on its own (timm itself runs in a venv of its own, by hand):
what it calls equal to eager, and that it still sees a wrong or a missing gradient; and
tools/bench_families.py's diffusers factories, which bench calls positionally."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_same
from tools import bench_families
from tools.check_timm import table, unequal


def _runs(noise: float, wrong: float = 0.0):
    """A float64 truth, eager float32's rounding of it, and a compiled run `noise` and `wrong`
    away; "zero" is a gradient exact arithmetic makes 0 (a bias before a batch norm)."""
    gen = torch.Generator().manual_seed(0)
    exact = {"out": torch.randn(64, generator=gen, dtype=torch.float64), "zero": torch.zeros(64)}
    exact["zero"] = exact["zero"].double()
    eager = {"out": exact["out"].float(), "zero": 1e-3 * torch.randn(64, generator=gen)}
    found = {k: v + noise * torch.randn(64, generator=gen) for k, v in eager.items()}
    found["out"] = found["out"] + wrong
    return found, eager, exact


def test_equal_within_tolerance_or_as_close_to_float64_as_eager():
    found, eager, exact = _runs(noise=1e-6)
    assert unequal(found, eager, exact) == []
    # noise on a zero gradient, beyond assert_close's atol from eager's but as far from float64
    found["zero"] = 1e-3 * torch.randn(64, generator=torch.Generator().manual_seed(1))
    assert not torch.allclose(found["zero"], eager["zero"], rtol=1e-4, atol=1e-4)
    assert unequal(found, eager, exact) == []
    found["zero"] = 3 * found["zero"]  # three times eager's distance from float64
    assert unequal(found, eager, exact) == ["zero"]


def test_a_wrong_or_missing_tensor_is_named():
    found, eager, exact = _runs(noise=1e-6, wrong=1e-2)
    assert unequal(found, eager, exact) == ["out"]
    del found["zero"]
    assert unequal(found, eager, exact) == ["zero", "out"]


def test_table_names_each_backends_failures_and_pass_rate():
    rows = [
        {"arch": "resnet18", "backend": "tpu_inductor", "ok": True},
        {"arch": "resnet18", "backend": "inductor", "ok": False, "reason": "Error: no rule"},
    ]
    text = table(rows)
    assert "| resnet18 | ResNet | pass | FAIL Error: no rule |" in text
    assert "tpu_inductor: 1/1 pass" in text and "inductor: 0/1 pass" in text


def test_bench_factory_calls_a_diffusers_model_positionally():
    pytest.importorskip("diffusers")
    from tests.models.test_diffusers import _build

    model, inputs = bench_families.dit()
    direct, batch = _build("dit")
    with torch.no_grad():
        assert_same(model(*inputs), direct(**batch).sample)
