"""ATen FX graphs → jax functions → StableHLO (imported as `tpu_inductor.lowering`).

Knows nothing of the backend, the cache or the runtime. Importing it is cheap: jax is imported
and the rules are registered the first time a rule table is needed (`registry.load_rules`).

Its public face, what the rest of tpu_inductor uses (nothing outside imports a submodule's
private names):

- what is supported: `supported(node, platform)`, `computes(node)`, `takes_traced_scalars`,
  `draws_random`, `rng_stream(node)` (what a random node's key folds in), `registered_ops()`, `core_aten_coverage()`, `register_lowering` (rules of one's own),
  `register_user_lowering` and `user_rules_fingerprint()` (users' rules, in the cache key);
- what is missing: `missing_ops(gm, platform)`, `op_name(target)`, `source_line(node)`;
- lower: `lower(gm, inputs, ...)` → `LoweredModule` (with `TensorSpec`, `OutputSlot`,
  `Shardings`, `PartialWrite`), `flat_outputs(gm)`; `torch_mlir` is the second frontend;
- `dense_dim_order(sizes, strides)`: the dim order of a dense strided layout.
"""

from .interpreter import missing_ops, op_name, rng_stream, source_line
from .layout import dense_dim_order
from .python_targets import computes
from .registry import (
    core_aten_coverage,
    draws_random,
    register_lowering,
    register_user_lowering,
    registered_ops,
    supported,
    takes_traced_scalars,
    user_rules_fingerprint,
)
from .stablehlo import LoweredModule, OutputSlot, Shardings, TensorSpec, flat_outputs, lower
from .written_parts import PartialWrite

__all__ = [
    "LoweredModule",
    "OutputSlot",
    "PartialWrite",
    "Shardings",
    "TensorSpec",
    "computes",
    "core_aten_coverage",
    "dense_dim_order",
    "draws_random",
    "flat_outputs",
    "lower",
    "missing_ops",
    "op_name",
    "register_lowering",
    "register_user_lowering",
    "registered_ops",
    "rng_stream",
    "source_line",
    "supported",
    "takes_traced_scalars",
    "user_rules_fingerprint",
]
