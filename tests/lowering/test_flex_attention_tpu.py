"""FlexAttention's TPU lowering run, not only emitted (lowering/ops/flex_attention_kernels.py):
a training step's forward and backward traced to ATen, lowered by the TPU's rules and run on
this CPU with the Pallas kernels interpreted (`GraphRunner(..., interpret_kernels=True)`),
against eager torch. Causal, sliding-window, unmasked and document-masked attentions (GQA
too; a document's ids per sequence or per batch row, as TorchTitan packs them; the first n
keys, as bucketing masks padded keys) are Splash calls, the document ids or the keys kept its
segment ids (a row that keeps no key exact); a score_mod or a mask reading a captured
tensor any other way takes the XLA form, its reason counted. Compiled for the TPU, a training
step with a document mask holds the kernel's calls and no sequence x sequence tensor.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention.flex_attention import (
    and_masks,
    create_block_mask,
    flex_attention,
    noop_mask,
)
from tpu_inductor.lowering import lower
from tpu_inductor.lowering.dtypes import x64_scope
from tpu_inductor.lowering.interpreter import GraphRunner

from tpu_inductor import enable_flex_attention_training

LENGTH, DIM = 256, 128
_DOCUMENTS = torch.tensor([0] * 100 + [1] * 156)


def _causal(b, h, q, kv):
    return q >= kv


def _sliding(b, h, q, kv):
    return (q >= kv) & (q - kv <= 48)


def _document(b, h, q, kv):
    return (_DOCUMENTS[q] == _DOCUMENTS[kv]) & (q >= kv)


# TorchTitan's packing, per batch row (ids from positions that restart at each document;
# int64, as its cumsum makes them): row 0 three documents, row 1 two
_POSITIONS = torch.stack(
    [torch.cat([torch.arange(n) for n in lengths]) for lengths in ((100, 28, 128), (200, 56))]
)
_ROW_DOCUMENTS = torch.cumsum((_POSITIONS == 0).int(), dim=1) - 1


def _row_document(b, h, q, kv):
    return _ROW_DOCUMENTS[b, q] == _ROW_DOCUMENTS[b, kv]


def _document_ends(well_formed=True):
    """TorchTitan's causal packed-document fast path: `q <= doc_end[b, kv]`; not well formed,
    each key's "end" 40 positions on (a band, not documents)."""
    ends = torch.stack([torch.searchsorted(r, r, right=True) - 1 for r in _ROW_DOCUMENTS])
    if not well_formed:
        ends = torch.arange(LENGTH).expand(2, -1) + 40
    return lambda b, h, q, kv: q <= ends[b, kv]


_KEPT = torch.tensor(200)  # bucketing's mask of padded keys (passes/bucket_rules_flex.py)


def _first_keys(b, h, q, kv):
    return kv < _KEPT


def _alibi(score, b, h, q, kv):
    return score - (q - kv).abs() * 0.1


SPLASH, XLA = "tpu.flex_attention.splash", "tpu.flex_attention.xla: "
CASES = {  # mask_mod, score_mod, kv heads, batch, the choice expected
    "causal": (_causal, None, 4, 1, SPLASH),
    "sliding window": (_sliding, None, 4, 1, SPLASH),
    # (every key: torch's own noop mask, made outside the traced step as models make theirs)
    "every key, gqa": (noop_mask, None, 2, 1, SPLASH),
    "document, causal": (_document, None, 4, 1, SPLASH),
    # TorchTitan's and_masks(causal, document) over two packed rows, grouped-query heads
    "row documents, causal, gqa": (and_masks(_causal, _row_document), None, 2, 2, SPLASH),
    "row documents": (_row_document, None, 4, 2, SPLASH),
    "first keys, causal": (and_masks(_causal, _first_keys), None, 4, 1, SPLASH),
    "first keys, gqa": (_first_keys, None, 2, 2, SPLASH),
    # (row 1's last document lies past the first 200 keys: its rows keep no key)
    "first keys, documents": (and_masks(_row_document, _first_keys), None, 4, 2, SPLASH),
    "first keys, documents, causal": (
        and_masks(_causal, _row_document, _first_keys),
        None,
        2,
        2,
        SPLASH,
    ),
    "first keys, documents, window": (
        and_masks(_sliding, _row_document, _first_keys),
        None,
        4,
        2,
        XLA + "document ends or a",
    ),
    "document ends": (and_masks(_causal, _document_ends()), None, 4, 2, SPLASH),
    "ill-formed ends": (and_masks(_causal, _document_ends(False)), None, 2, 2, SPLASH),
    "ends, no causal": (_document_ends(), None, 4, 2, XLA + "a mask_mod"),
    "alibi": (_causal, _alibi, 4, 1, XLA + "a score_mod"),
}


def _step(mask_mod, score_mod, gqa, batch=1):
    """fn(q, k, v, grad) -> (output, dq, dk, dv): one flex_attention and its backward."""
    block_mask = create_block_mask(mask_mod, batch, None, LENGTH, LENGTH, device="cpu")

    def fn(q, k, v, grad):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            out = flex_attention(
                q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa
            )
            return (out, *torch.autograd.grad(out, (q, k, v), grad))

    return fn


@pytest.mark.parametrize("case", CASES)
def test_interpreted_tpu_lowering_equals_eager(case):
    enable_flex_attention_training()
    mask_mod, score_mod, kv_heads, batch, expected_choice = CASES[case]
    fn = _step(mask_mod, score_mod, kv_heads != 4, batch)
    q, k, v, grad = _inputs(batch, kv_heads)
    expected = fn(q, k, v, grad)
    gm = make_fx(fn, tracing_mode="real")(q, k, v, grad)  # (the block mask's tensors: constants)
    runner = GraphRunner(gm, x64="keep", platform="tpu", interpret_kernels=True)
    arrays = [jnp.asarray(t.numpy()) for t in (q, k, v, grad)]
    with x64_scope("keep"):  # (as lowering runs it: the mask's int64 indices stay int64)
        found = jax.jit(lambda *a: runner.run(a))(*arrays)
    for name, e, f in zip(("output", "dq", "dk", "dv"), expected, found):
        f = torch.from_numpy(np.array(f))
        relative = ((f - e).norm() / e.norm()).item()
        assert relative <= 1e-5, (case, name, relative)
    choices = dict(runner.choices)
    assert list(choices) == [next(c for c in choices if c.startswith(expected_choice))], choices
    assert sum(choices.values()) == 2  # the forward and the backward


def _inputs(batch, kv_heads):
    g = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(batch, 4, LENGTH, DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, LENGTH, DIM, generator=g) for _ in range(2))
    return q, k, v, grad


@pytest.mark.parametrize("ends", [False, True], ids=["document ids", "document ends"])
def test_a_document_mask_compiled_for_tpu_is_the_kernel_with_no_square_tensor(ends):
    """TorchTitan's causal packed-document masks (its document ids; its fast path's document
    ends, Splash where well formed, the XLA form's listed blocks where not) in a training step
    lowered for the TPU: the forward and the backward are Splash calls, and no tensor of the
    module is sequence x sequence (the scores stay in blocks)."""
    enable_flex_attention_training()
    fn = _step(and_masks(_causal, _document_ends() if ends else _row_document), None, True, 2)
    args = _inputs(2, 2)
    gm = make_fx(fn, tracing_mode="real")(*args)
    lowered = lower(gm, list(args), platform="tpu")
    ((choice, count),) = lowered.kernel_choices.items()
    assert choice.startswith(SPLASH) and count == 2, lowered.kernel_choices
    assert "tpu_custom_call" in lowered.text
    square = re.findall(rf"tensor<[0-9x]*\b{LENGTH}x{LENGTH}x[^>]*>", lowered.text)
    assert not square, sorted(set(square))


def test_document_ends_are_segment_ids_only_when_well_formed():
    """`q <= ends[kv]` under a causal mask is `ends[q] == ends[kv]` exactly when each position's
    end is its document's last position (the run-time check that picks Splash)."""
    from tpu_inductor.lowering.ops.flex_attention_kernels import _well_formed

    ends = torch.stack([torch.searchsorted(r, r, right=True) - 1 for r in _ROW_DOCUMENTS])
    assert bool(_well_formed(jnp.asarray(ends.numpy())))
    band = np.arange(LENGTH)[None] + 40
    assert not bool(_well_formed(jnp.asarray(band)))
    early = ends.clone()
    early[0, 5] = 4  # a key whose "end" is before it
    assert not bool(_well_formed(jnp.asarray(early.numpy())))
    split = ends.clone()
    split[0, 10] = 10  # a document's end repeated from inside it
    assert not bool(_well_formed(jnp.asarray(split.numpy())))
