"""LoRA linears that read the same input, made one op (part of the ``"lora"`` family).

After the LoRA pass has placed its ops, the ``sloth.lora_linear`` nodes that read one tensor ``x`` (an
attention's q, k and v projections, an MLP's gate and up) become one ``sloth.lora_linear_shared``::

    y_i = sloth.lora_linear(x, w_i, bias_i, a_i, b_i, s)[0]          for i = 0..n-1, n >= 2
    ->
    a   = torch.cat([a_0, ..., a_{n-1}])                             (autograd splits da back into the a_i)
    out = sloth.lora_linear_shared(x, [w_i], [bias_i], a, [b_i], s)
    y_i = out[i]

and ``sloth.qlora_linear`` nodes over bitsandbytes 4-bit bases likewise become one ``sloth.qlora_linear_shared``.
The value of each y_i is the same math (lowering/lora_shared.py, which also says what it saves: one op call
instead of n, and x read once). Grouped only when the members agree on what the op needs: dense or 4-bit
alike (4-bit: one block size, quant type and in_features, all double-quantised or none), one scale, adapters
of one rank and one dtype, and each member's output used through its first result only. Members are joined
at the first one's place in the graph, so a member whose weights or adapters are computed after that place
(a stacked multi-adapter factor, say) stays on its own, unless they are casts of values made before it (autocast's
casts, which move up with the member), and so does every member after a node that may write
a tensor in place or changes grad mode or autocast (moving a member across it would change what it reads or
whether it records a gradient). A down projection fused with its GLU
(``glu_lora_linear``) reads no shared input and is left as it is.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from ..compiler.canonicalize import cast
from ..compiler.fx_utils import insert_call, is_call, module_path, tensor_of, value_of
from ..compiler.writes import written


def _lowering():
    """The kernel module, imported on first use (see patterns/rms_norm.py for why)."""
    from ..lowering import lora_shared

    return lora_shared


# The joined op's kernels tile all members' adapter columns at once (n r, padded to a power of two); at 128 the
# up and grad kernels' tiles take 131 KB of shared memory, at 256 they would need 262 KB, past the H200's
# 227 KB (compiled for sm_90 on the CPU). So a group is cut into ops of at most 128 adapter columns: q, k, v
# at r = 16 or 32 stay one op, at r = 64 become two (q + k, v alone), at r >= 128 are not joined.
MAX_SHARED_RANK = 128

# Where each op keeps its arguments: (x, bias, a, b, scale) positions; the rest are the base's.
_DENSE = dict(x=0, bias=2, a=3, b=4, scale=5)  # lora_linear(x, w, bias, a, b, scale)
_4BIT = dict(x=0, bias=10, a=11, b=12, scale=13)  # qlora_linear(x, packed, absmax, absmax_code, absmax_scale,
#                                                   absmax_offset, out_features, in_features, blocksize,
#                                                   quant_type, bias, a, b, scale)


def _layout(node: fx.Node) -> Optional[dict]:
    if node.target is torch.ops.sloth.lora_linear.default:
        return _DENSE
    if node.target is torch.ops.sloth.qlora_linear.default:
        return _4BIT
    return None


def _inputs(node: fx.Node) -> list[fx.Node]:
    """Everything the node reads besides x: what must exist where the joined op is placed."""
    return [n for n in node.args[1:] if isinstance(n, fx.Node)]


def _movable(node: fx.Node, first: fx.Node, position: dict[fx.Node, int]) -> bool:
    """Whether ``node``, made after ``first``, can move up before it: a cast (autocast's cast of a weight or a
    factor, patterns/lora.py) of a value made before ``first``, read by its member only. Moving it crosses no
    barrier: members after one are not joined."""
    return is_call(node, cast) and isinstance(node.args[0], fx.Node) and node.args[0] in position \
        and position[node.args[0]] < position[first] and len(node.users) == 1


def _key(node: fx.Node) -> Any:
    """What members of one group must share, or None for a node that cannot be a member."""
    layout = _layout(node)
    if layout is None:
        return None
    if any(not (u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0) for u in node.users):
        return None
    at, scale = tensor_of(node.args[layout["a"]]), node.args[layout["scale"]]
    if at is None or not isinstance(scale, float):
        return None
    key = (node.target, node.args[0], scale, at.shape[0], at.dtype)
    if layout is _4BIT:  # in_features, blocksize, quant_type, and double quantisation or not
        key += (node.args[7], node.args[8], node.args[9], node.args[3] is None)
    return key


def _barrier(node: fx.Node) -> bool:
    """A node no member may be moved across: it may write a tensor in place (x itself, a weight, an adapter:
    compiler/writes.py) or change state the ops run under (grad mode, autocast: FX's impure nodes)."""
    return node.op in ("call_function", "call_method") and (node.is_impure() or bool(written(node)))


def _next_barrier(nodes: list[fx.Node], start: int, end: int) -> int:
    """The position of the first barrier strictly between positions ``start`` and ``end``, else ``end + 1``."""
    return next((i for i in range(start + 1, end) if _barrier(nodes[i])), end + 1)


def share_lora_inputs(gm: fx.GraphModule, fused: list[fx.Node], joined: Optional[dict[fx.Node, list[fx.Node]]] = None
                      ) -> dict[fx.Node, tuple[str, str]]:
    """Join the ``sloth.lora_linear`` / ``sloth.qlora_linear`` nodes in ``fused`` that read one input (module
    docstring). Returns, for each node joined, the op it became and a note for the report naming the modules
    it was joined with; ``joined``, when given, gets each joined op's members."""
    _lowering().register()
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    groups: dict[Any, list[fx.Node]] = {}
    for node in fused:
        if (key := _key(node)) is not None:
            groups.setdefault(key, []).append(node)
    notes: dict[fx.Node, tuple[str, str]] = {}
    # Positions are taken once: a join only inserts pure nodes and erases members, so every other node keeps
    # its order relative to the rest.
    nodes_in_order = list(gm.graph.nodes)
    for key, nodes in groups.items():
        nodes.sort(key=position.__getitem__)
        first = nodes[0]
        stop = _next_barrier(nodes_in_order, position[first], position[nodes[-1]])
        members = [first] + [n for n in nodes[1:] if position[n] < stop
                             and all(position.get(i, len(position)) < position[first] or _movable(i, first, position)
                                     for i in _inputs(n))]
        size = MAX_SHARED_RANK // key[3]  # members per op (key[3]: the adapters' rank)
        for chunk in (members[i:i + size] for i in range(0, len(members), max(size, 1))):
            if len(chunk) < 2:
                continue
            names = [module_path(n) or "(top level)" for n in chunk]
            for member in chunk[1:]:
                for node in _inputs(member):
                    if position.get(node, len(position)) > position[chunk[0]]:
                        chunk[0].prepend(node)  # a _movable cast
            op, shared = _join(gm, chunk)
            if joined is not None:
                joined[shared] = chunk
            for node, name in zip(chunk, names):
                others = ", ".join(n for n in names if n != name)
                notes[node] = (op, f"one op with {others} (x read once)")
    if notes:
        gm.graph.lint()
    return notes


def _join(gm: fx.GraphModule, members: list[fx.Node]) -> tuple[str, fx.Node]:
    """Replace ``members`` by one shared op placed before the first; returns the op's name for the report and
    its node."""
    graph, first = gm.graph, members[0]
    layout = _layout(first)
    column = lambda i: [m.args[i] for m in members]  # noqa: E731  (argument i of every member)
    a = insert_call(graph, first, torch.cat, (column(layout["a"]), 0), meta_from=first)
    x, scale = first.args[layout["x"]], first.args[layout["scale"]]
    if layout is _DENSE:
        target, name = torch.ops.sloth.lora_linear_shared.default, "sloth.lora_linear_shared"
        args = (x, column(1), column(2), a, column(4), scale)
    else:
        nested = first.args[3] is not None
        target, name = torch.ops.sloth.qlora_linear_shared.default, "sloth.qlora_linear_shared"
        args = (x, column(1), column(2), *((column(3), column(4), column(5)) if nested else ([], [], [])),
                column(6), *first.args[7:10], column(10), a, column(12), scale)
    # The outputs' values as the LoRA pass left them (their requires_grad inherited from the replaced sums).
    ys = [tensor_of(next(iter(m.users))) if m.users else value_of(m)[0] for m in members]
    h = tensor_of(x).new_empty((value_of(first)[1].shape[0], tensor_of(a).shape[0]), dtype=torch.float32)
    shared = insert_call(graph, first, target, args, meta_from=first, value=[*ys, h])
    outs = [insert_call(graph, first, operator.getitem, (shared, i), meta_from=m, value=ys[i])
            for i, m in enumerate(members)]
    for member, y in zip(members, outs):
        for user in list(member.users):  # the member's getitem(., 0) nodes
            user.replace_all_uses_with(y)
            graph.erase_node(user)
        graph.erase_node(member)
    return name, shared
