"""cleanup: remove dead nodes, no-op aliases and metadata assertions.

Assumes a functional ATen graph (AOTAutograd or torch.export output). Preserves every output,
every input mutation (`copy_` into a placeholder is impure and stays) and `node.meta`.

    y = alias(x)                      -> uses of y read x
    _assert_tensor_metadata(x, ...)   -> removed (a trace-time check torch.export leaves in)
    dead node                         -> removed
"""

from __future__ import annotations

import torch

from .context import PassContext

aten = torch.ops.aten

_NOOP_ALIASES = (aten.alias.default, aten.lift_fresh_copy.default)
# Checks of dtype/shape/device that held when the graph was traced; they compute nothing and
# are impure to FX, so dead-code elimination keeps them.
_METADATA_ASSERTS = (aten._assert_tensor_metadata.default,)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    rewrites = ctx.rewrites
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _NOOP_ALIASES:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            rewrites["alias_removed"] += 1
        elif node.op == "call_function" and node.target in _METADATA_ASSERTS and not node.users:
            gm.graph.erase_node(node)
            rewrites["assert_removed"] += 1
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    rewrites["dead_removed"] += before - len(gm.graph.nodes)
    return gm
