"""The two elementwise passes of ``sloth.moe_experts`` (lowering/moe.py) that sit between its grouped GEMMs, each one
Triton kernel where the first version ran four to six PyTorch ops with fp32 intermediates.

Legend as in lowering/moe.py: T tokens, K experts a token, S = T*K rows sorted by expert, H hidden, I intermediate;
``inverse[t*K + k]`` is the sorted row of assignment (t, k) (the inverse of the sort ``order``).

``combine``: the weighted sum of each token's K expert rows back to token order::

    out[t] = sum_k scale[t, k] * rows[inverse[t*K + k]]      (scale = 1 when not given)

accumulated in fp32 in k order and rounded once: deterministic, no atomics. The first version gathered the rows
([S, H]), widened them to fp32 ([S, H] fp32), multiplied and summed: about 9 S*H*e bytes moved where this reads
S*H*e once (H200, Qwen3-MoE shape: the ``direct_copy`` / fp32 multiply / reduce kernels were ~11 of the MoE step's
63.6 GPU ms, benchmarks/results/2026-12-01_issue20_moe.md).

``glu_backward_weighted``: the expert GLU's backward with the router weight inside. Per sorted row r with router
weight w_r (``weights[order[r]]``), c_r = W_d^T dout (the first backward GEMM), gu_r = (g_r, u_r) saved by the
forward and h_r = a(g_r) * u_r::

    dh_r  = w_r c_r
    d g_r = dh_r * u_r * a'(g_r)        d u_r = dh_r * a(g_r)           -> d_gu [S, 2I]
    d w_r = <c_r, h_r>                  (written to dw[order[r]]: a permutation, so each once)  -> dw [T*K]
    hw_r  = w_r h_r                     (only when the down projection trains: its weight gradient's operand)

all in fp32 from the loaded values, each output rounded once (the first version rounded dh and h to the input dtype
before using them again).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend_choice import use_triton
from .glu import ACTIVATIONS, _activation_and_derivative, glu_backward_reference, glu_reference
from .host_math import cdiv, next_power_of_2
from .registration import launch
from .rounding import round_to


# ---------------------------------------------------------------------------------------------------
# combine
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _combine_kernel(
    p_rows, p_inverse, p_scale, p_out,
    n_cols, stride_rows, stride_out,
    TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One token (program 0) by one column block (program 1): out[t, cols] = sum_k scale[t, k] * rows[inverse]."""
    i_t, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < n_cols
    b_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        i_r = tl.load(p_inverse + i_t * TOP_K + k).to(tl.int64)
        b_row = tl.load(p_rows + i_r * stride_rows + o_n, mask=m_n, other=0.0).to(tl.float32)
        if HAS_SCALE:
            b_row = b_row * tl.load(p_scale + i_t * TOP_K + k).to(tl.float32)
        b_acc += b_row
    tl.store(p_out + i_t * stride_out + o_n, round_to(b_acc, p_out.dtype.element_ty), mask=m_n)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inverse[order[i]] = i, on the device (one scatter; no sort)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=order.device, dtype=order.dtype)
    return inverse


def combine_reference(rows: torch.Tensor, inverse: torch.Tensor, top_k: int, scale: torch.Tensor | None,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """``combine`` in plain PyTorch (fp32, one rounding): where Triton does not run."""
    rows_TKH = rows[inverse].view(inverse.shape[0] // top_k, top_k, -1).float()
    if scale is not None:
        rows_TKH = rows_TKH * scale.reshape(-1, top_k).float().unsqueeze(-1)
    return rows_TKH.sum(1).to(out_dtype)


def combine(rows: torch.Tensor, inverse: torch.Tensor, top_k: int, scale: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in ``out_dtype``: sum_k (scale[t, k] *) rows[inverse[t*K + k]] (module docstring). ``rows`` [S, H]
    with a unit column stride, ``inverse`` [S] (S = T*K), ``scale`` [T, K] or None."""
    n_rows, n_cols = rows.shape
    n_tokens = n_rows // top_k
    if not use_triton(rows) or rows.stride(1) != 1:
        return combine_reference(rows, inverse, top_k, scale, out_dtype)
    out = torch.empty((n_tokens, n_cols), dtype=out_dtype, device=rows.device)
    if out.numel():
        # One program per token and up to 2048 columns: K row loads of 4 KiB (bf16) in flight per program.
        block_n = min(next_power_of_2(n_cols), 2048)
        scale_flat = scale.reshape(-1) if scale is not None else inverse  # any pointer when unused
        launch(_combine_kernel)[(n_tokens, cdiv(n_cols, block_n))](
            rows, inverse, scale_flat, out, n_cols, rows.stride(0), out.stride(0),
            TOP_K=top_k, HAS_SCALE=scale is not None, BLOCK_N=block_n, num_warps=4 if block_n <= 1024 else 8,
        )
    return out


# ---------------------------------------------------------------------------------------------------
# glu_backward_weighted
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _glu_backward_weighted_kernel(
    p_c, p_gu, p_weights, p_order, p_dgu, p_dw, p_hw,
    n_rows, n_cols, stride_c, stride_gu, stride_dgu, stride_hw,
    ACTIVATION: tl.constexpr, STORE_DW: tl.constexpr, STORE_HW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """BLOCK_M sorted rows a program, their n_cols = I columns in BLOCK_N chunks (d w_r sums over all of them)."""
    i_m = tl.program_id(0)
    o_m = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_m = o_m < n_rows
    o_src = tl.load(p_order + o_m, mask=m_m, other=0).to(tl.int64)
    b_w = tl.load(p_weights + o_src, mask=m_m, other=0.0).to(tl.float32)
    b_dw = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for i_n in range(0, tl.cdiv(n_cols, BLOCK_N)):
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mn = m_m[:, None] & (o_n < n_cols)[None, :]
        b_c = tl.load(p_c + o_m[:, None] * stride_c + o_n[None, :], mask=m_mn, other=0.0).to(tl.float32)
        b_g = tl.load(p_gu + o_m[:, None] * stride_gu + o_n[None, :], mask=m_mn, other=0.0).to(tl.float32)
        b_u = tl.load(p_gu + o_m[:, None] * stride_gu + n_cols + o_n[None, :], mask=m_mn, other=0.0).to(tl.float32)
        b_a, b_da = _activation_and_derivative(b_g, ACTIVATION)
        b_h = b_a * b_u
        b_dh = b_c * b_w[:, None]
        tl.store(p_dgu + o_m[:, None] * stride_dgu + o_n[None, :], round_to(b_dh * b_u * b_da,
                 p_dgu.dtype.element_ty), mask=m_mn)
        tl.store(p_dgu + o_m[:, None] * stride_dgu + n_cols + o_n[None, :], round_to(b_dh * b_a,
                 p_dgu.dtype.element_ty), mask=m_mn)
        if STORE_DW:
            b_dw += tl.sum(b_c * b_h, axis=1)
        if STORE_HW:
            tl.store(p_hw + o_m[:, None] * stride_hw + o_n[None, :], round_to(b_h * b_w[:, None],
                     p_hw.dtype.element_ty), mask=m_mn)
    if STORE_DW:
        tl.store(p_dw + o_src, round_to(b_dw, p_dw.dtype.element_ty), mask=m_m)


def glu_backward_weighted_reference(c: torch.Tensor, gu: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                                    activation: str, want_dw: bool, want_hw: bool
                                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``glu_backward_weighted`` in plain PyTorch (fp32 inside, each output rounded once)."""
    w_S1 = weights.reshape(-1)[order].float().unsqueeze(1)
    dh = c.float() * w_S1
    d_gu, _ = glu_backward_reference(dh, gu.float(), None, activation)
    h = glu_reference(gu.float(), None, activation)
    dw = None
    if want_dw:
        dw = torch.empty(order.shape, dtype=weights.dtype, device=c.device)
        dw[order] = (c.float() * h).sum(-1).to(weights.dtype)
    hw = (h * w_S1).to(gu.dtype) if want_hw else None
    return d_gu.to(gu.dtype), dw, hw


def glu_backward_weighted(c: torch.Tensor, gu: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                          activation: str, want_dw: bool, want_hw: bool
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(d_gu [S, 2I] in gu's dtype, dw [T*K] in weights' dtype or None, hw [S, I] in gu's dtype or None) from
    c [S, I], gu [S, 2I] (gate half first), the router weights [T, K] and the sort order [S] (module docstring)."""
    n_rows, n_cols = c.shape
    if not use_triton(c) or c.stride(1) != 1 or gu.stride(1) != 1:
        return glu_backward_weighted_reference(c, gu, weights, order, activation, want_dw, want_hw)
    weights_flat = weights.reshape(-1)
    d_gu = torch.empty((n_rows, 2 * n_cols), dtype=gu.dtype, device=c.device)
    dw = torch.empty((n_rows,), dtype=weights.dtype, device=c.device) if want_dw else None
    hw = torch.empty((n_rows, n_cols), dtype=gu.dtype, device=c.device) if want_hw else None
    if n_rows and n_cols:
        # Tiles of 16 rows x up to 256 columns (~4K elements, the GLU kernels' size) looping over I; not swept.
        block_n = min(next_power_of_2(n_cols), 256)
        block_m = max(1, min(16, 4096 // block_n))
        launch(_glu_backward_weighted_kernel)[(cdiv(n_rows, block_m),)](
            c, gu, weights_flat, order, d_gu, dw if dw is not None else d_gu, hw if hw is not None else d_gu,
            n_rows, n_cols, c.stride(0), gu.stride(0), d_gu.stride(0), hw.stride(0) if hw is not None else 0,
            ACTIVATION=ACTIVATIONS[activation], STORE_DW=want_dw, STORE_HW=want_hw,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
        )
    return d_gu, dw, hw
