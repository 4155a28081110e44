"""Anchors: the nodes each family looks for, counted independently of its matcher, so no site goes unexplained.

The rule (issue 17): every anchor a family looks for is either replaced or listed under "left as they were"
with a reason. The matchers decide whether a site fuses; this module only says where a site *is*, with
definitions deliberately broader than any pattern, on the canonical graph (compiler/canonicalize.py).
Each family's anchor is declared with the family, in its patterns file (``anchor`` in the ``DECLARATION``,
compiler/families.py), its docstring saying what it finds; a user's family passes one to ``register_family``.

A replaced site no longer holds its anchor (the pass erased it, or, for the causal mask, dropped the mask),
so after the passes every anchor left must have a reason: a rejection of its family at the anchor or a few
nodes downstream of it (where that family's matcher starts). An anchor with none is reported with a generic
reason (``UNMATCHED``) and listed in ``Report.unexplained``: never silent for the user, and a failing test for
sloth (tests/conftest.py).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch.fx as fx


def anchors(graph_modules: Iterable[fx.GraphModule],
            finders: Iterable[tuple[str, Callable[[fx.Node], bool]]]) -> dict[str, list[fx.Node]]:
    """The anchor nodes of each (family, predicate) of ``finders`` in the graphs, in graph order (the pipeline
    passes the enabled families' anchors, each declared with its family: compiler/families.py)."""
    finders = list(finders)
    found: dict[str, list[fx.Node]] = {family: [] for family, _ in finders}
    for graph_module in graph_modules:
        for node in graph_module.graph.nodes:
            for family, is_anchor in finders:
                if is_anchor(node):
                    found[family].append(node)
    return found


def cut_by_graph_boundary(what: str) -> str:
    """The reason for a half of a pattern that a graph boundary cut (a family's ``cut_sites``: compiler/families.py):
    ``what`` says which half went where. A graph break, or Dynamo's DDP optimizer splitting the graph at gradient
    bucket boundaries (sloth is then called once per piece), can fall inside a pattern and leave no anchor in either
    graph; the half a graph returns is reported under its family, so that no site is silently lost."""
    return (f"cut apart by a graph boundary: {what} (a graph break, or DDP's split at a gradient bucket: "
            "torch._dynamo.config.optimize_ddp = False keeps one graph), so neither graph holds the whole pattern")


def returned_only(node: fx.Node) -> bool:
    """Whether ``node``'s one user is the graph's output (the half of a cut pattern a graph returns)."""
    return node.op == "call_function" and len(node.users) == 1 and next(iter(node.users)).op == "output"


UNMATCHED = ("sloth recognised this as the family's site, but none of its patterns matched this form and the pass "
             "gave no reason (a gap in sloth's matching: please report it)")

# How far upstream of a pass's rejection its anchor may lie: the rejection is recorded at the node where the
# match starts (LoRA: the add after the adapter's scale; RoPE: the add of the two products; GLU: the product).
_REACH = 4


def near(anchor: fx.Node, rejected: fx.Node) -> bool:
    """Whether ``anchor`` is ``rejected`` or at most ``_REACH`` nodes upstream of it."""
    frontier, seen = [rejected], {rejected}
    for _ in range(_REACH + 1):
        if anchor in frontier:
            return True
        frontier = [i for n in frontier for i in n.all_input_nodes if i not in seen]
        seen.update(frontier)
    return False


def unexplained(left: dict[str, list[fx.Node]], rejected: list[tuple[str, fx.Node]]) -> list[tuple[str, fx.Node]]:
    """(family, anchor) for each anchor left in the graph that no rejection of its family is at or just
    downstream of: a site the family's pass neither replaced nor explained."""
    return [(family, node) for family, nodes in left.items() for node in nodes
            if not any(f == family and near(node, r) for f, r in rejected)]
