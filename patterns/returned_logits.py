"""Returned logits whose gradient costs nothing when nobody differentiates them.

A compiled graph is one autograd node for all its outputs, and AOTAutograd's node materialises a zero gradient
for every differentiable output the caller did not differentiate. So a model that returns its logits beside a
loss (every transformers ``*ForCausalLM``) runs, in every backward, the lm_head's input gradient on a zero
``[N, V]`` tangent: measured on the H200 at Llama-3-8B 2 x 2048, one more N x V x H matmul (4.6 ms of the
step's 6.3 ms matmul excess, 2.5 vs 5.3 ms nvjet NNT kernels) and a 1 GiB zero fill, with sloth's loss fused or
not (``benchmarks/results/2026-12-01_1144_profile-*``).

The cross-entropy pass (patterns/cross_entropy.py) therefore returns the logits detached from the graph, with
the lm_head's input x as one more graph output, and records where (``gm.meta[META_KEY]``). ``reattach`` wraps
the compiled graph: it puts each such output back into autograd through ``ReturnedLogits``, an autograd node of
its own whose gradient is not materialised, so the caller who differentiates the logits gets

    dx = g @ w,   dw = g.T @ x,   db = g.sum(0)        (g the logits' gradient, flattened to [N, V])

and the caller who does not pays nothing. ``x`` is kept for that backward (N x H, 32 MiB at the 8B shape).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

META_KEY = "sloth_returned_logits"


@dataclasses.dataclass(frozen=True)
class ReturnedLogitsSlot:
    """Output ``output`` of the graph is the detached ``x @ w.T + b``; ``x`` is output ``x_output`` (an extra one,
    stripped before the caller sees it); ``w`` and ``b`` are the graph's inputs ``w_input`` and ``b_input``."""
    output: int
    x_output: int
    w_input: int
    b_input: Optional[int]


class ReturnedLogits(torch.autograd.Function):
    """Identity on the logits in the forward; the linear's gradients in the backward, only when one arrives."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, g: Optional[torch.Tensor]):
        if g is None:
            return None, None, None, None
        x, w = ctx.saved_tensors
        g_NV = g.reshape(-1, g.shape[-1])
        dx = (g_NV @ w).view(x.shape) if ctx.needs_input_grad[1] else None
        dw = g_NV.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[2] else None
        db = g_NV.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return None, dx, dw, db


def reattach(compiled: Callable, slots: list[ReturnedLogitsSlot]) -> Callable:
    """``compiled`` with each slot's logits back in autograd and the extra outputs removed."""
    extra = sorted(slot.x_output for slot in slots)

    def run(*args: Any) -> Any:
        returned = compiled(*args)
        outputs = list(returned)
        for slot in slots:
            logits, x = outputs[slot.output], outputs[slot.x_output]
            w = args[slot.w_input]
            b = args[slot.b_input] if slot.b_input is not None else None
            if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
                outputs[slot.output] = ReturnedLogits.apply(logits, x, w, b)
        for index in reversed(extra):
            del outputs[index]
        return type(returned)(outputs) if isinstance(returned, tuple) else outputs

    return run


def reattach_returned(gm: Any, compiled: Callable) -> Callable:
    """The cross-entropy family's ``after_compile``: ``compiled`` reattached where its pass recorded slots in
    ``gm.meta[META_KEY]``, else as it is."""
    slots = gm.meta.get(META_KEY)
    return reattach(compiled, slots) if slots else compiled
