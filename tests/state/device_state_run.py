"""A model placed on 8 virtual CPU devices by tpu_inductor.shard (run by test_device_state.py in
a subprocess: the device count is fixed when jax starts). Prints one JSON line per check."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import io  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

import tpu_inductor  # noqa: E402
from tpu_inductor.runtime.host_sync import host_sync  # noqa: E402
from tpu_inductor.sharding import plans as sharding_plans  # noqa: E402
from tpu_inductor.state import device_state  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # (large enough that the partial pages at the ends of each storage, which stay held, are
    # under 1% of the state)
    return torch.nn.Sequential(
        torch.nn.Linear(512, 2048),
        torch.nn.GELU(),
        torch.nn.Linear(2048, 512),
        torch.nn.LayerNorm(512),
    )


def _eager_reads(model: torch.nn.Module) -> dict[str, str]:
    """What each eager path to a device-only parameter does: the error's first words, or "ok"."""
    weight = model[0].weight
    reads = {
        "op": lambda: weight + 1,
        "print": lambda: repr(weight),
        "numpy": lambda: weight.detach().numpy().sum(),
        "tolist": lambda: weight.tolist(),
        "state_dict value": lambda: model.state_dict()["0.weight"].sum(),
        "torch.save": lambda: torch.save(model.state_dict(), io.BytesIO()),
        "eager forward": lambda: model(torch.randn(2, 512)),
        "in-place write": lambda: weight.data.mul_(2),
    }
    found = {}
    for name, read in reads.items():
        try:
            read()
            found[name] = "ok"
        except RuntimeError as e:
            found[name] = str(e)
    return found


def _held(tensors) -> int:
    return sum(host_sync.resident_bytes(t) for t in tensors)


def placed() -> dict:
    """Placed by tpu_inductor.shard: no host memory, every eager read names the sync, the sync
    brings the values home bitwise."""
    model = _model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    parameters = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in parameters)
    mesh = tpu_inductor.Mesh({"data": 8})
    tpu_inductor.shard(model, mesh, sharding_plans.fsdp("data", min_elements=1))
    held = _held(parameters)
    # AdamW's moments of such a parameter are made on its devices, split as it is: no host page
    optimizer = tpu_inductor.shard_optimizer_state(torch.optim.AdamW(parameters))
    for p in parameters:
        p.grad = torch.ones(p.shape)  # (only its presence is read)
    optimizer._init_group(optimizer.param_groups[0], [], [], [], [], [], [])
    moments = [optimizer.state[p][k] for p in parameters for k in ("exp_avg", "exp_avg_sq")]
    moments_held = _held(moments)
    split_as_parameters = all(
        device_state.device_array(optimizer.state[p]["exp_avg"]).sharding.is_equivalent_to(
            device_state.device_array(p).sharding, p.ndim
        )
        for p in parameters
    )
    tpu_inductor.sync(*moments)
    moments_zero = all(not m.any() for m in moments)
    reads = _eager_reads(model)
    tpu_inductor.sync(model)
    equal = all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return {
        "held": held,
        "nbytes": nbytes,
        "reads": reads,
        "equal": equal,
        "saved": buffer.tell(),
        "moments_held": moments_held,
        "moments_split_as_parameters": split_as_parameters,
        "moments_zero": moments_zero,
    }


def trained(steps: int) -> dict:
    """`steps` AdamW steps placed by FSDP on 8 devices against the same steps on one device:
    losses and parameters; the host bytes of parameter, gradient and optimizer storages; each
    device's resident bytes (the memory ledger) after a backward, against the state / 8."""
    results = {}
    for where in ("fsdp", "one", "eager"):  # (the one-device run's arrays would count on 0)
        torch._dynamo.reset()
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        x = torch.randn(16, 512, generator=torch.Generator().manual_seed(1))
        mesh = tpu_inductor.Mesh({"data": 8})
        if where == "fsdp":
            tpu_inductor.shard(model, mesh, sharding_plans.fsdp("data", min_elements=1))
            tpu_inductor.shard_optimizer_state(optimizer)
        options = {"host_sync": "explicit"}
        forward = torch.compile(model, backend="tpu_inductor", options=options)
        step = torch.compile(optimizer.step, backend="tpu_inductor", options=options)
        if where == "eager":
            forward, step = model, optimizer.step
        losses, figures = [], {}
        for i in range(steps):
            if where == "fsdp":
                tpu_inductor.mark_sharding(x, mesh, ("data", None))
            loss = forward(x).square().mean()
            loss.backward()
            if i == steps - 1 and where != "eager":  # parameters, gradients, both moments
                state = [*model.parameters()]
                state += [p.grad for p in model.parameters()]
                state += [v for s in optimizer.state.values() for v in s.values() if v.numel() > 1]
                ledger = tpu_inductor.memory()["devices"]
                figures = {
                    "state_bytes": sum(t.numel() * t.element_size() for t in state),
                    "host_bytes": _held(state),
                    "resident": [v["total"] for v in ledger.values()],
                }
            step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        tpu_inductor.sync(model, optimizer)
        figures["losses"] = losses
        figures["parameters"] = [p.detach().clone() for p in model.parameters()]
        results[where] = figures
    one, fsdp, eager = results["one"], results["fsdp"], results["eager"]
    return {
        "one": one,
        "fsdp": fsdp,
        "parameter_difference": _largest(fsdp.pop("parameters"), one["parameters"]),
        # what compiling alone moves them from eager's (AdamW divides each gradient by its own
        # magnitude: reduction-order differences in near-zero gradients move those weights)
        "compiled_difference": _largest(one.pop("parameters"), eager.pop("parameters")),
    }


def _largest(a, b) -> float:
    return max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(a, b))


if __name__ == "__main__":
    check = sys.argv[1]
    found = placed() if check == "placed" else trained(int(sys.argv[2]))
    print(json.dumps(found))
