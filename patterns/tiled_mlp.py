"""A LoRA MLP's two ops made one that runs a block of rows at a time (part of the ``"lora"`` family, on
``options={"tiled_mlp": True}`` or a number of rows per block).

After the LoRA pass has joined the gate and up projections (patterns/lora_shared.py) and taken the GLU into
the down projection, a LoRA MLP is two ops; this pass makes them one ``sloth.lora_mlp_tiled``
(lowering/tiled_mlp.py, which says what it saves and what it costs)::

    p    = sloth.lora_linear_shared(x, [w_g, w_u], [bias_g, bias_u], a, [b_g, b_u], s)
    d    = sloth.glu_lora_linear(p[0], p[1], activation, w_d, bias_d, a_d, b_d, s_d)
    y    = d[0]
    ->
    t    = sloth.lora_mlp_tiled(x, [w_g, w_u], [bias_g, bias_u], a, [b_g, b_u], s, activation, w_d, bias_d, a_d,
                                b_d, s_d, tile_rows, recompute)
    y    = t[0]

and likewise a merged gate-and-up projection (``sloth.lora_linear(x, w_gu, ...)[0]`` feeding the down op with
up None). Only when nothing else reads gate, up or the projections' saved product, when nothing between the two
ops may write a tensor in place or change grad mode or autocast (the joined op computes the projections at the
down op's place), and when the MLP has more rows than one block (fewer would pay the backward's recompute for
nothing: such an MLP is left as the two ops, and its site says so). 4-bit bases (QLoRA) are not tiled yet; their
sites say so.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.experimental import symbolic_shapes

from ..compiler.fx_utils import insert_call, tensor_of
from .lora_shared import _barrier


def _lowering():
    """The kernel module, imported on first use (see patterns/rms_norm.py for why)."""
    from ..lowering import tiled_mlp

    return tiled_mlp


def _only_getitems(node: fx.Node, indices: set[int]) -> bool:
    return all(u.op == "call_function" and u.target is operator.getitem and u.args[1] in indices for u in node.users)


def _projection(gate: Any, up: Any) -> Optional[fx.Node]:
    """The op that produced the down op's gate (and up), when its outputs go nowhere else."""
    if not (isinstance(gate, fx.Node) and gate.target is operator.getitem and gate.args[1] == 0
            and len(gate.users) == 1):
        return None
    producer = gate.args[0]
    if up is None:
        ok = producer.target is torch.ops.sloth.lora_linear.default and _only_getitems(producer, {0}) \
            and len(producer.users) == 1
    else:
        ok = (isinstance(up, fx.Node) and up.target is operator.getitem and up.args[0] is producer
              and up.args[1] == 1 and len(up.users) == 1
              and producer.target is torch.ops.sloth.lora_linear_shared.default
              and len(producer.args[1]) == 2 and _only_getitems(producer, {0, 1}) and len(producer.users) == 2)
    return producer if ok else None


def _hint(size: Any) -> Optional[int]:
    """A size's value in the example inputs, without adding a guard (a dynamic length is a SymInt)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    # The function's name moved between torch releases: optimization_hint (2.13), hint_int (2.11).
    for name in ("optimization_hint", "hint_int"):
        hint = getattr(symbolic_shapes, name, None)
        if hint is not None:
            try:
                return int(hint(size))
            except Exception:  # no hint recorded: the caller leaves the site as it is
                return None
    return None


def _rows(x: fx.Node) -> Optional[int]:
    xt = tensor_of(x)
    if xt is None:
        return None
    rows = 1
    for size in xt.shape[:-1]:
        hint = _hint(size)
        if hint is None:
            return None
        rows *= hint
    return rows


def tile_lora_mlps(gm: fx.GraphModule, down_ops: list[fx.Node], tile_rows: int, recompute: bool
                   ) -> dict[fx.Node, tuple[Optional[str], str, Optional[fx.Node]]]:
    """Make each LoRA MLP ending in one of ``down_ops`` (``sloth.glu_lora_linear`` / ``glu_qlora_linear`` nodes)
    one ``sloth.lora_mlp_tiled`` (module docstring), its gate and up kept or (``recompute``) recomputed in the
    backward. Returns, per down op looked at, (the op it became or None when left, a note for the report, the
    projection op it was joined with or None)."""
    _lowering().register()
    outcomes: dict[fx.Node, tuple[Optional[str], str, Optional[fx.Node]]] = {}
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    nodes_in_order = list(gm.graph.nodes)
    for down in down_ops:
        if down.target is torch.ops.sloth.glu_qlora_linear.default:
            outcomes[down] = (None, "not tiled: a 4-bit base (tiled_mlp covers dense LoRA MLPs for now)", None)
            continue
        if down.target is not torch.ops.sloth.glu_lora_linear.default or not _only_getitems(down, {0}):
            continue
        gate, up, activation, w_d, bias_d, a_d, b_d, scale_d = down.args
        producer = _projection(gate, up)
        if producer is None:
            outcomes[down] = (None, "not tiled: its gate and up are not one LoRA projection read by nothing else "
                                    "(tiled_mlp needs share_lora_input on)", None)
            continue
        if any(_barrier(n) for n in nodes_in_order[position[producer] + 1:position[down]]):
            outcomes[down] = (None, "not tiled: an in-place write or a grad-mode / autocast change lies between "
                                    "its projections and its down op", producer)
            continue
        rows = _rows(producer.args[0])
        if rows is None or rows <= tile_rows:
            outcomes[down] = (None, f"not tiled: {rows} rows fit one block of {tile_rows}", producer)
            continue
        if producer.target is torch.ops.sloth.lora_linear_shared.default:
            x, ws, biases, a, bs, scale = producer.args
        else:
            x, w, bias, a, b, scale = producer.args
            ws, biases, bs = [w], [bias], [b]
        y_value = tensor_of(next(iter(down.users)))
        if y_value is None:
            continue
        xt, at, adt = tensor_of(x), tensor_of(a), tensor_of(a_d)
        value = [y_value, xt.new_empty((rows, at.shape[0]), dtype=torch.float32),
                 xt.new_empty((rows, adt.shape[0]), dtype=torch.float32),
                 *([] if recompute else [xt.new_empty((rows, tensor_of(w).shape[0])) for w in ws])]
        tiled = insert_call(gm.graph, down, torch.ops.sloth.lora_mlp_tiled.default,
                            (x, list(ws), list(biases), a, list(bs), scale, activation, w_d, bias_d, a_d, b_d, scale_d,
                             tile_rows, recompute), meta_from=down, value=value)
        y = insert_call(gm.graph, down, operator.getitem, (tiled, 0), meta_from=down, value=y_value)
        for user in list(down.users):  # the down op's getitem(., 0) nodes
            user.replace_all_uses_with(y)
            gm.graph.erase_node(user)
        gm.graph.erase_node(down)
        for user in list(producer.users):
            gm.graph.erase_node(user)
        gm.graph.erase_node(producer)
        blocks = -(-rows // tile_rows)
        kept = "recomputed per block in backward" if recompute else "kept"
        outcomes[down] = ("sloth.lora_mlp_tiled", f"tiled: {blocks} blocks of {tile_rows} rows, gate and up {kept}",
                          producer)
    return outcomes
