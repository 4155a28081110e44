"""Which implementation a sloth op runs on a given tensor: the Triton kernel or the PyTorch reference.

Triton kernels run on CUDA tensors, and on CPU tensors when the Triton interpreter is on
(``TRITON_INTERPRET=1``, set before triton is imported; the tests and the CPU demo do this). Anywhere
else (CPU without the interpreter, other devices) every op falls back to its PyTorch reference, so
results stay correct everywhere and only the speed changes.
"""
from __future__ import annotations

import os

import torch


# Triton decides when a kernel is defined (at import of its lowering module) whether it runs through
# the interpreter; read the variable once, at the same moment, so the two can never disagree.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_interpreter_on() -> bool:
    """True when sloth's kernels were defined for Triton's CPU interpreter."""
    return _INTERPRETED


def use_triton(t: torch.Tensor) -> bool:
    """True when sloth's Triton kernels should handle tensor ``t``."""
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and triton_interpreter_on()
