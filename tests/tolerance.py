"""The tolerance rule: error vs an fp64 reference at most 2x eager PyTorch's own error, plus a small term that
scales with the values.

``assert_close(name, actual, eager, reference)``: ``reference`` is the same computation in float64,
``eager`` is plain PyTorch at the tested dtype. The message names the tensor and the ratio.

The error of a tensor is the root-mean-square of its difference from the reference (METHOD.md's
||out - ref|| up to a constant). The maximum is too noisy to compare two low-precision results: one
element rounding the other way downstream of a more accurate op can double it (seen with bf16
gradients of whole models), while the RMS error still separates a right kernel from a wrong one by
orders of magnitude.

The small term is ``SLACK_ULPS`` units of the dtype's roundoff (``finfo.eps``) times the reference's RMS: it lets a
result whose eager error happens to be exactly 0 (tiny fp32 cases) differ in the last bits, and it shrinks with the
values. A fixed absolute term does not: 1e-2 in bf16 let an all-zero router gradient through, whose reference
(softmax over 512 experts) has an RMS of about 1e-3.

A result that cancels is the exception: its exact value is far below the terms it is computed from, so any rounding
of those terms, in whatever order, is an error at their size, not at the result's. A top-1 renormalised router's
d logits is exactly 0 (w = 1, dl = w (dw - w dw)); the reference's RMS is 1e-17, and a kernel whose w is one unit off
1 (an approximate division on the GPU) is off by 5e-9, 2.8x eager's 1.7e-9. ``operand_scale``, the RMS of the terms
the result cancels from, adds ``SLACK_ULPS`` units of roundoff at that size; it is the caller's to say which terms.
Where the result does not cancel, those terms are about the result's size and the term changes little: an all-zero
result still fails (tests/test_tolerance.py).
"""
from __future__ import annotations

import torch

# Units of roundoff of the reference's size added to the 2x-eager bound. Two: the rounding of the output itself
# (at most half a unit) and of its inputs, with room for a different summation order. An all-zero result is off by
# the reference's whole RMS, 1 / (2 * eps) = 64 (bf16) or 4e6 (fp32) times this term (tests/test_tolerance.py).
SLACK_ULPS = 2.0

# The fixed absolute terms of the rule before SLACK_ULPS; tests/test_bad_input.py still adds them to its scalars'.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float64: 1e-10}


def rms(t: torch.Tensor) -> float:
    """Root-mean-square of ``t`` in float64 (0 for an empty tensor)."""
    if not t.numel():
        return 0.0
    return t.detach().double().pow(2).mean().sqrt().item()


def rms_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    if not a.numel():
        return 0.0
    return rms(a.detach().double() - ref.detach().double().to(a.device))


def slack(dtype: torch.dtype, reference: torch.Tensor, operand_scale: float = 0.0) -> float:
    """The small term of the rule: ``SLACK_ULPS`` units of ``dtype``'s roundoff at the reference's RMS, and as many
    at ``operand_scale`` (the RMS of the terms a cancelling result is formed from; 0: none)."""
    return SLACK_ULPS * torch.finfo(dtype).eps * (rms(reference) + operand_scale)


def assert_close(name: str, actual: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor,
                 atol: float | None = None, factor: float = 2.0, operand_scale: float = 0.0) -> None:
    """``actual``'s RMS error vs ``reference`` is at most ``factor`` times ``eager``'s plus ``atol`` (by default
    ``slack(eager.dtype, reference, operand_scale)``)."""
    assert actual.shape == reference.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    assert actual.dtype == eager.dtype, f"{name}: dtype {actual.dtype} != eager's {eager.dtype}"
    assert not torch.isnan(actual).any(), f"{name}: NaN"
    atol = slack(eager.dtype, reference, operand_scale) if atol is None else atol
    ours, theirs = rms_err(actual, reference), rms_err(eager, reference)
    ratio = ours / theirs if theirs else float("inf") if ours else 0.0
    assert ours <= factor * theirs + atol, (
        f"{name}: RMS error vs fp64 {ours:.3e} is {ratio:.2f}x eager's {theirs:.3e} (allowed {factor:g}x + {atol:.3g})")
