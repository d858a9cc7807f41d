"""diffusers models through `torch.compile(..., backend="tpu_inductor")`, built from tiny
configs with random seeded weights (nothing is downloaded): a UNet2DConditionModel (cross
attention, timestep embedding, group norm, up/down sampling), a DiT (DiTTransformer2DModel:
patches, adaptive layer norm on timestep and class) and an AutoencoderKL (encoder, the
posterior's mode, decoder).

Each compiles whole (fallback="error", fullgraph=True, no graph break, no eager region):
inference output and a training step (loss and every gradient) equal eager's, and a bfloat16
step as close to float32 as eager's (tests/numerics.py). The UNet and the VAE take about a
minute each to compile on CI's two cores, and the bfloat16 steps more: they carry the `slow`
marker.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from tests import numerics
from tests.helpers import assert_same, grads_of
from tests.models.test_hf_models import _assert_compiled_whole
from tpu_inductor.debug import records

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

diffusers = pytest.importorskip("diffusers")

STRICT = {"fallback": "error"}
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _unet():
    model = diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    return model, lambda g: {
        "sample": torch.randn(2, 4, 8, 8, generator=g),
        "timestep": torch.tensor([10, 500]),
        "encoder_hidden_states": torch.randn(2, 6, 32, generator=g),
    }


def _dit():
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    )
    return model, lambda g: {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=g),
        "timestep": torch.tensor([10, 500]),
        "class_labels": torch.tensor([1, 7]),
    }


def _vae():
    model = diffusers.AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=16,
    )
    return model, lambda g: {"sample": torch.randn(2, 3, 16, 16, generator=g)}


MODELS = {"unet2d_condition": _unet, "dit": _dit, "autoencoder_kl": _vae}


def _build(name: str):
    torch.manual_seed(0)
    model, make = MODELS[name]()
    with torch.no_grad():  # zero-initialised layers (DiT's adaptive norm) get values too
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    for module in model.modules():  # DiT drops class labels at random when training
        if hasattr(module, "dropout_prob"):
            module.dropout_prob = 0.0
    return model.eval(), make(torch.Generator().manual_seed(1))


def _output(model, inputs) -> torch.Tensor:
    return model(**inputs).sample


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if n == "dit" else pytest.mark.slow) for n in sorted(MODELS)],
)
def test_diffusers_model_forward_and_training_match_eager(name):
    model, inputs = _build(name)
    compiled = torch.compile(copy.deepcopy(model), backend="tpu_inductor", options=STRICT)
    first = len(records.records)
    with torch.no_grad():
        assert_same(_output(compiled, inputs), _output(model, inputs), **TOL)
    _assert_compiled_whole(first, graphs=1)
    torch._dynamo.reset()
    counters.clear()
    model.train()
    trained = copy.deepcopy(model)
    compiled = torch.compile(trained, backend="tpu_inductor", options=STRICT)
    first = len(records.records)
    expected = _output(model, inputs).square().mean()
    actual = _output(compiled, inputs).square().mean()
    assert_same(actual, expected, **TOL)
    expected_grads, actual_grads = grads_of(model, expected), grads_of(trained, actual)
    assert len(actual_grads) == len(expected_grads) == len(list(model.parameters()))
    assert_same(actual_grads, expected_grads, **TOL)
    _assert_compiled_whole(first, graphs=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_diffusers_model_bfloat16_step_is_as_close_to_float32_as_eager(name):
    """tests/numerics.py's bfloat16 training step (the output and every gradient)."""
    model, inputs = _build(name)

    def run(fn, batch):
        out = _output(fn, batch)
        return out, out.float().square().mean()

    numerics.assert_as_close_as_eager(numerics.bfloat16_step_errors(model, inputs, run))
