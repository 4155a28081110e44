"""The pass pipeline: a plain ordered list, one pass per pattern family, every pass the same signature.

    pass(gm, example_inputs, *, report, options) -> gm

``options`` (a PassOptions) carries the switches a pass may read; subgraphs get the defaults, since their
outputs feed the graph that calls them rather than the user.

``canonicalize`` always runs first (every pattern assumes canonical spellings); the family passes
follow in roadmap order and each can be switched off by name through ``options={"patterns": [...]}``;
``recompute`` runs last and marks what the backward should recompute rather than keep. A family pass runs
on the graph and on each subgraph body, except a ``whole_module`` one, which runs once on the top-level
graph and reaches into the bodies itself (the causal mask: a body receives it from its caller); it sees
the bodies before their canonicalisation, so it must not rely on canonical spellings (the causal mask
evaluates whatever ops build the mask).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import torch.fx as fx

from ..patterns.causal_mask import fuse_causal_mask_pass
from ..patterns.cross_entropy import fuse_cross_entropy_pass
from ..patterns.glu import fuse_glu_pass
from ..patterns.lora import fuse_lora_pass
from ..patterns.rms_norm import fuse_rms_norm_pass
from ..patterns.rope import fuse_rope_pass
from .anchors import UNMATCHED, anchors, unexplained
from .canonicalize import canonicalize_pass
from .options import PassOptions
from .recompute import recompute_pass
from .report import Report

GraphPass = Callable[..., fx.GraphModule]
log = logging.getLogger("sloth")


@dataclasses.dataclass(frozen=True)
class FamilyPass:
    family: str
    run: GraphPass
    whole_module: bool = False  # run once on the top-level graph, which reaches into its bodies itself


# Roadmap order (DESIGN.md). A family's pass may rely on the passes before it having run.
FAMILY_PASSES: tuple[FamilyPass, ...] = (
    FamilyPass("rms_norm", fuse_rms_norm_pass),
    FamilyPass("rope", fuse_rope_pass),
    FamilyPass("glu", fuse_glu_pass),
    FamilyPass("cross_entropy", fuse_cross_entropy_pass),
    FamilyPass("lora", fuse_lora_pass),
    FamilyPass("causal_mask", fuse_causal_mask_pass, whole_module=True),
)
FAMILIES: tuple[str, ...] = tuple(p.family for p in FAMILY_PASSES)


def resolve_families(patterns: Optional[Iterable[str]]) -> list[str]:
    """The families to run: all by default; a clear error for a name that is not a family."""
    if patterns is None:
        return list(FAMILIES)
    if isinstance(patterns, str):
        patterns = [patterns]
    chosen = list(patterns)
    unknown = [p for p in chosen if p not in FAMILIES]
    if unknown:
        raise ValueError(f"sloth: unknown pattern famil{'y' if len(unknown) == 1 else 'ies'} {unknown}; "
                         f"known: {list(FAMILIES)}")
    return chosen


def _subgraphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """Graph bodies of higher-order ops (activation checkpointing, autograd.Function, cond, ...).

    Dynamo puts e.g. each gradient-checkpointed decoder layer into such a body; the passes rewrite
    them like the top-level graph. A rewrite there is safe for the same reason as at top level: it
    keeps every value the body returns, and an intermediate the body returns (say, one saved for a
    custom backward) has a user outside the pattern, which makes the guards say no.
    """
    return [m for name, m in gm.named_modules() if m is not gm and isinstance(m, fx.GraphModule)]


def run_passes(gm: fx.GraphModule, example_inputs: Sequence[Any], families: Sequence[str],
               report: Report, options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Canonicalise, then run each enabled family's pass in order, on the graph and on every subgraph.

    Each pass's wall time is added to ``report.pass_seconds`` under its name ("canonicalize", a family's name,
    "anchors", "recompute"), summed over the graph and its subgraphs."""
    report.graphs += 1
    report.disabled = sorted(set(report.disabled) | (set(FAMILIES) - set(families)))

    def timed(name: str, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            report.pass_seconds[name] += time.perf_counter() - start

    graph_modules = [gm, *_subgraphs(gm)]
    for graph_module in graph_modules:
        # A subgraph's outputs feed its caller, so it must keep returning the logits; every other option is
        # the user's there too (a checkpointed layer must honour share_lora_input=False).
        graph_options = options if graph_module is gm else dataclasses.replace(options, return_logits=True,
                                                                               top_level=False)
        timed("canonicalize", canonicalize_pass, graph_module, example_inputs, report=report, options=graph_options)
        for family_pass in FAMILY_PASSES:
            if family_pass.family in families and (graph_module is gm or not family_pass.whole_module):
                timed(family_pass.family, family_pass.run, graph_module, example_inputs, report=report,
                      options=graph_options)
    # Every anchor a family looks for and left in the graph gets a reason in the report (compiler/anchors.py).
    left = timed("anchors", anchors, graph_modules, families)
    report.anchors_left.update({family: len(nodes) for family, nodes in left.items() if nodes})
    for family, node in unexplained(left, report.rejected_nodes):
        report.reject(family, node, UNMATCHED)
        report.unexplained.setdefault(family, []).append(report.rejections[-1].module or "(top level)")
        log.warning("sloth: %s: a site at %s matched none of the family's patterns and its pass gave no reason",
                    family, report.rejections[-1].source or node.name)
    # Top level only: subgraph bodies keep their own policy (a checkpointed layer is recomputed whole already).
    timed("recompute", recompute_pass, gm, example_inputs, report=report, options=options)
    return gm
