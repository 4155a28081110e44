"""The pass pipeline: a plain ordered list, one pass per pattern family, every pass the same signature.

    pass(gm, example_inputs, *, report) -> gm

``canonicalize`` always runs first (every pattern assumes canonical spellings); the family passes
follow in roadmap order and each can be switched off by name through ``options={"patterns": [...]}``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional, Sequence

import torch.fx as fx

from ..patterns.rms_norm import fuse_rms_norm_pass
from .canonicalize import canonicalize_pass
from .report import Report

GraphPass = Callable[..., fx.GraphModule]


@dataclasses.dataclass(frozen=True)
class FamilyPass:
    family: str
    run: GraphPass


# Roadmap order (DESIGN.md). A family's pass may rely on the passes before it having run.
FAMILY_PASSES: tuple[FamilyPass, ...] = (
    FamilyPass("rms_norm", fuse_rms_norm_pass),
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


def run_passes(gm: fx.GraphModule, example_inputs: Sequence[Any], families: Sequence[str],
               report: Report) -> fx.GraphModule:
    """Canonicalise, then run each enabled family's pass in order; the report collects what happened."""
    report.graphs += 1
    report.disabled = sorted(set(report.disabled) | (set(FAMILIES) - set(families)))
    gm = canonicalize_pass(gm, example_inputs, report=report)
    for family_pass in FAMILY_PASSES:
        if family_pass.family in families:
            gm = family_pass.run(gm, example_inputs, report=report)
    return gm
