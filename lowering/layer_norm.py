"""Fused LayerNorm: ``torch.ops.sloth.layer_norm`` and its manual backward.

The op equals, in one line of PyTorch (shapes: ``x_ND`` rows N by hidden D, ``w_D``, ``b_D``)::

    y_ND = F.layer_norm(x.float(), (D,), w.float(), b.float(), eps).to(out_dtype)

that is ``(x - mean(x)) * rsqrt(mean((x - mean(x))^2) + eps) * w + b`` per row (biased variance), with
``weight=None`` / ``bias=None`` leaving out the product / the sum. Everything is computed in fp32 and
rounded once, at the output; eager bf16 code that rounds the normalised value before the affine step is
less accurate, so the tolerance rule (error vs fp64 at most 2x eager's) holds by construction.

Memory traffic (the roofline): forward reads x (N*D), w and b (D each), writes y (N*D); backward reads x,
dy and w and writes dx (N*D) plus fp32 dW and db partials (P*D each, P programs). Nothing but x is saved
for backward (and w, an input anyway): the per-row mean and rstd are recomputed from the row the backward
kernel loads anyway, two in-register reductions instead of two N-float tensors written and read back.

Backward derivation. Per row, with ``m = mean(x)``, ``c = x - m``, ``r = (mean(c^2) + eps)^(-1/2)``,
``n = c * r``, ``y = n * w + b``::

    dn   = dy * w                      (dy itself without a weight)
    dn/dx: d n_i / d x_j = r * (delta_ij - 1/D) - n_i * n_j * r / D
    dx_j = r * (dn_j - mean_i(dn_i) - n_j * mean_i(dn_i * n_i))
    dw   = sum over rows of dy * n      db = sum over rows of dy   (fp32 partials per program, one .sum(0))

The weight and bias gradients are skipped when they need none (frozen norms under LoRA).
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
from .rounding import mul_rounded, round_to
# The launch shapes of a row-wise norm: whole rows in registers, rows packed per program when short, and
# persistent backward programs summing parameter-gradient partials. Same loads and reductions per element
# as RMSNorm plus one more reduction, so its H200-measured settings are taken over until a sweep of this op.
from .rms_norm import MAX_HIDDEN, _block_sizes, _bwd_launch_config

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _row_mean(b_v, n_cols):
    """sum(b_v, axis=1) / n_cols with an IEEE division. A plain fp32 ``/`` is not one on NVIDIA GPUs (div.full.f32,
    a multiply by an approximate reciprocal, which the compiler may fuse into what follows): on an H100 rows of
    3.0 (D = 40) gave c = x - mean = -4.47e-8 = -120 * (fl(1/40) - 1/40), not 0, and rstd = eps^(-1/2) = 316 made
    y 1.6e-5 off where eager's is exact. A constant row's sum is exact, and so is its correctly rounded
    quotient. One division a row: no measurable cost."""
    return tl.math.div_rn(tl.sum(b_v, axis=1), tl.zeros((b_v.shape[0],), tl.float32) + n_cols)


@triton.jit
def _layer_norm_fwd_kernel(
    p_x, p_w, p_b, p_y,
    n_rows, n_cols, stride_x, stride_y,
    eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_m = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < n_cols
    m_md = (o_m < n_rows)[:, None] & m_d[None, :]
    b_x = tl.load(p_x + o_m[:, None] * stride_x + o_d[None, :], mask=m_md, other=0.0).to(tl.float32)
    b_mean = _row_mean(b_x, n_cols)
    # Padding columns must not enter the variance: x - mean is -mean there.
    b_c = tl.where(m_md, b_x - b_mean[:, None], 0.0)
    b_rstd = 1.0 / tl.sqrt(_row_mean(b_c * b_c, n_cols) + eps)
    b_y = b_c * b_rstd[:, None]
    if HAS_WEIGHT:
        b_y = b_y * tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        b_y = b_y + tl.load(p_b + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    tl.store(p_y + o_m[:, None] * stride_y + o_d[None, :], round_to(b_y, p_y.dtype.element_ty), mask=m_md)


@triton.jit
def _layer_norm_bwd_kernel(
    p_dy, p_x, p_w, p_dx, p_dw_partial, p_db_partial,
    n_rows, n_cols, stride_dy, stride_x, stride_dx, blocks_per_prog,
    eps,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Each program walks its own run of ``blocks_per_prog`` row blocks, so that the fp32 dW and db partial
    # sums of the rows it saw stay in registers and are written once.
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < n_cols
    if HAS_WEIGHT:
        b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    b_db = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i_blk in range(0, blocks_per_prog):
        o_m = ((i_p * blocks_per_prog + i_blk) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_md = (o_m < n_rows)[:, None] & m_d[None, :]
        b_x = tl.load(p_x + o_m[:, None] * stride_x + o_d[None, :], mask=m_md, other=0.0).to(tl.float32)
        b_dy = tl.load(p_dy + o_m[:, None] * stride_dy + o_d[None, :], mask=m_md, other=0.0).to(tl.float32)
        b_mean = _row_mean(b_x, n_cols)
        b_c = tl.where(m_md, b_x - b_mean[:, None], 0.0)
        b_rstd = 1.0 / tl.sqrt(_row_mean(b_c * b_c, n_cols) + eps)
        b_n = b_c * b_rstd[:, None]
        if HAS_WEIGHT:
            # dn rounded before it is both averaged and subtracted from its mean: an FMA of dy * w with the
            # subtraction left the product's roundoff times rstd (eps^-1/2 = 316 on a constant row), 8e-6 on an
            # H100 where the exact dx of a one-column row is 0.
            b_dn = mul_rounded(b_dy, b_w[None, :] + tl.zeros_like(b_dy))
        else:
            b_dn = b_dy
        b_mean_dn = _row_mean(b_dn, n_cols)
        b_mean_dn_n = _row_mean(b_dn * b_n, n_cols)
        b_dx = b_rstd[:, None] * (b_dn - b_mean_dn[:, None] - b_n * b_mean_dn_n[:, None])
        tl.store(p_dx + o_m[:, None] * stride_dx + o_d[None, :], round_to(b_dx, p_dx.dtype.element_ty), mask=m_md)
        if COMPUTE_DW:
            b_dw += tl.sum(b_dy * b_n, axis=0)
        if COMPUTE_DB:
            b_db += tl.sum(b_dy, axis=0)
    if COMPUTE_DW:
        tl.store(p_dw_partial + i_p * n_cols + o_d, b_dw, mask=m_d)
    if COMPUTE_DB:
        tl.store(p_db_partial + i_p * n_cols + o_d, b_db, mask=m_d)


def _check_inputs(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"sloth.layer_norm: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("sloth.layer_norm: x must have at least one dimension (the normalised one)")
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"sloth.layer_norm: last dimension {x.shape[-1]} exceeds the single-pass limit {MAX_HIDDEN}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dim() != 1 or t.shape[0] != x.shape[-1]:
            raise ValueError(f"sloth.layer_norm: {name} must have shape ({x.shape[-1]},) to match x's last "
                             f"dimension, got {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"sloth.layer_norm: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    check_one_device("sloth.layer_norm", ("x", x), ("weight", weight), ("bias", bias))


def _unit_stride(v: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A [D] vector as the kernels read it, element d at data_ptr + d (an expanded or strided one is copied)."""
    return v if v is None or v.stride(0) == 1 else v.contiguous()


def layer_norm_reference(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """The op's math in plain PyTorch (fp32, one rounding): the fallback where Triton cannot run.

    Contiguous output whatever x's layout, as the fake implementation promises.
    """
    xf = x.float()
    c = xf - xf.mean(-1, keepdim=True)
    y = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).contiguous()


def layer_norm_backward_reference(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                                  compute_dw: bool, compute_db: bool
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The derivation in the module docstring, in plain PyTorch (fp32)."""
    xf, dyf = x.float(), dy.float()
    c = xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)
    n = c * rstd
    dn = dyf * weight.float() if weight is not None else dyf
    dx = rstd * (dn - dn.mean(-1, keepdim=True) - n * (dn * n).mean(-1, keepdim=True))
    dw = (dyf * n).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype) if compute_dw else x.new_empty(0)
    db = dyf.reshape(-1, x.shape[-1]).sum(0) if compute_db else x.new_empty(0)
    return dx.to(x.dtype).contiguous(), dw, db


def _layer_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                    out_dtype: torch.dtype) -> torch.Tensor:
    _check_inputs(x, weight, bias)
    if not use_triton(x):
        return layer_norm_reference(x, weight, bias, eps, out_dtype)
    x_ND = rows_2d(x)
    n_rows, n_cols = x_ND.shape
    weight, bias = _unit_stride(weight), _unit_stride(bias)
    y_ND = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    if n_rows > 0 and n_cols > 0:
        block_m, block_d, num_warps = _block_sizes(n_rows, n_cols)
        _layer_norm_fwd_kernel[(cdiv(n_rows, block_m),)](
            x_ND, weight if weight is not None else x_ND, bias if bias is not None else x_ND, y_ND,
            n_rows, n_cols, x_ND.stride(0), y_ND.stride(0),
            float(eps),
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
        )
    return y_ND.view(x.shape)


def _layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, compute_dw: bool,
                    compute_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db); dw and db are empty tensors where not requested (dw also without a weight)."""
    _check_inputs(x, weight, None)
    compute_dw = compute_dw and weight is not None
    if not use_triton(x):
        return layer_norm_backward_reference(dy, x, weight, eps, compute_dw, compute_db)
    x_ND, dy_ND = rows_2d(x), rows_2d(dy)
    n_rows, n_cols = x_ND.shape
    weight = _unit_stride(weight)
    dx_ND = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0 or n_cols == 0:
        dw = torch.zeros_like(weight) if compute_dw else x.new_empty(0)
        db = x.new_zeros(n_cols, dtype=torch.float32) if compute_db else x.new_empty(0)
        return dx_ND.view(x.shape), dw, db
    block_m, block_d, num_warps, n_progs = _bwd_launch_config(x, n_rows, n_cols, compute_dw or compute_db)
    n_blocks = cdiv(n_rows, block_m)
    blocks_per_prog = cdiv(n_blocks, n_progs)
    n_progs = cdiv(n_blocks, blocks_per_prog)
    partial = lambda wanted: torch.empty((n_progs, n_cols) if wanted else (0,), dtype=torch.float32,  # noqa: E731
                                         device=x.device)
    dw_partial, db_partial = partial(compute_dw), partial(compute_db)
    _layer_norm_bwd_kernel[(n_progs,)](
        dy_ND, x_ND, weight if weight is not None else x_ND, dx_ND, dw_partial, db_partial,
        n_rows, n_cols, dy_ND.stride(0), x_ND.stride(0), dx_ND.stride(0), blocks_per_prog,
        float(eps),
        HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
    )
    dw = dw_partial.sum(0).to(weight.dtype) if compute_dw else x.new_empty(0)
    db = db_partial.sum(0) if compute_db else x.new_empty(0)
    return dx_ND.view(x.shape), dw, db


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, eps, _ = inputs
    ctx.save_for_backward(x, weight)  # the bias's gradient is sum(dy): it needs no saved tensor
    ctx.eps = eps
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    compute_dw = weight is not None and ctx.needs_input_grad[1]
    compute_db = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
    dx, dw, db = torch.ops.sloth.layer_norm_backward(dy, x, weight, ctx.eps, compute_dw, compute_db)
    return (dx if ctx.needs_input_grad[0] else None, dw if compute_dw else None,
            db.to(ctx.bias_dtype) if compute_db else None, None, None)


@functools.cache
def register() -> None:
    """Define ``sloth::layer_norm`` and ``sloth::layer_norm_backward`` (idempotent)."""
    fwd = define("sloth::layer_norm", _layer_norm_fwd)
    bwd = define("sloth::layer_norm_backward", _layer_norm_bwd)

    @fake(fwd)
    def _(x, weight, bias, eps, out_dtype):
        check_one_device("sloth.layer_norm", ("x", x), ("weight", weight), ("bias", bias))
        return x.new_empty(x.shape, dtype=out_dtype)

    @fake(bwd)
    def _(dy, x, weight, eps, compute_dw, compute_db):
        dw = weight.new_empty(weight.shape) if (compute_dw and weight is not None) else x.new_empty(0)
        db = x.new_empty(x.shape[-1], dtype=torch.float32) if compute_db else x.new_empty(0)
        return x.new_empty(x.shape), dw, db

    fwd.register_autograd(_backward, setup_context=_setup_context)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Fused LayerNorm over the last dimension; see the module docstring for the exact math.

    ``out_dtype`` defaults to x's dtype.
    """
    register()
    return torch.ops.sloth.layer_norm(x, weight, bias, float(eps), out_dtype or x.dtype)
