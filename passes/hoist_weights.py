"""hoist_weights: split the work a graph does on its parameters alone out of the graph, to be done
once per parameter version instead of once per call (tpu_inductor/runtime/hoisted.py runs the halves).

A pass marks a node it made from weights with `node.meta[MARK]` (fuse_matmuls marks the
concatenation of Q/K/V's and gate/up's weights). `split(gm, static)` takes the marked nodes whose
inputs are all static graph inputs (parameters and buffers: AOTAutograd's static inputs) or
other such nodes, and returns

    prologue  the static inputs they read -> the values the rest of the graph reads
    main      the graph, each such value a new placeholder after the graph's inputs

so that `main(*args, *prologue(*args[sources]))` is the graph's result. The marks are hints: a
marked node that reads anything else stays in the graph, and a caller that does not split
(an AOT artifact, a training graph, whose parameters change every call) runs it as it is.

Preserves: the results (the same nodes, computed on the same values: main's placeholders carry
the hoisted nodes' `meta["val"]`), the placeholders' order and meta (the new ones come after the caller's inputs),
every other node's meta, the random streams (no random node is hoisted: a marked node is a
pure function of its inputs).
"""

from __future__ import annotations

import dataclasses

import torch

MARK = "per_parameter_version"


@dataclasses.dataclass(frozen=True)
class Split:
    """A graph split by `split`: `main` takes the graph's inputs and then `prologue`'s results;
    `prologue` takes the graph's inputs at `sources`, in that order; `main` does not read those
    of them at `prologue_only`."""

    prologue: torch.fx.GraphModule
    main: torch.fx.GraphModule
    sources: tuple[int, ...]
    prologue_only: tuple[int, ...]

    @property
    def made(self) -> tuple:
        """The fake values of the prologue's results (main's new inputs)."""
        return tuple(self.prologue.graph.output_node().meta["val"])


def split(gm: torch.fx.GraphModule, static: frozenset[int], inputs: int) -> Split | None:
    """The graph's marked parameter-only work split out, or None where there is none.
    `inputs`: how many of the graph's placeholders its caller passes (a bucketed graph's
    true sizes come after them, appended by its dispatch): main's new ones go after those."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position = {node: i for i, node in enumerate(placeholders)}
    hoisted: list[torch.fx.Node] = []  # in graph order
    chosen: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.meta.get(MARK):
            reads = node.all_input_nodes
            if reads and all(position.get(n) in static or n in chosen for n in reads):
                hoisted.append(node)
                chosen.add(node)
    boundary = [n for n in hoisted if any(user not in chosen for user in n.users)]
    if not boundary:
        return None
    sources = sorted(
        {position[n] for node in hoisted for n in node.all_input_nodes if n in position}
    )
    return Split(
        _prologue(gm, hoisted, boundary, [placeholders[i] for i in sources]),
        _main(gm, boundary, chosen, placeholders[inputs - 1].name),
        tuple(sources),
        tuple(i for i in sources if all(user in chosen for user in placeholders[i].users)),
    )


def _prologue(gm, hoisted, boundary, sources) -> torch.fx.GraphModule:
    graph, copied = torch.fx.Graph(), {}
    for source in sources:
        copied[source] = graph.node_copy(source)
    for node in hoisted:
        copied[node] = graph.node_copy(node, copied.__getitem__)
    output = graph.output(tuple(copied[n] for n in boundary))
    output.meta["val"] = tuple(n.meta["val"] for n in boundary)
    return torch.fx.GraphModule(gm, graph, f"{type(gm).__name__}Prologue")


def _main(gm, boundary, chosen, after: str) -> torch.fx.GraphModule:
    main = torch.fx.GraphModule(gm, _copy(gm.graph))
    nodes = dict(zip(gm.graph.nodes, main.graph.nodes))
    last = next(n for n in main.graph.nodes if n.name == after)
    for node in reversed(boundary):  # each inserted right after `last`: reversed keeps order
        with main.graph.inserting_after(last):
            value = main.graph.placeholder(f"hoisted_{node.name}")
        value.meta.update(val=node.meta["val"], stack_trace=node.meta.get("stack_trace"))
        nodes[node].replace_all_uses_with(value)
    for node in reversed(list(gm.graph.nodes)):
        if node in chosen:
            main.graph.erase_node(nodes[node])
    main.graph.lint()
    main.recompile()
    main.meta.update(gm.meta)
    return main


def _copy(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph()
    output = copy.graph_copy(graph, {})
    copy.output(output).meta.update(graph.output_node().meta)
    return copy
