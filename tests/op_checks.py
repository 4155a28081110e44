"""Helpers shared by the op test files (tests/test_*_op.py)."""
from __future__ import annotations

from types import ModuleType

import pytest


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("a Triton kernel was launched on the fallback path")


def force_fallback(mp: pytest.MonkeyPatch, lowering: ModuleType, *kernels: str) -> None:
    """Take ``lowering``'s PyTorch reference path, as on a CPU without the interpreter; launching any of
    ``kernels`` (names of its Triton kernels) now fails the test."""
    mp.setattr(lowering, "use_triton", lambda t: False)
    for name in kernels:
        mp.setattr(lowering, name, _NoLaunch())
