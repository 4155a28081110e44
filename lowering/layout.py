"""Host-side layout helpers shared by the launchers of row-wise kernels."""
from __future__ import annotations

from typing import Sequence

import torch


def rows_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, last dim] with a unit last stride, a view where the layout allows (a single column
    needs no unit stride: the kernels step over rows only)."""
    t_2d = t.reshape(-1, t.shape[-1])
    return t_2d if t_2d.stride(-1) == 1 or t_2d.shape[-1] == 1 else t_2d.contiguous()


def is_bshd(t: torch.Tensor) -> bool:
    """Whether ``t``, of shape [b, h, s, d], has the memory of [b, s, h, d]: a projection's output viewed as
    heads and transposed (``linear(x).view(b, s, h, d).transpose(1, 2)``)."""
    return t.dim() == 4 and t.transpose(1, 2).is_contiguous()


def empty_heads(like: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, bshd: bool) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` on ``like``'s device: contiguous, or with ``bshd`` (and 4 dims
    [b, h, s, d]) laid out as [b, s, h, d] in memory, so that the attention reading it (cuDNN's lays its output out
    like its query) returns [b, s, h * d] rows the o projection reads with no copy. Works on fakes too."""
    if bshd and len(shape) == 4:
        b, h, s, d = shape
        return like.new_empty((b, s, h, d), dtype=dtype).transpose(1, 2)
    return like.new_empty(tuple(shape), dtype=dtype)


def in_heads_layout(t: torch.Tensor, bshd: bool) -> torch.Tensor:
    """``t`` (contiguous) copied into ``empty_heads``' layout where that differs."""
    if not bshd or t.dim() != 4 or is_bshd(t):
        return t
    return empty_heads(t, t.shape, t.dtype, True).copy_(t)
