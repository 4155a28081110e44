"""Fused linear + cross-entropy: ``torch.ops.sloth.linear_cross_entropy``, never materialising the logits.

The op equals, in one line of PyTorch (shapes: ``x_NH`` N tokens by hidden H, ``w_VH`` vocabulary V,
``b_V`` optional, ``labels_N`` int64)::

    F.cross_entropy(cap(F.linear(x, w, b).float() * s), labels, ignore_index=ii, reduction=r, label_smoothing=eps)

with ``cap(z) = c * tanh(z / c)`` when the softcap ``c`` is non-zero (Gemma 2) and the identity otherwise,
and ``s`` the logit scale (Cohere, Granite; 1 = off). The [N, V] logits are never whole in memory: the
tokens are processed in chunks of C rows; per chunk the launcher computes the logits tile with one
matmul (``l_CV = x_c @ w.T + b``, in the inputs' dtype, as eager's ``F.linear`` rounds it), then one
Triton program per row computes an online log-sum-exp in fp32 over the row, the row's loss, and writes
the gradient of the loss w.r.t. the tile's logits over the tile itself; the launcher consumes that tile
at once into ``dx_c = g_CV @ w`` and ``dw += g_CV.T @ x_c`` (fp32 accumulator) and ``db += g_CV.sum(0)``.

Loss per row (``z`` the capped, scaled fp32 logits, ``lse = log(sum_j exp(z_j))``)::

    loss_i = lse - (1 - eps) * z_y - eps / V * sum_j z_j        (0 where labels_i == ignore_index)
    mean:  sum_i loss_i / n_valid      sum: sum_i loss_i         none: loss_i

``n_valid`` (the non-ignored rows) stays a device tensor: no host sync. With every row ignored, 'mean' is
0 / 0 = nan and its gradient 0, as in PyTorch.

Backward derivation. With ``p = softmax(z)`` and ``u = s * l / c``::

    dloss_i/dz_j = p_j - (1 - eps) * [j == y_i] - eps / V
    dz_j/dl_j    = s * (1 - tanh(u_j)^2)   with the softcap,   s without it
    dl/dx        = w,   dl/dw = x,   dl/db = 1
    g_ij = a_i * dloss_i/dz_j * dz_j/dl_j,   a_i = 1/n_valid (mean), 1 (sum), grad_out_i (none); 0 if ignored
    dx = g @ w,   dw = g.T @ x,   db = g.sum(0)

Gradients in the forward pass (Liger's choice) for 'mean' and 'sum': the backward that always follows a
training loss then costs one scalar multiply (``grad_out * dx``), and the forward does the work the
backward would otherwise redo: recomputing the logits in the backward (Cut Cross-Entropy's choice) costs
one more N*V*H matmul, a third more of this op's FLOPs. The memory cost, at 4096 tokens x H 4096 x V
128256 in bf16: dx (N*H, 32 MiB) is held from the forward until the backward; with a trainable head also
dw (V*H in w's dtype, 1 GiB, the size of the weight gradient the backward allocates anyway, but now
alive at the end of the forward, where activation memory peaks) and, during this op only, the fp32 dw
accumulator (V*H*4, 2 GiB). A frozen head (LoRA, QLoRA) pays the 32 MiB only. Eager keeps the bf16
logits, their fp32 copy and the fp32 log-softmax (10 bytes a logit, 4.9 GiB). Measured on the H200 (see
``_TILE_ELEMENTS``): frozen head 13.9 ms / 283 MiB peak vs Inductor 14.2 ms / 2004 MiB and eager 19.1 ms
/ 6012 MiB (283 MiB held two logits tiles; with the previous tile dropped first, one tile + dx is 160 MiB,
not yet measured); trainable head 22.2 ms / 3539 MiB vs Inductor 19.8 ms / 2036 MiB, a loss on both counts
(the fp32 dw accumulator; recomputing in the backward would not remove it).
'none' cannot use saved gradients (dw needs each row's grad_out), so it recomputes in the backward
(``sloth::linear_cross_entropy_backward``), as does any call whose forward was told not to compute a
gradient that the backward then needs.

The op returns ``(loss, dx, dw, db)``: the gradients computed in the forward are outputs, so AOTAutograd
sees them as ordinary saved tensors (empty where not computed); ``linear_cross_entropy`` returns the loss.
Labels outside [0, V) that are not ``ignore_index``, which PyTorch rejects with ``IndexError``: the Triton
kernel cannot raise without a host sync (reading the labels on the host before each launch), so it makes the
offending rows' loss and their gradient ``g_i`` NaN (under Triton's CPU interpreter too): 'mean' and 'sum'
are NaN, 'none' is NaN on those rows only, and so are those rows of dx; dw and db, sums over every row, are
NaN. Never a finite wrong loss. The PyTorch reference (Triton unavailable: a CPU without the interpreter)
raises ``IndexError`` as eager does when the labels are CPU tensors, where the check reads host memory (one
pass over N labels, no sync, nothing next to the N x V x H matmul), so a CPU run fails where eager fails; on
any other device it computes the kernel's NaN, since checking there would be the sync the kernel avoids.
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
from .registration import define, fake
from .rounding import round_to

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCTIONS = ("mean", "sum", "none")
# The per-chunk logits tile (in the inputs' dtype) is kept near this many elements. Measured on the H200
# (benchmarks/results/2026-11-29_143904_cross_entropy.*, 4096 x 4096 x 128256 bf16, fwd+bwd kernel ms /
# peak MiB above the inputs, Inductor 14.2 ms / 2004 MiB frozen head, 19.8 ms / 2036 MiB trainable):
#   rows per chunk       64      128     256     512     1024    2048
#   frozen head       38.2/96 19.8/96 15.0/157 13.9/283 13.4/533 13.0/1034
#   trainable head   144/3102 73.6/3102 41.5/3102 29.4/3163 24.0/3289 22.2/3539
# Small chunks starve the matmuls (dx = g @ w has a C x H output and a 128256-long K: split-K at C=128)
# and, with a trainable head, re-read and re-write the fp32 V x H dw accumulator once per chunk. So:
# 2^26 elements (512 rows, 128 MiB in bf16) without dw: faster than Inductor; 2^28 (2048 rows) with dw,
# where the 2 GiB fp32 accumulator dominates the peak anyway. The peaks above held two tiles (the last
# chunk's was still referenced when the next was allocated); the loop now drops it first, which leaves
# one tile + dx: 160 MiB at 512 rows, 8% of Inductor's (from the sweep's sizes, not yet re-measured).
_TILE_ELEMENTS = 1 << 26
_TILE_ELEMENTS_WITH_DW = 1 << 28


@triton.jit
def _tanh(b_u):
    """tanh in fp32 without cancellation: Taylor series for |u| < 1/4 (error below 1e-8 relative),
    ``(1 - e) / (1 + e)`` with ``e = exp(-2|u|)`` beyond (Triton has no tanh)."""
    b_a = tl.abs(b_u)
    b_u2 = b_u * b_u
    b_series = b_u * (1.0 + b_u2 * (-1.0 / 3.0 + b_u2 * (2.0 / 15.0 + b_u2 * (-17.0 / 315.0 + b_u2 * (
        62.0 / 2835.0 - b_u2 * (1382.0 / 155925.0))))))
    b_e = tl.exp(-2.0 * b_a)
    b_big = (1.0 - b_e) / (1.0 + b_e)
    b_big = tl.where(b_u < 0, -b_big, b_big)
    return tl.where(b_a < 0.25, b_series, b_big)


@triton.jit
def _lce_rows_kernel(
    p_logits, p_g, p_labels, p_loss, p_scale,
    n_cols, stride_l, stride_g, ignore_index,
    softcap, logit_scale, label_smoothing,
    HAS_SOFTCAP: tl.constexpr, COMPUTE_GRAD: tl.constexpr, PER_ROW_SCALE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # One program per row of the chunk: pass 1 reads the row once for the online log-sum-exp, the sum
    # of z (label smoothing) and z_y; pass 2 (gradients) reads it again and writes g over it (p_g is
    # p_logits for a tile the launcher computed) or into a tile of its own (logits the graph returns).
    i_m = tl.program_id(0).to(tl.int64)
    p_row = p_logits + i_m * stride_l
    p_g_row = p_g + i_m * stride_g
    b_y = tl.load(p_labels + i_m)
    b_valid = b_y != ignore_index
    b_m = tl.full([], float("-inf"), tl.float32)
    b_d = tl.zeros([], dtype=tl.float32)
    b_sz = tl.zeros([], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(n_cols, BLOCK_V)):
        o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
        m_v = o_v < n_cols
        b_z = tl.load(p_row + o_v, mask=m_v, other=0.0).to(tl.float32) * logit_scale
        if HAS_SOFTCAP:
            b_z = softcap * _tanh(b_z / softcap)
        b_sz += tl.sum(tl.where(m_v, b_z, 0.0), axis=0)
        b_z = tl.where(m_v, b_z, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_z, axis=0))
        b_d = b_d * tl.exp(b_m - b_m_new) + tl.sum(tl.exp(b_z - b_m_new), axis=0)
        b_m = b_m_new
    b_lse = b_m + tl.log(b_d)
    # A label outside [0, V) that is not ignore_index (eager raises): the row's loss and gradient are NaN,
    # so the reduced loss is NaN too, with no host sync; z_y is read at 0 so that no read is out of bounds.
    b_in_range = (b_y >= 0) & (b_y < n_cols)
    b_safe_y = tl.where(b_valid & b_in_range, b_y, 0)
    b_zy = tl.load(p_row + b_safe_y).to(tl.float32) * logit_scale
    if HAS_SOFTCAP:
        b_zy = softcap * _tanh(b_zy / softcap)
    b_loss = b_lse - (1.0 - label_smoothing) * b_zy - label_smoothing / n_cols * b_sz
    b_loss = tl.where(b_in_range, b_loss, float("nan"))
    tl.store(p_loss + i_m, tl.where(b_valid, b_loss, 0.0))
    if COMPUTE_GRAD:
        if PER_ROW_SCALE:
            b_a = tl.load(p_scale + i_m).to(tl.float32)
        else:
            b_a = tl.load(p_scale).to(tl.float32)
        b_a = tl.where(b_in_range, b_a, float("nan"))
        b_a = tl.where(b_valid, b_a, 0.0) * logit_scale
        for i_v in range(0, tl.cdiv(n_cols, BLOCK_V)):
            o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
            m_v = o_v < n_cols
            b_z = tl.load(p_row + o_v, mask=m_v, other=0.0).to(tl.float32) * logit_scale
            if HAS_SOFTCAP:
                b_t = _tanh(b_z / softcap)
                b_z = softcap * b_t
            b_dz = tl.exp(b_z - b_lse) - label_smoothing / n_cols - tl.where(o_v == b_y, 1.0 - label_smoothing, 0.0)
            b_g = b_dz * b_a
            if HAS_SOFTCAP:
                b_g = b_g * (1.0 - b_t * b_t)
            tl.store(p_g_row + o_v, round_to(b_g, p_g.dtype.element_ty), mask=m_v)


def chunk_rows(n_rows: int, vocab: int, hidden: int, weight_grad: bool = False) -> int:
    """Rows per chunk: the power of two at or below ``tile / V`` (``_TILE_ELEMENTS``, or
    ``_TILE_ELEMENTS_WITH_DW`` when dw is accumulated), and no more than ``n_rows`` rounded up to a
    power of two. ``hidden`` is unused by the rule (kept so the rule may depend on it)."""
    tile = _TILE_ELEMENTS_WITH_DW if weight_grad else _TILE_ELEMENTS
    by_tile = 1 << (max(1, tile // max(vocab, 1)).bit_length() - 1)
    return min(by_tile, next_power_of_2(max(n_rows, 1)))


@functools.cache
def _fp32_out_addmm_works(device_index: int) -> bool:
    """Whether ``torch.addmm(acc, a, b, torch.float32, out=acc)`` (bf16 inputs, fp32 accumulate and
    output) runs on this CUDA device with this torch. Not yet seen on a GPU (the CPU build has only a
    Meta kernel for it), so it is probed once on 2 x 2 tensors; the one host sync happens here."""
    try:
        acc = torch.zeros(2, 2, device=f"cuda:{device_index}")
        ones = torch.ones(2, 2, dtype=torch.bfloat16, device=acc.device)
        torch.addmm(acc, ones, ones, torch.float32, out=acc)
        return bool((acc == 2).all())
    except (RuntimeError, TypeError):
        return False


def _accumulate_mm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32, without a V x H temporary (the dw accumulator of every chunk)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda and _fp32_out_addmm_works(a.device.index or 0):
        torch.addmm(acc, a, b, torch.float32, out=acc)  # bf16/fp16 inputs, fp32 accumulate and output
    else:
        acc.addmm_(a.float(), b.float())  # fp32 copies of the chunk: correct everywhere, slower on a GPU


def _check_inputs(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                  reduction: str, logits: Optional[torch.Tensor] = None) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"sloth.linear_cross_entropy: x must be [N, H] and w [V, H], got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    if x.dtype not in _FLOAT_DTYPES or w.dtype != x.dtype:
        raise TypeError(f"sloth.linear_cross_entropy: x and w must share one of float32, bfloat16, float16, "
                        f"got {x.dtype} and {w.dtype}")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"sloth.linear_cross_entropy: bias must be [{w.shape[0]}] of {x.dtype}")
    if labels.dtype != torch.int64 or labels.shape != (x.shape[0],):
        raise ValueError(f"sloth.linear_cross_entropy: labels must be int64 of shape [{x.shape[0]}], "
                         f"got {labels.dtype} {tuple(labels.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"sloth.linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    _check_devices(x, w, bias, labels, logits)
    if logits is not None and (logits.shape != (x.shape[0], w.shape[0]) or logits.dtype != x.dtype):
        raise ValueError(f"sloth.linear_cross_entropy: logits must be [{x.shape[0]}, {w.shape[0]}] of {x.dtype} "
                         f"(x @ w.T + bias), got {logits.dtype} {tuple(logits.shape)}")


def _check_devices(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                   logits: Optional[torch.Tensor] = None) -> None:
    """One device for every input (the forward's fake runs this too: lowering/devices.py says why)."""
    check_one_device("sloth.linear_cross_entropy", ("x", x), ("w", w), ("bias", bias), ("labels", labels),
                     ("logits", logits))


def _row_loss_and_grad_reference(l: torch.Tensor, y: torch.Tensor, a: Optional[torch.Tensor], ignore_index: int,
                                 softcap: float, logit_scale: float, label_smoothing: float
                                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The kernel's math on one logits tile in plain PyTorch (fp32): per-row loss, and g when ``a`` is given.
    As in the kernel, a row whose label is outside [0, V) and not ``ignore_index`` gets a NaN loss and gradient
    (``_chunked`` raises before that on CPU tensors)."""
    u = l.float() * logit_scale
    t = torch.tanh(u / softcap) if softcap else None
    z = softcap * t if softcap else u
    valid = y != ignore_index
    in_range = (y >= 0) & (y < z.shape[1])
    safe_y = torch.where(valid & in_range, y, 0)
    lse = torch.logsumexp(z, -1)
    zy = z.gather(1, safe_y[:, None]).squeeze(1)
    loss = lse - (1.0 - label_smoothing) * zy - label_smoothing / z.shape[1] * z.sum(-1)
    loss = torch.where(valid, torch.where(in_range, loss, float("nan")), 0.0)
    if a is None:
        return loss, None
    dz = torch.softmax(z, -1) - label_smoothing / z.shape[1]
    target = torch.nn.functional.one_hot(safe_y, z.shape[1]) * (valid & in_range)[:, None]
    dz = dz - (1.0 - label_smoothing) * target
    a = torch.where(valid, torch.where(in_range, a, float("nan")), 0.0)
    g = dz * (a * logit_scale)[:, None]
    if softcap:
        g = g * (1.0 - t * t)
    return loss, g.to(l.dtype)


def _chunked(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
             row_scale: Optional[torch.Tensor], ignore_index: int, softcap: float, logit_scale: float,
             label_smoothing: float, compute_dx: bool, compute_dw: bool, logits: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row losses (fp32 [N]) and, when ``row_scale`` is given, dx, dw, db of ``sum_i a_i * loss_i``.

    ``row_scale`` is a 0-dim tensor (one ``a`` for every row) or an [N] tensor (one per row). ``logits``, when
    given, is ``x @ w.T + bias`` as the graph computed it: its tiles are read instead of recomputed (no matmul
    for them) and the gradient tiles go to one reused buffer, since the logits themselves are not ours to
    overwrite.
    """
    n_rows, hidden = x.shape
    vocab = w.shape[0]
    grads = row_scale is not None
    compute_dx, compute_dw = compute_dx and grads, compute_dw and grads
    compute_db = grads and bias is not None and compute_dw
    x = x.contiguous()
    loss = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x) if compute_dx else x.new_empty(0)
    dw_acc = torch.zeros((vocab, hidden), dtype=torch.float32, device=x.device) if compute_dw else None
    db_acc = torch.zeros(vocab, dtype=torch.float32, device=x.device) if compute_db else None
    triton_ok = use_triton(x)
    if not triton_ok and labels.device.type == "cpu":
        _raise_if_out_of_range(labels, vocab, ignore_index)
    block_v = min(next_power_of_2(max(vocab, 1)), 4096)
    rows = chunk_rows(n_rows, vocab, hidden, compute_dw)
    if logits is not None and logits.stride(-1) != 1:
        logits = logits.contiguous()
    g_buffer = (logits.new_empty((min(rows, n_rows), vocab)) if logits is not None and grads and triton_ok
                else None)
    for start in range(0, n_rows, rows):
        stop = min(start + rows, n_rows)
        x_c, y_c = x[start:stop], labels[start:stop]
        if logits is not None:
            l_CV = logits[start:stop]
        else:
            l_CV = torch.addmm(bias, x_c, w.t()) if bias is not None else x_c @ w.t()
        a_c = None if not grads else (row_scale if row_scale.dim() == 0 else row_scale[start:stop])
        if triton_ok:
            if logits is None:
                l_CV = l_CV.contiguous()
            g_CV = l_CV if g_buffer is None else g_buffer[:stop - start]
            _lce_rows_kernel[(stop - start,)](
                l_CV, g_CV, y_c.contiguous(), loss[start:stop], a_c if grads else loss,
                vocab, l_CV.stride(0), g_CV.stride(0), int(ignore_index),
                float(softcap), float(logit_scale), float(label_smoothing),
                HAS_SOFTCAP=bool(softcap), COMPUTE_GRAD=grads, PER_ROW_SCALE=grads and row_scale.dim() == 1,
                BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
            )
        else:
            a_rows = None if not grads else a_c.float().expand(stop - start)
            loss[start:stop], g_CV = _row_loss_and_grad_reference(l_CV, y_c, a_rows, ignore_index, softcap,
                                                                  logit_scale, label_smoothing)
        if compute_dx:
            torch.mm(g_CV, w, out=dx[start:stop])
        if compute_dw:
            _accumulate_mm_fp32(dw_acc, g_CV.t(), x_c)
        if compute_db:
            db_acc += g_CV.sum(0, dtype=torch.float32)
        # Drop this chunk's tile before the next one is allocated: otherwise two tiles are alive at the
        # next addmm (seen on the H200: peak 2 x tile + dx).
        del l_CV, g_CV
    dw = dw_acc.to(w.dtype) if compute_dw else x.new_empty(0)
    db = db_acc.to(bias.dtype) if compute_db else x.new_empty(0)
    return loss, dx, dw, db


def _raise_if_out_of_range(labels: torch.Tensor, vocab: int, ignore_index: int,
                           op: str = "sloth.linear_cross_entropy") -> None:
    """``IndexError`` for a label outside [0, V) that is not ``ignore_index``, as eager's cross-entropy raises,
    naming ``op``. Only for CPU tensors, where reading the labels is no host sync (see the module docstring)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bad.any():
        raise IndexError(f"{op}: target {int(labels[bad][0])} is out of bounds (V = {vocab}, "
                         f"ignore_index = {ignore_index})")


def _valid_count(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return (labels != ignore_index).sum().to(torch.float32)


def _lce_fwd(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
             ignore_index: int, reduction: str, softcap: float, logit_scale: float, label_smoothing: float,
             compute_dx: bool, compute_dw: bool, logits: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(x, w, bias, labels, reduction, logits)
    count = _valid_count(labels, ignore_index) if reduction == "mean" else None
    if reduction == "none" or not (compute_dx or compute_dw):
        row_scale = None  # 'none' recomputes in the backward; no gradient wanted: loss only
    elif reduction == "mean":
        row_scale = 1.0 / count
    else:
        row_scale = torch.ones((), dtype=torch.float32, device=x.device)
    loss, dx, dw, db = _chunked(x, w, bias, labels, row_scale, ignore_index, softcap, logit_scale,
                                label_smoothing, compute_dx, compute_dw, logits)
    if reduction == "mean":
        loss = loss.sum() / count
    elif reduction == "sum":
        loss = loss.sum()
    return loss, dx, dw, db


def _lce_bwd(grad_loss: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
             labels: torch.Tensor, ignore_index: int, reduction: str, softcap: float, logit_scale: float,
             label_smoothing: float, compute_dw: bool, logits: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dw, db recomputed chunk by chunk, for any reduction (``grad_loss`` scalar, or [N] for 'none');
    from ``logits`` when the forward had them."""
    _check_inputs(x, w, bias, labels, reduction, logits)
    row_scale = grad_loss.float().contiguous()  # autograd hands 'none' a stride-0 expand of one value
    if reduction == "mean":
        row_scale = row_scale / _valid_count(labels, ignore_index)
    _, dx, dw, db = _chunked(x, w, bias, labels, row_scale, ignore_index, softcap, logit_scale,
                             label_smoothing, True, compute_dw, logits)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    (x, w, bias, labels, ignore_index, reduction, softcap, logit_scale, label_smoothing, compute_dx, compute_dw,
     logits) = inputs
    _, dx, dw, db = output
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = bias is not None and ctx.needs_input_grad[2]
    # With every needed gradient formed in the forward (mean or sum; the op's own flags say which it formed),
    # the backward only scales them: x, w and the labels are not kept for it (in a compiled graph, keeping x
    # would keep the final norm's output), nor a gradient nobody needs.
    ctx.precomputed = reduction != "none" and (compute_dx or not need_dx) and (compute_dw or not (need_dw or need_db))
    ctx.needs = (need_dx, need_dw, need_db)
    ctx.dtypes = (x.dtype, w.dtype, bias.dtype if bias is not None else None)
    if ctx.precomputed:
        ctx.save_for_backward(dx if need_dx else None, dw if need_dw else None, db if need_db else None)
    else:
        ctx.save_for_backward(x, w, bias, labels, logits)
    ctx.args = (ignore_index, reduction, softcap, logit_scale, label_smoothing)
    ctx.mark_non_differentiable(dx, dw, db)


def _backward(ctx, grad_loss, _gdx, _gdw, _gdb):
    need_dx, need_dw, need_db = ctx.needs
    if ctx.precomputed:
        dx, dw, db = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        return ((grad_loss * dx).to(x_dtype) if need_dx else None, (grad_loss * dw).to(w_dtype) if need_dw else None,
                (grad_loss * db).to(b_dtype) if need_db else None, *([None] * 9))
    x, w, bias, labels, logits = ctx.saved_tensors
    ignore_index, reduction, softcap, logit_scale, label_smoothing = ctx.args
    dx, dw, db = torch.ops.sloth.linear_cross_entropy_backward(
        grad_loss, x, w, bias, labels, ignore_index, reduction, softcap, logit_scale, label_smoothing,
        need_dw or need_db, logits)
    # No gradient for ``logits``: they are x @ w.T + bias, whose gradient the op already routes to x, w and bias
    # (a gradient through the graph's own lm_head as well would count the loss twice).
    return (dx if need_dx else None), (dw if need_dw else None), (db if need_db else None), *([None] * 9)


@functools.cache
def register() -> None:
    """Define ``sloth::linear_cross_entropy`` and ``sloth::linear_cross_entropy_backward`` (idempotent)."""
    fwd = define("sloth::linear_cross_entropy", _lce_fwd)
    bwd = define("sloth::linear_cross_entropy_backward", _lce_bwd)

    def fwd_fake(x, w, bias, labels, ignore_index, reduction, softcap, logit_scale, label_smoothing, compute_dx,
                 compute_dw, logits=None):
        _check_devices(x, w, bias, labels, logits)
        loss = x.new_empty((x.shape[0],) if reduction == "none" else (), dtype=torch.float32)
        grads = reduction != "none" and (compute_dx or compute_dw)
        dx = x.new_empty(x.shape) if grads and compute_dx else x.new_empty(0)
        dw = w.new_empty(w.shape) if grads and compute_dw else x.new_empty(0)
        db = bias.new_empty(bias.shape) if grads and compute_dw and bias is not None else x.new_empty(0)
        return loss, dx, dw, db

    def bwd_fake(grad_loss, x, w, bias, labels, ignore_index, reduction, softcap, logit_scale, label_smoothing,
                 compute_dw, logits=None):
        dw = w.new_empty(w.shape) if compute_dw else x.new_empty(0)
        db = bias.new_empty(bias.shape) if compute_dw and bias is not None else x.new_empty(0)
        return x.new_empty(x.shape), dw, db

    for op, impl in ((fwd, fwd_fake), (bwd, bwd_fake)):
        fake(op)(impl)
    fwd.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "mean", softcap: float = 0.0,
                         logit_scale: float = 1.0, label_smoothing: float = 0.0,
                         logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Cross-entropy of ``x @ w.T + bias`` against ``labels`` without the [N, V] logits; see the module
    docstring for the exact math. The loss is fp32 (scalar, or [N] for ``reduction='none'``).

    ``logits``: ``x @ w.T + bias`` when the caller has computed it anyway (to return it): the loss and the
    gradients are then read from it, with no matmul for the logits; it gets no gradient from the loss."""
    register()
    grad_on = torch.is_grad_enabled()
    compute_dw = grad_on and (w.requires_grad or (bias is not None and bias.requires_grad))
    loss, _, _, _ = torch.ops.sloth.linear_cross_entropy(
        x, w, bias, labels, int(ignore_index), reduction, float(softcap), float(logit_scale),
        float(label_smoothing), grad_on and x.requires_grad, compute_dw, logits)
    return loss
