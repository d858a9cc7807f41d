"""Mixture-of-experts: grouped matmuls (lowering/ops/moe.py) and whole MoE decoders.

- `aten._grouped_mm` in its four forms against eager and a float64 per-group reference, drawn
  by hypothesis (group counts, empty groups, rows past the last offset, sizes), its gradient
  against eager's, and a new routing (other group sizes) run by the same executable. Its meta
  function takes bfloat16 only, so torch.compile never traces a float32 one: float32 grouped
  matmuls reach the backend as transformers' `grouped_mm_fallback` custom op (and its backward
  op), tested through the same rule in float32.
- Qwen3-MoE, Mixtral, DeepSeek-V3, GPT-OSS, OLMoE and Qwen2-MoE decoders (tests/hf_zoo.py): their default
  experts implementation ("grouped_mm") and "batched_mm": forward and a training step (loss and
  every gradient) compiled whole with fallback="error" and fullgraph=True, equal to eager
  (1e-5), and a batch routed differently runs without a new compile. The full matrix carries
  the `slow` marker. Their bfloat16 training step against float32's, as close as eager's, is
  tests/models/test_bfloat16_numerics.py's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import tpu_inductor
from tests import hf_zoo
from tests.helpers import assert_same, compile_aten, grads_of
from tests.models.test_hf_models import _assert_compiled_whole
from tests.strategies import PROPERTY, seeds
from tpu_inductor.debug import records

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

STRICT = {"fallback": "error"}
STATIC = {"backend": "tpu_inductor", "options": STRICT, "fullgraph": True, "dynamic": False}
DYNAMIC = {**STATIC, "dynamic": True}
F32 = {"rtol": 1e-5, "atol": 1e-5}
FORMS = ("2d3d", "2d2d", "3d2d", "3d3d")


def _operands(form: str, sizes: list[int], tail: int, k: int, n: int, dtype, seed: int):
    """(a, b, offs) of a grouped matmul of `form`: its ragged dim (a's rows, the contracted
    dim, b's columns) split into `sizes`, then `tail` entries past the last offset. Ragged
    operands are laid out as AOTAutograd's backward passes them (transposes): torch wants
    16-byte aligned strides."""
    gen = torch.Generator().manual_seed(seed)
    g, ragged = len(sizes), sum(sizes) + tail

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if form == "2d3d":
        return rand(ragged, k), rand(g, k, n), offs
    if form == "2d2d":
        return rand(ragged, k).t(), rand(ragged, n), offs
    if form == "3d2d":
        return rand(g, n, k), rand(ragged, k).t(), offs
    return rand(g, n, k), rand(g, k, n), None


def _reference(form: str, a, b, sizes: list[int]):
    """The grouped matmul in float64, one matmul per group (zeros past the last offset)."""
    a, b = a.double(), b.double()
    if form == "3d3d":
        return a @ b
    ends = torch.tensor([0, *sizes]).cumsum(0).tolist()
    groups = list(zip(ends, ends[1:]))
    if form == "2d2d":
        return torch.stack([a[:, s:e] @ b[s:e] for s, e in groups])
    out = torch.zeros(a.shape[-2], b.shape[-1], dtype=torch.float64)
    for i, (s, e) in enumerate(groups):
        if form == "2d3d":
            out[s:e] = a[s:e] @ b[i]
        else:
            out[:, s:e] = a[i] @ b[:, s:e]
    return out


def _grouped_mm(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)


@PROPERTY
@given(
    form=st.sampled_from(FORMS),
    sizes=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    tail=st.sampled_from([0, 0, 3]),
    k=st.sampled_from([8, 16]),
    n=st.sampled_from([8, 24]),
    seed=seeds(),
)
def test_grouped_mm_matches_eager_and_float64(form, sizes, tail, k, n, seed):
    """bfloat16 results equal eager's and are as close to float64 as eager's (one rounding of
    a float32 accumulation); rows (columns) past the last offset are zeros, which eager leaves
    unset."""
    a, b, offs = _operands(form, sizes, tail, k, n, torch.bfloat16, seed)
    actual = compile_aten(_grouped_mm, (a, b, offs))(a, b, offs)
    expected, exact = _grouped_mm(a, b, offs), _reference(form, a, b, sizes)
    past = {"2d3d": (slice(sum(sizes), None),), "3d2d": (..., slice(sum(sizes), None))}
    if form in past and tail:
        assert not actual[past[form]].any()
        covered = {"2d3d": (slice(0, sum(sizes)),), "3d2d": (..., slice(0, sum(sizes)))}[form]
        actual, expected, exact = actual[covered], expected[covered], exact[covered]
    assert_same(actual, expected)
    ours, eagers = (torch.abs(r.double() - exact) for r in (actual, expected))
    assert (ours <= eagers + 1e-6).all(), (ours.max(), eagers.max())


def _eager_and_compiled(fn, compiled, a, b, offs, grad):
    """(output, input gradient, weight gradient) of eager `fn` and of `compiled` on fresh
    leaves of the same operands, for the grouped-matmul tests' comparisons."""
    results = []
    for call in (fn, compiled):
        x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = call(x, w, offs)
        (out * grad).sum().backward()
        results.append((out, x.grad, w.grad))
    return results


@PROPERTY
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=4), seed=seeds())
def test_grouped_mm_gradient_matches_eager(sizes, seed):
    """The MoE form's backward (a 2-D x 2-D grouped matmul for the weights, a 2-D x 3-D one
    for the input) through torch.compile, against eager's gradients."""
    torch._dynamo.reset()  # each drawn case is a new program
    a, b, offs = _operands("2d3d", sizes, 0, 16, 8, torch.bfloat16, seed)
    grad = torch.randn(a.shape[0], 8, generator=torch.Generator().manual_seed(seed)).bfloat16()
    compiled = torch.compile(_grouped_mm, **STATIC)
    eager, ours = _eager_and_compiled(_grouped_mm, compiled, a, b, offs, grad)
    assert_same(ours[1:], eager[1:])
    empty = [i for i, s in enumerate(sizes) if s == 0]
    assert not ours[2][empty].any()


def test_new_group_sizes_run_without_a_compile():
    """Group sizes are runtime values: other offsets (an expert with no tokens, one with all)
    run the executable the first call compiled."""
    compiled = torch.compile(_grouped_mm, **STATIC)
    a, b, _ = _operands("2d3d", [3, 3, 2], 0, 16, 8, torch.bfloat16, seed=0)
    routings = ([3, 3, 2], [0, 8, 0], [1, 0, 7], [8, 0, 0])
    for i, sizes in enumerate(routings):
        offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        assert_same(compiled(a, b, offs), _grouped_mm(a, b, offs))
        if i == 0:
            compiles = tpu_inductor.compiles()
    assert tpu_inductor.compiles() == compiles


def test_grouped_mm_symbolic_sizes_match_eager():
    """One graph with symbolic sizes serves token counts that are not multiples of 8, forward
    and gradients equal to eager's. The backward's weight gradient reads the input's transpose
    saved by the forward; saved on the device it comes back dense, where the graph has it as a
    transposed view, and torch's _grouped_mm meta refuses the dense layout at an odd count:
    the graph is specialized with the strides it was traced with (passes/shapes.py)."""
    compiled = torch.compile(_grouped_mm, **DYNAMIC)
    for rows in (13, 21, 7):
        a, b, offs = _operands(
            "2d3d",
            [rows // 3, rows // 2, rows - rows // 3 - rows // 2],
            0,
            16,
            8,
            torch.bfloat16,
            seed=rows,
        )
        grad = torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows)).bfloat16()
        eager, ours = _eager_and_compiled(_grouped_mm, compiled, a, b, offs, grad)
        assert_same(ours, eager)
    assert counters["stats"]["unique_graphs"] == 1  # every size ran the symbolic graph


@PROPERTY
@given(
    sizes=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    tail=st.sampled_from([0, 2]),
    k=st.integers(1, 6),
    n=st.integers(1, 6),
    seed=seeds(),
)
def test_transformers_grouped_mm_fallback_matches_eager(sizes, tail, k, n, seed):
    """transformers' float32 expert matmul and its backward op (what a float32 MoE model
    traces to) through the same rule, forward and gradients equal to eager at 1e-5."""
    pytest.importorskip("transformers.integrations.moe")
    torch._dynamo.reset()  # each drawn case is a new program
    op = torch.ops.transformers.grouped_mm_fallback
    x, w, offs = _operands("2d3d", sizes, tail, k, n, torch.float32, seed)
    grad = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(seed))
    compiled = torch.compile(op, **STATIC)
    eager, ours = _eager_and_compiled(op, compiled, x, w, offs, grad)
    assert_same(ours, eager, **F32)


# --- whole models -----------------------------------------------------------------------------

FAST = {("qwen3_moe", None), ("mixtral", None), ("deepseek_v3", None), ("gpt_oss", None)}
CASES = [
    pytest.param(
        name,
        experts,
        id=f"{name}-{experts or 'default'}",
        marks=() if (name, experts) in FAST else pytest.mark.slow,
    )
    for name in hf_zoo.MOE
    for experts in (None, "batched_mm")
]


def _model(name: str, experts: str | None, dtype=torch.float32):
    model, inputs = hf_zoo.build(name, experts=experts)
    if experts is None:
        assert model.config._experts_implementation == "grouped_mm"
    return model.to(dtype), inputs


def _compiled(model):
    compiled = torch.compile(model, backend="tpu_inductor", options=STRICT, fullgraph=True)
    return compiled, len(records.records)


@pytest.mark.parametrize(("name", "experts"), CASES)
def test_moe_model_forward_and_training_match_eager(name, experts):
    model, inputs = _model(name, experts)
    compiled, first = _compiled(copy.deepcopy(model))
    with torch.no_grad():
        assert_same(compiled(**inputs).logits, model(**inputs).logits, **F32)
    _assert_compiled_whole(first, graphs=1)
    torch._dynamo.reset()
    counters.clear()
    model.train()
    inputs["labels"] = inputs["input_ids"]
    trained = copy.deepcopy(model)
    compiled, first = _compiled(trained)
    expected, actual = model(**inputs).loss, compiled(**inputs).loss
    assert_same(actual, expected, **F32)
    expected_grads, actual_grads = grads_of(model, expected), grads_of(trained, actual)
    assert len(actual_grads) == len(list(model.parameters()))
    assert_same(actual_grads, expected_grads, **F32)
    _assert_compiled_whole(first, graphs=2)


def test_moe_model_new_routing_runs_without_a_compile():
    """Batches that send other numbers of tokens to each expert run the executable the first
    batch compiled (group sizes are values, not shapes), with eager's results."""
    model, inputs = _model("qwen3_moe", None)
    routes = []
    gate = model.model.layers[0].mlp.gate
    hook = gate.register_forward_hook(lambda _m, _a, out: routes.append(out[2].flatten()))
    compiled, _ = _compiled(copy.deepcopy(model))
    counts = []
    with torch.no_grad():
        for seed in range(3):
            gen = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, hf_zoo.VOCAB, inputs["input_ids"].shape, generator=gen)
            batch = {**inputs, "input_ids": ids}
            assert_same(compiled(**batch).logits, model(**batch).logits, **F32)
            counts.append(torch.bincount(routes[-1], minlength=4).tolist())
            if seed == 0:
                compiles = tpu_inductor.compiles()
    hook.remove()
    assert len({tuple(c) for c in counts}) == 3, counts  # three routings
    assert tpu_inductor.compiles() == compiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moe_model_symbolic_sequence_length_matches_eager(dtype):
    """Qwen3-MoE (default experts: transformers' grouped_mm_fallback in float32,
    aten._grouped_mm in bfloat16) compiled with dynamic=True: one Dynamo graph serves
    sequence lengths 7 and 9 (odd token counts), logits equal to eager (bfloat16: to its
    rounding, 2**-8 relative)."""
    model, inputs = _model("qwen3_moe", None, dtype)
    compiled = torch.compile(copy.deepcopy(model), **{**DYNAMIC, "options": STRICT})
    tol = F32 if dtype == torch.float32 else {"rtol": 2**-8, "atol": 2**-8}
    with torch.no_grad():
        for seq in (7, 9):
            gen = torch.Generator().manual_seed(seq)
            ids = torch.randint(0, hf_zoo.VOCAB, (2, seq), generator=gen)
            batch = {**inputs, "input_ids": ids}
            assert_same(compiled(**batch).logits, model(**batch).logits, **tol)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
