"""MoE experts written as a list of modules (part of ``moe_route``, patterns/moe.py): an ``nn.ModuleList`` of small
MLPs, each with its own 2-D gate / up / down ``nn.Linear`` weights (research code, nanoGPT-style MoE forks, the
reference implementations of Mixtral and DeepSeek-V3). In the graph each expert's weights are separate inputs.

The dense form (every expert on every token, combined by a scattered top-k weight) fuses::

    weights = zeros(T, E).scatter(1, idx, w)                                   idx, w [T, K] (a top-k)
    out     = sum_e weights[:, e:e+1] * down_e(act(gate_e x) * up_e x)          (or ungated: down_e(act(up_e x)))

also as ``(weights.unsqueeze(-1) * torch.stack([expert(x) ...], 1)).sum(1)``. An expert a token did not choose has
weight 0, so this is the routed sum ``moe_experts_pattern`` (lowering/moe.py) on the stacked weights::

    W1 = cat([stack(W_gate_e), stack(W_up_e)], 1) [E, 2I, H]   (ungated, or one fused gate_up linear: stack(W_e))
    W2 = stack(W_down_e) [E, H, I]

and ``sloth.moe_experts(x, idx, w, W1, W2)`` replaces it: K of the E expert MLPs a token instead of E. The
gradients are the dense form's: d w[t, k] = <dout_t, y_e(t)> is d weights[t, idx[t, k]] through the scatter; the
unchosen entries' gradient goes to the zeros the scatter overwrote (no parameter), and a weight gradient of an
expert sums only the tokens that chose it (the others carry a zero factor). The stacks stay in the graph: each step
copies the experts' weights once (E * 3I * H elements, as much as the GEMMs read) and the backward slices the
stacked gradients back to the parameters; AOT / Inductor fuse both into the surrounding copies.

How a site is found (canonical graph): its anchors are the experts' linears (compiler/anchors.py
``is_expert_list_gemm``: a linear on a 2-D weight input whose MLP's result a router weight scales). Each *down*
linear is the one whose result is scaled; its first linears are the linears on its rows' side within its MLP (one:
ungated or gate and up fused; two: gate and up, the gate the one an activation reads first). Experts reading one
token value x with the same weight shapes are one block; ``out`` is the first [T, H] value downstream of all of their
down linears (through casts); idx and w are the last [T, K] integer and float values upstream of it; the region is
``out`` back to those and the experts' weights, and must read nothing else. It is accepted as patterns/moe.py's
sites are: evaluated on random probes (random tokens, distinct random experts a token, random router and expert
weights) and compared with the pattern for each activation the region names (else each of the op's), expert e being
the e-th block of the graph in order; one that agrees on both probes is taken.

Not fused, reported:
  - biased experts (``nn.Linear(bias=True)``): the region reads the biases (the op's biases are stacked [E, n]
    inputs; stacking them too is not done yet);
  - the loop over experts on the tokens routed to each (Mixtral's reference ``MoeLayer``, DeepSeek-V3's ``MoE``:
    ``rows, k = torch.where(idx == e); y[rows] += w[rows, k, None] * expert(x[rows])``). By default Dynamo cannot
    hold it: ``torch.where`` is ``nonzero``, whose output shape depends on the data, a graph break inside a loop,
    so Dynamo skips the block's frame (it runs eagerly) and compiles each expert's MLP as a graph of its own, a
    dense MLP like any other (the glu family's); no graph holds a router or an expert loop, and there is no site.
    With ``torch._dynamo.config.capture_dynamic_output_shape_ops = True`` the loop is one graph whose row counts
    are unbacked sizes (u0, u1, ...) and whose result is written into a buffer by index (``y[rows] += ...``): that
    graph is reported with this reason;
  - anything the probes refuse (another combine, token dropping, a post-expert norm), with their reason.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx as fx

from .moe_router import is_topk
from .moe_sites import is_router_weight, list_expert_weight
from ..compiler.fx_utils import (ancestors, descendants, insert_call, linear_parts, module_path, op_name,
                                 replace_and_erase, source_location, tensor_of, value_of)
from ..compiler.options import PassOptions
from ..compiler.report import Report, Site

FAMILY = "moe_route"
# How many nodes after a down linear the router weight's product may lie (views, casts, a stack).
_COMBINE_DEPTH = 3
# How many nodes back from a down linear's rows its first linears may lie (the activation, the GLU's product, casts).
_MLP_DEPTH = 6
# Calls that read only their first operand's shape, dtype and device (a buffer made like it).
_LIKE = {"zeros_like", "ones_like", "empty_like", "new_zeros", "new_ones", "new_empty"}


@dataclasses.dataclass
class ListExpert:
    """One expert's linears: ``firsts`` (gate and up, or one) on ``rows``, ``down`` on their activation."""
    firsts: list[fx.Node]
    down: fx.Node
    rows: fx.Node

    def weights(self) -> list[fx.Node]:
        return [list_expert_weight(n) for n in (*self.firsts, self.down)]

    def gemms(self) -> list[fx.Node]:
        return [*self.firsts, self.down]


def _scaled_by_router(down: fx.Node) -> bool:
    """Whether ``down``'s result is multiplied by a router weight within _COMBINE_DEPTH nodes."""
    frontier, walked = [down], {down}
    for _ in range(_COMBINE_DEPTH):
        frontier = [u for n in frontier for u in n.users if u not in walked]
        walked.update(frontier)
        if any(op_name(u) == "mul" and any(isinstance(a, fx.Node) and a not in walked and is_router_weight(a)
                                           for a in u.args) for u in frontier if u.op != "output"):
            return True
    return False


def _firsts(down: fx.Node) -> list[fx.Node]:
    """The linears on a 2-D weight input upstream of ``down``'s rows within its MLP (_MLP_DEPTH nodes, through
    elementwise ops and views, not through other linears)."""
    found, frontier, seen = [], [linear_parts(down)[0]], set()
    for _ in range(_MLP_DEPTH):
        nxt = []
        for node in frontier:
            if not isinstance(node, fx.Node) or node in seen or node.op == "placeholder":
                continue
            seen.add(node)
            if list_expert_weight(node) is not None:
                found.append(node)
            elif not is_topk(node):
                nxt.extend(node.all_input_nodes)
        frontier = nxt
    order = {n: i for i, n in enumerate(down.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _token_source(rows: fx.Node) -> fx.Node:
    """The value ``rows`` gathers by an integer index (``x[rows]``: the loop form), else ``rows`` itself."""
    if op_name(rows) in ("getitem", "index_select") and isinstance(rows.args[0], fx.Node):
        index = rows.args[1] if op_name(rows) == "getitem" else rows.args[2]
        value = tensor_of(index) if isinstance(index, fx.Node) else None
        if value is not None and not value.is_floating_point() and value.dtype != torch.bool:
            return rows.args[0]
    return rows


def _experts(gm: fx.GraphModule) -> list[list[ListExpert]]:
    """The blocks of list experts, each its experts in graph order."""
    blocks: dict[tuple, list[ListExpert]] = {}
    for node in gm.graph.nodes:
        if list_expert_weight(node) is None or not _scaled_by_router(node):
            continue
        firsts = _firsts(node)
        rows = {linear_parts(f)[0] for f in firsts}
        if not firsts or len(firsts) > 2 or len(rows) != 1:
            continue
        expert = ListExpert(firsts, node, rows.pop())
        shapes = tuple(tuple(tensor_of(w).shape) for w in expert.weights())
        blocks.setdefault((_token_source(expert.rows), shapes), []).append(expert)
    return list(blocks.values())


@dataclasses.dataclass
class ListSite:
    experts: list[ListExpert]
    x: fx.Node
    out: Optional[fx.Node] = None
    idx: Optional[fx.Node] = None
    w: Optional[fx.Node] = None
    region: list[fx.Node] = dataclasses.field(default_factory=list)
    act: str = ""
    gated: bool = True
    swapped: bool = False  # the second of two first linears is the gate
    shape_only: tuple[fx.Node, ...] = ()  # values the region reads only the shape of (``zeros_like(logits)``)


def _interface(experts: list[ListExpert]) -> tuple[Optional[ListSite], Optional[str]]:
    """The block's site (out, idx, w, region), or why none."""
    from .moe import _region

    x = _token_source(experts[0].rows)
    site = ListSite(experts, x)
    gathered = experts[0].rows is not x
    if len(experts) < 2:
        return None, "one expert module alone whose result a router weight scales: no list of experts to route"
    common = set.intersection(*(descendants(e.down) for e in experts))
    order = {n: i for i, n in enumerate(x.graph.nodes)}
    shape = tuple(tensor_of(x).shape)
    outs = sorted((n for n in common if (v := tensor_of(n)) is not None and tuple(v.shape) == shape), key=order.get)
    if not outs:
        if gathered:
            return None, ("a loop over experts on the tokens routed to each (torch.where / nonzero: row counts known "
                          "only at run time, unbacked sizes), accumulated into a buffer by index writes "
                          "(y[rows] += ...): not fused yet; the loop runs as written")
        return None, f"no {list(shape)} value follows every expert's output (the experts' weighted sum)"
    out = outs[0]
    while len(out.users) == 1 and op_name(next(iter(out.users))) in ("to", "cast", "type_as") \
            and tuple(tensor_of(next(iter(out.users))).shape) == shape:
        out = next(iter(out.users))
    tokens = shape[0]
    above = sorted(ancestors(out), key=order.get)
    upstream = [n for n in above if (v := tensor_of(n)) is not None
                and v.dim() == 2 and v.shape[0] == tokens and 0 < v.shape[1] < len(experts)]
    ints = [n for n in upstream if not tensor_of(n).is_floating_point() and tensor_of(n).dtype != torch.bool]
    floats = [n for n in upstream if tensor_of(n).is_floating_point()
              and ints and tensor_of(n).shape == tensor_of(ints[-1]).shape]
    if not ints or not floats:
        return None, f"no [{tokens}, k] expert ids and router weights (a top-k) found upstream of the experts' sum"
    site.out, site.idx, site.w = out, ints[-1], floats[-1]
    weights = {w for e in experts for w in e.weights()}
    # the [T, E] buffer the weights are scattered into is often zeros_like(logits): it reads the router's shape only
    site.shape_only = tuple(dict.fromkeys(n.args[0] for n in above
                                          if op_name(n) in _LIKE and isinstance(n.args[0], fx.Node)
                                          and n.args[0] not in (x, site.idx, site.w)))
    site.region, why_not = _region(out, {x, site.idx, site.w, *weights, *site.shape_only})
    return (site, None) if why_not is None else (None, why_not)


def _stacked(site: ListSite, values: dict[fx.Node, torch.Tensor], swapped: bool) -> tuple[torch.Tensor, ...]:
    """(W1 [E, 2I, H] or [E, I, H], W2 [E, H, I]) from per-expert ``values``."""
    firsts = [[values[list_expert_weight(f)] for f in e.firsts] for e in site.experts]
    if swapped:
        firsts = [f[::-1] for f in firsts]
    w1 = torch.cat([torch.stack([f[i] for f in firsts]) for i in range(len(firsts[0]))], dim=1)
    return w1, torch.stack([values[list_expert_weight(e.down)] for e in site.experts])


def _accept(site: ListSite) -> Optional[str]:
    """Set the site's activation and layout if the region equals the op's pattern on random probes, else why not."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from .moe import ACTIVATIONS, PROBE_TOLERANCE, UNGATED_ACTIVATIONS, _candidate_activations, _evaluate, _lowering
    from .moe_split import _activated

    x, out = tensor_of(site.x), tensor_of(site.out)
    if out.dtype not in PROBE_TOLERANCE or x.dtype not in PROBE_TOLERANCE:
        return f"its dtype {out.dtype} is not one the fused op supports"
    experts, moe = len(site.experts), _lowering()
    two = len(site.experts[0].firsts) == 2
    # two first linears: gate and up (halves of W1); one: ungated, or gate and up in one linear (probed both ways)
    # one: ungated (up [I, H], down [H, I]), or gate and up in one linear ([2I, H] beside a down [H, I])
    first, down = site.experts[0].weights()[0], site.experts[0].weights()[-1]
    rows1, width2 = tensor_of(first).shape[0], tensor_of(down).shape[1]
    layouts = [(True, _activated(site.experts[0].firsts[1]) and not _activated(site.experts[0].firsts[0]))] if two \
        else [(False, False)] if rows1 == width2 else [(True, False)] if rows1 == 2 * width2 else []
    if not layouts:
        return f"its expert linears' widths ({rows1} out of the first, {width2} into the down) are no expert MLP's"

    errors: dict[tuple, float] = {}
    with unset_fake_temporarily(), torch.no_grad():
        for seed, scale in ((0, 1.0), (1, 16.0)):
            g = torch.Generator(device=x.device).manual_seed(seed)
            tokens, top_k = tensor_of(site.idx).shape
            probe = {site.x: (scale * torch.randn(x.shape, generator=g, device=x.device)).to(x.dtype),
                     site.idx: torch.rand(tokens, experts, generator=g, device=x.device).argsort(-1)[:, :top_k]
                     .contiguous().to(tensor_of(site.idx).dtype),
                     site.w: torch.rand(tokens, top_k, generator=g, device=x.device).to(tensor_of(site.w).dtype)}
            for like in site.shape_only:  # (only its shape matters)
                probe[like] = torch.zeros(tuple(tensor_of(like).shape), dtype=tensor_of(like).dtype, device=x.device)
            for weight in {w for e in site.experts for w in e.weights()}:
                value = tensor_of(weight)
                probe[weight] = (torch.randn(value.shape, generator=g, device=x.device)
                                 / value.shape[1] ** 0.5).to(value.dtype)
            try:
                value = _evaluate(site, probe).float()
            except Exception as error:  # an op that cannot run outside the graph: leave the site as it was
                return f"evaluating it on a probe failed ({type(error).__name__}: {error})"
            for gated, swapped in layouts:
                w1, w2 = (t.float() for t in _stacked(site, probe, swapped))
                for act in _candidate_activations(site.region, ACTIVATIONS if gated else UNGATED_ACTIVATIONS):
                    ref = moe.moe_experts_pattern(probe[site.x].float(), probe[site.idx], probe[site.w].float(), w1,
                                                  w2, act, gated=gated)
                    error = float((value - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                    errors[act, gated, swapped] = max(errors.get((act, gated, swapped), 0.0), error)
    closest = min(errors, key=errors.get)
    if errors[closest] <= PROBE_TOLERANCE[out.dtype]:
        site.act, site.gated, site.swapped = closest
        return None
    return (f"on random probes it is not the routed sum of its {experts} experts (sum_k w * down_e(act(...)) with "
            f"e = idx[t, k], expert e the e-th in the graph) for any supported activation (closest: {closest[0]}, "
            f"relative error {errors[closest]:.2g}): another combine, token dropping or a post-expert norm")


def fuse_expert_lists(gm: fx.GraphModule, report: Report, options: PassOptions) -> bool:
    """Replace each block of list experts with ``sloth.moe_experts`` on their stacked weights (module docstring).

    before:  weights = zeros.scatter(1, idx, w); out = sum_e weights[:, e:e+1] * down_e(act(gate_e x) * up_e x)
    after:   W1 = cat([stack(gate_e), stack(up_e)], 1); W2 = stack(down_e); out = sloth.moe_experts(x, idx, w, W1, W2)[0]
    """
    from .moe import _erase_dead, _lowering

    changed = False
    for experts in _experts(gm):
        anchor = experts[0].firsts[0]
        site, why_not = _interface(experts)
        why_not = why_not or _accept(site)
        others = [g for e in experts for g in e.gemms() if g is not anchor]
        if why_not is not None:
            report.reject(FAMILY, anchor, why_not)
            report.rejected_nodes.extend((FAMILY, g) for g in others)
            continue
        _lowering().register()
        graph, at = gm.graph, site.out
        firsts = [[list_expert_weight(f) for f in e.firsts] for e in experts]
        if site.swapped:
            firsts = [f[::-1] for f in firsts]
        stacks = [insert_call(graph, at, torch.stack, ([f[i] for f in firsts],), meta_from=at)
                  for i in range(len(firsts[0]))]
        w1 = stacks[0] if len(stacks) == 1 else insert_call(graph, at, torch.cat, (stacks, 1), meta_from=at)
        w2 = insert_call(graph, at, torch.stack, ([list_expert_weight(e.down) for e in experts],), meta_from=at)
        fused = insert_call(graph, at, torch.ops.sloth.moe_experts.default,
                            (site.x, site.idx, site.w, w1, w2, site.act, None, None, False, 1.702, 7.0, None, None,
                             None, None, 1.0, 1.0, site.gated, *((True,) if options.moe_recompute else ())),
                            meta_from=at)
        if value_of(fused) is None:  # (the op did not run on the graph's fakes: patterns/moe.py)
            for node in (fused, w2, w1, *stacks):
                if not node.users and node.graph is graph:
                    graph.erase_node(node)
            report.reject(FAMILY, anchor, "the fused op could not be evaluated on this graph's fake values: "
                                          "the experts run as written")
            report.rejected_nodes.extend((FAMILY, g) for g in others)
            continue
        y = insert_call(graph, at, operator.getitem, (fused, 0), meta_from=at)
        if tensor_of(y).dtype != tensor_of(at).dtype:
            y = insert_call(graph, at, torch.Tensor.to, (y, tensor_of(at).dtype), meta_from=at)
        weights = {w for e in experts for w in e.weights()}
        erased = replace_and_erase(at, y, keep={site.x, site.idx, site.w, w1, w2, *stacks, *weights,
                                                *site.shape_only})
        _erase_dead(site.region, erased)
        kind = "gate, up and down" if len(stacks) == 2 else "gate_up and down" if site.gated else "ungated up and down"
        report.replaced(Site(FAMILY, "sloth.moe_experts", module_path(anchor), source_location(anchor),
                             f"{len(experts)} experts, top-{tensor_of(site.idx).shape[1]}, {site.act}, a list of "
                             f"expert modules ({kind} linears, stacked each step), "
                             f"{str(tensor_of(site.x).dtype).replace('torch.', '')}"))
        changed = True
    return changed

