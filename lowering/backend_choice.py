"""Which implementation a sloth op runs on a given tensor: the Triton kernel or the PyTorch reference.

Triton kernels run on CUDA tensors, and on CPU tensors when the Triton interpreter is on
(``TRITON_INTERPRET=1``, set before triton is imported; the tests and the CPU demo do this). Anywhere
else (CPU without the interpreter, other devices) every op falls back to its PyTorch reference, so
results stay correct everywhere and only the speed changes.
"""
from __future__ import annotations

import os
from typing import Iterable

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


def execution_path(devices: Iterable[torch.device]) -> str:
    """What runs sloth's ops in a graph whose inputs are on ``devices`` (a GPU if any input is on one), in the
    words of the report's first line."""
    kinds = {device.type for device in devices}
    if "cuda" in kinds:
        return "Triton kernels on the GPU"
    if "cpu" in kinds and triton_interpreter_on():
        return "Triton's CPU interpreter"
    return "PyTorch references"
