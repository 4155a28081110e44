"""Attention masks known causal, for the graphs that receive them as inputs.

When a model's graph is split (a graph break, FSDP2's per-module graphs, DDP's bucket splits), transformers'
causal mask is made in one graph and read by SDPA in others, where it is a graph input whose values the graph
does not fix: no proof is possible there. Two ways make such a tensor known causal (or known not):

    proven by the graph that made it   that graph's wrapper marks each output it proved causal at compile time
                                       (patterns/causal_mask.py: a closed computation, the same values every call)
    checked on the device              a graph reading a mask nobody marked compares its values with the causal
                                       mask (``check``: a block of rows at a time, one host sync for the answer)
                                       and records the verdict, causal or not, so each tensor is checked once

A graph reading a mask input runs its ``is_causal`` version only for a tensor whose recorded verdict is causal and
which is unchanged since (its version counter), else its version with the mask as written
(patterns/mask_inputs.py). The check exists for masks no graph can prove: under FSDP2 transformers' mask is
computed from position ids an eager frame made, so every step's mask is a new tensor, checked once (a 2 x 2048 x
2048 bool mask is two small reductions), and read by every layer's graph.

A verdict is held by a weak reference: it goes when the tensor does, and a new tensor never inherits an old one's
(the entry is keyed by the object and compared by identity).
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

# id(tensor) -> (weak reference, the tensor's version when judged, whether it is causal)
_verdicts: dict[int, tuple[weakref.ref, int, bool]] = {}
# Calls of mask-reading graphs, by version run (how often the causal version ran, how often the masked one), and
# how many masks were checked on the device.
calls = {"causal": 0, "masked": 0, "checked": 0}
# Query rows compared at a time: no [L, S] causal reference in memory (at 64k tokens a mask is 4 GiB of bools).
_ROWS_PER_BLOCK = 1024


def mark(tensor: Any, causal: bool = True) -> None:
    """Record ``tensor`` as it is now: causal (a graph output proven causal), or with ``causal=False`` not."""
    if not isinstance(tensor, torch.Tensor):
        return
    key = id(tensor)

    def forget(_ref: weakref.ref, key: int = key) -> None:
        entry = _verdicts.get(key)
        if entry is not None and entry[0]() is None:
            del _verdicts[key]

    _verdicts[key] = (weakref.ref(tensor, forget), tensor._version, causal)


def verdict(tensor: Any) -> Optional[bool]:
    """True / False as recorded for ``tensor`` unchanged since, None when nothing is recorded for it as it is."""
    entry = _verdicts.get(id(tensor))
    if entry is None or entry[0]() is not tensor or tensor._version != entry[1]:
        return None
    return entry[2]


def is_proven(tensor: Any) -> bool:
    """Whether ``tensor`` is recorded causal and not written in place since."""
    return verdict(tensor) is True


def known_causal(tensor: Any, check_values: bool) -> bool:
    """Whether ``tensor`` is known causal: recorded so (``is_proven``), or, with ``check_values`` (the
    ``mask_check`` option), found so by ``check``."""
    return check(tensor) if check_values else is_proven(tensor)


def check(tensor: Any) -> bool:
    """Whether ``tensor`` is causal: its recorded verdict, else its values compared on its device
    (``causal_values``) and the verdict recorded."""
    known = verdict(tensor)
    if known is not None:
        return known
    if not isinstance(tensor, torch.Tensor):
        return False
    calls["checked"] += 1
    causal = causal_values(tensor)
    mark(tensor, causal)
    return causal


def causal_values(mask: torch.Tensor, first_row: int = 0) -> bool:
    """Whether ``mask`` ([..., L, S]: bool with True = attend, or additive float with 0 = attend and -inf or the
    dtype's lowest value = do not), as rows ``first_row ..`` of a mask, allows exactly j <= i in every row i,
    SDPA's ``is_causal``. Computed on the mask's device a block of rows at a time into one flag, read once (the
    only host sync). The compile-time proof (patterns/causal_mask.py) compares its evaluated masks with this too."""
    if mask.dim() < 2 or not (mask.dtype == torch.bool or mask.is_floating_point()):
        return False
    q_len, kv_len = mask.shape[-2], mask.shape[-1]
    keys = torch.arange(kv_len, device=mask.device)
    ok = torch.ones((), dtype=torch.bool, device=mask.device)
    with torch.no_grad():
        for start in range(0, q_len, _ROWS_PER_BLOCK):
            part = mask[..., start:start + _ROWS_PER_BLOCK, :]
            rows = torch.arange(first_row + start, first_row + start + part.shape[-2], device=mask.device)
            if part.dtype == torch.bool:
                allowed = part
            else:
                allowed = part == 0
                blocked = (part == float("-inf")) | (part <= torch.finfo(part.dtype).min)
                ok &= (allowed | blocked).all()
            ok &= (allowed == (keys[None, :] <= rows[:, None])).all()
    return bool(ok)


def count(causal: bool) -> None:
    calls["causal" if causal else "masked"] += 1


def reset() -> None:
    """Forget every verdict and zero the counts (tests)."""
    _verdicts.clear()
    calls.update(causal=0, masked=0, checked=0)
