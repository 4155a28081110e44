"""Fused QLoRA linear: ``torch.ops.sloth.qlora_linear``, a bitsandbytes 4-bit (NF4 or FP4) frozen base plus
a LoRA adapter, dequantised in Triton and never keeping the dequantised weight past the call.

The op equals (``W = dequantize_4bit(packed, absmax, blocksize, quant_type, (N, K), x.dtype)``, bit for bit
bitsandbytes' dequantisation, lowering/nf4.py; with double quantisation each block's absmax is itself
dequantised from its uint8 code, ``absmax_code``, ``absmax_scale`` and ``absmax_offset``, inside the same
kernel)::

    sloth.lora_linear(x, W, bias, a, b, s)        (lowering/lora.py: the same math, forward and backward)

which is what peft computes over a ``bnb.nn.Linear4bit``: bitsandbytes' ``MatMul4Bit`` forward is its
``gemm_4bit`` op (on CUDA a fused 4-bit kernel up to 1536 rows when K is a multiple of the block size,
dequantise-then-matmul otherwise), its backward dequantises again for ``dy @ W``.

Dequantise-then-cuBLAS, not dequantisation inside the GEMM's main loop (Unsloth's choice too): at
Llama-3-8B shapes the GEMM is 0.3-0.7 ms and reading the 4-bit weight and writing its bf16 copy moves
N*K*2.5 bytes (2.5-36 us at the H200's 4.2 TB/s), so a fused 4-bit GEMM could win at most a few percent
of the op and would have to match cuBLAS's Hopper kernels to win anything. Measured on the H200 at the four
Llama-3-8B shapes (benchmarks/ops/qlora_gemm.py, results 2026-11-29_233625_qlora_gemm.*): dequantise + cuBLAS
0.049-0.638 ms, 7-12% above cuBLAS on the dense weight; the fused kernel (lowering/nf4_matmul.py) 30-35x
slower at its best launch setting. The dequantised weight is a temporary of the call: it is freed when the
call returns (the caching allocator hands the same block to the next layer), and the backward dequantises
again rather than keeping N*K*2 bytes per layer alive from forward to backward. Saved for backward: x and
h (M x r), as in lora_linear; the quantised weight and its statistics are parameters and buffers, alive
anyway.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from . import nf4
from .devices import check_one_device
from .lora import lora_backward, lora_forward
from .registration import define, fake

QUANT_TYPES = ("nf4", "fp4")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_quant_type(quant_type: str, op: str) -> None:
    """Raise, naming ``op``, for a quant type the 4-bit ops do not dequantise."""
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"{op}: quant_type must be one of {QUANT_TYPES}, got {quant_type!r}")


def dequantized_weight(packed: torch.Tensor, absmax: torch.Tensor, absmax_code: Optional[torch.Tensor],
                       absmax_scale: Optional[torch.Tensor], absmax_offset: Optional[torch.Tensor],
                       out_features: int, in_features: int, blocksize: int, quant_type: str,
                       dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] base weight in ``dtype``, bit for bit what bitsandbytes' dequantize_4bit returns."""
    check_quant_type(quant_type, "sloth.qlora_linear")
    nested = absmax_code is not None
    if nested != (absmax_scale is not None) or nested != (absmax_offset is not None):
        raise ValueError("sloth.qlora_linear: absmax_code, absmax_scale and absmax_offset come together "
                         "(double quantisation) or not at all")
    if nested:  # one launch: each block's absmax is dequantised where the weight kernel reads it
        return nf4.dequantize_4bit_nested(packed, absmax, absmax_scale, absmax_code, absmax_offset, blocksize,
                                          quant_type, (out_features, in_features), dtype)
    return nf4.dequantize_4bit(packed, absmax, blocksize, quant_type, (out_features, in_features), dtype)


def _check_x_and_devices(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                         absmax_code: Optional[torch.Tensor], absmax_scale: Optional[torch.Tensor],
                         bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> None:
    """What the dequantisation would otherwise report under another name: x's dtype (the weight's dtype there)
    and x's device (the dequantised weight's). ``absmax_offset`` may be anywhere: nf4 moves it (a scalar)."""
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"sloth.qlora_linear: x must be float32, bfloat16 or float16, got {x.dtype}")
    check_one_device("sloth.qlora_linear", ("x", x), ("packed", packed), ("absmax", absmax),
                     ("absmax_code", absmax_code), ("absmax_scale", absmax_scale), ("bias", bias), ("a", a), ("b", b))


def _qlora_fwd(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, absmax_code: Optional[torch.Tensor],
               absmax_scale: Optional[torch.Tensor], absmax_offset: Optional[torch.Tensor], out_features: int,
               in_features: int, blocksize: int, quant_type: str, bias: Optional[torch.Tensor], a: torch.Tensor,
               b: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_x_and_devices(x, packed, absmax, absmax_code, absmax_scale, bias, a, b)
    w = dequantized_weight(packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features, in_features,
                           blocksize, quant_type, x.dtype)
    return lora_forward(x, w, bias, a, b, scale)


def _qlora_bwd(dy: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
               absmax_code: Optional[torch.Tensor], absmax_scale: Optional[torch.Tensor],
               absmax_offset: Optional[torch.Tensor], out_features: int, in_features: int, blocksize: int,
               quant_type: str, a: torch.Tensor, b: torch.Tensor, h: Optional[torch.Tensor], scale: float,
               need_dx: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Without dx (the first adapted layer of a frozen embedding), the weight is not needed at all.
    w = dequantized_weight(packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features, in_features,
                           blocksize, quant_type, x.dtype) if need_dx else x.new_empty(0)
    return lora_backward(dy, x, w, a, b, h, scale, need_dx)


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

_ARGS = ("x", "packed", "absmax", "absmax_code", "absmax_scale", "absmax_offset", "out_features", "in_features",
         "blocksize", "quant_type", "bias", "a", "b", "scale")


def _setup_context(ctx, inputs, output) -> None:
    args = dict(zip(_ARGS, inputs))
    ctx.save_for_backward(args["x"], args["packed"], args["absmax"], args["absmax_code"], args["absmax_scale"],
                          args["absmax_offset"], args["a"], args["b"], output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.static = tuple(args[k] for k in ("out_features", "in_features", "blocksize", "quant_type", "scale"))


def _backward(ctx, dy, _dh):
    x, packed, absmax, code, absmax_scale, offset, a, b, h = ctx.saved_tensors
    n, k, blocksize, quant_type, scale = ctx.static
    needs = dict(zip(_ARGS, ctx.needs_input_grad))
    if needs["bias"]:
        raise RuntimeError("sloth.qlora_linear: the bias must be frozen (requires_grad=False); the op computes "
                           "no gradient for it")
    dx, da, db = torch.ops.sloth.qlora_linear_backward(dy, x, packed, absmax, code, absmax_scale, offset, n, k,
                                                       blocksize, quant_type, a, b, h, scale, needs["x"])
    grads = {"x": dx if needs["x"] else None, "a": da if needs["a"] else None, "b": db if needs["b"] else None}
    return tuple(grads.get(name) for name in _ARGS)


@functools.cache
def register() -> None:
    """Define ``sloth::qlora_linear`` and ``sloth::qlora_linear_backward`` (idempotent)."""
    fwd = define("sloth::qlora_linear", _qlora_fwd)
    bwd = define("sloth::qlora_linear_backward", _qlora_bwd)

    @fake(fwd)
    def _(x, packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features, in_features, blocksize,
          quant_type, bias, a, b, scale):
        _check_x_and_devices(x, packed, absmax, absmax_code, absmax_scale, bias, a, b)  # meta inputs: devices.py
        rows = math.prod(x.shape[:-1])
        return x.new_empty((*x.shape[:-1], out_features)), x.new_empty((rows, a.shape[0]), dtype=torch.float32)

    @fake(bwd)
    def _(dy, x, packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features, in_features, blocksize,
          quant_type, a, b, h, scale, need_dx):
        return (x.new_empty(x.shape) if need_dx else x.new_empty(0)), a.new_empty(a.shape), b.new_empty(b.shape)

    fwd.register_autograd(_backward, setup_context=_setup_context)


def qlora_linear(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, out_features: int, in_features: int,
                 blocksize: int, quant_type: str, bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor,
                 scale: float, absmax_code: Optional[torch.Tensor] = None, absmax_scale: Optional[torch.Tensor] = None,
                 absmax_offset: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``lora_linear(x, W, bias, a, b, scale)`` with ``W`` the bitsandbytes 4-bit weight dequantised on the fly;
    ``absmax_code``, ``absmax_scale``, ``absmax_offset`` given for double quantisation (a nested QuantState's
    ``state2.code``, ``state2.absmax`` and ``offset``; ``absmax`` is then its uint8 ``absmax``)."""
    register()
    y, _ = torch.ops.sloth.qlora_linear(x, packed, absmax, absmax_code, absmax_scale, absmax_offset, int(out_features),
                                        int(in_features), int(blocksize), quant_type, bias, a, b, float(scale))
    return y
