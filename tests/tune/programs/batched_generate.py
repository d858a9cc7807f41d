"""A batched generate() loop (tpu-inductor tune's acceptance program): a small GPT-2's
compiled forward generating 8 new tokens for batches of 2 prompts of lengths 5..24; every
batch's tokens checked against eager torch's generate(). Arguments: BATCHES (default 6)."""

import sys

import torch
import transformers

batches = int(sys.argv[1]) if len(sys.argv) > 1 else 6
torch.manual_seed(0)
config = transformers.GPT2Config(
    n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=128, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
)  # fmt: skip
model = transformers.GPT2LMHeadModel(config).eval()
model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
generator = torch.Generator().manual_seed(0)
prompts = [
    torch.randint(1, 128, (2, int(n)), generator=generator)
    for n in torch.randint(5, 25, (batches,), generator=generator)
]
expected = [model.generate(p, max_new_tokens=8, do_sample=False) for p in prompts]
model.forward = torch.compile(model.forward, backend="tpu_inductor")
for prompt, want in zip(prompts, expected):
    got = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want), (prompt.shape, got, want)
print(f"{batches} batches of prompts {[p.shape[1] for p in prompts]}: equal to eager")
