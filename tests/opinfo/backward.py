"""OpInfo samples with requires_grad, forward and backward compiled by us, against eager.

For the entries whose backward has a rule of its own (BACKWARD: convolution_backward, the
normalizations', pooling's, softmax's, the losses', attention's ...): each sample's forward
and backward graphs go through AOTAutograd into our compiler (fallback="error"), and the
outputs and the gradients of every input that requires grad (for fixed random cotangents)
are compared with eager autograd's.
"""

from __future__ import annotations

import itertools

import torch
from torch.utils import _pytree as pytree

from . import compare, randomness
from .outcome import Outcome, entry_name

BACKWARD = (
    "log_softmax",
    "softmax",
    "sigmoid",
    "tanh",
    "nn.functional.relu",
    "nn.functional.gelu",
    "nn.functional.silu",
    "nn.functional.conv1d",
    "nn.functional.conv2d",
    "nn.functional.conv3d",
    "nn.functional.conv_transpose1d",
    "nn.functional.conv_transpose2d",
    "nn.functional.conv_transpose3d",
    "nn.functional.batch_norm",
    "nn.functional.group_norm",
    "nn.functional.layer_norm",
    "nn.functional.max_pool2d",
    "nn.functional.max_pool3d",
    "nn.functional.avg_pool2d",
    "nn.functional.avg_pool3d",
    "nn.functional.adaptive_avg_pool2d",
    "nn.functional.adaptive_avg_pool3d",
    "nn.functional.adaptive_max_pool2d",
    "nn.functional.adaptive_max_pool3d",
    "nn.functional.embedding",
    "nn.functional.nll_loss",
    "nn.functional.cross_entropy",
    "nn.functional.multilabel_margin_loss",
    "nn.functional.pad.replicate",
    "nn.functional.scaled_dot_product_attention",
)
# Gradients add more roundings than the forward: this factor on the forward's tolerance.
GRAD_TOLERANCE_FACTOR = 10


def run_backward(op, dtype: torch.dtype, samples: int = 2) -> Outcome:
    """Outcome of the first `samples` requires_grad samples of `op`, one compile each."""
    torch.manual_seed(0)
    cases = list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=True), samples))
    cases = [c for c in cases if not randomness.draws(entry_name(op), c)]
    if not cases:
        return Outcome("no_samples")
    for index, case in enumerate(cases):
        outcome = _run_sample(op, case, dtype)
        if outcome.status != "pass":
            return Outcome(outcome.status, f"sample {index}: {outcome.detail}")
    return Outcome("pass")


def _run_sample(op, case, dtype) -> Outcome:
    from functorch.compile import aot_function

    from tpu_inductor import decompositions
    from tpu_inductor.compile_fx import compile_graph
    from tpu_inductor.config import Options
    from tpu_inductor.exc import UnsupportedOpError

    flat, spec = pytree.tree_flatten((case.input, case.args, case.kwargs))
    slots = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]

    def fn(*tensors):
        rebuilt = list(flat)
        for slot, tensor in zip(slots, tensors):
            rebuilt[slot] = tensor
        inp, args, kwargs = pytree.tree_unflatten(rebuilt, spec)
        result = pytree.tree_leaves(op.op(inp, *args, **kwargs))
        return tuple(v for v in result if isinstance(v, torch.Tensor) and v.requires_grad)

    def fresh():
        return [flat[s].detach().clone().requires_grad_(flat[s].requires_grad) for s in slots]

    options = Options.from_user({"fallback": "error", "cache": False})
    compiled = aot_function(
        fn,
        fw_compiler=lambda gm, inputs: compile_graph(gm, inputs, options, kind="forward"),
        bw_compiler=lambda gm, inputs: compile_graph(gm, inputs, options, kind="backward"),
        decompositions=decompositions.table(),
    )
    want_inputs, got_inputs = fresh(), fresh()
    want = fn(*want_inputs)
    if not want:
        return Outcome("no_samples", "no output requires grad")
    generator = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(w.shape, generator=generator).to(w.dtype) for w in want]
    try:
        with torch._functorch.config.patch(unlift_effect_tokens=True):
            got = compiled(*got_inputs)
            got_grads = _grads(got, got_inputs, cotangents)
    except UnsupportedOpError as e:
        return Outcome("unsupported", " ".join(str(e).split())[:300])
    except Exception as e:
        return Outcome("lowering_error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    want_grads = _grads(want, want_inputs, cotangents)
    tol = compare.tolerance(op, dtype)
    forward = compare.compare(got, want, tol)
    if forward.status != "pass":
        return Outcome(forward.status, f"forward: {forward.detail}")
    wide = {k: v * GRAD_TOLERANCE_FACTOR for k, v in tol.items()}
    backward = compare.compare(got_grads, want_grads, wide)
    return Outcome(backward.status, f"backward: {backward.detail}" if backward.detail else "")


def _grads(outputs, inputs, cotangents):
    """Gradients of every input that requires grad (zeros where an input is not used)."""
    wanted = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(outputs, wanted, cotangents, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, wanted))
