"""FlexAttention lowered (lowering/ops/flex_attention.py): the `flex_attention` higher-order op
and its backward, compiled whole with `fallback="error"`, against eager torch's own reference
(`sdpa_dense`, the math FlexAttention's kernels implement), forward and gradients, for every
mask and score_mod kind users write: none, causal, sliding window, document (segment) masks
from a captured tensor, ALiBi and soft-capping, grouped-query attention and a learnable bias.
float32 within 1e-5 relative; bfloat16 no further from a float64 run than eager's. Also: the
cache keys a score_mod's body (two score_mods alike but for their bodies are two compiles),
and torch's refusal of a CPU backward is lifted only by the explicit call.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from tpu_inductor import enable_flex_attention_training

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

BATCH, HEADS, LENGTH, DIM = 2, 4, 256, 16
WINDOW = 48


def _causal(b, h, q, kv):
    return q >= kv


def _sliding(b, h, q, kv):
    return (q >= kv) & (q - kv <= WINDOW)


_DOCUMENTS = torch.tensor([0] * 100 + [1] * 60 + [2] * 96)  # three packed documents


def _document(b, h, q, kv):
    return (_DOCUMENTS[q] == _DOCUMENTS[kv]) & (q >= kv)


def _softcap(score, b, h, q, kv):
    return 20 * torch.tanh(score / 20)


def _alibi(score, b, h, q, kv):
    slope = torch.exp2(-((h + 1) * 8.0 / HEADS))
    return score - slope * (q - kv).abs()


CASES = {
    "no mask": (None, None, {}),
    "causal": (_causal, None, {}),
    "sliding window": (_sliding, None, {}),
    "document": (_document, None, {}),
    "alibi, causal": (_causal, _alibi, {}),
    "soft-capping": (None, _softcap, {}),
    "gqa, causal": (_causal, None, {"enable_gqa": True}),
}


def _inputs(dtype, kv_heads=HEADS, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, LENGTH, DIM, generator=g)
    k, v = (torch.randn(BATCH, kv_heads, LENGTH, DIM, generator=g) for _ in range(2))
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _attention(mask_mod, score_mod, options):
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, LENGTH, LENGTH, device="cpu")

    def attend(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, **options)

    return attend


def _run(fn, inputs):
    """(output, gradients of q, k, v) of a backward with a fixed cotangent."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    cotangent = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)
    out.backward(cotangent)
    return [out.detach(), *(t.grad for t in inputs)]


def _compiled(fn):
    return torch.compile(fn, backend="tpu_inductor", options={"fallback": "error"}, fullgraph=True)


def _relative(found, expected):
    return ((found.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.fixture(autouse=True)
def _training():
    enable_flex_attention_training()


@pytest.mark.parametrize("case", CASES)
def test_forward_and_gradients_equal_eager_float32(case, compiled_graphs):
    mask_mod, score_mod, options = CASES[case]
    fn = _attention(mask_mod, score_mod, options)
    inputs = _inputs(torch.float32, kv_heads=2 if options else HEADS)
    expected, found = _run(fn, inputs), _run(_compiled(fn), inputs)
    for name, e, f in zip(("output", "dq", "dk", "dv"), expected, found):
        assert _relative(f, e) <= 1e-5, (case, name, _relative(f, e))
    assert len(compiled_graphs) == 2  # one forward, one backward: nothing left to eager torch
    (choice,) = compiled_graphs[0].lowered.kernel_choices  # the form chosen, and why
    assert choice.startswith("flex_attention.xla: "), choice


@pytest.mark.parametrize("case", ["causal", "document", "alibi, causal"])
def test_bfloat16_no_further_from_float64_than_eager(case):
    mask_mod, score_mod, options = CASES[case]
    fn = _attention(mask_mod, score_mod, options)
    inputs = _inputs(torch.bfloat16)
    exact = _run(fn, [t.double() for t in inputs])
    eager, found = _run(fn, inputs), _run(_compiled(fn), inputs)
    for name, x, e, f in zip(("output", "dq", "dk", "dv"), exact, eager, found):
        assert _relative(f, x) <= 2 * _relative(e, x) + 2**-8, (case, name)


def test_a_learnable_bias_captured_by_score_mod_gets_its_gradient():
    """A per-head, per-key bias table (a head-wise constant would have no gradient at all:
    softmax does not see it)."""
    table = torch.randn(HEADS, LENGTH, generator=torch.Generator().manual_seed(3))
    bias = table.requires_grad_()

    def attend(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, q, kv: s + bias[h, kv])

    q, k, v = _inputs(torch.float32)
    expected = _run(attend, [q, k, v]) + [bias.grad.clone()]
    bias.grad = None
    found = _run(_compiled(attend), [q, k, v]) + [bias.grad.clone()]
    for e, f in zip(expected, found):
        assert _relative(f, e) <= 1e-5


def test_two_score_mods_alike_but_for_their_bodies_are_two_compiles():
    """The cache keys a subgraph's body: the outer graphs of the two are alike, and a shared
    entry would run the first score_mod for the second."""
    q, k, v = (t.detach() for t in _inputs(torch.float32))
    for modify in (torch.tanh, torch.sin):

        def attend(q, k, v, modify=modify):
            return flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: modify(s))

        found, expected = _compiled(attend)(q, k, v), attend(q, k, v)
        torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)


def test_a_cpu_backward_is_refused_by_torch_until_enabled(monkeypatch):
    from torch.nn.attention import flex_attention as module

    from tpu_inductor.ops import flex_attention as lift

    torch_check = lift._original  # (the autouse fixture enabled it)
    monkeypatch.setattr(module, "_validate_device", torch_check)
    monkeypatch.setattr(lift, "_original", None)
    attend = _attention(_causal, None, {})
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        _run(attend, _inputs(torch.float32))
    enable_flex_attention_training()
    enable_flex_attention_training()  # idempotent: torch's check wrapped once
    assert lift._original is torch_check
    _run(attend, _inputs(torch.float32))  # eager's own dense backward runs


@pytest.mark.parametrize(
    "mask_mod, form", [(None, "every block computed and masked"), (_causal, "listed blocks alone")]
)
def test_long_queries_are_attended_a_block_at_a_time(mask_mod, form, compiled_graphs):
    """Past `ROWS` queries the score matrix is formed a block at a time (recomputed in the
    backward): of rows without a block mask, of the listed key blocks per query block with
    one. Equal to eager, and the executables' temporaries shrink with the block (figures:
    docs/benchmarks.md, FlexAttention)."""
    from tpu_inductor.lowering.ops.flex_attention import ROWS

    length = 4 * ROWS
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")

    def attend(q, k, v):
        return flex_attention(q, k, v, score_mod=_alibi, block_mask=block_mask)

    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(1, 2, length, DIM, generator=g) for _ in range(3)]
    expected, found = _run(attend, inputs), _run(_compiled(attend), inputs)
    for name, e, f in zip(("output", "dq", "dk", "dv"), expected, found):
        assert _relative(f, e) <= 1e-5, (name, _relative(f, e))
    whole = 2 * length * length * 4  # one float32 score matrix of the 2 heads
    forward, backward = (g.executable.get_compiled_memory_stats() for g in compiled_graphs)
    assert forward.temp_size_in_bytes < whole
    assert backward.temp_size_in_bytes < 1.5 * whole
    (choice,) = compiled_graphs[0].lowered.kernel_choices
    assert choice.endswith(form), choice


def test_blocks_the_block_mask_does_not_list_are_not_computed(compiled_graphs):
    """The XLA form visits the key blocks the block mask lists, nothing else: a block mask
    whose tables list each query block's own key block alone, its mask_mod keeping every key,
    gives block-diagonal attention (as torch's kernels give it; its eager reference reads
    mask_mod alone, so eager's side is the block-diagonal mask_mod)."""
    blocks = LENGTH // 128
    own = torch.arange(blocks, dtype=torch.int32).reshape(1, 1, blocks, 1)
    listed = BlockMask.from_kv_blocks(
        torch.ones(1, 1, blocks, dtype=torch.int32), own, BLOCK_SIZE=128,
        seq_lengths=(LENGTH, LENGTH),
    )  # fmt: skip

    def diagonal(b, h, q, kv):
        return q // 128 == kv // 128

    def attend(q, k, v):
        return flex_attention(q, k, v, block_mask=listed)

    inputs = _inputs(torch.float32)
    expected = _run(_attention(diagonal, None, {}), inputs)
    found = _run(_compiled(attend), inputs)
    for name, e, f in zip(("output", "dq", "dk", "dv"), expected, found):
        assert _relative(f, e) <= 1e-5, (name, _relative(f, e))
    (choice,) = compiled_graphs[0].lowered.kernel_choices
    assert choice.endswith("the listed blocks alone"), choice
