"""The one-device check of every op: its function and its fake implementation run it.

The fake runs it too because of how torch.library dispatches: a call with any input on the meta device is
served by the op's fake implementation (``register_fake`` is also the op's Meta kernel), so a call with one
input on "meta" and the others on the CPU or a GPU never reaches the op's function and its checks. Unchecked,
the fake returned an uninitialised tensor on the first input's device. The function checks for the other
mixes (CPU and GPU), where a Triton kernel handed a CPU tensor would read a host pointer.
"""
from __future__ import annotations

from typing import Optional

import torch


def check_one_device(op: str, first: tuple[str, torch.Tensor], *others: tuple[str, Optional[torch.Tensor]]) -> None:
    """Raise ValueError, naming ``op`` and the tensor, unless every given tensor is on ``first``'s device."""
    first_name, first_tensor = first
    for name, t in others:
        if t is not None and t.device != first_tensor.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on {first_tensor.device}")
