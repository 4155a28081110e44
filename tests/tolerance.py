"""The tolerance rule: error vs an fp64 reference at most 2x eager PyTorch's own error, plus a small atol.

``assert_close(name, actual, eager, reference)``: ``reference`` is the same computation in float64,
``eager`` is plain PyTorch at the tested dtype. The message names the tensor and the ratio.

The error of a tensor is the root-mean-square of its difference from the reference (METHOD.md's
||out - ref|| up to a constant). The maximum is too noisy to compare two low-precision results: one
element rounding the other way downstream of a more accurate op can double it (seen with bf16
gradients of whole models), while the RMS error still separates a right kernel from a wrong one by
orders of magnitude.
"""
from __future__ import annotations

import torch

# Small absolute slack so that exact-zero eager errors (tiny fp32 cases) do not demand bit equality.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float64: 1e-10}


def rms_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    if not a.numel():
        return 0.0
    return (a.detach().double() - ref.detach().double()).pow(2).mean().sqrt().item()


def assert_close(name: str, actual: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor,
                 atol: float | None = None, factor: float = 2.0) -> None:
    assert actual.shape == reference.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    assert actual.dtype == eager.dtype, f"{name}: dtype {actual.dtype} != eager's {eager.dtype}"
    assert not torch.isnan(actual).any(), f"{name}: NaN"
    atol = ATOL[eager.dtype] if atol is None else atol
    ours, theirs = rms_err(actual, reference), rms_err(eager, reference)
    ratio = ours / theirs if theirs else float("inf") if ours else 0.0
    assert ours <= factor * theirs + atol, (
        f"{name}: RMS error vs fp64 {ours:.3e} is {ratio:.2f}x eager's {theirs:.3e} (allowed {factor:g}x + {atol:g})")
