"""The pass guard: a pass that raises leaves the graphs as it found them, the report says so, compilation goes on.

A pass rewrites its graph module in place, so an exception half-way through leaves a graph that is neither the
user's nor sloth's. Before each pass the guard keeps a copy of every graph the pass may touch (the graph it is
given; for a ``whole_module`` pass, every subgraph body too) and the report's lengths; if the pass raises, each
graph is put back from its copy, the report loses what the failed pass recorded, and the failure is recorded as
``Report.failed[name]`` ("internal error: ZeroDivisionError: ...", the traceback in the log). The anchors of a
failed family that remain are then reported with that reason (compiler/pipeline.py), never as unexplained and
never as a crash of the user's step.

Copying is ``Graph.graph_copy``: node metadata (Dynamo's example values) is shared, not copied, so a copy of a
decoder layer's graph costs about a millisecond per thousand nodes. Rejections recorded by earlier passes name
nodes of the old graph; they are mapped onto the restored copies so that the anchor check still finds them.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch.fx as fx

from .report import Report

log = logging.getLogger("sloth")


@dataclasses.dataclass
class _Snapshot:
    """Copies of some graph modules' graphs and meta dicts, and the report's lengths, taken before one pass."""
    graphs: list[tuple[fx.GraphModule, fx.Graph, dict, dict]]  # (module, copy of its graph, old node -> copy, meta)
    sites: int
    rejections: int
    rejected_nodes: int
    recomputed: dict

    @classmethod
    def take(cls, modules: Sequence[fx.GraphModule], report: Report) -> "_Snapshot":
        graphs = []
        for module in modules:
            node_map: dict = {}
            graph = fx.Graph(tracer_cls=module.graph._tracer_cls)
            copied = graph.graph_copy(module.graph, val_map=node_map, return_output_node=True)
            graph._codegen = copy.deepcopy(module.graph._codegen)
            if copied is not None:
                value, old_output = copied
                graph.output(value, type_expr=getattr(old_output, "type", None)).meta = copy.copy(old_output.meta)
            for old, new in node_map.items():
                # Attributes others set on nodes outside their meta (Dynamo's ``_dynamo_source`` on placeholders,
                # which AOTAutograd reads) are not copied by graph_copy.
                for name in old.__dict__.keys() - new.__dict__.keys():
                    setattr(new, name, getattr(old, name))
            graphs.append((module, graph, node_map, dict(module.meta)))
        return cls(graphs, len(report.sites), len(report.rejections), len(report.rejected_nodes), dict(report.recomputed))

    def restore(self, report: Report) -> None:
        node_map: dict = {}
        for module, graph, copied_nodes, meta in self.graphs:
            module.graph = graph
            module.meta.clear()
            module.meta.update(meta)
            module.recompile()
            node_map.update(copied_nodes)
        del report.sites[self.sites:]
        del report.rejections[self.rejections:]
        del report.rejected_nodes[self.rejected_nodes:]
        report.recomputed.clear()
        report.recomputed.update(self.recomputed)
        report.rejected_nodes[:] = [(family, node_map.get(node, node)) for family, node in report.rejected_nodes]


def run_guarded(name: str, modules: Sequence[fx.GraphModule], report: Report, run: Callable[[], Any]) -> bool:
    """Run ``run()`` (a pass over ``modules``); if it raises, put ``modules`` and ``report`` back as they were before
    it, record ``report.failed[name]`` and return False. True when the pass finished."""
    snapshot = _Snapshot.take(modules, report)
    try:
        run()
    except Exception as error:  # noqa: BLE001 - any failure of a pass is sloth's bug, never the user's step's
        snapshot.restore(report)
        reason = f"internal error: {type(error).__name__}: {error}".rstrip(": ")
        report.failed.setdefault(name, reason)
        log.warning("sloth: the %s pass raised and was undone; the graph runs as the pass found it (%s)", name, reason,
                    exc_info=True)
        return False
    return True
