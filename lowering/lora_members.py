"""Launch-level fusion for LoRA linears that share one input (lowering/lora_shared.py): the same tile math
as lowering/lora.py's kernels, for up to three members in one launch.

The joined op of n members (q, k and v; gate and up) runs each adapter kernel once per member: on the H200
each launch costs ~16-18 us of host time (benchmarks/launch_overhead.py) and a LoRA step without CUDA graphs
is bound by that time where the GPU work is small. Here one launch covers the members, each program
choosing its member by its program id and then running lora.py's tile function on that member's tensors::

    split_members    out[rows of member i] = bf16 split of p_i        (the backward's b_i, [N_i, r])
    down_members     h[:, i r:(i + 1) r]   = x_i @ p_i                (the backward's g_i = dy_i @ b_i)
    up_add_members   y_i                  += s * h[:, i r:(i + 1) r] @ q_i   (the forward's adapter term)

Each member's tile is computed exactly as lora.py's single-member kernel computes it (same tile function,
same tile sizes and column groups), so the results are bit for bit the per-member launches'.
More than three members take one launch per three.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .backend_choice import triton_interpreter_on
from .host_math import cdiv
from .lora import (_SPLIT_BF16, _TF32X3, DOWN_CONFIG, UP_CONFIG, _block_r, _down_block_k, _down_mode, _down_tile,
                   _split_tile, _up_add_rows, up_add_groups)

MEMBERS_PER_LAUNCH = 3
_SPLIT_BLOCK_K = 64  # lora._down's split launch: 64 rows a program


@triton.jit
def _pick(i, v0, v1, v2):
    """v_i for i in {0, 1, 2}: a select, not a branch, so that the caller compiles one tile for all members."""
    return tl.where(i == 0, v0, tl.where(i == 1, v1, v2))


@triton.jit
def _split_members_kernel(p_out, R,
                          p_p0, K0, stride_pk0, stride_pr0, blocks0,
                          p_p1, K1, stride_pk1, stride_pr1, blocks1, row1,
                          p_p2, K2, stride_pk2, stride_pr2, row2,
                          BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Member i's factor p_i [K_i, R] split into out's rows row_i .. row_i + K_i (``_split_tile``); programs
    [0, blocks0) serve member 0, the next blocks1 member 1, the rest member 2."""
    i_k = tl.program_id(0)
    i = (i_k >= blocks0).to(tl.int32) + (i_k >= blocks0 + blocks1).to(tl.int32)
    _split_tile(i_k - _pick(i, 0, blocks0, blocks0 + blocks1), _pick(i, p_p0, p_p1, p_p2),
                p_out + _pick(i, 0, row1, row2) * (4 * BLOCK_R), _pick(i, K0, K1, K2), R,
                _pick(i, stride_pk0, stride_pk1, stride_pk2), _pick(i, stride_pr0, stride_pr1, stride_pr2), BLOCK_K,
                BLOCK_R)


@triton.jit
def _down_members_kernel(M, R, stride_hm,
                         p_x0, p_p0, p_h0, K0, stride_xm0, stride_pk0, stride_pr0,
                         p_x1, p_p1, p_h1, K1, stride_xm1, stride_pk1, stride_pr1,
                         p_x2, p_p2, p_h2, K2, stride_xm2, stride_pk2, stride_pr2,
                         MODE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    """h_i[M, R] = x_i[M, K_i] @ p_i[K_i, R] (``_down_tile``); grid (row blocks, members). The member's tensors
    are selected, not branched to: a branch per member would compile the pipelined K loop three times, each
    with its own shared memory (three times the single-member kernel's, past the H200's 227 KB with bf16
    adapters; seen there). Selected values keep the divisibility the three share."""
    i_m, i = tl.program_id(0), tl.program_id(1)
    _down_tile(i_m, _pick(i, p_x0, p_x1, p_x2), _pick(i, p_p0, p_p1, p_p2), _pick(i, p_h0, p_h1, p_h2), M,
               _pick(i, K0, K1, K2), R, _pick(i, stride_xm0, stride_xm1, stride_xm2),
               _pick(i, stride_pk0, stride_pk1, stride_pk2), _pick(i, stride_pr0, stride_pr1, stride_pr2), stride_hm,
               MODE, UPCAST, BLOCK_M, BLOCK_K, BLOCK_R)


@triton.jit
def _up_add_members_kernel(M, R, stride_hm, scale,
                           p_y0, p_h0, p_q0, N0, stride_ym0, stride_qr0, stride_qn0, cols0, groups0,
                           p_y1, p_h1, p_q1, N1, stride_ym1, stride_qr1, stride_qn1, cols1, groups1,
                           p_y2, p_h2, p_q2, N2, stride_ym2, stride_qr2, stride_qn2, cols2,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """y_i[M, N_i] += scale * h_i[M, R] @ q_i[R, N_i] in place (``_up_add_rows``, cols_i columns a group); grid
    (row blocks, column groups of all members: [0, groups0) member 0's, the next groups1 member 1's, the rest
    member 2's)."""
    i_m, i_g = tl.program_id(0), tl.program_id(1)
    i = (i_g >= groups0).to(tl.int32) + (i_g >= groups0 + groups1).to(tl.int32)
    _up_add_rows(i_m, i_g - _pick(i, 0, groups0, groups0 + groups1), _pick(i, p_y0, p_y1, p_y2),
                 _pick(i, p_h0, p_h1, p_h2), _pick(i, p_q0, p_q1, p_q2), M, _pick(i, N0, N1, N2), R,
                 _pick(i, stride_ym0, stride_ym1, stride_ym2), stride_hm, _pick(i, stride_qr0, stride_qr1, stride_qr2),
                 _pick(i, stride_qn0, stride_qn1, stride_qn2), scale, _pick(i, cols0, cols1, cols2), BLOCK_M, BLOCK_N,
                 BLOCK_R)


def _chunks(n: int) -> range:
    return range(0, n, MEMBERS_PER_LAUNCH)


def _padded(slots: list[tuple]) -> list[tuple]:
    """``slots`` filled up to MEMBERS_PER_LAUNCH with copies of the first (given no programs)."""
    return slots + [slots[0]] * (MEMBERS_PER_LAUNCH - len(slots))


def down_members(xs_MK: Sequence[torch.Tensor], ps_KR: Sequence[torch.Tensor], h_MR: torch.Tensor) -> torch.Tensor:
    """``h_MR[:, i r:(i + 1) r] = xs_MK[i] @ ps_KR[i]`` in fp32 for every member i (lora._down's math: one split
    launch and one down launch per three members). The x_i share rows M, dtype and (with the p_i) the product
    mode; the p_i share rank r and dtype and may be any strided views; ``h_MR`` is fp32 [M, n r] with unit column
    stride."""
    n = len(xs_MK)
    n_rows, rank = xs_MK[0].shape[0], ps_KR[0].shape[1]
    modes = {_down_mode(x, p) for x, p in zip(xs_MK, ps_KR)}
    # One dtype each for the x_i and the p_i too: the kernel selects its member's pointers, and a select needs
    # one pointer type (tf32x3 takes fp32 and bf16 activations alike, with lowering/lora.py's DOWN_SPLIT_LAUNCH off
    # as well).
    if len(modes) != 1 or len({x.dtype for x in xs_MK}) != 1 or len({p.dtype for p in ps_KR}) != 1 or \
            any(x.shape[0] != n_rows for x in xs_MK) or any(p.shape[1] != rank for p in ps_KR):
        raise ValueError("sloth.lora_members: the members must share rows, rank, dtypes and product mode, got x "
                         f"{[tuple(x.shape) for x in xs_MK]} ({[x.dtype for x in xs_MK]}), p "
                         f"{[tuple(p.shape) for p in ps_KR]} ({[p.dtype for p in ps_KR]})")
    if n_rows == 0:
        return h_MR
    (mode,) = modes
    c, block_r = DOWN_CONFIG, _block_r(rank)
    sizes = [x.shape[1] for x in xs_MK]
    block_k = _down_block_k(c, mode, block_r, xs_MK[0].element_size(), 2 if mode != _TF32X3.value else 4, max(sizes))
    if mode == _SPLIT_BF16.value:
        rows = [0]
        for k in sizes:
            rows.append(rows[-1] + k)
        split = torch.empty((rows[-1], 4 * block_r), dtype=torch.bfloat16, device=h_MR.device)
        for i0 in _chunks(n):
            members = [(ps_KR[i], sizes[i], cdiv(sizes[i], _SPLIT_BLOCK_K), rows[i] - rows[i0])
                       for i in range(i0, min(i0 + MEMBERS_PER_LAUNCH, n))]
            (p0, k0, b0, _), (p1, k1, b1, r1), (p2, k2, _, r2) = _padded(members)
            blocks = sum(m[2] for m in members)
            _split_members_kernel[(blocks,)](
                split[rows[i0]:], rank,
                p0, k0, p0.stride(0), p0.stride(1), b0,
                p1, k1, p1.stride(0), p1.stride(1), b1 if len(members) > 1 else 0, r1,
                p2, k2, p2.stride(0), p2.stride(1), r2,
                BLOCK_K=_SPLIT_BLOCK_K, BLOCK_R=block_r, num_warps=4)
        ps_KR = [split[rows[i]:rows[i + 1]] for i in range(n)]
    for i0 in _chunks(n):
        members = [(xs_MK[i], ps_KR[i], h_MR[:, i * rank:(i + 1) * rank], sizes[i])
                   for i in range(i0, min(i0 + MEMBERS_PER_LAUNCH, n))]
        args = []
        for x, p, h, k in _padded(members):
            args += [x, p, h, k, x.stride(0), p.stride(0), p.stride(1)]
        _down_members_kernel[(cdiv(n_rows, c["block_m"]), len(members))](
            n_rows, rank, h_MR.stride(0), *args,
            MODE=mode, UPCAST=triton_interpreter_on(), BLOCK_M=c["block_m"], BLOCK_K=block_k, BLOCK_R=block_r,
            num_warps=c["num_warps"], num_stages=c["num_stages"])
    return h_MR


def up_add_members_(ys_MN: Sequence[torch.Tensor], h_MR: torch.Tensor, qs_RN: Sequence[torch.Tensor],
                    scale: float) -> None:
    """``ys_MN[i] += scale * h_MR[:, i r:(i + 1) r] @ qs_RN[i]`` in place for every member i (lora._up_add_'s
    math, one launch per three members): fp32 sums, one rounding. The y_i share rows M; the q_i rank r."""
    n_rows, rank = ys_MN[0].shape[0], qs_RN[0].shape[0]
    if n_rows == 0:
        return
    c = UP_CONFIG
    for i0 in _chunks(len(ys_MN)):
        members = [(ys_MN[i], h_MR[:, i * rank:(i + 1) * rank], qs_RN[i], *up_add_groups(n_rows, ys_MN[i].shape[1]))
                   for i in range(i0, min(i0 + MEMBERS_PER_LAUNCH, len(ys_MN)))]
        args = []
        for j, (y, h, q, groups, per_group) in enumerate(_padded(members)):
            args += [y, h, q, y.shape[1], y.stride(0), q.stride(0), q.stride(1), per_group]
            if j < MEMBERS_PER_LAUNCH - 1:
                args.append(groups if j < len(members) else 0)
        _up_add_members_kernel[(cdiv(n_rows, c["block_m"]), sum(m[3] for m in members))](
            n_rows, rank, h_MR.stride(0), float(scale), *args,
            BLOCK_M=c["block_m"], BLOCK_N=c["block_n"], BLOCK_R=_block_r(rank), num_warps=c["num_warps"],
            num_stages=c["num_stages"])

