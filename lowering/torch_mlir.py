"""`lower(gm, inputs, ...) -> LoweredModule` through torch-mlir, a second, independent frontend.

The same contract as `stablehlo.lower`, but the ATen graph goes through torch-mlir's FX importer
(`torch_mlir.fx.stateless_fx_import(..., output_type="stablehlo")`) instead of our rules, so
each frontend can cross-check the other, and graphs our rules cannot lower have a second chance
before eager torch. torch-mlir is an optional extra (`pip install -e ".[torch-mlir]"`); without
it, `lower` raises FrontendUnavailableError.

torch-mlir imports a stateless graph whose every input and result is a tensor, so the graph is
first re-traced (make_fx) for the concrete input specs: Python inputs (SymInt sizes) are baked
in, writes into inputs (`copy_` into a placeholder) become extra results as in our lowering,
and None or other Python outputs (backward graphs have them) are kept out of the module and
rebuilt from the LoweredModule's output slots; torch-mlir's decomposition table is applied
then. torch-mlir keeps 64-bit types as torch has them, so its modules are lowered under the
"keep" policy whatever `x64` asks.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

import torch

from ..exc import FrontendUnavailableError, LoweringError
from .interpreter import flatten
from .stablehlo import (
    LoweredModule,
    OutputSlot,
    TensorSpec,
    require_concrete,
    tensor_input_specs,
)

log = logging.getLogger(__name__)

aten = torch.ops.aten

INSTALL_HINT = "install it with `pip install -e '.[torch-mlir]'` (or `pip install torch-mlir`)"


def available() -> bool:
    """Whether torch-mlir is installed (cheap: nothing is imported)."""
    return importlib.util.find_spec("torch_mlir") is not None


def require():
    """torch-mlir's FX module; FrontendUnavailableError when torch-mlir cannot be imported."""
    try:
        from torch_mlir import fx
    except ImportError as e:
        raise FrontendUnavailableError(
            f"tpu_inductor: lowering through torch-mlir needs the torch-mlir package, which "
            f"cannot be imported ({e}); {INSTALL_HINT}, or leave the options 'lowering' and "
            "'fallback' at values other than 'torch-mlir'."
        ) from e
    return fx


def lower(
    gm: torch.fx.GraphModule,
    inputs: Sequence[Any],
    *,
    platform: str = "cpu",
    x64: str = "keep",
) -> LoweredModule:
    """Lower `gm` for `inputs` (tensors or fake tensors, and concrete ints) via torch-mlir."""
    fx = require()
    seeded = sorted({str(node.target) for node in gm.graph.nodes if _draws_random_numbers(node)})
    if seeded:  # torch-mlir draws from XLA's own generator, the same stream in every process
        raise LoweringError(
            f"torch-mlir's random numbers ignore torch's generator (torch.manual_seed, the "
            f"same stream in every process): {seeded}. Lower graphs with random ops with our "
            "rules (the default lowering)."
        )
    require_concrete(gm)
    tensor_inputs, specs = tensor_input_specs(inputs)
    try:
        graph, structure = _stateless_graph(gm, inputs, tensor_inputs, specs, fx)
        module = fx.stateless_fx_import(graph, output_type="stablehlo")
    except Exception as e:  # torch-mlir raises its own error types, or NotImplementedError
        raise LoweringError(
            f"torch-mlir could not lower the graph: {type(e).__name__}: {_first_lines(e)}"
        ) from e
    if x64 != "keep":
        log.debug("tpu_inductor: torch-mlir keeps 64-bit types; x64=%r does not apply", x64)
    text = str(module)
    return LoweredModule(
        bytecode=_jax_bytecode(text),
        text=text,
        platform=platform,
        tensor_inputs=tensor_inputs,
        input_specs=specs,
        output_specs=structure["specs"],
        outputs=structure["slots"],
        mutations=structure["mutations"],
        uses_rng=False,
        x64="keep",
        text_with_locations=module.operation.get_asm(enable_debug_info=True),
    )


class _Functional(torch.fx.Interpreter):
    """Runs a graph, turning `copy_` into a placeholder into a recorded value (no mutation),
    and views into reshapes: the re-trace's decompositions may lay a result out otherwise than
    the traced kernel did (CPU flash attention), and in a functional graph both are the same."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.position = {node: i for i, node in enumerate(placeholders)}
        self.mutations: dict[int, torch.Tensor] = {}  # graph input position → new value

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.target is aten.copy_.default and n.args[0] in self.position:
            (dst, src), _ = self.fetch_args_kwargs_from_env(n)
            value = src.expand(dst.shape).to(dst.dtype)
            self.mutations[self.position[n.args[0]]] = value
            return value
        if n.target is aten.view.default:
            (tensor, shape), _ = self.fetch_args_kwargs_from_env(n)
            return tensor.reshape(shape)
        return super().run_node(n)


def _draws_random_numbers(node: torch.fx.Node) -> bool:
    """Whether `node` draws random numbers: an op tagged seeded, unless what is random about it
    is a `dropout_p` argument that is 0 (attention ops are tagged for their dropout)."""
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    arguments = target._schema.arguments
    at = next((i for i, a in enumerate(arguments) if a.name == "dropout_p"), None)
    if at is None:
        return True
    default = node.args[at] if len(node.args) > at else arguments[at].default_value
    return node.kwargs.get("dropout_p", default) != 0


def _stateless_graph(gm, inputs, tensor_inputs, specs, fx) -> tuple[torch.fx.GraphModule, dict]:
    """`gm` re-traced with tensor inputs and tensor results only, and how to call it.

    The re-trace applies torch-mlir's own decomposition table (as its `export_and_import`
    does), which rewrites the ops it has no conversion for (e.g. `squeeze.dims`).
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    structure: dict[str, Any] = {}

    def stateless(*tensors):
        values = list(inputs)
        for position, tensor in zip(tensor_inputs, tensors):
            values[position] = tensor
        runner = _Functional(gm)
        flat = list(flatten(runner.run(*values)))
        results, slots, mutations = [], [], []
        for value in flat:
            if isinstance(value, torch.Tensor):
                slots.append(OutputSlot(len(results)))
                results.append(value)
            else:
                slots.append(OutputSlot(None, value))
        for position, value in runner.mutations.items():
            mutations.append((position, len(results)))
            results.append(value)
        structure.update(
            slots=tuple(slots),
            mutations=tuple(mutations),
            specs=tuple(TensorSpec(tuple(r.shape), r.dtype) for r in results),
        )
        return tuple(results)

    examples = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # Out of Dynamo's tracing context and fake mode: make_fx would reuse its fake mode, whose
    # shape environment turns these static sizes into symbolic ones.
    with unset_fake_temporarily(), tracing(None):
        decompositions = fx.get_decomposition_table()
        traced = make_fx(stateless, decompositions, tracing_mode="fake")(*examples)
        return traced, structure


def _jax_bytecode(text: str) -> bytes:
    """torch-mlir's StableHLO text as bytecode of jax's MLIR (the version PJRT reads)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        return mlir.module_to_bytecode(ir.Module.parse(text))


def _first_lines(error: Exception, count: int = 6) -> str:
    return "\n".join(str(error).strip().splitlines()[:count])
