"""The MoE router's top-k in one pass: ``torch.ops.sloth.moe_router`` and its manual backward.

From the router's logits ``l`` ([T, E], one row a token) to the k routing weights ``w`` and expert indices
``idx`` ([T, k] each, the experts in descending order of score), in fp32 whatever the input dtype, one of three
functions (told apart by ``softmax_first`` and ``renorm``):

    softmax_first, not renorm:  p = softmax(l);  idx = topk(p);  w_i = p[idx_i]        Qwen3-MoE, OLMoE, Qwen2-MoE
    softmax_first, renorm:      as above, then   w_i = p[idx_i] / sum_j p[idx_j]       Mixtral, Qwen3 norm_topk_prob
    not softmax_first:          idx = topk(l);   w = softmax(l[idx])                   GPT-OSS (renorm: a no-op)

The last two are the same function (the softmax's denominator cancels), computed as written. The experts are
chosen by ``l`` (softmax is monotone: the same experts as by ``p``); between equal scores the lower index wins,
where ``torch.topk`` leaves the choice to its implementation (CPU and CUDA differ).

What it replaces: Inductor runs the softmax, ``aten.topk`` (a sort), the renormalisation and, in the backward,
a scatter into a zero [T, E] tensor and the softmax's backward as separate kernels; a MoE step is bound by the
host (benchmarks/results/2026-12-01_issue20_moe.md), where each launch counts. Here one kernel forward, one
backward, and nothing of size [T, E] is written in the forward.

Backward (dw [T, k] in, dl [T, E] out; everything recomputed from ``l`` and ``idx``). With c = sum_i w_i dw_i:

    softmax_first, not renorm:  dp_e = dw_i where e = idx_i, else 0;   dl = p * (dp - c)
                                (softmax's backward, sum_e p_e dp_e = sum_i w_i dw_i = c)
    renorm, or not softmax_first:  dl[idx_i] = w_i * (dw_i - c), dl = 0 elsewhere
                                (w = p[idx] / S: dp[idx_i] = (dw_i - c) / S, and then sum_e p_e dp_e = 0, so
                                dl_e = p_e dp_e; the softmax over the k selected logits gives the same)
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .backend_choice import use_triton
from .host_math import cdiv, next_power_of_2
from .registration import define, fake
from .rounding import round_to

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_EXPERTS = 512  # a row in registers
MAX_TOP_K = 32


def _rows_per_program(experts_block: int) -> int:
    # About 4096 scores a program: at 128 experts, 32 tokens; at 8 experts, 512.
    return max(1, min(512, 4096 // experts_block))


@triton.jit
def _select(b_l, o_e, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """The K largest of each row of ``b_l`` (fp32, -inf padding), in descending order, the lower index first
    between equals: (indices [M, BLOCK_K] int32 (BLOCK_E past K), their logits [M, BLOCK_K] (-inf past K))."""
    o_k = tl.arange(0, BLOCK_K)
    b_idx = tl.full((b_l.shape[0], BLOCK_K), BLOCK_E, tl.int32)
    b_val = tl.full((b_l.shape[0], BLOCK_K), float("-inf"), tl.float32)
    b_cur = b_l
    for i in tl.static_range(K):
        b_max = tl.max(b_cur, axis=1)
        b_at = tl.min(tl.where(b_cur == b_max[:, None], o_e[None, :], BLOCK_E), axis=1)
        b_idx = tl.where(o_k[None, :] == i, b_at[:, None], b_idx)
        b_val = tl.where(o_k[None, :] == i, b_max[:, None], b_val)
        b_cur = tl.where(o_e[None, :] == b_at[:, None], float("-inf"), b_cur)
    return b_idx, b_val


@triton.jit
def _weights(b_l, b_val, o_k, K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORM: tl.constexpr):
    """(w [M, BLOCK_K] fp32, 0 past K; p [M, BLOCK_E], the softmax over all experts, when SOFTMAX_FIRST)."""
    m_k = o_k[None, :] < K
    if SOFTMAX_FIRST:
        b_max = tl.max(b_l, axis=1)
        b_exp = tl.exp(b_l - b_max[:, None])
        b_p = b_exp / tl.sum(b_exp, axis=1)[:, None]
        b_w = tl.where(m_k, tl.exp(b_val - b_max[:, None]) / tl.sum(b_exp, axis=1)[:, None], 0.0)
        if RENORM:
            b_w = b_w / tl.sum(b_w, axis=1)[:, None]
    else:
        b_exp = tl.where(m_k, tl.exp(b_val - tl.max(b_val, axis=1)[:, None]), 0.0)
        b_w = b_exp / tl.sum(b_exp, axis=1)[:, None]
        if RENORM:
            b_w = b_w / tl.sum(b_w, axis=1)[:, None]
        b_p = b_l
    return b_w, b_p


@triton.jit
def _program_rows(p_l, n_rows, n_experts, stride_l, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """This program's rows and their logits: (row offsets, expert offsets, k offsets, row mask, logits [BLOCK_M,
    BLOCK_E] fp32 with -inf past the experts). Rows past the end read the last row (nothing of theirs is stored):
    an all -inf row would make NaNs."""
    o_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_e = tl.arange(0, BLOCK_E)
    o_r = tl.minimum(o_m, n_rows - 1)
    b_l = tl.load(p_l + o_r[:, None] * stride_l + o_e[None, :], mask=(o_e < n_experts)[None, :],
                  other=float("-inf")).to(tl.float32)
    return o_m, o_e, tl.arange(0, BLOCK_K), o_m < n_rows, b_l


# The kernels do not specialise on the logits' (and dw's) address and row stride. Triton marks a 16-byte-aligned
# pointer, and an int that is a multiple of 16, divisible; with both, a row's loads become 4-wide vectors, the layout
# gives each thread 4 neighbouring experts, and the row sums (the softmax's denominator, the renormalisation) add in
# another order: on an H100 a slice of a wider projection (row stride 40, 12 bytes past an aligned address) gave
# other weight bits than its contiguous copy (tests/test_moe_router_op.py::test_strided_logits). Unspecialised, every
# layout of the same values compiles to one kernel and gives the same bits; the loads are scalar, still coalesced (a
# warp's lanes read consecutive experts of a row) in a kernel that then makes K passes over the row in registers
# (the cost not measured).
@triton.jit(do_not_specialize_on_alignment=["p_l", "stride_l"])
def _moe_router_fwd_kernel(
    p_l, p_w, p_idx, n_rows, n_experts, stride_l,
    K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    o_m, o_e, o_k, m_m, b_l = _program_rows(p_l, n_rows, n_experts, stride_l, BLOCK_M, BLOCK_E, BLOCK_K)
    b_idx, b_val = _select(b_l, o_e, K, BLOCK_K, BLOCK_E)
    b_w, _ = _weights(b_l, b_val, o_k, K, SOFTMAX_FIRST, RENORM)
    m_mk = m_m[:, None] & (o_k < K)[None, :]
    tl.store(p_w + o_m[:, None] * K + o_k[None, :], round_to(b_w, p_w.dtype.element_ty), mask=m_mk)
    tl.store(p_idx + o_m[:, None] * K + o_k[None, :], b_idx.to(tl.int64), mask=m_mk)


@triton.jit(do_not_specialize_on_alignment=["p_l", "stride_l", "p_dw", "stride_dw"])  # as the forward
def _moe_router_bwd_kernel(
    p_dw, p_l, p_idx, p_dl, n_rows, n_experts, stride_l, stride_dw, stride_dl,
    K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    o_m, o_e, o_k, m_m, b_l = _program_rows(p_l, n_rows, n_experts, stride_l, BLOCK_M, BLOCK_E, BLOCK_K)
    m_me = m_m[:, None] & (o_e < n_experts)[None, :]
    m_mk = m_m[:, None] & (o_k < K)[None, :]
    b_idx = tl.load(p_idx + o_m[:, None] * K + o_k[None, :], mask=m_mk, other=BLOCK_E).to(tl.int32)
    b_dw = tl.load(p_dw + o_m[:, None] * stride_dw + o_k[None, :], mask=m_mk, other=0.0).to(tl.float32)
    # The selected logits, gathered from the row by index (k passes over the row; k is small).
    b_val = tl.full((BLOCK_M, BLOCK_K), float("-inf"), tl.float32)
    for i in tl.static_range(K):
        b_at = tl.sum(tl.where(o_k[None, :] == i, b_idx, 0), axis=1)
        b_li = tl.sum(tl.where(o_e[None, :] == b_at[:, None], b_l, 0.0), axis=1)
        b_val = tl.where(o_k[None, :] == i, b_li[:, None], b_val)
    b_w, b_p = _weights(b_l, b_val, o_k, K, SOFTMAX_FIRST, RENORM)
    b_c = tl.sum(b_w * b_dw, axis=1)
    if SOFTMAX_FIRST and not RENORM:
        b_scatter = b_dw  # dp at the selected experts
    else:
        b_scatter = b_w * (b_dw - b_c[:, None])  # dl at the selected experts
    b_d = tl.zeros((BLOCK_M, BLOCK_E), tl.float32)
    for i in tl.static_range(K):
        b_at = tl.sum(tl.where(o_k[None, :] == i, b_idx, 0), axis=1)
        b_si = tl.sum(tl.where(o_k[None, :] == i, b_scatter, 0.0), axis=1)
        b_d = tl.where(o_e[None, :] == b_at[:, None], b_si[:, None], b_d)
    if SOFTMAX_FIRST and not RENORM:
        b_d = tl.where(m_me, b_p * (b_d - b_c[:, None]), 0.0)
    tl.store(p_dl + o_m[:, None] * stride_dl + o_e[None, :], round_to(b_d, p_dl.dtype.element_ty), mask=m_me)


def _check(logits: torch.Tensor, k: int) -> None:
    if logits.dim() != 2 or logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"sloth.moe_router: logits must be a float32/bfloat16/float16 [tokens, experts] tensor, "
                         f"got {logits.dtype} {tuple(logits.shape)}")
    if not 1 <= k <= min(logits.shape[1], MAX_TOP_K):
        raise ValueError(f"sloth.moe_router: k must be in [1, min(experts, {MAX_TOP_K})], got k={k} for "
                         f"{logits.shape[1]} experts")
    if logits.shape[1] > MAX_EXPERTS:
        raise ValueError(f"sloth.moe_router: {logits.shape[1]} experts exceed the one-pass limit {MAX_EXPERTS}")


def moe_router_reference(logits: torch.Tensor, k: int, softmax_first: bool, renorm: bool,
                         out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The three functions of the module docstring in plain PyTorch, fp32 (the fallback and the tests' oracle;
    ties as ``torch.topk`` breaks them)."""
    l = logits.float()
    if softmax_first:
        w, idx = torch.topk(torch.softmax(l, dim=-1), k, dim=-1)
    else:
        top, idx = torch.topk(l, k, dim=-1)
        w = torch.softmax(top, dim=-1)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return w.to(out_dtype), idx


def moe_router_backward_reference(dw: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor, softmax_first: bool,
                                  renorm: bool) -> torch.Tensor:
    """The module docstring's backward in plain PyTorch, fp32."""
    l, dwf = logits.float(), dw.float()
    if softmax_first:
        p = torch.softmax(l, dim=-1)
        w = p.gather(1, idx)
        if renorm:
            w = w / w.sum(-1, keepdim=True)
    else:
        p, w = None, torch.softmax(l.gather(1, idx), dim=-1)
        if renorm:
            w = w / w.sum(-1, keepdim=True)
    c = (w * dwf).sum(-1, keepdim=True)
    if softmax_first and not renorm:
        dp = torch.zeros_like(l).scatter(1, idx, dwf)
        return (p * (dp - c)).to(logits.dtype)
    return torch.zeros_like(l).scatter(1, idx, w * (dwf - c)).to(logits.dtype)


def _blocks(logits: torch.Tensor, k: int) -> tuple[int, int, int]:
    block_e = max(2, next_power_of_2(logits.shape[1]))
    return _rows_per_program(block_e), block_e, max(2, next_power_of_2(k))


def _moe_router_fwd(logits: torch.Tensor, k: int, softmax_first: bool, renorm: bool,
                    out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, k)
    if not use_triton(logits):
        return moe_router_reference(logits, k, softmax_first, renorm, out_dtype)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    n_rows, n_experts = logits.shape
    w = torch.empty((n_rows, k), dtype=out_dtype, device=logits.device)
    idx = torch.empty((n_rows, k), dtype=torch.int64, device=logits.device)
    if n_rows:
        block_m, block_e, block_k = _blocks(logits, k)
        _moe_router_fwd_kernel[(cdiv(n_rows, block_m),)](
            logits, w, idx, n_rows, n_experts, logits.stride(0),
            K=k, SOFTMAX_FIRST=bool(softmax_first), RENORM=bool(renorm),
            BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4,
        )
    return w, idx


def _moe_router_bwd(dw: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor, softmax_first: bool,
                    renorm: bool) -> torch.Tensor:
    k = idx.shape[1]
    _check(logits, k)
    if not use_triton(logits):
        return moe_router_backward_reference(dw, logits, idx, softmax_first, renorm)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    dw, idx = dw.contiguous(), idx.contiguous()
    n_rows, n_experts = logits.shape
    dl = torch.empty((n_rows, n_experts), dtype=logits.dtype, device=logits.device)
    if n_rows:
        block_m, block_e, block_k = _blocks(logits, k)
        _moe_router_bwd_kernel[(cdiv(n_rows, block_m),)](
            dw, logits, idx, dl, n_rows, n_experts, logits.stride(0), dw.stride(0), dl.stride(0),
            K=k, SOFTMAX_FIRST=bool(softmax_first), RENORM=bool(renorm),
            BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4,
        )
    return dl


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    logits, _k, softmax_first, renorm, _dtype = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.softmax_first, ctx.renorm = softmax_first, renorm


def _backward(ctx, dw, _didx):
    logits, idx = ctx.saved_tensors
    if dw is None:
        return None, None, None, None, None
    dl = torch.ops.sloth.moe_router_backward(dw, logits, idx, ctx.softmax_first, ctx.renorm)
    return dl, None, None, None, None


@functools.cache
def register() -> None:
    """Define ``sloth::moe_router`` and ``sloth::moe_router_backward`` (idempotent)."""
    fwd = define("sloth::moe_router", _moe_router_fwd)
    bwd = define("sloth::moe_router_backward", _moe_router_bwd)

    @fake(fwd)
    def _(logits, k, softmax_first, renorm, out_dtype):
        _check(logits, k)
        return (logits.new_empty((logits.shape[0], k), dtype=out_dtype),
                logits.new_empty((logits.shape[0], k), dtype=torch.int64))

    @fake(bwd)
    def _(dw, logits, idx, softmax_first, renorm):
        return logits.new_empty(logits.shape)

    fwd.register_autograd(_backward, setup_context=_setup_context)


def moe_router(logits: torch.Tensor, k: int, softmax_first: bool = True, renorm: bool = False,
               out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in ``out_dtype``, expert indices [T, k] int64) from router logits [T, E]: one of the
    module docstring's three functions."""
    register()
    return torch.ops.sloth.moe_router(logits, int(k), bool(softmax_first), bool(renorm), out_dtype)
