"""Attention masks proven causal by one compiled graph, for the graphs that receive them as inputs.

When a model's graph is split (a graph break, FSDP2's per-module graphs, DDP's bucket splits), transformers'
causal mask is made in one graph and read by SDPA in others, where it is a graph input whose values the graph
does not fix: no proof is possible there. The graph that makes it can prove it (patterns/causal_mask.py), so
sloth's wrapper of that graph marks each such output tensor here when it returns it, and a graph reading a mask
input runs its ``is_causal`` version only when that input is a marked tensor, unchanged since (its version
counter), else its version with the mask as written (compiler/backend.py). The check is on the host, per call:
no device work and no sync.

A mark is held by a weak reference: it goes when the tensor does, and a new tensor never inherits an old one's
mark (the entry is keyed by the object and compared by identity).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

_marked: dict[int, tuple[weakref.ref, int]] = {}
# Calls of mask-reading graphs, by version run: how often the causal version ran, and how often the masked one.
calls = {"causal": 0, "masked": 0}


def mark(tensor: Any) -> None:
    """Record ``tensor`` (a graph output proven causal) as it is now."""
    if not isinstance(tensor, torch.Tensor):
        return
    key = id(tensor)

    def forget(_ref: weakref.ref, key: int = key) -> None:
        entry = _marked.get(key)
        if entry is not None and entry[0]() is None:
            del _marked[key]

    _marked[key] = (weakref.ref(tensor, forget), tensor._version)


def is_proven(tensor: Any) -> bool:
    """Whether ``tensor`` is a tensor ``mark`` recorded, not written in place since."""
    entry = _marked.get(id(tensor))
    return entry is not None and entry[0]() is tensor and tensor._version == entry[1]


def count(causal: bool) -> None:
    calls["causal" if causal else "masked"] += 1


def reset() -> None:
    """Forget every mark and zero the counts (tests)."""
    _marked.clear()
    calls.update(causal=0, masked=0)
