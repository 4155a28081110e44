"""Helpers shared by the pattern test files (tests/test_*_pattern.py)."""
from __future__ import annotations

import inspect
from typing import Callable, Optional

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


def graph_of(fn: Callable, *args: torch.Tensor) -> torch.fx.GraphModule:
    """The graph sloth rewrote (passes run in place) when compiling ``fn(*args)`` whole."""
    graphs: list = []
    torch.compile(fn, backend=counting_backend(graphs, "eager"), fullgraph=True)(*args)
    return graphs[0]


def line_of(fn: Callable, needle: str) -> tuple[int, str]:
    """(line number, stripped text) of the first line of ``fn``'s source containing ``needle``."""
    lines, start = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if needle in line:
            return start + i, line.strip()
    raise AssertionError(f"{needle!r} not in {fn.__name__}")


def forward_backward(fn: Callable, args: list[torch.Tensor], params: list[torch.Tensor],
                     dy_dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """[out, d(arg) for each float arg, d(param) for each param] for a seeded cotangent."""
    args = [a.detach().requires_grad_(True) if a.is_floating_point() else a for a in args]
    y = fn(*args)
    dy = torch.randn(y.shape, generator=seeded(3)).to(dy_dtype or y.dtype).to(y.device, y.dtype)
    leaves = [a for a in args if a.requires_grad] + params
    return [y.detach(), *torch.autograd.grad(y, leaves, dy)]
