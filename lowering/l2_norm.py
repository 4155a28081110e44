"""Fused L2 normalisation over the last dimension: ``torch.ops.sloth.l2_norm`` and its manual backward.

Two functions, told apart by ``clamp`` because they put eps in different places:

    clamp=True:   y = x / max(||x||, eps)              F.normalize(x, dim=-1, eps=eps)
    clamp=False:  y = x * rsqrt(sum(x^2) + eps)        q/k L2-norms written out, x / sqrt(sum(x^2) + eps)

(``||x||`` the Euclidean norm of the row.) Both in fp32, rounded once to ``out_dtype``. There is no weight;
a mean instead of the sum is an RMSNorm without weight (Llama 4's ``L2Norm``), which the rms_norm family takes.

Memory traffic: forward reads x (N*D) and writes y (N*D); backward reads x and dy and writes dx. Only x is
saved; the row's sum of squares is recomputed in the backward from the row it loads anyway.

Backward derivation. Per row, with ``s = sum(x^2)`` and ``r`` the scale, ``y = x * r``:

    clamp=False:  r = (s + eps)^(-1/2),  dr/dx_j = -r^3 x_j
                  dx_j = r * dy_j - x_j * r^3 * sum_i(dy_i x_i) = r * (dy_j - y_j * sum_i(dy_i y_i))
    clamp=True:   ||x|| >= eps: r = 1/||x||, dr/dx_j = -x_j / ||x||^3, the same formula
                  ||x|| <  eps: r = 1/eps is a constant, dx_j = r * dy_j
                  (the boundary ||x|| == eps takes the norm's branch where the installed torch's clamp_min
                  passes its gradient there, torch <= 2.13; else the constant's: lowering/torch_conventions.py)
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
from .layout import rows_2d
from .registration import define, fake
from .rounding import round_to
# Whole rows in registers, short rows packed per program (see lowering/rms_norm.py for the measurements).
from .rms_norm import MAX_HIDDEN, _block_sizes
from .torch_conventions import CLAMP_PASSES_AT_BOUND

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _l2_scale(b_sumsq, eps, CLAMP: tl.constexpr):
    """Per-row scale r, y = x * r: 1 / max(sqrt(s), eps) or rsqrt(s + eps)."""
    if CLAMP:
        return 1.0 / tl.maximum(tl.sqrt(b_sumsq), eps)
    else:
        return 1.0 / tl.sqrt(b_sumsq + eps)


@triton.jit
def _l2_norm_fwd_kernel(
    p_x, p_y, n_rows, n_cols, stride_x, stride_y, eps,
    CLAMP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_m = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_md = (o_m < n_rows)[:, None] & (o_d < n_cols)[None, :]
    b_x = tl.load(p_x + o_m[:, None] * stride_x + o_d[None, :], mask=m_md, other=0.0).to(tl.float32)
    b_r = _l2_scale(tl.sum(b_x * b_x, axis=1), eps, CLAMP)
    tl.store(p_y + o_m[:, None] * stride_y + o_d[None, :], round_to(b_x * b_r[:, None], p_y.dtype.element_ty),
             mask=m_md)


@triton.jit
def _l2_norm_bwd_kernel(
    p_dy, p_x, p_dx, n_rows, n_cols, stride_dy, stride_x, stride_dx, eps,
    CLAMP: tl.constexpr, PASS_AT_BOUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``PASS_AT_BOUND``: whether a row whose norm equals eps takes the norm's gradient, as the installed torch's
    clamp_min passes it (``CLAMP_PASSES_AT_BOUND``, read by the launcher at each call: a module-level constexpr would
    be frozen into the first compile, and Triton refuses a changed global)."""
    i_m = tl.program_id(0)
    o_m = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_md = (o_m < n_rows)[:, None] & (o_d < n_cols)[None, :]
    b_x = tl.load(p_x + o_m[:, None] * stride_x + o_d[None, :], mask=m_md, other=0.0).to(tl.float32)
    b_dy = tl.load(p_dy + o_m[:, None] * stride_dy + o_d[None, :], mask=m_md, other=0.0).to(tl.float32)
    b_sumsq = tl.sum(b_x * b_x, axis=1)
    b_r = _l2_scale(b_sumsq, eps, CLAMP)
    b_y = b_x * b_r[:, None]
    b_dot = tl.sum(b_dy * b_y, axis=1)
    if CLAMP:  # a row clamped to eps has a constant scale: no gradient through its norm
        if PASS_AT_BOUND:
            b_dot = tl.where(tl.sqrt(b_sumsq) >= eps, b_dot, 0.0)
        else:
            b_dot = tl.where(tl.sqrt(b_sumsq) > eps, b_dot, 0.0)
    b_dx = b_r[:, None] * (b_dy - b_y * b_dot[:, None])
    tl.store(p_dx + o_m[:, None] * stride_dx + o_d[None, :], round_to(b_dx, p_dx.dtype.element_ty), mask=m_md)


def _check_inputs(x: torch.Tensor) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"sloth.l2_norm: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("sloth.l2_norm: x must have at least one dimension (the normalised one)")
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"sloth.l2_norm: last dimension {x.shape[-1]} exceeds the single-pass limit {MAX_HIDDEN}")


def _scale_reference(xf: torch.Tensor, eps: float, clamp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    sumsq = xf.pow(2).sum(-1, keepdim=True)
    if clamp:
        norm = sumsq.sqrt()
        return 1.0 / norm.clamp_min(eps), (norm >= eps) if CLAMP_PASSES_AT_BOUND else (norm > eps)
    return torch.rsqrt(sumsq + eps), torch.ones_like(sumsq, dtype=torch.bool)


def l2_norm_reference(x: torch.Tensor, eps: float, clamp: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """The op's math in plain PyTorch (fp32, one rounding): the fallback where Triton cannot run."""
    xf = x.float()
    return (xf * _scale_reference(xf, eps, clamp)[0]).to(out_dtype).contiguous()


def l2_norm_backward_reference(dy: torch.Tensor, x: torch.Tensor, eps: float, clamp: bool) -> torch.Tensor:
    """The derivation in the module docstring, in plain PyTorch (fp32)."""
    xf, dyf = x.float(), dy.float()
    r, through = _scale_reference(xf, eps, clamp)
    y = xf * r
    dot = torch.where(through, (dyf * y).sum(-1, keepdim=True), 0.0)
    return (r * (dyf - y * dot)).to(x.dtype).contiguous()


def _l2_norm_fwd(x: torch.Tensor, eps: float, clamp: bool, out_dtype: torch.dtype) -> torch.Tensor:
    _check_inputs(x)
    if not use_triton(x):
        return l2_norm_reference(x, eps, clamp, out_dtype)
    x_ND = rows_2d(x)
    n_rows, n_cols = x_ND.shape
    y_ND = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    if n_rows > 0 and n_cols > 0:
        block_m, block_d, num_warps = _block_sizes(n_rows, n_cols)
        _l2_norm_fwd_kernel[(cdiv(n_rows, block_m),)](
            x_ND, y_ND, n_rows, n_cols, x_ND.stride(0), y_ND.stride(0), float(eps),
            CLAMP=bool(clamp), BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
        )
    return y_ND.view(x.shape)


def _l2_norm_bwd(dy: torch.Tensor, x: torch.Tensor, eps: float, clamp: bool) -> torch.Tensor:
    _check_inputs(x)
    if not use_triton(x):
        return l2_norm_backward_reference(dy, x, eps, clamp)
    x_ND, dy_ND = rows_2d(x), rows_2d(dy)
    n_rows, n_cols = x_ND.shape
    dx_ND = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows > 0 and n_cols > 0:
        block_m, block_d, num_warps = _block_sizes(n_rows, n_cols)
        _l2_norm_bwd_kernel[(cdiv(n_rows, block_m),)](
            dy_ND, x_ND, dx_ND, n_rows, n_cols, dy_ND.stride(0), x_ND.stride(0), dx_ND.stride(0), float(eps),
            CLAMP=bool(clamp), PASS_AT_BOUND=CLAMP_PASSES_AT_BOUND, BLOCK_M=block_m, BLOCK_D=block_d,
            num_warps=num_warps,
        )
    return dx_ND.view(x.shape)


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    x, eps, clamp, _ = inputs
    ctx.save_for_backward(x)
    ctx.eps, ctx.clamp = eps, clamp


def _backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return torch.ops.sloth.l2_norm_backward(dy, x, ctx.eps, ctx.clamp), None, None, None


@functools.cache
def register() -> None:
    """Define ``sloth::l2_norm`` and ``sloth::l2_norm_backward`` (idempotent)."""
    fwd = define("sloth::l2_norm", _l2_norm_fwd)
    bwd = define("sloth::l2_norm_backward", _l2_norm_bwd)

    @fake(fwd)
    def _(x, eps, clamp, out_dtype):
        return x.new_empty(x.shape, dtype=out_dtype)

    @fake(bwd)
    def _(dy, x, eps, clamp):
        check_one_device("sloth.l2_norm_backward", ("x", x), ("dy", dy))
        return x.new_empty(x.shape)

    fwd.register_autograd(_backward, setup_context=_setup_context)


def l2_norm(x: torch.Tensor, eps: float = 1e-12, clamp: bool = True, out_dtype: Optional[torch.dtype] = None
            ) -> torch.Tensor:
    """Fused L2 normalisation over the last dimension; ``clamp`` picks the eps semantics (module docstring).

    The defaults are ``F.normalize(x, dim=-1)``'s; ``out_dtype`` defaults to x's dtype.
    """
    register()
    return torch.ops.sloth.l2_norm(x, float(eps), bool(clamp), out_dtype or x.dtype)
