"""The pass loop of the families whose sites are found one node at a time (layer_norm, rms_norm, l2_norm).

    for each call node whose target one of the family's matchers looks at:
        match = matcher(node)      None: not a site of this form; a str: the reason it is left as it was;
                                   else a match object, which ``replace`` rewrites (returning the nodes it erased)
        report it: the reason, or the op it became with ``describe(match)``

Nodes a replacement erased are skipped (the loop walks a copy of the node list). The graph is linted and
recompiled once at the end.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch.fx as fx

from ..compiler.fx_utils import is_call, module_path, source_location
from ..compiler.report import Report, Site

Matcher = Callable[[fx.Node], Optional[Union[str, Any]]]


def rewrite_sites(gm: fx.GraphModule, report: Report, family: str, op: str,
                  matchers: Iterable[tuple[tuple[Callable, ...], Matcher]],
                  replace: Callable[[fx.GraphModule, Any], set[fx.Node]],
                  describe: Callable[[Any], str]) -> fx.GraphModule:
    """Run ``matchers`` ((targets, matcher) pairs, the first whose targets the node calls decides) over ``gm``'s
    call nodes; replace each match with ``replace(gm, match)`` and report it as ``op``; report each reason."""
    matchers = list(matchers)
    erased: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in erased or node.op != "call_function":
            continue
        matcher = next((m for targets, m in matchers if is_call(node, *targets)), None)
        found = matcher(node) if matcher is not None else None
        if found is None:
            continue
        if isinstance(found, str):
            report.reject(family, node, found)
            continue
        detail = describe(found)
        erased |= replace(gm, found)
        report.replaced(Site(family, op, module_path(node), source_location(node), detail))
    gm.graph.lint()
    gm.recompile()
    return gm
