"""A LoRA MLP computed a block of rows at a time: ``torch.ops.sloth.lora_mlp_tiled``, for long context.

The op equals the two ops the LoRA pass leaves in a LoRA MLP (lowering/lora_shared.py, lowering/glu_lora.py)::

    gate, up = sloth.lora_linear_shared(x, [w_g, w_u], [bias_g, bias_u], a, [b_g, b_u], s)[:2]
    y        = sloth.glu_lora_linear(gate, up, activation, w_d, bias_d, a_d, b_d, s_d)

(or, with one member, ``gate`` the merged gate-and-up projection and ``up`` None), and exists for what it
keeps alive. Those two ops save ``gate`` and ``up`` (rows x intermediate each), and the down op's backward
holds three more such tensors at once (d_hidden, d_gate, d_up): at 65536 tokens of Llama-3-8B (intermediate
14336, bf16) each is 1.75 GiB, so a layer's MLP backward needs ~8.75 GiB however the layer is checkpointed.
This op runs both halves one block of ``tile_rows`` rows at a time. With ``recompute`` it saves x (rows x
hidden) and the two adapters' fp32 down products (rows x 3r) and recomputes each block's gate and up in the
backward::

    forward   for each block b:   gate_b, up_b, h1_b = lora_linear_shared(x_b, ...)
                                  y_b, h2_b          = glu_lora_linear(gate_b, up_b, ...)
    backward  for each block b:   gate_b, up_b       = lora_linear_shared(x_b, ...)     recomputed
                                  d_gate_b, d_up_b, (da_d, db_d) += glu_lora_linear's backward(dy_b, gate_b, up_b,
                                                                                               h2_b)
                                  dx_b, (da, db_g, db_u)         += lora_linear_shared's backward(d_gate_b, d_up_b,
                                                                                                  x_b, h1_b)

Rows are independent in every one of these products except the adapters' weight gradients, which are sums
over rows: each block's share is computed in fp32 and the shares are summed in fp32 and rounded once, as the
untiled kernels round their one sum (the blocks change only the order of the fp32 additions). The price is the
recompute: two base GEMMs per block (gate and up, 4 x rows x hidden x intermediate FLOPs) on top of the step's
12 MLP GEMMs under gradient checkpointing: on the H200 the Llama-3-8B LoRA step took 6.2% longer at 64k tokens,
where attention dominates, and 11.7% longer at 16k (benchmarks/results/2026-12-02_issue19_tiled_mlp.md). Short
sequences would pay it for nothing, which is why the pass (patterns/tiled_mlp.py) tiles only MLPs with more rows
than one block.
The intermediates a block needs at once: gate, up, d_hidden, d_gate, d_up, 5 x tile_rows x intermediate
(0.55 GiB at 4096 rows of Llama-3-8B).

Without ``recompute`` the op keeps gate and up whole (computed in one call in the forward, as the two ops do)
and only the GLU, the down projection and the backward run by blocks: no recompute, and of the five
tensors the backward held, the three it makes (d_hidden, d_gate, d_up) exist one block at a time.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .devices import check_one_device
from .glu_lora import _glu_lora_bwd, _glu_lora_fwd
from .layout import rows_2d
from .lora_shared import _grad_structure, _per_item, lora_shared_backward, lora_shared_forward
from .registration import define, fake

# Rows per block when the user asks for tiling without a number (``options={"tiled_mlp": True}``): 5 blocks'
# worth of intermediates is 0.55 GiB at Llama-3-8B's width, and 4096-row GEMMs still run near the H200's peak.
DEFAULT_TILE_ROWS = 4096


def _check(ws: list[torch.Tensor], biases: list[Optional[torch.Tensor]], bs: list[torch.Tensor], w_d: torch.Tensor,
           tile_rows: int) -> None:
    if len(ws) not in (1, 2) or len(biases) != len(ws) or len(bs) != len(ws):
        raise ValueError(f"sloth.lora_mlp_tiled: ws, biases and bs must hold the gate and up projections (2) or "
                         f"the merged gate-and-up projection (1), got {len(ws)}, {len(biases)} and {len(bs)}")
    if tile_rows < 1:
        raise ValueError(f"sloth.lora_mlp_tiled: tile_rows must be a positive number of rows, got {tile_rows}")
    width = ws[0].shape[0] // (2 if len(ws) == 1 else 1)
    if w_d.dim() != 2 or w_d.shape[1] != width:
        raise ValueError(f"sloth.lora_mlp_tiled: the down projection's weight must be [out, {width}] (the "
                         f"intermediate width), got {tuple(w_d.shape)}")


def _gate_up(projections: list[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    return (projections[0], projections[1]) if len(projections) == 2 else (projections[0], None)


def lora_mlp_tiled_forward(x: torch.Tensor, ws: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
                           a: torch.Tensor, bs: list[torch.Tensor], scale: float, activation: str, w_d: torch.Tensor,
                           bias_d: Optional[torch.Tensor], a_d: torch.Tensor, b_d: torch.Tensor, scale_d: float,
                           tile_rows: int, recompute: bool) -> list[torch.Tensor]:
    """``[y, h1, h2, *projections]``: the MLP's output, the adapters' fp32 down products (x a.T, hidden a_d.T)
    and, without ``recompute``, the projections (gate and up, or the merged one), kept for the backward."""
    _check(ws, biases, bs, w_d, tile_rows)
    x_MK = rows_2d(x)
    rows = x_MK.shape[0]
    y = x.new_empty((rows, w_d.shape[0]))
    h2 = x.new_empty((rows, a_d.shape[0]), dtype=torch.float32)
    kept: list[torch.Tensor] = []
    if recompute:
        h1 = x.new_empty((rows, a.shape[0]), dtype=torch.float32)
    else:
        *kept, h1 = lora_shared_forward(x_MK, ws, biases, a, bs, scale)
    for start in range(0, rows, tile_rows):
        block = slice(start, min(start + tile_rows, rows))
        if recompute:
            *projections, h1[block] = lora_shared_forward(x_MK[block], ws, biases, a, bs, scale)
        else:
            projections = [p[block] for p in kept]
        gate, up = _gate_up(projections)
        y[block], h2[block] = _glu_lora_fwd(gate, up, activation, w_d, bias_d, a_d, b_d, scale_d)
        del projections, gate, up  # this block's intermediates go before the next block's are made
    return [y.view(*x.shape[:-1], w_d.shape[0]), h1, h2, *kept]


def lora_mlp_tiled_backward(dy: torch.Tensor, x: torch.Tensor, ws: list[torch.Tensor],
                            biases: list[Optional[torch.Tensor]], a: torch.Tensor, bs: list[torch.Tensor], scale: float,
                            activation: str, w_d: torch.Tensor, a_d: torch.Tensor, b_d: torch.Tensor,
                            h1: Optional[torch.Tensor], h2: Optional[torch.Tensor], kept: list[torch.Tensor],
                            scale_d: float, tile_rows: int, need_dx: bool) -> list[torch.Tensor]:
    """``[dx, da, db_0, ..., db_{n-1}, da_d, db_d]`` (module docstring); dx is empty when ``need_dx`` is False.
    ``kept`` holds the forward's projections, or nothing (they are then recomputed block by block). h1 and h2
    None (compiler/lean_backward.py: the forward was not run again for them): each block's are recomputed,
    bit for bit the forward's, h1's by the projections' recompute, h2's from the hidden the GLU's backward
    forms; only where the projections are recomputed too."""
    if kept and (h1 is None or h2 is None):
        raise ValueError("sloth.lora_mlp_tiled_backward: h1 and h2 may be left out only where the projections are "
                         "recomputed (kept empty)")
    x_MK, dy_MN = rows_2d(x), rows_2d(dy)
    rows = x_MK.shape[0]
    fp32 = torch.float32
    da, da_d, db_d = (torch.zeros(t.shape, dtype=fp32, device=x.device) for t in (a, a_d, b_d))
    dbs = [torch.zeros(b.shape, dtype=fp32, device=x.device) for b in bs]
    dx = x_MK.new_empty(x_MK.shape) if need_dx else x.new_empty(0)
    for start in range(0, rows, tile_rows):
        block = slice(start, min(start + tile_rows, rows))
        x_b = x_MK[block]
        if kept:
            projections, h1_b = [p[block] for p in kept], h1[block]
        else:
            *projections, h1_b = lora_shared_forward(x_b, ws, biases, a, bs, scale)  # h1_b is h1[block] again
        gate, up = _gate_up(projections)
        # Recomputed projections are this loop's own: their gradients are written over them.
        d_gate, d_up, da_d_b, db_d_b = _glu_lora_bwd(dy_MN[block], gate, up, activation, w_d, a_d, b_d,
                                                     None if h2 is None else h2[block], scale_d, grad_dtype=fp32,
                                                     in_place=not kept)
        del projections, gate, up
        dx_b, da_b, *dbs_b = lora_shared_backward([d_gate, d_up] if len(ws) == 2 else [d_gate], x_b, ws, a, bs,
                                                  h1_b, scale, need_dx, grad_dtype=fp32)
        del d_gate, d_up
        if need_dx:
            dx[block] = dx_b
        da += da_b
        da_d += da_d_b
        db_d += db_d_b
        for db, db_b in zip(dbs, dbs_b):
            db += db_b
    return [dx.view(x.shape) if need_dx else dx, da.to(a.dtype), *(db.to(b.dtype) for db, b in zip(dbs, bs)),
            da_d.to(a_d.dtype), db_d.to(b_d.dtype)]


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

_ARGS = ("x", "ws", "biases", "a", "bs", "scale", "activation", "w_d", "bias_d", "a_d", "b_d", "scale_d",
         "tile_rows", "recompute")


def _setup_context(ctx, inputs, output) -> None:
    args = dict(zip(_ARGS, inputs))
    n = len(args["ws"])
    kept = output[3:]
    ctx.save_for_backward(args["x"], args["a"], output[1], output[2], args["w_d"], args["a_d"], args["b_d"],
                          *args["ws"], *args["bs"], *args["biases"], *kept)
    ctx.mark_non_differentiable(*output[1:])  # h1, h2 and the kept projections are returned to be saved, not used
    ctx.n, ctx.structure = n, _grad_structure(inputs)
    ctx.static = (args["scale"], args["activation"], args["scale_d"], args["tile_rows"])


def _backward(ctx, grads):
    needs = dict(zip(_ARGS, ctx.needs_input_grad))
    n = ctx.n
    if any(_per_item(needs["ws"], n)) or any(_per_item(needs["biases"], n)) or needs["w_d"] or needs["bias_d"]:
        raise RuntimeError("sloth.lora_mlp_tiled: the base weights and biases must be frozen (requires_grad=False); "
                           "the op computes no gradient for them")
    x, a, h1, h2, w_d, a_d, b_d, *rest = ctx.saved_tensors
    ws, bs, biases, kept = rest[:n], rest[n:2 * n], rest[2 * n:3 * n], rest[3 * n:]
    scale, activation, scale_d, tile_rows = ctx.static
    dx, da, *dbs, da_d, db_d = torch.ops.sloth.lora_mlp_tiled_backward(
        grads[0], x, list(ws), list(biases), a, list(bs), scale, activation, w_d, a_d, b_d, h1, h2, list(kept),
        scale_d, tile_rows, bool(needs["x"]))
    out = [None if slot is None else list(slot) for slot in ctx.structure]
    index = {name: i for i, name in enumerate(_ARGS)}
    out[index["x"]] = dx if needs["x"] else None
    out[index["a"]] = da if needs["a"] else None
    out[index["bs"]] = [db if need else None for db, need in zip(dbs, _per_item(needs["bs"], n))]
    out[index["a_d"]] = da_d if needs["a_d"] else None
    out[index["b_d"]] = db_d if needs["b_d"] else None
    return tuple(out)


@functools.cache
def register() -> None:
    """Define ``sloth::lora_mlp_tiled`` and its backward (idempotent)."""
    fwd = define("sloth::lora_mlp_tiled", lora_mlp_tiled_forward)
    bwd = define("sloth::lora_mlp_tiled_backward", lora_mlp_tiled_backward)

    @fake(fwd)
    def _(x, ws, biases, a, bs, scale, activation, w_d, bias_d, a_d, b_d, scale_d, tile_rows, recompute):
        # A call with a meta input runs this, not the op and its checks (lowering/devices.py).
        check_one_device("sloth.lora_mlp_tiled", ("x", x), ("a", a), ("w_d", w_d), ("bias_d", bias_d), ("a_d", a_d),
                         ("b_d", b_d), *((f"ws[{i}]", w) for i, w in enumerate(ws)),
                         *((f"biases[{i}]", t) for i, t in enumerate(biases)),
                         *((f"bs[{i}]", b) for i, b in enumerate(bs)))
        rows = math.prod(x.shape[:-1])
        return [x.new_empty((*x.shape[:-1], w_d.shape[0])), x.new_empty((rows, a.shape[0]), dtype=torch.float32),
                x.new_empty((rows, a_d.shape[0]), dtype=torch.float32),
                *([] if recompute else [x.new_empty((rows, w.shape[0])) for w in ws])]

    @fake(bwd)
    def _(dy, x, ws, biases, a, bs, scale, activation, w_d, a_d, b_d, h1, h2, kept, scale_d, tile_rows, need_dx):
        return [x.new_empty(x.shape) if need_dx else x.new_empty(0), a.new_empty(a.shape),
                *(b.new_empty(b.shape) for b in bs), a_d.new_empty(a_d.shape), b_d.new_empty(b_d.shape)]

    fwd.register_autograd(_backward, setup_context=_setup_context)


def lora_mlp_tiled(x: torch.Tensor, ws: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
                   a_list: list[torch.Tensor], bs: list[torch.Tensor], scale: float, activation: str,
                   w_d: torch.Tensor, bias_d: Optional[torch.Tensor], a_d: torch.Tensor, b_d: torch.Tensor,
                   scale_d: float, tile_rows: int = DEFAULT_TILE_ROWS, recompute: bool = True) -> torch.Tensor:
    """The LoRA MLP ``down(glu(gate(x), up(x)))`` (each projection ``x w.T + bias + s x a.T b.T``) computed
    ``tile_rows`` rows at a time, gate and up kept or (``recompute``) recomputed (module docstring); ``a_list``,
    ``bs``, ``ws`` and ``biases`` hold the gate's and up's (or the merged projection's alone)."""
    register()
    y, *_ = torch.ops.sloth.lora_mlp_tiled(x, list(ws), list(biases), torch.cat(list(a_list), 0), list(bs),
                                           float(scale), activation, w_d, bias_d, a_d, b_d, float(scale_d),
                                           int(tile_rows), bool(recompute))
    return y
