"""Host-side layout helper shared by the launchers of row-wise kernels."""
from __future__ import annotations

import torch


def rows_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, last dim] with a unit last stride, a view where the layout allows (a single column
    needs no unit stride: the kernels step over rows only)."""
    t_2d = t.reshape(-1, t.shape[-1])
    return t_2d if t_2d.stride(-1) == 1 or t_2d.shape[-1] == 1 else t_2d.contiguous()
