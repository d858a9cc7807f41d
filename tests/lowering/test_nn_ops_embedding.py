"""Embedding and its dense backward (lowering/ops/embedding.py) against eager torch.

Each case calls one ATen overload directly, so the traced graph holds exactly that op; the
compile runs with fallback="error", so a missing rule fails instead of running in eager torch.
"""

from __future__ import annotations

import pytest
import torch

from tests.lowering.nn_helpers import F32, aten, rand, run, tokens

# --- embedding -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding(dtype):
    run(lambda w, i: aten.embedding(w, i), (rand(10, 6, dtype=dtype), tokens(3, 7)), F32)


@pytest.mark.parametrize("padding_idx, scale", [(-1, False), (2, False), (3, True)])
def test_embedding_dense_backward(padding_idx, scale):
    indices, grad = tokens(3, 7), rand(3, 7, 6)

    def backward(grad, indices):
        return aten.embedding_dense_backward(grad, indices, 10, padding_idx, scale)

    run(backward, (grad, indices), F32)
