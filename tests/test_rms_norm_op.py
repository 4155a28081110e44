"""The fused op ``sloth.lowering.rms_norm.rms_norm``: forward, dx and dw against the pattern functions.

Oracle (STYLE.md, habit 5): ``patterns/rms_norm.py``'s functions run eagerly at the tested dtype are
"eager"; the same functions run in float64 end to end are the reference. The patterns upcast with
``.float()`` / ``.to(torch.float32)``, which would silently drop a float64 input back to fp32, so the
reference runs under ``StayFloat64`` (tests/op_checks.py), a TorchFunctionMode that turns exactly those
upcasts into no-ops on float64 tensors (``test_reference_really_is_float64`` checks that it does).

Styles: ``llama`` (offset 0, ``rms_norm_pattern``), ``gemma`` (offset 1, ``gemma_rms_norm_pattern``),
``none`` (no weight, ``weightless_rms_norm_pattern``).
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

import sloth.lowering.rms_norm as lowering
from sloth.lowering.rms_norm import MAX_HIDDEN, register, rms_norm
from sloth.patterns.rms_norm import gemma_rms_norm_pattern, rms_norm_pattern, weightless_rms_norm_pattern
from tolerance import assert_close
from op_checks import force_fallback, RecordOps, StayFloat64

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
OFFSET = {"llama": 0.0, "gemma": 1.0, "none": 0.0}


def pattern(style: str, x: torch.Tensor, w: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    if style == "llama":
        return rms_norm_pattern(x, w, eps)
    if style == "gemma":
        return gemma_rms_norm_pattern(x, w, eps)
    return weightless_rms_norm_pattern(x, eps)


def fused(style: str, x: torch.Tensor, w: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return rms_norm(x, w if style != "none" else None, eps, offset=OFFSET[style])


def make_inputs(shape, style: str, scale: float = 1.0, seed: int = 0, device: str = "cpu"):
    """fp32 masters for x, w and dy, drawn on the CPU (the same values on every device) and moved to ``device``;
    every run rounds them to its own dtype first."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    # Llama weights sit near 1, Gemma's near 0 (it multiplies by 1 + w).
    w = torch.randn(shape[-1], generator=g) * 0.5 + (1.0 if style == "llama" else 0.0)
    dy = torch.randn(shape, generator=g)
    return x.to(device), w.to(device), dy.to(device)


def forward_backward(fn, x, w, dy, weight_grad: bool = True):
    """(y, dx, dw) of ``fn(x, w)`` for cotangent dy; dw is None when w is None or frozen."""
    x = x.detach().requires_grad_(True)  # detach, not clone: clone would make a strided view contiguous
    if w is not None:
        w = w.detach().requires_grad_(weight_grad)
    y = fn(x, w)
    wrt = (x, w) if (w is not None and weight_grad) else (x,)
    grads = torch.autograd.grad(y, wrt, dy.to(y.dtype))
    return y.detach(), grads[0], (grads[1] if len(grads) > 1 else None)


def check_against_pattern(style, x32, w32, dy32, dtype, eps=1e-6, weight_dtype=None, out_dtype=None):
    """Run the fused op, the pattern at ``dtype`` and the pattern in float64; apply the tolerance rule."""
    weight_dtype = weight_dtype or dtype
    x, dy = x32.to(dtype), dy32.to(dtype)
    w = w32.to(weight_dtype) if style != "none" else None

    def ours(x_, w_):
        return rms_norm(x_, w_, eps, offset=OFFSET[style], out_dtype=out_dtype)

    actual = forward_backward(ours, x, w, dy)
    eager = forward_backward(lambda x_, w_: pattern(style, x_, w_, eps), x, w, dy)
    with StayFloat64():
        reference = forward_backward(lambda x_, w_: pattern(style, x_, w_, eps), x.double(),
                                     None if w is None else w.double(), dy.double())
    assert reference[0].dtype == torch.float64
    for name, a, e, r in zip(("y", "dx", "dw"), actual, eager, reference):
        if e is None:
            assert a is None and r is None, f"{name}: computed a gradient the pattern does not have"
            continue
        assert_close(name, a, e, r)
    return actual


# ---------------------------------------------------------------------------------------------------
# The oracle itself
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["llama", "gemma", "none"])
def test_reference_really_is_float64(style, device):
    x, w, _ = make_inputs((4, 64), style, device=device)
    x, w = x.double(), w.double()
    with StayFloat64():
        ref = pattern(style, x, w, 1e-6)
    upcast_to_fp32 = pattern(style, x, w, 1e-6)  # the patterns as written round through fp32
    assert ref.dtype == torch.float64
    assert 0 < (ref - upcast_to_fp32).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------------
# Forward, dx and dw: shapes x dtypes x styles
# ---------------------------------------------------------------------------------------------------

SHAPES = [(1, 64), (3, 64), (127, 64), (1, 100), (3, 100), (127, 100), (300, 100),
          (1, 4096), (3, 4096), (2, 3, 100), (2, 5, 3, 64)]


def shape_id(shape) -> str:
    if len(shape) == 2:
        return f"N{shape[0]}-D{shape[1]}"
    if len(shape) == 3:
        return f"B{shape[0]}-T{shape[1]}-D{shape[2]}"
    return f"B{shape[0]}-T{shape[1]}-H{shape[2]}-D{shape[3]}"


CASES = [pytest.param(shape, dtype, style, id=f"{shape_id(shape)}-{DTYPE_IDS[dtype]}-{style}")
         for shape in SHAPES for dtype in (torch.float32, torch.bfloat16) for style in ("llama", "gemma", "none")]
CASES += [pytest.param((127, 100), torch.float16, style, id=f"N127-D100-fp16-{style}") for style in ("llama", "gemma")]


@pytest.mark.parametrize("shape,dtype,style", CASES)
def test_forward_and_gradients_match_pattern(shape, dtype, style, device):
    x, w, dy = make_inputs(shape, style, device=device)
    y, dx, dw = check_against_pattern(style, x, w, dy, dtype)
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == x.shape
    if style != "none":
        assert dw.dtype == dtype and dw.shape == (shape[-1],)


# ---------------------------------------------------------------------------------------------------
# Frozen weight, layouts, mixed dtypes, eps
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-weight", "trained-weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_frozen_weight_skips_dw(frozen, dtype, device):
    x32, w32, dy32 = make_inputs((127, 100), "llama", device=device)
    x = x32.to(dtype).requires_grad_(True)
    w = w32.to(dtype).requires_grad_(not frozen)
    y = rms_norm(x, w, 1e-6)
    with RecordOps() as rec:
        y.backward(dy32.to(dtype))
    bwd = [(args, out) for func, args, out in rec.calls if func is torch.ops.sloth.rms_norm_backward.default]
    assert len(bwd) == 1, f"expected one sloth backward call, saw {[c[0] for c in rec.calls]}"
    (args, (dx_raw, dw_raw)) = bwd[0]
    assert args[5] is (not frozen), "compute_dw should be requested exactly when the weight needs a gradient"
    assert (dw_raw.numel() == 0) is frozen
    assert (w.grad is None) is frozen

    _, dx_eager, _ = forward_backward(lambda a, b: rms_norm_pattern(a, b, 1e-6), x32.to(dtype), w32.to(dtype),
                                      dy32.to(dtype), weight_grad=False)
    with StayFloat64():
        _, dx_ref, _ = forward_backward(lambda a, b: rms_norm_pattern(a, b, 1e-6), x32.to(dtype).double(),
                                        w32.to(dtype).double(), dy32.to(dtype).double(), weight_grad=False)
    assert_close("dx", x.grad, dx_eager, dx_ref)


LAYOUTS = {
    # (N, D) -> a view with the same values and a different layout
    "transposed": lambda t: t.t().contiguous().t(),
    "row-padded": lambda t: torch.nn.functional.pad(t, (0, 28)).narrow(-1, 0, t.shape[-1]),
    "every-other-row": lambda t: torch.stack([t, torch.zeros_like(t)], 1).reshape(-1, t.shape[-1])[::2],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_non_contiguous_input(layout, dtype, device):
    x32, w32, dy32 = make_inputs((37, 100), "llama", device=device)
    x = LAYOUTS[layout](x32.to(dtype))
    dy = LAYOUTS[layout](dy32.to(dtype))  # a non-contiguous cotangent too
    assert torch.equal(x, x32.to(dtype)) and not x.is_contiguous() and not dy.is_contiguous()
    w = w32.to(dtype)

    y, dx, dw = forward_backward(lambda a, b: rms_norm(a, b, 1e-6), x, w, dy)
    y_e, dx_e, dw_e = forward_backward(lambda a, b: rms_norm_pattern(a, b, 1e-6), x, w, dy)
    with StayFloat64():
        y_r, dx_r, dw_r = forward_backward(lambda a, b: rms_norm_pattern(a, b, 1e-6), x.double(), w.double(),
                                           dy.double())
    assert_close("y", y, y_e, y_r)
    assert_close("dx", dx, dx_e, dx_r)
    assert_close("dw", dw, dw_e, dw_r)


def test_mixed_bf16_input_fp32_weight_fp32_output(device):
    x, w, dy = make_inputs((127, 100), "llama", device=device)
    y, dx, dw = check_against_pattern("llama", x, w, dy, torch.bfloat16, weight_dtype=torch.float32,
                                      out_dtype=torch.float32)
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.float32, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("style", ["llama", "gemma", "none"])
def test_eps_is_a_runtime_argument(style, device):
    # Rows with mean square ~1e-4: eps 1e-6 barely matters, eps 1e-2 dominates the denominator.
    x, w, dy = make_inputs((16, 64), style, scale=1e-2, device=device)
    small = check_against_pattern(style, x, w, dy, torch.float32, eps=1e-6)
    large = check_against_pattern(style, x, w, dy, torch.float32, eps=1e-2)
    assert (small[0] - large[0]).abs().max().item() > 0.5  # would be 0 if eps were ignored or cached
    assert (small[1] - large[1]).abs().max().item() > 0.5
    again = rms_norm(x, w if style != "none" else None, 1e-6, offset=OFFSET[style])
    assert torch.equal(again, small[0]), "a second call with the first eps must give the first result"


def test_gemma_offset_is_applied(device):
    x, w, _ = make_inputs((3, 64), "gemma", device=device)
    plain = rms_norm(x, w, 1e-6, offset=0.0)
    gemma = rms_norm(x, w, 1e-6, offset=1.0)
    weightless = rms_norm(x, None, 1e-6)
    torch.testing.assert_close(gemma - plain, weightless)


# ---------------------------------------------------------------------------------------------------
# Input errors
# ---------------------------------------------------------------------------------------------------

BAD_INPUTS = [
    pytest.param(lambda d: (torch.randn(3, 64, device=d), torch.randn(65, device=d)), ValueError,
                 r"weight must have shape \(64,\).*got \(65,\)", id="weight-too-long"),
    pytest.param(lambda d: (torch.randn(3, 64, device=d), torch.randn(1, 64, device=d)), ValueError,
                 r"weight must have shape \(64,\).*\(1, 64\)", id="weight-2d"),
    pytest.param(lambda d: (torch.randint(0, 3, (3, 64), device=d), torch.randn(64, device=d)), TypeError,
                 r"x must be .*int64", id="x-int64"),
    pytest.param(lambda d: (torch.randn(3, 64, dtype=torch.float64, device=d), None), TypeError,
                 r"x must be .*float64", id="x-float64"),
    pytest.param(lambda d: (torch.randn(3, 64, device=d), torch.ones(64, dtype=torch.int32, device=d)), TypeError,
                 r"weight must be .*int32", id="weight-int32"),
    pytest.param(lambda d: (torch.zeros(2, MAX_HIDDEN + 1, dtype=torch.bfloat16, device=d), None), ValueError,
                 rf"last dimension {MAX_HIDDEN + 1} exceeds .*{MAX_HIDDEN}", id="hidden-over-max"),
    pytest.param(lambda d: (torch.tensor(1.0, device=d), None), ValueError, r"at least one dimension", id="x-0d"),
]


@pytest.mark.parametrize("via", ["function", "torch.ops"])
@pytest.mark.parametrize("make,error,message", BAD_INPUTS)
def test_input_errors_name_the_problem(make, error, message, via, device):
    x, w = make(device)
    if via == "function":
        call = lambda: rms_norm(x, w, 1e-6)  # noqa: E731
    else:
        register()
        call = lambda: torch.ops.sloth.rms_norm(x, w, 1e-6, 0.0, torch.float32)  # noqa: E731
    with pytest.raises(error, match=message):
        call()


def test_hidden_at_max_is_accepted(device):
    x = torch.randn(1, MAX_HIDDEN, dtype=torch.bfloat16, device=device)
    y = rms_norm(x, None, 1e-6)
    assert_close("y", y, weightless_rms_norm_pattern(x, 1e-6),
                 (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)))


# ---------------------------------------------------------------------------------------------------
# Empty input
# ---------------------------------------------------------------------------------------------------

def test_zero_rows_forward(device):
    x = torch.randn(0, 64, device=device)
    y = rms_norm(x, torch.randn(64, device=device), 1e-6)
    assert y.shape == (0, 64)


def test_zero_rows_backward(device):
    x = torch.randn(0, 64, device=device, requires_grad=True)
    w = torch.randn(64, device=device, requires_grad=True)
    rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad.shape == (0, 64)
    assert torch.equal(w.grad, torch.zeros(64, device=device))


# ---------------------------------------------------------------------------------------------------
# torch.library registration
# ---------------------------------------------------------------------------------------------------

OPCHECK_CASES = [
    pytest.param(lambda d: torch.randn(3, 100, device=d), lambda d: torch.randn(100, device=d),
                 id="N3-D100-fp32-weight"),
    pytest.param(lambda d: torch.randn(2, 5, 64, dtype=torch.bfloat16, device=d), lambda d: None,
                 id="B2-T5-D64-bf16-noweight"),
    pytest.param(lambda d: torch.randn(64, 8, device=d).t(), lambda d: torch.randn(64, device=d),
                 id="N8-D64-transposed-weight"),
    pytest.param(lambda d: torch.randn(4, 64, dtype=torch.bfloat16, device=d), lambda d: torch.randn(64, device=d),
                 id="N4-D64-bf16-fp32weight"),
]


@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["out-like-x", "out-fp32"])
@pytest.mark.parametrize("make_x,make_w", OPCHECK_CASES)
def test_opcheck_forward(make_x, make_w, out_dtype, device):
    register()
    x, w = make_x(device).requires_grad_(True), make_w(device)
    if w is not None:
        w.requires_grad_(True)
    torch.library.opcheck(torch.ops.sloth.rms_norm.default, (x, w, 1e-6, 1.0, out_dtype or x.dtype))


@pytest.mark.parametrize("compute_dw", [True, False], ids=["dw", "no-dw"])
@pytest.mark.parametrize("make_x,make_w", OPCHECK_CASES)
def test_opcheck_backward(make_x, make_w, compute_dw, device):
    # The backward op has no autograd of its own (no double backward), so its inputs need no grad.
    register()
    x, w = make_x(device), make_w(device)
    dy = torch.randn(x.shape, dtype=x.dtype, device=device)
    torch.library.opcheck(torch.ops.sloth.rms_norm_backward.default, (dy, x, w, 1e-6, 0.0, compute_dw))


def test_register_is_idempotent():
    register()
    register()
    assert hasattr(torch.ops.sloth, "rms_norm") and hasattr(torch.ops.sloth, "rms_norm_backward")


# ---------------------------------------------------------------------------------------------------
# The PyTorch fallback (CPU without the interpreter, other devices)
# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def no_triton(monkeypatch):
    force_fallback(monkeypatch, lowering, "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel")


FALLBACK_CASES = [pytest.param(shape, dtype, style, id=f"{shape_id(shape)}-{DTYPE_IDS[dtype]}-{style}")
                  for shape in [(3, 100), (2, 5, 3, 64)] for dtype in (torch.float32, torch.bfloat16)
                  for style in ("llama", "gemma", "none")]


@pytest.mark.parametrize("shape,dtype,style", FALLBACK_CASES)
def test_fallback_matches_triton(shape, dtype, style, device):
    x32, w32, dy32 = make_inputs(shape, style, device=device)
    x, w, dy = x32.to(dtype), (w32.to(dtype) if style != "none" else None), dy32.to(dtype)
    triton_out = forward_backward(lambda a, b: fused(style, a, b, 1e-6), x, w, dy)
    with pytest.MonkeyPatch.context() as mp:
        force_fallback(mp, lowering, "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel")
        fallback_out = forward_backward(lambda a, b: fused(style, a, b, 1e-6), x, w, dy)
    for name, a, b in zip(("y", "dx", "dw"), fallback_out, triton_out):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


def test_fallback_is_used_when_triton_cannot_run(no_triton, device):
    x, w, dy = make_inputs((3, 100), "llama", device=device)
    check_against_pattern("llama", x, w, dy, torch.bfloat16)


def test_fallback_output_layout_matches_fake(no_triton, device):
    register()
    x = torch.randn(64, 8, device=device).t()
    w = torch.randn(64, device=device)
    torch.library.opcheck(torch.ops.sloth.rms_norm.default, (x, w, 1e-6, 0.0, torch.float32),
                          test_utils=("test_faketensor",))
    dx, _ = torch.ops.sloth.rms_norm_backward(torch.randn(8, 64, device=device), x, w, 1e-6, 0.0, True)
    assert dx.is_contiguous()
