"""A 4-bit (NF4 / FP4) weight dequantised inside the matmul's main loop: ``y = x @ W.T`` without ever
writing ``W``, the alternative to lowering/qlora.py's dequantise-into-a-buffer-then-cuBLAS.

Issue 6 asks for both, measured at Llama-3-8B shapes, the faster kept. This is the fused one, as a plain
function (not an op): ``benchmarks/ops/qlora_gemm.py`` times it against dequantise + cuBLAS. The math is
the same bit for bit up to the matmul's summation order: each weight element is formed exactly as
``dequantize_4bit`` forms it (``code[nibble] * absmax`` in fp32, rounded once to x's dtype), then
multiplied on tensor cores with fp32 accumulation (x in bf16 or fp16: an fp32 x would get TF32 products)::

    y[m, n] = sum_k x[m, k] * round(code[q(n, k)] * absmax[(n * K + k) // blocksize])      (fp32 sum)

Per K step a program loads an x tile [BLOCK_M, BLOCK_K] as its even and odd columns, the packed bytes
of a weight tile [BLOCK_N, BLOCK_K / 2], one absmax per (row, block), gathers the codes from the 16-entry
table, and makes two half-K ``tl.dot``s (even columns with the high nibbles, odd with the low). It reads the weight at half a byte an element instead of cuBLAS's two, but spends ALU and
table lookups in the main loop that cuBLAS's Hopper kernels do not. Requires ``K % blocksize == 0``
(every Llama-family projection), so each row's absmax blocks start at its first column; a last K tile
that runs past K is masked (x's padding is zero, and no absmax past the row is read).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend_choice import triton_interpreter_on
from .host_math import cdiv
from .nf4 import BLOCKSIZES, _to_output_dtype, code_table


@triton.jit
def _nf4_matmul_kernel(p_x, p_packed, p_absmax, p_code, p_y, M, N, K, stride_xm, stride_ym,
                       BLOCKSIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr):
    """y[M, N] = x[M, K] @ dequant(W)[N, K].T; programs in GROUP_M-row groups so that neighbours share
    weight tiles in L2."""
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)
    i_m = first_m + (pid % (GROUP_M * n_n)) % rows
    i_n = (pid % (GROUP_M * n_n)) // rows
    o_m = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M x K may pass 2**31 elements
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m, m_n = o_m < M, o_n < N
    o_byte = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # Byte j of a weight row's tile holds elements k0 + 2j (high nibble) and k0 + 2j + 1 (low): the tile is
        # multiplied as two half-K products, x's even columns with the high nibbles, odd with the low ones
        # (interleaving the halves back into one tile does not compile for sm_90 with Triton 3.6).
        o_even = k0 + 2 * o_byte
        m_even = o_even < K  # K is even, so an even column inside K has its odd neighbour too
        p_row = p_x + o_m[:, None] * stride_xm + o_even[None, :]
        m_x = m_m[:, None] & m_even[None, :]
        b_x_even = tl.load(p_row, mask=m_x, other=0.0)
        b_x_odd = tl.load(p_row + 1, mask=m_x, other=0.0)
        o_elem = o_n[:, None].to(tl.int64) * K + o_even[None, :]
        b_q = tl.load(p_packed + o_elem // 2, mask=m_n[:, None] & m_even[None, :], other=0).to(tl.int32)
        # One absmax per (row, block), broadcast over the block's bytes. Past K (a partial last tile) the
        # codes are masked, not the scale: those weights meet x's zero padding.
        o_block = (o_n.to(tl.int64) * K + k0) // BLOCKSIZE
        if BLOCK_K <= BLOCKSIZE:  # the tile lies in one block of each row
            b_absmax = tl.load(p_absmax + o_block, mask=m_n, other=0.0)[:, None]
        else:
            o_sub = tl.arange(0, BLOCK_K // BLOCKSIZE)
            m_sub = (k0 + o_sub * BLOCKSIZE) < K  # a partial last tile: no block past the row's end
            b_blocks = tl.load(p_absmax + o_block[:, None] + o_sub[None, :], mask=m_n[:, None] & m_sub[None, :],
                               other=0.0)
            b_spread = tl.broadcast_to(b_blocks[:, :, None], (BLOCK_N, BLOCK_K // BLOCKSIZE, BLOCKSIZE // 2))
            b_absmax = tl.reshape(b_spread, (BLOCK_N, BLOCK_K // 2))
        b_hi = _to_output_dtype(tl.load(p_code + (b_q >> 4)) * b_absmax, p_x.dtype.element_ty)
        b_lo = _to_output_dtype(tl.load(p_code + (b_q & 0xF)) * b_absmax, p_x.dtype.element_ty)
        if UPCAST:  # Triton 3.6's CPU interpreter multiplies bf16 tiles wrongly; fp32 holds them exactly
            acc = tl.dot(b_x_even.to(tl.float32), tl.trans(b_hi.to(tl.float32)), acc)
            acc = tl.dot(b_x_odd.to(tl.float32), tl.trans(b_lo.to(tl.float32)), acc)
        else:
            acc = tl.dot(b_x_even, tl.trans(b_hi), acc)
            acc = tl.dot(b_x_odd, tl.trans(b_lo), acc)
    tl.store(p_y + o_m[:, None] * stride_ym + o_n[None, :], _to_output_dtype(acc, p_y.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


# Launch settings: the benchmark sweeps CONFIGS and reports each. Measured on the H200 (4096 tokens, bf16, NF4
# block 64; benchmarks/results/2026-11-29_233625_qlora_gemm.*): the best setting (128 x 256 x 64, 8 warps)
# reaches 21.8-23.5 TFLOP/s, 3% of the bf16 peak, 30-35x slower than dequantise + cuBLAS (0.187 ms for
# q/o, 0.638 gate/up, 0.624 down: 94-104% of the measured peak, within 7-12% of cuBLAS on a weight already
# dense, the most a fused kernel could ever win). So lowering/qlora.py dequantises into a buffer and calls
# cuBLAS; this kernel stays as the measured alternative, not used by any op.
CONFIGS = (dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
           dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
           dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
           dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=2))


def nf4_matmul(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str,
               n: int, k: int, config: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T`` for a bitsandbytes 4-bit ``W [n, k]`` (``packed`` uint8, ``absmax`` fp32 one per
    block, already dequantised when nested), in x's dtype; see the module docstring."""
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"sloth.nf4_matmul: x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"sloth.nf4_matmul: x must be bfloat16 or float16 (4-bit compute dtypes), got {x.dtype}")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"sloth.nf4_matmul: blocksize must be one of {BLOCKSIZES}, got {blocksize}")
    if packed.device != x.device or absmax.device != x.device:
        raise ValueError(f"sloth.nf4_matmul: x, packed and absmax must share a device, got {x.device}, "
                         f"{packed.device}, {absmax.device}")
    if packed.dtype != torch.uint8 or packed.numel() != n * k // 2 or absmax.dtype != torch.float32:
        raise ValueError(f"sloth.nf4_matmul: want packed uint8 of {n * k // 2} bytes and float32 absmax, got "
                         f"{packed.dtype} of {packed.numel()} and {absmax.dtype}")
    if k % blocksize or absmax.numel() != n * k // blocksize:
        raise ValueError(f"sloth.nf4_matmul: K = {k} must be a multiple of the blocksize {blocksize} (and "
                         f"absmax hold {n * k // blocksize} entries, got {absmax.numel()})")
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"sloth.nf4_matmul: quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    c = dict(config or CONFIGS[0])
    if triton_interpreter_on():  # small tiles: the interpreter's cost grows with the tile
        c.update(block_m=16, block_n=16, block_k=min(c["block_k"], 2 * blocksize))
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    grid = (cdiv(x.shape[0], c["block_m"]) * cdiv(n, c["block_n"]),)
    _nf4_matmul_kernel[grid](
        x, packed.reshape(-1), absmax.reshape(-1), code_table(quant_type, x.device), y, x.shape[0], n, k,
        x.stride(0), y.stride(0), BLOCKSIZE=blocksize, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"],
        BLOCK_K=c["block_k"], GROUP_M=8, UPCAST=triton_interpreter_on(), num_warps=c["num_warps"],
        num_stages=c["num_stages"],
    )
    return y
