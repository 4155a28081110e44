"""Gate and up in two stacked weights (part of ``moe_route``, patterns/moe.py): production MoE trainers (torchtitan's
``GroupedExperts``: ``w1``, ``w3`` [E, I, H], ``w2`` [E, H, I]) keep the gate and the up projection apart and run
three expert GEMMs over the tokens they permute themselves::

    h   = act(gemm(rows, W_gate[e])) * gemm(rows, W_up[e])          W_gate, W_up [E, I, H] (or [E, H, I])
    out = gemm(h, W_down[e])

which is the op's first GEMM on ``W1 = cat([W_gate, W_up], dim of I)`` [E, 2I, H] (gate rows first, up rows
after: the op's halves layout) and its second on W_down. The pass joins the two weights with one ``torch.cat`` in
the graph (a copy of both each step, E * 2I * H elements, and a split of their gradient in the backward) and gives
the op the joined value; the two graph inputs stay the trainable parameters.

How a pair is recognised, on the canonical graph, from the expert GEMMs (compiler/anchors.py): two GEMMs reading
the same rows (one value, through views and casts, or the same gather written twice), with stacked weights of one
shape and dtype, and a third expert GEMM downstream of both (the down projection). The gate is the one whose result
reaches an activation first (else the earlier in the graph). Nothing here is trusted alone: the probes (patterns/
moe.py ``_accept``) compare the region, reading the two weights as slices of the joined one, with the op's pattern
on it, so a wrong gate/up order or a wrong dim is refused there, not fused.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx as fx

from .moe_sites import expert_operand, expert_weight_arg
from ..compiler.fx_utils import descendants, op_name, insert_call, tensor_of
from .moe_adapters import _same_call, _viewed, rows_of

# What an activation of the gate is called in the canonical graph (a clamp first: GPT-OSS and DeepSeek-V4 clamp).
_ACTIVATIONS = {"silu", "gelu", "sigmoid", "relu", "tanh", "clamp", "clamp_max", "clip"}
_TRANSPOSES = {"transpose", "t", "permute"}


@dataclasses.dataclass
class SplitGateUp:
    """The up GEMM beside gate GEMM ``gate``; ``joined`` the ``torch.cat`` of their weights the op reads (inserted
    by ``join``), along ``dim`` of the stored [E, ., .] weights."""
    gate: fx.Node
    up: fx.Node
    dim: int
    joined: Optional[fx.Node] = None

    def parts(self) -> tuple[fx.Node, fx.Node]:
        return expert_operand(self.gate), expert_operand(self.up)

    def slices(self, joined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate's and the up's weights as views of a value of the joined weight (the probes' inputs)."""
        return joined.chunk(2, dim=self.dim)


def _same_rows(a: fx.Node, b: fx.Node) -> bool:
    rows_a, rows_b = rows_of(a), rows_of(b)
    if rows_a is None or rows_b is None:
        return False
    chain_a, chain_b = _viewed(rows_a), _viewed(rows_b)
    return bool(set(chain_a) & set(chain_b)) or _same_call(chain_a[-1], chain_b[-1])


def _activated(gemm: fx.Node, depth: int = 3) -> bool:
    """Whether ``gemm``'s result reaches an activation within ``depth`` nodes (through views and casts)."""
    frontier = [gemm]
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users]
        if any(op_name(u) in _ACTIVATIONS for u in frontier):
            return True
    return False


def _cat_dim(gemm: fx.Node, stored: tuple[int, int, int], hidden: int) -> int:
    """The dim of the stored [E, ., .] weights that holds I (the one the joined weight doubles): the one that is not
    H; where both are (I == H), read off how the GEMM multiplies: ``grouped_mm(x, B)`` / ``x @ B[e]`` take B as
    [k, n], ``linear`` / ``bmm(W[e], x)`` as [n, k], each transpose on the way flipping it."""
    if stored[1] != stored[2]:
        return 1 if stored[2] == hidden else 2
    arg, _ = expert_weight_arg(gemm)
    flips = 0
    for node in _viewed(arg) if isinstance(arg, fx.Node) else ():
        flips += op_name(node) in _TRANSPOSES
    n_first = op_name(gemm) in ("linear", "bmm") and (op_name(gemm) == "linear" or gemm.args[0] is arg)
    return 1 if n_first == (flips % 2 == 0) else 2


def split_gate_ups(gemms: list[fx.Node]) -> dict[fx.Node, SplitGateUp]:
    """The gate/up pairs among ``gemms`` (expert GEMMs in graph order, adapters' GEMMs left out), by gate GEMM."""
    found: dict[fx.Node, SplitGateUp] = {}
    taken: set[fx.Node] = set()
    for i, a in enumerate(gemms):
        if a in taken:
            continue
        for b in gemms[i + 1:]:
            if b in taken or not _same_rows(a, b):
                continue
            wa, wb = (tensor_of(expert_operand(g)) for g in (a, b))
            if expert_operand(a) is expert_operand(b) or wa.shape != wb.shape or wa.dtype != wb.dtype:
                continue
            below = descendants(a) & descendants(b)
            if not any(g in below for g in gemms):
                continue
            gate, up = (b, a) if _activated(b) and not _activated(a) else (a, b)
            rows = tensor_of(rows_of(a))
            found[gate] = SplitGateUp(gate, up, _cat_dim(gate, tuple(wa.shape), rows.shape[-1]))
            taken |= {a, b}
            break
    return found


def join(split: SplitGateUp) -> fx.Node:
    """Insert ``torch.cat([W_gate, W_up], dim)`` before the gate GEMM (once): the op's first weight."""
    if split.joined is None:
        split.joined = insert_call(split.gate.graph, split.gate, torch.cat, (list(split.parts()), split.dim),
                                   meta_from=split.gate)
    return split.joined


def unjoin(split: SplitGateUp) -> None:
    """Erase the joined weight again where the site was refused (the graph as it was)."""
    if split.joined is not None and not split.joined.users:
        split.joined.graph.erase_node(split.joined)
    split.joined = None
