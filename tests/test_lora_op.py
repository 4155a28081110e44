"""The fused op ``sloth.lowering.lora.lora_linear``: y, dx, da and db against the pattern function.

Oracle (STYLE.md, habit 5): ``patterns/lora.py``'s ``lora_pattern`` (peft's LoRA forward) run eagerly at the
tested dtypes is "eager"; the same function with every input in float64 is the reference (its two casts go
to a's dtype and back to x's, both float64 there, so it stays float64 end to end). The base weight and bias
are frozen throughout, as the op requires; x, a and b get gradients.

The adapter's up factor b is drawn non-zero (peft initialises it to zero, which would hide a dropped or
mis-scaled adapter path and give a zero da), with a and b scaled so that the adapter's contribution is of
the base's size.

Dtypes: x and w in float32, bfloat16 and float16, the adapter in float32 (peft's default, which keeps it
there under a 16-bit base) or in x's dtype. In the latter case eager rounds after each adapter matmul and
the op does not, so the op's error is the smaller one.

Measured error ratios (ours / eager's, vs fp64) on CPU: fp32 0.5-1.4x (2.7x for the single-element da of
K = 1, r = 1, inside the atol), fp16 0.6-1.0x, bf16 0.3-1.7x except y at 1.1-2.1x, measured while Triton
3.6's interpreter still truncated the kernels' fp32 -> bf16 stores (lowering/rounding.py rounds them now).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import sloth.lowering.lora as lowering
from sloth.lowering.lora import lora_linear, lora_linear_reference, register
from sloth.patterns.lora import lora_pattern
from tolerance import assert_close
from op_checks import force_fallback, record_launches, RecordOps

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
KERNELS = ("_split_factor_kernel", "_lora_down_kernel", "_lora_up_add_kernel", "_lora_grad_kernel")


def make_inputs(x_shape, n: int, r: int, *, bias: bool = False, seed: int = 0, device: str = "cpu"):
    """fp32 masters for x, w, bias, a, b and dy, drawn on the CPU (the same values on every device) and moved to
    ``device``; every run rounds them to its own dtypes first.

    w and a are scaled by 1/sqrt(K), b by 1/sqrt(r): base and adapter outputs both have a std of about 1,
    so an error in either shows in y.
    """
    g = torch.Generator().manual_seed(seed)
    k = x_shape[-1]
    x = torch.randn(x_shape, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b_ = torch.randn(n, generator=g) if bias else None
    a = torch.randn(r, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, r, generator=g) / math.sqrt(r)
    dy = torch.randn(*x_shape[:-1], n, generator=g)
    return tuple(None if t is None else t.to(device) for t in (x, w, b_, a, b, dy))


def forward_backward(fn, x, w, bias, a, b, scale, dy, need_dx: bool = True):
    """[y, dx, da, db] of ``fn(x, w, bias, a, b, scale)`` for cotangent dy; w and bias frozen, dx None
    when x does not require grad."""
    x = x.detach().requires_grad_(need_dx)  # detach, not clone: keeps a view's layout
    a, b = a.detach().requires_grad_(True), b.detach().requires_grad_(True)
    y = fn(x, w, bias, a, b, scale)
    wrt = ([x] if need_dx else []) + [a, b]
    grads = list(torch.autograd.grad(y, wrt, dy.to(y.dtype)))
    dx = grads.pop(0) if need_dx else None
    return [y.detach(), dx, *grads]


def cast_inputs(masters, dtype: torch.dtype, adapter_dtype: torch.dtype):
    """The masters rounded to the run's dtypes: x, w, bias and dy to ``dtype``, a and b to ``adapter_dtype``."""
    x, w, bias, a, b, dy = masters
    return (x.to(dtype), w.to(dtype), None if bias is None else bias.to(dtype), a.to(adapter_dtype),
            b.to(adapter_dtype), dy.to(dtype))


def check_against_pattern(masters, dtype, adapter_dtype, scale, need_dx: bool = True):
    """Run the fused op, the pattern at the tested dtypes and the pattern in float64; apply the tolerance rule."""
    x, w, bias, a, b, dy = cast_inputs(masters, dtype, adapter_dtype)
    actual = forward_backward(lora_linear, x, w, bias, a, b, scale, dy, need_dx)
    eager = forward_backward(lora_pattern, x, w, bias, a, b, scale, dy, need_dx)
    reference = forward_backward(lora_pattern, *(None if t is None else t.double() for t in (x, w, bias, a, b)),
                                 scale, dy.double(), need_dx)
    assert reference[0].dtype == torch.float64
    for name, got, e, ref in zip(("y", "dx", "da", "db"), actual, eager, reference):
        if e is None:
            assert got is None, f"{name}: a gradient the pattern does not have"
            continue
        assert_close(name, got, e, ref)
    return actual


# ---------------------------------------------------------------------------------------------------
# y, dx, da and db: shapes x dtypes x adapter dtypes, with and without bias, several scales
# ---------------------------------------------------------------------------------------------------

# (x shape, N, r, bias, scale): odd sizes everywhere (every block of every kernel has a masked tail), K = 1,
# N = 1 and r = 1 degenerate cases, r = 33 padded to a BLOCK_R of 64, 257 rows where the dA/dB reduction
# runs in two row splits of several blocks, a 3-D x, and one shape past the launch configs' tiles.
SHAPES = [
    ((1, 16), 45, 5, False, 2.0),
    ((3, 70), 45, 33, True, 0.5),
    ((37, 70), 1, 16, False, 2.0),
    ((37, 1), 45, 1, True, 2.0),
    ((257, 16), 45, 5, True, 0.5),
    ((257, 70), 1, 33, False, -1.5),
    ((2, 37, 70), 45, 16, True, 2.0),
    ((37, 300), 130, 16, True, 0.5),  # K past one down tile (256) and two grad tiles (128), N past one up tile
]


def shape_id(x_shape, n, r, bias, scale) -> str:
    rows = "x".join(str(d) for d in x_shape[:-1])
    return f"M{rows}-K{x_shape[-1]}-N{n}-r{r}{'-bias' if bias else ''}-s{scale:g}"


# (x dtype, adapter dtype): peft's fp32 adapter under each base dtype, and the adapter in x's dtype.
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]

CASES = [pytest.param(*shape, dt, adt, id=f"{shape_id(*shape)}-{DTYPE_IDS[dt]}-adapter-{DTYPE_IDS[adt]}")
         for shape in SHAPES for dt, adt in DTYPE_PAIRS]
CASES += [pytest.param((37, 70), 45, 16, True, 2.0, torch.float16, adt,
                       id=f"M37-K70-N45-r16-bias-s2-fp16-adapter-{DTYPE_IDS[adt]}")
          for adt in (torch.float32, torch.float16)]


@pytest.mark.parametrize("x_shape,n,r,bias,scale,dtype,adapter_dtype", CASES)
def test_forward_and_gradients_match_pattern(x_shape, n, r, bias, scale, dtype, adapter_dtype, device):
    masters = make_inputs(x_shape, n, r, bias=bias, device=device)
    y, dx, da, db = check_against_pattern(masters, dtype, adapter_dtype, scale)
    assert y.dtype == dtype and y.shape == (*x_shape[:-1], n)
    assert dx.dtype == dtype and dx.shape == x_shape
    assert da.dtype == db.dtype == adapter_dtype and da.shape == (r, x_shape[-1]) and db.shape == (n, r)


@pytest.mark.parametrize("dtype,adapter_dtype", DTYPE_PAIRS, ids=lambda t: DTYPE_IDS.get(t, t))
def test_small_tiles_every_kernel_loops(monkeypatch, dtype, adapter_dtype, device):
    # With 16-wide tiles the down kernel loops over K, the grad kernel over several K blocks and row splits,
    # and the up kernel over a grid of row blocks and two column groups, looping over a group's column tiles
    # (3 tiles of 16 over 45 columns: groups of 2 and 1), at a size the interpreter runs quickly.
    monkeypatch.setitem(lowering.DOWN_CONFIG, "block_m", 16)
    monkeypatch.setitem(lowering.DOWN_CONFIG, "block_k", 16)
    monkeypatch.setitem(lowering.UP_CONFIG, "block_m", 16)
    monkeypatch.setitem(lowering.UP_CONFIG, "block_n", 16)
    monkeypatch.setitem(lowering.UP_CONFIG, "programs", 14)
    assert lowering.up_add_groups(100, 45) == (2, 32)
    monkeypatch.setitem(lowering.GRAD_CONFIG, "block_m", 16)
    monkeypatch.setitem(lowering.GRAD_CONFIG, "block_k", 16)
    check_against_pattern(make_inputs((100, 70), 45, 16, bias=True, device=device), dtype, adapter_dtype, 2.0)


def test_down_kernel_in_tf32x3_without_the_split_launch(monkeypatch, device):
    """DOWN_SPLIT_LAUNCH off (benchmarks/variants.py's lora_down_tf32x3): bf16 activations with an fp32 adapter take
    the down products in tf32x3 instead of a factor split launch, within the tolerance rule, forward and every
    gradient."""
    if not lowering.use_triton(torch.empty(0, device=device)):
        pytest.skip("no Triton here")
    monkeypatch.setattr(lowering, "DOWN_SPLIT_LAUNCH", False)
    launches = record_launches(monkeypatch, lowering, *KERNELS)
    check_against_pattern(make_inputs((100, 70), 45, 16, bias=True, device=device), torch.bfloat16, torch.float32, 2.0)
    names = {name for name, _, _ in launches}
    assert "_lora_down_kernel" in names and "_split_factor_kernel" not in names, names
    assert {kw["MODE"] for name, _, kw in launches if name == "_lora_down_kernel"} == {lowering._TF32X3.value}


def test_backward_forms_both_adapter_gradients_in_one_launch(monkeypatch, device):
    """da and db come from one grad-kernel launch (programs of both problems in one grid)."""
    if not lowering.use_triton(torch.empty(0, device=device)):
        pytest.skip("no Triton here")
    launches = record_launches(monkeypatch, lowering, "_lora_grad_kernel")
    x, w, _, a, b, _ = make_inputs((3, 9, 40), 24, 5, bias=False, device=device)
    x, a, b = x.bfloat16().requires_grad_(), a.requires_grad_(), b.requires_grad_()
    lora_linear(x, w.bfloat16(), None, a, b, 2.0).sum().backward()
    assert len(launches) == 1 and a.grad is not None and b.grad is not None and x.grad is not None


def test_fp32_input_with_a_bf16_adapter(device):
    # Allowed by the op (the factors need only agree with each other). The pattern rounds x to bf16 for the
    # adapter (peft's x.to(lora_A.weight.dtype)); the op reads x in fp32, which the fp64 reference rewards.
    check_against_pattern(make_inputs((37, 70), 45, 16, bias=True, device=device), torch.float32, torch.bfloat16, 2.0)


@pytest.mark.parametrize("dtype,adapter_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16-adapter-fp32"])
def test_frozen_input_computes_adapter_gradients_only(dtype, adapter_dtype, device):
    # x without requires_grad (the first layer's input, say): the backward op is told so and skips dx.
    masters = make_inputs((37, 70), 45, 16, bias=True, device=device)
    _, dx, da, db = check_against_pattern(masters, dtype, adapter_dtype, 2.0, need_dx=False)
    assert dx is None and da.shape == (16, 70) and db.shape == (45, 16)
    x, w, bias, a, b, dy = cast_inputs(masters, dtype, adapter_dtype)
    a.requires_grad_(True)
    b.requires_grad_(True)
    y = lora_linear(x, w, bias, a, b, 2.0)
    with RecordOps() as rec:
        y.backward(dy)
    (args, (dx_empty, _, _)), = [(args, out) for f, args, out in rec.calls
                                 if f is torch.ops.sloth.lora_linear_backward.default]
    assert args[-1] is False and dx_empty.numel() == 0


@pytest.mark.parametrize("trained", ["x", "a", "b"])
def test_one_input_trained(trained, device):
    # Only x (a frozen adapter), only a or only b requires grad: the op returns the one gradient asked for.
    x, w, _, a, b, dy = cast_inputs(make_inputs((37, 70), 45, 16, device=device), torch.float32, torch.float32)
    grads = []
    for fn, args in ((lora_linear, (x, w, a, b)), (lora_pattern, (x, w, a, b)),
                     (lora_pattern, tuple(t.double() for t in (x, w, a, b)))):
        x_, w_, a_, b_ = (t.detach().requires_grad_(name == trained) for name, t in zip("xwab", args))
        y = fn(x_, w_, None, a_, b_, 2.0)
        grads += torch.autograd.grad(y, [{"x": x_, "a": a_, "b": b_}[trained]], dy.to(y.dtype))
    assert_close(f"d{trained}", *grads)


# ---------------------------------------------------------------------------------------------------
# The adapter path and its scale: a dropped adapter or a scale applied twice must show
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adapter_part_is_linear_in_the_scale(dtype, device):
    # y - base, dx - dx_base, da and db are all proportional to s: with s = 2 they are exactly 4x those
    # with s = 0.5 (powers of two, so only the final roundings differ). A dropped adapter gives 0, a scale
    # applied twice 16x.
    masters = make_inputs((37, 70), 45, 16, bias=True, device=device)
    x, w, bias, a, b, dy = cast_inputs(masters, dtype, torch.float32)
    base = F.linear(x, w, bias).float()
    dx_base = (dy.float() @ w.float())
    runs = {s: forward_backward(lora_linear, x, w, bias, a, b, s, dy) for s in (2.0, 0.5)}
    (y2, dx2, da2, db2), (y05, dx05, da05, db05) = runs[2.0], runs[0.5]
    low2, low05 = y2.float() - base, y05.float() - base
    expected = 2.0 * F.linear(F.linear(x.float(), a), b)
    assert low2.norm() > 0.5 * base.norm(), "the adapter's contribution is too small to test"
    tol = dict(rtol=0, atol=0.05 * expected.abs().max().item()) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(low2, expected, **tol)
    torch.testing.assert_close(low2, 4 * low05, **tol)
    torch.testing.assert_close(dx2.float() - dx_base, 4 * (dx05.float() - dx_base), **tol)
    torch.testing.assert_close(da2, 4 * da05)
    torch.testing.assert_close(db2, 4 * db05)


def test_zero_scale_is_the_base_alone(device):
    masters = make_inputs((37, 70), 45, 16, bias=True, device=device)
    x, w, bias, a, b, dy = cast_inputs(masters, torch.float32, torch.float32)
    y, dx, da, db = forward_backward(lora_linear, x, w, bias, a, b, 0.0, dy)
    torch.testing.assert_close(y, F.linear(x, w, bias))
    torch.testing.assert_close(dx, dy @ w)
    assert not da.any() and not db.any()


def test_saved_adapter_activation_is_x_times_a_transposed(device):
    # The op's second output h = x2 @ a.T (fp32, [rows, r]) is what the backward uses for db.
    x, w, bias, a, b, _ = cast_inputs(make_inputs((2, 37, 70), 45, 16, device=device), torch.bfloat16, torch.float32)
    register()
    y, h = torch.ops.sloth.lora_linear(x, w, bias, a, b, 2.0)
    assert h.dtype == torch.float32 and h.shape == (74, 16) and h.is_contiguous()
    torch.testing.assert_close(h, x.reshape(-1, 70).float() @ a.t())
    y_ref, h_ref = lora_linear_reference(x, w, bias, a, b, 2.0)
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(y, y_ref)


# ---------------------------------------------------------------------------------------------------
# Layouts: strided x and dy, transposed adapter factors, an expanded cotangent, 1-D x, zero rows
# ---------------------------------------------------------------------------------------------------

LAYOUTS = {
    # (rows, cols) -> a view with the same values and a different layout
    "transposed": lambda t: t.t().contiguous().t(),
    "row-padded": lambda t: F.pad(t, (0, 28)).narrow(-1, 0, t.shape[-1]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_non_contiguous_inputs(layout, dtype, device):
    masters = make_inputs((37, 70), 45, 16, bias=True, device=device)
    x, w, bias, a, b, dy = (None if t is None or t.dim() != 2 else LAYOUTS[layout](t)
                            for t in cast_inputs(masters, dtype, torch.float32))
    bias = masters[2].to(dtype)
    assert not x.is_contiguous() and not a.is_contiguous() and not b.is_contiguous() and not dy.is_contiguous()
    actual = forward_backward(lora_linear, x, w, bias, a, b, 2.0, dy)
    eager = forward_backward(lora_pattern, x, w, bias, a, b, 2.0, dy)
    reference = forward_backward(lora_pattern, x.double(), w.double(), bias.double(), a.double(), b.double(), 2.0,
                                 dy.double())
    for name, got, e, ref in zip(("y", "dx", "da", "db"), actual, eager, reference):
        assert_close(name, got, e, ref)


@pytest.mark.parametrize("n", [1, 45])
def test_expanded_cotangent(n, device):
    # y.sum().backward() hands the backward a stride-0 dy.
    x, w, bias, a, b, _ = cast_inputs(make_inputs((37, 70), n, 16, device=device), torch.float32, torch.float32)
    grads = []
    for fn in (lora_linear, lora_pattern):
        leaves = [t.detach().requires_grad_(True) for t in (x, a, b)]
        fn(leaves[0], w, bias, leaves[1], leaves[2], 2.0).sum().backward()
        grads.append([t.grad for t in leaves])
    for name, got, want in zip(("dx", "da", "db"), *grads):
        torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}")


def test_one_dimensional_x(device):
    masters = make_inputs((70,), 45, 16, bias=True, device=device)
    y, dx, _, _ = check_against_pattern(masters, torch.float32, torch.float32, 2.0)
    assert y.shape == (45,) and dx.shape == (70,)


def test_zero_rows(device):
    x = torch.randn(0, 70, device=device, requires_grad=True)
    w, a = torch.randn(45, 70, device=device), torch.randn(16, 70, device=device, requires_grad=True)
    b = torch.randn(45, 16, device=device, requires_grad=True)
    y = lora_linear(x, w, None, a, b, 2.0)
    assert y.shape == (0, 45)
    y.sum().backward()
    assert x.grad.shape == (0, 70) and not a.grad.any() and not b.grad.any()


# ---------------------------------------------------------------------------------------------------
# Frozen base, input errors
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("trainable", ["weight", "bias"])
def test_trainable_base_raises_in_backward(trainable, device):
    masters = make_inputs((3, 16), 45, 5, bias=True, device=device)
    x, w, bias, a, b, dy = cast_inputs(masters, torch.float32, torch.float32)
    (w if trainable == "weight" else bias).requires_grad_(True)
    a.requires_grad_(True)
    y = lora_linear(x, w, bias, a, b, 2.0)  # the forward does not know yet whether a gradient is wanted
    with pytest.raises(RuntimeError, match=r"base weight and bias must be frozen"):
        y.backward(dy)


def _bad(device, x=(3, 16), w=(45, 16), bias=None, a=(5, 16), b=(45, 5), *, dtype=torch.float32, w_dtype=None,
         bias_dtype=None, a_dtype=torch.float32, b_dtype=None):
    """Inputs of the given shapes and dtypes (each defaults to a consistent one) on ``device``."""
    def make(shape, dt):
        if dt.is_floating_point:
            return torch.randn(shape, device=device).to(dt)
        return torch.randint(0, 3, shape, dtype=dt, device=device)
    return (make(x, dtype), make(w, w_dtype or dtype), None if bias is None else make(bias, bias_dtype or dtype),
            make(a, a_dtype), make(b, b_dtype or a_dtype))


BAD_INPUTS = [
    pytest.param(lambda d: _bad(d, w=(45, 17)), ValueError, r"shapes do not chain: x \[\.\.\., 16\], w \(45, 17\)",
                 id="w-other-K"),
    pytest.param(lambda d: _bad(d, a=(5, 17)), ValueError, r"shapes do not chain.*a \(5, 17\)", id="a-other-K"),
    pytest.param(lambda d: _bad(d, b=(44, 5)), ValueError, r"shapes do not chain.*b \(44, 5\)", id="b-other-N"),
    pytest.param(lambda d: _bad(d, b=(45, 4)), ValueError, r"shapes do not chain.*a \(5, 16\), b \(45, 4\)",
                 id="b-other-rank"),
    pytest.param(lambda d: _bad(d, w=(45, 16, 1)), ValueError, r"w \[N, K\].*got \(3, 16\), \(45, 16, 1\)", id="w-3d"),
    pytest.param(lambda d: _bad(d, x=()), ValueError, r"x must be \[\.\.\., K\]", id="x-0d"),
    pytest.param(lambda d: _bad(d, bias=(44,)), ValueError, r"bias must be \[45\], got \(44,\)", id="bias-other-N"),
    pytest.param(lambda d: _bad(d, w_dtype=torch.bfloat16), TypeError,
                 r"x, w \(and bias\) must share .*got torch.float32, torch.bfloat16", id="w-other-dtype"),
    pytest.param(lambda d: _bad(d, bias=(45,), bias_dtype=torch.bfloat16), TypeError,
                 r"must share .*got torch.float32, torch.float32, torch.bfloat16", id="bias-other-dtype"),
    pytest.param(lambda d: _bad(d, dtype=torch.float64), TypeError, r"must share one of .*got torch.float64",
                 id="x-float64"),
    pytest.param(lambda d: _bad(d, dtype=torch.int64), TypeError, r"must share one of .*got torch.int64", id="x-int64"),
    pytest.param(lambda d: _bad(d, b_dtype=torch.bfloat16), TypeError,
                 r"a and b must share .*got torch.float32 and torch.bfloat16", id="a-b-other-dtypes"),
    pytest.param(lambda d: _bad(d, a_dtype=torch.float64), TypeError,
                 r"a and b must share one of .*got torch.float64 and torch.float64", id="adapter-float64"),
]


@pytest.mark.parametrize("via", ["function", "torch.ops"])
@pytest.mark.parametrize("make,error,message", BAD_INPUTS)
def test_input_errors_name_the_problem(make, error, message, via, device):
    x, w, bias, a, b = make(device)
    register()
    op = lora_linear if via == "function" else torch.ops.sloth.lora_linear
    with pytest.raises(error, match=message):
        op(x, w, bias, a, b, 2.0)


# ---------------------------------------------------------------------------------------------------
# torch.library registration
# ---------------------------------------------------------------------------------------------------

OPCHECK_CASES = [
    pytest.param((37, 70), 45, 16, False, torch.float32, torch.float32, id="M37-K70-N45-r16-fp32"),
    pytest.param((2, 5, 16), 45, 5, True, torch.bfloat16, torch.float32, id="B2-T5-K16-N45-r5-bias-bf16-adapter-fp32"),
    pytest.param((3, 70), 1, 33, True, torch.bfloat16, torch.bfloat16, id="M3-K70-N1-r33-bias-bf16"),
]


@pytest.mark.parametrize("x_shape,n,r,bias,dtype,adapter_dtype", OPCHECK_CASES)
def test_opcheck_forward(x_shape, n, r, bias, dtype, adapter_dtype, device):
    register()
    x, w, b_, a, b, _ = cast_inputs(make_inputs(x_shape, n, r, bias=bias, device=device), dtype, adapter_dtype)
    for t in (x, a, b):
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.sloth.lora_linear.default, (x, w, b_, a, b, 2.0))


@pytest.mark.parametrize("need_dx", [True, False], ids=["with-dx", "without-dx"])
@pytest.mark.parametrize("x_shape,n,r,bias,dtype,adapter_dtype", OPCHECK_CASES)
def test_opcheck_backward(x_shape, n, r, bias, dtype, adapter_dtype, need_dx, device):
    # The backward op has no autograd of its own (no double backward), so its inputs need no grad.
    register()
    x, w, b_, a, b, dy = cast_inputs(make_inputs(x_shape, n, r, bias=bias, device=device), dtype, adapter_dtype)
    _, h = torch.ops.sloth.lora_linear(x, w, b_, a, b, 2.0)
    torch.library.opcheck(torch.ops.sloth.lora_linear_backward.default, (dy, x, w, a, b, h, 2.0, need_dx))


def test_backward_op_with_a_non_contiguous_h(device):
    # The op's own forward always saves a contiguous h; the registered backward op accepts any layout.
    register()
    x, w, _, a, b, dy = cast_inputs(make_inputs((37, 70), 45, 16, device=device), torch.float32, torch.float32)
    _, h = torch.ops.sloth.lora_linear(x, w, None, a, b, 2.0)
    want = torch.ops.sloth.lora_linear_backward(dy, x, w, a, b, h, 2.0, True)
    got = torch.ops.sloth.lora_linear_backward(dy, x, w, a, b, LAYOUTS["transposed"](h), 2.0, True)
    for name, g, e in zip(("dx", "da", "db"), got, want):
        torch.testing.assert_close(g, e, msg=lambda m: f"{name}: {m}")


def test_register_is_idempotent():
    register()
    register()
    assert hasattr(torch.ops.sloth, "lora_linear") and hasattr(torch.ops.sloth, "lora_linear_backward")


def test_grad_splits_are_added_in_the_launch_in_split_order(monkeypatch, device):
    """The weight-gradient kernel splits M over programs; the last program of each tile adds the splits'
    partials in split order: the result is the fp64 product to fp32 rounding, the same bits on every run, the
    shared counters are zero again after each launch (so the next launch may reuse them), and too few
    counters are refused."""
    if not lowering.use_triton(torch.empty(0, device=device)):
        pytest.skip("no Triton here")
    g = torch.Generator().manual_seed(5)
    u, x = torch.randn(1100, 21, generator=g).to(device), torch.randn(1100, 300, generator=g).to(device, torch.bfloat16)
    u2 = torch.randn(1100, 21, generator=g).to(device)
    x2 = torch.randn(1100, 45, generator=g).to(device, torch.bfloat16)
    problems = [(u, x, False), (u2, x2, True)]
    counters = lowering.grad_counters([[300, 45]], 1100, u.device)
    launches = record_launches(monkeypatch, lowering, "_lora_grad_kernel")
    first = lowering._grads(problems, -0.75, counters)
    assert launches[0][1][1] > 1, launches  # the grid's second dimension: row splits
    assert lowering.grad_counters([[300, 45]], 256, u.device).numel() == 1  # no splits: nothing to count
    assert not counters.any()
    again = lowering._grads(problems, -0.75, counters)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(first, again))
    want = [-0.75 * (u.double().t() @ x.double()), -0.75 * (u2.double().t() @ x2.double()).t()]
    # (on a GPU the programs run at once: the same bits twice and zeroed counters then also say no race)
    for got, ref in zip(first, want):
        torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=1e-5)
    with pytest.raises(ValueError, match="split counters"):
        lowering._grads(problems, 1.0, counters[:2])



def test_backward_grad_launches_share_the_devices_counter_buffer(monkeypatch, device):
    """With a shared counter buffer made for the device (on a GPU, by the LoRA pass when it compiles), every
    backward's row-split launches count on it instead of a fresh zeroed one: the same bits as without it, the
    buffer zero again after each backward, and a need past its size served by a fresh buffer."""
    if not lowering.use_triton(torch.empty(0, device=device)):
        pytest.skip("no Triton here")
    monkeypatch.setitem(lowering.GRAD_CONFIG, "block_m", 16)  # row splits at a size the interpreter runs quickly
    monkeypatch.setitem(lowering.GRAD_CONFIG, "block_k", 16)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    x, w, _, a, b, dy = make_inputs((140, 70), 45, 16, device=device)
    x, w, dy = (t.to(torch.bfloat16) for t in (x, w, dy))
    h = torch.randn(140, 16, generator=torch.Generator().manual_seed(3)).to(device)
    fresh = lowering.lora_backward(dy, x, w, a, b, h, 1.5, True)

    shared = torch.zeros(64, dtype=torch.int32, device=dev)
    monkeypatch.setitem(lowering._COUNTER_BUFFERS, dev, shared)
    seen = []
    kernel = lowering._lora_grad_kernel

    class _Seen:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append((grid, any(arg is shared for arg in args)))
                return kernel[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(lowering, "_lora_grad_kernel", _Seen())
    first = lowering.lora_backward(dy, x, w, a, b, h, 1.5, True)
    again = lowering.lora_backward(dy, x, w, a, b, h, 1.5, True)
    assert seen and all(grid[1] > 1 and used for grid, used in seen), seen  # split, and on the shared buffer
    assert not shared.any()
    for got in (first, again):
        assert all(torch.equal(p, q) for p, q in zip(got, fresh))
    assert lowering._zeroed_counters(65, dev) is not shared and lowering._zeroed_counters(64, dev) is shared


def test_counter_buffer_is_made_for_gpus_only_and_once(monkeypatch):
    monkeypatch.setattr(lowering, "_COUNTER_BUFFERS", {})  # whatever earlier tests made stays out of this one
    lowering.make_counter_buffer(torch.device("cpu"))  # the interpreter needs none: a fill is no launch there
    assert not lowering._COUNTER_BUFFERS
    if not torch.cuda.is_available():
        return
    here = torch.device("cuda", torch.cuda.current_device())
    lowering.make_counter_buffer(torch.device("cuda"))
    made = lowering._COUNTER_BUFFERS[here]
    lowering.make_counter_buffer(here)
    assert lowering._COUNTER_BUFFERS[here] is made
    assert made.numel() == lowering.COUNTER_BUFFER_SIZE and not made.any()


def test_shared_counters_only_on_the_default_stream(monkeypatch):
    """A side stream (its kernels may run beside the default stream's), graph capture and a need past the buffer's
    size get a fresh zeroed buffer, never the shared one."""
    monkeypatch.setattr(lowering, "_COUNTER_BUFFERS", {})
    cpu = torch.device("cpu")
    shared = torch.zeros(64, dtype=torch.int32)
    lowering._COUNTER_BUFFERS[cpu] = shared
    assert lowering._zeroed_counters(8, cpu) is shared
    fresh = lowering._zeroed_counters(65, cpu)
    assert fresh is not shared and fresh.numel() == 65 and not fresh.any()
    if not torch.cuda.is_available():
        return
    here = torch.device("cuda", torch.cuda.current_device())
    lowering.make_counter_buffer(here)
    gpu_shared = lowering._COUNTER_BUFFERS[here]
    assert lowering._zeroed_counters(8, here) is gpu_shared
    with torch.cuda.stream(torch.cuda.Stream()):
        assert lowering._zeroed_counters(8, here) is not gpu_shared
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lowering._zeroed_counters(8, here)
    assert captured is not gpu_shared


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs 4.3 GB of GPU memory and a GPU's speed")
def test_up_add_rows_past_two_to_the_31_elements():
    """y[M, N] with M * N > 2^31 (150,000 rows of 14,336): the last rows' offsets need 64 bits."""
    rows, cols, rank = 150_000, 14_336, 16
    y = torch.zeros(rows, cols, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(rows, rank, device="cuda", generator=g)
    q = torch.randn(rank, cols, device="cuda", generator=g)
    lowering._up_add_(y, h, q, 0.5)
    for part in (slice(0, 64), slice(rows - 64, rows)):
        want = (0.5 * (h[part].double() @ q.double())).to(torch.bfloat16)
        torch.testing.assert_close(y[part].float(), want.float(), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------------
# The PyTorch fallback (CPU without the interpreter, other devices)
# ---------------------------------------------------------------------------------------------------

FALLBACK_CASES = [pytest.param(x_shape, n, r, dt, adt, id=f"{shape_id(x_shape, n, r, True, 2.0)}-{DTYPE_IDS[dt]}-"
                               f"adapter-{DTYPE_IDS[adt]}")
                  for x_shape, n, r in [((37, 70), 45, 16), ((2, 5, 16), 1, 33)]
                  for dt, adt in DTYPE_PAIRS]


@pytest.mark.parametrize("x_shape,n,r,dtype,adapter_dtype", FALLBACK_CASES)
def test_fallback_matches_triton(x_shape, n, r, dtype, adapter_dtype, device):
    masters = make_inputs(x_shape, n, r, bias=True, device=device)
    args = cast_inputs(masters, dtype, adapter_dtype)
    triton_out = forward_backward(lora_linear, *args[:5], 2.0, args[5])
    with pytest.MonkeyPatch.context() as mp:
        force_fallback(mp, lowering, *KERNELS)
        fallback_out = forward_backward(lora_linear, *args[:5], 2.0, args[5])
    for name, got, want in zip(("y", "dx", "da", "db"), fallback_out, triton_out):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        # Both sum in fp32 and round once, in other orders (row splits, a factor split into bf16 parts): fp32
        # results a few ulps apart, 16-bit ones one ulp.
        tol = dict(rtol=1e-5, atol=1e-5) if got.dtype == torch.float32 else {}
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("need_dx", [True, False], ids=["with-dx", "without-dx"])
def test_fallback_is_used_when_triton_cannot_run(monkeypatch, need_dx, device):
    force_fallback(monkeypatch, lowering, *KERNELS)
    masters = make_inputs((37, 70), 45, 16, bias=True, device=device)
    check_against_pattern(masters, torch.bfloat16, torch.float32, 2.0, need_dx)
    check_against_pattern(masters, torch.bfloat16, torch.bfloat16, 0.5, need_dx)


def test_fallback_output_layout_matches_fake(monkeypatch, device):
    force_fallback(monkeypatch, lowering, *KERNELS)
    register()
    masters = make_inputs((2, 5, 16), 45, 5, bias=True, device=device)
    x, w, bias, a, b, dy = cast_inputs(masters, torch.bfloat16, torch.float32)
    x_t = LAYOUTS["transposed"](x.reshape(10, 16))
    torch.library.opcheck(torch.ops.sloth.lora_linear.default, (x_t, w, bias, a, b, 2.0),
                          test_utils=("test_faketensor",))
    _, h = torch.ops.sloth.lora_linear(x, w, bias, a, b, 2.0)
    for need_dx in (True, False):
        torch.library.opcheck(torch.ops.sloth.lora_linear_backward.default, (dy, x, w, a, b, h, 2.0, need_dx),
                              test_utils=("test_faketensor",))


@pytest.mark.parametrize("rank", [1, 16, 32, 64, 128])
@pytest.mark.parametrize("x_dtype,factor_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                                  (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_down_kernel_tiles_fit_the_shared_memory_budget(rank, x_dtype, factor_dtype):
    # The split factor tile grows with the rank; at the swept 256-wide K tiles r = 32 would need 295 KB of
    # shared memory on an H200 (232 KB a block). The launcher shrinks block_k until the tiles fit.
    x, p = torch.empty(4, 4096, dtype=x_dtype), torch.empty(4096, rank, dtype=factor_dtype)
    mode, block_r = lowering._mode(x, p), lowering._block_r(rank)
    config = lowering.DOWN_CONFIG
    factor_bytes = 4 if mode == lowering._TF32X3.value else 2  # the split factor is bf16
    block_k = lowering._down_block_k(config, mode, block_r, x.element_size(), factor_bytes, 4096)
    cols = 4 * block_r if mode == lowering._SPLIT_BF16.value else block_r
    used = lowering.down_smem_bytes(config["block_m"], block_k, cols, x.element_size(), factor_bytes,
                                    config["num_stages"])
    assert block_k >= 16 and used <= lowering._DOWN_SMEM_BUDGET, (block_k, used)
    if rank <= 16 and x_dtype == torch.bfloat16:
        assert block_k == config["block_k"]  # the swept setting itself where it was measured
