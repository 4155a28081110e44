"""Fused q/k RMSNorm and RoPE: ``torch.ops.sloth.norm_rope`` and its manual backward.

Qwen3, Qwen3-MoE, Gemma 3 and others normalise each head of q and k (an RMSNorm over head_dim) right before
the rotary embedding. The op equals, for x each of q and k (``[..., D]``, any strides with unit last stride),
its norm's weight ``w`` ([D] or None), ``eps`` and ``offset`` (0, or 1 for Gemma's ``(1 + w)``)::

    y = sloth.rope_single(sloth.rms_norm(x, w, eps, offset, norm_dtype), cos, sin, interleaved)

(lowering/rms_norm.py, lowering/rope.py: rotate-half or interleaved pairs, partial rotary passing the last D - R
dims through) with one difference: the normalised value is not rounded to ``norm_dtype`` between the two.
Everything is fp32 and rounded once, at the output, in ``promote(norm_dtype, cos, sin)``; eager code rounds the
normalised value, the weight product, and RoPE's products and sum, so the fused result is at least as accurate.

Why one op: the two norms and the RoPE are three op calls and three launches forward and three backward (a third
of sloth's op calls in a Qwen3-MoE layer, whose step the host bounds); here one each way. With
``norm_rope`` in compiler/recompute.py's ``RECOMPUTED_OPS`` (benchmarks/variants.py's ``norm_rope_recompute``) the
pair is recomputed in the backward instead of saved: the backward keeps the un-normalised q and k for the norms'
gradient anyway, so the rotated q and k that attention's backward reads cost one more launch there instead of two
[tokens, heads, D] tensors a layer (0.37 GiB at the Qwen3-MoE row), but 2.1 ms of that 53 ms step on an H100
(benchmarks/results/2026-12-05_issue20_norm_rope.md), so by default they are kept.

Memory traffic: forward reads x (N*D), cos and sin, writes y (N*D); backward reads dy, x, cos and sin and writes
dx, plus fp32 dW partials (one row of D a program) where a weight trains. Nothing is saved but x.

Backward. Per row, with ``r = (mean(x^2) + eps)^(-1/2)``, ``xh = x r``, ``v = w + offset``, ``n = xh v`` and ``y =
Rot(n)`` (RoPE, linear in n)::

    dn = Rot^T(dy)                    lowering/rope.py's backward: the rotation by -theta, pass dims copied
    g  = dn * v
    dx = r * (g - xh * mean(g * xh))  lowering/rms_norm.py's derivation with dy := dn
    dw = sum over rows of dn * xh     (fp32 partial sums per program, then one .sum(0))

``bshd_out`` writes y, and in the backward dx, of 4-D ``[b, h, s, d]`` in ``[b, s, h, d]`` memory, as
lowering/rope.py's (its docstring says why: attention's output needs no copy then).

cos and sin get no gradient (position tables: lowering/rope.py says why); asking for one raises.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .backend_choice import use_triton
from .devices import check_one_device
from .host_math import cdiv
from .layout import empty_heads, in_heads_layout
from .registration import define, fake
from .rms_norm import MAX_HIDDEN, rms_norm_backward_reference
from .rope import (_block_sizes, _check_inputs as _check_rope_inputs, _lead_strides, _out_dtype, _rows_meta,
                   rope_reference)
from .rounding import round_to

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _component_offsets(o_h, half, INTERLEAVED: tl.constexpr):
    """Offsets in a row of the two components each rotation mixes, and of their cos/sin entries: halves
    (x[h], x[half + h]; cos[h], cos[half + h]) or interleaved pairs (x[2h], x[2h + 1]; cos[h] for both)."""
    o_1, o_2, o_c1, o_c2 = o_h, half + o_h, o_h, half + o_h
    if INTERLEAVED:  # one return for both layouts: a constexpr branch only rebinds
        o_1, o_2, o_c2 = 2 * o_h, 2 * o_h + 1, o_h
    return o_1, o_2, o_c1, o_c2


@triton.jit
def _row_offsets(o_m, n1, n2, s0, s1, s2):
    """The offset of each row (i0, i1, i2) of a [n0, n1, n2, D] view with strides s0, s1, s2."""
    i2 = o_m % n2
    i1 = (o_m // n2) % n1
    i0 = o_m // (n2 * n1)
    return (i0 * s0 + i1 * s1 + i2 * s2)[:, None]


@triton.jit
def _norm_rope_fwd_block(
    p_x, p_w, p_cos, p_sin, p_y, i_blk,
    n_rows, n1, n2, sx0, sx1, sx2, sc0, sc1, sc2, ss0, ss1, ss2, sy0, sy1, sy2,
    half, n_pass, eps, offset,
    HAS_WEIGHT: tl.constexpr, HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Normalise and rotate BLOCK_M rows of one tensor (y's rows at strides sy*)."""
    n_cols = 2 * half + n_pass
    o_m = (i_blk * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_m = o_m < n_rows
    o_x = _row_offsets(o_m, n1, n2, sx0, sx1, sx2)
    o_c = _row_offsets(o_m, n1, n2, sc0, sc1, sc2)
    o_s = _row_offsets(o_m, n1, n2, ss0, ss1, ss2)
    o_y = _row_offsets(o_m, n1, n2, sy0, sy1, sy2)
    o_h = tl.arange(0, BLOCK_H)[None, :]
    m_h = o_h < half
    m_mh = m_m[:, None] & m_h
    o_1, o_2, o_c1, o_c2 = _component_offsets(o_h, half, INTERLEAVED)
    b_x1 = tl.load(p_x + o_x + o_1, mask=m_mh, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_x + o_x + o_2, mask=m_mh, other=0.0).to(tl.float32)
    b_ss = tl.sum(b_x1 * b_x1, axis=1) + tl.sum(b_x2 * b_x2, axis=1)
    if HAS_PASS:
        o_p = 2 * half + tl.arange(0, BLOCK_P)[None, :]
        m_p = o_p < n_cols
        m_mp = m_m[:, None] & m_p
        b_xp = tl.load(p_x + o_x + o_p, mask=m_mp, other=0.0).to(tl.float32)
        b_ss += tl.sum(b_xp * b_xp, axis=1)
    b_r = (1.0 / tl.sqrt(b_ss / n_cols + eps))[:, None]
    b_n1 = b_x1 * b_r
    b_n2 = b_x2 * b_r
    if HAS_WEIGHT:
        b_n1 = b_n1 * (tl.load(p_w + o_1, mask=m_h, other=0.0).to(tl.float32) + offset)
        b_n2 = b_n2 * (tl.load(p_w + o_2, mask=m_h, other=0.0).to(tl.float32) + offset)
    b_c1 = tl.load(p_cos + o_c + o_c1, mask=m_mh, other=0.0).to(tl.float32)
    b_c2 = tl.load(p_cos + o_c + o_c2, mask=m_mh, other=0.0).to(tl.float32)
    b_s1 = tl.load(p_sin + o_s + o_c1, mask=m_mh, other=0.0).to(tl.float32)
    b_s2 = tl.load(p_sin + o_s + o_c2, mask=m_mh, other=0.0).to(tl.float32)
    tl.store(p_y + o_y + o_1, round_to(b_n1 * b_c1 - b_n2 * b_s1, p_y.dtype.element_ty), mask=m_mh)
    tl.store(p_y + o_y + o_2, round_to(b_n2 * b_c2 + b_n1 * b_s2, p_y.dtype.element_ty), mask=m_mh)
    if HAS_PASS:
        b_np = b_xp * b_r
        if HAS_WEIGHT:
            b_np = b_np * (tl.load(p_w + o_p, mask=m_p, other=0.0).to(tl.float32) + offset)
        tl.store(p_y + o_y + o_p, round_to(b_np, p_y.dtype.element_ty), mask=m_mp)


@triton.jit
def _norm_rope_fwd_kernel(
    p_q, p_k, p_wq, p_wk, p_cos, p_sin, p_qo, p_ko,
    n_rows_q, n1_q, n2_q, sx0_q, sx1_q, sx2_q, sc0_q, sc1_q, sc2_q, ss0_q, ss1_q, ss2_q, sy0_q, sy1_q, sy2_q,
    n_rows_k, n1_k, n2_k, sx0_k, sx1_k, sx2_k, sc0_k, sc1_k, sc2_k, ss0_k, ss1_k, ss2_k, sy0_k, sy1_k, sy2_k,
    half, n_pass, n_blocks_q, eps_q, eps_k, offset_q, offset_k,
    HAS_WEIGHT_Q: tl.constexpr, HAS_WEIGHT_K: tl.constexpr, HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # One launch for q and k: the first n_blocks_q programs take q's rows, the rest k's (as lowering/rope.py).
    i_b = tl.program_id(0)
    if i_b < n_blocks_q:
        _norm_rope_fwd_block(p_q, p_wq, p_cos, p_sin, p_qo, i_b,
                             n_rows_q, n1_q, n2_q, sx0_q, sx1_q, sx2_q, sc0_q, sc1_q, sc2_q, ss0_q, ss1_q, ss2_q,
                             sy0_q, sy1_q, sy2_q, half, n_pass, eps_q, offset_q,
                             HAS_WEIGHT_Q, HAS_PASS, INTERLEAVED, BLOCK_M, BLOCK_H, BLOCK_P)
    else:
        _norm_rope_fwd_block(p_k, p_wk, p_cos, p_sin, p_ko, i_b - n_blocks_q,
                             n_rows_k, n1_k, n2_k, sx0_k, sx1_k, sx2_k, sc0_k, sc1_k, sc2_k, ss0_k, ss1_k, ss2_k,
                             sy0_k, sy1_k, sy2_k, half, n_pass, eps_k, offset_k,
                             HAS_WEIGHT_K, HAS_PASS, INTERLEAVED, BLOCK_M, BLOCK_H, BLOCK_P)


@triton.jit
def _norm_rope_bwd_block(
    p_dy, p_x, p_w, p_cos, p_sin, p_dx, p_dw, i_blk, i_part,
    n_rows, n1, n2, sd0, sd1, sd2, sx0, sx1, sx2, sc0, sc1, sc2, ss0, ss1, ss2, sy0, sy1, sy2,
    half, n_pass, eps, offset,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """dx (rows at strides sy*) of BLOCK_M rows of one tensor, and with COMPUTE_DW their dW in row ``i_part`` of the
    fp32 partials (module docstring)."""
    n_cols = 2 * half + n_pass
    o_m = (i_blk * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_m = o_m < n_rows
    o_d = _row_offsets(o_m, n1, n2, sd0, sd1, sd2)
    o_x = _row_offsets(o_m, n1, n2, sx0, sx1, sx2)
    o_c = _row_offsets(o_m, n1, n2, sc0, sc1, sc2)
    o_s = _row_offsets(o_m, n1, n2, ss0, ss1, ss2)
    o_y = _row_offsets(o_m, n1, n2, sy0, sy1, sy2)
    o_h = tl.arange(0, BLOCK_H)[None, :]
    m_h = o_h < half
    m_mh = m_m[:, None] & m_h
    o_1, o_2, o_c1, o_c2 = _component_offsets(o_h, half, INTERLEAVED)
    # dn = Rot^T(dy)
    b_dy1 = tl.load(p_dy + o_d + o_1, mask=m_mh, other=0.0).to(tl.float32)
    b_dy2 = tl.load(p_dy + o_d + o_2, mask=m_mh, other=0.0).to(tl.float32)
    b_c1 = tl.load(p_cos + o_c + o_c1, mask=m_mh, other=0.0).to(tl.float32)
    b_c2 = tl.load(p_cos + o_c + o_c2, mask=m_mh, other=0.0).to(tl.float32)
    b_s1 = tl.load(p_sin + o_s + o_c1, mask=m_mh, other=0.0).to(tl.float32)
    b_s2 = tl.load(p_sin + o_s + o_c2, mask=m_mh, other=0.0).to(tl.float32)
    b_dn1 = b_dy1 * b_c1 + b_dy2 * b_s2
    b_dn2 = b_dy2 * b_c2 - b_dy1 * b_s1
    # the norm's backward with dy := dn
    b_x1 = tl.load(p_x + o_x + o_1, mask=m_mh, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_x + o_x + o_2, mask=m_mh, other=0.0).to(tl.float32)
    b_ss = tl.sum(b_x1 * b_x1, axis=1) + tl.sum(b_x2 * b_x2, axis=1)
    if HAS_PASS:
        o_p = 2 * half + tl.arange(0, BLOCK_P)[None, :]
        m_p = o_p < n_cols
        m_mp = m_m[:, None] & m_p
        b_xp = tl.load(p_x + o_x + o_p, mask=m_mp, other=0.0).to(tl.float32)
        b_dnp = tl.load(p_dy + o_d + o_p, mask=m_mp, other=0.0).to(tl.float32)
        b_ss += tl.sum(b_xp * b_xp, axis=1)
    b_r = (1.0 / tl.sqrt(b_ss / n_cols + eps))[:, None]
    b_xh1 = b_x1 * b_r
    b_xh2 = b_x2 * b_r
    b_g1 = b_dn1
    b_g2 = b_dn2
    if HAS_WEIGHT:
        b_g1 = b_dn1 * (tl.load(p_w + o_1, mask=m_h, other=0.0).to(tl.float32) + offset)
        b_g2 = b_dn2 * (tl.load(p_w + o_2, mask=m_h, other=0.0).to(tl.float32) + offset)
    b_dot = tl.sum(b_g1 * b_xh1, axis=1) + tl.sum(b_g2 * b_xh2, axis=1)
    if HAS_PASS:
        b_xhp = b_xp * b_r
        b_gp = b_dnp
        if HAS_WEIGHT:
            b_gp = b_dnp * (tl.load(p_w + o_p, mask=m_p, other=0.0).to(tl.float32) + offset)
        b_dot += tl.sum(b_gp * b_xhp, axis=1)
    b_mean = (b_dot / n_cols)[:, None]
    tl.store(p_dx + o_y + o_1, round_to(b_r * (b_g1 - b_xh1 * b_mean), p_dx.dtype.element_ty), mask=m_mh)
    tl.store(p_dx + o_y + o_2, round_to(b_r * (b_g2 - b_xh2 * b_mean), p_dx.dtype.element_ty), mask=m_mh)
    if HAS_PASS:
        tl.store(p_dx + o_y + o_p, round_to(b_r * (b_gp - b_xhp * b_mean), p_dx.dtype.element_ty), mask=m_mp)
    if COMPUTE_DW:
        # rows past n_rows loaded x = 0, so xh = 0 there and they add nothing
        o_w1, o_w2, _, _ = _component_offsets(tl.arange(0, BLOCK_H), half, INTERLEAVED)
        m_w = tl.arange(0, BLOCK_H) < half
        p_row = p_dw + i_part * n_cols
        tl.store(p_row + o_w1, tl.sum(b_dn1 * b_xh1, axis=0), mask=m_w)
        tl.store(p_row + o_w2, tl.sum(b_dn2 * b_xh2, axis=0), mask=m_w)
        if HAS_PASS:
            o_wp = 2 * half + tl.arange(0, BLOCK_P)
            tl.store(p_row + o_wp, tl.sum(b_dnp * b_xhp, axis=0), mask=o_wp < n_cols)


@triton.jit
def _norm_rope_bwd_kernel(
    p_dq, p_dk, p_q, p_k, p_wq, p_wk, p_cos, p_sin, p_dq_in, p_dk_in, p_dw,
    n_rows_q, n1_q, n2_q, sd0_q, sd1_q, sd2_q, sx0_q, sx1_q, sx2_q, sc0_q, sc1_q, sc2_q, ss0_q, ss1_q, ss2_q,
    sy0_q, sy1_q, sy2_q,
    n_rows_k, n1_k, n2_k, sd0_k, sd1_k, sd2_k, sx0_k, sx1_k, sx2_k, sc0_k, sc1_k, sc2_k, ss0_k, ss1_k, ss2_k,
    sy0_k, sy1_k, sy2_k,
    half, n_pass, n_blocks_q, eps_q, eps_k, offset_q, offset_k,
    HAS_WEIGHT_Q: tl.constexpr, HAS_WEIGHT_K: tl.constexpr, COMPUTE_DW_Q: tl.constexpr, COMPUTE_DW_K: tl.constexpr,
    HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # Program i writes row i of the dW partials: q's blocks first, then k's.
    i_b = tl.program_id(0)
    if i_b < n_blocks_q:
        _norm_rope_bwd_block(p_dq, p_q, p_wq, p_cos, p_sin, p_dq_in, p_dw, i_b, i_b,
                             n_rows_q, n1_q, n2_q, sd0_q, sd1_q, sd2_q, sx0_q, sx1_q, sx2_q, sc0_q, sc1_q, sc2_q,
                             ss0_q, ss1_q, ss2_q, sy0_q, sy1_q, sy2_q, half, n_pass, eps_q, offset_q,
                             HAS_WEIGHT_Q, COMPUTE_DW_Q, HAS_PASS, INTERLEAVED, BLOCK_M, BLOCK_H, BLOCK_P)
    else:
        _norm_rope_bwd_block(p_dk, p_k, p_wk, p_cos, p_sin, p_dk_in, p_dw, i_b - n_blocks_q, i_b,
                             n_rows_k, n1_k, n2_k, sd0_k, sd1_k, sd2_k, sx0_k, sx1_k, sx2_k, sc0_k, sc1_k, sc2_k,
                             ss0_k, ss1_k, ss2_k, sy0_k, sy1_k, sy2_k, half, n_pass, eps_k, offset_k,
                             HAS_WEIGHT_K, COMPUTE_DW_K, HAS_PASS, INTERLEAVED, BLOCK_M, BLOCK_H, BLOCK_P)


# ---------------------------------------------------------------------------------------------------
# Checks and the PyTorch reference
# ---------------------------------------------------------------------------------------------------

def _check_inputs(q: torch.Tensor, k: torch.Tensor, q_weight: Optional[torch.Tensor],
                  k_weight: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> None:
    if q.dim() and k.dim() and q.shape[-1] != k.shape[-1]:
        raise ValueError(f"sloth.norm_rope: q and k must have one head dim, got {q.shape[-1]} and {k.shape[-1]}")
    try:  # dtypes, devices and shapes of q, k, cos and sin, as lowering/rope.py checks them
        _check_rope_inputs((q, k), cos, sin, interleaved)
    except (TypeError, ValueError) as error:
        raise type(error)(str(error).replace("sloth.rope:", "sloth.norm_rope:", 1)) from None
    if q.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"sloth.norm_rope: head dim {q.shape[-1]} exceeds the single-pass limit {MAX_HIDDEN}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is None:
            continue
        if w.dim() != 1 or w.shape[0] != q.shape[-1]:
            raise ValueError(f"sloth.norm_rope: {name} must have shape ({q.shape[-1]},), got {tuple(w.shape)}")
        if w.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"sloth.norm_rope: {name} must be float32, bfloat16 or float16, got {w.dtype}")
    check_one_device("sloth.norm_rope", ("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight),
                     ("cos", cos), ("sin", sin))


def _normalised(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float) -> torch.Tensor:
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return n * (weight.float() + offset) if weight is not None else n


def norm_rope_reference(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float,
                        cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype, interleaved: bool = False
                        ) -> torch.Tensor:
    """One tensor's forward in plain PyTorch (fp32, one rounding): the fallback where Triton cannot run."""
    return rope_reference(_normalised(x, weight, eps, offset), cos, sin, False, out_dtype, interleaved)


def norm_rope_backward_reference(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                                 offset: float, cos: torch.Tensor, sin: torch.Tensor, compute_dw: bool,
                                 interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of one tensor by the module docstring's derivation, in plain PyTorch (fp32)."""
    dn = rope_reference(dy, cos, sin, True, torch.float32, interleaved)
    return rms_norm_backward_reference(dn, x, weight, eps, offset, compute_dw and weight is not None)


# ---------------------------------------------------------------------------------------------------
# Launchers: the op's forward and backward
# ---------------------------------------------------------------------------------------------------

def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit-stride rows (a transposed projection view has them already; only exotic layouts copy)."""
    return t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()


def _unit(weight: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return weight if weight is None or weight.stride(0) == 1 else weight.contiguous()


def _geometry(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, interleaved: bool
              ) -> tuple[int, int, int, int, int, int, list[int]]:
    """(half, n_pass, BLOCK_M, BLOCK_H, BLOCK_P, num_warps, blocks of q and k) of one launch."""
    rot, head = cos.shape[-1] * (2 if interleaved else 1), q.shape[-1]
    n_rows = [q.numel() // head if head else 0, k.numel() // head if head else 0]
    block_m, block_h, block_p, num_warps = _block_sizes(max(n_rows), rot // 2, head - rot)
    return rot // 2, head - rot, block_m, block_h, block_p, num_warps, [cdiv(n, block_m) for n in n_rows]


def _norm_rope_fwd(q: torch.Tensor, k: torch.Tensor, q_weight: Optional[torch.Tensor],
                   k_weight: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, q_eps: float, k_eps: float,
                   q_offset: float, k_offset: float, norm_dtype: torch.dtype, interleaved: bool = False,
                   bshd_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, q_weight, k_weight, cos, sin, interleaved)
    out_dtype = _out_dtype(norm_dtype, cos, sin)
    if not use_triton(q):
        return (in_heads_layout(norm_rope_reference(q, q_weight, q_eps, q_offset, cos, sin, out_dtype, interleaved),
                                bshd_out),
                in_heads_layout(norm_rope_reference(k, k_weight, k_eps, k_offset, cos, sin, out_dtype, interleaved),
                                bshd_out))
    q, k = _unit_last(q), _unit_last(k)
    cos, sin = _unit_last(cos), _unit_last(sin)
    q_weight, k_weight = _unit(q_weight), _unit(k_weight)
    q_out, k_out = empty_heads(q, q.shape, out_dtype, bshd_out), empty_heads(k, k.shape, out_dtype, bshd_out)
    half, n_pass, block_m, block_h, block_p, num_warps, n_blocks = _geometry(q, k, cos, interleaved)
    if sum(n_blocks) == 0:
        return q_out, k_out
    _norm_rope_fwd_kernel[(sum(n_blocks),)](
        q, k, q_weight if q_weight is not None else q, k_weight if k_weight is not None else k, cos, sin,
        q_out, k_out, *_rows_meta(q, cos, sin), *_lead_strides(q_out), *_rows_meta(k, cos, sin), *_lead_strides(k_out),
        half, n_pass, n_blocks[0], float(q_eps), float(k_eps), float(q_offset), float(k_offset),
        HAS_WEIGHT_Q=q_weight is not None, HAS_WEIGHT_K=k_weight is not None, HAS_PASS=n_pass > 0,
        INTERLEAVED=interleaved, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_P=block_p, num_warps=num_warps,
    )
    return q_out, k_out


def _norm_rope_bwd(dq: torch.Tensor, dk: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor], cos: torch.Tensor,
                   sin: torch.Tensor, q_eps: float, k_eps: float, q_offset: float, k_offset: float,
                   compute_dwq: bool, compute_dwk: bool, interleaved: bool = False, bshd_out: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq_in, dk_in, d q_weight, d k_weight); a weight's gradient is an empty tensor where not asked for (or
    the weight is None)."""
    _check_inputs(q, k, q_weight, k_weight, cos, sin, interleaved)
    compute_dwq, compute_dwk = compute_dwq and q_weight is not None, compute_dwk and k_weight is not None
    if dq.shape != q.shape or dk.shape != k.shape:
        raise ValueError(f"sloth.norm_rope: the gradients' shapes {tuple(dq.shape)}, {tuple(dk.shape)} differ from "
                         f"q's {tuple(q.shape)} and k's {tuple(k.shape)}")
    if not use_triton(q):
        dq_in, dwq = norm_rope_backward_reference(dq, q, q_weight, q_eps, q_offset, cos, sin, compute_dwq, interleaved)
        dk_in, dwk = norm_rope_backward_reference(dk, k, k_weight, k_eps, k_offset, cos, sin, compute_dwk, interleaved)
        return in_heads_layout(dq_in, bshd_out), in_heads_layout(dk_in, bshd_out), dwq, dwk
    q, k, dq, dk = _unit_last(q), _unit_last(k), _unit_last(dq), _unit_last(dk)
    cos, sin = _unit_last(cos), _unit_last(sin)
    q_weight, k_weight = _unit(q_weight), _unit(k_weight)
    dq_in, dk_in = empty_heads(q, q.shape, q.dtype, bshd_out), empty_heads(k, k.shape, k.dtype, bshd_out)
    half, n_pass, block_m, block_h, block_p, num_warps, n_blocks = _geometry(q, k, cos, interleaved)
    head = q.shape[-1]
    partials = torch.empty((sum(n_blocks), head) if compute_dwq or compute_dwk else (0,), dtype=torch.float32,
                           device=q.device)
    if sum(n_blocks):
        _norm_rope_bwd_kernel[(sum(n_blocks),)](
            dq, dk, q, k, q_weight if q_weight is not None else q, k_weight if k_weight is not None else k,
            cos, sin, dq_in, dk_in, partials if partials.numel() else dq_in,
            *_meta_with_grad(q, dq, cos, sin), *_lead_strides(dq_in), *_meta_with_grad(k, dk, cos, sin),
            *_lead_strides(dk_in),
            half, n_pass, n_blocks[0], float(q_eps), float(k_eps), float(q_offset), float(k_offset),
            HAS_WEIGHT_Q=q_weight is not None, HAS_WEIGHT_K=k_weight is not None,
            COMPUTE_DW_Q=compute_dwq, COMPUTE_DW_K=compute_dwk, HAS_PASS=n_pass > 0, INTERLEAVED=interleaved,
            BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_P=block_p, num_warps=num_warps,
        )
    dwq = partials[:n_blocks[0]].sum(0).to(q_weight.dtype) if compute_dwq else q.new_empty(0)
    dwk = partials[n_blocks[0]:].sum(0).to(k_weight.dtype) if compute_dwk else k.new_empty(0)
    return dq_in, dk_in, dwq, dwk


def _meta_with_grad(x: torch.Tensor, dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[int]:
    """[n_rows, n1, n2, 3 strides of dy, 3 of x, 3 of cos, 3 of sin]: the backward block's row geometry."""
    meta_x, meta_dy = _rows_meta(x, cos, sin), _rows_meta(dy, cos, sin)
    return [*meta_x[:3], *meta_dy[3:6], *meta_x[3:]]


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    # graphs made before bshd_out omit it
    q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, q_offset, k_offset, _norm_dtype, interleaved, bshd_out = \
        (*inputs, False)[:13]
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
    ctx.scalars = (q_eps, k_eps, q_offset, k_offset)
    ctx.interleaved, ctx.bshd_out = interleaved, bshd_out
    ctx.n_inputs = len(inputs)


def _backward(ctx, dq, dk):
    if ctx.needs_input_grad[4] or ctx.needs_input_grad[5]:
        raise RuntimeError("sloth.norm_rope: cos and sin get no gradient from this op (they are position tables); "
                           "detach them, or leave this RoPE unfused")
    q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
    # An output nobody used has no cotangent; its input's gradient is then that of zeros.
    dq = dq if dq is not None else cos.new_zeros(q.shape)
    dk = dk if dk is not None else cos.new_zeros(k.shape)
    compute_dwq = q_weight is not None and ctx.needs_input_grad[2]
    compute_dwk = k_weight is not None and ctx.needs_input_grad[3]
    dq_in, dk_in, dwq, dwk = torch.ops.sloth.norm_rope_backward(dq, dk, q, k, q_weight, k_weight, cos, sin,
                                                                *ctx.scalars, compute_dwq, compute_dwk,
                                                                ctx.interleaved, ctx.bshd_out)
    return (dq_in, dk_in, dwq if compute_dwq else None, dwk if compute_dwk else None,
            None, None, None, None, None, None, None, None, None)[:ctx.n_inputs]


@functools.cache
def register() -> None:
    """Define ``sloth::norm_rope`` and ``sloth::norm_rope_backward`` (idempotent)."""
    fwd = define("sloth::norm_rope", _norm_rope_fwd)
    bwd = define("sloth::norm_rope_backward", _norm_rope_bwd)

    @fake(fwd)
    def _(q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, q_offset, k_offset, norm_dtype, interleaved=False,
          bshd_out=False):
        check_one_device("sloth.norm_rope", ("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight),
                         ("cos", cos), ("sin", sin))  # meta inputs land here (lowering/devices.py)
        out_dtype = _out_dtype(norm_dtype, cos, sin)
        return empty_heads(q, q.shape, out_dtype, bshd_out), empty_heads(k, k.shape, out_dtype, bshd_out)

    @fake(bwd)
    def _(dq, dk, q, k, q_weight, k_weight, cos, sin, q_eps, k_eps, q_offset, k_offset, compute_dwq, compute_dwk,
          interleaved=False, bshd_out=False):
        dwq = q_weight.new_empty(q_weight.shape) if compute_dwq and q_weight is not None else q.new_empty(0)
        dwk = k_weight.new_empty(k_weight.shape) if compute_dwk and k_weight is not None else k.new_empty(0)
        return empty_heads(q, q.shape, q.dtype, bshd_out), empty_heads(k, k.shape, k.dtype, bshd_out), dwq, dwk

    fwd.register_autograd(_backward, setup_context=_setup_context)


def norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor],
              cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
              norm_dtype: Optional[torch.dtype] = None, interleaved: bool = False, k_eps: Optional[float] = None,
              k_offset: Optional[float] = None, bshd_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm each head of q and k over its last dim, then rotate both by cos/sin, in one launch; see the module
    docstring for the exact math. ``norm_dtype`` (default q's dtype) is the norms' output dtype, which with cos
    and sin decides the result's; ``k_eps`` and ``k_offset`` default to q's; ``bshd_out`` lays 4-D results
    [b, h, s, d] out as [b, s, h, d] (lowering/rope.py), the backward's input gradients too."""
    register()
    return torch.ops.sloth.norm_rope(q, k, q_weight, k_weight, cos, sin, float(eps),
                                     float(eps if k_eps is None else k_eps), float(offset),
                                     float(offset if k_offset is None else k_offset), norm_dtype or q.dtype,
                                     interleaved, bshd_out)
