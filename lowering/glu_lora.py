"""A LoRA down projection fused with the gated activation that feeds it: ``torch.ops.sloth.glu_lora_linear``.

The op equals, in one line of PyTorch (see lowering/glu.py and lowering/lora.py for each half)::

    sloth.lora_linear(sloth.glu(gate, up, activation), w, bias, a, b, s)

(and ``sloth::glu_qlora_linear`` the same over a bitsandbytes 4-bit base, lowering/qlora.py), and exists
for what it does not save. In a LoRA MLP the down projection's adapter needs its input
``hidden = act(gate) * up`` in the backward (``da = s * (dy @ b).T @ hidden``), so the two ops side by side
keep ``gate`` and ``up`` (for the GLU's backward) and ``hidden`` too: one more tokens x intermediate
tensor per layer (112 MiB at 4096 tokens x 14336 in bf16; 3.5 GiB over Llama-3-8B's 32 layers). This op
saves ``gate`` and ``up`` only and recomputes ``hidden`` in the backward, one elementwise pass that reads
gate and up and writes hidden (Unsloth's LoRA MLP makes the same trade).

    forward   hidden = glu(gate, up);  y, h = lora_linear(hidden, ...)      hidden freed on return
    backward  d_hidden = dy @ w + s * (dy @ b) @ a
              d_gate, d_up = glu_backward(d_hidden, gate, up);  hidden = glu(gate, up) written over d_hidden
              da = s * (dy @ b).T @ hidden,  db = s * dy.T @ h

The GLU's backward reads gate and up anyway, so it writes the recomputed hidden in the same pass, into
d_hidden's memory once it has read it: no pass of its own for the recompute (which read gate and up again
and wrote hidden: 2 x 112 MiB read a layer at Llama-3-8B's shape) and no extra buffer.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .backend_choice import use_triton
from .devices import check_one_device
from .glu import glu_backward_impl, glu_forward
from .layout import rows_2d
from .lora import adapter_activation, lora_adapter_grads, lora_backward, lora_backward_dx, lora_forward
from .qlora import dequantized_weight
from .registration import define, fake

# The backward's hidden written by the GLU's backward over d_hidden (the default) instead of recomputed by a
# GLU forward pass of its own: per layer one launch and a read of gate and up (2 x tokens x intermediate)
# fewer. False keeps the recompute, for measuring the two on one machine (benchmarks/variants.py).
FUSED_HIDDEN = True


def _glu_lora_fwd(gate: torch.Tensor, up: Optional[torch.Tensor], activation: str, w: torch.Tensor,
                  bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return lora_forward(glu_forward(gate, up, activation), w, bias, a, b, scale)


def _glu_lora_bwd(dy: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor], activation: str,
                  w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, h: Optional[torch.Tensor], scale: float,
                  grad_dtype: Optional[torch.dtype] = None, in_place: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_gate, d_up, da, db); d_up is empty when ``up`` is None (gate is then the merged projection); da and db
    in ``grad_dtype`` when given (lowering/tiled_mlp.py sums them over row blocks in fp32). ``in_place``:
    d_gate and d_up are written over gate and up (glu_backward_impl's ``in_place``). ``h`` None: recomputed
    from the hidden the backward forms anyway (compiler/lean_backward.py says when)."""
    if not use_triton(gate) or not FUSED_HIDDEN:
        hidden = glu_forward(gate, up, activation)
        d_hidden, da, db = lora_backward(dy, hidden, w, a, b, h, scale, True, grad_dtype)
        del hidden
        d_gate, d_up = glu_backward_impl(d_hidden, gate, up, activation, in_place=in_place)
        return d_gate, d_up, da, db
    # da needs hidden; d_gate and d_up need d_hidden, which needs only dy. So d_hidden first, then the GLU's
    # backward writes hidden over d_hidden in the pass that reads gate and up anyway, then da and db.
    dy_MN = rows_2d(dy)
    d_hidden, g_MR = lora_backward_dx(dy_MN, w, a, b, scale)
    d_gate, d_up = glu_backward_impl(d_hidden.view(*gate.shape[:-1], d_hidden.shape[-1]), gate, up, activation,
                                     y_over_dy=True, in_place=in_place)
    if h is None:  # d_hidden now holds hidden, bit for bit the forward's, so h is the forward's too
        h = adapter_activation(d_hidden, a)
    da, db = lora_adapter_grads(g_MR, d_hidden, h, dy_MN, a, b, scale, grad_dtype)
    return d_gate, d_up, da, db


def _glu_lora_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor], activation: str,
                     w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, h: Optional[torch.Tensor], scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The functional backward op's function: _glu_lora_bwd, out of place."""
    return _glu_lora_bwd(dy, gate, up, activation, w, a, b, h, scale)


def _glu_qlora_fwd(gate: torch.Tensor, up: Optional[torch.Tensor], activation: str, packed: torch.Tensor,
                   absmax: torch.Tensor, absmax_code: Optional[torch.Tensor], absmax_scale: Optional[torch.Tensor],
                   absmax_offset: Optional[torch.Tensor], out_features: int, in_features: int, blocksize: int,
                   quant_type: str, bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    w = dequantized_weight(packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features, in_features,
                           blocksize, quant_type, gate.dtype)
    return _glu_lora_fwd(gate, up, activation, w, bias, a, b, scale)


def _glu_qlora_bwd(dy: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor], activation: str,
                   packed: torch.Tensor, absmax: torch.Tensor, absmax_code: Optional[torch.Tensor],
                   absmax_scale: Optional[torch.Tensor], absmax_offset: Optional[torch.Tensor], out_features: int,
                   in_features: int, blocksize: int, quant_type: str, a: torch.Tensor, b: torch.Tensor,
                   h: Optional[torch.Tensor], scale: float, in_place: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    w = dequantized_weight(packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features, in_features,
                           blocksize, quant_type, gate.dtype)
    return _glu_lora_bwd(dy, gate, up, activation, w, a, b, h, scale, in_place=in_place)


def _glu_qlora_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor], activation: str,
                      packed: torch.Tensor, absmax: torch.Tensor, absmax_code: Optional[torch.Tensor],
                      absmax_scale: Optional[torch.Tensor], absmax_offset: Optional[torch.Tensor], out_features: int,
                      in_features: int, blocksize: int, quant_type: str, a: torch.Tensor, b: torch.Tensor,
                      h: Optional[torch.Tensor], scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The functional 4-bit backward op's function: _glu_qlora_bwd, out of place."""
    return _glu_qlora_bwd(dy, gate, up, activation, packed, absmax, absmax_code, absmax_scale, absmax_offset,
                          out_features, in_features, blocksize, quant_type, a, b, h, scale)


# The backwards in place: d_gate and d_up written over gate and up, only (da, db) returned. No autograd (they
# are backward ops); compiler/lean_backward.py puts them in a compiled backward where nothing reads gate
# and up after the backward op, and this op's output tensors are then gate and up themselves.
def _glu_lora_bwd_inplace(dy: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor], activation: str,
                          w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, h: Optional[torch.Tensor],
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _glu_lora_bwd(dy, gate, up, activation, w, a, b, h, scale, in_place=True)[2:]


def _glu_qlora_bwd_inplace(dy: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor], activation: str,
                           packed: torch.Tensor, absmax: torch.Tensor, absmax_code: Optional[torch.Tensor],
                           absmax_scale: Optional[torch.Tensor], absmax_offset: Optional[torch.Tensor],
                           out_features: int, in_features: int, blocksize: int, quant_type: str, a: torch.Tensor,
                           b: torch.Tensor, h: Optional[torch.Tensor], scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    return _glu_qlora_bwd(dy, gate, up, activation, packed, absmax, absmax_code, absmax_scale, absmax_offset,
                          out_features, in_features, blocksize, quant_type, a, b, h, scale, in_place=True)[2:]


def _setup_context(ctx, inputs, output) -> None:
    gate, up, activation, w, bias, a, b, scale = inputs
    ctx.save_for_backward(gate, up, w, a, b, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.activation, ctx.scale = activation, scale


def _backward(ctx, dy, _dh):
    gate, up, w, a, b, h = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if needs[3] or needs[4]:
        raise RuntimeError("sloth.glu_lora_linear: the base weight and bias must be frozen (requires_grad=False)")
    d_gate, d_up, da, db = torch.ops.sloth.glu_lora_linear_backward(dy, gate, up, ctx.activation, w, a, b, h,
                                                                    ctx.scale)
    return (d_gate if needs[0] else None, d_up if up is not None and needs[1] else None, None, None, None,
            da if needs[5] else None, db if needs[6] else None, None)


@functools.cache
def register() -> None:
    """Define ``sloth::glu_lora_linear`` and its backward (idempotent)."""
    fwd = define("sloth::glu_lora_linear", _glu_lora_fwd)
    bwd = define("sloth::glu_lora_linear_backward", _glu_lora_bwd_op)

    @fake(fwd)
    def _(gate, up, activation, w, bias, a, b, scale):
        # A call with a meta input runs this, not the op and its checks (lowering/devices.py).
        check_one_device("sloth.glu_lora_linear", ("gate", gate), ("up", up), ("w", w), ("bias", bias), ("a", a),
                         ("b", b))
        rows = math.prod(gate.shape[:-1])
        return gate.new_empty((*gate.shape[:-1], w.shape[0])), gate.new_empty((rows, a.shape[0]), dtype=torch.float32)

    @fake(bwd)
    def _(dy, gate, up, activation, w, a, b, h, scale):
        return (gate.new_empty(gate.shape), up.new_empty(up.shape) if up is not None else gate.new_empty(0),
                a.new_empty(a.shape), b.new_empty(b.shape))

    fwd.register_autograd(_backward, setup_context=_setup_context)
    inplace = define("sloth::glu_lora_linear_backward_inplace", _glu_lora_bwd_inplace, mutates_args=("gate", "up"))

    @fake(inplace)
    def _(dy, gate, up, activation, w, a, b, h, scale):
        return a.new_empty(a.shape), b.new_empty(b.shape)


_QLORA_ARGS = ("gate", "up", "activation", "packed", "absmax", "absmax_code", "absmax_scale", "absmax_offset",
               "out_features", "in_features", "blocksize", "quant_type", "bias", "a", "b", "scale")


def _setup_context_4bit(ctx, inputs, output) -> None:
    args = dict(zip(_QLORA_ARGS, inputs))
    ctx.save_for_backward(args["gate"], args["up"], args["packed"], args["absmax"], args["absmax_code"],
                          args["absmax_scale"], args["absmax_offset"], args["a"], args["b"], output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.static = (args["activation"], args["out_features"], args["in_features"], args["blocksize"],
                  args["quant_type"], args["scale"])


def _backward_4bit(ctx, dy, _dh):
    gate, up, packed, absmax, code, absmax_scale, offset, a, b, h = ctx.saved_tensors
    activation, n, k, blocksize, quant_type, scale = ctx.static
    needs = dict(zip(_QLORA_ARGS, ctx.needs_input_grad))
    if needs["bias"]:
        raise RuntimeError("sloth.glu_qlora_linear: the bias must be frozen (requires_grad=False)")
    d_gate, d_up, da, db = torch.ops.sloth.glu_qlora_linear_backward(
        dy, gate, up, activation, packed, absmax, code, absmax_scale, offset, n, k, blocksize, quant_type, a, b, h,
        scale)
    grads = {"gate": d_gate if needs["gate"] else None, "up": d_up if up is not None and needs["up"] else None,
             "a": da if needs["a"] else None, "b": db if needs["b"] else None}
    return tuple(grads.get(name) for name in _QLORA_ARGS)


@functools.cache
def register_4bit() -> None:
    """Define ``sloth::glu_qlora_linear`` and its backward (idempotent)."""
    fwd = define("sloth::glu_qlora_linear", _glu_qlora_fwd)
    bwd = define("sloth::glu_qlora_linear_backward", _glu_qlora_bwd_op)

    @fake(fwd)
    def _(gate, up, activation, packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features,
          in_features, blocksize, quant_type, bias, a, b, scale):
        # A call with a meta input runs this, not the op and its checks (lowering/devices.py).
        check_one_device("sloth.glu_qlora_linear", ("gate", gate), ("up", up), ("packed", packed), ("absmax", absmax),
                         ("absmax_code", absmax_code), ("absmax_scale", absmax_scale),
                         ("absmax_offset", absmax_offset), ("bias", bias), ("a", a), ("b", b))
        rows = math.prod(gate.shape[:-1])
        return gate.new_empty((*gate.shape[:-1], out_features)), gate.new_empty((rows, a.shape[0]),
                                                                                dtype=torch.float32)

    @fake(bwd)
    def _(dy, gate, up, activation, packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features,
          in_features, blocksize, quant_type, a, b, h, scale):
        return (gate.new_empty(gate.shape), up.new_empty(up.shape) if up is not None else gate.new_empty(0),
                a.new_empty(a.shape), b.new_empty(b.shape))

    fwd.register_autograd(_backward_4bit, setup_context=_setup_context_4bit)
    inplace = define("sloth::glu_qlora_linear_backward_inplace", _glu_qlora_bwd_inplace,
                     mutates_args=("gate", "up"))

    @fake(inplace)
    def _(dy, gate, up, activation, packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features,
          in_features, blocksize, quant_type, a, b, h, scale):
        return a.new_empty(a.shape), b.new_empty(b.shape)


def glu_lora_linear(gate: torch.Tensor, up: Optional[torch.Tensor], activation: str, w: torch.Tensor,
                    bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``lora_linear(glu(gate, up, activation), w, bias, a, b, scale)`` without saving the GLU's output."""
    register()
    y, _ = torch.ops.sloth.glu_lora_linear(gate, up, activation, w, bias, a, b, float(scale))
    return y
