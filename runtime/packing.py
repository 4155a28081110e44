"""Packed-sequence metadata: each token's document bounds, built once per batch from position ids.

A packed row holds several documents back to back. What marks where a document starts depends on what the
model reads; each rule is the one a mask in the wild is built from (patterns/packed_attention.py finds which
one a model's mask follows)::

    "position_reset"  a token starts a document where its position is not the previous one's plus 1
                      (transformers' ``find_packed_sequence_indices``: ``cumsum(diff(position_ids) != 1)``)
    "position_zero"   a token starts a document where its position is 0 (``cumsum(position_ids == 0)``)
    "id_change"       the input holds document ids; a document starts where the id changes

The first token of a row always starts a document. From the start flags, per token t of row b::

    start[b, t] = max(s <= t : s starts a document)          (a running max of the flagged indices)
    end[b, t]   = min(s > t : s starts a document, or T)     (a running min from the right)

returned as one int32 tensor ``[2, B, T]`` (sloth.document_attention's ``bounds``). All of it is elementwise
work and two scans on the device: no host sync, no data-dependent shape, nothing of size T^2. The graph
computes it once, at the top, and every layer (and every checkpointed recomputation) reads the same tensor.
"""
from __future__ import annotations

from typing import Optional

import torch

RULES = ("position_reset", "position_zero", "id_change")


def document_starts(ids: torch.Tensor, rule: str) -> torch.Tensor:
    """Bool [B, T]: whether each token starts a document under ``rule`` (``ids``: [B, T] or [T] integers)."""
    if rule not in RULES:
        raise ValueError(f"sloth: unknown document rule {rule!r}; known: {RULES}")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"sloth: document ids must be a [batch, tokens] integer tensor, got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    first = torch.ones_like(ids[:, :1], dtype=torch.bool)
    if rule == "position_reset":
        rest = ids[:, 1:] != ids[:, :-1] + 1
    elif rule == "position_zero":
        rest = ids[:, 1:] == 0
    else:
        rest = ids[:, 1:] != ids[:, :-1]
    return torch.cat([first, rest], dim=1)


def document_bounds(ids: torch.Tensor, rule: str, batch: Optional[int] = None) -> torch.Tensor:
    """int32 [2, B, T]: each token's document start and end (exclusive), by ``rule`` (module docstring);
    ``batch`` repeats one row of ids for B rows (position ids shared by the batch)."""
    starts = document_starts(ids, rule)
    if batch is not None and starts.shape[0] != batch:
        starts = starts.expand(batch, -1)
    # The token index made from starts, not by arange(T): where the graph's fake value of this call is computed
    # (patterns/packed_attention.py inserts it) no fake mode is active, so a factory function would turn a symbolic
    # T into the traced number, a guard that specialises the graph to one length.
    # (int64 cumsum, then int32: Inductor computed an int32 cumsum of ones in int64 and dropped the cast, seen on
    # the CPU with torch 2.13.)
    index = (torch.ones_like(starts, dtype=torch.long).cumsum(1) - 1).to(torch.int32)
    start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    # end[t] = the next start after t: a start at s + 1 ends the document at s + 1; T is the last index plus 1 (as a
    # fill value, a symbolic T would be specialised too).
    next_start = torch.cat([starts[:, 1:], torch.ones_like(starts[:, :1])], dim=1)
    end = torch.where(next_start, index + 1, index[:, -1:] + 1).flip(1).cummin(dim=1).values.flip(1)
    return torch.stack([start, end]).to(torch.int32)
