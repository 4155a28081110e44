"""Helpers shared by the op test files (tests/test_*_op.py)."""
from __future__ import annotations

from types import ModuleType

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class RecordOps(TorchDispatchMode):
    """Records (op, args, output) of every op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, out))
        return out


class StayFloat64(TorchFunctionMode):
    """Make a pattern's fp32 upcasts (``.float()``, ``.to(torch.float32)``, a softmax's ``dtype=torch.float32``)
    no-ops on float64 tensors, so that the pattern run on float64 inputs stays float64 end to end: the reference
    of the tolerance rule."""

    _SOFTMAX = (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._SOFTMAX and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64 \
                and kwargs.get("dtype") is torch.float32:
            kwargs = {**kwargs, "dtype": torch.float64}
        if func in (torch.Tensor.float, torch.Tensor.to) and isinstance(args[0], torch.Tensor) \
                and args[0].dtype == torch.float64:
            if func is torch.Tensor.float:
                return args[0]
            target = kwargs.get("dtype", args[1] if len(args) > 1 else None)
            if target is torch.float32 and len(args) <= 2 and set(kwargs) <= {"dtype"}:
                return args[0]
        return func(*args, **kwargs)


class NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("a Triton kernel was launched on the fallback path")


def force_fallback(mp: pytest.MonkeyPatch, lowering: ModuleType, *kernels: str) -> None:
    """Take ``lowering``'s PyTorch reference path, as on a CPU without the interpreter; launching any of
    ``kernels`` (names of its Triton kernels) now fails the test."""
    mp.setattr(lowering, "use_triton", lambda t: False)
    for name in kernels:
        mp.setattr(lowering, name, NoLaunch())


def record_launches(mp: pytest.MonkeyPatch, lowering: ModuleType, *kernels: str) -> list[tuple[str, tuple, dict]]:
    """Wrap ``lowering``'s Triton kernels named ``kernels`` so that each launch still runs and is appended, as
    (kernel name, grid, launch keywords), to the returned list."""
    launches: list[tuple[str, tuple, dict]] = []

    class _Record:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.name, grid, kwargs))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in kernels:
        mp.setattr(lowering, name, _Record(name, getattr(lowering, name)))
    return launches
