"""nll_loss and multilabel_margin_loss (lowering/ops/losses.py) against eager torch.

Each case calls one ATen overload directly, so the traced graph holds exactly that op; the
compile runs with fallback="error", so a missing rule fails instead of running in eager torch.
"""

from __future__ import annotations

import pytest
import torch

from tests.lowering.nn_helpers import F32, STRICT, aten, rand, run, tokens

# --- losses ----------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kind", ["unbatched", "1d", "2d"])
def test_nll_loss(kind, weighted, reduction):
    """Every case has targets equal to ignore_index (their loss and gradient are 0, their
    weight is not counted); the unbatched one is that target alone."""
    ignore = 1
    if kind == "unbatched":
        x, target = rand(5).log_softmax(0), torch.tensor(ignore)
        forward, backward = aten.nll_loss_forward, aten.nll_loss_backward
    elif kind == "1d":
        x, target = rand(8, 5).log_softmax(1), tokens(8, high=5)
        forward, backward = aten.nll_loss_forward, aten.nll_loss_backward
    else:
        x, target = rand(2, 5, 3, 4).log_softmax(1), tokens(2, 3, 4, high=5)
        forward, backward = aten.nll_loss2d_forward, aten.nll_loss2d_backward
    target.view(-1)[::3] = ignore
    weight = rand(5, seed=1).abs() if weighted else None
    run(lambda x, t, w: forward(x, t, w, reduction, ignore), (x, target, weight), F32)
    loss, total = forward(x, target, weight, reduction, ignore)
    grad = torch.randn(loss.shape, generator=torch.Generator().manual_seed(2))

    def grad_fn(g, x, t, w, total):
        return backward(g, x, t, w, reduction, ignore, total)

    run(grad_fn, (grad, x, target, weight, total), F32)


# A -1 ends a row's targets: the entries after it are not targets. The last row has a margin of
# exactly 0 (1 - 1.5 + 0.5), where torch's gradient is 0.
_MLM_TARGETS = torch.tensor([[3, 0, -1, 1, 2], [1, -1, 2, 2, 0], [0, 4, 2, 1, 3], [0, -1, 1, 1, 1]])


def _mlm_inputs():
    x = rand(4, 5)
    x[3, :2] = torch.tensor([1.5, 0.5])
    return x


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("batched", [True, False], ids=["2d", "1d"])
def test_multilabel_margin_loss(batched, reduction):
    x, target = _mlm_inputs(), _MLM_TARGETS
    if not batched:
        x, target = x[0], target[0]

    def loss_and_grad(x, t):
        loss = torch.nn.functional.multilabel_margin_loss(x, t, reduction=reduction)
        # torch's meta shapes a 1-d input's unreduced loss (1,), its kernel ()
        return loss.reshape(-1), torch.autograd.grad(loss.sum(), x)[0]

    run(loss_and_grad, (x.requires_grad_(), target), F32)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multilabel_margin_loss_through_dynamo(reduction):
    """torch also installs its wrong decomposition as the op's Autograd kernel, which tracing
    runs before any table: taken out while tracing (tpu_inductor.decompositions)."""
    x, target = _mlm_inputs(), _MLM_TARGETS

    def loss(x, t):
        return torch.nn.functional.multilabel_margin_loss(x, t, reduction=reduction)

    compiled = torch.compile(loss, backend="tpu_inductor", options=STRICT)
    leaf, want_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = compiled(leaf, target), loss(want_leaf, target)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(leaf.grad, want_leaf.grad)
    kernels = torch.ops.aten.multilabel_margin_loss_forward.default.py_kernels
    assert torch._C.DispatchKey.Autograd in kernels  # put back for everyone else
