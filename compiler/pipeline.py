"""The pass pipeline: canonicalisation, the registered family passes in order, the anchor check, recompute.

Every pass has one signature:

    pass(gm, example_inputs, *, report, options) -> gm

``options`` (a PassOptions) carries the switches a pass may read; a subgraph body gets the user's options
except those that would change what it returns to its caller (``return_logits``, ``top_level``).

``canonicalize`` runs first, on the graph and every subgraph body (every pattern assumes canonical
spellings); then each family registered in compiler/families.py (sloth's own, registered below in their declared
order, and a user's) runs in registry order, unless switched off by name (``options={"disable": [...]}``, or
left out of ``options={"patterns": [...]}``). A family pass runs on the graph and on each subgraph body, except a
``whole_module`` one, which runs once on the top-level graph and reaches into the bodies itself (the causal
mask: a body receives it from its caller). Then every enabled family's anchors left in the graphs are
checked for a reason (compiler/anchors.py), and ``recompute`` marks what the backward should recompute
rather than keep. Every pass runs guarded (compiler/pass_guard.py): one that raises is undone on the graphs it
was given, named in ``report.failed``, and the compile goes on without it. One pass finishes on every graph
before the next starts, so the graph dumps (compiler/dump.py) show the whole graph after each pass.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch.fx as fx

from .anchors import UNMATCHED, anchors, unexplained
from .canonicalize import canonicalize_pass
from .dump import GraphDump
from .families import family_passes, families, register_declared
from .fx_utils import subgraphs
from .options import PassOptions
from .pass_guard import run_guarded
from .recompute import recompute_pass
from .report import Report

log = logging.getLogger("sloth")

# sloth's own families, each declared in its patterns file (a ``DECLARATION``: compiler/families.py), registered
# in their declared order through the registry a user's family joins too.
register_declared()
# The built-in families' names (``families()`` lists a user's too).
FAMILIES: tuple[str, ...] = families()


def run_passes(gm: fx.GraphModule, example_inputs: Sequence[Any], families: Sequence[str],
               report: Report, options: PassOptions = PassOptions(), dump_root: Optional[str] = None,
               refuse: Optional[str] = None) -> fx.GraphModule:
    """Canonicalise, then run each enabled family's pass in registry order, on the graph and on every subgraph.

    With ``refuse`` (a reason) no family pass runs: every site the enabled families' anchors find is reported
    with that reason and the graph stays as it was, canonicalised (compiler/subclass_guard.py).

    Each pass's wall time is added to ``report.pass_seconds`` under its name ("canonicalize", a family's name,
    "anchors", "recompute"), summed over the graph and its subgraphs. With ``dump_root`` the graph is written
    there before the passes and after each pass that changed it (compiler/dump.py)."""
    report.graphs += 1
    report.ran_on(example_inputs)
    registered = family_passes()
    report.disabled = sorted(set(report.disabled) | ({p.name for p in registered} - set(families)))
    dump = GraphDump(dump_root, gm) if dump_root else None
    if dump:
        report.dumps.append(dump.folder)
        dump.snapshot("before", gm)

    def timed(name: str, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            report.pass_seconds[name] += time.perf_counter() - start

    graph_modules = [gm, *subgraphs(gm)]
    # A subgraph's outputs feed its caller, so it must keep returning the logits; every other option is
    # the user's there too (a checkpointed layer must honour share_lora_input=False).
    subgraph_options = dataclasses.replace(options, return_logits=True, top_level=False)

    def options_for(graph_module: fx.GraphModule) -> PassOptions:
        return options if graph_module is gm else subgraph_options

    # Each pass runs guarded (compiler/pass_guard.py): one that raises is undone on the graphs it was given and
    # named in report.failed; compilation goes on without it.
    for graph_module in graph_modules:
        if not run_guarded("canonicalize", [graph_module], report, lambda: timed(
                "canonicalize", canonicalize_pass, graph_module, example_inputs, report=report,
                options=options_for(graph_module))) and refuse is None:
            # Every pattern assumes canonical spellings: without them no family runs, each site reported.
            refuse = f"canonicalisation failed ({report.failed['canonicalize']}); the graph runs as written"
    if dump:
        dump.snapshot("canonicalize", gm)
    enabled = [p for p in registered if p.name in families]
    for family_pass in enabled if refuse is None else []:
        for graph_module in graph_modules:
            if graph_module is gm or not family_pass.whole_module:
                touched = graph_modules if family_pass.whole_module else [graph_module]
                results: list[Any] = []
                if not run_guarded(family_pass.name, touched, report, lambda: results.append(timed(
                        family_pass.name, family_pass.run, graph_module, example_inputs, report=report,
                        options=options_for(graph_module)))):
                    break  # undone on this graph; the family's sites left get its reason below
                if results[0] is not graph_module:
                    raise TypeError(f"sloth: the {family_pass.name!r} pass returned {type(results[0]).__name__}; "
                                    "a pass rewrites the graph module it is given in place and returns it")
        if dump:
            dump.snapshot(family_pass.name, gm)
    # Halves of patterns a graph boundary cut, which no anchor sees (each family's ``cut_sites``).
    if refuse is None:
        for family_pass in enabled:
            for node, reason in family_pass.cut_sites(gm) if family_pass.cut_sites is not None else ():
                report.reject(family_pass.name, node, reason)
    # Every anchor a family looks for and left in the graph gets a reason in the report (compiler/anchors.py).
    left = timed("anchors", anchors, graph_modules, [(p.name, p.anchor) for p in enabled if p.anchor is not None])
    report.anchors_left.update({family: len(nodes) for family, nodes in left.items() if nodes})
    for family, node in unexplained(left, report.rejected_nodes):
        if refuse is not None or family in report.failed:
            report.reject(family, node, refuse if refuse is not None else
                          f"the {family} pass raised and was undone ({report.failed[family]})")
            continue
        report.reject(family, node, UNMATCHED)
        report.unexplained.setdefault(family, []).append(report.rejections[-1].module or "(top level)")
        log.warning("sloth: %s: a site at %s matched none of the family's patterns and its pass gave no reason",
                    family, report.rejections[-1].source or node.name)
    # Top level only: subgraph bodies keep their own policy (a checkpointed layer is recomputed whole already).
    run_guarded("recompute", [gm], report, lambda: timed(
        "recompute", recompute_pass, gm, example_inputs, report=report, options=options))
    return gm
