"""The tolerance rule itself (tests/tolerance.py): it passes eager's own result, fails an all-zero one against a
non-zero reference at every scale (the router gradient at 512 experts has an RMS near 1e-3, below the old fixed
1e-2 of bf16), and fails a result twice as far off as eager's rounding and more; with ``operand_scale`` (a result
that cancels) it passes roundoff of the operands and still fails more than that, and an all-zero result."""
from __future__ import annotations

import pytest
import torch

from tolerance import assert_close, rms, slack

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]


def _reference(scale: float, device: str) -> torch.Tensor:
    return torch.randn(512, 37, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(device) * scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_eager_itself_passes(dtype, scale, device):
    reference = _reference(scale, device)
    eager = reference.to(dtype)
    assert_close("eager", eager, eager, reference)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_all_zero_result_fails(dtype, scale, device):
    reference = _reference(scale, device)
    with pytest.raises(AssertionError, match="zeros: RMS error"):
        assert_close("zeros", torch.zeros_like(reference, dtype=dtype), reference.to(dtype), reference)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_few_units_of_roundoff_more_than_eager_fail(dtype, device):
    # Eager rounds once (RMS error about eps / sqrt(12) of the values); a result off by 4 units everywhere is past
    # 2x that plus the 2-unit slack.
    reference = _reference(1.0, device)
    eager = reference.to(dtype)
    off = (reference * (1 + 4 * torch.finfo(dtype).eps)).to(dtype)
    with pytest.raises(AssertionError, match="off: RMS error"):
        assert_close("off", off, eager, reference)


def test_slack_scales_with_the_reference(device):
    reference = _reference(1.0, device)
    assert slack(torch.bfloat16, reference * 1e-3) == pytest.approx(1e-3 * slack(torch.bfloat16, reference))
    assert slack(torch.bfloat16, reference) == pytest.approx(2 * 2 ** -7 * rms(reference))
    assert slack(torch.float32, torch.zeros(3, device=device)) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_operand_scale_passes_the_operands_roundoff_and_no_more(dtype, device):
    # A result that cancels: exactly 0 (the reference), eager exact too, from operands of RMS 1 (a top-1 router's
    # d logits = w (dw - w dw)). One unit of the operands' roundoff passes with operand_scale and fails without it;
    # four units fail with it.
    operands = _reference(1.0, device)
    reference = torch.zeros_like(operands)
    eager = reference.to(dtype)
    unit = torch.finfo(dtype).eps * operands
    scale = rms(operands)
    assert_close("one unit", unit.to(dtype), eager, reference, operand_scale=scale)
    with pytest.raises(AssertionError, match="one unit: RMS error"):
        assert_close("one unit", unit.to(dtype), eager, reference)
    with pytest.raises(AssertionError, match="four units: RMS error"):
        assert_close("four units", (4 * unit).to(dtype), eager, reference, operand_scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_operand_scale_still_fails_an_all_zero_result(dtype, scale, device):
    # Where the result does not cancel its operands are about its size: the term adds as much as the reference's.
    reference = _reference(scale, device)
    with pytest.raises(AssertionError, match="zeros: RMS error"):
        assert_close("zeros", torch.zeros_like(reference, dtype=dtype), reference.to(dtype), reference,
                     operand_scale=rms(reference))
    assert slack(dtype, reference, rms(reference)) == pytest.approx(2 * slack(dtype, reference))


def test_nan_and_shape_and_dtype_are_named(device):
    reference = _reference(1.0, device)
    eager = reference.float()
    with pytest.raises(AssertionError, match="x: NaN"):
        assert_close("x", torch.full_like(eager, float("nan")), eager, reference)
    with pytest.raises(AssertionError, match="x: shape"):
        assert_close("x", eager[1:], eager, reference)
    with pytest.raises(AssertionError, match="x: dtype"):
        assert_close("x", eager.bfloat16(), eager, reference)
