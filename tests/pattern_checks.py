"""Helpers shared by the pattern test files (tests/test_*_pattern.py)."""
from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn

from sloth import sloth_backend


def seeded(seed: int) -> torch.Generator:
    """A CPU generator with a fixed seed: every test draws the same inputs on every run."""
    return torch.Generator().manual_seed(seed)


def params_of(fn: Callable) -> list[torch.Tensor]:
    """The parameters of ``fn`` when it is a module (their gradients are compared too), else none."""
    return list(fn.parameters()) if isinstance(fn, nn.Module) else []


def counting_backend(calls: list, inner: str) -> Callable:
    """The sloth backend with ``inner``, appending each graph it compiles to ``calls``."""
    def backend(gm, example_inputs):
        calls.append(gm)
        return sloth_backend(gm, example_inputs, options={"inner": inner})
    return backend


def line_of(fn: Callable, needle: str) -> tuple[int, str]:
    """(line number, stripped text) of the first line of ``fn``'s source containing ``needle``."""
    lines, start = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if needle in line:
            return start + i, line.strip()
    raise AssertionError(f"{needle!r} not in {fn.__name__}")
