"""Per-token log-probabilities and entropy of a linear head: ``torch.ops.sloth.linear_token_logprobs``, never
materialising the [N, V] logits.

The op equals, in PyTorch (``x_NH`` N tokens by hidden H, ``w_VH`` vocabulary V, ``b_V`` optional, ``labels_N``
int64, ``cap`` and ``s`` as in lowering/linear_cross_entropy.py, ``T`` the temperature)::

    z = cap(F.linear(x, w, b).float() * s) / T
    logp_i = log_softmax(z_i)[y_i]                  = z_iy - lse_i
    H_i    = -sum_j p_ij log p_ij                   = lse_i - sum_j p_ij z_ij         (p = softmax(z))

both 0, and without gradient, where ``labels_i == ignore_index``: the rows a loss masks out (a prompt, padding),
selected on the device without a host sync. The entropy is computed only when asked (``entropy=True``). These
are the per-token values DPO, KTO, GRPO and RLOO losses are written from (TRL's ``selective_log_softmax`` and its
entropy), where the mean cross-entropy of lowering/linear_cross_entropy.py is not enough.

Forward: the tokens in chunks of C rows (``chunk_rows``); per chunk one matmul forms the logits tile in the inputs'
dtype (as eager's ``F.linear`` rounds it), then one Triton program per row reads the row once with an online
log-sum-exp relative to the running max ``m``: ``d = sum_j exp(z_j - m)`` and ``q = sum_j exp(z_j - m) (z_j - m)``,
both rescaled when ``m`` grows (``q <- alpha (q + (m_old - m_new) d)``, ``alpha = exp(m_old - m_new)``), then z_y.
Every result is formed from differences to ``m``, never from ``lse = m + log d`` itself, whose rounding at the
logits' size (a bias of 3000: 2.4e-4 an ulp) would otherwise land in ``logp = z_y - lse``::

    logp = (z_y - m) - log d,      H = log d - q / d,      p_j = exp((z_j - m) - log d),      E - m = q / d

Each row keeps ``m``, ``log d`` and ``q / d`` (``stats``, [3, N] fp32) for the backward. With ``statistics`` the
same pass also gives TRL's per-token metrics (no gradient; rows 3-5 of ``stats``): ``log sum_j p_j^2 =
log sum_j exp(2 (z_j - m)) - 2 log d`` (the sum rescaled by ``alpha^2``), the mean logit ``sum_j z_j / V``, and
is-top-1 ``z_y >= m and z_y > max_{j<y} z_j`` (the first argmax, as ``torch.argmax`` breaks ties).

Backward derivation, with upstream gradients ``a_i`` (of logp_i) and ``e_i`` (of H_i), ``t = tanh(s l / c)``::

    dlogp_i/dz_j = [j == y_i] - p_ij
    dH_i/dz_j    = p_ij (E_i - z_ij)        (d lse/dz_j = p_j; d sum_k p_k z_k / dz_j = p_j + p_j z_j - p_j E),
                                            computed as p_ij ((E_i - m_i) - (z_ij - m_i))
    dz_j/dl_j    = s (1 - t_j^2) / T  with the softcap,   s / T without it
    g_ij = (a_i dlogp_i/dz_j + e_i dH_i/dz_j) dz_j/dl_j        (0 on ignored rows)
    dx = g @ w,   dw = g.T @ x,   db = g.sum(0)

The upstream gradients are per row and known only in the backward, so the backward forms each logits tile again
(one more N x V x H matmul, as Cut Cross-Entropy does) and writes g over it. Unless ``dx_in_forward`` says which
row gradients of x the forward computes, while the tile is there (a frozen head, LoRA's case: only dx is wanted)::

    D1_i = sum_j (dlogp_i/dz_j) (dz_j/dl_j) w_j        (bit 1)      D2_i = sum_j (dH_i/dz_j) (dz_j/dl_j) w_j   (bit 2)

(fp32, [N, H] each), and the backward is ``dx_i = a_i D1_i + e_i D2_i``: no second pass over the vocabulary. The
logits' matmul and one matmul per part: two matmuls for the log-probabilities (as the mean cross-entropy) where
recomputing takes three; a part not computed in the forward (an entropy asked for its value, then differentiated
anyway), or dw, is recomputed in the backward as above, so the result never depends on the choice. Measured on one
H100 at 4096 x 4096 x 128256 (benchmarks/results/2026-12-08_issue59_token_logprobs_h100.md): bit 1 alone, a forward
of 13.2 ms and a step of 14.4 (the mean loss 14.1, TRL's head 18.8); bits 1 and 2, whose second fp32 tile halves
the rows a program holds, a forward of 22.3 ms, slower than recomputing both parts in one backward pass, so the
graph pass asks for bit 2 nowhere.

A label outside [0, V) that is not ``ignore_index`` makes the row's log-probability, entropy and gradient NaN (as
the cross-entropy op does: no host sync); the PyTorch reference raises ``IndexError`` for CPU labels, as eager's
gather does.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .backend_choice import use_triton
from .devices import check_one_device
from .host_math import next_power_of_2
from .linear_cross_entropy import _accumulate_mm_fp32, _raise_if_out_of_range, _tanh, chunk_rows
from .registration import define, fake
from .rounding import round_to

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _capped(b_l, softcap, logit_scale, inv_temperature, HAS_SOFTCAP: tl.constexpr):
    """z = cap(l s) / T in fp32 (the module docstring)."""
    b_z = b_l.to(tl.float32) * logit_scale
    if HAS_SOFTCAP:
        b_z = softcap * _tanh(b_z / softcap)
    return b_z * inv_temperature


@triton.jit
def _token_stats_kernel(
    p_logits, p_labels, p_logp, p_entropy, p_stats,
    n_rows, n_cols, stride_l, ignore_index, softcap, logit_scale, inv_temperature,
    p_entropy_grad, stride_g,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr, LOGP_GRAD: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr, STATISTICS: tl.constexpr,
):
    # One program per row of the chunk: one pass over the row for the online log-sum-exp (m, d) and
    # q = sum_j exp(z_j - m) (z_j - m), every value relative to the running max m (module docstring), then z_y.
    i_m = tl.program_id(0).to(tl.int64)
    p_row = p_logits + i_m * stride_l
    b_y = tl.load(p_labels + i_m)
    b_valid = b_y != ignore_index
    b_m = tl.full([], float("-inf"), tl.float32)
    b_d = tl.zeros([], dtype=tl.float32)
    b_q = tl.zeros([], dtype=tl.float32)
    b_sq = tl.zeros([], dtype=tl.float32)  # statistics: sum_j exp(2 (z_j - m)), sum_j z_j, max_{j < y} z_j
    b_sum_z = tl.zeros([], dtype=tl.float32)
    b_max_before = tl.full([], float("-inf"), tl.float32)
    for i_v in range(0, tl.cdiv(n_cols, BLOCK_V)):
        o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
        m_v = o_v < n_cols
        b_z = _capped(tl.load(p_row + o_v, mask=m_v, other=0.0), softcap, logit_scale, inv_temperature,
                      HAS_SOFTCAP)
        b_m_new = tl.maximum(b_m, tl.max(tl.where(m_v, b_z, float("-inf")), axis=0))
        b_s = tl.where(m_v, b_z - b_m_new, 0.0)
        b_e = tl.where(m_v, tl.exp(b_s), 0.0)
        b_alpha = tl.exp(b_m - b_m_new)
        # the terms so far move from m to m_new: sum e (z - m_new) = alpha (q + (m - m_new) d); none yet: 0
        b_shift = tl.where(b_d > 0, b_m - b_m_new, 0.0) * b_d  # (m is -inf before the first block)
        b_q = b_alpha * (b_q + b_shift) + tl.sum(b_e * b_s, axis=0)
        b_d = b_d * b_alpha + tl.sum(b_e, axis=0)
        if STATISTICS:
            b_sq = b_sq * b_alpha * b_alpha + tl.sum(b_e * b_e, axis=0)
            b_sum_z += tl.sum(tl.where(m_v, b_z, 0.0), axis=0)
            b_max_before = tl.maximum(b_max_before, tl.max(tl.where(m_v & (o_v < b_y), b_z, float("-inf")), axis=0))
        b_m = b_m_new
    b_log_d = tl.log(b_d)
    b_mean = b_q / b_d  # E - m, with E = sum_j p_j z_j
    b_in_range = (b_y >= 0) & (b_y < n_cols)
    b_safe_y = tl.where(b_valid & b_in_range, b_y, 0)
    b_zy = _capped(tl.load(p_row + b_safe_y), softcap, logit_scale, inv_temperature, HAS_SOFTCAP)
    b_bad = tl.where(b_in_range, 0.0, float("nan"))  # NaN for a label outside [0, V) (module docstring)
    tl.store(p_logp + i_m, tl.where(b_valid, (b_zy - b_m) - b_log_d + b_bad, 0.0))
    if ENTROPY:
        tl.store(p_entropy + i_m, tl.where(b_valid, b_log_d - b_mean + b_bad, 0.0))
    tl.store(p_stats + i_m, b_m)
    tl.store(p_stats + n_rows + i_m, b_log_d)
    tl.store(p_stats + 2 * n_rows + i_m, b_mean)
    if STATISTICS:  # TRL's: log sum_j p_j^2, the mean logit, whether y is the first argmax
        tl.store(p_stats + 3 * n_rows + i_m, tl.where(b_valid, tl.log(b_sq) - 2.0 * b_log_d, 0.0))
        tl.store(p_stats + 4 * n_rows + i_m, tl.where(b_valid, b_sum_z / n_cols, 0.0))
        b_top1 = tl.where((b_zy >= b_m) & (b_zy > b_max_before), 1.0, 0.0)
        tl.store(p_stats + 5 * n_rows + i_m, tl.where(b_valid, b_top1 + b_bad, 0.0))
    if LOGP_GRAD or ENTROPY_GRAD:
        # dx_in_forward: dlogp/dl over the tile in place (a = 1, e = 0), dH/dl into the second tile (a = 0,
        # e = 1); a second read of the row, mostly from L2
        b_a = tl.where(b_valid, tl.where(b_in_range, 1.0, float("nan")), 0.0)
        b_e = tl.where(b_valid, 1.0, 0.0)
        p_grow = p_entropy_grad + i_m * stride_g
        for i_v in range(0, tl.cdiv(n_cols, BLOCK_V)):
            o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
            m_v = o_v < n_cols
            b_l = tl.load(p_row + o_v, mask=m_v, other=0.0)
            if ENTROPY_GRAD:
                b_g2 = _tile_gradient(b_l, o_v, m_v, b_y, b_m, b_log_d, b_mean, 0.0, b_e, softcap, logit_scale,
                                      inv_temperature, HAS_SOFTCAP, True)
                tl.store(p_grow + o_v, round_to(b_g2, p_entropy_grad.dtype.element_ty), mask=m_v)
            if LOGP_GRAD:
                b_g1 = _tile_gradient(b_l, o_v, m_v, b_y, b_m, b_log_d, b_mean, b_a, 0.0, softcap, logit_scale,
                                      inv_temperature, HAS_SOFTCAP, False)
                tl.store(p_row + o_v, round_to(b_g1, p_logits.dtype.element_ty), mask=m_v)


@triton.jit
def _tile_gradient(b_l, o_v, m_v, b_y, b_m, b_log_d, b_mean, b_a, b_e, softcap, logit_scale, inv_temperature,
                   HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr):
    """g_j = (a ([j == y] - p_j) + e p_j (E - z_j)) dz_j/dl_j (fp32) on one block of a row's raw logits l."""
    b_u = b_l.to(tl.float32) * logit_scale
    if HAS_SOFTCAP:
        b_t = _tanh(b_u / softcap)
        b_z = softcap * b_t * inv_temperature
    else:
        b_z = b_u * inv_temperature
    b_s = tl.where(m_v, b_z - b_m, 0.0)
    b_p = tl.where(m_v, tl.exp(tl.where(m_v, b_s - b_log_d, 0.0)), 0.0)  # lanes past V: no exp of junk
    b_dz = b_a * (tl.where(o_v == b_y, 1.0, 0.0) - b_p)
    if ENTROPY:
        b_dz += b_e * b_p * (b_mean - b_s)
    b_g = b_dz * (logit_scale * inv_temperature)
    if HAS_SOFTCAP:
        b_g = b_g * (1.0 - b_t * b_t)
    return b_g


@triton.jit
def _token_grad_kernel(
    p_logits, p_labels, p_stats, p_grad_logp, p_grad_entropy,
    n_rows, n_cols, stride_l, ignore_index, softcap, logit_scale, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # g over the tile, in place: g_j = (a ([j == y] - p_j) + e p_j (E - z_j)) dz_j/dl_j.
    i_m = tl.program_id(0).to(tl.int64)
    p_row = p_logits + i_m * stride_l
    b_y = tl.load(p_labels + i_m)
    b_valid = b_y != ignore_index
    b_in_range = (b_y >= 0) & (b_y < n_cols)
    b_m = tl.load(p_stats + i_m)
    b_log_d = tl.load(p_stats + n_rows + i_m)
    b_mean = tl.load(p_stats + 2 * n_rows + i_m)
    b_a = tl.where(b_valid, tl.load(p_grad_logp + i_m).to(tl.float32), 0.0)
    b_a = tl.where(b_in_range | ~b_valid, b_a, float("nan"))
    if ENTROPY:
        b_e = tl.where(b_valid, tl.load(p_grad_entropy + i_m).to(tl.float32), 0.0)
    else:
        b_e = 0.0
    for i_v in range(0, tl.cdiv(n_cols, BLOCK_V)):
        o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
        m_v = o_v < n_cols
        b_g = _tile_gradient(tl.load(p_row + o_v, mask=m_v, other=0.0), o_v, m_v, b_y, b_m, b_log_d, b_mean, b_a,
                             b_e, softcap, logit_scale, inv_temperature, HAS_SOFTCAP, ENTROPY)
        tl.store(p_row + o_v, round_to(b_g, p_logits.dtype.element_ty), mask=m_v)


def _z_reference(l: torch.Tensor, softcap: float, logit_scale: float, temperature: float) -> torch.Tensor:
    u = l.float() * logit_scale
    return (softcap * torch.tanh(u / softcap) if softcap else u) / temperature


def _stats_reference(l: torch.Tensor, y: torch.Tensor, ignore_index: int, softcap: float, logit_scale: float,
                     temperature: float, statistics: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel's math on one tile in PyTorch (fp32): logp, entropy, and the stats m, log d, E - m (and
    with ``statistics`` log sum p^2, the mean logit, is-top-1)."""
    z = _z_reference(l, softcap, logit_scale, temperature)
    valid = y != ignore_index
    in_range = (y >= 0) & (y < z.shape[1])
    m = z.max(-1).values
    s = z - m[:, None]
    log_d = torch.logsumexp(s, -1)
    mean = (torch.softmax(s, -1) * s).sum(-1)
    sy = s.gather(1, torch.where(valid & in_range, y, 0)[:, None]).squeeze(1)
    bad = torch.where(in_range, 0.0, float("nan"))
    rows = [m, log_d, mean]
    if statistics:
        zy = z.gather(1, torch.where(valid & in_range, y, 0)[:, None]).squeeze(1)
        before = torch.arange(z.shape[1], device=z.device)[None, :] < y[:, None]
        max_before = z.masked_fill(~before, float("-inf")).amax(-1)
        top1 = ((zy >= m) & (zy > max_before)).float() + bad
        rows += [torch.where(valid, t, 0.0) for t in (torch.logsumexp(2 * s, -1) - 2 * log_d, z.mean(-1), top1)]
    return (torch.where(valid, sy - log_d + bad, 0.0), torch.where(valid, log_d - mean + bad, 0.0),
            torch.stack(rows))


def _grad_reference(l: torch.Tensor, y: torch.Tensor, stats: torch.Tensor, a: torch.Tensor,
                    e: Optional[torch.Tensor], ignore_index: int, softcap: float, logit_scale: float,
                    temperature: float) -> torch.Tensor:
    """The backward kernel's math on one tile in PyTorch (fp32): g in the tile's dtype."""
    u = l.float() * logit_scale
    t = torch.tanh(u / softcap) if softcap else None
    z = (softcap * t if softcap else u) / temperature
    valid = y != ignore_index
    in_range = (y >= 0) & (y < z.shape[1])
    a = torch.where(valid, torch.where(in_range, a.float(), float("nan")), 0.0)
    m, log_d, mean = stats[:3]  # (with statistics, rows 3-5 are the metrics)
    s = z - m[:, None]
    p = torch.exp(s - log_d[:, None])
    onehot = torch.zeros_like(z).scatter_(1, torch.where(valid & in_range, y, 0)[:, None], 1.0)
    dz = a[:, None] * (onehot - p)
    if e is not None:
        dz = dz + torch.where(valid, e.float(), 0.0)[:, None] * p * (mean[:, None] - s)
    g = dz * (logit_scale / temperature)
    if softcap:
        g = g * (1.0 - t * t)
    return g.to(l.dtype)


def _check_inputs(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                  temperature: float) -> None:
    name = "sloth.linear_token_logprobs"
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: x must be [N, H] and w [V, H], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in _FLOAT_DTYPES or w.dtype != x.dtype:
        raise TypeError(f"{name}: x and w must share one of float32, bfloat16, float16, got {x.dtype} and {w.dtype}")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"{name}: bias must be [{w.shape[0]}] of {x.dtype}")
    if labels.dtype != torch.int64 or labels.shape != (x.shape[0],):
        raise ValueError(f"{name}: labels must be int64 of shape [{x.shape[0]}], got {labels.dtype} "
                         f"{tuple(labels.shape)}")
    if not temperature > 0:
        raise ValueError(f"{name}: temperature must be positive, got {temperature}")
    check_one_device(name, ("x", x), ("w", w), ("bias", bias), ("labels", labels))


def _tile(x_c: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return (torch.addmm(bias, x_c, w.t()) if bias is not None else x_c @ w.t()).contiguous()


LOGP_GRAD, ENTROPY_GRAD = 1, 2  # the bits of ``dx_in_forward``: which row gradients of x the forward computes


def _forward_parts(dx_in_forward: int, entropy: bool) -> tuple[bool, bool]:
    if dx_in_forward not in (0, 1, 2, 3) or dx_in_forward & ENTROPY_GRAD and not entropy:
        raise ValueError(f"sloth.linear_token_logprobs: dx_in_forward must be 0, 1, 2 or 3 (2 and 3 with the "
                         f"entropy), got {dx_in_forward} with entropy={entropy}")
    return bool(dx_in_forward & LOGP_GRAD), bool(dx_in_forward & ENTROPY_GRAD)


def _ltl_fwd(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
             ignore_index: int, softcap: float, logit_scale: float, temperature: float, entropy: bool,
             dx_in_forward: int = 0, statistics: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(x, w, bias, labels, temperature)
    logp_grad, entropy_grad = _forward_parts(dx_in_forward, entropy)
    n_rows, vocab = x.shape[0], w.shape[0]
    x = x.contiguous()
    logp = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    ent = torch.empty(n_rows if entropy else 0, dtype=torch.float32, device=x.device)
    stats = torch.empty((6 if statistics else 3, n_rows), dtype=torch.float32, device=x.device)
    # D1 then D2 (module docstring), fp32, accumulated into zeros by _accumulate_mm_fp32
    dx_parts = torch.zeros((logp_grad + entropy_grad, n_rows, x.shape[1]), dtype=torch.float32, device=x.device)
    triton_ok = use_triton(x)
    if not triton_ok and labels.device.type == "cpu":
        _raise_if_out_of_range(labels, vocab, ignore_index, "sloth.linear_token_logprobs")
    block_v = min(next_power_of_2(max(vocab, 1)), 4096)
    rows = chunk_rows(n_rows, vocab, x.shape[1])
    rows = max(1, rows // 2) if entropy_grad else rows  # two tiles at once: each half the size
    for start in range(0, n_rows, rows):
        stop = min(start + rows, n_rows)
        l_CV, y_c = _tile(x[start:stop], w, bias), labels[start:stop].contiguous()
        g2_CV = torch.empty_like(l_CV) if entropy_grad else l_CV
        if triton_ok:
            _token_stats_kernel[(stop - start,)](
                l_CV, y_c, logp[start:], ent[start:] if entropy else logp, stats[:, start:],
                n_rows, vocab, l_CV.stride(0), int(ignore_index), float(softcap), float(logit_scale),
                1.0 / float(temperature), g2_CV, g2_CV.stride(0), HAS_SOFTCAP=bool(softcap), ENTROPY=entropy,
                BLOCK_V=block_v, LOGP_GRAD=logp_grad, ENTROPY_GRAD=entropy_grad, STATISTICS=statistics,
                num_warps=8 if block_v >= 2048 else 4)
        else:
            lp, h, stats[:, start:stop] = _stats_reference(l_CV, y_c, ignore_index, softcap, logit_scale, temperature,
                                                           statistics)
            logp[start:stop] = lp
            if entropy:
                ent[start:stop] = h
            ones = torch.ones(stop - start, device=x.device)
            args = (ignore_index, softcap, logit_scale, temperature)
            if entropy_grad:
                g2_CV = _grad_reference(l_CV, y_c, stats[:, start:stop], torch.zeros_like(ones), ones, *args)
            if logp_grad:
                l_CV = _grad_reference(l_CV, y_c, stats[:, start:stop], ones, None, *args)
        if logp_grad:
            _accumulate_mm_fp32(dx_parts[0, start:stop], l_CV, w)
        if entropy_grad:
            _accumulate_mm_fp32(dx_parts[int(logp_grad), start:stop], g2_CV, w)
        del l_CV, g2_CV
    return logp, ent, stats, dx_parts


def _ltl_bwd(grad_logp: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], x: torch.Tensor,
             w: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor, stats: torch.Tensor,
             dx_parts: torch.Tensor, ignore_index: int, softcap: float, logit_scale: float, temperature: float,
             dx_in_forward: int, compute_dx: bool, compute_dw: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dw, db from the upstream gradients: dx from the forward's parts where it computed them, the rest with
    each logits tile formed again (module docstring)."""
    _check_inputs(x, w, bias, labels, temperature)
    x = x.contiguous()
    # autograd may hand a stride-0 expand; no gradient of an output is a zero one
    grad_logp = grad_logp.float().contiguous() if grad_logp is not None else None
    grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
    logp_part, entropy_part = bool(dx_in_forward & LOGP_GRAD), bool(dx_in_forward & ENTROPY_GRAD)
    if not (compute_dx and not compute_dw and (logp_part or entropy_part)):
        return _recompute_grads(grad_logp, grad_entropy, x, w, bias, labels, stats, ignore_index, softcap,
                                logit_scale, temperature, compute_dx, compute_dw)
    valid = (labels != ignore_index)[:, None]
    dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if logp_part and grad_logp is not None:
        dx += torch.where(valid, grad_logp[:, None], 0.0) * dx_parts[0]
    if entropy_part and grad_entropy is not None:
        dx += torch.where(valid, grad_entropy[:, None], 0.0) * dx_parts[int(logp_part)]
    rest_logp = None if logp_part else grad_logp
    rest_entropy = None if entropy_part else grad_entropy
    if rest_logp is not None or rest_entropy is not None:  # a part the forward did not compute, recomputed
        _recompute_grads(rest_logp, rest_entropy, x, w, bias, labels, stats, ignore_index, softcap, logit_scale,
                         temperature, True, False, dx_fp32=dx)
    return dx.to(x.dtype), x.new_empty(0), x.new_empty(0)


def _recompute_grads(grad_logp: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], x: torch.Tensor,
                     w: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor, stats: torch.Tensor,
                     ignore_index: int, softcap: float, logit_scale: float, temperature: float, compute_dx: bool,
                     compute_dw: bool, dx_fp32: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dw, db with each logits tile formed again; with ``dx_fp32``, dx is added into it instead."""
    n_rows, vocab = x.shape[0], w.shape[0]
    if grad_logp is None:
        grad_logp = torch.zeros(n_rows, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x) if compute_dx and dx_fp32 is None else x.new_empty(0)
    dw_acc = torch.zeros((vocab, x.shape[1]), dtype=torch.float32, device=x.device) if compute_dw else None
    db_acc = torch.zeros(vocab, dtype=torch.float32, device=x.device) if compute_dw and bias is not None else None
    triton_ok = use_triton(x)
    block_v = min(next_power_of_2(max(vocab, 1)), 4096)
    rows = chunk_rows(n_rows, vocab, x.shape[1], compute_dw)
    for start in range(0, n_rows, rows):
        stop = min(start + rows, n_rows)
        x_c, y_c = x[start:stop], labels[start:stop].contiguous()
        g_CV = _tile(x_c, w, bias)
        if triton_ok:
            _token_grad_kernel[(stop - start,)](
                g_CV, y_c, stats[:, start:], grad_logp[start:],
                grad_entropy[start:] if grad_entropy is not None else grad_logp,
                n_rows, vocab, g_CV.stride(0), int(ignore_index), float(softcap), float(logit_scale),
                1.0 / float(temperature), HAS_SOFTCAP=bool(softcap), ENTROPY=grad_entropy is not None,
                BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4)
        else:
            g_CV = _grad_reference(g_CV, y_c, stats[:, start:stop], grad_logp[start:stop],
                                   grad_entropy[start:stop] if grad_entropy is not None else None, ignore_index,
                                   softcap, logit_scale, temperature)
        if dx_fp32 is not None:
            _accumulate_mm_fp32(dx_fp32[start:stop], g_CV, w)
        elif compute_dx:
            torch.mm(g_CV, w, out=dx[start:stop])
        if compute_dw:
            _accumulate_mm_fp32(dw_acc, g_CV.t(), x_c)
        if db_acc is not None:
            db_acc += g_CV.sum(0, dtype=torch.float32)
        del g_CV
    dw = dw_acc.to(w.dtype) if compute_dw else x.new_empty(0)
    db = db_acc.to(bias.dtype) if db_acc is not None else x.new_empty(0)
    return dx, dw, db


def _setup_context(ctx, inputs, output) -> None:
    x, w, bias, labels, ignore_index, softcap, logit_scale, temperature, entropy, dx_in_forward, _ = inputs
    _, _, stats, dx_parts = output
    ctx.needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
    ctx.save_for_backward(x, w, bias, labels, stats, dx_parts)
    ctx.args = (ignore_index, softcap, logit_scale, temperature, entropy, dx_in_forward)
    ctx.mark_non_differentiable(stats, dx_parts)
    # an output nothing differentiates arrives as None, not zeros: no recompute pass for its part of dx
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logp, grad_entropy, _grad_stats, _grad_dx_parts):
    need_dx, need_dw, need_db = ctx.needs
    x, w, bias, labels, stats, dx_parts = ctx.saved_tensors
    ignore_index, softcap, logit_scale, temperature, entropy, dx_in_forward = ctx.args
    dx, dw, db = torch.ops.sloth.linear_token_logprobs_backward(
        grad_logp, grad_entropy if entropy else None, x, w, bias, labels, stats, dx_parts, ignore_index, softcap,
        logit_scale, temperature, dx_in_forward, need_dx, need_dw or need_db)
    return (dx if need_dx else None), (dw if need_dw else None), (db if need_db else None), *([None] * 8)


@functools.cache
def register() -> None:
    """Define ``sloth::linear_token_logprobs`` and its backward (idempotent)."""
    fwd = define("sloth::linear_token_logprobs", _ltl_fwd)
    bwd = define("sloth::linear_token_logprobs_backward", _ltl_bwd)

    def fwd_fake(x, w, bias, labels, ignore_index, softcap, logit_scale, temperature, entropy, dx_in_forward=0,
                 statistics=False):
        check_one_device("sloth.linear_token_logprobs", ("x", x), ("w", w), ("bias", bias), ("labels", labels))
        logp_grad, entropy_grad = _forward_parts(dx_in_forward, entropy)
        n = x.shape[0]
        return (x.new_empty(n, dtype=torch.float32), x.new_empty(n if entropy else 0, dtype=torch.float32),
                x.new_empty((6 if statistics else 3, n), dtype=torch.float32),
                x.new_empty((logp_grad + entropy_grad, n, x.shape[1]), dtype=torch.float32))

    def bwd_fake(grad_logp, grad_entropy, x, w, bias, labels, stats, dx_parts, ignore_index, softcap, logit_scale,
                 temperature, dx_in_forward, compute_dx, compute_dw):
        dx = x.new_empty(x.shape) if compute_dx else x.new_empty(0)
        dw = w.new_empty(w.shape) if compute_dw else x.new_empty(0)
        db = bias.new_empty(bias.shape) if compute_dw and bias is not None else x.new_empty(0)
        return dx, dw, db

    for op, impl in ((fwd, fwd_fake), (bwd, bwd_fake)):
        fake(op)(impl)
    fwd.register_autograd(_backward, setup_context=_setup_context)


def default_dx_in_forward(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> int:
    """``dx_in_forward`` for a caller that does not know which outputs get a gradient: the log-probabilities' part
    where only x gets one (a frozen head, recording autograd), else none."""
    frozen_head = not w.requires_grad and not (bias is not None and bias.requires_grad)
    return LOGP_GRAD if torch.is_grad_enabled() and x.requires_grad and frozen_head else 0


def linear_token_logprobs(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                          ignore_index: int = -100, softcap: float = 0.0, logit_scale: float = 1.0,
                          temperature: float = 1.0, entropy: bool = False, dx_in_forward: Optional[int] = None,
                          statistics: bool = False) -> tuple[Optional[torch.Tensor], ...]:
    """Per-token ``log_softmax(z)[labels]`` and, with ``entropy``, the entropy of ``softmax(z)``, for
    ``z = cap(x @ w.T + bias) * s / T`` (module docstring), both fp32 [N], without the [N, V] logits.

    ``dx_in_forward``: which row gradients of x the forward computes (module docstring; bit 1 the
    log-probabilities', bit 2 the entropy's). By default the log-probabilities' when only x gets a gradient (a
    frozen head), else none: an entropy computed for a metric then costs nothing in the backward, and one that is
    differentiated is recomputed with dw, if any (0 is the faster choice there; module docstring). Any choice
    gives the same gradients; it decides where the work is done.

    ``statistics``: also TRL's per-token metrics, without gradient, as three more fp32 [N] values:
    ``log sum_j p_j^2``, the mean of ``z``, and 1.0 where the label is the first argmax of ``z`` (else 0.0); all
    0 on ignored rows. Returns ``(logp, entropy or None)``, or with ``statistics`` ``(logp, entropy or None,
    log_sum_sq_probs, mean_logits, is_top1)``, TRL's order."""
    register()
    if dx_in_forward is None:
        dx_in_forward = default_dx_in_forward(x, w, bias)
    logp, ent, stats, _ = torch.ops.sloth.linear_token_logprobs(
        x, w, bias, labels, int(ignore_index), float(softcap), float(logit_scale), float(temperature), bool(entropy),
        int(dx_in_forward), bool(statistics))
    if statistics:
        return logp, (ent if entropy else None), stats[3], stats[4], stats[5]
    return logp, (ent if entropy else None)
