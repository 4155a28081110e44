"""The Report: what each pass replaced, where in the user's source, and why near-misses were refused."""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any, Sequence

import torch
import torch.fx as fx

from ..lowering.backend_choice import execution_path
from .fx_utils import module_path, source_location

log = logging.getLogger("sloth")


@dataclasses.dataclass(frozen=True)
class Site:
    """One replaced subgraph: ``family`` (e.g. "rms_norm"), the op it became, where it came from."""
    family: str
    op: str
    module: str
    source: str
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A near-miss a pass looked at and left as it was, with the reason."""
    family: str
    module: str
    source: str
    reason: str


@dataclasses.dataclass
class Report:
    """Everything sloth did to the graphs of one compile (or one ``sloth.explain`` call).

    ``counts`` maps each family to the number of sites replaced; ``str(report)`` is a table.
    """
    sites: list[Site] = dataclasses.field(default_factory=list)
    rejections: list[Rejection] = dataclasses.field(default_factory=list)
    disabled: list[str] = dataclasses.field(default_factory=list)
    graphs: int = 0
    # op name -> outputs tagged to be recomputed in the backward rather than saved where a backward reads them
    # (compiler/recompute.py; the partitioner acts on the tags, so inner="eager" ignores them)
    recomputed: Counter = dataclasses.field(default_factory=Counter)
    # family -> where its anchors were left with no reason from the family's pass (compiler/anchors.py): they
    # are in ``rejections`` too, with a generic reason; a matcher gap for sloth to close, never silent.
    unexplained: dict = dataclasses.field(default_factory=dict)
    # family -> anchors left in the graphs after the passes (each with one reason in ``rejections``)
    anchors_left: Counter = dataclasses.field(default_factory=Counter)
    # pass name -> seconds spent in it (compiler/pipeline.py run_passes), summed over graphs and subgraphs
    pass_seconds: Counter = dataclasses.field(default_factory=Counter)
    # what the offload option moved to host memory, one OffloadRecord per partitioned graph
    # (compiler/offload_partition.py; empty without the option or for an inference graph)
    offload: list = dataclasses.field(default_factory=list)
    # pass name -> "internal error: ..." for each pass that raised and was undone (compiler/pass_guard.py): the
    # graph ran as that pass found it, and the family's sites left are reported with this reason
    failed: dict = dataclasses.field(default_factory=dict)
    # late pass name -> why it did not run on these graphs (compiler/late_passes.py passes_off)
    passes_off: dict = dataclasses.field(default_factory=dict)
    # the plan's line for each graph (compiler/planner.py), one per distinct plan
    plan: list = dataclasses.field(default_factory=list)
    # folders the graphs were dumped into (the ``dump`` option, compiler/dump.py)
    dumps: list = dataclasses.field(default_factory=list)
    # what ran the sloth ops of these graphs, as the first line says (lowering/backend_choice.py execution_path)
    paths: list = dataclasses.field(default_factory=list)
    # (family, node) of each rejection of this graph, for compiler/anchors.py; not merged (nodes are per graph)
    rejected_nodes: list = dataclasses.field(default_factory=list, repr=False, compare=False)

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(site.family for site in self.sites))

    def ran_on(self, example_inputs: Sequence[Any]) -> None:
        """Record what runs the sloth ops of a graph with these inputs (nothing for a graph without tensors)."""
        devices = [x.device for x in example_inputs if isinstance(x, torch.Tensor)]
        path = execution_path(devices) if devices else None
        if path is not None and path not in self.paths:
            self.paths.append(path)

    def replaced(self, site: Site) -> None:
        self.sites.append(site)
        log.info("sloth: %s -> %s at %s %s", site.family, site.op, site.module or "?", site.source)

    def replaced_at(self, family: str, node: "fx.Node", op: str, detail: str = "") -> None:
        """Record that ``family`` replaced a site with ``op``; ``node`` (the new node, or the site's old root)
        gives the module path and source line."""
        self.replaced(Site(family, op, module_path(node), source_location(node), detail))

    def rejoined(self, family: str, node: "fx.Node", op: str, note: str) -> None:
        """Record that the site ``family`` replaced with the op at ``node`` (module path and source line as its
        Site has them) is now part of ``op``, a later pass having joined that op into another (the RMSNorms of
        q and k into ``sloth.norm_rope``: patterns/norm_rope.py)."""
        key = (family, module_path(node), source_location(node))
        for i, site in enumerate(self.sites):
            if (site.family, site.module, site.source) == key and site.op != op:
                detail = f"{site.detail}; {note}" if site.detail else note
                self.sites[i] = dataclasses.replace(site, op=op, detail=detail)
                return

    def kept_on_purpose(self, family: str, anchor: "fx.Node") -> None:
        """Record that the site at ``anchor``, left in the graph, is accounted for by a Site already recorded
        (a causal mask read from a graph input, chosen per call: patterns/causal_mask.py), so the anchor check
        (compiler/anchors.py) does not call it unexplained."""
        self.rejected_nodes.append((family, anchor))

    def reject(self, family: str, anchor: "fx.Node", reason: str) -> None:
        """Record that ``family`` left the site at ``anchor`` as it was, and why."""
        self.rejected_nodes.append((family, anchor))
        self.rejected(Rejection(family, module_path(anchor), source_location(anchor), reason))

    def rejected(self, rejection: Rejection) -> None:
        self.rejections.append(rejection)
        log.info("sloth: %s left as it was at %s %s: %s", rejection.family, rejection.module or "?",
                 rejection.source, rejection.reason)

    def merge(self, other: "Report") -> None:
        self.sites += other.sites
        self.rejections += other.rejections
        self.disabled = sorted(set(self.disabled) | set(other.disabled))
        self.graphs += other.graphs
        self.recomputed += other.recomputed
        self.anchors_left += other.anchors_left
        self.dumps += other.dumps
        self.paths += [path for path in other.paths if path not in self.paths]
        self.offload += other.offload
        self.pass_seconds.update(other.pass_seconds)  # update, not +=: keeps a pass that took 0.0 s
        for name, reason in other.failed.items():
            self.failed.setdefault(name, reason)
        for name, reason in other.passes_off.items():
            self.passes_off.setdefault(name, reason)
        self.plan += [line for line in other.plan if line not in self.plan]
        for family, where in other.unexplained.items():
            self.unexplained[family] = self.unexplained.get(family, []) + where

    def __str__(self) -> str:
        ran = f" ({' + '.join(self.paths)})" if self.paths else ""
        out = [f"sloth report{ran}: {self.graphs} graph(s), "
               + (", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items())) or "nothing replaced")]
        if self.failed:
            out.append("  passes that raised and were undone (a bug in sloth; the graph ran as the pass found it): "
                       + "; ".join(f"{name}: {reason}" for name, reason in self.failed.items()))
        for line in self.plan:
            out.append(f"  plan: {line}")
        if self.disabled:
            out.append(f"  disabled passes: {', '.join(self.disabled)}")
        if self.passes_off:
            by_reason: dict = {}
            for name, reason in self.passes_off.items():
                by_reason.setdefault(reason, []).append(name)
            out.append("  partition / post-grad passes off: " + "; ".join(f"{', '.join(names)} ({reason})"
                                                           for reason, names in by_reason.items()))
        if self.pass_seconds:
            out.append(f"  sloth's passes took {sum(self.pass_seconds.values()):.3f} s: "
                       + ", ".join(f"{name} {seconds:.3f}" for name, seconds in self.pass_seconds.items()))
        if self.offload:
            tensors, nbytes = sum(r.tensors for r in self.offload), sum(r.nbytes for r in self.offload)
            kept, small = sum(r.kept for r in self.offload), sum(r.skipped_small for r in self.offload)
            out.append(f"  offloaded to host memory: {tensors} saved activation(s), {nbytes / 2**20:.1f} MiB a step "
                       f"each way; {kept} kept on the device (read first by the backward), {small} below min_bytes")
        if self.dumps:
            out.append(f"  graphs dumped to: {', '.join(self.dumps)}")
        if self.recomputed:
            out.append("  marked to be recomputed in backward, not saved: "
                       + ", ".join(f"{n} sloth.{op} outputs" for op, n in sorted(self.recomputed.items())))
        if self.sites:
            out.append("  replaced:")
            for s in self.sites:
                out.append(f"    {s.family:<12} -> {s.op:<16} {s.module or '(top level)'}"
                           + (f"  [{s.detail}]" if s.detail else ""))
                if s.source:
                    out.append(f"    {'':<12}    at {s.source}")
        if self.rejections:
            out.append("  left as they were:")
            for r in self.rejections:
                out.append(f"    {r.family:<12}    {r.module or '(top level)'}: {r.reason}")
                if r.source:
                    out.append(f"    {'':<12}    at {r.source}")
        return "\n".join(out)
