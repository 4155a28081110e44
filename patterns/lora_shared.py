"""LoRA linears that read the same input, made one op (part of the ``"lora"`` family).

After the LoRA pass has placed its ops, the ``sloth.lora_linear`` nodes that read one tensor ``x`` (an
attention's q, k and v projections, an MLP's gate and up) become one ``sloth.lora_linear_shared``::

    y_i = sloth.lora_linear(x, w_i, bias_i, a_i, b_i, s)[0]          for i = 0..n-1, n >= 2
    ->
    a   = torch.cat([a_0, ..., a_{n-1}])                             (autograd splits da back into the a_i)
    out = sloth.lora_linear_shared(x, [w_i], [bias_i], a, [b_i], s)
    y_i = out[i]

The value of each y_i is the same math (lowering/lora_shared.py, which also says what it saves: one op call
instead of n, and x read once). Grouped only when the members agree on what the op needs: one scale, adapters
of one rank and one dtype, and each member's output used through its first result only. Members are joined
at the first one's place in the graph, so a member whose weights or adapters are computed after that place
(a stacked multi-adapter factor, say) stays on its own. 4-bit bases (``qlora_linear``) and a down projection
fused with its GLU (``glu_lora_linear``) are left as they are.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..compiler.fx_utils import insert_call, module_path, tensor_of, value_of


def _lowering():
    """The kernel module, imported on first use (see patterns/rms_norm.py for why)."""
    from ..lowering import lora_shared

    return lora_shared


def _inputs(node: fx.Node) -> list[fx.Node]:
    _, w, bias, a, b, _ = node.args
    return [n for n in (w, bias, a, b) if isinstance(n, fx.Node)]


def _key(node: fx.Node) -> Any:
    """What members of one group must share, or None for a node that cannot be a member."""
    if any(not (u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0) for u in node.users):
        return None
    x, _, _, a, _, scale = node.args
    at = tensor_of(a)
    if at is None or not isinstance(scale, float):
        return None
    return x, scale, at.shape[0], at.dtype


def share_lora_inputs(gm: fx.GraphModule, fused: list[fx.Node]) -> dict[fx.Node, str]:
    """Join the ``sloth.lora_linear`` nodes in ``fused`` that read one input (module docstring). Returns, for
    each node joined, a note for the report naming the modules it was joined with."""
    _lowering().register()
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    groups: dict[Any, list[fx.Node]] = {}
    for node in fused:
        if node.target is torch.ops.sloth.lora_linear.default and (key := _key(node)) is not None:
            groups.setdefault(key, []).append(node)
    notes: dict[fx.Node, str] = {}
    for (x, scale, _, _), nodes in groups.items():
        nodes.sort(key=position.__getitem__)
        first = nodes[0]
        members = [first] + [n for n in nodes[1:] if all(position[i] < position[first] for i in _inputs(n))]
        if len(members) < 2:
            continue
        names = [module_path(n) or "(top level)" for n in members]
        _join(gm, x, scale, members)
        for node, name in zip(members, names):
            others = ", ".join(n for n in names if n != name)
            notes[node] = f"one sloth.lora_linear_shared with {others} (x read once)"
    if notes:
        gm.graph.lint()
    return notes


def _join(gm: fx.GraphModule, x: fx.Node, scale: float, members: list[fx.Node]) -> None:
    graph, first = gm.graph, members[0]
    a = insert_call(graph, first, torch.cat, ([m.args[3] for m in members], 0), meta_from=first)
    # The outputs' values as the LoRA pass left them (their requires_grad inherited from the replaced sums).
    ys = [tensor_of(next(iter(m.users))) if m.users else value_of(m)[0] for m in members]
    h = tensor_of(x).new_empty((value_of(first)[1].shape[0], tensor_of(a).shape[0]), dtype=torch.float32)
    shared = insert_call(graph, first, torch.ops.sloth.lora_linear_shared.default,
                         (x, [m.args[1] for m in members], [m.args[2] for m in members], a,
                          [m.args[4] for m in members], scale), meta_from=first, value=[*ys, h])
    outs = [insert_call(graph, first, operator.getitem, (shared, i), meta_from=m, value=ys[i])
            for i, m in enumerate(members)]
    for member, y in zip(members, outs):
        for user in list(member.users):  # the member's getitem(., 0) nodes
            user.replace_all_uses_with(y)
            graph.erase_node(user)
        graph.erase_node(member)
