"""The norm fusion (passes/fuse_norms.py): written-out RMSNorm and LayerNorm → `tpu_inductor::norm`.

Float32: the forward and every gradient of a training step equal the unfused compile's (1e-6)
and eager torch's, for Hugging Face's Llama (LlamaRMSNorm) and T5 (T5LayerNorm), and for
LayerNorms written by hand (`var`, or `(x - m) ** 2` with a `/ sqrt`), and `F.rms_norm` (torch
decomposes it into the same chain); BERT's nn.LayerNorm is an ATen op already, left alone. Bfloat16: the fused results are no further from float64
than eager torch's; a norm written without casts (float32 statistics fused, bfloat16 steps
unfused) equals the unfused compile to bfloat16 rounding: 2 ulps (rtol = atol = 2**-6, ulp
≤ |x| * 2**-7 for bfloat16's 8 significant bits; h, once rounded fused, is rounded after each
of squares, mean, eps and rsqrt unfused, which moves the last bit of y by 1-2 ulps).
"""

from __future__ import annotations

import collections

import pytest
import torch
from tpu_inductor.passes import pipeline

from tests import hf_zoo
from tests.fusion_checks import (
    assert_dumped_rewrite,
    assert_option_validated_and_keyed,
    llama_trained_at_two_lengths,
    rewrites_since,
)
from tests.helpers import assert_same, grads_of


def _options(fuse: bool) -> dict:
    return {"cache": False, "fallback": "error", "fusion": {"norms": fuse}}


class HandLayerNorm(torch.nn.Module):
    """A LayerNorm written out: `var` and rsqrt, or `(x - m) ** 2` and a division by sqrt."""

    def __init__(self, features: int, form: str, cast: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(features, generator=g))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(features, generator=g))
        self.form, self.cast = form, cast

    def forward(self, x):
        h = x.float() if self.cast else x
        m = h.mean(-1, keepdim=True)
        if self.form == "var":
            h = (h - m) * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + 1e-5)
        else:
            h = (h - m) / torch.sqrt((h - m).pow(2).mean(-1, keepdim=True) + 1e-5)
        return self.weight * h.to(x.dtype) + self.bias


class HandRMSNorm(torch.nn.Module):
    """An RMSNorm written without casts (in bfloat16, every step rounds unfused)."""

    def __init__(self, features: int):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(features, generator=g))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6))


def _module_step(module: torch.nn.Module, x: torch.Tensor, options: dict | None):
    """(output, grads of x and parameters, rewrites) of one step of `module` on `x`: compiled
    with `options`, or eager for None. The loss weighs each output so no gradient is trivial."""
    x = x.detach().requires_grad_()
    module.zero_grad()
    before = collections.Counter(pipeline.counters)
    torch._dynamo.reset()
    run = module if options is None else torch.compile(module, backend="tpu_inductor", **options)
    y = run(x)
    weights = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape)
    (y.double() * weights).sum().backward()
    grads = {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}
    return y.detach(), grads, rewrites_since("norms", before)


class FunctionalRMSNorm(HandRMSNorm):
    """`F.rms_norm`, which torch decomposes into the written-out chain (with `add.Scalar`)."""

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, 1e-6)


HAND = {
    "functional_rms_norm": FunctionalRMSNorm,
    "layer_norm_var": lambda d: HandLayerNorm(d, "var"),
    "layer_norm_sqrt": lambda d: HandLayerNorm(d, "sqrt"),
    "layer_norm_cast": lambda d: HandLayerNorm(d, "var", cast=True),
    "rms_norm": HandRMSNorm,
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_hand_written_float32_equals_unfused_and_eager(name):
    module = HAND[name](24)
    x = torch.randn(3, 7, 24, generator=torch.Generator().manual_seed(5)) * 2 + 0.5
    fused, fused_grads, rewrites = _module_step(module, x, {"options": _options(True)})
    unfused, unfused_grads, off = _module_step(module, x, {"options": _options(False)})
    kind = "rms_norm" if name.endswith("rms_norm") else "layer_norm"
    assert rewrites == {kind: 1} and off == {}, rewrites
    assert_same(fused, unfused, rtol=1e-6, atol=1e-6)
    assert_same(fused_grads, unfused_grads, rtol=1e-6, atol=1e-6)
    eager, eager_grads, _ = _module_step(module, x, None)
    assert_same(fused, eager)
    assert_same(fused_grads, eager_grads)


def _error(t: torch.Tensor, reference: torch.Tensor) -> float:
    return ((t.double() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("name", sorted(HAND))
def test_hand_written_bfloat16_no_less_accurate_than_eager(name):
    """Against the float64 module: the fused step's output and gradients no further than eager
    torch's in bfloat16; the output equal to the unfused compile to bfloat16 rounding."""
    x = torch.randn(3, 7, 24, generator=torch.Generator().manual_seed(6)) * 2 + 0.5
    module = HAND[name](24)
    exact, exact_grads, _ = _module_step(module.double(), x.double(), None)
    module = module.bfloat16()
    x = x.bfloat16()
    fused, fused_grads, rewrites = _module_step(module, x, {"options": _options(True)})
    unfused, _, _ = _module_step(module, x, {"options": _options(False)})
    eager, eager_grads, _ = _module_step(module, x, None)
    assert sum(rewrites.values()) == 1, rewrites
    assert _error(fused, exact) <= _error(eager, exact) * 1.05
    for key, grad in fused_grads.items():
        assert _error(grad, exact_grads[key]) <= _error(eager_grads[key], exact_grads[key]) * 1.05
    assert_same(fused, unfused, rtol=2**-6, atol=2**-6)


def _train_step(name: str, options: dict, dtype=torch.float32):
    model, kwargs = hf_zoo.build(name)
    model = model.to(dtype)
    torch._dynamo.reset()
    before = collections.Counter(pipeline.counters)
    compiled = torch.compile(model, backend="tpu_inductor", options=options)
    labels = kwargs.get("decoder_input_ids", kwargs["input_ids"])
    out = compiled(**kwargs, labels=labels)
    grads = grads_of(model, out.loss)
    return (out.logits.detach(), out.loss.detach()), grads, rewrites_since("norms", before)


# model -> RMSNorms in the forward of hf_zoo's two layers: Llama two per layer and the final
# one; T5 three per decoder layer, two per encoder layer, a final one each; BERT's are
# nn.LayerNorm (native_layer_norm, one ATen op already): none
EXPECTED = {"llama": 5, "t5": 12, "bert": 0}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_training_step_equals_unfused_and_eager(name):
    fused, fused_grads, rewrites = _train_step(name, _options(True))
    unfused, unfused_grads, off = _train_step(name, _options(False))
    assert off == {}
    assert rewrites == ({"rms_norm": EXPECTED[name]} if EXPECTED[name] else {}), rewrites
    assert_same(fused, unfused, rtol=1e-6, atol=1e-6)
    assert fused_grads.keys() == unfused_grads.keys()
    assert_same(fused_grads, unfused_grads, rtol=1e-6, atol=1e-6)
    model, kwargs = hf_zoo.build(name)
    eager = model(**kwargs, labels=kwargs.get("decoder_input_ids", kwargs["input_ids"]))
    assert_same(fused, (eager.logits.detach(), eager.loss.detach()))
    assert_same(fused_grads, grads_of(model, eager.loss))


def test_llama_bfloat16_no_less_accurate_than_eager():
    """Llama in bfloat16 (HF casts to float32 itself): the fused logits no further from the
    float64 model's than eager torch's bfloat16 ones."""
    model, kwargs = hf_zoo.build("llama")
    with torch.no_grad():
        exact = model.double()(**kwargs).logits
        eager = model.bfloat16()(**kwargs).logits
        torch._dynamo.reset()
        before = collections.Counter(pipeline.counters)
        fused = torch.compile(model, backend="tpu_inductor", options=_options(True))(**kwargs)
    assert rewrites_since("norms", before) == {"rms_norm": 5}
    assert _error(fused.logits, exact) <= _error(eager, exact) * 1.05


def test_symbolic_lengths():
    """Llama trained at two lengths with dynamic=True: the norms fuse (the normalized dim is
    the hidden one, never bucketed) and logits and every gradient equal eager torch's."""
    rewrites = llama_trained_at_two_lengths(_options(True), "norms")
    assert rewrites.get("rms_norm", 0) >= 5


def test_dump_shows_the_rewrite(tmp_path):
    """The rewrite is in the dumps: the pass's graph and its diff from the graph before it."""
    assert_dumped_rewrite(
        tmp_path,
        "norms",
        {"rms_norm": 5},
        added=("tpu_inductor.norm.default", 5),
        removed=("aten.rsqrt.default", 5),
    )


def test_option_is_validated_and_in_the_cache_key():
    assert_option_validated_and_keyed("norms")


def test_chain_node_read_elsewhere_is_kept():
    """A statistic the graph also returns (the variance) stays as the graph computed it,
    counted `kept` (the mean of squares and its squares), and every result equals eager."""
    from tests.helpers import check_against_eager

    def fn(x, w):
        variance = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(variance + 1e-6)), variance

    before = collections.Counter(pipeline.counters)
    check_against_eager(fn, torch.randn(4, 16), torch.randn(16), options=_options(True))
    assert rewrites_since("norms", before) == {"rms_norm": 1, "kept": 2}


def test_narrowing_convert_is_not_fused():
    """A statistic of x.to(bfloat16) scaling the float32 x is no norm of one value (the op
    would scale the rounded x): left alone, and equal to eager within the statistic's one
    bfloat16 rounding (eager's bfloat16 rsqrt is not always the nearest: 0.984375 for
    rsqrt(1.0390625), where XLA's is 0.98046875, nearer 0.98102)."""
    from tests.helpers import compile_aten

    def fn(x):
        r = torch.rsqrt(x.bfloat16().pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * r

    def statistic(x):
        return torch.rsqrt(x.double().bfloat16().double().pow(2).mean(-1, keepdim=True) + 1e-6)

    x = torch.randn(4, 16)
    before = collections.Counter(pipeline.counters)
    actual = compile_aten(fn, (x,), _options(True))(x)
    assert rewrites_since("norms", before) == {}
    assert actual.dtype == torch.float32
    exact = x.double() * statistic(x)
    torch.testing.assert_close(actual.double(), exact, rtol=2**-6, atol=0)  # bfloat16 roundings
    ours, eager = (actual.double() - exact).abs().max(), (fn(x).double() - exact).abs().max()
    assert ours <= eager + 1e-6, f"further from float64 than eager: {ours} > {eager}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("centered", "divide"), [(False, False), (True, False), (True, True)])
def test_op_lowering_equals_its_eager_kernel(dtype, centered, divide):
    """The op's lowering (lowering/ops/norm.py) equals its eager kernel (what runs where a
    region falls back to eager), and its fake kernel agrees with that kernel (opcheck)."""
    from tests.helpers import check_against_eager
    from tpu_inductor.ops.norm import ops as ours

    g = torch.Generator().manual_seed(7)
    x, w, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((3, 5, 16), (16,), (16,)))
    eps = torch.tensor(1e-5)

    def fn(x, w, b, eps):
        return ours.norm(x, w, b, eps, centered, divide, dtype)

    check_against_eager(fn, x, w, b, eps)
    torch.library.opcheck(ours.norm.default, (x, w, b, eps, centered, divide, dtype))


def test_with_the_other_fusions():
    """Llama trained with every fusion on: each pass still fires (the merged projections read
    the norm op's result) and logits and every gradient equal eager torch's."""
    model, kwargs = hf_zoo.build("llama")
    torch._dynamo.reset()
    before = collections.Counter(pipeline.counters)
    every = {"norms": True, "matmuls": True, "attention": True}
    options = {**_options(True), "fusion": every}
    out = torch.compile(model, backend="tpu_inductor", options=options)(
        **kwargs, labels=kwargs["input_ids"]
    )
    grads = grads_of(model, out.loss)
    eager = model(**kwargs, labels=kwargs["input_ids"])
    assert_same(out.logits, eager.logits)
    assert_same(grads, grads_of(model, eager.loss))
    fired = {key for key, n in pipeline.counters.items() if n > before[key]}
    expected = {"fuse_norms.rms_norm", "fuse_matmuls.shared_input", "fuse_attention.sdpa_forward"}
    assert expected <= fired, fired
