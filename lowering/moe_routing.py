"""The dispatch of ``sloth.moe_experts`` (lowering/moe.py): the S = T*K assignments of ``top_k_index [T, K]`` sorted
by expert, stably, as a counting sort in two Triton launches instead of a radix sort and four more PyTorch ops.

For assignment i (token i // K) with expert e_i in [0, E), the outputs are::

    offs[e]      = #{i : e_i <= e}                                (int32 [E]: the end of expert e's rows)
    pos(i)       = offs[e_i - 1] + #{j < i : e_j = e_i}           (its sorted row: stable, token order within e)
    order[pos(i)] = i,  sorted_ids[pos(i)] = e_i,  token[pos(i)] = i // K,  inverse[i] = pos(i)

``_route_counts_kernel`` counts each block of block_s assignments per expert ([blocks, E + 1] int32, a one-hot
compare summed over the block; the last column counts ids outside [0, E)); ``_route_scatter_kernel``, one program
per block again, sums the counts of all blocks (the totals, whose exclusive prefix sum is each expert's first row)
and of the blocks before its own (its base within each expert), ranks its assignments within their expert by a
cumulative sum of the one-hot over the block, and writes the four permutation arrays at pos(i) (and offs, once).
Every pos(i) is written exactly once, so the result is deterministic and equal to ``torch.sort(stable=True)``'s,
with no atomics and no host sync.

Ids outside [0, E) (which the op documents as undefined, since checking needs a host sync) still get distinct rows
after every expert's, so the outputs stay permutations and no write leaves its array.

Why: per MoE layer the forward ran ``torch.sort`` (a CUB radix sort: its temporary-storage query and two or more
launches), ``arange`` + ``searchsorted`` for offs, ``arange`` + an index-put for the inverse and a floor-divide for
the token of each row: about seven launches, on a step that waits on its host. This is two launches. Measured on an
H100 (benchmarks/ops/moe_routing.py; benchmarks/results/2026-12-06_issue20_final_rows_routing_h100.md): at Qwen3-MoE's
4096 tokens of top-8 over 128 experts 52.0 us of host time a call against 134.7 (about 1 ms a 12-layer step), and
at 8192 tokens 39.8 us of GPU time against 83.7. The backward forms the inverse and the token of each row again from
the saved order in one launch (``invert_order``) instead of three: 2.9 against 7.8 us of GPU time.
``ROUTE_CHOICE = "sort"`` (benchmarks/variants.py's ``moe_route_sort``) keeps the PyTorch ops, which also run
wherever Triton does not.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .backend_choice import use_triton
from .host_math import cdiv, next_power_of_2

ROUTE_CHOICE = "counting"  # or "sort" (module docstring)

# Each program holds a [block_s, next_power_of_2(E)] one-hot and its cumulative sum: block_s rows such that the
# tile has at most TILE elements (256 rows at 128 experts).
TILE = 32768
# Blocks' counts summed per step of the scatter kernel's loop over blocks.
BLOCK_C = 32
# Every scatter program sums the counts of all blocks, so the work grows as blocks^2 * E: past this many blocks
# (65536 assignments at 128 experts, 8192 tokens of top-8) the radix sort of route_reference is used instead.
MAX_BLOCKS = 256


class Routing(NamedTuple):
    """The dispatch of S assignments (module docstring): order [S] int64, sorted_ids [S] (top_k_index's dtype),
    offs [E] int32, inverse [S] int64, token [S] int64 (order // K)."""
    order: torch.Tensor
    sorted_ids: torch.Tensor
    offs: torch.Tensor
    inverse: torch.Tensor
    token: torch.Tensor


@triton.jit
def _route_counts_kernel(p_ids, p_counts, S, E, stride_c, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[block, e] = #{i in the block : ids[i] = e} for e < E, and counts[block, E] = the block's ids outside
    [0, E)."""
    i_b = tl.program_id(0)
    o_s = i_b * BLOCK_S + tl.arange(0, BLOCK_S)
    m_s = o_s < S
    b_ids = tl.load(p_ids + o_s, mask=m_s, other=0).to(tl.int32)
    o_e = tl.arange(0, BLOCK_E)
    b_hit = (b_ids[:, None] == o_e[None, :]) & m_s[:, None]
    tl.store(p_counts + i_b * stride_c + o_e, tl.sum(b_hit.to(tl.int32), axis=0), mask=o_e < E)
    b_bad = m_s & ((b_ids < 0) | (b_ids >= E))
    tl.store(p_counts + i_b * stride_c + E, tl.sum(b_bad.to(tl.int32), axis=0))


@triton.jit
def _route_scatter_kernel(p_ids, p_counts, p_order, p_sorted, p_inverse, p_token, p_offs, S, E, n_blocks, stride_c,
                          TOP_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    """Each assignment of block ``program_id`` written at its sorted row (module docstring); block 0 also writes
    offs."""
    i_b = tl.program_id(0)
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    b_total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    b_before = tl.zeros((BLOCK_E,), dtype=tl.int32)
    n_bad_before = 0
    for c0 in range(0, n_blocks, BLOCK_C):
        o_c = c0 + tl.arange(0, BLOCK_C)
        m_c = o_c < n_blocks
        b_c = tl.load(p_counts + o_c[:, None] * stride_c + o_e[None, :], mask=m_c[:, None] & m_e[None, :], other=0)
        b_total += tl.sum(b_c, axis=0)
        b_before += tl.sum(tl.where((o_c < i_b)[:, None], b_c, 0), axis=0)
        b_bad = tl.load(p_counts + o_c * stride_c + E, mask=m_c & (o_c < i_b), other=0)
        n_bad_before += tl.sum(b_bad, axis=0)
    b_ends = tl.cumsum(b_total, axis=0)
    if i_b == 0:
        tl.store(p_offs + o_e, b_ends, mask=m_e)
    b_base = b_ends - b_total + b_before  # this block's first row within each expert
    n_valid = tl.sum(b_total, axis=0)

    o_s = i_b * BLOCK_S + tl.arange(0, BLOCK_S)
    m_s = o_s < S
    b_raw = tl.load(p_ids + o_s, mask=m_s, other=0)
    b_ids = b_raw.to(tl.int32)
    b_hit = (b_ids[:, None] == o_e[None, :]) & m_s[:, None] & m_e[None, :]
    b_hit32 = b_hit.to(tl.int32)
    # Rank within the block among the same expert (stable: index order), then the expert's base for this block.
    b_rank = tl.sum(tl.where(b_hit, tl.cumsum(b_hit32, axis=0), 0), axis=1) - 1
    b_pos = tl.sum(tl.where(b_hit, b_base[None, :], 0), axis=1) + b_rank
    b_bad = m_s & ((b_ids < 0) | (b_ids >= E))
    b_bad32 = b_bad.to(tl.int32)
    b_pos = tl.where(b_bad, n_valid + n_bad_before + tl.cumsum(b_bad32, axis=0) - 1, b_pos)
    b_pos64 = b_pos.to(tl.int64)
    o_s64 = o_s.to(tl.int64)
    tl.store(p_order + b_pos64, o_s64, mask=m_s)
    tl.store(p_sorted + b_pos64, b_raw, mask=m_s)
    tl.store(p_token + b_pos64, o_s64 // TOP_K, mask=m_s)
    tl.store(p_inverse + o_s64, b_pos64, mask=m_s)


@triton.jit
def _invert_order_kernel(p_order, p_inverse, p_token, S, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """inverse[order[r]] = r and token[r] = order[r] // TOP_K for a block of rows r."""
    o_r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_r = o_r < S
    b_order = tl.load(p_order + o_r, mask=m_r, other=0)
    tl.store(p_inverse + b_order, o_r, mask=m_r)
    tl.store(p_token + o_r, b_order // TOP_K, mask=m_r)


def invert_order(order: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inverse [S], token [S]) of a saved ``order`` (a permutation of [0, S), int64): what ``route`` gave the forward
    beside it, formed again for the backward in one launch where Triton runs (else an index-put and a floor-divide)."""
    if top_k < 1:
        raise ValueError(f"sloth.moe_experts: top_k must be at least 1, got {top_k}")
    n_rows = order.shape[0]
    if ROUTE_CHOICE == "sort" or not use_triton(order) or n_rows == 0 or not order.is_contiguous():
        return invert_order_reference(order, top_k)
    inverse, token = torch.empty_like(order), torch.empty_like(order)
    _invert_order_kernel[(cdiv(n_rows, 1024),)](order, inverse, token, n_rows, TOP_K=top_k, BLOCK=1024,
                                                       num_warps=4)
    return inverse, token


def invert_order_reference(order: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``invert_order`` in PyTorch ops: an index-put for the inverse, a floor-divide for the tokens."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=order.device, dtype=order.dtype)
    return inverse, order // top_k


def route_reference(top_k_index: torch.Tensor, n_experts: int) -> Routing:
    """``route`` in PyTorch ops: a stable sort, ``searchsorted`` for offs, then ``invert_order_reference``."""
    sorted_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    bounds = torch.arange(n_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, bounds, right=True, out_int32=True)
    return Routing(order, sorted_ids, offs, *invert_order_reference(order, top_k_index.shape[1]))


def route(top_k_index: torch.Tensor, n_experts: int) -> Routing:
    """The dispatch of ``top_k_index [T, K]`` (int32 or int64, ids in [0, n_experts)) over ``n_experts`` experts
    (module docstring): two Triton launches where Triton runs and ROUTE_CHOICE is not "sort", else
    ``route_reference``; the same values either way."""
    if top_k_index.dim() != 2:
        raise ValueError(f"sloth.moe_experts: top_k_index must be [T, K], got shape {tuple(top_k_index.shape)}")
    if n_experts < 1:
        raise ValueError(f"sloth.moe_experts: the experts must number at least 1, got {n_experts}")
    n_rows = top_k_index.numel()
    block_e = max(16, next_power_of_2(n_experts))
    block_s = max(16, min(1024, TILE // block_e))
    n_blocks = cdiv(n_rows, block_s)
    if ROUTE_CHOICE == "sort" or not use_triton(top_k_index) or n_rows == 0 or n_blocks > MAX_BLOCKS:
        return route_reference(top_k_index, n_experts)
    device = top_k_index.device
    ids = top_k_index.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    counts = torch.empty((n_blocks, n_experts + 1), dtype=torch.int32, device=device)
    order = torch.empty(n_rows, dtype=torch.int64, device=device)
    sorted_ids = torch.empty_like(ids)
    inverse = torch.empty(n_rows, dtype=torch.int64, device=device)
    token = torch.empty(n_rows, dtype=torch.int64, device=device)
    offs = torch.empty(n_experts, dtype=torch.int32, device=device)
    # Each program holds [BLOCK_S, block_e] int32 tiles: more warps as the experts grow (128 experts: 8 warps).
    warps = 4 if block_e <= 64 else 8
    _route_counts_kernel[(n_blocks,)](ids, counts, n_rows, n_experts, counts.stride(0), BLOCK_S=block_s,
                                              BLOCK_E=block_e, num_warps=warps)
    _route_scatter_kernel[(n_blocks,)](
        ids, counts, order, sorted_ids, inverse, token, offs, n_rows, n_experts, n_blocks, counts.stride(0),
        TOP_K=top_k_index.shape[1], BLOCK_S=block_s, BLOCK_E=block_e, BLOCK_C=BLOCK_C, num_warps=warps)
    return Routing(order, sorted_ids, offs, inverse, token)
