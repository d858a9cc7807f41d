"""The ready-made sharding plans by name, the one a script asks for with
`tpu_inductor.shard(model, mesh, "auto")`, and what each would hold per device.

A script written once runs under its defaults and under a tuned config unchanged:

    mesh = tpu_inductor.auto_mesh({"data": 8})   # the config's mesh ("data=2,model=4"), else this
    tpu_inductor.shard(model, mesh, "auto")      # the config's plan, else "data"

The config is options' `sharding` record (TPU_INDUCTOR_CONFIG=tuned.json, which `tpu-inductor
tune --mesh` writes, or TPU_INDUCTOR_SHARDING). Each "auto" call also keeps a survey of the
model for the tuner (`surveys`, the last call's): per named plan, the bytes of parameters (and
of those that train) per device, from the shapes and the plan's specs alone: nothing compiled.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tpu_inductor.config import Options
from tpu_inductor.exc import OptionError
from tpu_inductor.sharding import plans
from tpu_inductor.sharding.mesh import Mesh, Spec, parse_mesh


def _expert_axis(mesh: Mesh) -> str:
    return "expert" if "expert" in mesh.names else "model"


# name -> (what it is, the plan on a mesh). The batch is the script's to split (mark_sharding
# over "data"); "data" needs no plan for the weights.
NAMED: dict[str, tuple[str, Callable[[Mesh], plans.Plan]]] = {
    "data": ("data parallel: the weights whole on every device", lambda mesh: {}),
    "fsdp": ("FSDP: parameters split over data", lambda mesh: plans.fsdp("data")),
    "tensor_parallel": (
        "tensor parallel over model (TP x DP with the batch over data)",
        lambda mesh: plans.tensor_parallel("model"),
    ),
    "fsdp_tensor_parallel": (
        "tensor parallel over model, then FSDP over data (2-D)",
        lambda mesh: plans.combine(plans.tensor_parallel("model"), plans.fsdp("data")),
    ),
    "expert_parallel": (
        "stacked MoE experts over expert (or model), the rest tensor parallel over model",
        lambda mesh: plans.combine(
            plans.expert_parallel(_expert_axis(mesh)), plans.tensor_parallel("model")
        ),
    ),
}
DEFAULT = "data"

# Optimizer state per parameter, in parameters' bytes (torch.optim's per-parameter tensors;
# SGD's and RMSprop's follow their hyperparameters: note_optimizer).
_STATES = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Adagrad": 1}

# The last `shard(model, mesh, "auto")`'s survey, the one entry (the tuner's record reads it).
surveys: list[dict] = []


def plan(name: str, mesh: Mesh) -> plans.Plan:
    """The named plan `name` on `mesh`."""
    if name not in NAMED:
        raise OptionError(
            f"tpu_inductor: sharding plan {name!r} is not one of {', '.join(NAMED)} "
            "(options' sharding.plan)."
        )
    return NAMED[name][1](mesh)


def specs(name: str, model: torch.nn.Module, mesh: Mesh) -> dict[str, Spec]:
    """The specs of the named plan `name` for `model` on `mesh` (an OptionError where it does
    not apply: an axis the mesh lacks, a model without the layers it splits)."""
    return plans.resolve(model, mesh, plan(name, mesh))


def auto_mesh(default) -> Mesh:
    """The mesh the config names (options' sharding.mesh, which `tpu-inductor tune --mesh`
    writes), else `default` (a Mesh or its axes): `tpu_inductor.auto_mesh`."""
    text = Options.from_user().sharding.mesh
    if text is not None:
        return parse_mesh(text)
    return default if isinstance(default, Mesh) else Mesh(default)


def auto(model: torch.nn.Module, mesh: Mesh) -> plans.Plan:
    """The configured plan (else DEFAULT) on `mesh`; surveys every named plan for `model`."""
    name = Options.from_user().sharding.plan or DEFAULT
    surveys[:] = [{"mesh": str(mesh), "plan": name, "plans": survey(model, mesh)}]
    return plan(name, mesh)


def survey(model: torch.nn.Module, mesh: Mesh) -> dict[str, dict]:
    """Per named plan: {"parameters", "trainable", "buffers"} bytes per device (the largest
    device's, from shapes and specs), or {"error": why it does not apply}."""
    sizes = dict(mesh.axes)
    found = {}
    for name in NAMED:
        try:
            given = specs(name, model, mesh)
        except OptionError as e:
            found[name] = {"error": str(e)}
            continue
        figures = {"parameters": 0, "trainable": 0, "buffers": 0}
        for tensor_name, tensor in model.named_parameters():
            share = _share(tensor, given.get(tensor_name, ()), sizes)
            figures["parameters"] += share
            figures["trainable"] += share if tensor.requires_grad else 0
        for tensor_name, tensor in model.named_buffers():
            figures["buffers"] += _share(tensor, given.get(tensor_name, ()), sizes)
        found[name] = figures
    return found


def _share(tensor: torch.Tensor, spec: Spec, sizes: dict[str, int]) -> int:
    """The bytes of `tensor` one device holds when it is split by `spec`."""
    split = math.prod(sizes[axis] for axis in spec if axis is not None)
    return -(-tensor.numel() // split) * tensor.element_size()


def note_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Keep, on the last survey (the model placed last: shard_optimizer_state follows its
    shard), how many parameter-sized state tensors `optimizer` keeps per parameter (None: an
    optimizer this table does not know)."""
    if not surveys:
        return
    kind = type(optimizer).__name__
    states = _STATES.get(kind)
    defaults = optimizer.defaults
    if kind == "SGD":
        states = int(bool(defaults.get("momentum")))
    elif kind == "RMSprop":
        states = 1 + bool(defaults.get("momentum")) + bool(defaults.get("centered"))
    surveys[-1]["optimizer"] = {"kind": kind, "states": states}
