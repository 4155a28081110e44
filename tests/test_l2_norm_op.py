"""The fused op ``sloth.lowering.l2_norm.l2_norm``: forward and dx against the pattern functions, both eps modes.

Oracle: ``patterns/l2_norm.py``'s ``normalize_pattern`` (``clamp=True``: x / max(||x||, eps)) and
``l2_norm_pattern`` (``clamp=False``: x * rsqrt(sum(x^2) + eps)) run eagerly at the tested dtype ("eager") and in
float64 under ``StayFloat64`` (the reference).
"""
from __future__ import annotations

import pytest
import torch

import sloth.lowering.l2_norm as lowering
from sloth.lowering.l2_norm import MAX_HIDDEN, l2_norm, register
from sloth.patterns.l2_norm import l2_norm_pattern, normalize_pattern
from tolerance import assert_close
from op_checks import force_fallback, StayFloat64

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
MODES = {"clamp": (True, normalize_pattern), "add": (False, l2_norm_pattern)}


def make_inputs(shape, scale: float = 1.0, seed: int = 0, device: str = "cpu"):
    """x and dy in fp32, drawn on the CPU (the same values on every device) and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device), torch.randn(shape, generator=g).to(device)


def run(fn, x, dy):
    x = x.detach().requires_grad_(True)
    y = fn(x)
    (dx,) = torch.autograd.grad(y, x, dy.to(y.dtype))
    return y.detach(), dx


def check(mode, x32, dy32, dtype, eps):
    clamp, pattern = MODES[mode]
    x, dy = x32.to(dtype), dy32.to(dtype)
    actual = run(lambda a: l2_norm(a, eps, clamp), x, dy)
    eager = run(lambda a: pattern(a, eps), x, dy)
    with StayFloat64():
        reference = run(lambda a: pattern(a, eps), x.double(), dy.double())
    assert reference[0].dtype == torch.float64
    for name, a, e, r in zip(("y", "dx"), actual, eager, reference):
        assert_close(name, a, e, r)
    return actual


SHAPES = [(7, 33), (13, 100), (2, 3, 64)]
CASES = [pytest.param(shape, dtype, mode, id=f"{'-'.join(map(str, shape))}-{DTYPE_IDS[dtype]}-{mode}")
         for shape in SHAPES for dtype in (torch.float32, torch.bfloat16) for mode in MODES]
CASES += [pytest.param((13, 100), torch.float16, mode, id=f"13-100-fp16-{mode}") for mode in MODES]


@pytest.mark.parametrize("shape,dtype,mode", CASES)
def test_forward_and_gradient_match_pattern(shape, dtype, mode, device):
    x, dy = make_inputs(shape, device=device)
    y, dx = check(mode, x, dy, dtype, eps=1e-6)
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_below_eps(dtype, device):
    # Half the rows have ||x|| ~ 1e-3 < eps = 1e-2: F.normalize divides them by eps (a constant, dx = dy / eps),
    # the additive form by sqrt(sum + eps); the two modes must differ there and each equal its pattern.
    x, dy = make_inputs((8, 40), device=device)
    x[::2] *= 2e-4
    clamped = check("clamp", x, dy, dtype, eps=1e-2)
    added = check("add", x, dy, dtype, eps=1e-2)
    # Below eps: x / eps against about x / sqrt(eps), a factor sqrt(1/eps) = 10; above it both are about x / ||x||.
    ratio = clamped[0].float().abs().sum(-1) / added[0].float().abs().sum(-1)
    assert (ratio[::2] > 9).all() and (ratio[1::2] - 1).abs().max() < 0.02, ratio


@pytest.mark.parametrize("passes", [True, False], ids=["torch<=2.13", "torch>=2.14"])
def test_norm_at_eps_follows_the_clamp_convention(monkeypatch, passes, device):
    # A row whose norm is exactly eps: F.normalize's clamp_min(eps) passes the gradient to the norm up to torch 2.13
    # and not from 2.14 (lowering/torch_conventions.py). The kernel and the reference follow CLAMP_PASSES_AT_BOUND,
    # both ways here (the launcher passes it as a constexpr argument: one compiled kernel each): with it
    # dx = (dy - y <dy, y>) / eps, without it dx = dy / eps.
    monkeypatch.setattr(lowering, "CLAMP_PASSES_AT_BOUND", passes)
    x = torch.tensor([[0.5, 0.0, 0.0, 0.0]], device=device)  # ||x|| = 0.5, exact
    dy = torch.tensor([[1.0, 1.0, 0.0, 0.0]], device=device)
    through_norm = torch.tensor([[0.0, 2.0, 0.0, 0.0]], device=device)  # (dy - y <dy, y>) / eps with y = [1, 0, 0, 0]
    for backward in (lowering._l2_norm_bwd, lowering.l2_norm_backward_reference):
        dx = backward(dy, x, 0.5, True)
        torch.testing.assert_close(dx, through_norm if passes else dy / 0.5, msg=backward.__name__)


def test_eps_is_a_runtime_argument(device):
    x, dy = make_inputs((6, 64), scale=1e-2, device=device)
    small, large = check("add", x, dy, torch.float32, eps=1e-6), check("add", x, dy, torch.float32, eps=1.0)
    assert (small[0] - large[0]).abs().max() > 0.1  # rows of norm ~0.08: eps 1 shrinks them 12-fold
    assert torch.equal(l2_norm(x, 1e-6, False), small[0])


BAD_INPUTS = [
    pytest.param(lambda d: torch.randn(3, 64, dtype=torch.float64, device=d), TypeError, r"x must be .*float64",
                 id="x-float64"),
    pytest.param(lambda d: torch.zeros(1, MAX_HIDDEN + 1, device=d), ValueError, rf"exceeds .*{MAX_HIDDEN}",
                 id="hidden-over-max"),
    pytest.param(lambda d: torch.tensor(1.0, device=d), ValueError, r"at least one dimension", id="x-0d"),
]


@pytest.mark.parametrize("make,error,message", BAD_INPUTS)
def test_input_errors_name_the_problem(make, error, message, device):
    with pytest.raises(error, match="sloth.l2_norm: .*" + message):
        l2_norm(make(device), 1e-6, True)


@pytest.mark.parametrize("clamp", [True, False], ids=["clamp", "add"])
@pytest.mark.parametrize("make_x", [lambda d: torch.randn(3, 33, device=d),
                                    lambda d: torch.randn(64, 8, dtype=torch.bfloat16, device=d).t()],
                         ids=["N3-D33-fp32", "N8-D64-bf16-transposed"])
def test_opcheck(make_x, clamp, device):
    register()
    x = make_x(device).requires_grad_(True)
    torch.library.opcheck(torch.ops.sloth.l2_norm.default, (x, 1e-6, clamp, torch.float32))
    torch.library.opcheck(torch.ops.sloth.l2_norm_backward.default,
                          (torch.randn(x.shape, dtype=x.dtype, device=device), x.detach(), 1e-6, clamp))


@pytest.mark.parametrize("mode", list(MODES))
def test_fallback_matches_triton(mode, device):
    clamp, _ = MODES[mode]
    x, dy = make_inputs((2, 5, 33), device=device)
    x[0] *= 1e-4
    fused = lambda a: l2_norm(a, 1e-3, clamp)  # noqa: E731
    triton_out = run(fused, x, dy)
    with pytest.MonkeyPatch.context() as mp:
        force_fallback(mp, lowering, "_l2_norm_fwd_kernel", "_l2_norm_bwd_kernel")
        fallback_out = run(fused, x, dy)
    for name, a, t in zip(("y", "dx"), fallback_out, triton_out):
        torch.testing.assert_close(a, t, msg=lambda m: f"{name}: {m}")
