"""A variable-length training loop (tpu-inductor tune's acceptance program): a small GPT-2
trained on batches of random lengths in 9..40, one compiled step each; every step's loss and
the final weights checked against the same loop in eager torch. Arguments: STEPS (default 24)."""

import copy
import sys

import torch
import transformers

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 24
torch.manual_seed(0)
config = transformers.GPT2Config(
    n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0,
)  # fmt: skip
model = transformers.GPT2LMHeadModel(config)
model.loss_type = "ForCausalLM"
reference = copy.deepcopy(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
step = torch.compile(model, backend="tpu_inductor")
generator = torch.Generator().manual_seed(0)
lengths = torch.randint(9, 41, (steps,), generator=generator).tolist()
for n in lengths:
    ids = torch.randint(0, 128, (2, n), generator=generator)
    torch._dynamo.maybe_mark_dynamic(ids, 1)
    loss, expected = step(ids, labels=ids).loss, reference(ids, labels=ids).loss
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    for opt, value in ((optimizer, loss), (reference_optimizer, expected)):
        opt.zero_grad()
        value.backward()
        opt.step()
for got, want in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
print(f"{steps} steps, lengths {min(lengths)}..{max(lengths)}: equal to eager")
