"""Fused RMSNorm: ``torch.ops.sloth.rms_norm`` and its manual backward.

The op equals, in one line of PyTorch (shapes: ``x_ND`` rows N by hidden D, ``w_D``)::

    y_ND = (x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * (w.float() + offset)).to(out_dtype)

``offset`` is 0 for Llama-style norms and 1 for Gemma's ``(1 + w)``; ``weight=None`` is the weightless
norm. Everything is computed in fp32 and rounded once, at the output. Eager Llama code rounds the
normalised value to the input dtype before the weight multiply; skipping that second rounding is at
least as accurate, so the tolerance rule (error vs fp64 at most 2x eager's) holds by construction.

Memory traffic (the roofline): forward reads x (N*D) and w (D), writes y (N*D); backward reads x, dy,
w and writes dx (N*D) plus fp32 dW partials (P*D, P programs). Nothing but x is saved for backward:
the per-row rstd is recomputed from the row the backward kernel loads anyway, which costs one
in-register reduction and saves an N-float tensor and its write.

Backward derivation. Per row, with ``r = (mean(x^2) + eps)^(-1/2)``, ``n = x * r``, ``v = w + offset``,
``y = n * v``::

    dn   = dy * v
    dr/dx_j = -r^3 * x_j / D
    dx_j = r * dn_j + sum_i(dn_i * x_i) * dr/dx_j
         = r * (dn_j - n_j * mean_i(dn_i * n_i))
    dw   = sum over rows of dy * n          (fp32 partial sums per program, then one .sum(0))

The weight gradient is skipped entirely when the weight does not need one (LoRA, QLoRA).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .backend_choice import use_triton
from .devices import check_one_device
from .host_math import cdiv, next_power_of_2
from .registration import define, fake
from .rounding import round_to

# A row lives in registers whole; past this the single-pass kernel would spill (the patterns' guard
# refuses such norms, and a direct call gets a clear error).
MAX_HIDDEN = 65536
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_fwd_kernel(
    p_x, p_w, p_y,
    n_rows, n_cols, stride_x, stride_y,
    eps, offset,
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_m = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < n_rows
    m_d = o_d < n_cols
    m_md = m_m[:, None] & m_d[None, :]
    b_x = tl.load(p_x + o_m[:, None] * stride_x + o_d[None, :], mask=m_md, other=0.0).to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / n_cols + eps)
    b_y = b_x * b_rstd[:, None]
    if HAS_WEIGHT:
        b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32) + offset
        b_y = b_y * b_w[None, :]
    tl.store(p_y + o_m[:, None] * stride_y + o_d[None, :], round_to(b_y, p_y.dtype.element_ty), mask=m_md)


@triton.jit
def _rms_norm_bwd_kernel(
    p_dy, p_x, p_w, p_dx, p_dw_partial,
    n_rows, n_cols, stride_dy, stride_x, stride_dx, blocks_per_prog,
    eps, offset,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Each program walks its own run of ``blocks_per_prog`` row blocks, so that the fp32 dW partial
    # sum of the rows it saw stays in registers and is written once.
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < n_cols
    if HAS_WEIGHT:
        b_v = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32) + offset
    b_dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i_blk in range(0, blocks_per_prog):
        o_m = ((i_p * blocks_per_prog + i_blk) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_md = (o_m < n_rows)[:, None] & m_d[None, :]
        b_x = tl.load(p_x + o_m[:, None] * stride_x + o_d[None, :], mask=m_md, other=0.0).to(tl.float32)
        b_dy = tl.load(p_dy + o_m[:, None] * stride_dy + o_d[None, :], mask=m_md, other=0.0).to(tl.float32)
        b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / n_cols + eps)
        b_n = b_x * b_rstd[:, None]
        if HAS_WEIGHT:
            b_dn = b_dy * b_v[None, :]
        else:
            b_dn = b_dy
        b_mean_dn_n = tl.sum(b_dn * b_n, axis=1) / n_cols
        b_dx = b_rstd[:, None] * (b_dn - b_n * b_mean_dn_n[:, None])
        tl.store(p_dx + o_m[:, None] * stride_dx + o_d[None, :], round_to(b_dx, p_dx.dtype.element_ty), mask=m_md)
        if COMPUTE_DW:
            b_dw += tl.sum(b_dy * b_n, axis=0)
    if COMPUTE_DW:
        tl.store(p_dw_partial + i_p * n_cols + o_d, b_dw, mask=m_d)


def _block_sizes(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, num_warps): whole rows per block, about 4K elements a program.

    Short rows (q/k-norm over head_dim 128) pack 32 rows into one program so each program still
    moves enough bytes; long rows (hidden 4096) take one row each. Warps follow the Triton
    layer-norm tutorial: one warp per 256 elements, 1 to 8.
    """
    block_d = next_power_of_2(max(n_cols, 1))
    block_m = max(1, min(next_power_of_2(max(n_rows, 1)), 4096 // block_d))
    num_warps = min(max(block_m * block_d // 256, 1), 8)
    return block_m, block_d, num_warps


def _check_inputs(x: torch.Tensor, weight: Optional[torch.Tensor]) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"sloth.rms_norm: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("sloth.rms_norm: x must have at least one dimension (the normalised one)")
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"sloth.rms_norm: last dimension {x.shape[-1]} exceeds the single-pass limit {MAX_HIDDEN}")
    if weight is not None:
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise ValueError(
                f"sloth.rms_norm: weight must have shape ({x.shape[-1]},) to match x's last dimension, "
                f"got {tuple(weight.shape)}")
        if weight.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"sloth.rms_norm: weight must be float32, bfloat16 or float16, got {weight.dtype}")
    check_one_device("sloth.rms_norm", ("x", x), ("weight", weight))


def _unit_stride(weight: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The weight as the kernels read it, element d at data_ptr + d: a copy when its stride is not 1 (an
    expanded ``w.expand(D)`` has stride 0, a slice ``w[::2]`` stride 2; both were read wrongly before)."""
    return weight if weight is None or weight.stride(0) == 1 else weight.contiguous()


def rms_norm_reference(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """The op's math in plain PyTorch (fp32, one rounding): the fallback where Triton cannot run.

    Contiguous output whatever x's layout, as the fake implementation promises.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.float() + offset)
    return y.to(out_dtype).contiguous()


def rms_norm_backward_reference(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                                offset: float, compute_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The derivation in the module docstring, in plain PyTorch (fp32)."""
    xf, dyf = x.float(), dy.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * rstd
    dn = dyf * (weight.float() + offset) if weight is not None else dyf
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    if compute_dw and weight is not None:
        dw = (dyf * n).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    else:
        dw = x.new_empty(0)
    return dx.to(x.dtype).contiguous(), dw


def _rms_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float,
                  out_dtype: torch.dtype) -> torch.Tensor:
    _check_inputs(x, weight)
    if not use_triton(x):
        return rms_norm_reference(x, weight, eps, offset, out_dtype)
    n_cols = x.shape[-1]
    x_ND = x.reshape(-1, n_cols)
    if x_ND.stride(-1) != 1:
        x_ND = x_ND.contiguous()
    n_rows = x_ND.shape[0]
    weight = _unit_stride(weight)
    y_ND = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    if n_rows > 0:
        block_m, block_d, num_warps = _block_sizes(n_rows, n_cols)
        _rms_norm_fwd_kernel[(cdiv(n_rows, block_m),)](
            x_ND, weight if weight is not None else x_ND, y_ND,
            n_rows, n_cols, x_ND.stride(0), y_ND.stride(0),
            float(eps), float(offset),
            HAS_WEIGHT=weight is not None, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
        )
    return y_ND.view(x.shape)


# The backward with a weight gradient runs persistent programs that each sum the dW of their rows in
# registers and write one fp32 partial row: more programs hide more latency but write (and re-read in
# the final .sum) more partials, and more rows per block put more bytes in flight per iteration.
# H200 sweep, bf16, kernel time as % of copy bandwidth (benchmarks/results/*_rms_norm_bwd_sweep.log):
#   wide rows: 4 rows x 4096 per block, 8 warps, 1 program per SM: 55.8% at 4096 x 4096 and 70.7% at
#              16384 x 4096 (1 row, 2 programs/SM, the first setting: 46.5% and 59.9%)
#   narrow rows (q/k-norm, 131072 x 128): 16 rows per block, 2 warps, 16 programs/SM: 50.1% (32 rows,
#              8 warps, 32 programs/SM: 37.3%)
_DW_WIDE = dict(block_elements=16384, num_warps=8, programs_per_sm=1)
_DW_NARROW = dict(block_rows=16, num_warps=2, programs_per_sm=16)
_NARROW = 512  # hidden sizes at or below this take the narrow setting


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _bwd_launch_config(x: torch.Tensor, n_rows: int, n_cols: int, compute_dw: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_D, num_warps, programs) of the backward kernel."""
    block_m, block_d, num_warps = _block_sizes(n_rows, n_cols)
    if not compute_dw:
        return block_m, block_d, num_warps, cdiv(n_rows, block_m)  # no partials: a program a block
    if x.device.type != "cuda":
        return block_m, block_d, num_warps, max(1, min(cdiv(n_rows, block_m), 4))
    if n_cols <= _NARROW:
        block_m, num_warps, per_sm = _DW_NARROW["block_rows"], _DW_NARROW["num_warps"], _DW_NARROW["programs_per_sm"]
    else:
        block_m = max(1, _DW_WIDE["block_elements"] // block_d)
        num_warps, per_sm = _DW_WIDE["num_warps"], _DW_WIDE["programs_per_sm"]
    block_m = min(block_m, next_power_of_2(n_rows))
    n_progs = max(1, min(cdiv(n_rows, block_m), per_sm * _sm_count(x.device.index or 0)))
    return block_m, block_d, num_warps, n_progs


def _rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float,
                  compute_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(x, weight)
    compute_dw = compute_dw and weight is not None
    if not use_triton(x):
        return rms_norm_backward_reference(dy, x, weight, eps, offset, compute_dw)
    n_cols = x.shape[-1]
    x_ND = x.reshape(-1, n_cols)
    if x_ND.stride(-1) != 1:
        x_ND = x_ND.contiguous()
    dy_ND = dy.reshape(-1, n_cols)
    if dy_ND.stride(-1) != 1:
        dy_ND = dy_ND.contiguous()
    n_rows = x_ND.shape[0]
    weight = _unit_stride(weight)
    dx_ND = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        dw = torch.zeros_like(weight) if compute_dw else x.new_empty(0)
        return dx_ND.view(x.shape), dw
    block_m, block_d, num_warps, n_progs = _bwd_launch_config(x, n_rows, n_cols, compute_dw)
    n_blocks = cdiv(n_rows, block_m)
    blocks_per_prog = cdiv(n_blocks, n_progs)
    n_progs = cdiv(n_blocks, blocks_per_prog)
    dw_partial = torch.empty((n_progs, n_cols) if compute_dw else (0,), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(n_progs,)](
        dy_ND, x_ND, weight if weight is not None else x_ND, dx_ND, dw_partial,
        n_rows, n_cols, dy_ND.stride(0), x_ND.stride(0), dx_ND.stride(0), blocks_per_prog,
        float(eps), float(offset),
        HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw,
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
    )
    dw = dw_partial.sum(0).to(weight.dtype) if compute_dw else x.new_empty(0)
    return dx_ND.view(x.shape), dw


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    x, weight, eps, offset, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.offset = eps, offset


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    compute_dw = weight is not None and ctx.needs_input_grad[1]
    dx, dw = torch.ops.sloth.rms_norm_backward(dy, x, weight, ctx.eps, ctx.offset, compute_dw)
    return dx, (dw if compute_dw else None), None, None, None


@functools.cache
def register() -> None:
    """Define ``sloth::rms_norm`` and ``sloth::rms_norm_backward`` (idempotent)."""
    fwd = define("sloth::rms_norm", _rms_norm_fwd)
    bwd = define("sloth::rms_norm_backward", _rms_norm_bwd)

    @fake(fwd)
    def _(x, weight, eps, offset, out_dtype):
        check_one_device("sloth.rms_norm", ("x", x), ("weight", weight))  # meta inputs land here (devices.py)
        return x.new_empty(x.shape, dtype=out_dtype)

    @fake(bwd)
    def _(dy, x, weight, eps, offset, compute_dw):
        dw = weight.new_empty(weight.shape) if (compute_dw and weight is not None) else x.new_empty(0)
        return x.new_empty(x.shape), dw

    fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6, offset: float = 0.0,
             out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Fused RMSNorm over the last dimension; see the module docstring for the exact math.

    ``out_dtype`` defaults to x's dtype.
    """
    register()
    return torch.ops.sloth.rms_norm(x, weight, float(eps), float(offset), out_dtype or x.dtype)
