"""`tpu-inductor bench` factories for the model families beyond Hugging Face's decoders: the
diffusers models of tests/models/test_diffusers.py and timm architectures of
tools/check_timm.py, at the same tiny sizes, random seeded weights, in eval mode (bench's
training step copies the model into train mode). From the repository root, one core:

    taskset -c 0 nice -n 19 .venv/bin/tpu-inductor bench --train --threads 1 \\
        tools.bench_families:unet2d_condition tools.bench_families:dit \\
        tools.bench_families:autoencoder_kl
    taskset -c 0 nice -n 19 /tmp/timmenv/bin/tpu-inductor bench --train --threads 1 \\
        tools.bench_families:resnet18 tools.bench_families:convnext_atto ...

The diffusers ones need the project's venv (diffusers), the timm ones timm's own venv (see
tools/check_timm.py).
"""

from __future__ import annotations

import torch


class _Positional(torch.nn.Module):
    """A diffusers model called positionally (bench calls `model(*inputs)`), its `.sample` out."""

    def __init__(self, model: torch.nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args):
        return self.model(**dict(zip(self.names, args))).sample


def _diffusers(name: str):
    from tests.models.test_diffusers import _build

    model, inputs = _build(name)
    return _Positional(model, tuple(inputs)).eval(), tuple(inputs.values())


def _timm(arch: str):
    from tools.check_timm import build

    model, images, _labels = build(arch)
    return model.eval(), (images,)


def unet2d_condition():
    return _diffusers("unet2d_condition")


def dit():
    return _diffusers("dit")


def autoencoder_kl():
    return _diffusers("autoencoder_kl")


def resnet18():
    return _timm("resnet18")


def efficientnet_b0():
    return _timm("efficientnet_b0")


def convnext_atto():
    return _timm("convnext_atto")


def vit_tiny():
    return _timm("vit_tiny")


def swin_tiny():
    return _timm("swin_tiny")
