"""Where the ``moe_route`` family's sites are: a matmul-like call reading stacked ``[E, ., .]`` expert weights
(patterns/moe.py, moe_adapters.py, moe_split.py), or a GEMM of one module of a list of experts whose result a router
weight scales (patterns/moe_expert_list.py). The predicates are the family's anchor (deliberately broader than any
matcher: compiler/anchors.py) and the matchers' first test.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.fx as fx

from ..compiler.fx_utils import linear_parts, op_name, tensor_of
from .moe_router import is_topk


# MoE experts: a matmul-like call reading stacked [E, ., .] expert weights (patterns/moe.py).
_GROUPED_GEMMS = {"_grouped_mm", "grouped_mm", "grouped_mm_fallback"}


_GEMM_NAMES = _GROUPED_GEMMS | {"bmm", "matmul", "linear", "mm", "einsum"}


_VIEWS = {"transpose", "permute", "t", "view", "reshape", "contiguous", "to", "getitem", "cast", "expand",
          "unsqueeze", "squeeze", "index_select"}


def expert_weight(node: Any, indexed: bool = False, depth: int = 6) -> Optional[fx.Node]:
    """The 3-D float graph input ``node`` is a view of (with ``indexed``: an indexing of, ``W[e]`` or ``W[ids]``,
    then views), or None. A sum or product on the way (``W + scale * B @ A``, ``baddbmm(W, B, A)``: peft's LoRA on
    the expert weights, ``target_parameters``) is followed to its operand that leads to such an input."""
    if depth < 0 or not isinstance(node, fx.Node):
        return None
    value = tensor_of(node)
    if node.op == "placeholder":
        return node if value is not None and value.dim() == 3 and value.is_floating_point() and not indexed else None
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    name = op_name(node)
    if name in ("add", "sub", "mul", "baddbmm"):  # baddbmm(W, B, A): W + B @ A, peft's merged expert weight
        return next((w for w in (expert_weight(a, indexed, depth - 1) for a in node.args) if w is not None), None)
    if name not in _VIEWS:
        return None
    return expert_weight(node.args[0], indexed and name not in ("getitem", "index_select"), depth - 1)


def expert_weight_arg(node: fx.Node) -> tuple[Optional[Any], Optional[fx.Node]]:
    """(the argument of a matmul-like ``node`` that carries a stacked expert weight, that weight's graph input), or
    (None, None): the weight operand of a grouped GEMM (``grouped_mm(x, W, offs)``), or an indexed one (``W[e]``,
    ``W[ids]``) of ``bmm`` / ``matmul`` / ``linear`` / ``einsum`` (a 3-D activation such as the hidden states
    [B, S, H] is no expert weight)."""
    if node.op not in ("call_function", "call_method") or op_name(node) not in _GEMM_NAMES:
        return None, None
    if op_name(node) in _GROUPED_GEMMS:
        if len(node.args) < 2:
            return None, None
        weight = expert_weight(node.args[1])
        return (node.args[1], weight) if weight is not None else (None, None)
    for arg in node.args:
        if isinstance(arg, fx.Node) and (weight := expert_weight(arg, indexed=True)) is not None:
            return arg, weight
    return None, None


def expert_operand(node: fx.Node) -> Optional[fx.Node]:
    """The stacked expert weight (a graph input) a matmul-like ``node`` reads, or None (``expert_weight_arg``)."""
    return expert_weight_arg(node)[1]


def is_expert_gemm(node: fx.Node) -> bool:
    """A matmul-like call reading stacked expert weights: one of the ``moe_route`` family's anchors."""
    return expert_operand(node) is not None


# What a router weight passes through from the top-k to the product it scales (indexing, views, casts, the
# softmax, a scatter into [T, E], a renormalisation): no GEMM, no norm, no residual add.
_ROUTING = {"getitem", "narrow", "select", "unsqueeze", "squeeze", "view", "reshape", "flatten", "to", "cast",
            "type_as", "contiguous", "expand", "softmax", "scatter", "scatter_", "gather", "index_select", "div",
            "mul", "sum", "where", "eq", "float"}


def is_router_weight(node: Any, depth: int = 6) -> bool:
    """A float per-token factor (last dim 1) computed from a ``topk`` within ``depth`` routing steps: a router's
    weight of one expert (``weights[:, e:e+1]`` of a scattered [T, E], ``w[rows, k, None]``)."""
    value = tensor_of(node)
    if value is None or not value.is_floating_point() or not value.dim() or value.shape[-1] != 1:
        return False
    frontier, seen = [node], {node}
    for _ in range(depth):
        if any(is_topk(n) for n in frontier):
            return True
        frontier = [i for n in frontier if n.op in ("call_function", "call_method") and op_name(n) in _ROUTING
                    for i in n.all_input_nodes if i not in seen]
        seen.update(frontier)
    return any(is_topk(n) for n in frontier)


def list_expert_weight(node: fx.Node) -> Optional[fx.Node]:
    """The 2-D float graph input (through casts) a ``linear`` / ``x @ W.t()`` ``node`` multiplies by, or None."""
    parts = linear_parts(node)
    weight = parts[1] if parts is not None else None
    while isinstance(weight, fx.Node) and weight.op != "placeholder" and op_name(weight) in ("to", "cast") \
            and weight.args:
        weight = weight.args[0]
    value = tensor_of(weight)
    if not isinstance(weight, fx.Node) or weight.op != "placeholder" or value is None or value.dim() != 2 \
            or not value.is_floating_point():
        return None
    return weight


def is_expert_list_gemm(node: fx.Node, depth: int = 5) -> bool:
    """A GEMM of one expert of a list of expert modules (nn.ModuleList of MLPs, patterns/moe_expert_list.py): a
    linear on a 2-D weight graph input whose result, within ``depth`` nodes (its MLP's rest), is multiplied by a
    router weight (``is_router_weight``) not computed from it."""
    if list_expert_weight(node) is None:
        return False
    frontier, walked = [node], {node}
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u not in walked and not is_topk(u)]
        walked.update(frontier)
        for user in frontier:
            if user.op in ("call_function", "call_method") and op_name(user) == "mul" and any(
                    isinstance(a, fx.Node) and a not in walked and is_router_weight(a) for a in user.args):
                return True
    return False


def anchor(node: fx.Node) -> bool:
    """The ``moe_route`` family's anchor: a matmul-like call (grouped_mm, bmm, matmul, linear) reading a 3-D float
    graph input (stacked expert weights) through views or indexing; or a linear on a 2-D float graph input whose
    result (within its MLP) a router weight scales: a per-token factor computed from a topk by indexing, softmax or
    scatter (a list of expert modules)"""
    return is_expert_gemm(node) or is_expert_list_gemm(node)
