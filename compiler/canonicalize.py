"""Canonicalisation: one spelling per operation, so each pattern family needs few patterns.

Dynamo's graph keeps the user's spelling: ``x.pow(2)``, ``x ** 2``, ``torch.pow(x, 2)`` and ``x * x`` are
four different nodes for one value. This pass rewrites them into one form, in place, without changing
any value the graph computes:

    before                                          after
    call_method pow(x, 2) / operator.pow(x, 2)      torch.square(x)
    operator.mul(x, x)                              torch.square(x)
    call_method mean(x, -1, keepdim=True)           torch.mean(x, (-1,), True)     (dims negative)
    torch.sum(x, -1, True) / D                      torch.mean(x, (-1,), True)     (D the reduced size)
    1 / torch.sqrt(v), torch.pow(v, -0.5)           torch.rsqrt(v)
    x / torch.sqrt(v)                               torch.mul(x, torch.rsqrt(v))
    operator.mul / call_method mul / torch.mul      torch.mul                      (add, sub, div alike)
    x.float(), .to(torch.float32), .type_as(y)      cast(x, torch.float32)         (dtype from the graph)
    a cast, view, reshape or .contiguous() that     removed
    changes nothing
    F.rms_norm(x, s, weight=w, eps=e)               torch.rms_norm(x, s, w, e)

Canonical nodes carry no keyword arguments; a node that keeps one (``torch.add(a, b, alpha=2)``, a
reduction with ``dtype=``) is left in its own spelling and no pattern reads it. Values are unchanged
except for one rounding: a floating ``sum / N`` rounds twice where ``mean`` rounds once.
Dtypes and shapes come from the fake values Dynamo recorded on each node, never from module classes.
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch._prims_common as prims_common

from .fx_utils import insert_call, is_call, is_number, same_shape, tensor_of
from .report import Report

_is_contiguous = getattr(prims_common, "is_contiguous_or_false", lambda t: t.is_contiguous())


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The one canonical dtype conversion (``x.to(dtype)``); every cast spelling becomes this."""
    return x.to(dtype)


_BINARY = {
    operator.mul: torch.mul, "mul": torch.mul, torch.mul: torch.mul,
    operator.add: torch.add, "add": torch.add, torch.add: torch.add,
    operator.sub: torch.sub, "sub": torch.sub, torch.sub: torch.sub,
    operator.truediv: torch.div, "div": torch.div, "true_divide": torch.div, torch.div: torch.div,
    torch.true_divide: torch.div,
    operator.pow: torch.pow, "pow": torch.pow, torch.pow: torch.pow,
}
_UNARY_METHODS = ("rsqrt", "sqrt", "reciprocal", "square", "neg", "exp", "tanh", "sigmoid", "abs")
_UNARY = {**{name: getattr(torch, name) for name in _UNARY_METHODS},
          **{getattr(torch, name): getattr(torch, name) for name in _UNARY_METHODS},
          operator.neg: torch.neg}
_REDUCTIONS = {"mean": torch.mean, torch.mean: torch.mean, "sum": torch.sum, torch.sum: torch.sum}
_CAST_METHODS = ("to", "float", "half", "bfloat16", "double", "type_as", "type")
_VIEW_METHODS = ("view", "reshape", "flatten")
_VIEW_FUNCTIONS = (torch.reshape, torch.flatten)
_PURE = tuple({*_BINARY.values(), *_UNARY.values(), torch.mean, torch.sum, cast})


def _key(node: fx.Node) -> Any:
    return node.target if node.op in ("call_function", "call_method") else None


def _rewrite(node: fx.Node, target: Any, args: tuple) -> None:
    """Turn ``node`` into ``target(*args)`` in place; its value is unchanged, so its meta stays."""
    node.op, node.target, node.args, node.kwargs = "call_function", target, args, {}


def _spelling(node: fx.Node) -> bool:
    """Method, operator and keyword spellings -> canonical ``torch.*`` calls. True if rewritten."""
    key = _key(node)
    out = tensor_of(node)
    if key is None or out is None:  # only tensor-valued ops; shape arithmetic on SymInts stays
        return False
    args, kwargs = node.args, node.kwargs
    if key in _BINARY and len(args) == 2 and not kwargs:
        if node.target is not _BINARY[key] or node.op != "call_function":
            _rewrite(node, _BINARY[key], tuple(args))
            return True
        return False
    if key in _UNARY and len(args) == 1 and not kwargs:
        if node.target is not _UNARY[key] or node.op != "call_function":
            _rewrite(node, _UNARY[key], tuple(args))
            return True
        return False
    if key in _REDUCTIONS:
        return _reduction(node, _REDUCTIONS[key])
    if node.op == "call_method" and key in _CAST_METHODS:
        return _cast(node)
    if key in (torch.rms_norm,) and node.op == "call_function":
        names = ("input", "normalized_shape", "weight", "eps")
        full = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
        if set(kwargs) - set(names[len(args):]) or len(full) != len(args) + len(kwargs):
            return False
        full += [None] * (4 - len(full))
        if (node.args, node.kwargs) != (tuple(full), {}):
            _rewrite(node, torch.rms_norm, tuple(full))
            return True
    return False


def _reduction(node: fx.Node, fn: Any) -> bool:
    """``mean``/``sum`` with a dim -> ``fn(x, negative_dims_tuple, keepdim)``; no dtype argument."""
    x = node.args[0]
    xt = tensor_of(x)
    params = dict(zip(("dim", "keepdim"), node.args[1:]))
    if len(node.args) > 3 or set(node.kwargs) - {"dim", "keepdim"} or xt is None:
        return False
    params.update(node.kwargs)
    dim = params.get("dim")
    if dim is None:
        return False
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not all(isinstance(d, int) for d in dims):
        return False
    dims = tuple(d - xt.dim() if d >= 0 else d for d in dims)
    new_args = (x, dims, bool(params.get("keepdim", False)))
    if (node.op, node.target, node.args, dict(node.kwargs)) == ("call_function", fn, new_args, {}):
        return False
    _rewrite(node, fn, new_args)
    return True


def _cast(node: fx.Node) -> bool:
    """Every dtype-only conversion -> ``cast(x, dtype)``, or nothing when the dtype is unchanged."""
    x = node.args[0]
    xt, out = tensor_of(x), tensor_of(node)
    if xt is None or out is None or xt.device != out.device:
        return False
    if node.target == "to" and set(node.kwargs) - {"dtype", "non_blocking"}:
        return False  # copy=True, memory_format=...: more than a dtype change
    if node.target == "type" and (len(node.args) != 2 or node.kwargs):
        return False  # x.type() with no dtype returns a string
    if out.dtype == xt.dtype:
        node.replace_all_uses_with(x)
        node.graph.erase_node(node)
        return True
    _rewrite(node, cast, (x, out.dtype))
    return True


def _no_op_removed(node: fx.Node) -> bool:
    """Drop views and ``.contiguous()`` that return their input's shape and layout unchanged."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    x = node.args[0]
    xt, out = tensor_of(x), tensor_of(node)
    if xt is None or out is None:
        return False
    if node.op == "call_method" and node.target == "contiguous":
        ok = not node.kwargs and _is_contiguous(xt)
    elif (node.op == "call_method" and node.target in _VIEW_METHODS) or is_call(node, *_VIEW_FUNCTIONS):
        ok = same_shape(xt, out) and xt.dtype == out.dtype  # x.view(torch.int32) reinterprets
    else:
        return False
    if ok:
        node.replace_all_uses_with(x)
        node.graph.erase_node(node)
    return ok


def _erase_if_dead(node: Any) -> None:
    if isinstance(node, fx.Node) and not node.users and is_call(node, *_PURE):
        node.graph.erase_node(node)


def _same_dtype(x: Any, node: fx.Node) -> bool:
    """True when ``node`` keeps its input's dtype (``int ** 2.0`` is float; ``square(int)`` is int)."""
    xt, out = tensor_of(x), tensor_of(node)
    return xt is not None and out is not None and xt.dtype == out.dtype


def _algebra(node: fx.Node) -> bool:
    """Equal-value rewrites between canonical ops (square, rsqrt, mean). True if rewritten."""
    a = node.args
    if is_call(node, torch.pow) and is_number(a[1]) and _same_dtype(a[0], node):
        new = {2: torch.square, 0.5: torch.sqrt, -0.5: torch.rsqrt}.get(a[1])
        if new is not None:
            _rewrite(node, new, (a[0],))
            return True
    if is_call(node, torch.mul) and isinstance(a[0], fx.Node) and a[0] is a[1]:
        _rewrite(node, torch.square, (a[0],))
        return True
    if is_call(node, torch.reciprocal) and is_call(a[0], torch.sqrt):
        sqrt = a[0]
        _rewrite(node, torch.rsqrt, (sqrt.args[0],))
        _erase_if_dead(sqrt)
        return True
    if is_call(node, torch.div) and is_number(a[0]) and a[0] == 1 and isinstance(a[1], fx.Node):
        _rewrite(node, torch.reciprocal, (a[1],))
        return True
    if is_call(node, torch.div) and isinstance(a[0], fx.Node) and is_call(a[1], torch.sqrt):
        sqrt = a[1]
        rsqrt = insert_call(node.graph, node, torch.rsqrt, (sqrt.args[0],), meta_from=sqrt)
        _rewrite(node, torch.mul, (a[0], rsqrt))
        _erase_if_dead(sqrt)
        return True
    if is_call(node, torch.div, torch.mul) and is_number(a[1]) and is_call(a[0], torch.sum):
        return _sum_to_mean(node)
    return False


def _sum_to_mean(node: fx.Node) -> bool:
    """``sum(x, dims, k) / N`` or ``* (1/N)`` with N the number of reduced elements -> ``mean``."""
    total = node.args[0]
    if len(total.args) != 3 or not isinstance(total.args[1], tuple):
        return False  # a full sum, or one with dtype=: not the canonical sum over dims
    x, dims, keepdim = total.args
    xt = tensor_of(x)
    if xt is None or not xt.is_floating_point() or len(total.users) != 1:
        return False
    count = 1
    for d in dims:
        size = xt.shape[d]
        if not isinstance(size, int):
            return False
        count *= size
    factor = node.args[1]
    if (node.target is torch.div and factor == count) or (node.target is torch.mul and factor == 1.0 / count):
        _rewrite(node, torch.mean, (x, dims, keepdim))
        node.graph.erase_node(total)
        return True
    return False


def canonicalize_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report) -> fx.GraphModule:
    """Rewrite every node into its canonical spelling (see the module docstring). Values unchanged."""
    graph = gm.graph
    for node in list(graph.nodes):
        if not _no_op_removed(node):
            _spelling(node)
    # Algebra runs to a fixed point: one rewrite can enable another (pow -> square -> mean of square).
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node.op == "call_function":
                changed |= _algebra(node)
    graph.lint()
    gm.recompile()
    return gm

