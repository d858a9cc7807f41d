"""Sharding plans: which of a model's parameters and buffers are split over which mesh axes.

A plan is what `tpu_inductor.shard(model, mesh, plan)` takes:

- a mapping of name globs to partition specs, for parameters and buffers (`*` also matches
  the dots of layer indices: `"layers.*.mlp.up_proj.weight": ("model", None)`);
- a mapping of module-name globs to TorchTitan-style styles (`ColwiseParallel()`,
  `RowwiseParallel()`, `SequenceParallel()`, or torch.distributed's classes of those names),
  translated into the specs of each module's weight and bias;
- or a ready-made plan below: `fsdp`, `tensor_parallel` (Megatron-style, for Hugging Face
  decoder blocks), `expert_parallel` (stacked MoE expert weights); several combine with
  `combine`. Data parallelism needs no plan for the weights (they stay whole on every device):
  split the batch with `tpu_inductor.mark_sharding(batch, mesh, ("data", None))`.

Every entry must match something: a typo is an error naming the entry, not a silent replicate.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tpu_inductor.exc import OptionError
from tpu_inductor.sharding.mesh import Mesh, Spec


@dataclasses.dataclass(frozen=True)
class ColwiseParallel:
    """A linear layer's outputs split over `axis`: its weight ([out, in]) by rows, its bias."""

    axis: str = "model"

    def specs(self, module: torch.nn.Module) -> dict[str, Spec]:
        return _linear_specs(module, self.axis, output=True)


@dataclasses.dataclass(frozen=True)
class RowwiseParallel:
    """A linear layer's inputs split over `axis`: its weight by columns (its output is summed
    over the axis by the partitioner's all-reduce); its bias whole."""

    axis: str = "model"

    def specs(self, module: torch.nn.Module) -> dict[str, Spec]:
        return _linear_specs(module, self.axis, output=False)


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """TorchTitan's norm-layer style: the activations are split along the sequence there; the
    norm's own weights stay whole. Here the weights stay whole and the partitioner chooses the
    activations' layout (mark one with `mark_sharding` to force it)."""

    axis: str = "model"

    def specs(self, module: torch.nn.Module) -> dict[str, Spec]:
        return {}


def _linear_specs(module: torch.nn.Module, axis: str, output: bool) -> dict[str, Spec]:
    """Specs of a linear layer's weight and bias, split along its outputs or its inputs.
    nn.Linear keeps weight as [out, in]; transformers' Conv1D (GPT-2) as [in, out]."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise OptionError(
            f"tpu_inductor: a linear-layer style was given for {type(module).__name__}, which "
            "has no 2-d weight; give its tensors' specs by name instead."
        )
    transposed = type(module).__name__ == "Conv1D"
    out_dim = 1 if transposed else 0
    dim = out_dim if output else 1 - out_dim
    specs = {"weight": tuple(axis if d == dim else None for d in range(2))}
    if output and getattr(module, "bias", None) is not None:
        specs["bias"] = (axis,)
    return specs


_STYLES = {"ColwiseParallel": True, "RowwiseParallel": False, "SequenceParallel": None}


def _style_specs(style: Any, module: torch.nn.Module, axis: str) -> dict[str, Spec]:
    """The specs of a style: ours, or torch.distributed's class of that name (its DTensor
    layouts name no mesh axis: `axis` is the one the ready-made plan or shard call gives)."""
    if isinstance(style, (ColwiseParallel, RowwiseParallel, SequenceParallel)):
        return style.specs(module)
    kind = _STYLES.get(type(style).__name__, "unknown")
    if kind == "unknown":
        raise OptionError(
            f"tpu_inductor: plan style {style!r} is not one of ColwiseParallel, RowwiseParallel, "
            "SequenceParallel (tpu_inductor.sharding.plans) nor a partition spec."
        )
    return {} if kind is None else _linear_specs(module, axis, output=kind)


Plan = Mapping[str, Any] | Callable[[torch.nn.Module, Mesh], Mapping[str, Spec]]


def resolve(model: torch.nn.Module, mesh: Mesh, plan: Plan, axis: str = "model") -> dict[str, Spec]:
    """Tensor name → partition spec for `model` under `plan` (see the module docstring)."""
    if callable(plan) and not isinstance(plan, Mapping):
        return dict(plan(model, mesh))
    if not isinstance(plan, Mapping):
        raise OptionError(
            f"tpu_inductor.shard: plan is {type(plan).__name__}; pass a mapping of name globs to "
            "specs or styles, or a plan from tpu_inductor.sharding.plans."
        )
    tensors = [name for name, _ in model.named_parameters()]
    tensors += [name for name, _ in model.named_buffers()]
    modules = dict(model.named_modules())
    specs: dict[str, Spec] = {}
    for pattern, value in plan.items():
        matched = 0
        if isinstance(value, (tuple, list)):
            for name in fnmatch.filter(tensors, pattern):
                specs[name], matched = tuple(value), matched + 1
        else:
            for name in fnmatch.filter(modules, pattern):
                prefix = f"{name}." if name else ""
                for tensor, spec in _style_specs(value, modules[name], axis).items():
                    specs[prefix + tensor] = spec
                matched += 1
        if not matched:
            kind = "parameter or buffer" if isinstance(value, (tuple, list)) else "module"
            near = [n for n in (tensors if kind != "module" else modules) if n][:4]
            raise OptionError(
                f"tpu_inductor.shard: plan entry {pattern!r} matches no {kind} of "
                f"{type(model).__name__} (names look like {near}); fix the glob or drop it."
            )
    return specs


def combine(*plans: Plan) -> Callable[[torch.nn.Module, Mesh], dict[str, Spec]]:
    """Plans applied in order, merged dim by dim (tensor parallel over "model", then FSDP over
    "data"): an axis a later plan puts on a dim an earlier one split goes to the first dim left
    whole that it divides, or is dropped (that tensor stays whole along it)."""

    def plan(model, mesh):
        shapes = {n: tuple(t.shape) for n, t in model.named_parameters()}
        shapes.update((n, tuple(t.shape)) for n, t in model.named_buffers())
        sizes = dict(mesh.axes)
        merged: dict[str, Spec] = {}
        for each in plans:
            for name, spec in resolve(model, mesh, each).items():
                padded = [*merged.get(name, ())]
                padded += [None] * (len(shapes[name]) - len(padded))
                for dim, axis in enumerate(spec):
                    if axis is None or axis in padded:
                        continue
                    free = [d for d, a in enumerate(padded) if a is None]
                    fits = [d for d in free if shapes[name][d] % sizes.get(axis, 1) == 0]
                    target = dim if dim in fits else next(iter(fits), None)
                    if target is not None:
                        padded[target] = axis
                while padded and padded[-1] is None:
                    padded.pop()
                merged[name] = tuple(padded)
        return merged

    return plan


def fsdp(axis: str = "data", min_elements: int = 1024):
    """FSDP-style: every parameter of at least `min_elements` split along its first dim that
    `axis` divides (gathered where it is used, its gradient reduce-scattered by the
    partitioner); smaller ones, and those no dim of which divides, stay whole."""

    def plan(model, mesh):
        size = dict(mesh.axes).get(axis)
        if size is None:
            raise OptionError(f"tpu_inductor: fsdp({axis!r}): mesh {mesh} has no axis {axis!r}.")
        specs = {}
        for name, tensor in model.named_parameters():
            if tensor.numel() < min_elements:
                continue
            dim = next((d for d, n in enumerate(tensor.shape) if n % size == 0), None)
            if dim is not None:
                specs[name] = tuple(axis if d == dim else None for d in range(dim + 1))
        return specs

    return plan


# Hugging Face decoder blocks: projections whose outputs split (Colwise) and whose inputs do
# (Rowwise), by module name: Llama-family (q/k/v/o, gate/up/down) and GPT-2 (c_attn, c_fc,
# c_proj).
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_attn", "c_fc")
_ROWWISE = ("o_proj", "down_proj", "c_proj")


def tensor_parallel(axis: str = "model"):
    """Megatron-style tensor parallelism for Hugging Face decoders: attention's q/k/v and the
    MLP's gate/up split by output features, o/down by input features: one all-reduce after
    attention and one after the MLP in the forward. Embeddings and norms stay whole."""

    def plan(model, mesh):
        if axis not in mesh.names:
            raise OptionError(
                f"tpu_inductor: tensor_parallel({axis!r}): mesh {mesh} has no axis {axis!r}."
            )
        specs = {}
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in _COLWISE or leaf in _ROWWISE:
                style = ColwiseParallel(axis) if leaf in _COLWISE else RowwiseParallel(axis)
                specs.update({f"{name}.{t}": s for t, s in style.specs(module).items()})
        if not specs:
            raise OptionError(
                f"tpu_inductor: tensor_parallel found none of {_COLWISE + _ROWWISE} in "
                f"{type(model).__name__}; give a plan by name for this model."
            )
        return specs

    return plan


def expert_parallel(axis: str = "expert"):
    """Expert parallelism for MoE layers whose experts are stacked ([experts, ...] tensors under
    an `experts` module): each device holds experts / axis of them. A grouped matmul over
    tokens sorted by expert (Hugging Face's "grouped_mm" experts) then sends each token to the
    devices holding its experts and back by all-to-all, dropping none (passes/annotate_sharding,
    `expert_mm`); other expert code is split by the partitioner (all-reduces of partial
    results). Split the batch over the other axes with `mark_sharding`."""

    def plan(model, mesh):
        specs = {
            name: (axis,)
            for name, tensor in model.named_parameters()
            if ".experts." in f".{name}" and tensor.ndim >= 3
        }
        if not specs:
            raise OptionError(
                f"tpu_inductor: expert_parallel found no stacked expert weights in "
                f"{type(model).__name__} (parameters under 'experts' with 3 or more dims)."
            )
        return specs

    return plan
