"""Fused LoRA linear: ``torch.ops.sloth.lora_linear``, a frozen base plus a low-rank adapter, with a
manual backward that never forms ``W + s * B @ A``.

The op equals, in one line of PyTorch (``x`` [..., K]; frozen ``w`` [N, K] and ``bias`` [N] in x's dtype;
adapter ``a`` [r, K] and ``b`` [N, r] in the adapter dtype, float32 as peft keeps them or x's dtype;
``s`` the scaling)::

    y = (F.linear(x, w, bias).float() + s * F.linear(F.linear(x.float(), a.float()), b.float())).to(x.dtype)

which is peft's LoRA forward (``base_layer(x) + lora_B(lora_A(x.to(A.dtype))) * scaling``, cast back):
the base output is rounded to x's dtype once, the adapter path is fp32 end to end, and the sum is rounded
once. With a bf16 adapter eager rounds after each adapter matmul; the op does not, so it is at least as
accurate.

Why an op and not Inductor: peft keeps the adapter in fp32, so eager and Inductor run the adapter's
matmuls as fp32 cuBLAS GEMMs without tensor cores (measured on the H200: 17% of a Llama-3-8B LoRA
step's GPU time, benchmarks/results/2026-11-29_1446_profile-inductor-L4.txt), plus an fp32 copy of
every adapted input. Here the adapter matmuls are three small Triton kernels that read the 16-bit
activations as they are and multiply with fp32 accuracy on tensor cores: with bf16 activations each
fp32 adapter factor is split into three bf16 parts whose sum is exact (8 + 8 + 8 significand bits), so
bf16 products with fp32 accumulation reproduce the fp32 products; with fp32 or fp16 activations both
operands go through ``tf32x3`` (each split into a TF32 high and low part, three products); a bf16
adapter on bf16 activations needs neither. The adapter's
output is added into the base GEMM's output in place.

With ``x2 = x.reshape(M, K)``, ``h = x2 @ a.T`` ([M, r], fp32, saved for backward)::

    forward   y2  = base + s * h @ b.T                  base = x2 @ w.T + bias (cuBLAS, x's dtype)
    backward  g   = dy2 @ b                 [M, r]      (dy2 = dy.reshape(M, N))
              dx  = dy2 @ w + s * g @ a     [M, K]      (cuBLAS for dy2 @ w, then added in place)
              da  = s * g.T @ x2            [r, K]
              db  = s * dy2.T @ h           [N, r]      (computed as (s * h.T @ dy2).T)

Derivation: y2 = x2 w^T + s (x2 a^T) b^T, so dy2 flows to x2 through w and through s a^T b^T
(dx = dy2 w + s dy2 b a), to b through s h (db = s dy2^T h) and to a through s x2 (da = s (dy2 b)^T x2).
Nothing of size K x N beyond w is formed; saved for backward are x (which the graph keeps anyway) and
h (M x r). The base weight and bias get no gradient: the op is for frozen bases (the pattern refuses a
trainable one).

Memory traffic per call (e = x's bytes per element, the roofline of the adapter part): forward reads
x (M K e) for h, and base and writes y (2 M N e); backward reads dy twice (g, db), x once (da), and
dx's base part, which it writes back (2 M K e).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend_choice import triton_interpreter_on, use_triton
from .devices import check_one_device
from .host_math import cdiv, next_power_of_2
from .layout import rows_2d
from .registration import define, fake
from .rounding import round_to

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# How a tile product of a 16-bit activation tile and an fp32 adapter tile is formed (a constexpr):
_NATIVE = tl.constexpr(0)  # both operands in one 16-bit dtype: one tensor-core dot, fp32 accumulate
_SPLIT_BF16 = tl.constexpr(1)  # bf16 activations, fp32 factor: the factor split into 3 bf16 parts
_TF32X3 = tl.constexpr(2)  # anything else (fp32 or fp16 activations): both as fp32, tf32x3


@triton.jit
def _split_bf16(b_v):
    """fp32 -> three bf16 tiles whose fp32 sum is exactly ``b_v`` (8 + 8 + 8 significand bits; each
    residual is exact in fp32). With bf16 activations, three bf16 dots then give fp32-exact products."""
    b_hi = b_v.to(tl.bfloat16)
    b_rest = b_v - b_hi.to(tl.float32)
    b_mid = b_rest.to(tl.bfloat16)
    b_lo = (b_rest - b_mid.to(tl.float32)).to(tl.bfloat16)
    return b_hi, b_mid, b_lo


@triton.jit
def _dot16(b_a, b_b, acc, UPCAST: tl.constexpr):
    """acc + b_a @ b_b for 16-bit tiles; with UPCAST the tiles go to fp32 first (the same value: 16-bit
    products are exact in fp32), because Triton 3.6's CPU interpreter multiplies bf16 tiles wrongly."""
    if UPCAST:
        return tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), acc)
    return tl.dot(b_a, b_b, acc)


@triton.jit
def _dot_fp32_exact(b_act, b_fac, acc, MODE: tl.constexpr, FACTOR_LEFT: tl.constexpr, UPCAST: tl.constexpr):
    """acc + b_act @ b_fac (or b_fac @ b_act when FACTOR_LEFT), with products as exact as fp32 FMA:
    ``b_act`` a 16-bit (or fp32) activation tile, ``b_fac`` an fp32 (or 16-bit) adapter tile.

    _SPLIT_BF16 forms the tile's product on its own, from zero, the small parts first (lo, mid, then hi on them),
    and adds it to ``acc`` with one fp32 add, as Triton's tf32x3 lowering does with its small products. Chained
    onto ``acc`` (hi, mid, lo), the mid and lo dots' products, 2^-8 and 2^-16 of hi's, met a running sum of the
    whole K so far inside the tensor core, which aligns every product to the sum's exponent and truncates it
    (no IEEE rounding; Fasi et al. 2021, Khattak and Mikaitis 2025): da came out at 4.5x eager's error on an
    H100 (bf16 x, fp32 adapter, M = 257), reproduced to 1% by a model of that accumulator, which gives this
    form 0.8x (tests/test_lora_op.py). The sum stays a separate fp32 add: Triton's combine pass folds
    ``acc + dot(a, b, 0)`` back into ``dot(a, b, acc)``, not ``acc + dot(a, b, t)`` with t from the chain."""
    if MODE == _NATIVE:
        if FACTOR_LEFT:
            acc = _dot16(b_fac.to(b_act.dtype), b_act, acc, UPCAST)
        else:
            acc = _dot16(b_act, b_fac.to(b_act.dtype), acc, UPCAST)
    elif MODE == _SPLIT_BF16:
        b_hi, b_mid, b_lo = _split_bf16(b_fac.to(tl.float32))
        b_a = b_act.to(tl.bfloat16)
        b_tile = tl.zeros_like(acc)
        if FACTOR_LEFT:
            b_tile = _dot16(b_lo, b_a, b_tile, UPCAST)
            b_tile = _dot16(b_mid, b_a, b_tile, UPCAST)
            b_tile = _dot16(b_hi, b_a, b_tile, UPCAST)
        else:
            b_tile = _dot16(b_a, b_lo, b_tile, UPCAST)
            b_tile = _dot16(b_a, b_mid, b_tile, UPCAST)
            b_tile = _dot16(b_a, b_hi, b_tile, UPCAST)
        acc = acc + b_tile
    else:
        if FACTOR_LEFT:
            acc = tl.dot(b_fac.to(tl.float32), b_act.to(tl.float32), acc, input_precision="tf32x3")
        else:
            acc = tl.dot(b_act.to(tl.float32), b_fac.to(tl.float32), acc, input_precision="tf32x3")
    return acc


@triton.jit
def _split_tile(i_k, p_p, p_out, K, R, stride_pk, stride_pr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[rows of block i_k, 4 * BLOCK_R] (bf16) = [hi | mid | lo | 0] of the fp32 factor p[K, R]
    (``_split_bf16``), the columns past R zero: the down kernel then multiplies by all three parts in one dot."""
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    o_r = tl.arange(0, BLOCK_R)
    m_k = o_k < K
    b_p = tl.load(p_p + o_k[:, None] * stride_pk + o_r[None, :] * stride_pr, mask=m_k[:, None] & (o_r < R)[None, :],
                  other=0.0).to(tl.float32)
    b_hi, b_mid, b_lo = _split_bf16(b_p)
    p_row = p_out + o_k[:, None] * (4 * BLOCK_R) + o_r[None, :]
    tl.store(p_row, b_hi, mask=m_k[:, None])
    tl.store(p_row + BLOCK_R, b_mid, mask=m_k[:, None])
    tl.store(p_row + 2 * BLOCK_R, b_lo, mask=m_k[:, None])
    tl.store(p_row + 3 * BLOCK_R, tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.bfloat16), mask=m_k[:, None])


@triton.jit
def _split_factor_kernel(p_p, p_out, K, R, stride_pk, stride_pr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[K, 4 * BLOCK_R] = the bf16 split of p[K, R] (``_split_tile``), one program per BLOCK_K rows."""
    _split_tile(tl.program_id(0), p_p, p_out, K, R, stride_pk, stride_pr, BLOCK_K, BLOCK_R)


@triton.jit
def _down_tile(i_m, p_x, p_p, p_h, M, K, R, stride_xm, stride_pk, stride_pr, stride_hm,
               MODE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_R: tl.constexpr):
    """h[BLOCK_M rows of block i_m, R] (fp32, rows stride_hm apart) = x[rows, K] @ p[K, R], the whole K looped
    over. With MODE _SPLIT_BF16, p is the [K, 4 * BLOCK_R] output of ``_split_factor_kernel`` (its row stride
    4 * BLOCK_R; stride_pk and stride_pr unused): one dot against all three parts, whose column groups are
    summed at the end (p's split is done once per call, not once per program)."""
    o_b = tl.arange(0, BLOCK_M)  # rows within the block
    o_m = i_m * BLOCK_M + o_b
    o_r = tl.arange(0, BLOCK_R)
    m_m, m_r = o_m < M, o_r < R
    p_x = p_x + (i_m * BLOCK_M).to(tl.int64) * stride_xm  # the block in 64 bits, as _up_add_rows does
    if MODE == _SPLIT_BF16:
        o_c = tl.arange(0, 4 * BLOCK_R)
        b_acc = tl.zeros((BLOCK_M, 4 * BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < K
            b_x = tl.load(p_x + o_b[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                          other=0.0)
            b_p = tl.load(p_p + o_k[:, None] * (4 * BLOCK_R) + o_c[None, :], mask=m_k[:, None], other=0.0)
            b_acc = _dot16(b_x.to(tl.bfloat16), b_p, b_acc, UPCAST)
        b_h = tl.sum(tl.reshape(b_acc, (BLOCK_M, 4, BLOCK_R)), axis=1)
    else:
        b_h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < K
            b_x = tl.load(p_x + o_b[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                          other=0.0)
            b_p = tl.load(p_p + o_k[:, None] * stride_pk + o_r[None, :] * stride_pr,
                          mask=m_k[:, None] & m_r[None, :], other=0.0)
            b_h = _dot_fp32_exact(b_x, b_p, b_h, MODE, False, UPCAST)
    tl.store(p_h + o_m[:, None] * stride_hm + o_r[None, :], b_h, mask=m_m[:, None] & m_r[None, :])


@triton.jit
def _lora_down_kernel(p_x, p_p, p_h, M, K, R, stride_xm, stride_pk, stride_pr, stride_hm,
                      MODE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    """h[M, R] = x[M, K] @ p[K, R] (``_down_tile``): one program per BLOCK_M rows."""
    _down_tile(tl.program_id(0), p_x, p_p, p_h, M, K, R, stride_xm, stride_pk, stride_pr, stride_hm, MODE, UPCAST,
               BLOCK_M, BLOCK_K, BLOCK_R)


@triton.jit
def _up_add_rows(i_m, i_g, p_y, p_h, p_q, M, N, R, stride_ym, stride_hm, stride_qr, stride_qn, scale, cols_per_group,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[rows of block i_m, columns of group i_g] += scale * h[rows, R] @ q[R, columns] in place, summed in fp32
    and rounded once to y's dtype, one BLOCK_N-column tile at a time (group i_g: columns i_g * cols_per_group
    to the next group's). h's rows are loaded once for the group, and the loop lets the next tile's loads run
    while this tile is stored (num_stages). Both factors are fp32 (h always, q as the adapter), so the tile
    product is tf32x3; K = R is tiny, the tile is bound by reading and writing y."""
    o_b = tl.arange(0, BLOCK_M)  # rows within the block
    o_m = i_m * BLOCK_M + o_b
    o_r = tl.arange(0, BLOCK_R)
    m_m, m_r = o_m < M, o_r < R
    b_h = tl.load(p_h + o_m[:, None] * stride_hm + o_r[None, :], mask=m_m[:, None] & m_r[None, :], other=0.0)
    # y's block in 64 bits (M * N passes 2^31 past ~150k rows of 14336), the offsets inside it in 32
    p_y = p_y + (i_m * BLOCK_M).to(tl.int64) * stride_ym
    col_start = i_g * cols_per_group
    col_stop = tl.minimum(col_start + cols_per_group, N)
    for n0 in range(col_start, col_stop, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < col_stop
        b_q = tl.load(p_q + o_r[:, None] * stride_qr + o_n[None, :] * stride_qn, mask=m_r[:, None] & m_n[None, :],
                      other=0.0)
        b_low = tl.dot(b_h, b_q.to(tl.float32), input_precision="tf32x3")
        m_mn = m_m[:, None] & m_n[None, :]
        p_tile = p_y + o_b[:, None] * stride_ym + o_n[None, :]
        b_y = tl.load(p_tile, mask=m_mn, other=0.0).to(tl.float32) + scale * b_low
        tl.store(p_tile, round_to(b_y, p_y.dtype.element_ty), mask=m_mn)


@triton.jit
def _lora_up_add_kernel(p_y, p_h, p_q, M, N, R, stride_ym, stride_hm, stride_qr, stride_qn, scale, cols_per_group,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[M, N] += scale * h[M, R] @ q[R, N] in place (``_up_add_rows``); grid (row blocks, column groups)."""
    _up_add_rows(tl.program_id(0), tl.program_id(1), p_y, p_h, p_q, M, N, R, stride_ym, stride_hm, stride_qr,
                 stride_qn, scale, cols_per_group, BLOCK_M, BLOCK_N, BLOCK_R)


@triton.jit
def _grad_tile(p_u, p_x, p_g, p_out, p_count, M, K, R, stride_um, stride_xm, stride_gk, stride_gr, stride_gs, i_k, i_s,
               rows_per_split, n_splits, scale, MODE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[:, K block i_k] = scale * u[M, R].T @ x[M, K block], stored through (stride_gk, stride_gr) so the caller
    picks [R, K] or [K, R]. Program i_s forms the sum over split i_s's rows; with one split it is the result.
    With several, each split's partial goes to the workspace g (splits ``stride_gs`` apart), and the program
    that finishes the tile last (the ``n_splits``-th to add 1 to its counter ``p_count``) adds the partials in
    split order, 0 first, and writes the result: the same sum whatever order the programs ran in, in one
    launch (before, an aten sum over the splits per gradient: 450 reductions a QLoRA step, 10.9 ms of profiled
    host time, benchmarks/results/2026-11-29_2143_profile-sloth-qlora-L32.txt), and sets the counter back
    to 0."""
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    o_r = tl.arange(0, BLOCK_R)
    m_k, m_r = o_k < K, o_r < R
    row_start = i_s * rows_per_split
    row_stop = tl.minimum(row_start + rows_per_split, M)
    b_g = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for m0 in range(row_start, row_stop, BLOCK_M):
        o_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)  # row * stride passes 2^31 past ~150k rows of 14336
        m_m = o_m < row_stop
        b_ut = tl.load(p_u + o_m[None, :] * stride_um + o_r[:, None], mask=m_r[:, None] & m_m[None, :], other=0.0)
        b_x = tl.load(p_x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_g = _dot_fp32_exact(b_x, b_ut, b_g, MODE, True, UPCAST)
    o_tile = o_r[:, None] * stride_gr + o_k[None, :] * stride_gk
    m_tile = m_r[:, None] & m_k[None, :]
    if n_splits == 1:
        tl.store(p_out + o_tile, b_g * scale, mask=m_tile)
    else:
        tl.store(p_g + i_s * stride_gs + o_tile, b_g * scale, mask=m_tile)
        tl.debug_barrier()  # every thread's partial is stored before the counter says so (release below)
        if tl.atomic_add(p_count, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
            b_sum = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
            for s in range(0, n_splits):  # .cg: read the partials from L2, where the other programs wrote them
                b_sum += tl.load(p_g + s * stride_gs + o_tile, mask=m_tile, other=0.0, cache_modifier=".cg")
            tl.store(p_out + o_tile, b_sum, mask=m_tile)
            tl.atomic_xchg(p_count, 0)


@triton.jit
def _lora_grad_kernel(p_u, p_x, p_g, p_out, K, stride_um, stride_xm, stride_gk, stride_gr, stride_gs, k_blocks,
                      p_u2, p_x2, p_g2, p_out2, K2, stride_um2, stride_xm2, stride_gk2, stride_gr2, stride_gs2,
                      p_count, M, R, rows_per_split, n_splits, scale,
                      MODE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    """Up to two weight gradients of one backward in one launch (same rows M, rank R and scale): programs
    i_k < k_blocks form out = scale * u.T @ x over K, the rest out2 = scale * u2.T @ x2 over K2 (K2 = 0: one
    gradient only). Grid (k blocks of both, splits); ``p_count`` holds one zeroed int32 counter per k block
    of both (``_grad_tile``: the last split of a tile adds the splits' partials, deterministically)."""
    i_k, i_s = tl.program_id(0), tl.program_id(1)
    if i_k < k_blocks:
        _grad_tile(p_u, p_x, p_g, p_out, p_count + i_k, M, K, R, stride_um, stride_xm, stride_gk, stride_gr,
                   stride_gs, i_k, i_s, rows_per_split, n_splits, scale, MODE, UPCAST, BLOCK_M, BLOCK_K, BLOCK_R)
    else:
        _grad_tile(p_u2, p_x2, p_g2, p_out2, p_count + i_k, M, K2, R, stride_um2, stride_xm2, stride_gk2, stride_gr2,
                   stride_gs2, i_k - k_blocks, i_s, rows_per_split, n_splits, scale, MODE, UPCAST, BLOCK_M, BLOCK_K,
                   BLOCK_R)


# ---------------------------------------------------------------------------------------------------
# Host launchers. Every 2-D operand has a unit last stride (``rows_2d``); the adapter factors are read
# through their strides, so a.T and b.T are never copied.
# ---------------------------------------------------------------------------------------------------

# Launch settings, from benchmarks/ops/lora_sweep.py on the H200 (4096 tokens, r 16, bf16 x, fp32 adapter;
# % of the 4.27 TB/s copy over the bytes each kernel must move, mean of the q/o, gate/up and down shapes):
# up_add (the one-tile-a-program kernel before UP_CONFIG's) 64 x 128 tiles, 4 warps: 70% (128-row and
# 256-column tiles and 8 warps were slower); grad
# 64 rows x 128 columns, 4 warps, ~2 programs per SM: 52% (8 warps: 35-45%). The down kernel before the
# one-dot split (three dots, factor split per program) peaked at 27% with 64-row blocks, falling with
# smaller blocks as every program re-split the factor; the one-dot form reaches 45% with 64 x 256 tiles
# and 4 warps (32-row blocks 35-40%, 128-row 40%, 8 warps less).
DOWN_CONFIG = dict(block_m=64, block_k=256, num_warps=4, num_stages=3)
# Tried and not kept: the down kernel splitting the fp32 factor itself (each column group of the [K, 4 R]
# operand loading the fp32 tile and keeping its part; a join + reshape of the three parts did not compile
# for sm_90 below 256-long K tiles), which saves the split launch, two of a LoRA linear's seven (one each
# way). Its fp32 tiles are twice the split launch's bf16 ones in shared memory (the
# 256-long K tile needed 256 KB on the H200; 128 fit), and on one lease the QLoRA step took 338.7 ms
# against 285.2 with the split launch (benchmarks/results/2026-11-30_000414 and _000856; commit de1fccd).
# up_add: one program per 32 rows and column group, looping over its 128-column tiles (3 stages, 4 warps), the
# groups chosen so that the grid has ~512 programs (4 for 4096 tokens). At the step's shapes (benchmarks/ops/
# lora_insitu.py, H200, 4096 tokens; % of copy for the o and down forward, o dx, down dx [N 14336], and the
# joined dx at r 48 and 32): 67 67 65 71 28 38, against 67 66 42 47 15 26 for the one-tile-a-program kernel it
# replaced (64 x 128 tiles; its sweep above timed the forward's b.T layout only, where they tie). The dx cases
# read q = a with columns adjacent, which the one-tile programs loaded once per tile.
UP_CONFIG = dict(block_m=32, block_n=128, num_warps=4, num_stages=3, programs=512)
GRAD_CONFIG = dict(block_m=64, block_k=128, num_warps=4, num_stages=3, programs=264)
# Tried and not kept: writing the adapter term first and letting cuBLAS add the base product in its
# epilogue (``y.addmm_(x, w.T)``, beta 1) instead of the up kernel's read-add-write pass. H200, 4096
# tokens, r 16, forward+backward kernel ms, this form vs the epilogue form (benchmarks/results/
# 2026-11-29_171625_lora.*): q/o 0.488 vs 0.481, k/v 0.191 vs 0.194, gate/up 1.460 vs 1.429, down 1.486
# vs 1.504: within 2% either way (cuBLAS's epilogue read of C is not free), and it rounds the adapter term
# before the sum where eager rounds the base product, which moved a bf16 whole-model gradient past the
# 2x rule (gemma3, 2.26x eager's error).


def _mode(act: torch.Tensor, factor: torch.Tensor) -> int:
    if act.dtype == factor.dtype and act.dtype != torch.float32:
        return _NATIVE.value
    if act.dtype == torch.bfloat16:
        return _SPLIT_BF16.value
    return _TF32X3.value


# The down kernels' product for bf16 activations and an fp32 factor: the factor split into three bf16 parts
# by a launch of its own (the default), or, with DOWN_SPLIT_LAUNCH False, tf32x3 on the fp32 factor as fp16
# and fp32 activations have it (a bf16 value is exact in tf32, so each product keeps 22 of the factor's 24
# significand bits), which saves the split launch: one per down call, 256 a Llama-3-8B step. Measured on the
# H200 (2026-11-30, one lease) and not kept: QLoRA step 301.3 and 302.4 ms against the default's 273.1, LoRA
# 290.6; the step is bound by the GPU's power cap, not the host, and three tf32 products cost more than the
# launches save (benchmarks/results/2026-11-30_052355_*, _052510_*, _052842_*). The other form stays, for
# measuring (benchmarks/variants.py's ``lora_down_tf32x3``).
DOWN_SPLIT_LAUNCH = True


def _down_mode(act: torch.Tensor, factor: torch.Tensor) -> int:
    """The down kernels' MODE: ``_mode``, except tf32x3 for the bf16 split when DOWN_SPLIT_LAUNCH is off."""
    mode = _mode(act, factor)
    return _TF32X3.value if mode == _SPLIT_BF16.value and not DOWN_SPLIT_LAUNCH else mode


def _block_r(rank: int) -> int:
    return max(16, next_power_of_2(rank))  # tl.dot needs every dimension >= 16


# Shared memory the down kernel may plan for: the H200 (sm_90) allows 232,448 bytes a block; the margin
# covers what Triton adds beyond the pipelined operand tiles.
_DOWN_SMEM_BUDGET = 200 * 1024


def down_smem_bytes(block_m: int, block_k: int, factor_cols: int, x_bytes: int, factor_bytes: int,
                    stages: int) -> int:
    """The down kernel's pipelined tiles: ``stages`` copies of an x tile [block_m, block_k] and a factor tile
    [block_k, factor_cols] (factor_cols = 4 * BLOCK_R bf16 columns when the factor is split)."""
    return stages * (block_m * block_k * x_bytes + block_k * factor_cols * factor_bytes)


def _down_block_k(c: dict, mode: int, block_r: int, x_bytes: int, factor_bytes: int, k: int) -> int:
    """DOWN_CONFIG's block_k (swept at r = 16), halved until the tiles fit ``_DOWN_SMEM_BUDGET``: the split
    factor tile grows with the rank (r = 32 at 256 would need 295 KB), and the tile must stay >= 16."""
    cols = 4 * block_r if mode == _SPLIT_BF16.value else block_r
    block_k = min(c["block_k"], max(16, next_power_of_2(k)))
    while block_k > 16 and down_smem_bytes(c["block_m"], block_k, cols, x_bytes, factor_bytes,
                                           c["num_stages"]) > _DOWN_SMEM_BUDGET:
        block_k //= 2
    return block_k


def _down(x_MK: torch.Tensor, p_KR: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x_MK @ p_KR`` in fp32 ([M, R]); ``p_KR`` may be any strided view (a.T, or b). Written into ``out``
    when given: an fp32 [M, R] view with unit column stride (a column block of a wider buffer)."""
    n_rows, k = x_MK.shape
    rank = p_KR.shape[1]
    h_MR = torch.empty((n_rows, rank), dtype=torch.float32, device=x_MK.device) if out is None else out
    if n_rows == 0:
        return h_MR
    if k == 0:
        return h_MR.zero_()
    c, mode, block_r = DOWN_CONFIG, _down_mode(x_MK, p_KR), _block_r(rank)
    block_k = _down_block_k(c, mode, block_r, x_MK.element_size(), 2 if mode != _TF32X3.value else 4, k)
    if mode == _SPLIT_BF16.value:
        split = torch.empty((k, 4 * block_r), dtype=torch.bfloat16, device=x_MK.device)
        _split_factor_kernel[(cdiv(k, 64),)](
            p_KR, split, k, rank, p_KR.stride(0), p_KR.stride(1), BLOCK_K=64, BLOCK_R=block_r, num_warps=4)
        p_KR = split
    _lora_down_kernel[(cdiv(n_rows, c["block_m"]),)](
        x_MK, p_KR, h_MR, n_rows, k, rank, x_MK.stride(0), p_KR.stride(0), p_KR.stride(1), h_MR.stride(0),
        MODE=mode, UPCAST=triton_interpreter_on(), BLOCK_M=c["block_m"], BLOCK_K=block_k, BLOCK_R=block_r,
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    return h_MR


def up_add_groups(n_rows: int, n_cols: int) -> tuple[int, int]:
    """(column groups, columns per group) of the up_add kernels for a [n_rows, n_cols] output: enough groups
    that the grid has about UP_CONFIG["programs"] programs, each group a whole number of column tiles (no
    group for an empty output)."""
    c = UP_CONFIG
    tiles = cdiv(n_cols, c["block_n"])
    if tiles == 0 or n_rows == 0:
        return 0, c["block_n"]
    groups = max(1, min(tiles, cdiv(c["programs"], cdiv(n_rows, c["block_m"]))))
    per_group = cdiv(tiles, groups) * c["block_n"]
    return cdiv(n_cols, per_group), per_group


def _up_add_(base_MN: torch.Tensor, h_MR: torch.Tensor, q_RN: torch.Tensor, scale: float) -> torch.Tensor:
    """``base_MN += scale * h_MR @ q_RN`` in place (fp32 sum, one rounding); returns base_MN. ``h_MR`` needs a
    unit column stride only (it may be a column block of a wider buffer)."""
    n_rows, n_cols = base_MN.shape
    if base_MN.numel() == 0:
        return base_MN
    c = UP_CONFIG
    groups, per_group = up_add_groups(n_rows, n_cols)
    _lora_up_add_kernel[(cdiv(n_rows, c["block_m"]), groups)](
        base_MN, h_MR, q_RN, n_rows, n_cols, h_MR.shape[1], base_MN.stride(0), h_MR.stride(0), q_RN.stride(0),
        q_RN.stride(1), float(scale), per_group,
        BLOCK_M=c["block_m"], BLOCK_N=c["block_n"], BLOCK_R=_block_r(h_MR.shape[1]), num_warps=c["num_warps"],
        num_stages=c["num_stages"],
    )
    return base_MN


def _k_blocks(sizes: list[int]) -> tuple[int, list[int]]:
    """(BLOCK_K, k blocks per problem) of the grad kernel for problems of these K (one block size a launch)."""
    block_k = min(GRAD_CONFIG["block_k"], max(16, next_power_of_2(max(sizes))))
    return block_k, [cdiv(k, block_k) for k in sizes]


def _splits(n_rows: int, k_blocks: list[int]) -> tuple[int, int]:
    """(splits, rows_per_split): the M rows split so that the grad kernel's grid covers the GPU."""
    c = GRAD_CONFIG
    splits = max(1, min(cdiv(c["programs"], sum(k_blocks)), cdiv(n_rows, 4 * c["block_m"])))
    rows_per_split = cdiv(cdiv(n_rows, splits), c["block_m"]) * c["block_m"]
    return cdiv(n_rows, rows_per_split), rows_per_split


# Split counters shared by the weight-gradient launches on a device's default stream. Every launch leaves the
# counters it used at zero, and launches on one stream run one after another, so they can share one buffer
# instead of a zeroed allocation and its fill launch per backward (four a Llama layer: 128 launches of a
# Llama-3-8B step, benchmarks/results/2026-11-30_0342_profile-sloth-Lall.txt, "FillFunctor<int>"). The buffer
# is made when the LoRA pass places an op (``make_counter_buffer``), never while a step runs: made then, it
# could come from a CUDA graph's private pool (cudagraph trees warm up in it) and be handed to other tensors
# under the kernels' feet. Other streams (whose kernels may run beside the default stream's), graph capture,
# and a need past the buffer's size get a fresh zeroed buffer, as every call did before.
COUNTER_BUFFER_SIZE = 4096
_COUNTER_BUFFERS: dict[torch.device, torch.Tensor] = {}


def make_counter_buffer(device: torch.device) -> None:
    """Make ``device``'s shared split counters if it is a GPU without them (once; call when compiling). Not
    while a CUDA graph is being captured (the zeros would only be recorded, in the graph's pool); made on the
    device's default stream, whose kernels will use it, and waited for."""
    device = torch.device(device)
    if device.type != "cuda":
        return  # the interpreter's kernels run one at a time on the host: a fill costs no launch there
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device in _COUNTER_BUFFERS or torch.cuda.is_current_stream_capturing():
        return
    default = torch.cuda.default_stream(device)
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.cuda.device(device), torch.cuda.stream(default):
        buffer = torch.zeros(COUNTER_BUFFER_SIZE, dtype=torch.int32, device=device)
    default.synchronize()
    _COUNTER_BUFFERS[device] = buffer


def _zeroed_counters(n: int, device: torch.device) -> torch.Tensor:
    """At least ``n`` zeroed int32 split counters on ``device``: the shared buffer where it may be used (the
    launch goes to the current device's current stream, as Triton launches: it must be ``device``'s default
    stream, not capturing)."""
    shared = _COUNTER_BUFFERS.get(device)
    if shared is not None and n <= shared.numel() and (device.type != "cuda" or (
            device.index == torch.cuda.current_device() and not torch.cuda.is_current_stream_capturing()
            and torch.cuda.current_stream() == torch.cuda.default_stream())):
        return shared
    return torch.zeros(n, dtype=torch.int32, device=device)


def grad_counters(calls: list[list[int]], n_rows: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 split counters for several ``_grads`` calls of one op's backward over ``n_rows`` rows
    (``calls``: each call's K of its problems): every launch leaves the counters it used at zero again, so the
    calls, one after another on a stream, share one buffer as long as the largest needs (the device's shared
    buffer, or one fill launch for all of them). Without row splits in any call, one unused int32 (no fill);
    so also for no rows, where ``_grads`` launches nothing (and ``_splits`` would divide by zero)."""
    blocks = [_k_blocks(sizes)[1] for sizes in calls]
    if n_rows == 0 or all(_splits(n_rows, kb)[0] == 1 for kb in blocks):
        return torch.empty(1, dtype=torch.int32, device=device)
    return _zeroed_counters(max(sum(kb) for kb in blocks), device)


def _grads(problems: list[tuple[torch.Tensor, torch.Tensor, bool]], scale: float,
           counters: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """``scale * u_MR.T @ x_MK`` in fp32 for each (u_MR, x_MK, transposed) of one or two ``problems`` sharing
    M rows and rank R, in one launch: [R, K], or its transpose [K, R] (contiguous) when ``transposed``. The M
    rows are split so the grid covers the GPU, and the last split of each tile adds the partials
    (``_grad_tile``), counting on zeroed ``counters``, at least one per k block of the problems
    (``grad_counters``; made here when not given); they are zero again after the launch."""
    n_rows, rank = problems[0][0].shape
    sizes = [x.shape[1] for _, x, _ in problems]
    if n_rows == 0 or 0 in sizes:
        return [torch.zeros((k, rank) if t else (rank, k), dtype=torch.float32, device=x.device)
                for (_, x, t), k in zip(problems, sizes)]
    c = GRAD_CONFIG
    block_k, k_blocks = _k_blocks(sizes)
    splits, rows_per_split = _splits(n_rows, k_blocks)
    device = problems[0][1].device
    if counters is None:  # with one split the kernel never touches them: an unused int32, not an input's data
        counters = _zeroed_counters(sum(k_blocks), device) if splits > 1 else \
            torch.empty(1, dtype=torch.int32, device=device)
    elif splits > 1 and counters.numel() < sum(k_blocks):
        raise ValueError(f"sloth.lora_linear: {counters.numel()} split counters for {sum(k_blocks)} tiles")
    args, outs = [], []
    for u_MR, x_MK, transposed in problems:
        k = x_MK.shape[1]
        shape = (k, rank) if transposed else (rank, k)
        out = torch.empty(shape, dtype=torch.float32, device=device)
        g = torch.empty((splits, *shape), dtype=torch.float32, device=device) if splits > 1 else out
        stride_gk, stride_gr = (rank, 1) if transposed else (1, k)
        u_MR = u_MR if u_MR.stride(1) == 1 else u_MR.contiguous()  # rows may be apart, columns adjacent
        args.append((u_MR, x_MK, g, out, k, u_MR.stride(0), x_MK.stride(0), stride_gk, stride_gr, rank * k))
        outs.append(out)
    (u1, x1, *rest1), (u2, x2, g2, out2, k2, *strides2) = args[0], args[-1]
    if _mode(x2, u2) != _mode(x1, u1):  # one MODE constexpr serves both problems
        raise ValueError(f"sloth.lora_linear: the paired gradients need one product mode, got {x1.dtype} x "
                         f"{u1.dtype} and {x2.dtype} x {u2.dtype}")
    if len(problems) == 1:
        k2 = 0  # the second slot gets no programs
    _lora_grad_kernel[(sum(k_blocks), splits)](
        u1, x1, *rest1, k_blocks[0],
        u2, x2, g2, out2, k2, *strides2,
        counters, n_rows, rank, rows_per_split, splits, float(scale),
        MODE=_mode(x1, u1), UPCAST=triton_interpreter_on(), BLOCK_M=c["block_m"], BLOCK_K=block_k,
        BLOCK_R=_block_r(rank),
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    return outs


def _grad(u_MR: torch.Tensor, x_MK: torch.Tensor, scale: float, transposed: bool = False) -> torch.Tensor:
    """``scale * u_MR.T @ x_MK`` in fp32: [R, K], or its transpose [K, R] (contiguous) when ``transposed``."""
    return _grads([(u_MR, x_MK, transposed)], scale)[0]


# ---------------------------------------------------------------------------------------------------
# The op's forward and backward: the Triton path, or the same math in PyTorch.
# ---------------------------------------------------------------------------------------------------

def _check_inputs(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor,
                  b: torch.Tensor) -> None:
    if x.dim() < 1 or w.dim() != 2 or a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"sloth.lora_linear: x must be [..., K], w [N, K], a [r, K] and b [N, r], got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(a.shape)} and {tuple(b.shape)}")
    k, (n, r) = x.shape[-1], b.shape
    if w.shape != (n, k) or a.shape != (r, k):
        raise ValueError(f"sloth.lora_linear: shapes do not chain: x [..., {k}], w {tuple(w.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)} (want w [N, K], a [r, K], b [N, r])")
    if x.dtype not in _FLOAT_DTYPES or w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"sloth.lora_linear: x, w (and bias) must share one of float32, bfloat16, float16, got "
                        f"{x.dtype}, {w.dtype}" + (f", {bias.dtype}" if bias is not None else ""))
    if a.dtype not in _FLOAT_DTYPES or b.dtype != a.dtype:
        raise TypeError(f"sloth.lora_linear: a and b must share one of float32, bfloat16, float16, got "
                        f"{a.dtype} and {b.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"sloth.lora_linear: bias must be [{n}], got {tuple(bias.shape)}")
    _check_devices(x, w, bias, a, b)


def _check_devices(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor,
                   b: torch.Tensor) -> None:
    """x, the base and the adapter on one device (the fake runs this too: lowering/devices.py says why)."""
    check_one_device("sloth.lora_linear", ("x", x), ("w", w), ("bias", bias), ("a", a), ("b", b))


def lora_linear_reference(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor,
                          b: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) by the module docstring's formulas in plain PyTorch, the adapter path in fp32."""
    x2 = x.reshape(-1, x.shape[-1])
    h = x2.float() @ a.float().t()
    y2 = (F.linear(x2, w, bias).float() + scale * (h @ b.float().t())).to(x.dtype)
    return y2.view(*x.shape[:-1], w.shape[0]), h


def adapter_activation(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """h = x2 @ a.T ([M, r], fp32), bit for bit as the forward computes it: what a backward given no h
    (compiler/lean_backward.py) recomputes from the x it has, one pass over x."""
    if not use_triton(x):
        return x.reshape(-1, x.shape[-1]).float() @ a.float().t()
    return _down(rows_2d(x), a.t())


def lora_forward(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) of the op (also the body of sloth::qlora_linear once its weight is dequantised)."""
    _check_inputs(x, w, bias, a, b)
    if not use_triton(x):
        return lora_linear_reference(x, w, bias, a, b, scale)
    x_MK = rows_2d(x)
    h_MR = _down(x_MK, a.t())
    y_MN = _up_add_(F.linear(x_MK, w, bias), h_MR, b.t(), scale)  # cuBLAS writes base, the kernel adds in place
    return y_MN.view(*x.shape[:-1], w.shape[0]), h_MR


def lora_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  h: Optional[torch.Tensor], scale: float, need_dx: bool, grad_dtype: Optional[torch.dtype] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, da, db); dx is empty when ``need_dx`` is False. da and db come in ``grad_dtype`` when given (a
    caller summing them over row blocks asks for fp32), else in a's and b's dtypes. ``h`` None: recomputed
    from x (adapter_activation)."""
    if h is None:
        h = adapter_activation(x, a)
    if not use_triton(x):
        dy2, x2 = dy.reshape(-1, dy.shape[-1]).float(), x.reshape(-1, x.shape[-1]).float()
        g = dy2 @ b.float()
        dx = ((dy2 @ w.float()).to(x.dtype).float() + scale * (g @ a.float())).to(x.dtype).view(x.shape) \
            if need_dx else x.new_empty(0)
        return dx, (scale * g.t() @ x2).to(grad_dtype or a.dtype), (scale * dy2.t() @ h).to(grad_dtype or b.dtype)
    dy_MN = rows_2d(dy)
    if need_dx:
        dx_MK, g_MR = lora_backward_dx(dy_MN, w, a, b, scale)
        dx = dx_MK.view(x.shape)
    else:
        g_MR, dx = _down(dy_MN, b), x.new_empty(0)
    da, db = lora_adapter_grads(g_MR, rows_2d(x), h, dy_MN, a, b, scale, grad_dtype)
    return dx, da, db


def lora_backward_dx(dy_MN: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """lora_backward's first half on the GPU path: (dx_MK = dy @ w + s * g @ a, g_MR = dy @ b in fp32), dx a
    fresh contiguous tensor the caller owns. With lora_adapter_grads after it, a caller can put work between
    the two that needs dx and produces the x the gradients read (glu_lora.py: the GLU's backward writes
    the recomputed hidden over its own gradient)."""
    g_MR = _down(dy_MN, b)
    return _up_add_(dy_MN @ w, g_MR, a, scale), g_MR


def lora_adapter_grads(g_MR: torch.Tensor, x_MK: torch.Tensor, h_MR: torch.Tensor, dy_MN: torch.Tensor,
                       a: torch.Tensor, b: torch.Tensor, scale: float, grad_dtype: Optional[torch.dtype] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(da = s * g.T @ x, db = s * dy.T @ h) in ``grad_dtype`` if given, else in a's and b's dtypes, in one
    launch: they share M, r and the scale, and their mode (x and dy share a dtype; g and h are fp32)."""
    da, db = _grads([(g_MR, x_MK, False), (h_MR, dy_MN, True)], scale)
    return da.to(grad_dtype or a.dtype), db.to(grad_dtype or b.dtype)


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    x, w, bias, a, b, scale = inputs
    _, h = output
    ctx.save_for_backward(x, w, a, b, h)
    ctx.mark_non_differentiable(h)  # h is returned to be saved, not to be used: it gets no gradient
    ctx.scale = scale


def _backward(ctx, dy, _dh):
    x, w, a, b, h = ctx.saved_tensors
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise RuntimeError("sloth.lora_linear: the base weight and bias must be frozen (requires_grad=False); "
                           "the op computes no gradient for them")
    dx, da, db = torch.ops.sloth.lora_linear_backward(dy, x, w, a, b, h, ctx.scale, ctx.needs_input_grad[0])
    return (dx if ctx.needs_input_grad[0] else None), None, None, \
        (da if ctx.needs_input_grad[3] else None), (db if ctx.needs_input_grad[4] else None), None


@functools.cache
def register() -> None:
    """Define ``sloth::lora_linear`` and ``sloth::lora_linear_backward`` (idempotent)."""
    fwd = define("sloth::lora_linear", lora_forward)
    bwd = define("sloth::lora_linear_backward", lora_backward)

    @fake(fwd)
    def _(x, w, bias, a, b, scale):
        _check_devices(x, w, bias, a, b)
        rows = math.prod(x.shape[:-1])
        return x.new_empty((*x.shape[:-1], w.shape[0])), x.new_empty((rows, a.shape[0]), dtype=torch.float32)

    @fake(bwd)
    def _(dy, x, w, a, b, h, scale, need_dx):
        return (x.new_empty(x.shape) if need_dx else x.new_empty(0)), a.new_empty(a.shape), b.new_empty(b.shape)

    fwd.register_autograd(_backward, setup_context=_setup_context)


def lora_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor,
                scale: float) -> torch.Tensor:
    """``F.linear(x, w, bias) + scale * F.linear(F.linear(x, a), b)`` with a frozen base, fp32 adapter math
    and one rounding; see the module docstring for the exact math."""
    register()
    y, _ = torch.ops.sloth.lora_linear(x, w, bias, a, b, float(scale))
    return y
