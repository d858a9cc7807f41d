"""FlexAttention's TPU lowering run, not only emitted (lowering/ops/flex_attention_kernels.py):
a training step's forward and backward traced to ATen, lowered by the TPU's rules and run on
this CPU with the Pallas kernels interpreted (`GraphRunner(..., interpret_kernels=True)`),
against eager torch. Causal, sliding-window and unmasked attentions (GQA too) are Splash calls;
a score_mod or a mask reading captured tensors takes the XLA form, its reason counted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask
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


def _alibi(score, b, h, q, kv):
    return score - (q - kv).abs() * 0.1


CASES = {  # mask_mod, score_mod, kv heads, the choice expected
    "causal": (_causal, None, 4, "tpu.flex_attention.splash"),
    "sliding window": (_sliding, None, 4, "tpu.flex_attention.splash"),
    # (every key: torch's own noop mask, made outside the traced step as models make theirs)
    "every key, gqa": (noop_mask, None, 2, "tpu.flex_attention.splash"),
    "document": (_document, None, 4, "tpu.flex_attention.xla: score_mod or mask_mod reads"),
    "alibi": (_causal, _alibi, 4, "tpu.flex_attention.xla: a score_mod"),
}


def _step(mask_mod, score_mod, gqa):
    """fn(q, k, v, grad) -> (output, dq, dk, dv): one flex_attention and its backward."""
    block_mask = create_block_mask(mask_mod, None, None, LENGTH, LENGTH, device="cpu")

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
    mask_mod, score_mod, kv_heads, expected_choice = CASES[case]
    fn = _step(mask_mod, score_mod, kv_heads != 4)
    g = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(1, 4, LENGTH, DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, LENGTH, DIM, generator=g) for _ in range(2))
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
