"""Sites cut apart by a graph boundary: reported at the half a graph returns, since no anchor sees either half.

A graph break, or Dynamo's DDP optimizer splitting the graph at gradient-bucket boundaries (sloth is then called
once per piece), can fall inside a pattern. Two cuts leave no anchor in either graph (compiler/anchors.py):

    glu   act(gate) returned to the next graph, which multiplies it by up: the activation's one user is the output
    lora  an adapter's down-projection A(x) returned to the next graph, which applies B and adds it to the base:
          a linear with a trained weight of rank r below its input width, whose input a wider linear with a frozen
          weight also reads (the base), and whose one user is the output (a frozen router's logits are no adapter)

Such a half is reported under its family with the reason, so that no site a family looks for is silently
lost. (A cut between an adapter and its base linear is the LoRA family's own rejection: patterns/lora.py.)
Measured: a 4-layer Llama with r = 64 adapters under DDP with 1 MB buckets on the CPU was split into two
pieces through layer 1's MLP, its GLU and its up-projection's adapter cut this way.
"""
from __future__ import annotations

from typing import Iterator

import torch.fx as fx
import torch.nn.functional as F

from .fx_utils import is_call, linear_parts, matrix_width, tensor_of

_WHERE = ("(a graph break, or DDP's split at a gradient bucket: torch._dynamo.config.optimize_ddp = False keeps "
          "one graph), so neither graph holds the whole pattern")
GLU_CUT = f"cut apart by a graph boundary: the activation is returned to another graph that multiplies it {_WHERE}"
LORA_CUT = (f"cut apart by a graph boundary: the adapter's down-projection A(x) is returned to another graph that "
            f"applies B and adds it to the base {_WHERE}")


def _only_returned(node: fx.Node) -> bool:
    return len(node.users) == 1 and next(iter(node.users)).op == "output"


def _trained(weight: object) -> bool:
    t = tensor_of(weight)
    return t is not None and t.requires_grad


def _is_adapter_down_projection(node: fx.Node, linears: list[tuple[fx.Node, tuple]]) -> bool:
    parts = linear_parts(node)
    if parts is None:
        return False
    x, w, _ = parts
    rank, width_in = matrix_width(w, 0), matrix_width(w, 1)
    if not (isinstance(rank, int) and isinstance(width_in, int) and rank < width_in and _trained(w)):
        return False
    source = x.args[0] if is_call(x, F.dropout) else x  # peft reads dropout(x) (identity when p = 0)
    for other, (ox, ow, _) in linears:
        if other is not node and (ox is source or ox is x) and not _trained(ow):
            out = matrix_width(ow, 0)
            if isinstance(out, int) and out > rank:
                return True
    return False


def cut_sites(gm: fx.GraphModule) -> Iterator[tuple[str, fx.Node, str]]:
    """(family, node, reason) for each half of a cut pattern ``gm`` returns (module docstring)."""
    from ..patterns.glu import is_gate_activation  # the glu family's predicate; patterns import compiler modules

    linears = [(n, parts) for n in gm.graph.nodes if (parts := linear_parts(n)) is not None]
    for node in gm.graph.nodes:
        if node.op != "call_function" or not _only_returned(node):
            continue
        if is_gate_activation(node):
            yield "glu", node, GLU_CUT
        elif _is_adapter_down_projection(node, linears):
            yield "lora", node, LORA_CUT
