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
before using them again). ``d_w_add`` [S] (fp32, sorted-row order), when given, is added to d w_r before its
rounding: the down bias's term <dout_t, b2[e]> (lowering/moe.py).

GPT-OSS's experts (lowering/moe.py's docstring) add two things both kernels take as constexprs: gate and up
*interleaved* (gate column j of a row at 2j, up at 2j+1, and d_gu written in the same layout) and the activation
``swiglu_oai``, a function of gate and up together::

    g' = min(g, limit),  u' = clamp(u, -limit, limit),  s = sigmoid(alpha g'),  h = g' s (u' + 1)
    dh/dg = (u' + 1)(s + alpha g' s (1 - s)) [g <= limit],    dh/du = g' s [-limit <= u <= limit]

(the masks are ``torch.clamp``'s backward's: at the bound itself, ``g == limit`` or ``|u| == limit``, torch 2.13 and
earlier pass the gradient and 2.14 and later do not, so the kernels follow the installed torch,
lowering/torch_conventions.py), and ``silu_clamped`` (DeepSeek-V4's, Hunyuan-V4's), the same clamps
around a plain SwiGLU: ``h = silu(g') u'``, ``dh/dg = u' s (1 + g' (1 - s)) [g <= limit]`` with s = sigmoid(g'),
``dh/du = silu(g') [-limit <= u <= limit]``. ``expert_glu_forward`` is the forward of those variants: the GLU
with the gate/up bias of each row's expert added first, the biased pre-activation written back over gu (it is what
the backward reads) rounded to gu's dtype, as eager's ``gu + b[e]`` is, and h computed from the rounded values.

Ungated experts (NemotronH's, Ergo's; lowering/moe.py's ``gated=False``): the first GEMM gives u_r [I] alone and
h_r = a(u_r), with ``a`` one of ``relu2`` (a(u) = relu(u)^2, a'(u) = 2 relu(u)) or lowering/glu.py's silu, gelu_tanh
and gelu_erf (their a and a' as that file derives them). Both kernels take it as the feature flag ``GATED=False``:
the forward reads a [BLOCK_M, BLOCK_N] tile of u (its bias, when given, added and written back as above) and writes
h; the weighted backward is the gated one with the GLU's derivative replaced by a'::

    dh_r = w_r c_r,   d u_r = dh_r * a'(u_r)  -> d_u [S, I],   d w_r = <c_r, h_r>,   hw_r = w_r h_r
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend_choice import use_triton
from .glu import ACTIVATIONS, _activation_and_derivative, _sigmoid_pair, glu_backward_reference, glu_reference
from .host_math import cdiv, next_power_of_2
from .rounding import round_to
from .torch_conventions import CLAMP_PASSES_AT_BOUND


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
        _combine_kernel[(n_tokens, cdiv(n_cols, block_n))](
            rows, inverse, scale_flat, out, n_cols, rows.stride(0), out.stride(0),
            TOP_K=top_k, HAS_SCALE=scale is not None, BLOCK_N=block_n, num_warps=4 if block_n <= 1024 else 8,
        )
    return out


# ---------------------------------------------------------------------------------------------------
# The expert GLU's variants: interleaved gate/up, GPT-OSS's clamped GLU, the gate/up bias
# ---------------------------------------------------------------------------------------------------

_SWIGLU_OAI = tl.constexpr(3)  # after lowering/glu.py's activations 0-2
_SILU_CLAMPED = tl.constexpr(4)
_RELU2 = tl.constexpr(ACTIVATIONS["relu2"])  # lowering/glu.py's code; the ungated experts' kernel tests for it
# The kernels' activation codes by lowering/glu.py's names (relu2 among them), swiglu_oai and silu_clamped.
EXPERT_ACTIVATIONS = {**ACTIVATIONS, "swiglu_oai": _SWIGLU_OAI.value, "silu_clamped": _SILU_CLAMPED.value}
# The activations an ungated expert takes (h = a(u)), by EXPERT_ACTIVATIONS' names.
UNGATED_ACTIVATIONS = tuple(ACTIVATIONS)


@triton.jit
def _inside_clamps(b_g, b_u, limit, PASS_AT_BOUND: tl.constexpr):
    """(g not clamped by min(g, limit), u not clamped by clamp(u, -limit, limit)): where torch.clamp's backward passes
    the gradient, the bound itself included or not (``PASS_AT_BOUND``: the installed torch's convention,
    ``CLAMP_PASSES_AT_BOUND``, which the launcher reads at each call and passes as a launch argument, so that each
    value compiles its own kernel; a module-level constexpr would be frozen into the first compile)."""
    if PASS_AT_BOUND:
        return b_g <= limit, (b_u >= -limit) & (b_u <= limit)
    else:
        return b_g < limit, (b_u > -limit) & (b_u < limit)


@triton.jit
def _expert_glu_and_derivatives(b_g, b_u, alpha, limit, ACTIVATION: tl.constexpr, PASS_AT_BOUND: tl.constexpr):
    """(h, dh/dg, dh/du) in fp32 (module docstring)."""
    if ACTIVATION == _SWIGLU_OAI:
        b_gc = tl.minimum(b_g, limit)
        b_uc = tl.minimum(tl.maximum(b_u, -limit), limit)
        b_av = alpha * b_gc  # named: see glu.py's _activation
        b_s, b_1ms = _sigmoid_pair(b_av)
        b_a = b_gc * b_s
        b_h = b_a * (b_uc + 1.0)
        m_g, m_u = _inside_clamps(b_g, b_u, limit, PASS_AT_BOUND)
        b_dg = tl.where(m_g, (b_uc + 1.0) * (b_s + alpha * b_a * b_1ms), 0.0)
        b_du = tl.where(m_u, b_a, 0.0)
    elif ACTIVATION == _SILU_CLAMPED:
        b_gc = tl.minimum(b_g, limit)
        b_uc = tl.minimum(tl.maximum(b_u, -limit), limit)
        b_s, b_1ms = _sigmoid_pair(b_gc)
        b_a = b_gc * b_s
        b_h = b_a * b_uc
        m_g, m_u = _inside_clamps(b_g, b_u, limit, PASS_AT_BOUND)
        b_dg = tl.where(m_g, b_uc * b_s * (1.0 + b_gc * b_1ms), 0.0)
        b_du = tl.where(m_u, b_a, 0.0)
    else:
        b_a, b_da = _activation_and_derivative(b_g, ACTIVATION)
        b_h = b_a * b_u
        b_dg = b_u * b_da
        b_du = b_a
    return b_h, b_dg, b_du


@triton.jit
def _ungated_activation_and_derivative(b_u, ACTIVATION: tl.constexpr):
    """(a(u), a'(u)) in fp32 for an ungated expert (module docstring)."""
    if ACTIVATION == _RELU2:
        b_r = tl.maximum(b_u, 0.0)
        b_a = b_r * b_r
        b_da = 2.0 * b_r
    else:
        b_a, b_da = _activation_and_derivative(b_u, ACTIVATION)
    return b_a, b_da


@triton.jit
def _expert_glu(b_g, b_u, alpha, limit, ACTIVATION: tl.constexpr):
    """h in fp32 (module docstring); the derivatives, unused, are dead code the compiler drops (either convention)."""
    b_h, _, _ = _expert_glu_and_derivatives(b_g, b_u, alpha, limit, ACTIVATION, PASS_AT_BOUND=True)
    return b_h


@triton.jit
def _add_expert_bias_in_place(p_tile, b_tile, p_bias, p_ids, o_m, m_m, o_cols, m_tile, stride_bias):
    """A loaded fp32 tile of gu plus its rows' experts' bias (columns ``o_cols``), rounded to gu's dtype as eager's
    ``gu + b[e]`` is, written back over the tile (the backward reads it) and returned in fp32."""
    o_e = tl.load(p_ids + o_m, mask=m_m, other=0).to(tl.int64)
    b_tile = round_to(b_tile + tl.load(p_bias + o_e[:, None] * stride_bias + o_cols[None, :], mask=m_tile,
                                       other=0.0).to(tl.float32), p_tile.dtype.element_ty)
    tl.debug_barrier()  # each element is loaded and stored by the same program, its load consumed above
    tl.store(p_tile, b_tile, mask=m_tile)
    return b_tile.to(tl.float32)


@triton.jit
def _expert_glu_fwd_kernel(
    p_gu, p_bias, p_ids, p_h,
    n_rows, n_cols, stride_gu, stride_bias, stride_h, alpha, limit,
    ACTIVATION: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr = True,
):
    """A BLOCK_M x BLOCK_N tile of h (and, with HAS_BIAS, of the biased gu written back in place). Interleaved
    gate/up are read as one contiguous [BLOCK_M, 2 BLOCK_N] tile and split in registers: two stride-2 loads
    instead cost GPT-OSS-20B's kernel 0.80 ms for 0.47 GB (2026-12-03 profile, 7x its copy time). Ungated
    (GATED=False), gu is u [n_rows, n_cols] and h = a(u)."""
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < n_rows
    m_mn = m_m[:, None] & (o_n < n_cols)[None, :]
    if not GATED:
        p_u = p_gu + o_m[:, None] * stride_gu + o_n[None, :]
        b_u = tl.load(p_u, mask=m_mn, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b_u = _add_expert_bias_in_place(p_u, b_u, p_bias, p_ids, o_m, m_m, o_n, m_mn, stride_bias)
        b_h, _ = _ungated_activation_and_derivative(b_u, ACTIVATION)  # a' unused: dead code, dropped
    else:
        if INTERLEAVED:  # columns 2j (gate) and 2j + 1 (up) of this tile, as one tile
            o_gu = 2 * i_n * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
            m_gu = m_m[:, None] & (o_gu < 2 * n_cols)[None, :]
            p_tile = p_gu + o_m[:, None] * stride_gu + o_gu[None, :]
            b_gu = tl.load(p_tile, mask=m_gu, other=0.0).to(tl.float32)
            if HAS_BIAS:
                b_gu = _add_expert_bias_in_place(p_tile, b_gu, p_bias, p_ids, o_m, m_m, o_gu, m_gu, stride_bias)
            b_g, b_u = tl.split(tl.reshape(b_gu, (BLOCK_M, BLOCK_N, 2)))
        else:
            p_g = p_gu + o_m[:, None] * stride_gu + o_n[None, :]
            p_u = p_g + n_cols
            b_g = tl.load(p_g, mask=m_mn, other=0.0).to(tl.float32)
            b_u = tl.load(p_u, mask=m_mn, other=0.0).to(tl.float32)
            if HAS_BIAS:
                o_e = tl.load(p_ids + o_m, mask=m_m, other=0).to(tl.int64)
                p_b = p_bias + o_e[:, None] * stride_bias + o_n[None, :]
                b_g = round_to(b_g + tl.load(p_b, mask=m_mn, other=0.0).to(tl.float32), p_gu.dtype.element_ty)
                b_u = round_to(b_u + tl.load(p_b + n_cols, mask=m_mn, other=0.0).to(tl.float32),
                               p_gu.dtype.element_ty)
                tl.debug_barrier()  # as in _add_expert_bias_in_place
                tl.store(p_g, b_g, mask=m_mn)
                tl.store(p_u, b_u, mask=m_mn)
                b_g = b_g.to(tl.float32)
                b_u = b_u.to(tl.float32)
        b_h = _expert_glu(b_g, b_u, alpha, limit, ACTIVATION)
    tl.store(p_h + o_m[:, None] * stride_h + o_n[None, :], round_to(b_h, p_h.dtype.element_ty), mask=m_mn)


def ungated_activation_math(u: torch.Tensor, activation: str) -> torch.Tensor:
    """a(u) (``activation`` one of UNGATED_ACTIVATIONS, or lowering/moe.py's "gelu" for gelu_erf), in u's dtype's
    arithmetic: eager's (transformers' ``ACT2FN["relu2"]`` is ``torch.square(F.relu(u))``)."""
    if activation == "relu2":
        return torch.square(F.relu(u))
    if activation == "silu":
        return F.silu(u)
    return F.gelu(u, approximate="tanh" if activation == "gelu_tanh" else "none")


def expert_glu_math(gu: torch.Tensor, activation: str, interleaved: bool, alpha: float, limit: float,
                    gated: bool = True) -> torch.Tensor:
    """h of gu [.., 2I] (``activation`` one of EXPERT_ACTIVATIONS' names), in gu's dtype's arithmetic: eager's.
    Ungated (``gated=False``), gu is u [.., I] and h = a(u)."""
    if not gated:
        return ungated_activation_math(gu, activation)
    gate, up = (gu[..., 0::2], gu[..., 1::2]) if interleaved else gu.chunk(2, dim=-1)
    if activation == "swiglu_oai":
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up + 1)
    if activation == "silu_clamped":
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


def expert_glu_forward_reference(gu: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, activation: str,
                                 interleaved: bool, alpha: float, limit: float, gated: bool = True
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``expert_glu_forward`` in plain PyTorch (fp32 inside, each output rounded once)."""
    if bias is not None:
        gu = gu + bias[ids]
    return gu, expert_glu_math(gu.float(), activation, interleaved, alpha, limit, gated).to(gu.dtype)


def expert_glu_forward(gu: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, activation: str,
                       interleaved: bool, alpha: float, limit: float, gated: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(gu + bias[ids] (gu itself, written in place, when Triton runs), h [S, I]) from gu [S, 2I], the gate/up
    bias [E, 2I] or None and the sorted rows' experts ``ids`` [S] (module docstring). Ungated: gu is u [S, I], the
    bias [E, I], and h = a(u)."""
    n_rows, n_cols = gu.shape[0], gu.shape[1] // 2 if gated else gu.shape[1]
    if not use_triton(gu) or gu.stride(1) != 1 or (bias is not None and bias.stride(1) != 1):
        return expert_glu_forward_reference(gu, bias, ids, activation, interleaved, alpha, limit, gated)
    h = torch.empty((n_rows, n_cols), dtype=gu.dtype, device=gu.device)
    if n_rows and n_cols:
        # Tiles of ~4K elements as lowering/glu.py's (not swept)
        block_n = min(next_power_of_2(n_cols), 256)
        block_m = max(1, min(16, 4096 // block_n))
        _expert_glu_fwd_kernel[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
            gu, bias if bias is not None else gu, ids, h, n_rows, n_cols, gu.stride(0),
            bias.stride(0) if bias is not None else 0, h.stride(0), float(alpha), float(limit),
            ACTIVATION=EXPERT_ACTIVATIONS[activation], INTERLEAVED=interleaved, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, GATED=gated, num_warps=4,
        )
    return gu, h


# ---------------------------------------------------------------------------------------------------
# segment_sum: the per-expert biases' gradients
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _segment_sum_kernel(
    p_rows, p_scale, p_offs, p_out, n_cols, stride_rows, stride_out,
    HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One column block (program 0) by one expert (program 1): out[e, cols] = sum over its sorted rows. The column
    blocks on the grid's first axis (up to 2**31 - 1; the second stops at 65535): lowering/moe.py's reference
    weight gradient sums rows of k*n columns, 16.6M (130K blocks) at GPT-OSS-20B's W1."""
    i_n, i_e = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < n_cols
    i_end = tl.load(p_offs + i_e).to(tl.int64)
    i_start = tl.load(p_offs + i_e - 1, mask=i_e > 0, other=0).to(tl.int64)
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i_m in range(i_start, i_end, BLOCK_M):
        o_m = i_m + tl.arange(0, BLOCK_M).to(tl.int64)
        m_m = o_m < i_end
        b_row = tl.load(p_rows + o_m[:, None] * stride_rows + o_n[None, :], mask=m_m[:, None] & m_n[None, :],
                        other=0.0).to(tl.float32)
        if HAS_SCALE:
            b_row = b_row * tl.load(p_scale + o_m, mask=m_m, other=0.0).to(tl.float32)[:, None]
        b_acc += b_row
    tl.store(p_out + i_e.to(tl.int64) * stride_out + o_n, round_to(tl.sum(b_acc, axis=0), p_out.dtype.element_ty),
             mask=m_n)  # int64: E * k*n elements pass 2**31 at 128 experts of 16.6M


def segment_sum_reference(rows: torch.Tensor, offs: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor | None,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """``segment_sum`` in plain PyTorch (fp32 ``index_add_`` by each row's expert ``ids``, one rounding)."""
    values = rows.float() if scale is None else rows.float() * scale.float().unsqueeze(1)
    out = torch.zeros((offs.shape[0], rows.shape[1]), dtype=torch.float32, device=rows.device)
    return out.index_add_(0, ids, values).to(out_dtype)


def segment_sum(rows: torch.Tensor, offs: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """[E, N] in ``out_dtype``: out[e] = sum of (scale[r] *) rows[r] over expert e's sorted rows r, those below
    ``offs[e]`` (int32 ends) and from ``offs[e-1]``; ``ids`` [S] is each row's expert (for the reference only).
    In fp32 in row order, rounded once: deterministic, with no atomics. ``index_add_`` onto E rows from S = T*K
    rows (32 of 16384 for GPT-OSS-20B) makes every atomic add contend for the same few addresses."""
    n_cols = rows.shape[1]
    if not use_triton(rows) or rows.stride(1) != 1:
        return segment_sum_reference(rows, offs, ids, scale, out_dtype)
    out = torch.empty((offs.shape[0], n_cols), dtype=out_dtype, device=rows.device)
    if out.numel():
        # 32 rows x 128 columns a step; the grid is column blocks x E (GPT-OSS-20B: 45 x 32 programs for d b1)
        block_n = min(next_power_of_2(n_cols), 128)
        _segment_sum_kernel[(cdiv(n_cols, block_n), offs.shape[0])](
            rows, scale if scale is not None else rows, offs, out, n_cols, rows.stride(0), out.stride(0),
            HAS_SCALE=scale is not None, BLOCK_M=32, BLOCK_N=block_n, num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------------------------------
# glu_backward_weighted
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _glu_backward_weighted_kernel(
    p_c, p_gu, p_weights, p_order, p_dgu, p_dw, p_hw, p_dw_add,
    n_rows, n_cols, stride_c, stride_gu, stride_dgu, stride_hw, alpha, limit,
    ACTIVATION: tl.constexpr, STORE_DW: tl.constexpr, STORE_HW: tl.constexpr, PASS_AT_BOUND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr = False, HAS_DW_ADD: tl.constexpr = False,
    GATED: tl.constexpr = True,
):
    """BLOCK_M sorted rows a program, their n_cols = I columns in BLOCK_N chunks (d w_r sums over all of them).
    Ungated (GATED=False), gu and d gu are u and d u [n_rows, n_cols]. ``PASS_AT_BOUND``: ``_inside_clamps``'."""
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
        b_dh = b_c * b_w[:, None]
        if not GATED:
            b_u = tl.load(p_gu + o_m[:, None] * stride_gu + o_n[None, :], mask=m_mn, other=0.0).to(tl.float32)
            b_h, b_da = _ungated_activation_and_derivative(b_u, ACTIVATION)
            tl.store(p_dgu + o_m[:, None] * stride_dgu + o_n[None, :], round_to(b_dh * b_da, p_dgu.dtype.element_ty),
                     mask=m_mn)
        else:
            if INTERLEAVED:  # one contiguous [BLOCK_M, 2 BLOCK_N] tile of gu and of d gu (the forward kernel's why)
                o_gu = 2 * i_n * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
                m_gu = m_m[:, None] & (o_gu < 2 * n_cols)[None, :]
                b_gu = tl.load(p_gu + o_m[:, None] * stride_gu + o_gu[None, :], mask=m_gu,
                               other=0.0).to(tl.float32)
                b_g, b_u = tl.split(tl.reshape(b_gu, (BLOCK_M, BLOCK_N, 2)))
            else:
                b_g = tl.load(p_gu + o_m[:, None] * stride_gu + o_n[None, :], mask=m_mn, other=0.0).to(tl.float32)
                b_u = tl.load(p_gu + o_m[:, None] * stride_gu + n_cols + o_n[None, :], mask=m_mn,
                              other=0.0).to(tl.float32)
            b_h, b_dhdg, b_dhdu = _expert_glu_and_derivatives(b_g, b_u, alpha, limit, ACTIVATION,
                                                                          PASS_AT_BOUND)
            b_dg = round_to(b_dh * b_dhdg, p_dgu.dtype.element_ty)
            b_du = round_to(b_dh * b_dhdu, p_dgu.dtype.element_ty)
            if INTERLEAVED:
                tl.store(p_dgu + o_m[:, None] * stride_dgu + o_gu[None, :],
                         tl.reshape(tl.join(b_dg, b_du), (BLOCK_M, 2 * BLOCK_N)), mask=m_gu)
            else:
                tl.store(p_dgu + o_m[:, None] * stride_dgu + o_n[None, :], b_dg, mask=m_mn)
                tl.store(p_dgu + o_m[:, None] * stride_dgu + n_cols + o_n[None, :], b_du, mask=m_mn)
        if STORE_DW:
            b_dw += tl.sum(b_c * b_h, axis=1)
        if STORE_HW:
            tl.store(p_hw + o_m[:, None] * stride_hw + o_n[None, :], round_to(b_h * b_w[:, None],
                     p_hw.dtype.element_ty), mask=m_mn)
    if STORE_DW:
        if HAS_DW_ADD:
            b_dw += tl.load(p_dw_add + o_m, mask=m_m, other=0.0)
        tl.store(p_dw + o_src, round_to(b_dw, p_dw.dtype.element_ty), mask=m_m)


def _inside_clamps_reference(g: torch.Tensor, u: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' ``_inside_clamps`` in PyTorch: where torch.clamp's backward passes the gradient."""
    if CLAMP_PASSES_AT_BOUND:
        return g <= limit, (u >= -limit) & (u <= limit)
    return g < limit, (u > -limit) & (u < limit)


def glu_backward_weighted_reference(c: torch.Tensor, gu: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                                    activation: str, want_dw: bool, want_hw: bool, interleaved: bool = False,
                                    alpha: float = 1.702, limit: float = 7.0, d_w_add: torch.Tensor | None = None,
                                    gated: bool = True
                                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``glu_backward_weighted`` in plain PyTorch (fp32 inside, each output rounded once)."""
    w_S1 = weights.reshape(-1)[order].float().unsqueeze(1)
    dh = c.float() * w_S1
    if not gated:
        h, d_u = _ungated_backward_reference(dh, gu.float(), activation)
        return _weighted_outputs(c, h, d_u, gu, w_S1, weights, order, want_dw, want_hw, d_w_add)
    gate, up = ((gu[:, 0::2], gu[:, 1::2]) if interleaved else gu.chunk(2, -1))
    g, u = gate.float(), up.float()
    if activation == "swiglu_oai":
        inside_g, inside_u = _inside_clamps_reference(g, u, limit)
        gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        s = torch.sigmoid(alpha * gc)
        a = gc * s
        h = a * (uc + 1)
        d_gate = dh * (uc + 1) * (s + alpha * a * (1 - s)) * inside_g
        d_up = dh * a * inside_u
    elif activation == "silu_clamped":
        inside_g, inside_u = _inside_clamps_reference(g, u, limit)
        gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        s = torch.sigmoid(gc)
        a = gc * s
        h = a * uc
        d_gate = dh * uc * s * (1 + gc * torch.sigmoid(-gc)) * inside_g
        d_up = dh * a * inside_u
    else:  # lowering/glu.py's fp32 references, on the halves
        halves = torch.cat([g, u], -1)
        h = glu_reference(halves, None, activation)
        d_gate, d_up = glu_backward_reference(dh, halves, None, activation)[0].chunk(2, -1)
    d_gu = torch.stack([d_gate, d_up], -1).flatten(-2) if interleaved else torch.cat([d_gate, d_up], -1)
    return _weighted_outputs(c, h, d_gu, gu, w_S1, weights, order, want_dw, want_hw, d_w_add)


def _ungated_backward_reference(dh: torch.Tensor, u: torch.Tensor, activation: str
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, d u) = (a(u), dh * a'(u)) in fp32 from fp32 dh and u (module docstring)."""
    if activation == "relu2":
        r = u.clamp_min(0)
        return r * r, dh * 2 * r
    # lowering/glu.py's fp32 reference with dy = up = 1: its (d_gate, d_up) are (a'(u), a(u))
    ones = torch.ones_like(u)
    da, a = glu_backward_reference(ones, u, ones, activation)
    return a, dh * da


def _weighted_outputs(c, h, d_gu, gu, w_S1, weights, order, want_dw, want_hw, d_w_add
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The references' (d_gu, dw, hw) from fp32 h [S, I] and d_gu: d w_r = <c_r, h_r> (+ d_w_add) scattered to
    the assignments' order, and hw = w h, each rounded once."""
    dw = None
    if want_dw:
        dw_rows = (c.float() * h).sum(-1)
        if d_w_add is not None:
            dw_rows = dw_rows + d_w_add
        dw = torch.empty(order.shape, dtype=weights.dtype, device=c.device)
        dw[order] = dw_rows.to(weights.dtype)
    hw = (h * w_S1).to(gu.dtype) if want_hw else None
    return d_gu.to(gu.dtype), dw, hw


def glu_backward_weighted(c: torch.Tensor, gu: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                          activation: str, want_dw: bool, want_hw: bool, interleaved: bool = False,
                          alpha: float = 1.702, limit: float = 7.0, d_w_add: torch.Tensor | None = None,
                          gated: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(d_gu [S, 2I] in gu's dtype and layout, dw [T*K] in weights' dtype or None, hw [S, I] in gu's dtype or None)
    from c [S, I], gu [S, 2I], the router weights [T, K], the sort order [S] and, for a down bias, ``d_w_add`` [S]
    (module docstring); ``activation`` one of EXPERT_ACTIVATIONS' names. Ungated: gu is u [S, I], d_gu is d u
    [S, I], and ``activation`` one of UNGATED_ACTIVATIONS (lowering/glu.py's names)."""
    n_rows, n_cols = c.shape
    if not use_triton(c) or c.stride(1) != 1 or gu.stride(1) != 1:
        return glu_backward_weighted_reference(c, gu, weights, order, activation, want_dw, want_hw, interleaved,
                                               alpha, limit, d_w_add, gated)
    weights_flat = weights.reshape(-1)
    d_gu = torch.empty((n_rows, 2 * n_cols if gated else n_cols), dtype=gu.dtype, device=c.device)
    dw = torch.empty((n_rows,), dtype=weights.dtype, device=c.device) if want_dw else None
    hw = torch.empty((n_rows, n_cols), dtype=gu.dtype, device=c.device) if want_hw else None
    if n_rows and n_cols:
        # Tiles of 16 rows x up to 256 columns (~4K elements, the GLU kernels' size) looping over I; not swept.
        block_n = min(next_power_of_2(n_cols), 256)
        block_m = max(1, min(16, 4096 // block_n))
        d_w_add = d_w_add.float().contiguous() if d_w_add is not None else None
        _glu_backward_weighted_kernel[(cdiv(n_rows, block_m),)](
            c, gu, weights_flat, order, d_gu, dw if dw is not None else d_gu, hw if hw is not None else d_gu,
            d_w_add if d_w_add is not None else d_gu,
            n_rows, n_cols, c.stride(0), gu.stride(0), d_gu.stride(0), hw.stride(0) if hw is not None else 0,
            float(alpha), float(limit),
            ACTIVATION=EXPERT_ACTIVATIONS[activation], STORE_DW=want_dw, STORE_HW=want_hw,
            PASS_AT_BOUND=CLAMP_PASSES_AT_BOUND,  # read now: tests switch it (_inside_clamps)
            BLOCK_M=block_m, BLOCK_N=block_n, INTERLEAVED=interleaved, HAS_DW_ADD=d_w_add is not None, GATED=gated,
            num_warps=4,
        )
    return d_gu, dw, hw
