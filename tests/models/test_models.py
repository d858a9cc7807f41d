"""Small models end to end through `torch.compile(..., backend="tpu_inductor")` against eager.

Every compile uses fallback="error", so an op without a rule fails the test instead of running
in eager torch. Forward outputs, every parameter gradient and updated buffers are compared.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import assert_same, grads_of

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

STRICT = {"fallback": "error"}
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _compiled(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="tpu_inductor", options=STRICT)


def _check_model(model: nn.Module, loss_fn, *inputs):
    """Forward results, parameter gradients and buffers of a compiled copy match eager."""
    eager, compiled = model, copy.deepcopy(model)
    expected, actual = eager(*inputs), _compiled(compiled)(*inputs)
    assert_same(actual, expected, **TOL)
    assert_same(grads_of(compiled, loss_fn(actual)), grads_of(eager, loss_fn(expected)), **TOL)
    assert_same(dict(compiled.named_buffers()), dict(eager.named_buffers()), **TOL)


# --- MLP and CNN -----------------------------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


class SmallCNN(nn.Module):
    """conv, batch norm, max pool, strided conv, group norm, upsampling, avg pools, linear."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = (
            nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(16),
        )
        self.gn = nn.GroupNorm(4, 16)
        self.head = nn.Linear(16 * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.avg_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.interpolate(self.gn(x), scale_factor=2, mode="nearest")
        return self.head(F.adaptive_avg_pool2d(x, 2).flatten(1))


def test_mlp():
    x = torch.randn(8, 16)
    _check_model(_mlp(), lambda out: out.square().mean(), x)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_cnn(mode):
    torch.manual_seed(0)
    model = SmallCNN().train(mode == "train")
    x = torch.randn(4, 3, 16, 16)
    _check_model(model, lambda out: out.square().mean(), x)


def test_cnn_inference_no_grad():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert_same(_compiled(copy.deepcopy(model))(x), model(x), **TOL)


# --- GPT -------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a GELU MLP, with dropout."""

    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    """Token + position embeddings, decoder blocks, final layer norm, LM head, cross-entropy."""

    def __init__(self, vocab=64, d=32, heads=2, layers=2, seq=16, dropout=0.0):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens, targets):
        x = self.drop(self.tok(tokens) + self.pos(torch.arange(tokens.shape[1])))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _gpt(dropout=0.0):
    torch.manual_seed(0)
    return TinyGPT(dropout=dropout)


def _batch(seed=1, vocab=64, batch=2, seq=16):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_gpt_forward_and_gradients():
    _check_model(_gpt(), lambda out: out[1], *_batch())


@torch.no_grad()
def test_gpt_dropout_is_random_and_seeded():
    model = _compiled(_gpt(dropout=0.2).train())
    tokens, targets = _batch()
    first, second = model(tokens, targets)[0], model(tokens, targets)[0]
    assert not torch.equal(first, second), "dropout gave the same result on two calls"
    torch.manual_seed(123)
    again = model(tokens, targets)[0]
    torch.manual_seed(123)
    assert torch.equal(model(tokens, targets)[0], again), "torch.manual_seed did not repeat"
    eval_logits = model.eval()(tokens, targets)[0]
    assert_same(eval_logits, _gpt(dropout=0.2).eval()(tokens, targets)[0], **TOL)


def _train(model: nn.Module, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, batch = [], _batch()
    for _ in range(steps):
        _, loss = model(*batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_gpt_adamw_training_loop():
    expected = _train(_gpt(), 20)
    actual = _train(_compiled(_gpt()), 20)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=0)
    assert expected[-1] < 0.9 * expected[0]  # the loop does train (one batch, overfit)


@pytest.mark.parametrize("optimizer", ["adam", "adamw_tensor_lr"])
def test_compiled_adam_steps_lower_inductors_fma(optimizer):
    """Dynamo traces Adam's addcmul_ as Inductor's prims.fma (an op that exists once Inductor's
    prims are imported): lowered by name, the step has no eager region."""
    torch.manual_seed(0)
    model, reference = _mlp(), _mlp()
    reference.load_state_dict(model.state_dict())
    if optimizer == "adam":
        make = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    else:
        make = lambda params: torch.optim.AdamW(params, lr=torch.tensor(1e-2))  # noqa: E731
    opt, reference_opt = make(model.parameters()), make(reference.parameters())
    step = torch.compile(opt.step, backend="tpu_inductor", options={"fallback": "error"})
    x = torch.randn(8, 16)
    for _ in range(3):
        for m in (model, reference):
            m.zero_grad()
            m(x).square().mean().backward()
        step()
        reference_opt.step()
    for got, want in zip(model.parameters(), reference.parameters()):
        assert_same(got, want, rtol=1e-5, atol=1e-6)


def test_whole_training_step_compiles_without_eager_fallback():
    """Optimizer step, gradient clipping and a Python-float loss weight inside the compiled
    function: the ops they bring (foreach norm and mul, true_divide, float64→float32 conversion
    of the weight) all lower, and the parameters follow eager's."""

    def make():
        torch.manual_seed(0)
        model = _mlp()
        return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    def step(model, opt, x, y, weight):
        loss = F.mse_loss(model(x), y) * weight
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        return loss

    (model, opt), (reference, reference_opt) = make(), make()
    compiled = torch.compile(
        step, backend="tpu_inductor", options={"fallback": "error"}, dynamic=True
    )
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for weight in (1.0, 0.5, 0.25):  # a new float each step: a symbolic scalar input
        assert_same(
            compiled(model, opt, x, y, weight), step(reference, reference_opt, x, y, weight)
        )
    for got, want in zip(model.parameters(), reference.parameters()):
        assert_same(got, want, rtol=1e-5, atol=1e-6)
