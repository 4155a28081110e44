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
activations as they are and multiply with fp32 accuracy on tensor cores (``tf32x3``: each fp32 operand
split into three TF32 parts; the error is that of an fp32 FMA GEMM, not of TF32), and the adapter's
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

from .backend_choice import use_triton

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _lora_down_kernel(p_x, p_p, p_h, M, K, R, stride_xm, stride_pk, stride_pr,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """h[M, R] (fp32) = x[M, K] @ p[K, R]: one program per BLOCK_M rows, the whole K looped over."""
    i_m = tl.program_id(0)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_r = tl.arange(0, BLOCK_R)
    m_m, m_r = o_m < M, o_r < R
    b_h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_x = tl.load(p_x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_p = tl.load(p_p + o_k[:, None] * stride_pk + o_r[None, :] * stride_pr, mask=m_k[:, None] & m_r[None, :],
                      other=0.0)
        b_h += tl.dot(b_x.to(tl.float32), b_p.to(tl.float32), input_precision="tf32x3")
    tl.store(p_h + o_m[:, None] * R + o_r[None, :], b_h, mask=m_m[:, None] & m_r[None, :])


@triton.jit
def _lora_up_add_kernel(p_base, p_h, p_q, p_y, M, N, R, stride_bm, stride_qr, stride_qn, stride_ym, scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[M, N] = base[M, N] + scale * h[M, R] @ q[R, N], summed in fp32, rounded once to y's dtype.
    ``y`` may be ``base`` itself (each program reads its tile before writing it)."""
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_r = tl.arange(0, BLOCK_R)
    m_m, m_n, m_r = o_m < M, o_n < N, o_r < R
    b_h = tl.load(p_h + o_m[:, None] * R + o_r[None, :], mask=m_m[:, None] & m_r[None, :], other=0.0)
    b_q = tl.load(p_q + o_r[:, None] * stride_qr + o_n[None, :] * stride_qn, mask=m_r[:, None] & m_n[None, :],
                  other=0.0)
    b_low = tl.dot(b_h, b_q.to(tl.float32), input_precision="tf32x3")
    m_mn = m_m[:, None] & m_n[None, :]
    b_base = tl.load(p_base + o_m[:, None] * stride_bm + o_n[None, :], mask=m_mn, other=0.0).to(tl.float32)
    b_y = b_base + scale * b_low
    tl.store(p_y + o_m[:, None] * stride_ym + o_n[None, :], b_y.to(p_y.dtype.element_ty), mask=m_mn)


@triton.jit
def _lora_grad_kernel(p_u, p_x, p_g, M, K, R, stride_xm, rows_per_split,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """g[split, R, K] (fp32) = u[rows, R].T @ x[rows, K] over one split's rows: grid (K blocks, splits).
    The host sums the splits (a deterministic reduction, no atomics)."""
    i_k, i_s = tl.program_id(0), tl.program_id(1)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    o_r = tl.arange(0, BLOCK_R)
    m_k, m_r = o_k < K, o_r < R
    row_start = i_s * rows_per_split
    row_stop = tl.minimum(row_start + rows_per_split, M)
    b_g = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for m0 in range(row_start, row_stop, BLOCK_M):
        o_m = m0 + tl.arange(0, BLOCK_M)
        m_m = o_m < row_stop
        b_ut = tl.load(p_u + o_m[None, :] * R + o_r[:, None], mask=m_r[:, None] & m_m[None, :], other=0.0)
        b_x = tl.load(p_x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_g += tl.dot(b_ut, b_x.to(tl.float32), input_precision="tf32x3")
    tl.store(p_g + i_s * R * K + o_r[:, None] * K + o_k[None, :], b_g, mask=m_r[:, None] & m_k[None, :])


# ---------------------------------------------------------------------------------------------------
# Host launchers. Every 2-D operand has a unit last stride (``_rows``); the adapter factors are read
# through their strides, so a.T and b.T are never copied.
# ---------------------------------------------------------------------------------------------------

def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot needs every dimension >= 16


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, last dim] with a unit last stride (a view where the layout allows)."""
    t_2d = t.reshape(-1, t.shape[-1])
    return t_2d if t_2d.stride(-1) == 1 or t_2d.shape[-1] == 1 else t_2d.contiguous()


def _down(x_MK: torch.Tensor, p_KR: torch.Tensor) -> torch.Tensor:
    """``x_MK @ p_KR`` in fp32 ([M, R]); ``p_KR`` may be any strided view (a.T, or b)."""
    n_rows, k = x_MK.shape
    rank = p_KR.shape[1]
    h_MR = torch.empty((n_rows, rank), dtype=torch.float32, device=x_MK.device)
    if n_rows == 0:
        return h_MR
    if k == 0:
        return h_MR.zero_()
    block_m = 32 if n_rows >= 32 * 64 else 16  # enough programs to keep the SMs streaming x
    _lora_down_kernel[(triton.cdiv(n_rows, block_m),)](
        x_MK, p_KR, h_MR, n_rows, k, rank, x_MK.stride(0), p_KR.stride(0), p_KR.stride(1),
        BLOCK_M=block_m, BLOCK_K=128, BLOCK_R=_block_r(rank), num_warps=4,
    )
    return h_MR


def _up_add_(base_MN: torch.Tensor, h_MR: torch.Tensor, q_RN: torch.Tensor, scale: float) -> torch.Tensor:
    """``base_MN += scale * h_MR @ q_RN`` in place (fp32 sum, one rounding); returns base_MN."""
    n_rows, n_cols = base_MN.shape
    if base_MN.numel() == 0:
        return base_MN
    block_m, block_n = 64, 128
    _lora_up_add_kernel[(triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))](
        base_MN, h_MR, q_RN, base_MN, n_rows, n_cols, h_MR.shape[1], base_MN.stride(0),
        q_RN.stride(0), q_RN.stride(1), base_MN.stride(0), float(scale),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_block_r(h_MR.shape[1]), num_warps=4,
    )
    return base_MN


def _grad(u_MR: torch.Tensor, x_MK: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * u_MR.T @ x_MK`` in fp32 ([R, K]), the M rows split so the grid covers the GPU."""
    n_rows, k = x_MK.shape
    rank = u_MR.shape[1]
    if n_rows == 0 or k == 0:
        return torch.zeros((rank, k), dtype=torch.float32, device=x_MK.device)
    block_m, block_k = 32, 64
    k_blocks = triton.cdiv(k, block_k)
    # About four programs per SM in all (132 SMs on an H200), each with at least 4 row blocks.
    splits = max(1, min(triton.cdiv(528, k_blocks), triton.cdiv(n_rows, 4 * block_m)))
    rows_per_split = triton.cdiv(triton.cdiv(n_rows, splits), block_m) * block_m
    splits = triton.cdiv(n_rows, rows_per_split)
    g_SRK = torch.empty((splits, rank, k), dtype=torch.float32, device=x_MK.device)
    _lora_grad_kernel[(k_blocks, splits)](
        u_MR, x_MK, g_SRK, n_rows, k, rank, x_MK.stride(0), rows_per_split,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=_block_r(rank), num_warps=4,
    )
    g_RK = g_SRK[0] if splits == 1 else g_SRK.sum(0)
    return g_RK.mul_(scale)


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


def lora_linear_reference(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor,
                          b: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) by the module docstring's formulas in plain PyTorch, the adapter path in fp32."""
    x2 = x.reshape(-1, x.shape[-1])
    h = x2.float() @ a.float().t()
    y2 = (F.linear(x2, w, bias).float() + scale * (h @ b.float().t())).to(x.dtype)
    return y2.view(*x.shape[:-1], w.shape[0]), h


def _lora_fwd(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(x, w, bias, a, b)
    if not use_triton(x):
        return lora_linear_reference(x, w, bias, a, b, scale)
    x_MK = _rows(x)
    h_MR = _down(x_MK, a.t())
    y_MN = _up_add_(F.linear(x_MK, w, bias), h_MR, b.t(), scale)  # cuBLAS writes base, the kernel adds in place
    return y_MN.view(*x.shape[:-1], w.shape[0]), h_MR


def _lora_bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              h: torch.Tensor, scale: float, need_dx: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, da, db); dx is empty when ``need_dx`` is False."""
    if not use_triton(x):
        dy2, x2 = dy.reshape(-1, dy.shape[-1]).float(), x.reshape(-1, x.shape[-1]).float()
        g = dy2 @ b.float()
        dx = ((dy2 @ w.float()).to(x.dtype).float() + scale * (g @ a.float())).to(x.dtype).view(x.shape) \
            if need_dx else x.new_empty(0)
        return dx, (scale * g.t() @ x2).to(a.dtype), (scale * dy2.t() @ h).to(b.dtype)
    dy_MN, x_MK = _rows(dy), _rows(x)
    g_MR = _down(dy_MN, b)
    dx = _up_add_(dy_MN @ w, g_MR, a, scale).view(x.shape) if need_dx else x.new_empty(0)
    da = _grad(g_MR, x_MK, scale).to(a.dtype)
    db = _grad(h, dy_MN, scale).t().to(b.dtype).contiguous()
    return dx, da, db


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    x, w, bias, a, b, scale = inputs
    _, h = output
    ctx.save_for_backward(x, w, a, b, h)
    ctx.scale = scale
    ctx.has_bias = bias is not None


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
    fwd = torch.library.custom_op("sloth::lora_linear", mutates_args=())(_lora_fwd)
    bwd = torch.library.custom_op("sloth::lora_linear_backward", mutates_args=())(_lora_bwd)

    @fwd.register_fake
    def _(x, w, bias, a, b, scale):
        rows = math.prod(x.shape[:-1])
        return x.new_empty((*x.shape[:-1], w.shape[0])), x.new_empty((rows, a.shape[0]), dtype=torch.float32)

    @bwd.register_fake
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
