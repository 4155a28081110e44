"""The bias-corrected routers of the ``moe_router`` family (DeepSeek-V3 and its kin): a top-k that only chooses
the experts, over scores plus a bias, the weights gathered from the unbiased scores, becomes one
``torch.ops.sloth.moe_router_biased`` (lowering/moe_router_biased.py has the function and its backward).

What is matched (the canonical graph, whatever module wrote it), from the anchor, a 2-D ``topk`` over the last
dim, largest first, whose indices alone are read:

    its input       c, or c with a group mask applied: ``masked_fill(c, m, -inf or 0.0)``
    c               s + bias or bias + s (bias [E] or [1, E], computed from nothing the logits feed), or s alone;
                    s through a detach or an fp32 cast counts as s; or l + bias (the logits chose, kolibri1)
    s               sigmoid(l) or softmax(l, -1), fp32 (an fp32 upcast of l taken off: the op upcasts)
    the weights     s.gather(-1, idx) (or ``sigmoid(l.gather(-1, idx))`` when the logits chose): one gather of
                    the indices from s; then, when the weights' only readers are their sum over the last dim
                    (keepdim) and a division by it, by it + eps or by clamp(it, min=eps) (in place too), that
                    renormalisation
    the group mask  m is computed from c alone; its group count G is the middle size of a 3-D view of c
                    ([T, G, E/G]) and its kept-group count the k of a top-k over [T, G] among those nodes. It is
                    not read by its structure: the nodes that compute m are run on random scores, and m must equal
                    "outside the best groups" (lowering's ``group_keep_reference``) with groups scored by their
                    top-2 sum or by their max, whichever agrees on every draw. So any way of writing the mask
                    (a scatter into zeros, a one-hot, a comparison of ranks) is taken if it computes that. One
                    group (GLM-4.5 to 4.7, Kimi-K2: n_group = topk_group = 1; a [T, 1, E] view) keeps every
                    expert: the mask is checked the same way and dropped.

What stays as written after the op: a routed scaling factor (in place too: DeepSeek-V3's ``weights *= route_scale``
then writes into the op's output) and casts of the weights, and anything else that reads s (an aux loss: s stays
for it, and its gradient adds to the op's in autograd). The indices' other readers (the experts) read the op's
indices.

Reported, left as written: bf16 or fp16 scores (the choice would round differently from the op's fp32), a bias
that depends on the logits, a gather from something other than the scores, a group mask that reads more than c
or does not compute the groups (the reason says which), more than 64 groups, the kernel's limits.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..compiler.canonicalize import cast
from ..compiler.fx_utils import arg_of, insert_call, is_function, is_last_dim, is_method, softmax_input, tensor_of

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DIVIDE = (torch.div, operator.truediv, operator.itruediv, torch.true_divide)
_ADD = (torch.add, operator.add)
_SIGMOID = (torch.sigmoid, torch.nn.functional.sigmoid, torch.special.expit)
_DRAWS = 3  # random scores the group mask is run on


def _lowering():
    from ..lowering import moe_router_biased

    return moe_router_biased


@dataclasses.dataclass
class BiasedMatch:
    topk: fx.Node
    logits: fx.Node
    bias: Optional[fx.Node]
    k: int
    score: str
    choose_logits: bool
    n_group: int
    topk_group: int
    group_top2: bool
    fill: float
    renorm: int
    eps: float
    weights: fx.Node     # the node whose value is the op's weights
    indices: fx.Node     # the topk's indices
    chain: list[fx.Node]  # the nodes the op replaces (erased once unread)

    def form(self) -> str:
        choice = ("logits" if self.choose_logits else self.score) + (" + bias" if self.bias is not None else "")
        groups = (f", best {self.topk_group} of {self.n_group} groups by "
                  + ("top-2 sum" if self.group_top2 else "max") if self.n_group > 1 else "")
        renorm = {0: "", 1: f", renormalised (+{self.eps:g})", 2: f", renormalised (clamp {self.eps:g})"}[self.renorm]
        return f"{self.score} scores, top-{self.k} of {choice}{groups}{renorm}"


def _strip(node: Any) -> Any:
    """``node`` with detaches and fp32 upcasts of a float tensor taken off."""
    while isinstance(node, fx.Node):
        if (is_function(node, torch.detach) or is_method(node, "detach")) and node.args:
            node = node.args[0]
        elif is_function(node, cast) and node.args[1] == torch.float32 and tensor_of(node.args[0]) is not None \
                and tensor_of(node.args[0]).dtype in _FLOAT_DTYPES:
            node = node.args[0]
        else:
            break
    return node


def _uncast(node: Any) -> Any:
    """``node`` with fp32 upcasts of a float tensor taken off (not detaches: the op's gradient would pass them)."""
    while is_function(node, cast) and node.args[1] == torch.float32 and tensor_of(node.args[0]) is not None \
            and tensor_of(node.args[0]).dtype in _FLOAT_DTYPES:
        node = node.args[0]
    return node


def _stripped(node: Any, strip=None) -> list[fx.Node]:
    """The nodes ``strip`` (``_strip`` by default) takes off ``node``."""
    strip = strip or _strip
    nodes = []
    while node is not strip(node):
        nodes.append(node)
        node = node.args[0]
    return nodes


def _scores(node: Any) -> Optional[tuple[str, fx.Node, fx.Node]]:
    """(score function, logits, the score node) when ``node`` is sigmoid(l) or softmax(l, -1), else None."""
    if (is_function(node, *_SIGMOID) or is_method(node, "sigmoid")) and len(node.args) == 1 and not node.kwargs:
        return "sigmoid", _uncast(node.args[0]), node
    logits = softmax_input(node)
    if logits is not None:
        return "softmax", _uncast(logits), node
    return None


_VIEWS = {"view", "reshape", "unflatten", "flatten", "unsqueeze", "squeeze", "expand", "expand_as", "transpose", "t",
          "permute", "narrow", "select", "as_strided", "detach", "view_as", "unbind", "split", "chunk", "movedim",
          "contiguous", "getitem", "diagonal", "swapaxes", "alias"}


def _name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _writes(node: Any) -> bool:
    """An in-place write into its first argument: a method or function named ``*_``, ``operator.setitem``, an
    in-place operator (``/=``), or an ``out=``."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    name = _name(node)
    return ((name.endswith("_") and not name.startswith("__")) or name == "setitem" or "out" in node.kwargs
            or node.target in (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                               operator.ipow, operator.iand, operator.ior, operator.ixor, operator.imod))


def _written(node: Any, allowed: set) -> Optional[fx.Node]:
    """A write not in ``allowed`` into ``node`` or a view of it (a view's view too), or None."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if _writes(user) and user.args and user.args[0] is n and user not in allowed:
                return user
            if _name(user) in _VIEWS and user.args and user.args[0] is n:
                stack.append(user)
    return None


def _same(a: Any, b: fx.Node) -> bool:
    """``a`` is ``b`` or the same call on the same arguments (``sigmoid(l)`` written twice)."""
    return a is b or (isinstance(a, fx.Node) and a.op == b.op and a.target == b.target and a.args == b.args
                      and a.kwargs == b.kwargs)


def _depends_on(node: Any, target: fx.Node) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        if n is target:
            return True
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _gathers(indices: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(gather node, its source) for each reader of ``indices`` that gathers along the last dim by them."""
    found = []
    for user in indices.users:
        if is_function(user, torch.gather) or is_method(user, "gather"):
            source, dim, index = arg_of(user, 0, "input"), arg_of(user, 1, "dim"), arg_of(user, 2, "index")
        else:
            continue
        if isinstance(source, fx.Node) and index is indices and is_last_dim(dim, 2) \
                and not set(user.kwargs) - {"input", "dim", "index"}:
            found.append((user, source))
    return found


def renormalisation(weights: fx.Node) -> Optional[tuple[fx.Node, list[fx.Node], int, float]]:
    """(the division, the nodes between, renorm mode, eps) when ``weights``' only readers are its sum over the
    last dim (keepdim) and a division of it by that sum, the sum + eps, or clamp(sum, min=eps); else None."""
    readers = list(weights.users)
    if len(readers) != 2:
        return None
    total = next((n for n in readers if is_function(n, torch.sum) or is_method(n, "sum")), None)
    divide = next((n for n in readers if is_function(n, *DIVIDE) or is_method(n, "div", "div_", "true_divide")), None)
    if total is None or divide is None or total.args[0] is not weights or len(divide.args) != 2 or divide.kwargs \
            or divide.args[0] is not weights:
        return None
    dims = arg_of(total, 1, "dim")
    dims = dims[0] if isinstance(dims, (tuple, list)) and len(dims) == 1 else dims
    if not is_last_dim(dims, 2) or not arg_of(total, 2, "keepdim", False) or set(total.kwargs) - {"dim", "keepdim"} \
            or len(total.args) > 3:
        return None
    lowering = _lowering()
    denominator = divide.args[1]
    if denominator is total:
        return divide, [total], lowering.RENORM_ADD, 0.0
    if len(total.users) != 1 or not isinstance(denominator, fx.Node) or denominator.kwargs.keys() - {"min"}:
        return None
    if is_function(denominator, *_ADD) and len(denominator.args) == 2 and not denominator.kwargs:
        eps = [a for a in denominator.args if a is not total]
        if total in denominator.args and len(eps) == 1 and isinstance(eps[0], (int, float)) and eps[0] >= 0:
            return divide, [total, denominator], lowering.RENORM_ADD, float(eps[0])
    if (is_function(denominator, torch.clamp, torch.clamp_min) or is_method(denominator, "clamp", "clamp_min")) \
            and denominator.args[0] is total:
        eps = arg_of(denominator, 1, "min")
        if isinstance(eps, (int, float)) and eps > 0 and len(denominator.args) <= 2:
            return divide, [total, denominator], lowering.RENORM_CLAMP, float(eps)
    return None


def _mask_nodes(mask: fx.Node, scores: fx.Node, reader: fx.Node) -> Union[list[fx.Node], str]:
    """The nodes that compute ``mask`` from ``scores``, in graph order: its ancestors, and the in-place writes into
    them (a ``scatter_`` into zeros), back to ``scores``; a reason when they read anything else, when anything but
    them and ``reader`` (the masked fill) reads them, or when a write comes after a read of what it writes."""
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    found, stack = set(), [mask]
    while stack:
        n = stack.pop()
        if n is scores or n in found:
            continue
        if n.op not in ("call_function", "call_method"):
            return f"the group mask reads {n.op} {n.name}, not only the scores"
        found.add(n)
        stack.extend(n.all_input_nodes)
        for user in n.users:  # a write into n (a scatter_ into zeros): run with the rest, in graph order
            if _writes(user) and user.args[0] is n:
                stack.append(user)
    nodes = sorted(found, key=order.__getitem__)
    for n in nodes:
        for user in n.users:
            if user not in found and user is not reader:
                return f"the group mask's {n.name} is read outside the mask"
            if _writes(user) and (n is mask or n is scores or any(order[r] < order[user] for r in n.users
                                                                   if r is not user and not _writes(r))):
                return f"{user.name} writes into {n.name} after it is read"
    return nodes


def _run(nodes: list[fx.Node], scores: fx.Node, value: torch.Tensor) -> dict:
    env = {scores: value}

    def load(a):
        return fx.node.map_arg(a, lambda n: env[n])

    for n in nodes:
        args, kwargs = load(n.args), load(n.kwargs)
        if n.op == "call_function":
            env[n] = n.target(*args, **kwargs)
        else:
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
    return env


def _groups(mask: fx.Node, scores: fx.Node, reader: fx.Node, experts: int) -> Union[tuple[int, int, bool], str]:
    """(groups, kept groups, scored by top-2 sum) that the mask computes, by running it (module docstring).
    Candidates: the group counts G of the 3-D [T, G, E/G] values among the mask's nodes; the kept counts the k of
    a top-k over [T, G] among them, else every count from 1 to G; both group scores."""
    nodes = _mask_nodes(mask, scores, reader)
    if isinstance(nodes, str):
        return nodes
    lowering = _lowering()
    shapes = [tensor_of(n) for n in nodes]
    groups = sorted({t.shape[-2] for t in shapes if t is not None and t.dim() == 3 and isinstance(t.shape[-2], int)
                     and isinstance(t.shape[-1], int) and t.shape[-2] * t.shape[-1] == experts
                     and 1 <= t.shape[-2] <= lowering.MAX_GROUPS})
    if not groups:
        return (f"the group mask has no [tokens, groups, experts / groups] view of the scores (at most "
                f"{lowering.MAX_GROUPS} groups)")
    candidates = []
    for n_group in groups:
        kept = {arg_of(n, 1, "k") for n in nodes if (is_function(n, torch.topk) or is_method(n, "topk"))
                and tensor_of(n.args[0]) is not None and tensor_of(n.args[0]).dim() == 2
                and tensor_of(n.args[0]).shape[-1] == n_group}
        kept = {k for k in kept if isinstance(k, int) and 1 <= k <= n_group} or set(range(1, n_group + 1))
        candidates += [(n_group, k, top2) for k in sorted(kept) for top2 in (True, False)
                       if not top2 or experts // n_group >= 2]
    real = tensor_of(scores).shape[0]
    g = torch.Generator().manual_seed(0)
    for tokens in dict.fromkeys([64] + ([real] if isinstance(real, int) and 0 < real <= 16384 else [])):
        try:
            for _ in range(_DRAWS):
                value = torch.randn(tokens, experts, generator=g)
                got = _run(nodes, scores, value)[mask]
                if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or got.shape != value.shape:
                    return "the group mask is not a [tokens, experts] bool tensor"
                candidates = [c for c in candidates if torch.equal(got, ~lowering.group_keep_reference(value, *c))]
            break
        except Exception as e:  # e.g. a view of the traced token count: run again at that count
            error = f"the group mask could not be run on sample scores ({type(e).__name__}: {e})"
    else:
        return error
    if not candidates:
        return "the group mask is not 'outside the best groups' (by top-2 sum or max) on sample scores"
    return candidates[0]


def match_biased(topk: fx.Node, indices: fx.Node) -> Union[BiasedMatch, str, None]:
    """The bias-corrected router around ``topk`` (2-D, last dim, largest, constant k, only ``indices`` read);
    None when no score, gather or bias around it makes one (the caller reports the top-k as before)."""
    k = arg_of(topk, 1, "k")
    chosen = topk.args[0]
    experts = tensor_of(chosen).shape[1]
    lowering = _lowering()
    chain: list[fx.Node] = [topk]
    fill, masked = float("-inf"), None
    if (is_function(chosen, torch.masked_fill) or is_method(chosen, "masked_fill")) and len(chosen.args) == 3 \
            and not chosen.kwargs:
        choice, masked, fill = chosen.args
        if not isinstance(fill, (int, float)) or float(fill) not in (float("-inf"), 0.0):
            return None
        fill = float(fill)
        chain.append(chosen)
    else:
        choice = chosen
    if not isinstance(choice, fx.Node):
        return None
    # c = score side + bias, or the score side alone
    bias, side = None, choice
    gathers = _gathers(indices)

    def score_side(a: Any) -> bool:  # the scores, or logits the indices gather from
        return isinstance(a, fx.Node) and (_scores(_strip(a)) is not None
                                           or any(_strip(source) is _strip(a) for _, source in gathers))

    if is_function(choice, *_ADD) and len(choice.args) == 2 and not choice.kwargs:
        for a, b in (choice.args, choice.args[::-1]):
            if score_side(a):
                bias_value = tensor_of(b)
                if isinstance(b, fx.Node) and bias_value is not None and bias_value.is_floating_point() \
                        and tuple(bias_value.shape) in ((experts,), (1, experts)):
                    bias, side = b, a
                    break
        if bias is None:
            return None
        chain.append(choice)
    found = _scores(_strip(side))
    if found is not None:
        score, logits, scores_node = found
        take = [g for g, source in gathers if _same(source, scores_node)]
        if len(take) != 1:
            return None if not take else "the indices gather the scores more than once"
        weights = take[0]
        choose_logits = False
        chain += [weights, scores_node, arg_of(weights, 0, "input")] + _stripped(scores_node.args[0], _uncast)
    else:  # the logits chose: c = l + bias (l detached there or not); the weights sigmoid(l.gather(-1, idx))
        logits = _strip(side)
        take = [(g, source) for g, source in gathers if _uncast(source) is logits and len(g.users) == 1
                and (is_function(next(iter(g.users)), *_SIGMOID) or is_method(next(iter(g.users)), "sigmoid"))]
        if bias is None or len(take) != 1:
            return None
        gather, source = take[0]
        weights = next(iter(gather.users))
        score, choose_logits = "sigmoid", True
        chain += [gather, weights] + _stripped(source, _uncast)
    chain += _stripped(side)
    if bias is not None and _depends_on(bias, logits):
        return "the bias is computed from the router's logits"
    scores_value, logits_value = tensor_of(weights), tensor_of(logits)
    if logits_value is None or logits_value.dim() != 2 or logits_value.dtype not in _FLOAT_DTYPES:
        return "the logits are not a float32/bf16/fp16 [tokens, experts] tensor"
    if scores_value is None or scores_value.dtype != torch.float32 or tensor_of(choice).dtype != torch.float32:
        return "the scores are not float32 (the op chooses in fp32; a bf16 choice rounds differently)"
    if experts > lowering.MAX_EXPERTS or k > lowering.MAX_TOP_K or not 1 <= k <= experts:
        return (f"top-{k} of {experts} experts is outside the kernel's limits (k <= {lowering.MAX_TOP_K}, "
                f"experts <= {lowering.MAX_EXPERTS})")
    n_group, topk_group, group_top2 = 1, 1, True
    if masked is not None:
        groups = _groups(masked, choice, chosen, experts)
        if isinstance(groups, str):
            return groups
        n_group, topk_group, group_top2 = groups
        nodes = _mask_nodes(masked, choice, chosen)
        chain += nodes
        if topk_group == n_group:  # every group kept: no mask
            n_group, topk_group = 1, 1
    renorm, eps = lowering.RENORM_NONE, 0.0
    found_renorm = renormalisation(weights)
    allowed = {n for n in chain if _writes(n)}  # the mask's own writes, checked by _mask_nodes
    if found_renorm is not None:
        divide, between, renorm, eps = found_renorm
        chain += between + [divide]
        allowed.add(divide)
        weights = divide
    # A write into the weights themselves (DeepSeek-V3's ``weights *= route_scale``) comes after the op's work and
    # writes into the op's output once it reads that: not a write the op misses.
    for node in [logits, bias, *(n for n in chain if n is not weights)]:
        write = _written(node, allowed)
        if write is not None:
            return f"{write.name} writes in place into the router's {node.name} (or a view of it)"
    return BiasedMatch(topk, logits, bias, k, score, choose_logits, n_group, topk_group, group_top2, fill, renorm,
                       eps, weights, indices, chain)


def insert_router(graph: fx.Graph, topk: fx.Node, op: Any, args: tuple, logits: fx.Node, k: int,
                  weights: fx.Node, indices: fx.Node, chain: list[fx.Node]) -> set[fx.Node]:
    """Insert ``op(*args) -> (w [T, k], idx [T, k] int64)`` at ``topk``, read its weights where ``weights`` was
    read and its indices where ``indices`` was, and erase the nodes of ``chain`` left unread (readers first; the
    scores stay for another reader, an aux loss). Returns the erased nodes. Both router patterns end so."""
    w_value, l_value = tensor_of(weights), tensor_of(logits)
    value = (l_value.new_empty((l_value.shape[0], k), dtype=w_value.dtype,
                               requires_grad=bool(w_value.requires_grad)),
             l_value.new_empty((l_value.shape[0], k), dtype=torch.int64))
    pair = insert_call(graph, topk, op, args, meta_from=topk, value=value)
    new_weights = insert_call(graph, topk, operator.getitem, (pair, 0), meta_from=topk, value=value[0])
    new_indices = insert_call(graph, topk, operator.getitem, (pair, 1), meta_from=topk, value=value[1])
    weights.replace_all_uses_with(new_weights)
    indices.replace_all_uses_with(new_indices)
    graph.erase_node(indices)
    erased = {indices}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(chain), key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
            erased.add(node)
    return erased


def replace_biased(graph: fx.Graph, m: BiasedMatch) -> set[fx.Node]:
    """``m``'s router as ``sloth.moe_router_biased``; returns the erased nodes."""
    _lowering().register()
    bias = m.bias
    if bias is not None and tensor_of(bias).dim() == 2:
        experts = tensor_of(bias).shape[1]
        bias = insert_call(graph, m.topk, torch.reshape, (bias, (experts,)), meta_from=m.topk,
                           value=tensor_of(bias).reshape(experts))
    args = (m.logits, bias, m.k, m.score, m.choose_logits, m.n_group, m.topk_group, m.group_top2, m.fill, m.renorm,
            m.eps, tensor_of(m.weights).dtype)
    return insert_router(graph, m.topk, torch.ops.sloth.moe_router_biased.default, args, m.logits, m.k, m.weights,
                         m.indices, m.chain)
