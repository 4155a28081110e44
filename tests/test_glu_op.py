"""The fused op ``sloth.lowering.glu.glu``: forward, d_gate and d_up against the pattern functions.

Oracle (STYLE.md, habit 5): ``patterns/glu.py``'s functions run eagerly at the tested dtype are "eager"; the
same functions run in float64 are the reference (they have no fp32 upcasts, so float64 inputs keep them in
float64 end to end). The merged form ``glu(m, None, act)`` is checked against the pattern applied to
``m.chunk(2, -1)``, its gradient against the gradient of m.

Activations: ``silu`` (SwiGLU), ``gelu_tanh`` and ``gelu_erf`` (GeGLU), ``relu`` (ReGLU), ``relu2`` (BitNet's
squared ReLU) and ``sigmoid`` (GLU). Forms: ``split`` (gate and up separate tensors), ``merged`` (one [..., 2n]
tensor, gate half first).

Measured error ratios (ours / eager's, vs fp64): fp32 0.5-1.2x, fp16 0.6-0.8x, bf16 1.4-1.8x on CPU, the
bf16 figure from before the kernels rounded on the interpreter too (Triton 3.6's interpreter truncates
fp32 -> bf16; lowering/rounding.py now rounds to nearest there as a GPU does). The activations added later,
over SHAPES, y and both gradients (2026-12-07, interpreter): relu 1.00x at every dtype (the same roundings as
eager), relu2 fp32 1.00x, bf16 0.52-0.98x, fp16 0.21-0.94x, sigmoid fp32 0.27-1.14x, bf16 0.31-0.83x, fp16
0.14-0.80x.
"""
from __future__ import annotations

import pytest
import torch

import sloth.lowering.glu as lowering
from sloth.lowering.glu import ACTIVATIONS, glu, register
from sloth.patterns.glu import PATTERNS
from tolerance import assert_close
from op_checks import force_fallback, RecordOps

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def make_inputs(shape, seed: int = 0, scale: float = 2.0):
    """fp32 masters for gate, up and dy; every run rounds them to its own dtype first.

    gate spreads over [-6, 6] or so (scale 2): the activations bend there, and gelu's tails are reached.
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale, torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def forward_backward(fn, inputs, dy):
    """(y, d(input) for each input) of ``fn(*inputs)`` for cotangent dy."""
    inputs = [t.detach().requires_grad_(True) for t in inputs]  # detach, not clone: keeps a view's layout
    y = fn(*inputs)
    return [y.detach(), *torch.autograd.grad(y, inputs, dy.to(y.dtype))]


def fused_fn(activation: str, form: str):
    if form == "merged":
        return lambda m: glu(m, None, activation)
    return lambda g, u: glu(g, u, activation)


def pattern_fn(activation: str, form: str):
    pattern = PATTERNS[activation]
    if form == "merged":
        return lambda m: pattern(*m.chunk(2, dim=-1))
    return pattern


def check_against_pattern(activation, form, g32, u32, dy32, dtype):
    """Run the fused op, the pattern at ``dtype`` and the pattern in float64; apply the tolerance rule."""
    g, u, dy = g32.to(dtype), u32.to(dtype), dy32.to(dtype)
    inputs = [torch.cat([g, u], -1)] if form == "merged" else [g, u]
    actual = forward_backward(fused_fn(activation, form), inputs, dy)
    eager = forward_backward(pattern_fn(activation, form), inputs, dy)
    reference = forward_backward(pattern_fn(activation, form), [t.double() for t in inputs], dy.double())
    names = ("y", "d_merged") if form == "merged" else ("y", "d_gate", "d_up")
    for name, a, e, r in zip(names, actual, eager, reference):
        assert_close(name, a, e, r)
    return actual


# ---------------------------------------------------------------------------------------------------
# Forward, d_gate and d_up: shapes x dtypes x activations x forms
# ---------------------------------------------------------------------------------------------------

SHAPES = [(1, 64), (3, 64), (127, 64), (1, 100), (3, 100), (127, 100), (1, 1000), (3, 1000), (127, 1000),
          (2, 5, 100)]


def shape_id(shape) -> str:
    return f"N{shape[0]}-n{shape[1]}" if len(shape) == 2 else f"B{shape[0]}-T{shape[1]}-n{shape[2]}"


CASES = [pytest.param(shape, dtype, act, form, id=f"{shape_id(shape)}-{DTYPE_IDS[dtype]}-{act}-{form}")
         for shape in SHAPES for dtype in (torch.float32, torch.bfloat16) for act in ACTIVATIONS
         for form in ("split", "merged")
         if form == "split" or shape in ((3, 100), (127, 1000), (2, 5, 100))]
CASES += [pytest.param((127, 100), torch.float16, act, "split", id=f"N127-n100-fp16-{act}-split")
          for act in ACTIVATIONS]


@pytest.mark.parametrize("shape,dtype,activation,form", CASES)
def test_forward_and_gradients_match_pattern(shape, dtype, activation, form):
    g, u, dy = make_inputs(shape)
    y, *grads = check_against_pattern(activation, form, g, u, dy, dtype)
    assert y.dtype == dtype and y.shape == shape and all(d.dtype == dtype for d in grads)
    if form == "merged":
        assert grads[0].shape == (*shape[:-1], 2 * shape[-1])


# ---------------------------------------------------------------------------------------------------
# Layouts, tails, one tensor as both operands
# ---------------------------------------------------------------------------------------------------

LAYOUTS = {
    # (N, n) -> a view with the same values and a different layout
    "transposed": lambda t: t.t().contiguous().t(),
    "row-padded": lambda t: torch.nn.functional.pad(t, (0, 28)).narrow(-1, 0, t.shape[-1]),
    "every-other-row": lambda t: torch.stack([t, torch.zeros_like(t)], 1).reshape(-1, t.shape[-1])[::2],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_non_contiguous_inputs(layout, dtype):
    g32, u32, dy32 = make_inputs((37, 100))
    g, u, dy = (LAYOUTS[layout](t.to(dtype)) for t in (g32, u32, dy32))
    assert torch.equal(g, g32.to(dtype)) and not g.is_contiguous() and not dy.is_contiguous()
    actual = forward_backward(fused_fn("silu", "split"), [g, u], dy)
    eager = forward_backward(PATTERNS["silu"], [g, u], dy)
    reference = forward_backward(PATTERNS["silu"], [g.double(), u.double()], dy.double())
    for name, a, e, r in zip(("y", "d_gate", "d_up"), actual, eager, reference):
        assert_close(name, a, e, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merged_with_padded_rows(dtype):
    # A [N, 2n] view of a wider buffer: rows are 2n + 28 apart, the halves still n apart.
    g32, u32, dy32 = make_inputs((37, 100))
    m = LAYOUTS["row-padded"](torch.cat([g32, u32], -1).to(dtype))
    assert not m.is_contiguous()
    actual = forward_backward(fused_fn("gelu_tanh", "merged"), [m], dy32.to(dtype))
    eager = forward_backward(pattern_fn("gelu_tanh", "merged"), [m], dy32.to(dtype))
    reference = forward_backward(pattern_fn("gelu_tanh", "merged"), [m.double()], dy32.double())
    for name, a, e, r in zip(("y", "d_merged"), actual, eager, reference):
        assert_close(name, a, e, r)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the interpreter's numpy would warn of an exp overflow
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_tails_are_finite_and_exact(activation):
    # Far into both tails: silu and gelu go to 0 (and x) without a NaN from inf * 0 or an overflow.
    g = torch.tensor([-1e4, -300.0, -100.0, -30.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 30.0, 100.0, 300.0, 1e4]).repeat(3, 1)
    u, dy = torch.ones_like(g), torch.ones_like(g)
    y, d_gate, d_up = forward_backward(fused_fn(activation, "split"), [g, u], dy)
    y_r, d_gate_r, d_up_r = forward_backward(PATTERNS[activation], [g.double(), u.double()], dy.double())
    for name, a, r in (("y", y, y_r), ("d_gate", d_gate, d_gate_r), ("d_up", d_up, d_up_r)):
        assert torch.isfinite(a).all(), f"{name}: {a[0]}"
        torch.testing.assert_close(a.double(), r, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fallback", [False, True], ids=["triton", "fallback"])
@pytest.mark.parametrize("activation", ["relu", "relu2"])
def test_relu_kink_follows_autograd(monkeypatch, activation, fallback, dtype):
    # At g = 0 autograd's relu passes no gradient (threshold_backward: where(g <= 0, 0, dy)); -0.0 is <= 0 too. A
    # NaN gate gives a NaN output and lets its gradient through, as torch.relu and its backward do.
    if fallback:
        force_fallback(monkeypatch, lowering, "_glu_fwd_kernel", "_glu_bwd_kernel")
    g = torch.tensor([[0.0, -0.0, 1e-30, -1e-30, 2.0, -2.0, float("nan"), 0.5]], dtype=dtype)
    u = torch.tensor([[3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, -1.5]], dtype=dtype)
    dy = torch.ones_like(g)
    actual = forward_backward(fused_fn(activation, "split"), [g, u], dy)
    eager = forward_backward(PATTERNS[activation], [g, u], dy)
    for name, a, e in zip(("y", "d_gate", "d_up"), actual, eager):
        torch.testing.assert_close(a, e, equal_nan=True, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert actual[1][0, 0] == 0 and actual[1][0, 1] == 0  # the kink itself


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_gate_as_its_own_up(activation):
    # act(g) * g: one tensor in both places; autograd adds the two gradients the op returns.
    g, _, dy = make_inputs((3, 100))
    actual = forward_backward(lambda x: glu(x, x, activation), [g], dy)
    eager = forward_backward(lambda x: PATTERNS[activation](x, x), [g], dy)
    reference = forward_backward(lambda x: PATTERNS[activation](x, x), [g.double()], dy.double())
    for name, a, e, r in zip(("y", "d_gate"), actual, eager, reference):
        assert_close(name, a, e, r)


def test_backward_saves_gate_and_up_only():
    # One backward op call per forward, and nothing recomputed by PyTorch ops in between.
    g, u, dy = (t.requires_grad_(True) for t in make_inputs((3, 64)))
    y = glu(g, u, "silu")
    with RecordOps() as rec:
        y.backward(dy)
    ops = [func for func, _, _ in rec.calls]
    assert torch.ops.sloth.glu_backward.default in ops
    assert not [f for f in ops if "silu" in str(f) or "sigmoid" in str(f)], ops


# ---------------------------------------------------------------------------------------------------
# Input errors
# ---------------------------------------------------------------------------------------------------

BAD_INPUTS = [
    pytest.param(lambda: (torch.randn(3, 64), torch.randn(3, 64), "tanh"), ValueError,
                 r"activation must be one of .*'silu'.*'relu2'.*got 'tanh'", id="activation-tanh"),
    pytest.param(lambda: (torch.randint(0, 3, (3, 64)), torch.randint(0, 3, (3, 64)), "silu"), TypeError,
                 r"gate must be .*int64", id="gate-int64"),
    pytest.param(lambda: (torch.randn(3, 64, dtype=torch.float64), torch.randn(3, 64, dtype=torch.float64), "silu"),
                 TypeError, r"gate must be .*float64", id="gate-float64"),
    pytest.param(lambda: (torch.randn(3, 64), torch.randn(3, 64, dtype=torch.bfloat16), "silu"), TypeError,
                 r"up must have gate's dtype torch.float32, got torch.bfloat16", id="up-other-dtype"),
    pytest.param(lambda: (torch.randn(3, 64), torch.randn(64), "silu"), ValueError,
                 r"up must have gate's shape \(3, 64\), got \(64,\)", id="up-broadcasts"),
    pytest.param(lambda: (torch.randn(3, 65), None, "gelu_tanh"), ValueError,
                 r"merged gate_up tensor needs an even last dimension, got 65", id="merged-odd"),
    pytest.param(lambda: (torch.tensor(1.0), torch.tensor(1.0), "silu"), ValueError, r"at least one dimension",
                 id="gate-0d"),
]


@pytest.mark.parametrize("via", ["function", "torch.ops"])
@pytest.mark.parametrize("make,error,message", BAD_INPUTS)
def test_input_errors_name_the_problem(make, error, message, via):
    gate, up, activation = make()
    if via == "function":
        call = lambda: glu(gate, up, activation)  # noqa: E731
    else:
        register()
        call = lambda: torch.ops.sloth.glu(gate, up, activation)  # noqa: E731
    with pytest.raises(error, match=message):
        call()


# ---------------------------------------------------------------------------------------------------
# Empty input
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["split", "merged"])
def test_zero_rows(form):
    g, u = torch.randn(0, 64, requires_grad=True), torch.randn(0, 64, requires_grad=True)
    m = torch.randn(0, 128, requires_grad=True)
    y = glu(m, None, "silu") if form == "merged" else glu(g, u, "silu")
    assert y.shape == (0, 64)
    y.sum().backward()
    assert (m.grad.shape == (0, 128)) if form == "merged" else (g.grad.shape == u.grad.shape == (0, 64))


# ---------------------------------------------------------------------------------------------------
# torch.library registration
# ---------------------------------------------------------------------------------------------------

OPCHECK_CASES = [
    pytest.param(lambda: (torch.randn(3, 100), torch.randn(3, 100)), id="N3-n100-fp32-split"),
    pytest.param(lambda: (torch.randn(2, 5, 64, dtype=torch.bfloat16), None), id="B2-T5-n32-bf16-merged"),
    pytest.param(lambda: (torch.randn(64, 8).t(), torch.randn(8, 64)), id="N8-n64-transposed-gate"),
    pytest.param(lambda: (torch.randn(4, 200)[:, :100], torch.randn(4, 100, dtype=torch.float32)),
                 id="N4-n100-strided-rows"),
]


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("make", OPCHECK_CASES)
def test_opcheck_forward(make, activation):
    register()
    x, up = make()
    x.requires_grad_(True)
    if up is not None:
        up.requires_grad_(True)
    torch.library.opcheck(torch.ops.sloth.glu.default, (x, up, activation))


@pytest.mark.parametrize("make", OPCHECK_CASES)
def test_opcheck_backward(make):
    # The backward op has no autograd of its own (no double backward), so its inputs need no grad.
    register()
    x, up = make()
    dy = torch.randn(up.shape if up is not None else (*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype)
    torch.library.opcheck(torch.ops.sloth.glu_backward.default, (dy, x, up, "gelu_erf"))


def test_register_is_idempotent():
    register()
    register()
    assert hasattr(torch.ops.sloth, "glu") and hasattr(torch.ops.sloth, "glu_backward")


# ---------------------------------------------------------------------------------------------------
# The PyTorch fallback (CPU without the interpreter, other devices)
# ---------------------------------------------------------------------------------------------------

FALLBACK_CASES = [pytest.param(shape, dtype, act, form, id=f"{shape_id(shape)}-{DTYPE_IDS[dtype]}-{act}-{form}")
                  for shape in [(3, 100), (2, 5, 64)] for dtype in (torch.float32, torch.bfloat16)
                  for act in ACTIVATIONS for form in ("split", "merged")]


@pytest.mark.parametrize("shape,dtype,activation,form", FALLBACK_CASES)
def test_fallback_matches_triton(shape, dtype, activation, form):
    g32, u32, dy32 = make_inputs(shape)
    g, u, dy = g32.to(dtype), u32.to(dtype), dy32.to(dtype)
    inputs = [torch.cat([g, u], -1)] if form == "merged" else [g, u]
    triton_out = forward_backward(fused_fn(activation, form), inputs, dy)
    with pytest.MonkeyPatch.context() as mp:
        force_fallback(mp, lowering, "_glu_fwd_kernel", "_glu_bwd_kernel")
        fallback_out = forward_backward(fused_fn(activation, form), inputs, dy)
    for i, (a, b) in enumerate(zip(fallback_out, triton_out)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        # bf16: both round the same fp32 value to nearest (lowering/rounding.py); the fp32 values may differ.
        torch.testing.assert_close(a, b, msg=lambda m: f"output {i}: {m}")


def test_fallback_is_used_when_triton_cannot_run(monkeypatch):
    force_fallback(monkeypatch, lowering, "_glu_fwd_kernel", "_glu_bwd_kernel")
    g, u, dy = make_inputs((3, 100))
    for form in ("split", "merged"):
        check_against_pattern("gelu_erf", form, g, u, dy, torch.bfloat16)


def test_fallback_output_layout_matches_fake(monkeypatch):
    force_fallback(monkeypatch, lowering, "_glu_fwd_kernel", "_glu_bwd_kernel")
    register()
    g, u = torch.randn(64, 8).t(), torch.randn(8, 64)
    torch.library.opcheck(torch.ops.sloth.glu.default, (g, u, "silu"), test_utils=("test_faketensor",))
    m = torch.randn(4, 256)[:, :128]
    torch.library.opcheck(torch.ops.sloth.glu.default, (m, None, "silu"), test_utils=("test_faketensor",))
    d_gate, d_up = torch.ops.sloth.glu_backward(torch.randn(8, 64), g, u, "silu")
    assert d_gate.is_contiguous() and d_up.is_contiguous()
    d_m, _ = torch.ops.sloth.glu_backward(torch.randn(4, 64), m, None, "silu")
    assert d_m.is_contiguous() and d_m.shape == (4, 128)


@pytest.mark.parametrize("fallback", [False, True], ids=["triton", "fallback"])
@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_backward_writes_the_output_over_dy(monkeypatch, fallback, merged, activation):
    # glu_backward_impl(y_over_dy=True), which glu_lora.py's backward uses: the same gradients, and dy now
    # holding the forward's output bit for bit (the kernel reads each dy before writing its y there).
    if fallback:
        force_fallback(monkeypatch, lowering, "_glu_fwd_kernel", "_glu_bwd_kernel")
    gen = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(13, 70, generator=gen).to(torch.bfloat16) for _ in range(2))
    x, up_arg = (torch.cat([gate, up], -1), None) if merged else (gate, up)
    dy = torch.randn(13, 70, generator=gen).to(torch.bfloat16)
    dx, dup = lowering.glu_backward_impl(dy, x, up_arg, activation)
    dy_out = dy.clone()
    dx_y, dup_y = lowering.glu_backward_impl(dy_out, x, up_arg, activation, y_over_dy=True)
    assert torch.equal(dx_y, dx) and torch.equal(dup_y, dup)
    assert torch.equal(dy_out, lowering.glu_forward(x, up_arg, activation))
    with pytest.raises(ValueError, match="y_over_dy needs dy contiguous"):
        lowering.glu_backward_impl(dy.t().contiguous().t(), x, up_arg, activation, y_over_dy=True)
    with pytest.raises(ValueError, match="y_over_dy needs dy contiguous"):
        lowering.glu_backward_impl(dy.float(), x, up_arg, activation, y_over_dy=True)


def test_the_backward_op_does_not_take_y_over_dy():
    # The registered op is functional (mutates_args=()): y_over_dy, which writes over dy, stays off its schema.
    register()
    args = [a.name for a in torch.ops.sloth.glu_backward.default._schema.arguments]
    assert args == ["dy", "x", "up", "activation"], args
