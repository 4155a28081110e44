"""Rounding a kernel's fp32 result to its output dtype, the same way on a GPU and in Triton's CPU interpreter.

Every sloth kernel computes in fp32 and rounds once, at the store. On a GPU ``x.to(tl.bfloat16)`` rounds
to nearest even; Triton 3.6's CPU interpreter truncates instead (seen in every bf16 test: errors about
twice the GPU's, enough to push correct kernels past the tests' 2x-of-eager rule). ``round_to`` keeps the
GPU's native conversion and, only when the kernels were defined for the interpreter, rounds bf16 with
integer operations (add half an ulp and the tie-breaking bit, then drop the low 16 bits), which gives the
bits ``cvt.rn.bf16.f32`` gives for every finite input and for infinities; NaN stays NaN.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .backend_choice import triton_interpreter_on

INTERPRETED = tl.constexpr(triton_interpreter_on())


@triton.jit
def round_to(b_x, DTYPE: tl.constexpr):
    """fp32 (or narrower) block -> DTYPE, rounded to nearest even."""
    if INTERPRETED and DTYPE == tl.bfloat16:
        b_x = b_x.to(tl.float32)
        b_bits = b_x.to(tl.uint32, bitcast=True)
        b_bits = b_bits + 0x7FFF + ((b_bits >> 16) & 1)
        b_rounded = (b_bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(b_x != b_x, b_x.to(DTYPE), b_rounded)
    else:
        return b_x.to(DTYPE)


@triton.jit
def mul_rounded(b_a, b_b):
    """fp32 ``a * b`` rounded on its own, never contracted into an FMA with the add or subtract that reads it: PTX
    ``mul.rn.f32`` (an explicit rounding mode, which the PTX optimiser never fuses) on a GPU; numpy, which never
    fuses, in the interpreter. For a product that is both summed and subtracted from that sum (a row's mean), where
    an FMA would subtract the rounded sum from the unrounded product and leave its roundoff, times what follows."""
    if INTERPRETED:
        return b_a * b_b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [b_a, b_b], dtype=tl.float32, is_pure=True,
                                     pack=1)
