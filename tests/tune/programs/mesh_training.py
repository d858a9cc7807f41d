"""The training loop of the --mesh programs (llama_mesh.py, moe_mesh.py): the model placed as a
tuned config says, trained compiled beside the same loop in eager torch, every step's loss and
the final weights checked against it."""

import copy

import torch

import tpu_inductor


def train_against_eager(model, make_optimizer, batches, *, weights_atol: float, **forward_kw):
    """Train `model` (built on the host, not yet placed) on `batches` of token ids, each its own
    labels, on the mesh from `tpu_inductor.auto_mesh` (else data=8), placed by `shard(model,
    mesh, "auto")`, the batch over "data", against a deep copy trained eagerly."""
    reference = copy.deepcopy(model)
    mesh = tpu_inductor.auto_mesh({"data": 8})
    tpu_inductor.shard(model, mesh, "auto")
    optimizer = tpu_inductor.shard_optimizer_state(make_optimizer(model.parameters()))
    reference_optimizer = make_optimizer(reference.parameters())
    forward = torch.compile(model, backend="tpu_inductor")
    step = torch.compile(optimizer.step, backend="tpu_inductor")
    for ids in batches:
        expected = reference(ids, labels=ids, **forward_kw).loss
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        tpu_inductor.mark_sharding(ids, mesh, ("data", None))
        loss = forward(ids, labels=ids, **forward_kw).loss
        loss.backward()
        step()
        optimizer.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    tpu_inductor.sync(model)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=weights_atol)
    print(f"{len(batches)} steps on mesh {mesh}: equal to eager")
