"""16-bit training as close to float32 as eager's: the one comparison every model test shares.

`bfloat16_step_errors(model, batch, run)` takes one training step of a model three ways, from
the same bfloat16-rounded weights: eagerly in float32 (the reference), eagerly in bfloat16, and
compiled in bfloat16 (fallback="error", one Dynamo graph). It returns, for the logits, the loss
and every parameter's gradient, the relative distance of each bfloat16 run from the reference;
`assert_as_close_as_eager` holds the compiled one to at most twice eager's plus a floor.

Mixture-of-experts routing is a discrete choice: where two experts' router scores are within a
bfloat16 rounding of each other, either run may pick the other expert for a token and its
gradients then differ from float32's by tens of percent, by chance. `decisive_batch` picks the
first batch (by seed) on which every `torch.topk` the float32 model runs chooses by a margin
no bfloat16 rounding can cross, so a distance measures arithmetic, not a coin.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from tests.helpers import grads_of

STRICT = {"fallback": "error"}
FLOOR = 2**-8  # one bfloat16 rounding, relative
# How clearly a batch's routing must choose: the gap between the k-th and (k+1)-th scores of
# a topk, over the row's largest (a bfloat16 run's scores are off by about 2**-11 of it).
MARGIN = 2**-9

Run = Callable[[Callable, dict], tuple[torch.Tensor, torch.Tensor]]  # (fn, batch) -> logits, loss


def hf_run(fn: Callable, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A Hugging Face model's logits and loss (the batch carries its labels)."""
    out = fn(**batch)
    return out.logits, out.loss


def _step(model: torch.nn.Module, fn: Callable, batch: dict, run: Run) -> dict[str, torch.Tensor]:
    logits, loss = run(fn, batch)
    return {"logits": logits.detach(), "loss": loss.detach(), **grads_of(model, loss)}


def _relative(value: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    return ((value.double() - exact).norm() / exact.norm().clamp_min(1e-30)).item()


def _floats_as(batch: dict, dtype: torch.dtype) -> dict:
    return {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in batch.items()
    }


def bfloat16_step_errors(
    model: torch.nn.Module, batch: dict, run: Run = hf_run
) -> dict[str, tuple[float, float]]:
    """name -> (compiled bfloat16's, eager bfloat16's) relative distance from float32, for the
    logits, the loss and every parameter's gradient of one training step of `model`. Floating
    inputs are rounded to bfloat16 too (the reference takes the rounded values in float32)."""
    bf16 = copy.deepcopy(model).train().bfloat16()
    reference, compiled = copy.deepcopy(bf16).float(), copy.deepcopy(bf16)
    batch = _floats_as(batch, torch.bfloat16)
    exact = _step(reference, reference, _floats_as(batch, torch.float32), run)
    eager = _step(bf16, bf16, batch, run)
    fn = torch.compile(compiled, backend="tpu_inductor", options=STRICT, fullgraph=True)
    ours = _step(compiled, fn, batch, run)
    assert ours.keys() == eager.keys() == exact.keys()
    assert len(exact) == 2 + len(list(model.parameters()))  # every parameter has a gradient
    return {k: (_relative(ours[k], exact[k]), _relative(eager[k], exact[k])) for k in exact}


def assert_as_close_as_eager(errors: dict[str, tuple[float, float]], factor: float = 2.0):
    """Every compiled distance at most `factor` times eager's plus FLOOR; names the worst."""
    over = {k: (o, e) for k, (o, e) in errors.items() if o > factor * e + FLOOR}
    assert not over, f"further from float32 than {factor}x eager bfloat16's + {FLOOR}: {over}"


class _TopkMargins(TorchFunctionMode):
    """For every topk run under it, the smallest over its rows of the gap between the k-th and
    the (k+1)-th value, over the row's largest finite magnitude."""

    def __init__(self):
        super().__init__()
        self.margins: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            values, k = args[0], args[1] if len(args) > 1 else kwargs["k"]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
            ranked = values.detach().float().sort(dim, descending=largest).values
            if k < ranked.shape[dim]:
                gap = (ranked.narrow(dim, k - 1, 1) - ranked.narrow(dim, k, 1)).abs()
                finite = ranked.nan_to_num(posinf=0.0, neginf=0.0)  # masked-out choices
                scale = finite.abs().amax(dim, keepdim=True).clamp_min(1e-30)
                self.margins.append((gap / scale).min())
        return func(*args, **kwargs)


def decisive_batch(
    model: torch.nn.Module, make: Callable[[int], dict], run: Run = hf_run, tries: int = 64
) -> dict:
    """`make(seed)` for the first seed whose every topk, in a float32 run of the model's
    bfloat16-rounded weights, chooses by more than MARGIN of the row's largest finite value
    (about 4x the rounding noise a bfloat16 run's router scores carry); any batch of a model
    that routes nothing."""
    reference = copy.deepcopy(model).bfloat16().float().eval()
    for seed in range(tries):
        batch = make(seed)
        with torch.no_grad(), _TopkMargins() as recorder:
            run(reference, batch)
        if all(m > MARGIN for m in recorder.margins):
            return batch
    raise AssertionError(f"no batch of {tries} routes every token by a margin of {MARGIN}")
