"""MoE router family (``"moe_router"`` in the report): the top-k that routes tokens to experts, with the scoring
around it, becomes one ``torch.ops.sloth.moe_router`` (lowering/moe_router.py: one kernel forward, one backward).

The meaning (``moe_router_reference`` in lowering/moe_router.py), on router logits ``l`` [T, E]::

    w, idx = topk(softmax(l, -1), k, -1)                       softmax_first, not renorm  (Qwen3-MoE, OLMoE)
    w, idx = topk(softmax(l, -1), k, -1);  w = w / w.sum(-1)   softmax_first, renorm      (Mixtral, Qwen3 norm_topk)
    top, idx = topk(l, k, -1);  w = softmax(top, -1)           not softmax_first          (GPT-OSS)

What is matched (the canonical graph, whatever module wrote it): the anchor is a ``topk`` over the last dim of a
2-D float tensor, largest first. Its input a softmax over the last dim (function or method, any dtype argument)
of ``l``, an fp32 upcast of ``l`` taken off (the op computes in fp32), gives the first two forms, renormalised when
the values' only readers are ``sum(w, -1, keepdim=True)`` and a division of w by it (in place too, transformers'
``w /= w.sum(...)``); otherwise the values the topk returned are the op's, and what reads them reads the op's.
Its values read only by a softmax over the last dim gives the third form. The softmax over all experts may have
other readers (an aux loss reading the router's probabilities): it stays for them, and its gradient adds to the
op's in autograd, as it would have.

The weights come out in the dtype the graph had them in. Between equal scores the op picks the lower expert
index, where ``torch.topk`` leaves the choice to its implementation.

A top-k whose indices alone are read is a bias-corrected router (DeepSeek-V3, GLM-4.5 and their kin: scores plus
a bias choose, within the best groups or not, and the weights are gathered from the scores) when
patterns/moe_router_biased.py matches it: it becomes ``sloth.moe_router_biased``. Those are matched first, the
last top-k first, so that a grouped router's top-ks over its groups go with it.

Reported, left as written: scores that are not a softmax of the logits and are not softmaxed after the topk
(the top-k values of sigmoid scores, Llama 4's sigmoid of the top-1 logit), the smallest-k, another dim, a k over the kernel's limit, more experts than one pass holds,
the top-k logits read by anything but the softmax, only one of values and indices read, float64, a write in place
into the logits or the scores (the op would not see it; its backward reads the logits). A write into the weights
themselves (``w *= scale``, after the renormalisation) is no such write: it writes into the op's output.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Sequence, Union

import torch
import torch.fx as fx

from ..compiler.canonicalize import cast
from ..compiler.fx_utils import (arg_of, is_function, is_last_dim, is_method, module_path, softmax_input,
                                 source_location, tensor_of)
from ..compiler.options import PassOptions
from ..compiler.families import Family
from ..compiler.report import Report, Site
from .moe_router_biased import BiasedMatch, _written, insert_router, match_biased, renormalisation, replace_biased

FAMILY = "moe_router"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _lowering():
    from ..lowering import moe_router

    return moe_router


def _uncast(x: fx.Node) -> fx.Node:
    """``x`` with an fp32 upcast of a float tensor taken off (the op computes in fp32)."""
    if is_function(x, cast) and x.args[1] == torch.float32:
        source = tensor_of(x.args[0])
        if source is not None and source.dtype in _DTYPES:
            return x.args[0]
    return x


@dataclasses.dataclass
class _Match:
    topk: fx.Node
    logits: fx.Node       # the op's input
    k: int
    softmax_first: bool
    renorm: bool
    weights: fx.Node      # the node whose value is the op's weights
    indices: fx.Node      # topk's indices
    chain: list[fx.Node]  # the nodes the op replaces (erased once unread)


def _items(topk: fx.Node) -> tuple[list[fx.Node], list[fx.Node], bool]:
    """(readers of the values, readers of the indices, whether anything else reads the topk's result)."""
    values, indices, other = [], [], False
    for user in topk.users:
        if is_function(user, operator.getitem) and user.args[1] == 0:
            values.append(user)
        elif is_function(user, operator.getitem) and user.args[1] == 1:
            indices.append(user)
        elif is_method(user, "values") or is_method(user, "indices"):
            (values if user.target == "values" else indices).append(user)
        else:
            other = True
    return values, indices, other


def _match(topk: fx.Node) -> Union[_Match, BiasedMatch, str]:
    scores = topk.args[0]
    value = tensor_of(scores)
    k = arg_of(topk, 1, "k")
    if value.dim() != 2:
        return f"the scores are {value.dim()}-D, not [tokens, experts]"
    if not is_last_dim(arg_of(topk, 2, "dim", -1), 2):
        return "the top-k is not over the last dim (the experts)"
    if not arg_of(topk, 3, "largest", True):
        return "the smallest k, not the largest"
    if not isinstance(k, int):
        return "k is not a constant"
    experts = value.shape[1]
    lowering = _lowering()
    if not isinstance(experts, int):
        return "the number of experts is symbolic"
    if experts > lowering.MAX_EXPERTS or k > lowering.MAX_TOP_K or not 1 <= k <= experts:
        return (f"top-{k} of {experts} experts is outside the kernel's limits "
                f"(k <= {lowering.MAX_TOP_K}, experts <= {lowering.MAX_EXPERTS})")
    values, indices, other = _items(topk)
    if other or len(values) > 1 or len(indices) > 1:
        return "the top-k's result is read other than as one values and one indices"
    if indices and not values:
        found = match_biased(topk, indices[0])
        return "only the indices of the top-k are read" if found is None else found
    if not indices:
        return "only the values of the top-k are read"
    values, indices = values[0], indices[0]
    logits = softmax_input(scores)
    if logits is not None:
        chain = [topk, values]
        if _uncast(logits) is not logits:  # the upcast the op does itself
            chain.insert(0, logits)
            logits = _uncast(logits)
        found = renormalisation(values)
        if found is not None and len(found[1]) == 1:  # w / sum(w); an eps or a clamp is not this op's function
            weights, total = found[0], found[1][0]
            chain += [total, weights]
        else:
            found, weights = None, values
        softmax_first, renorm = True, found is not None
        chain.append(scores)
    else:
        after = list(values.users)
        if len(after) != 1 or softmax_input(after[0]) is not values:
            if any(is_function(n, torch.sigmoid) or is_method(n, "sigmoid") for n in (scores, *after)):
                return ("sigmoid scores read as the top-k's values: not fused yet (sigmoid routers that gather "
                        "their weights by the indices are)")
            return ("the scores are not a softmax of the logits, and the top-k values are not softmaxed after it "
                    "(read elsewhere or another function)")
        logits, weights, chain = _uncast(scores), after[0], [topk, values, after[0]]
        if logits is not scores:
            chain.insert(0, scores)
        softmax_first, renorm = False, False
    logits_value, weights_value = tensor_of(logits), tensor_of(weights)
    if logits_value is None or logits_value.dtype not in _DTYPES or weights_value is None \
            or weights_value.dtype not in _DTYPES:
        return "dtypes other than fp32, bf16 and fp16"
    if tuple(weights_value.shape) != (value.shape[0], k):
        return f"the weights' shape {tuple(weights_value.shape)} is not [tokens, k]"
    # a write the op would not see (into the scores before the top-k, or the logits, which its backward reads); one
    # into the weights themselves (``w *= scale``) writes into the op's output once it reads that, as eager's
    allowed = {weights}  # (the renormalisation's division, in place or not)
    for node in [logits, *(n for n in chain if n is not weights)]:
        write = _written(node, allowed)
        if write is not None:
            return f"{write.name} writes in place into the router's {node.name} (or a view of it)"
    return _Match(topk, logits, k, softmax_first, renorm, weights, indices, chain)


def _replace(graph: fx.Graph, m: _Match) -> None:
    insert_router(graph, m.topk, torch.ops.sloth.moe_router.default,
                  (m.logits, m.k, m.softmax_first, m.renorm, tensor_of(m.weights).dtype), m.logits, m.k, m.weights,
                  m.indices, m.chain)


def fuse_moe_router_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                         options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace every router top-k of a supported form with ``torch.ops.sloth.moe_router`` (module docstring).

    before:  p = softmax(l, -1, float32);  v, idx = topk(p, 8, -1);  w = v / v.sum(-1, keepdim=True)
    after:   w, idx = sloth.moe_router(l, 8, True, True, float32)
    """
    _lowering().register()
    # The bias-corrected routers first, last top-k first: a grouped router's own top-ks over its groups go with
    # it, and are not reported as routers of their own.
    erased: set[fx.Node] = set()
    for node in reversed(list(gm.graph.nodes)):
        if is_topk(node) and node not in erased:
            found = _match(node)
            if isinstance(found, BiasedMatch):
                site = Site(FAMILY, "sloth.moe_router_biased", module_path(node), source_location(node),
                            f"{found.form()}, {tensor_of(found.logits).shape[1]} experts, "
                            f"{tensor_of(found.logits).dtype}".replace("torch.", ""))
                erased |= replace_biased(gm.graph, found)
                report.replaced(site)
    for node in list(gm.graph.nodes):
        if not is_topk(node):
            continue
        found = _match(node)
        if isinstance(found, BiasedMatch):  # the first loop took every one
            continue
        if isinstance(found, str):
            report.reject(FAMILY, node, found)
            continue
        form = ("softmax, top-" + str(found.k) + (", renormalised" if found.renorm else "") if found.softmax_first
                else f"top-{found.k}, softmax over the k")
        detail = f"{form}, {tensor_of(found.logits).shape[1]} experts, {tensor_of(found.logits).dtype}".replace(
            "torch.", "")
        site = Site(FAMILY, "sloth.moe_router", module_path(node), source_location(node), detail)
        _replace(gm.graph, found)
        report.replaced(site)
    gm.graph.lint()
    gm.recompile()
    return gm


# The family's anchor (compiler/anchors.py): where its sites are, more broadly than its matchers take them.
def is_topk(node: fx.Node) -> bool:
    """A ``topk`` of a float tensor of 2 or more dims: the ``moe_router`` family's anchor."""
    if not ((node.op == "call_function" and node.target is torch.topk)
            or (node.op == "call_method" and node.target == "topk")) or not node.args:
        return False
    value = tensor_of(node.args[0])
    return value is not None and value.is_floating_point() and value.dim() >= 2


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_moe_router_pass, order=60, anchor=is_topk,
                     emits=("moe_router", "moe_router_biased"),
                     summary=("the router's top-k with its softmax and renormalisation, and bias-corrected grouped "
                              "routers"))
