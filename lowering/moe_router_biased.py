"""The bias-corrected MoE router in one pass: ``torch.ops.sloth.moe_router_biased`` and its manual backward.

The routers of DeepSeek-V3, GLM-4.5, Kimi-K2, AFMoE, MiniMax-M2, Hunyuan, ERNIE-4.5 and their kin choose the
experts by a score plus a per-expert bias (the auxiliary-loss-free load balancing of DeepSeek-V3), optionally
within the best groups of experts, and weight them by the unbiased score. On router logits ``l`` [T, E] (one
row a token), in fp32 whatever the input dtype:

    s = sigmoid(l)                      or  s = softmax(l, -1)                    (``score``)
    c = s + bias                        or  c = l + bias  (``choose_logits``, sigmoid only)   bias [E], optional
    grouped (n_group G > 1): the E experts in G equal groups of E/G; a group's score is the sum of its two
        largest c (``group_top2``) or its largest; the ``topk_group`` best groups are kept and c = ``fill``
        (-inf, or 0.0 as DeepSeek-V2's descendants write it) outside them
    idx = the k largest c, in descending order, the lower index first between equals
    w_i = s[idx_i];  renorm 1: w_i = w_i / (sum_j w_j + eps);  renorm 2: w_i = w_i / max(sum_j w_j, eps)

What stays outside: a routed scaling factor and casts after the weights (Inductor fuses them into their
readers). The bias gets no gradient (it only chooses: topk's indices carry none), as in eager.

Between equal scores (experts or groups) the lower index wins, where ``torch.topk`` leaves the choice to its
implementation; with ``fill`` 0.0 every masked expert ties at 0, so a k above the kept experts with a positive
choice picks the lowest masked indices.

Backward (dw [T, k] in, dl [T, E] out; recomputed from ``l`` and ``idx``). With S = sum_j s[idx_j] and D the
denominator (S + eps, or max(S, eps)), the gradient at the selected scores:

    no renorm:  ds_i = dw_i
    renorm:     ds_i = (dw_i - sum_j dw_j w_j) / D       (renorm 2 with S < eps: ds_i = dw_i / eps)

ds is zero at the other experts; then dl = ds * s * (1 - s) (sigmoid), or dl = s * (ds - sum_i ds_i s[idx_i])
(softmax's backward: sum_e s_e ds_e has only the selected terms).

What it replaces: the sigmoid, the bias add, the grouped view, two topks (sorts), a scatter into a [T, G] mask,
its expansion to [T, E], a masked fill, the last topk, the gather and the renormalisation: about ten kernels
forward and as many backward under Inductor, one each here. A MoE step is bound by the host, where each launch
counts (benchmarks/results/2026-12-04_issue20_moe_router.md).
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
from .moe_router import MAX_EXPERTS, MAX_TOP_K, _blocks, _program_rows
from .registration import define, fake
from .rounding import round_to

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCORES = ("sigmoid", "softmax")
MAX_GROUPS = 64  # a static loop each over the groups
RENORM_NONE, RENORM_ADD, RENORM_CLAMP = 0, 1, 2


@triton.jit
def _scores(b_l, SOFTMAX: tl.constexpr):
    """s from the logits (fp32, -inf padding gives 0)."""
    if SOFTMAX:
        b_exp = tl.exp(b_l - tl.max(b_l, axis=1)[:, None])
        return b_exp / tl.sum(b_exp, axis=1)[:, None]
    return 1.0 / (1.0 + tl.exp(-b_l))


@triton.jit
def _keep_groups(b_c, o_e, group_size, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 GROUP_TOP2: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr):
    """Which experts lie in the TOPK_GROUP best groups ([M, BLOCK_E] int1; padding experts are in none)."""
    o_g = tl.arange(0, BLOCK_G)
    o_grp = o_e // group_size
    b_gs = tl.full((b_c.shape[0], BLOCK_G), float("-inf"), tl.float32)
    for g in tl.static_range(N_GROUP):
        m_g = (o_grp == g)[None, :]
        b_v = tl.where(m_g, b_c, float("-inf"))
        b_m1 = tl.max(b_v, axis=1)
        if GROUP_TOP2:
            b_at = tl.min(tl.where(m_g & (b_v == b_m1[:, None]), o_e[None, :], BLOCK_E), axis=1)
            b_m2 = tl.max(tl.where(o_e[None, :] == b_at[:, None], float("-inf"), b_v), axis=1)
            b_score = b_m1 + b_m2
        else:
            b_score = b_m1
        b_gs = tl.where(o_g[None, :] == g, b_score[:, None], b_gs)
    b_kept = tl.zeros((b_c.shape[0], BLOCK_G), tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        m_free = (o_g < N_GROUP)[None, :] & (b_kept == 0)
        b_max = tl.max(tl.where(m_free, b_gs, float("-inf")), axis=1)
        b_at = tl.min(tl.where(m_free & (b_gs == b_max[:, None]), o_g[None, :], BLOCK_G), axis=1)
        b_kept = tl.where(o_g[None, :] == b_at[:, None], 1, b_kept)
    b_keep = tl.zeros((b_c.shape[0], BLOCK_E), tl.int32)
    for g in tl.static_range(N_GROUP):
        b_kg = tl.max(tl.where(o_g[None, :] == g, b_kept, 0), axis=1)
        b_keep = tl.where((o_grp == g)[None, :] & (b_kg > 0)[:, None], 1, b_keep)
    return b_keep > 0


@triton.jit(do_not_specialize_on_alignment=["p_l", "stride_l"])  # as moe_router's: bits independent of layout
def _moe_router_biased_fwd_kernel(
    p_l, p_bias, p_w, p_idx, n_rows, n_experts, stride_l, group_size, fill, eps,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, CHOOSE_LOGITS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):
    o_m, o_e, o_k, m_m, b_l = _program_rows(p_l, n_rows, n_experts, stride_l, BLOCK_M, BLOCK_E, BLOCK_K)
    m_e = (o_e < n_experts)[None, :]
    b_s = _scores(b_l, SOFTMAX)
    if CHOOSE_LOGITS:
        b_c = b_l
    else:
        b_c = b_s
    if HAS_BIAS:
        b_c = b_c + tl.load(p_bias + o_e, mask=o_e < n_experts, other=0.0).to(tl.float32)[None, :]
    b_c = tl.where(m_e, b_c, float("-inf"))
    if N_GROUP > 1:
        b_c = tl.where(_keep_groups(b_c, o_e, group_size, N_GROUP, TOPK_GROUP, GROUP_TOP2, BLOCK_E, BLOCK_G),
                       b_c, fill)
    # The K largest c, a taken mask keeping apart the equal (-inf or fill) scores; s at each taken.
    b_idx = tl.full((BLOCK_M, BLOCK_K), 0, tl.int32)
    b_w = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    b_taken = tl.zeros((BLOCK_M, BLOCK_E), tl.int32)
    for i in tl.static_range(K):
        m_free = m_e & (b_taken == 0)
        b_max = tl.max(tl.where(m_free, b_c, float("-inf")), axis=1)
        b_at = tl.min(tl.where(m_free & (b_c == b_max[:, None]), o_e[None, :], BLOCK_E), axis=1)
        m_at = o_e[None, :] == b_at[:, None]
        b_si = tl.sum(tl.where(m_at, b_s, 0.0), axis=1)
        b_idx = tl.where(o_k[None, :] == i, b_at[:, None], b_idx)
        b_w = tl.where(o_k[None, :] == i, b_si[:, None], b_w)
        b_taken = tl.where(m_at, 1, b_taken)
    if RENORM == 1:
        b_w = b_w / (tl.sum(b_w, axis=1) + eps)[:, None]
    elif RENORM == 2:
        b_w = b_w / tl.maximum(tl.sum(b_w, axis=1), eps)[:, None]
    m_mk = m_m[:, None] & (o_k < K)[None, :]
    tl.store(p_w + o_m[:, None] * K + o_k[None, :], round_to(b_w, p_w.dtype.element_ty), mask=m_mk)
    tl.store(p_idx + o_m[:, None] * K + o_k[None, :], b_idx.to(tl.int64), mask=m_mk)


@triton.jit(do_not_specialize_on_alignment=["p_l", "stride_l", "p_dw", "stride_dw"])  # as the forward
def _moe_router_biased_bwd_kernel(
    p_dw, p_l, p_idx, p_dl, n_rows, n_experts, stride_l, stride_dw, stride_dl, eps,
    K: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    o_m, o_e, o_k, m_m, b_l = _program_rows(p_l, n_rows, n_experts, stride_l, BLOCK_M, BLOCK_E, BLOCK_K)
    m_me = m_m[:, None] & (o_e < n_experts)[None, :]
    # Rows past the end read the last row's indices and dw too (a zero sum there would divide 0 by 0).
    o_r = tl.minimum(o_m, n_rows - 1)
    m_k = (o_k < K)[None, :]
    b_idx = tl.load(p_idx + o_r[:, None] * K + o_k[None, :], mask=m_k, other=BLOCK_E).to(tl.int32)
    b_dw = tl.load(p_dw + o_r[:, None] * stride_dw + o_k[None, :], mask=m_k, other=0.0).to(tl.float32)
    b_s = _scores(b_l, SOFTMAX)
    b_sel = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)  # s at the selected experts
    for i in tl.static_range(K):
        b_at = tl.sum(tl.where(o_k[None, :] == i, b_idx, 0), axis=1)
        b_si = tl.sum(tl.where(o_e[None, :] == b_at[:, None], b_s, 0.0), axis=1)
        b_sel = tl.where(o_k[None, :] == i, b_si[:, None], b_sel)
    if RENORM == 0:
        b_ds = b_dw
    else:
        b_sum = tl.sum(b_sel, axis=1)
        if RENORM == 1:
            b_den = b_sum + eps
        else:
            b_den = tl.maximum(b_sum, eps)
        b_c = tl.sum(b_dw * b_sel, axis=1) / b_den
        b_ds = (b_dw - b_c[:, None]) / b_den[:, None]
        if RENORM == 2:  # clamp's gradient passes where the sum is at least eps (torch.clamp's rule)
            b_ds = tl.where((b_sum >= eps)[:, None], b_ds, b_dw / eps)
    b_d = tl.zeros((BLOCK_M, BLOCK_E), tl.float32)
    for i in tl.static_range(K):
        b_at = tl.sum(tl.where(o_k[None, :] == i, b_idx, 0), axis=1)
        b_di = tl.sum(tl.where(o_k[None, :] == i, b_ds, 0.0), axis=1)
        b_d = tl.where(o_e[None, :] == b_at[:, None], b_di[:, None], b_d)
    if SOFTMAX:
        b_d = b_s * (b_d - tl.sum(b_ds * b_sel, axis=1)[:, None])
    else:
        b_d = b_d * b_s * (1.0 - b_s)
    tl.store(p_dl + o_m[:, None] * stride_dl + o_e[None, :], round_to(tl.where(m_me, b_d, 0.0),
                                                                     p_dl.dtype.element_ty), mask=m_me)


def _check(logits: torch.Tensor, bias: Optional[torch.Tensor], k: int, score: str, choose_logits: bool,
           n_group: int, topk_group: int, group_top2: bool, fill: float, renorm: int) -> None:
    name = "sloth.moe_router_biased"
    if logits.dim() != 2 or logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: logits must be a float32/bfloat16/float16 [tokens, experts] tensor, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    experts = logits.shape[1]
    if experts > MAX_EXPERTS:
        raise ValueError(f"{name}: {experts} experts exceed the one-pass limit {MAX_EXPERTS}")
    if not 1 <= k <= min(experts, MAX_TOP_K):
        raise ValueError(f"{name}: k must be in [1, min(experts, {MAX_TOP_K})], got k={k} for {experts} experts")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != experts or not bias.is_floating_point()):
        raise ValueError(f"{name}: bias must be a float [experts] = [{experts}] tensor, got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    check_one_device(name, ("logits", logits), ("bias", bias))
    if score not in _SCORES:
        raise ValueError(f"{name}: score must be one of {_SCORES}, got {score!r}")
    if choose_logits and score != "sigmoid":
        raise ValueError(f"{name}: choose_logits is for sigmoid scores")
    if not 1 <= n_group <= MAX_GROUPS or experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"{name}: n_group must divide the {experts} experts (at most {MAX_GROUPS} groups) and "
                         f"topk_group be in [1, n_group], got n_group={n_group}, topk_group={topk_group}")
    if n_group > 1 and group_top2 and experts // n_group < 2:
        raise ValueError(f"{name}: a group's top-2 score needs 2 experts a group, got {experts // n_group}")
    if fill not in (float("-inf"), 0.0):
        raise ValueError(f"{name}: fill must be -inf or 0.0, got {fill}")
    if renorm not in (RENORM_NONE, RENORM_ADD, RENORM_CLAMP):
        raise ValueError(f"{name}: renorm must be 0 (none), 1 (sum + eps) or 2 (max(sum, eps)), got {renorm}")


def _scores_reference(logits: torch.Tensor, score: str) -> torch.Tensor:
    l = logits.float()
    return torch.sigmoid(l) if score == "sigmoid" else torch.softmax(l, dim=-1)


def _denominator(total: torch.Tensor, renorm: int, eps: float) -> torch.Tensor:
    return total + eps if renorm == RENORM_ADD else total.clamp(min=eps)


def moe_router_biased_reference(logits: torch.Tensor, bias: Optional[torch.Tensor], k: int, score: str,
                                choose_logits: bool, n_group: int, topk_group: int, group_top2: bool, fill: float,
                                renorm: int, eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's function in plain PyTorch, fp32 (the fallback and the tests' oracle; ties as
    ``torch.topk`` breaks them)."""
    s = _scores_reference(logits, score)
    c = logits.float() if choose_logits else s
    if bias is not None:
        c = c + bias.float()
    if n_group > 1:
        c = c.masked_fill(~group_keep_reference(c, n_group, topk_group, group_top2), fill)
    idx = torch.topk(c, k, dim=-1).indices
    w = s.gather(1, idx)
    if renorm:
        w = w / _denominator(w.sum(-1, keepdim=True), renorm, eps)
    return w.to(out_dtype), idx


def group_keep_reference(c: torch.Tensor, n_group: int, topk_group: int, group_top2: bool) -> torch.Tensor:
    """[T, E] bool: the experts in the ``topk_group`` best of ``n_group`` groups of ``c`` [T, E] (a group's score:
    the sum of its two largest, or its largest). The pattern checks a graph's group mask against this."""
    grouped = c.view(c.shape[0], n_group, c.shape[1] // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1) if group_top2 else grouped.amax(-1)
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
        1, torch.topk(group_scores, topk_group, dim=-1).indices, True)
    return kept.unsqueeze(-1).expand_as(grouped).reshape(c.shape)


def moe_router_biased_backward_reference(dw: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor, score: str,
                                         renorm: int, eps: float) -> torch.Tensor:
    """The module docstring's backward in plain PyTorch, fp32."""
    s = _scores_reference(logits, score)
    dwf, sel = dw.float(), s.gather(1, idx)
    if renorm:
        total = sel.sum(-1, keepdim=True)
        den = _denominator(total, renorm, eps)
        ds = (dwf - (dwf * sel).sum(-1, keepdim=True) / den) / den
        if renorm == RENORM_CLAMP:
            ds = torch.where(total >= eps, ds, dwf / eps)
    else:
        ds = dwf
    d = torch.zeros_like(s).scatter(1, idx, ds)
    if score == "softmax":
        d = s * (d - (ds * sel).sum(-1, keepdim=True))
    else:
        d = d * s * (1 - s)
    return d.to(logits.dtype)


def _moe_router_biased_fwd(logits: torch.Tensor, bias: Optional[torch.Tensor], k: int, score: str,
                           choose_logits: bool, n_group: int, topk_group: int, group_top2: bool, fill: float,
                           renorm: int, eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, bias, k, score, choose_logits, n_group, topk_group, group_top2, fill, renorm)
    if not use_triton(logits):
        return moe_router_biased_reference(logits, bias, k, score, choose_logits, n_group, topk_group, group_top2,
                                           fill, renorm, eps, out_dtype)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    n_rows, n_experts = logits.shape
    w = torch.empty((n_rows, k), dtype=out_dtype, device=logits.device)
    idx = torch.empty((n_rows, k), dtype=torch.int64, device=logits.device)
    if n_rows:
        block_m, block_e, block_k = _blocks(logits, k)
        _moe_router_biased_fwd_kernel[(cdiv(n_rows, block_m),)](
            logits, logits if bias is None else bias.contiguous(), w, idx, n_rows, n_experts, logits.stride(0),
            n_experts // n_group, float(fill), float(eps),
            K=k, HAS_BIAS=bias is not None, SOFTMAX=score == "softmax", CHOOSE_LOGITS=bool(choose_logits),
            N_GROUP=n_group, TOPK_GROUP=topk_group, GROUP_TOP2=bool(group_top2), RENORM=renorm,
            BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_K=block_k, BLOCK_G=max(2, next_power_of_2(n_group)),
            num_warps=4,
        )
    return w, idx


def _moe_router_biased_bwd(dw: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor, score: str, renorm: int,
                           eps: float) -> torch.Tensor:
    if not use_triton(logits):
        return moe_router_biased_backward_reference(dw, logits, idx, score, renorm, eps)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    dw, idx = dw.contiguous(), idx.contiguous()
    n_rows, n_experts = logits.shape
    k = idx.shape[1]
    dl = torch.empty((n_rows, n_experts), dtype=logits.dtype, device=logits.device)
    if n_rows:
        block_m, block_e, block_k = _blocks(logits, k)
        _moe_router_biased_bwd_kernel[(cdiv(n_rows, block_m),)](
            dw, logits, idx, dl, n_rows, n_experts, logits.stride(0), dw.stride(0), dl.stride(0), float(eps),
            K=k, SOFTMAX=score == "softmax", RENORM=renorm,
            BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4,
        )
    return dl


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    logits, _bias, _k, score, _choose, _n_group, _topk_group, _top2, _fill, renorm, eps, _dtype = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.score, ctx.renorm, ctx.eps = score, renorm, eps


def _backward(ctx, dw, _didx):
    logits, idx = ctx.saved_tensors
    dl = None
    if dw is not None:
        dl = torch.ops.sloth.moe_router_biased_backward(dw, logits, idx, ctx.score, ctx.renorm, ctx.eps)
    return (dl,) + (None,) * 11


@functools.cache
def register() -> None:
    """Define ``sloth::moe_router_biased`` and ``sloth::moe_router_biased_backward`` (idempotent)."""
    fwd = define("sloth::moe_router_biased", _moe_router_biased_fwd)
    bwd = define("sloth::moe_router_biased_backward", _moe_router_biased_bwd)

    @fake(fwd)
    def _(logits, bias, k, score, choose_logits, n_group, topk_group, group_top2, fill, renorm, eps, out_dtype):
        _check(logits, bias, k, score, choose_logits, n_group, topk_group, group_top2, fill, renorm)
        return (logits.new_empty((logits.shape[0], k), dtype=out_dtype),
                logits.new_empty((logits.shape[0], k), dtype=torch.int64))

    @fake(bwd)
    def _(dw, logits, idx, score, renorm, eps):
        return logits.new_empty(logits.shape)

    fwd.register_autograd(_backward, setup_context=_setup_context)


def moe_router_biased(logits: torch.Tensor, bias: Optional[torch.Tensor], k: int, score: str = "sigmoid",
                      choose_logits: bool = False, n_group: int = 1, topk_group: int = 1, group_top2: bool = True,
                      fill: float = float("-inf"), renorm: int = RENORM_NONE, eps: float = 0.0,
                      out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in ``out_dtype``, expert indices [T, k] int64) from router logits [T, E] and a score
    correction bias [E] (or None): the module docstring's function."""
    register()
    return torch.ops.sloth.moe_router_biased(logits, bias, int(k), str(score), bool(choose_logits), int(n_group),
                                             int(topk_group), bool(group_top2), float(fill), int(renorm),
                                             float(eps), out_dtype)
