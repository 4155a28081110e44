"""The fused op ``sloth.lowering.layer_norm.layer_norm``: forward, dx, dw and db against the pattern functions.

Oracle (STYLE.md, habit 5): ``patterns/layer_norm.py``'s functions run eagerly at the tested dtype are "eager";
the same functions in float64 end to end (``StayFloat64`` turns their fp32 upcasts into no-ops) are the
reference. Affine styles: ``wb`` (weight and bias, nn.LayerNorm), ``w`` (weight only, ``bias=False``), ``b``
(bias only), ``none`` (``elementwise_affine=False``).
"""
from __future__ import annotations

import pytest
import torch

import sloth.lowering.layer_norm as lowering
from sloth.lowering.layer_norm import MAX_HIDDEN, layer_norm, register
from sloth.patterns.layer_norm import layer_norm_pattern, upcast_layer_norm_pattern
from tolerance import assert_close
from op_checks import force_fallback, RecordOps, StayFloat64

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
PATTERNS = {"F.layer_norm": layer_norm_pattern, "upcast": upcast_layer_norm_pattern}
KERNELS = ("_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel")


def make_inputs(shape, scale: float = 1.0, shift: float = 0.0, seed: int = 0, device: str = "cpu"):
    """fp32 masters for x, w, b and dy (x off-centre by ``shift``: a kernel that skipped the mean would show), drawn
    on the CPU (the same values on every device) and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale + shift
    w = torch.randn(shape[-1], generator=g) * 0.5 + 1.0
    b = torch.randn(shape[-1], generator=g) * 0.5
    dy = torch.randn(shape, generator=g)
    return x.to(device), w.to(device), b.to(device), dy.to(device)


def run(fn, x, w, b, dy, frozen=()):
    """[y, dx, dw, db] of ``fn(x, w, b)`` for cotangent dy; None for a missing or frozen parameter."""
    x = x.detach().requires_grad_(True)
    params = {"w": w, "b": b}
    for name, p in params.items():
        if p is not None:
            params[name] = p.detach().requires_grad_(name not in frozen)
    y = fn(x, params["w"], params["b"])
    wrt = [x] + [p for p in params.values() if p is not None and p.requires_grad]
    grads = iter(torch.autograd.grad(y, wrt, dy.to(y.dtype)))
    out = [y.detach(), next(grads)]
    for p in params.values():
        out.append(next(grads) if p is not None and p.requires_grad else None)
    return out


def check(style, x32, w32, b32, dy32, dtype, eps=1e-5, pattern="F.layer_norm", frozen=()):
    """The fused op, the pattern at ``dtype`` and the pattern in float64 under the tolerance rule."""
    x, dy = x32.to(dtype), dy32.to(dtype)
    w = w32.to(dtype) if "w" in style else None
    b = b32.to(dtype) if "b" in style else None
    fn = PATTERNS[pattern]
    actual = run(lambda x_, w_, b_: layer_norm(x_, w_, b_, eps), x, w, b, dy, frozen)
    eager = run(lambda x_, w_, b_: fn(x_, w_, b_, eps), x, w, b, dy, frozen)
    with StayFloat64():
        reference = run(lambda x_, w_, b_: fn(x_, w_, b_, eps), x.double(), None if w is None else w.double(),
                        None if b is None else b.double(), dy.double(), frozen)
    assert reference[0].dtype == torch.float64
    for name, a, e, r in zip(("y", "dx", "dw", "db"), actual, eager, reference):
        if e is None:
            assert a is None and r is None, f"{name}: computed a gradient the pattern does not have"
            continue
        assert_close(name, a, e, r)
    return actual


def test_reference_really_is_float64(device):
    x, w, b, _ = make_inputs((4, 64), device=device)
    x, w, b = x.double(), w.double(), b.double()
    with StayFloat64():
        ref = upcast_layer_norm_pattern(x, w, b, 1e-5)
    assert ref.dtype == torch.float64
    assert 0 < (ref - upcast_layer_norm_pattern(x, w, b, 1e-5)).abs().max().item() < 1e-5


SHAPES = [(7, 33), (13, 100), (2, 3, 64), (1, 4096)]


def shape_id(shape) -> str:
    return {2: "N{}-D{}", 3: "B{}-T{}-D{}"}[len(shape)].format(*shape)


CASES = [pytest.param(shape, dtype, style, id=f"{shape_id(shape)}-{DTYPE_IDS[dtype]}-{style}")
         for shape in SHAPES for dtype in (torch.float32, torch.bfloat16) for style in ("wb", "none")]
CASES += [pytest.param((13, 100), dtype, style, id=f"N13-D100-{DTYPE_IDS[dtype]}-{style}")
          for dtype in (torch.float32, torch.bfloat16) for style in ("w", "b")]
CASES += [pytest.param((13, 100), torch.float16, "wb", id="N13-D100-fp16-wb")]


@pytest.mark.parametrize("shape,dtype,style", CASES)
def test_forward_and_gradients_match_pattern(shape, dtype, style, device):
    x, w, b, dy = make_inputs(shape, shift=3.0, device=device)
    y, dx, dw, db = check(style, x, w, b, dy, dtype)
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == x.shape
    assert (dw is not None) == ("w" in style) and (db is not None) == ("b" in style)
    if dw is not None:
        assert dw.dtype == dtype and dw.shape == (shape[-1],)
    if db is not None:
        assert db.dtype == dtype and db.shape == (shape[-1],)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_upcast_pattern(dtype, device):
    x, w, b, dy = make_inputs((7, 33), shift=-2.0, device=device)
    check("wb", x, w, b, dy, dtype, pattern="upcast")


@pytest.mark.parametrize("frozen", [("w", "b"), ("w",), ("b",)], ids=["frozen-w-b", "frozen-w", "frozen-b"])
def test_frozen_parameters_get_no_gradient(frozen, device):
    x32, w32, b32, dy32 = make_inputs((13, 100), device=device)
    check("wb", x32, w32, b32, dy32, torch.bfloat16, frozen=frozen)  # the values, and no grad where frozen
    x = x32.to(torch.bfloat16).requires_grad_(True)
    w = w32.to(torch.bfloat16).requires_grad_("w" not in frozen)
    b = b32.to(torch.bfloat16).requires_grad_("b" not in frozen)
    y = layer_norm(x, w, b, 1e-5)
    with RecordOps() as rec:
        y.backward(dy32.to(torch.bfloat16))
    (args, (_, dw_raw, db_raw)), = [(a, o) for f, a, o in rec.calls
                                     if f is torch.ops.sloth.layer_norm_backward.default]
    assert args[4] is ("w" not in frozen) and args[5] is ("b" not in frozen)
    assert (dw_raw.numel() == 0) == ("w" in frozen) and (db_raw.numel() == 0) == ("b" in frozen)
    assert (w.grad is None) == ("w" in frozen) and (b.grad is None) == ("b" in frozen)


LAYOUTS = {
    "transposed": lambda t: t.t().contiguous().t(),
    "row-padded": lambda t: torch.nn.functional.pad(t, (0, 28)).narrow(-1, 0, t.shape[-1]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_non_contiguous_input(layout, device):
    x32, w32, b32, dy32 = make_inputs((13, 33), shift=1.0, device=device)
    x, dy = LAYOUTS[layout](x32.to(torch.bfloat16)), LAYOUTS[layout](dy32.to(torch.bfloat16))
    assert not x.is_contiguous() and not dy.is_contiguous()
    w, b = w32.to(torch.bfloat16), b32.to(torch.bfloat16)
    actual = run(lambda a, w_, b_: layer_norm(a, w_, b_, 1e-5), x, w, b, dy)
    eager = run(lambda a, w_, b_: layer_norm_pattern(a, w_, b_, 1e-5), x, w, b, dy)
    reference = run(lambda a, w_, b_: layer_norm_pattern(a, w_, b_, 1e-5), x.double(), w.double(), b.double(),
                    dy.double())
    for name, a, e, r in zip(("y", "dx", "dw", "db"), actual, eager, reference):
        assert_close(name, a, e, r)


def test_mixed_bf16_input_fp32_parameters_fp32_output(device):
    x32, w32, b32, dy32 = make_inputs((13, 100), device=device)
    x, w, b = x32.to(torch.bfloat16), w32, b32
    actual = run(lambda a, w_, b_: layer_norm(a, w_, b_, 1e-5, out_dtype=torch.float32), x, w, b, dy32)
    eager = run(lambda a, w_, b_: upcast_layer_norm_pattern(a, w_, b_, 1e-5).float(), x, w, b, dy32)
    with StayFloat64():
        reference = run(lambda a, w_, b_: upcast_layer_norm_pattern(a, w_, b_, 1e-5), x.double(), w.double(),
                        b.double(), dy32.double())
    assert [t.dtype for t in actual] == [torch.float32, torch.bfloat16, torch.float32, torch.float32]
    for name, a, e, r in zip(("y", "dx", "dw", "db"), actual, eager, reference):
        assert_close(name, a, e.to(a.dtype), r)


def test_eps_is_a_runtime_argument(device):
    # Rows with variance ~1e-4: eps 1e-6 barely matters, eps 1e-2 dominates the denominator.
    x, w, b, dy = make_inputs((16, 64), scale=1e-2, device=device)
    small = check("wb", x, w, b, dy, torch.float32, eps=1e-6)
    large = check("wb", x, w, b, dy, torch.float32, eps=1e-2)
    assert (small[0] - large[0]).abs().max().item() > 0.5
    assert (small[1] - large[1]).abs().max().item() > 0.5
    assert torch.equal(layer_norm(x, w, b, 1e-6), small[0]), "a second call with the first eps gives the first result"


def test_constant_rows_and_single_column(device):
    # Zero variance: n = 0 and y = b exactly; dx = rstd * (dn - mean(dn)) with rstd = eps^(-1/2), which is 0 for
    # D = 1 (every row of one column is constant).
    for shape in ((5, 40), (6, 1)):
        x, w, b, dy = make_inputs(shape, device=device)
        y, dx, _, _ = check("wb", torch.full(shape, 3.0, device=device), w, b, dy, torch.float32)
        assert torch.equal(y, b.expand(shape)) and not dx.isnan().any()
        if shape[-1] == 1:
            assert torch.equal(dx, torch.zeros(shape, device=device))


BAD_INPUTS = [
    pytest.param(lambda d: (torch.randn(3, 64, device=d), torch.randn(65, device=d), None), ValueError,
                 r"weight must have shape \(64,\).*got \(65,\)", id="weight-too-long"),
    pytest.param(lambda d: (torch.randn(3, 64, device=d), None, torch.randn(1, 64, device=d)), ValueError,
                 r"bias must have shape \(64,\).*\(1, 64\)", id="bias-2d"),
    pytest.param(lambda d: (torch.randn(3, 64, dtype=torch.float64, device=d), None, None), TypeError,
                 r"x must be .*float64", id="x-float64"),
    pytest.param(lambda d: (torch.randn(3, 64, device=d), None, torch.ones(64, dtype=torch.int32, device=d)),
                 TypeError, r"bias must be .*int32", id="bias-int32"),
    pytest.param(lambda d: (torch.zeros(1, MAX_HIDDEN + 1, device=d), None, None), ValueError,
                 rf"exceeds .*{MAX_HIDDEN}", id="hidden-over-max"),
    pytest.param(lambda d: (torch.tensor(1.0, device=d), None, None), ValueError, r"at least one dimension",
                 id="x-0d"),
]


@pytest.mark.parametrize("make,error,message", BAD_INPUTS)
def test_input_errors_name_the_problem(make, error, message, device):
    x, w, b = make(device)
    with pytest.raises(error, match="sloth.layer_norm: .*" + message):
        layer_norm(x, w, b, 1e-5)


def test_zero_rows(device):
    x = torch.randn(0, 64, device=device, requires_grad=True)
    w, b = torch.randn(64, device=device, requires_grad=True), torch.randn(64, device=device, requires_grad=True)
    layer_norm(x, w, b, 1e-5).sum().backward()
    zeros = torch.zeros(64, device=device)
    assert x.grad.shape == (0, 64) and torch.equal(w.grad, zeros) and torch.equal(b.grad, zeros)


OPCHECK_CASES = [
    pytest.param(lambda d: torch.randn(3, 33, device=d), True, True, id="N3-D33-fp32-wb"),
    pytest.param(lambda d: torch.randn(2, 5, 64, dtype=torch.bfloat16, device=d), False, False,
                 id="B2-T5-D64-bf16-none"),
    pytest.param(lambda d: torch.randn(64, 8, device=d).t(), True, False, id="N8-D64-transposed-w"),
]


@pytest.mark.parametrize("make_x,has_w,has_b", OPCHECK_CASES)
def test_opcheck(make_x, has_w, has_b, device):
    register()
    x = make_x(device).requires_grad_(True)
    d = x.shape[-1]
    w = torch.randn(d, dtype=x.dtype, device=device, requires_grad=True) if has_w else None
    b = torch.randn(d, dtype=x.dtype, device=device, requires_grad=True) if has_b else None
    torch.library.opcheck(torch.ops.sloth.layer_norm.default, (x, w, b, 1e-5, x.dtype))
    dy = torch.randn(x.shape, dtype=x.dtype, device=device)
    torch.library.opcheck(torch.ops.sloth.layer_norm_backward.default,
                          (dy, x.detach(), None if w is None else w.detach(), 1e-5, has_w, has_b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fallback_matches_triton(dtype, device):
    x32, w32, b32, dy32 = make_inputs((2, 5, 33), shift=1.0, device=device)
    x, w, b, dy = x32.to(dtype), w32.to(dtype), b32.to(dtype), dy32.to(dtype)
    fused = lambda a, w_, b_: layer_norm(a, w_, b_, 1e-5)  # noqa: E731
    triton_out = run(fused, x, w, b, dy)
    with pytest.MonkeyPatch.context() as mp:
        force_fallback(mp, lowering, *KERNELS)
        fallback_out = run(fused, x, w, b, dy)
    for name, a, t in zip(("y", "dx", "dw", "db"), fallback_out, triton_out):
        assert a.dtype == t.dtype and a.shape == t.shape, name
        torch.testing.assert_close(a, t, msg=lambda m: f"{name}: {m}")
