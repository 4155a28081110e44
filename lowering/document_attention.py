"""Document-causal attention for packed sequences: ``torch.ops.sloth.document_attention`` and its backward.

A packed row holds several documents one after another. Token i may attend to token j exactly when j is in
i's document and not after i. With ``start[b, i]`` the index of the first token of i's document, the op is
(``q_BHTD``: batch B, H query heads, T tokens, head dim D; ``k, v``: G = H / Hk query heads per key head)::

    allowed[b, i, j] = start[b, i] <= j <= i
    s    = scale * q[b, h] @ k[b, h // G].T            (fp32)
    p    = softmax(where(allowed, s, -inf), dim=-1)
    out  = p @ v[b, h // G]

Every row attends at least to itself, so no row is masked whole (no NaN, whatever the padding). The
document bounds come in one int32 tensor ``bounds [2, B, T]``: ``bounds[0]`` the start above, ``bounds[1]``
one past the last token of the document (runtime/packing.py builds them once per batch from position ids).

Why a kernel of our own. SDPA with the dense ``[B, 1, T, T]`` mask transformers builds for a packed batch
computes every score and reads the mask (O(T^2) work and memory); ``varlen_attn`` needs ``cu_seqlens`` whose
length (the number of documents) and ``max_seqlen`` are data, so a host sync per batch, or a grid sized for
T documents of T tokens; FlexAttention needs a block mask built per batch and recompiles per length. Here the
bounds are per token, so the grid is static (T / BLOCK_M query blocks per head) and each block visits only
its key range: query rows [m0, m1) read keys [start[m0], m1), since ``start`` never decreases along a row.
The backward's key block [n0, n1) reads query rows [n0, end[n1 - 1]), the rows whose documents reach it.

Forward (FlashAttention-2's online softmax, base 2): per query block, running max m, sum l and accumulator,
``lse2 = m + log2(l)`` kept for the backward (fp32, [B, H, T]). Backward, with ``delta = rowsum(out * dout)``::

    p  = exp2(s * log2(e) - lse2)       (recomputed, not saved)
    dv = p.T @ dout        dp = dout @ v.T        ds = p * (dp - delta)
    dq = scale * ds @ k    dk = scale * ds.T @ q

dk and dv of a key head sum over its G query heads inside one program (no atomics); dq has its own kernel.
Inputs may have any strides with a unit last stride (transformers' [B, T, H, D] projections viewed as
[B, H, T, D]); the output is laid out [B, T, H, D] and viewed as [B, H, T, D], the layout the next
``transpose(1, 2).reshape`` reads without a copy.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .backend_choice import use_triton
from .devices import check_one_device
from .host_math import cdiv, next_power_of_2
from .registration import define, fake
from .rounding import INTERPRETED, round_to

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


# ---------------------------------------------------------------------------------------------------
# The math as plain PyTorch (the reference path where Triton does not run, and the tests' oracle).
# ---------------------------------------------------------------------------------------------------

def allowed_from_bounds(bounds: torch.Tensor, first_row: int = 0, n_rows: Optional[int] = None) -> torch.Tensor:
    """The [B, 1, R, T] bool mask (True = attend) the document bounds stand for, start[b, i] <= j <= i, for the query
    rows i in [first_row, first_row + R) (all T rows by default: [B, 1, T, T])."""
    start = bounds[0].long()
    t = start.shape[-1]
    n_rows = t - first_row if n_rows is None else n_rows
    j = torch.arange(t, device=bounds.device)
    i = torch.arange(first_row, first_row + n_rows, device=bounds.device)
    start = start[:, first_row:first_row + n_rows]
    return ((j[None, None, :] >= start[:, :, None]) & (j[None, None, :] <= i[None, :, None]))[:, None]


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def document_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor,
                                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse2) in plain PyTorch, fp32 inside: O(T^2) memory, for CPUs without the interpreter."""
    heads = q.shape[1]
    s = (q.float() @ _repeat_kv(k, heads).float().transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed_from_bounds(bounds), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse[..., None]) @ _repeat_kv(v, heads).float()
    return _output_like(q, out.to(q.dtype)), lse * _LOG2E


def document_attention_backward_reference(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                          out: torch.Tensor, lse2: torch.Tensor, bounds: torch.Tensor,
                                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in plain PyTorch from the saved log-sum-exp, fp32 inside."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kf, vf = _repeat_kv(k, heads).float(), _repeat_kv(v, heads).float()
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    p = torch.exp(s - (lse2 / _LOG2E)[..., None]).masked_fill(~allowed_from_bounds(bounds), 0.0)
    do = dout.float()
    delta = (out.float() * do).sum(-1, keepdim=True)
    ds = p * (do @ vf.transpose(-1, -2) - delta)
    dq = scale * ds @ kf
    dk = scale * ds.transpose(-1, -2) @ q.float()
    dv = p.transpose(-1, -2) @ do
    b, _, t, d = k.shape
    dk = dk.view(b, kv_heads, heads // kv_heads, t, d).sum(2)
    dv = dv.view(b, kv_heads, heads // kv_heads, t, v.shape[-1]).sum(2)
    # dq in q's layout, as the fake declares (empty_like: q is usually a [B, T, H, D] projection viewed
    # [B, H, T, D]), dk and dv contiguous
    return torch.empty_like(q).copy_(dq), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------------------
# Triton kernels.
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation: fp32 tiles through tf32x3 (fp32-level error), 16-bit tiles natively, or
    as fp32 under the interpreter, whose bf16 tile products are wrong (lowering/lora.py's ``_dot16``)."""
    if IEEE:
        return tl.dot(a, b, input_precision="tf32x3")
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _head(p, b, h, stride_b, stride_h):
    """Pointer to head ``h`` of batch row ``b`` of a [B, H, T, D] tensor (int64: B * H * T * D may pass 2^31)."""
    return p + b.to(tl.int64) * stride_b + h * stride_h


@triton.jit
def _rows(p_head, rows, stride_t, o_d):
    """Pointers of the [rows, head_dim] tile of one head: token r at p_head + r * stride_t, element d at + d."""
    return p_head + rows[:, None].to(tl.int64) * stride_t + o_d[None, :]


@triton.jit
def _kv_block(p_kb, p_vb, o_n, sk_t, sv_t, o_d, mask):
    """The key and value tiles of tokens ``o_n`` of one key head (0 where ``mask`` is off)."""
    return (tl.load(_rows(p_kb, o_n, sk_t, o_d), mask=mask, other=0.0),
            tl.load(_rows(p_vb, o_n, sv_t, o_d), mask=mask, other=0.0))


@triton.jit
def _allowed(o_m, o_n, start):
    """The document-causal mask of query rows ``o_m`` against keys ``o_n``: start[i] <= j <= i."""
    return (o_n[None, :] >= start[:, None]) & (o_n[None, :] <= o_m[:, None])


@triton.jit
def _fwd_kernel(
    p_q, p_k, p_v, p_o, p_lse, p_bounds, p_sink2,
    n_tok, n_heads, group, head_dim,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
    scale_log2e,
    IEEE: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = i_bh // n_heads
    h = i_bh % n_heads
    hk = h // group
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < n_tok
    m_d = o_d < head_dim
    start = tl.load(p_bounds + b * n_tok + o_m, mask=m_m, other=n_tok)
    b_q = tl.load(_rows(_head(p_q, b, h, sq_b, sq_h), o_m, sq_t, o_d), mask=m_m[:, None] & m_d[None, :], other=0.0)
    lo = tl.min(start, axis=0)  # start[m0]: start never decreases along a row
    hi = tl.minimum((i_m + 1) * BLOCK_M, n_tok)
    p_kb = _head(p_k, b, hk, sk_b, sk_h)
    p_vb = _head(p_v, b, hk, sv_b, sv_h)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < hi
        b_k, b_v = _kv_block(p_kb, p_vb, o_n, sk_t, sv_t, o_d, m_n[:, None] & m_d[None, :])
        s = _dot(b_q, tl.trans(b_k), IEEE) * scale_log2e
        allowed = _allowed(o_m, o_n, start)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(round_to(p, b_v.dtype), b_v, IEEE)
        m_i = m_new
    if HAS_SINK:  # one more logit per head, sink2[h] (base 2), with no value: it only joins the denominator
        sink2 = tl.load(p_sink2 + h)
        m_new = tl.maximum(m_i, sink2)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink2 - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    l_safe = tl.where(m_m, l_i, 1.0)
    b_o = acc / l_safe[:, None]
    tl.store(_rows(_head(p_o, b, h, so_b, so_h), o_m, so_t, o_d),
             round_to(b_o, p_o.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
    tl.store(p_lse + i_bh.to(tl.int64) * n_tok + o_m, m_i + tl.log2(l_safe), mask=m_m)


@triton.jit
def _bwd_dkdv_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_bounds, p_dk, p_dv,
    n_batch, n_tok, n_heads, n_kv_heads, group, head_dim,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
    scale, scale_log2e,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = i_bh // n_kv_heads
    hk = i_bh % n_kv_heads
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_n = o_n < n_tok
    m_d = o_d < head_dim
    m_nd = m_n[:, None] & m_d[None, :]
    b_k, b_v = _kv_block(_head(p_k, b, hk, sk_b, sk_h), _head(p_v, b, hk, sv_b, sv_h), o_n, sk_t, sv_t, o_d, m_nd)
    # Query rows that can see this key block: from its first key to the end of its last key's document.
    lo = i_n * BLOCK_N
    last = tl.minimum(lo + BLOCK_N, n_tok) - 1
    hi = tl.load(p_bounds + n_batch * n_tok + b * n_tok + last)  # bounds[1][b, last]
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for g in range(0, group):
        h = hk * group + g
        p_qb = _head(p_q, b, h, sq_b, sq_h)
        p_dob = _head(p_do, b, h, sdo_b, sdo_h)
        row = (b * n_heads + h).to(tl.int64) * n_tok
        for m0 in range(lo, hi, BLOCK_M):
            o_m = m0 + tl.arange(0, BLOCK_M)
            m_m = o_m < hi
            m_md = m_m[:, None] & m_d[None, :]
            b_q = tl.load(_rows(p_qb, o_m, sq_t, o_d), mask=m_md, other=0.0)
            b_do = tl.load(_rows(p_dob, o_m, sdo_t, o_d), mask=m_md, other=0.0)
            lse = tl.load(p_lse + row + o_m, mask=m_m, other=0.0)
            delta = tl.load(p_delta + row + o_m, mask=m_m, other=0.0)
            start = tl.load(p_bounds + b * n_tok + o_m, mask=m_m, other=n_tok)
            allowed = _allowed(o_m, o_n, start) & m_n[None, :]
            s = _dot(b_q, tl.trans(b_k), IEEE) * scale_log2e
            p = tl.where(allowed, tl.exp2(s - lse[:, None]), 0.0)
            dv += _dot(tl.trans(round_to(p, b_do.dtype)), b_do, IEEE)
            dp = _dot(b_do, tl.trans(b_v), IEEE)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(round_to(ds, b_q.dtype)), b_q, IEEE)
    tl.store(_rows(p_dk + i_bh.to(tl.int64) * n_tok * head_dim, o_n, head_dim, o_d),
             round_to(dk * scale, p_dk.dtype.element_ty), mask=m_nd)
    tl.store(_rows(p_dv + i_bh.to(tl.int64) * n_tok * head_dim, o_n, head_dim, o_d),
             round_to(dv, p_dv.dtype.element_ty), mask=m_nd)


@triton.jit
def _bwd_dq_kernel(
    p_q, p_k, p_v, p_do, p_lse, p_delta, p_bounds, p_dq,
    n_tok, n_heads, group, head_dim,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t, sdq_b, sdq_h, sdq_t,
    scale, scale_log2e,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = i_bh // n_heads
    h = i_bh % n_heads
    hk = h // group
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < n_tok
    m_d = o_d < head_dim
    m_md = m_m[:, None] & m_d[None, :]
    start = tl.load(p_bounds + b * n_tok + o_m, mask=m_m, other=n_tok)
    b_q = tl.load(_rows(_head(p_q, b, h, sq_b, sq_h), o_m, sq_t, o_d), mask=m_md, other=0.0)
    b_do = tl.load(_rows(_head(p_do, b, h, sdo_b, sdo_h), o_m, sdo_t, o_d), mask=m_md, other=0.0)
    lse = tl.load(p_lse + i_bh.to(tl.int64) * n_tok + o_m, mask=m_m, other=0.0)
    delta = tl.load(p_delta + i_bh.to(tl.int64) * n_tok + o_m, mask=m_m, other=0.0)
    lo = tl.min(start, axis=0)
    hi = tl.minimum((i_m + 1) * BLOCK_M, n_tok)
    p_kb = _head(p_k, b, hk, sk_b, sk_h)
    p_vb = _head(p_v, b, hk, sv_b, sv_h)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < hi
        b_k, b_v = _kv_block(p_kb, p_vb, o_n, sk_t, sv_t, o_d, m_n[:, None] & m_d[None, :])
        allowed = _allowed(o_m, o_n, start) & m_m[:, None]
        s = _dot(b_q, tl.trans(b_k), IEEE) * scale_log2e
        p = tl.where(allowed, tl.exp2(s - lse[:, None]), 0.0)
        dp = _dot(b_do, tl.trans(b_v), IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(round_to(ds, b_k.dtype), b_k, IEEE)
    tl.store(_rows(_head(p_dq, b, h, sdq_b, sdq_h), o_m, sdq_t, o_d),
             round_to(dq * scale, p_dq.dtype.element_ty), mask=m_md)


# ---------------------------------------------------------------------------------------------------
# Host side.
# ---------------------------------------------------------------------------------------------------

def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor) -> None:
    name = "sloth.document_attention"
    for label, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: {label} must be [batch, heads, tokens, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: {label} has dtype {t.dtype}; supported: {_FLOAT_DTYPES}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, heads, t, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != t or k.shape[3] != d:
        raise ValueError(f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} must be [{b}, kv_heads, {t}, {d}] "
                         f"for q {tuple(q.shape)}")
    if k.shape[1] == 0 or heads % k.shape[1]:
        raise ValueError(f"{name}: {heads} query heads are not a multiple of {k.shape[1]} key/value heads")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"{name}: head_dim {d} is above the kernel's {MAX_HEAD_DIM}")
    if bounds.dtype != torch.int32 or tuple(bounds.shape) != (2, b, t):
        raise ValueError(f"{name}: bounds must be int32 [2, {b}, {t}] (document start and end per token), got "
                         f"{bounds.dtype} {tuple(bounds.shape)}")
    check_one_device(name, ("q", q), ("k", k), ("v", v), ("bounds", bounds))


def _output_like(q: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` [B, H, T, D] stored [B, T, H, D] (the fake allocates the same layout)."""
    out = _empty_output(q, q.dtype)
    out.copy_(value)
    return out


def _empty_output(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    b, h, t, d = q.shape
    return q.new_empty((b, t, h, d), dtype=dtype).transpose(1, 2)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel on a GPU; benchmarks/ops/document_attention.py times
# candidates by setting TILES_OVERRIDE. H200, bf16, 32/8 heads of 128, log-normal documents (median 300), kernel
# ms (benchmarks/results/2026-12-01_171057_document_attention.*), forward / forward+backward:
#   T = 16384: fwd (128, 64, 8, 3) + bwd (64, 64, 4, 2) x 2: 0.517 / 2.636; fwd (64, 64, 4, 3): 0.416 (bwd
#              (32, 128, 4, 3) and (128, 32, 4, 3): 4.875); all (128, 128 / 64, 8, 2): 0.607 / 2.877;
#              varlen_attn with max_seqlen read on the host 0.689 / 3.298, with max_seqlen = T 1.326 / 7.714;
#              SDPA under the dense mask 13.99 / 50.13
#   T = 65536: 2.615 / 12.436; fwd (64, 64, 4, 3): 2.292; varlen_attn 6.661 / 34.564 (max_seqlen = T: 46.98 /
#              287.7)
# Kept: the (64, 64, 4, 3) forward and the (64, 64, 4, 2) backward kernels.
GPU_TILES = dict(fwd=(64, 64, 4, 3), dkdv=(64, 64, 4, 2), dq=(64, 64, 4, 2))
TILES_OVERRIDE: dict | None = None


def _blocks(device: torch.device, head_dim: int) -> dict:
    """Tile sizes: small under the interpreter (numpy time grows with the tile), FlashAttention-2's on a GPU."""
    block_d = max(16, next_power_of_2(head_dim))
    if TILES_OVERRIDE is not None:
        return dict(TILES_OVERRIDE, block_d=block_d)
    if device.type != "cuda":
        return dict(fwd=(16, 16, 1, 1), dkdv=(16, 16, 1, 1), dq=(16, 16, 1, 1), block_d=block_d)
    return dict(GPU_TILES, block_d=block_d)


def _ieee(dtype: torch.dtype) -> bool:
    return dtype == torch.float32


def _document_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, v, bounds)
    if not use_triton(q):
        return document_attention_reference(q, k, v, bounds, scale)
    return forward_kernel(q, k, v, bounds, scale, None)


def forward_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, scale: float,
                   sink2: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse2) from the Triton forward; with ``sink2`` (fp32 [H], the sinks times log2(e)) each head's
    softmax has that one more logit in its denominator (lowering/sink_attention.py)."""
    q, k, v, bounds = _unit_last(q), _unit_last(k), _unit_last(v), bounds.contiguous()
    b, heads, t, d = q.shape
    out = _empty_output(q, q.dtype)
    lse = torch.empty((b, heads, t), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    blocks = _blocks(q.device, d)
    bm, bn, warps, stages = blocks["fwd"]
    _fwd_kernel[(cdiv(t, bm), b * heads)](
        q, k, v, out, lse, bounds, lse if sink2 is None else sink2,
        t, heads, heads // k.shape[1], d,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        float(scale) * _LOG2E,
        IEEE=_ieee(q.dtype), HAS_SINK=sink2 is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=blocks["block_d"],
        num_warps=warps, num_stages=stages,
    )
    return out, lse


def _document_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, bounds: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, v, bounds)
    if not use_triton(q):
        return document_attention_backward_reference(dout, q, k, v, out, lse, bounds, scale)
    return backward_kernels(dout, q, k, v, lse, row_delta(out, dout), bounds, scale)


def row_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(out * dout), fp32 [B, H, T]: the softmax backward's per-row term."""
    return (out.float() * dout.float()).sum(-1).contiguous()


def backward_kernels(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                     delta: torch.Tensor, bounds: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the Triton backward, given the saved ``lse`` (base 2) and ``delta`` (``row_delta``)."""
    q, k, v, dout, bounds = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(dout), bounds.contiguous()
    b, heads, t, d = q.shape
    kv_heads = k.shape[1]
    dq = torch.empty_like(q)
    dk = torch.empty((b, kv_heads, t, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((b, kv_heads, t, d), dtype=v.dtype, device=v.device)
    if q.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    blocks = _blocks(q.device, d)
    group = heads // kv_heads
    bm, bn, warps, stages = blocks["dkdv"]
    _bwd_dkdv_kernel[(cdiv(t, bn), b * kv_heads)](
        q, k, v, dout, lse, delta, bounds, dk, dv,
        b, t, heads, kv_heads, group, d,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        float(scale), float(scale) * _LOG2E,
        IEEE=_ieee(q.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=blocks["block_d"], num_warps=warps, num_stages=stages,
    )
    bm, bn, warps, stages = blocks["dq"]
    _bwd_dq_kernel[(cdiv(t, bm), b * heads)](
        q, k, v, dout, lse, delta, bounds, dq,
        t, heads, group, d,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        float(scale), float(scale) * _LOG2E,
        IEEE=_ieee(q.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=blocks["block_d"], num_warps=warps, num_stages=stages,
    )
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library.
# ---------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    q, k, v, bounds, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bounds)
    ctx.scale = scale


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, bounds = ctx.saved_tensors
    dq, dk, dv = torch.ops.sloth.document_attention_backward(dout, q, k, v, out, lse, bounds, ctx.scale)
    return dq, dk, dv, None, None


@functools.cache
def register() -> None:
    """Define ``sloth::document_attention`` and its ``_backward`` (idempotent)."""
    fwd = define("sloth::document_attention", _document_attention_fwd)
    bwd = define("sloth::document_attention_backward", _document_attention_bwd)

    @fake(fwd)
    def _(q, k, v, bounds, scale):
        check_one_device("sloth.document_attention", ("q", q), ("k", k), ("v", v), ("bounds", bounds))
        b, heads, t, _ = q.shape
        return _empty_output(q, q.dtype), q.new_empty((b, heads, t), dtype=torch.float32)

    @fake(bwd)
    def _(dout, q, k, v, out, lse, bounds, scale):
        return torch.empty_like(q), k.new_empty(k.shape), v.new_empty(v.shape)

    fwd.register_autograd(_backward, setup_context=_setup_context)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor,
                       scale: float | None = None) -> torch.Tensor:
    """Document-causal attention (module docstring); ``scale`` defaults to 1/sqrt(head_dim), as SDPA's."""
    register()
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.sloth.document_attention(q, k, v, bounds, float(scale))[0]
