"""What an FX node may write in place: shared by the passes that must not move or evaluate code across a write.

    written(node)                  the nodes whose tensors ``node`` may write (empty for a functional node)
    mutated_producer(graph, nodes) a node of ``graph`` writing memory one of ``nodes`` made (views included)
    body_of(node)                  the body GraphModule of a checkpoint/wrap higher-order op, else None

Conservative by design: an op whose schema may write an argument the node passes (any overload of a packet),
``out=``, ``inplace=True`` (by keyword or by position), setitem and the augmented operators, any method or function
named like an in-place op (``x.mul_``), a checkpointed body or a custom autograd.Function's forward body writing its
placeholder, and every input of any other higher-order op all count as writes.
"""
from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from .fx_utils import tensor_of

# Higher-order ops whose body's placeholders are the call's operands in order: (body, *operands).
BODY_CALLS = ("tag_activation_checkpoint", "wrap")

INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.imatmul}


def flat_nodes(value: Any) -> list[fx.Node]:
    """Every fx.Node inside ``value`` (args, kwargs, nested lists, tuples and dicts)."""
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def _schema_writes(node: fx.Node, schema: Any) -> list[fx.Node]:
    """The arguments ``schema`` marks as written (``Tensor(a!)``), by position or by name."""
    written = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        written += flat_nodes(value)
    return written


def written(node: fx.Node) -> list[fx.Node]:
    """The nodes whose tensors ``node`` may write in place: setitem, ``x += y``, ``x.fill_()``, ``out=``,
    ``inplace=True``, an op whose schema writes an argument the node passes (for a packet, any overload's), a
    checkpointed body writing its placeholder, and, not knowing better, every input of any other higher-order op.
    Empty for a functional node."""
    if node.op not in ("call_function", "call_method"):
        return []
    target = node.target
    out = flat_nodes(node.kwargs.get("out"))
    if isinstance(target, torch._ops.HigherOrderOperator):
        hop = getattr(target, "__name__", None)
        if hop in BODY_CALLS:
            return _body_call_writes(node, body_of(node), node.args[1:])
        if hop == "autograd_function_apply":  # (forward body, backward body, *operands): a custom autograd.Function
            return _body_call_writes(node, _graph_module(node.args[0]) if node.args else None, node.args[2:])
        return node.all_input_nodes
    if isinstance(target, torch._ops.OpOverload):
        return _schema_writes(node, target._schema) + out
    if isinstance(target, torch._ops.OpOverloadPacket):  # which overload runs is not known: any that writes
        found = [n for name in target.overloads() for n in _schema_writes(node, getattr(target, name)._schema)]
        return list(dict.fromkeys(found + out))  # (aten.index's out= overload writes only an out= given)
    if not node.args:
        return out
    name = target if node.op == "call_method" else getattr(target, "__name__", "")
    if target in INPLACE_OPERATORS or node.kwargs.get("inplace") is True or _inplace_by_position(node):
        return [*flat_nodes(node.args[0]), *out]
    if getattr(target, "__module__", None) in ("operator", "_operator"):  # and_, or_, not_: functional
        return out
    if isinstance(name, str) and name.endswith("_") and not name.startswith("__"):
        return [*flat_nodes(node.args[0]), *out]
    return out


@functools.lru_cache(maxsize=None)
def _inplace_index(target: Any) -> Optional[int]:
    """The position of ``target``'s ``inplace`` parameter (F.dropout(x, p, training, inplace), F.relu(x,
    inplace)), or None; a target whose signature cannot be read has none."""
    try:
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("inplace") if "inplace" in names else None


def _inplace_by_position(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    try:
        index = _inplace_index(node.target)
    except TypeError:  # an unhashable target
        return False
    return index is not None and index < len(node.args) and node.args[index] is True


def _graph_module(arg: Any) -> Optional[fx.GraphModule]:
    """The GraphModule a get_attr node ``arg`` names, else None."""
    if not isinstance(arg, fx.Node) or arg.op != "get_attr":
        return None
    body = getattr(arg.graph.owning_module, arg.target, None)
    return body if isinstance(body, fx.GraphModule) else None


def body_of(node: fx.Node) -> Optional[fx.GraphModule]:
    """The body of a ``BODY_CALLS`` node (``(body, *operands)``, body a get_attr of a GraphModule), else None."""
    if node.op != "call_function" or getattr(node.target, "__name__", None) not in BODY_CALLS or not node.args:
        return None
    return _graph_module(node.args[0])


def _body_call_writes(node: fx.Node, body: Optional[fx.GraphModule], operands: tuple) -> list[fx.Node]:
    """The ``operands`` of a higher-order op whose placeholder its ``body`` writes (recursively); every input
    when the body cannot be read or its placeholders do not pair with the operands."""
    if body is None:
        return node.all_input_nodes
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        return node.all_input_nodes
    return [operand for placeholder, operand in zip(placeholders, operands)
            if isinstance(operand, fx.Node) and mutated_producer(body.graph, {placeholder}) is not None]


# The storage of a value whose storage cannot be read: functorch's batched tensors (a mask built with torch.vmap,
# as transformers' Gemma 3 builds its image tokens' bidirectional mask) raise on ``untyped_storage()``. Two such
# values compare equal, so a write to one counts as a write to any other (conservative: aliasing unknown).
_UNREADABLE = object()


def _storage(node: Any) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    value = tensor_of(node)
    if value is None:
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return _UNREADABLE


def mutated_producer(graph: fx.Graph, producers: set[fx.Node],
                     candidates: Optional[list[fx.Node]] = None) -> Optional[fx.Node]:
    """A node of ``graph`` (or of ``candidates``, the nodes known to write, when given) that writes in place
    into memory one of ``producers`` made (views included: the example values' storages say what aliases
    what), or None."""
    storages = {_storage(n) for n in producers} - {None}
    for node in graph.nodes if candidates is None else candidates:
        if any(target in producers or _storage(target) in storages for target in written(node)):
            return node
    return None
