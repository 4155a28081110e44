"""Grouped GEMMs over rows sorted by group, in Triton: the MoE experts' GEMMs (lowering/moe.py) where
``torch._grouped_mm`` does not run, and those that read the tokens' rows through the sort order (no gathered copy).

Legend as in lowering/moe.py: S rows sorted by group (expert), E groups, ``offs`` [E] int32 the end of each group's
rows (group e is rows ``offs[e-1] <= s < offs[e]``, ``offs[-1] = 0``), K the reduced size, N the output width.

``grouped_mm(a, b, offs, rows)`` is the [S, K] x [E, K, N] form, ``torch._grouped_mm(a, b, offs=offs)``::

    out[s] = a[rows[s]] @ b[e(s)]          (a[s] without ``rows``),   e(s) the group of row s

``rows`` [S] (int) reads the operand's rows through an index: the experts' first GEMM reads token ``order[s] // K``'s
hidden state for sorted row s, and the backward's first reads that token's output gradient, so neither gathered
[S, H] copy is written and read back (at Qwen3-MoE's layer of 4096 tokens, top-8: 128 MiB each way). ``b`` may have
any strides (the experts' weights are used transposed: ``W[e]^T`` is ``W.transpose(1, 2)``, a view).
Rows at or past ``offs[-1]`` are not written (``torch._grouped_mm`` leaves them uninitialised too).

``grouped_mm_weight(left, right, offs)`` is the [K, S] x [S, N] form, the weight gradients'::

    out[e] = sum_{s in group e} left[s]^T right[s]       ([E, K, N] from left [S, K] and right [S, N]; zero for an
                                                          empty group)

Both accumulate in fp32 and round once. fp32 operands multiply in IEEE fp32 (``input_precision="ieee"``), not
TF32: eager fp32 matmuls do not round their inputs to TF32 either (``torch.backends.cuda.matmul.allow_tf32`` is off
by default). The op sends fp32 here only in the CPU interpreter (or when lowering/moe.py's GEMM_CHOICE "triton"
forces it).

Scheduling, with no host sync: the host knows S and E but not the group sizes. The first kernel's grid is an upper
bound on the row tiles, ``cdiv(S, BLOCK_M) + E`` (each group wastes at most one partial tile), by the column tiles;
each program reads ``offs`` (E values), counts each group's row tiles, and finds its own group by a prefix sum;
programs past the last tile return at once. The row-tile axis is the grid's first (fastest) so that the programs
running together share a column block of the weights: each expert's weight is read from memory about once while
the tokens (T x K values, a few MiB) stay in L2.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_power_of_2
from .rounding import INTERPRETED, round_to


@triton.jit
def _dot(b_a, b_b, b_acc, IEEE: tl.constexpr):
    """b_acc + b_a @ b_b in fp32. 16-bit operands on a GPU: the tensor cores' product accumulated into b_acc (the
    order CUTLASS's grouped GEMM uses too: bit-equal to torch._grouped_mm at the benchmark's shapes). fp32 operands:
    IEEE products (FMAs), each BLOCK_K slice summed on its own and then added (two-level summation; it did not bring
    the op's router-weight gradient within 2x of eager's error on an H100, so fp32 experts on a GPU keep the
    reference GEMM, lowering/moe.py's _triton_gemm_runs). The interpreter takes 16-bit operands widened to fp32 (its
    dot returned garbage for bf16 ones under Triton 3.9)."""
    if IEEE or INTERPRETED:
        return b_acc + tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(b_a, b_b, b_acc)


@triton.jit
def _group_tile(p_offs, i_tile, N_GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(group, first row of this tile, end of the group's rows) for row tile ``i_tile`` of the grouped rows; group
    N_GROUPS when the tile is past the last one."""
    o_g = tl.arange(0, GROUPS_POW2)
    m_g = o_g < N_GROUPS
    b_end = tl.load(p_offs + o_g, mask=m_g, other=0).to(tl.int32)
    b_start = tl.load(p_offs + o_g - 1, mask=m_g & (o_g > 0), other=0).to(tl.int32)
    b_tiles = tl.where(m_g, (b_end - b_start + BLOCK_M - 1) // BLOCK_M, 0)
    b_tiles_end = tl.cumsum(b_tiles, 0)
    i_g = tl.sum((b_tiles_end <= i_tile).to(tl.int32), 0)  # groups whose tiles all come before this one
    m_this = o_g == i_g
    first_tile = tl.sum(tl.where(m_this, b_tiles_end - b_tiles, 0), 0)
    row0 = tl.sum(tl.where(m_this, b_start, 0), 0) + (i_tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(m_this, b_end, 0), 0)
    return i_g, row0, row_end


@triton.jit
def _grouped_mm_kernel(
    p_a, p_rows, p_b, p_offs, p_out,
    n_k, n_n, stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_om,
    N_GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr, GATHER: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One row tile of one group (program 0) by one column block (program 1): out[s] = a[rows[s]] @ b[group]."""
    i_g, row0, row_end = _group_tile(p_offs, tl.program_id(0), N_GROUPS, GROUPS_POW2, BLOCK_M)
    if i_g < N_GROUPS:
        o_m = row0 + tl.arange(0, BLOCK_M)
        m_m = o_m < row_end
        if GATHER:
            o_src = tl.load(p_rows + o_m, mask=m_m, other=0).to(tl.int64)
        else:
            o_src = o_m.to(tl.int64)
        o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < n_n
        o_k = tl.arange(0, BLOCK_K)
        p_a_tile = p_a + o_src[:, None] * stride_am + o_k[None, :] * stride_ak
        p_b_tile = p_b + i_g.to(tl.int64) * stride_be + o_k[:, None] * stride_bk + o_n[None, :].to(tl.int64) * stride_bn
        b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, n_k, BLOCK_K):
            m_k = (k0 + o_k) < n_k
            b_a = tl.load(p_a_tile, mask=m_m[:, None] & m_k[None, :], other=0.0)
            b_b = tl.load(p_b_tile, mask=m_k[:, None] & m_n[None, :], other=0.0)
            b_acc = _dot(b_a, b_b, b_acc, IEEE)
            p_a_tile += BLOCK_K * stride_ak
            p_b_tile += BLOCK_K * stride_bk
        p_o = p_out + o_m[:, None].to(tl.int64) * stride_om + o_n[None, :]
        tl.store(p_o, round_to(b_acc, p_out.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _grouped_mm_weight_kernel(
    p_left, p_right, p_offs, p_out,
    n_k, n_n, stride_lm, stride_lk, stride_rm, stride_rn, stride_oe, stride_ok, stride_on,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One group (program 0) by one [BLOCK_K, BLOCK_N] tile of its output (program 1: k tile, program 2: n tile):
    out[e] = sum over the group's rows s of left[s]^T right[s], its rows in blocks of BLOCK_M."""
    i_g = tl.program_id(0)
    row_start = tl.load(p_offs + i_g - 1, mask=i_g > 0, other=0).to(tl.int32)
    row_end = tl.load(p_offs + i_g).to(tl.int32)
    # int64: o_k * stride and o_n * stride reach K * S or N * S for column-major operands
    o_k = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    o_n = (tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_k, m_n = o_k < n_k, o_n < n_n
    o_m = tl.arange(0, BLOCK_M)
    b_acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        o_row = (m0 + o_m).to(tl.int64)
        m_row = (m0 + o_m) < row_end
        b_l = tl.load(p_left + o_row[None, :] * stride_lm + o_k[:, None] * stride_lk,
                      mask=m_k[:, None] & m_row[None, :], other=0.0)
        b_r = tl.load(p_right + o_row[:, None] * stride_rm + o_n[None, :] * stride_rn,
                      mask=m_row[:, None] & m_n[None, :], other=0.0)
        b_acc = _dot(b_l, b_r, b_acc, IEEE)
    p_o = p_out + i_g.to(tl.int64) * stride_oe + o_k[:, None] * stride_ok + o_n[None, :] * stride_on
    tl.store(p_o, round_to(b_acc, p_out.dtype.element_ty), mask=m_k[:, None] & m_n[None, :])


# Tile sizes for 16-bit operands on a GPU, the fastest of five settings at three MoE shapes on an H100
# (benchmarks/results/2026-12-06_h100_103628_grouped_gemm.md): the row form at 128 x 256 x 64 (8 warps, 3 stages),
# 0.51-0.89x the time of 128 x 128 x 64; the weight form at 64 x 128 x 64 (4 warps, 4 stages; 128 x 256 needs 240 KiB
# of shared memory, over the H100's 227).
_ROW_TILES = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
_WEIGHT_TILES = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
# fp32 operands multiply in IEEE FMAs (no tensor cores): small tiles.
_FP32_TILES = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)


@functools.cache
def _shared_memory(index: int) -> int:
    """Shared memory one program may use on CUDA device ``index`` (bytes): 227 KiB on an H100, 163 on an A100,
    99 on an L4 or RTX 4090."""
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", None) or props.shared_memory_per_block  # (ROCm: not given)


def _fitted(tiles: dict, limit: int, size: int, weight_form: bool) -> dict:
    """``tiles`` with fewer stages, then narrower tiles, until the pipelined operand tiles fit ``limit`` bytes (stages
    x (A tile + B tile) x element size: what Triton asked for when a setting did not fit)."""
    tiles = dict(tiles)

    def need() -> int:
        m, n, k = tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"]
        return tiles["num_stages"] * ((k * m + m * n) if weight_form else (m * k + k * n)) * size

    while need() > limit:
        if tiles["num_stages"] > 2:
            tiles["num_stages"] -= 1
        elif tiles["BLOCK_N"] > 64:
            tiles["BLOCK_N"] //= 2
            tiles["num_warps"] = 4
        elif tiles["BLOCK_M"] > 32:
            tiles["BLOCK_M"] //= 2
        else:
            break
    return tiles


def _config(a: torch.Tensor, n_n: int, n_k: int = 0, weight_form: bool = False) -> dict:
    """The tile sizes for operand ``a``'s device and dtype (above), narrowed to the output's width ``n_n`` (and, for
    the weight form, its height ``n_k``) where that is smaller: a LoRA factor's products are rank r wide, and a
    256-wide tile would multiply 16 columns of data and 240 of zeros; small tiles in the interpreter, whose time
    grows with the tile's work."""
    if a.device.type != "cuda":
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4)
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    return _cuda_config(index, a.dtype, weight_form, min(next_power_of_2(n_n), 256),
                        min(next_power_of_2(n_k), 256) if weight_form else 0)


@functools.cache
def _cuda_config(index: int, dtype: torch.dtype, weight_form: bool, width: int, height: int) -> dict:
    tiles = dict(_FP32_TILES if dtype == torch.float32 else _WEIGHT_TILES if weight_form else _ROW_TILES)
    tiles["BLOCK_N"] = max(16, min(tiles["BLOCK_N"], width))
    if weight_form:  # the weight kernel's BLOCK_K tiles the output's rows
        tiles["BLOCK_K"] = max(16, min(tiles["BLOCK_K"], height))
    return _fitted(tiles, _shared_memory(index), dtype.itemsize, weight_form)


def _check(name: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{name}: both operands must have one dtype, got {a.dtype} and {b.dtype}")
    if offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: offs must be a 1-D int32 or int64 tensor of group ends, got {offs.dtype} "
                        f"{tuple(offs.shape)}")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """[S, N]: out[s] = a[rows[s]] @ b[group of s] (``a[s]`` without ``rows``; module docstring). ``a`` [T, K] (T = S
    without ``rows``), ``b`` [E, K, N] with any strides, ``offs`` [E] the groups' row ends, ``rows`` [S] int.
    ``config`` overrides the tile sizes (benchmarks/ops/grouped_gemm.py)."""
    _check("sloth grouped_mm", a, b, offs)
    offs = offs.contiguous()  # the kernels read offs and rows as dense vectors
    rows = rows.contiguous() if rows is not None else None
    n_rows = rows.shape[0] if rows is not None else a.shape[0]
    n_groups, n_k, n_n = b.shape
    if a.shape[1] != n_k or offs.shape[0] != n_groups:
        raise ValueError(f"sloth grouped_mm: a [., {n_k}] and offs [{n_groups}] for b {tuple(b.shape)}, got "
                         f"{tuple(a.shape)} and {tuple(offs.shape)}")
    out = torch.empty((n_rows, n_n), dtype=a.dtype, device=a.device)
    if n_rows == 0 or n_n == 0:
        return out
    c = config or _config(a, n_n)
    _grouped_mm_kernel[(cdiv(n_rows, c["BLOCK_M"]) + n_groups, cdiv(n_n, c["BLOCK_N"]))](
        a, rows if rows is not None else offs, b, offs, out,
        n_k, n_n, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        N_GROUPS=n_groups, GROUPS_POW2=next_power_of_2(n_groups), GATHER=rows is not None,
        IEEE=a.dtype == torch.float32, **c,
    )
    return out


def grouped_mm_weight(left: torch.Tensor, right: torch.Tensor, offs: torch.Tensor,
                      config: dict | None = None) -> torch.Tensor:
    """[E, K, N]: out[e] = sum over group e's rows of left[s]^T right[s] (``torch._grouped_mm(left.t(), right,
    offs=offs)``), ``left`` [S, K], ``right`` [S, N], any strides; zero for an empty group."""
    _check("sloth grouped_mm_weight", left, right, offs)
    offs = offs.contiguous()
    if left.shape[0] != right.shape[0]:
        raise ValueError(f"sloth grouped_mm_weight: left and right need one row count, got {tuple(left.shape)} and "
                         f"{tuple(right.shape)}")
    n_groups, n_k, n_n = offs.shape[0], left.shape[1], right.shape[1]
    out = torch.empty((n_groups, n_k, n_n), dtype=left.dtype, device=left.device)
    if out.numel() == 0:
        return out
    c = config or _config(left, n_n, n_k, weight_form=True)
    _grouped_mm_weight_kernel[(n_groups, cdiv(n_k, c["BLOCK_K"]), cdiv(n_n, c["BLOCK_N"]))](
        left, right, offs, out,
        n_k, n_n, left.stride(0), left.stride(1), right.stride(0), right.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        IEEE=left.dtype == torch.float32, **c,
    )
    return out
