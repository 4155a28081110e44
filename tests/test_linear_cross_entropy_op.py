"""The fused op ``sloth.lowering.linear_cross_entropy``: loss, dx, dw and dbias against the pattern function.

Oracle (STYLE.md, habit 5): ``patterns/cross_entropy.py``'s ``linear_cross_entropy_pattern`` run eagerly at
the tested dtype is "eager"; the same function in float64 end to end is the reference (``StayFloat64``
turns its ``.float()`` upcast into a no-op on float64 tensors, as in tests/test_rms_norm_op.py).
"""
from __future__ import annotations

import math

import pytest
import torch

import sloth.lowering.linear_cross_entropy as lowering
from sloth.lowering.linear_cross_entropy import chunk_rows, linear_cross_entropy, register
from sloth.patterns.cross_entropy import linear_cross_entropy_pattern
from tolerance import assert_close
from op_checks import force_fallback, RecordOps, StayFloat64

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
REDUCTIONS = ["mean", "sum", "none"]


def make_inputs(n: int, h: int, v: int, *, bias: bool = False, ignored: str = "none", seed: int = 0):
    """fp32 masters for x, w, b and int64 labels; ``ignored``: "none", "some" (every third row), "all"."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) / math.sqrt(h) * 2.0  # logits of std ~2: a peaked softmax
    b = torch.randn(v, generator=g) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    if ignored == "some":
        labels[::3] = -100
    elif ignored == "all":
        labels[:] = -100
    return x, w, b, labels


def forward_backward(fn, x, w, b, dy_seed: int = 1, weight_grad: bool = True):
    """(loss, dx, dw, db) of ``fn(x, w, b)`` with a seeded cotangent; dw/db None when not trained."""
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(weight_grad)
    b = b.detach().requires_grad_(weight_grad) if b is not None else None
    loss = fn(x, w, b)
    dy = torch.randn(loss.shape, generator=torch.Generator().manual_seed(dy_seed)).to(loss.device, loss.dtype)
    wrt = [x] + ([w] if weight_grad else []) + ([b] if (b is not None and weight_grad) else [])
    grads = list(torch.autograd.grad(loss, wrt, dy))
    dx = grads.pop(0)
    dw = grads.pop(0) if weight_grad else None
    db = grads.pop(0) if (b is not None and weight_grad) else None
    return loss.detach(), dx, dw, db


def fused(labels, logits_given: bool = False, **opts):
    """The op as a function of (x, w, b); with ``logits_given`` it also receives ``F.linear(x, w, b)``, computed
    in the graph beside it as a model that returns its logits does (they get no gradient from the loss)."""
    def fn(a, c, d):
        logits = torch.nn.functional.linear(a, c, d) if logits_given else None
        return linear_cross_entropy(a, c, d, labels, logits=logits, **opts)
    return fn


def check_against_pattern(x32, w32, b32, labels, dtype, logits_given: bool = False, **opts):
    x, w = x32.to(dtype), w32.to(dtype)
    b = b32.to(dtype) if b32 is not None else None
    actual = forward_backward(fused(labels, logits_given, **opts), x, w, b)
    eager = forward_backward(lambda a, c, d: linear_cross_entropy_pattern(a, c, d, labels, **opts), x, w, b)
    with StayFloat64():
        reference = forward_backward(lambda a, c, d: linear_cross_entropy_pattern(a, c, d, labels, **opts),
                                     x.double(), w.double(), None if b is None else b.double())
    assert reference[0].dtype == torch.float64
    for name, a, e, r in zip(("loss", "dx", "dw", "db"), actual, eager, reference):
        if e is None:
            assert a is None, f"{name}: computed a gradient the pattern does not have"
            continue
        # A scalar loss cannot carry the 2x rule (eager's fp32 sum can land within 1e-9 of fp64 by luck, as in
        # tests/test_models.py), so losses get two units of fp32 roundoff of their size on top of the atol.
        atol = None
        if name == "loss" and r.numel():
            atol = 1e-5 + 2 * torch.finfo(torch.float32).eps * r.abs().max().item()
        assert_close(name, a, e, r, atol=atol)
    return actual


# ---------------------------------------------------------------------------------------------------
# Shapes x dtypes x reductions
# ---------------------------------------------------------------------------------------------------

SHAPES = [(n, v) for v in (1, 7, 1000) for n in (1, 3, 257)]
CASES = [pytest.param(n, v, dtype, red, id=f"N{n}-V{v}-{DTYPE_IDS[dtype]}-{red}")
         for n, v in SHAPES for dtype in (torch.float32, torch.bfloat16) for red in REDUCTIONS
         # 257 tokens (one interpreted program per token) only where it adds coverage, keeping the file under 40 s
         if n != 257 or red == "mean" or (red == "none" and v == 7)]


@pytest.mark.parametrize("n,v,dtype,reduction", CASES)
def test_loss_and_gradients_match_pattern(n, v, dtype, reduction):
    x, w, b, labels = make_inputs(n, 24, v)
    loss, dx, dw, _ = check_against_pattern(x, w, b, labels, dtype, reduction=reduction)
    assert loss.dtype == torch.float32 and loss.shape == ((n,) if reduction == "none" else ())
    assert dx.dtype == dtype and dw.dtype == dtype and dw.shape == (v, 24)


OPTIONS = {
    "bias": dict(bias=True),
    "ignore-some": dict(ignored="some"),
    "ignore-some-other-index": dict(ignored="some", ignore_index=-1),
    "label-smoothing": dict(ignored="some", label_smoothing=0.1),
    "softcap": dict(softcap=3.0),
    "logit-scale": dict(logit_scale=0.25),
    "everything": dict(bias=True, ignored="some", label_smoothing=0.2, softcap=5.0, logit_scale=1.7),
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_match_pattern(option, dtype, reduction):
    spec = dict(OPTIONS[option])
    bias, ignored = spec.pop("bias", False), spec.pop("ignored", "none")
    x, w, b, labels = make_inputs(37, 24, 100, bias=bias, ignored=ignored)
    if spec.get("ignore_index") == -1:
        labels[labels == -100] = -1
    check_against_pattern(x, w, b, labels, dtype, reduction=reduction, **spec)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_vocabulary_few_tokens(dtype):
    x, w, b, labels = make_inputs(3, 16, 32001, ignored="some")
    check_against_pattern(x, w, b, labels, dtype, reduction="mean", softcap=30.0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_rows_ignored_matches_pytorch(dtype, reduction):
    x, w, b, labels = make_inputs(5, 16, 11, ignored="all")
    x, w = x.to(dtype), w.to(dtype)
    ours = forward_backward(lambda a, c, d: linear_cross_entropy(a, c, d, labels, reduction=reduction), x, w, b)
    eager = forward_backward(lambda a, c, d: linear_cross_entropy_pattern(a, c, d, labels, reduction=reduction),
                             x, w, b)
    # 'mean' over no rows is 0/0 = nan in PyTorch, with zero gradients; 'sum' and 'none' are zeros.
    torch.testing.assert_close(ours[0], eager[0], equal_nan=True)
    assert ours[0].isnan().all().item() == (reduction == "mean")
    for name, a, e in zip(("dx", "dw"), ours[1:3], eager[1:3]):
        assert not a.any(), f"{name} should be zero"
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", ["plain", "everything"])
def test_given_logits_match_pattern(option, dtype, reduction):
    """The loss read from the logits the graph returns anyway: the same values and gradients as recomputing."""
    spec = dict(OPTIONS.get(option, {}))
    bias, ignored = spec.pop("bias", False), spec.pop("ignored", "none")
    x, w, b, labels = make_inputs(37, 24, 100, bias=bias, ignored=ignored)
    check_against_pattern(x, w, b, labels, dtype, logits_given=True, reduction=reduction, **spec)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_given_logits_are_read_not_recomputed_nor_written(reduction):
    # Several chunks, so the gradient buffer is reused; the logits must come back unchanged (they are the
    # model's output) and no matmul may produce a logits tile, in the forward or in the backward.
    x, w, b, labels = make_inputs(67, 16, 300, bias=True, ignored="some")
    x.requires_grad_(True)
    w.requires_grad_(True)
    with torch.no_grad():
        logits = torch.nn.functional.linear(x, w, b)
    before = logits.clone()
    with pytest.MonkeyPatch.context() as mp, RecordOps() as rec:
        mp.setattr(lowering, "_TILE_ELEMENTS", 300 * 2)
        mp.setattr(lowering, "_TILE_ELEMENTS_WITH_DW", 300 * 2)
        loss = linear_cross_entropy(x, w, b, labels, reduction=reduction, logits=logits)
        loss.backward(torch.ones_like(loss))
    matmuls = [f for f, _, out in rec.calls if f in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
               and out.shape[-1] == 300]
    assert not matmuls, f"{len(matmuls)} matmul(s) recomputed logits tiles"
    torch.testing.assert_close(logits, before, rtol=0, atol=0)
    expect = torch.autograd.grad(linear_cross_entropy_pattern(x, w, b, labels, reduction=reduction).sum(), (x, w))
    torch.testing.assert_close(x.grad, expect[0])
    torch.testing.assert_close(w.grad, expect[1])


def test_given_logits_of_the_wrong_shape_raise():
    x, w, _, labels = make_inputs(5, 8, 13)
    with pytest.raises(ValueError, match=r"logits must be \[5, 13\]"):
        linear_cross_entropy(x, w, None, labels, logits=torch.zeros(5, 12))


def test_chunking_splits_the_tokens():
    """With the tile budget lowered, every shape runs through several chunks; results are unchanged."""
    x, w, b, labels = make_inputs(67, 16, 300, bias=True, ignored="some")
    whole = check_against_pattern(x, w, b, labels, torch.float32, label_smoothing=0.1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lowering, "_TILE_ELEMENTS", 300 * 2)
        mp.setattr(lowering, "_TILE_ELEMENTS_WITH_DW", 300 * 2)
        assert chunk_rows(67, 300, 16) == 2 and chunk_rows(67, 300, 16, weight_grad=True) == 2
        chunked = check_against_pattern(x, w, b, labels, torch.float32, label_smoothing=0.1)
    for name, a, c in zip(("loss", "dx", "dw", "db"), whole, chunked):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_chunk_rows_from_shapes():
    assert chunk_rows(4096, 128256, 4096) == 512  # the tile budget: 512 x 128256 < 2^26 elements
    assert chunk_rows(4096, 128256, 4096, weight_grad=True) == 2048  # 2^28 with the dw accumulator
    assert chunk_rows(16384, 32000, 4096) == 2048
    assert chunk_rows(1, 7, 24) == 1 and chunk_rows(257, 7, 24) == 512  # never more than N rounded up


# ---------------------------------------------------------------------------------------------------
# Where the gradients are computed
# ---------------------------------------------------------------------------------------------------

def _sloth_calls(rec):
    return [(f, a, o) for f, a, o in rec.calls if "sloth" in str(f)]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradients_in_forward_backward_only_scales(reduction):
    x, w, _, labels = make_inputs(9, 16, 40)
    x.requires_grad_(True)
    w.requires_grad_(True)
    loss = linear_cross_entropy(x, w, None, labels, reduction=reduction)
    with RecordOps() as rec:
        loss.backward(torch.tensor(3.0))
    assert not _sloth_calls(rec), "mean/sum must not recompute in the backward"
    expect = torch.autograd.grad(3.0 * linear_cross_entropy_pattern(x, w, None, labels, reduction=reduction),
                                 (x, w))
    torch.testing.assert_close(x.grad, expect[0])
    torch.testing.assert_close(w.grad, expect[1])


def test_none_reduction_recomputes_in_backward():
    x, w, _, labels = make_inputs(9, 16, 40)
    x.requires_grad_(True)
    w.requires_grad_(True)
    loss = linear_cross_entropy(x, w, None, labels, reduction="none")
    with RecordOps() as rec:
        loss.backward(torch.arange(9.0))
    assert [f for f, _, _ in _sloth_calls(rec)] == [torch.ops.sloth.linear_cross_entropy_backward.default]


@pytest.mark.parametrize("dtype", DTYPES)
def test_frozen_weight_skips_dw(dtype):
    x32, w32, _, labels = make_inputs(13, 16, 40)
    x = x32.to(dtype).requires_grad_(True)
    w = w32.to(dtype)
    with RecordOps() as rec:
        linear_cross_entropy(x, w, None, labels).backward()
    (_, args, (_, dx, dw, _)), = _sloth_calls(rec)
    assert args[-1] is False and dw.numel() == 0 and dx.shape == x.shape
    assert w.grad is None
    _, dx_ours, _, _ = forward_backward(lambda a, c, d: linear_cross_entropy(a, c, d, labels),
                                        x32.to(dtype), w, None, weight_grad=False)
    _, dx_e, _, _ = forward_backward(lambda a, c, d: linear_cross_entropy_pattern(a, c, d, labels),
                                     x32.to(dtype), w, None, weight_grad=False)
    with StayFloat64():
        _, dx_r, _, _ = forward_backward(lambda a, c, d: linear_cross_entropy_pattern(a, c, d, labels),
                                         x32.to(dtype).double(), w.double(), None, weight_grad=False)
    assert_close("dx", dx_ours, dx_e, dx_r)


def test_no_grad_computes_the_loss_only():
    x, w, _, labels = make_inputs(13, 16, 40)
    with torch.no_grad(), RecordOps() as rec:
        loss = linear_cross_entropy(x.requires_grad_(True), w.requires_grad_(True), None, labels)
    (_, _, (_, dx, dw, db)), = _sloth_calls(rec)
    assert dx.numel() == dw.numel() == db.numel() == 0
    torch.testing.assert_close(loss, linear_cross_entropy_pattern(x.detach(), w.detach(), None, labels))


# ---------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("logits_given", [False, True], ids=["recomputed", "logits-given"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_opcheck_forward(reduction, logits_given):
    register()
    x, w, b, labels = make_inputs(5, 8, 13, bias=True, ignored="some")
    logits = torch.nn.functional.linear(x, w, b) if logits_given else None
    torch.library.opcheck(torch.ops.sloth.linear_cross_entropy.default,
                          (x.requires_grad_(True), w.requires_grad_(True), b.requires_grad_(True), labels, -100,
                           reduction, 2.0, 0.5, 0.1, True, True, logits))


def test_opcheck_backward():
    register()
    x, w, b, labels = make_inputs(5, 8, 13, bias=True, ignored="some")
    torch.library.opcheck(torch.ops.sloth.linear_cross_entropy_backward.default,
                          (torch.randn(5), x, w, b, labels, -100, "none", 0.0, 1.0, 0.0, True))


def test_bad_inputs_raise_clear_errors():
    x, w, _, labels = make_inputs(5, 8, 13)
    with pytest.raises(ValueError, match="labels must be int64"):
        linear_cross_entropy(x, w, None, labels.int())
    with pytest.raises(TypeError, match="share one of"):
        linear_cross_entropy(x.double(), w.double(), None, labels)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, None, labels, reduction="batchmean")


# ---------------------------------------------------------------------------------------------------
# The PyTorch fallback (CPU without the interpreter, other devices)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_matches_triton(dtype, reduction):
    x32, w32, b32, labels = make_inputs(37, 16, 100, bias=True, ignored="some")
    x, w, b = x32.to(dtype), w32.to(dtype), b32.to(dtype)
    opts = dict(reduction=reduction, softcap=4.0, logit_scale=0.8, label_smoothing=0.1)
    fn = lambda a, c, d: linear_cross_entropy(a, c, d, labels, **opts)  # noqa: E731
    triton_out = forward_backward(fn, x, w, b)
    with pytest.MonkeyPatch.context() as mp:
        force_fallback(mp, lowering, "_lce_rows_kernel")
        fallback_out = forward_backward(fn, x, w, b)
    for name, a, c in zip(("loss", "dx", "dw", "db"), fallback_out, triton_out):
        assert a.dtype == c.dtype and a.shape == c.shape, name
        # In bf16 a gradient-tile element that rounds the other way (the two tanh/exp differ in the last
        # fp32 bit) moves a cancelling sum in dx by a few of its ulps: 1% of the tensor's size covers it.
        atol = 1e-2 * c.abs().max().item() if dtype == torch.bfloat16 else None
        torch.testing.assert_close(a, c, atol=atol, rtol=1.6e-2 if atol else None,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("logits_given", [False, True], ids=["recomputed", "logits-given"])
def test_fallback_is_used_when_triton_cannot_run(monkeypatch, logits_given):
    force_fallback(monkeypatch, lowering, "_lce_rows_kernel")
    x, w, b, labels = make_inputs(7, 16, 50, bias=True, ignored="some")
    check_against_pattern(x, w, b, labels, torch.bfloat16, logits_given, softcap=3.0, label_smoothing=0.1)


@pytest.mark.parametrize("reduction,weight_grad,keeps_inputs", [
    ("mean", False, False), ("sum", True, False), ("none", False, True)], ids=["mean-frozen", "sum-trained", "none"])
def test_backward_keeps_the_inputs_only_when_it_recomputes(reduction, weight_grad, keeps_inputs):
    # mean/sum: every gradient is formed in the forward, so x (in a model, the final norm's output), w and
    # the labels are not saved for the backward; 'none' recomputes chunk by chunk and needs them.
    x32, w32, _, labels = make_inputs(13, 24, 37)
    x, w = x32.requires_grad_(), w32.requires_grad_(weight_grad)
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.data_ptr()) or t, lambda t: t):
        loss = linear_cross_entropy(x, w, None, labels, reduction=reduction)
    assert (x.data_ptr() in saved) == keeps_inputs and (w.data_ptr() in saved) == keeps_inputs, saved
    loss.sum().backward()  # and the backward still runs on what was kept
    assert x.grad is not None and (w.grad is not None) == weight_grad


# ---------------------------------------------------------------------------------------------------
# Labels outside [0, V) that are not ignore_index (eager raises IndexError)
# ---------------------------------------------------------------------------------------------------

BAD_LABELS = [pytest.param(lambda v: v, id="label-V"), pytest.param(lambda v: -5, id="label-minus-5")]


def _labels_with_one_bad(v: int, bad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels with row 2 set to ``bad`` and rows 0 and 4 ignored, the same labels with row 2 ignored too)."""
    labels = torch.tensor([-100, 3, bad, v - 1, -100, 0, 5])
    ignored = labels.clone()
    ignored[2] = -100
    return labels, ignored


@pytest.mark.parametrize("logits_given", [False, True], ids=["recomputed", "logits-given"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bad", BAD_LABELS)
def test_out_of_range_label_makes_the_kernel_loss_nan(bad, reduction, logits_given, device):
    """The Triton kernel (interpreted on the CPU, compiled on a GPU) cannot raise without a host sync: the offending
    row's loss and its gradient are NaN, so 'mean' and 'sum' are NaN, never a finite loss; every other row is what it
    is with the offending row ignored (for 'mean' up to the count, which includes the offending row)."""
    x, w, b, _ = (t.to(device) for t in make_inputs(7, 16, 13, bias=True))
    labels, ignored = (t.to(device) for t in _labels_with_one_bad(13, bad(13)))
    opts = dict(reduction=reduction, softcap=3.0, label_smoothing=0.1)
    loss, dx, dw, db = forward_backward(fused(labels, logits_given, **opts), x, w, b)
    want_loss, want_dx, _, _ = forward_backward(fused(ignored, logits_given, **opts), x, w, b)
    rows = torch.arange(7, device=device) != 2
    if reduction == "none":
        assert loss[2].isnan() and not loss[rows].isnan().any()
        assert (loss[[0, 4]] == 0).all(), "ignored rows must stay 0"
        torch.testing.assert_close(loss[rows], want_loss[rows])
    else:
        assert loss.isnan(), loss
    scale = 4 / 5 if reduction == "mean" else 1.0  # the count is 5 valid rows with the offending one, 4 without
    assert dx[2].isnan().all() and not dx[rows].isnan().any()
    torch.testing.assert_close(dx[rows], want_dx[rows] * scale)
    assert dw.isnan().all() and db.isnan().all(), "dw and db sum over every row, the offending one included"


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bad", BAD_LABELS)
def test_out_of_range_label_raises_on_the_pytorch_reference(monkeypatch, bad, reduction):
    """Where Triton cannot run on CPU tensors, the reference checks the labels (host memory: no sync) and
    raises IndexError, as eager does, in the forward and in the recomputing backward alike."""
    force_fallback(monkeypatch, lowering, "_lce_rows_kernel")
    x, w, b, _ = make_inputs(7, 16, 13, bias=True)
    labels, _ = _labels_with_one_bad(13, bad(13))
    with pytest.raises(IndexError, match="out of bounds"):
        linear_cross_entropy_pattern(x, w, b, labels, reduction=reduction)  # eager
    with pytest.raises(IndexError, match=rf"sloth.linear_cross_entropy: target {bad(13)} is out of bounds"):
        linear_cross_entropy(x, w, b, labels, reduction=reduction)
    with pytest.raises(IndexError, match="out of bounds"):
        lowering._lce_bwd(torch.ones(7), x, w, b, labels, -100, "none", 0.0, 1.0, 0.0, True)


@pytest.mark.parametrize("bad", BAD_LABELS)
def test_out_of_range_label_is_nan_in_the_reference_math(bad):
    """On a device where checking would sync, the reference computes what the kernel does: the offending row's
    loss and gradient tile NaN, ignored rows 0, the others as with the offending row ignored."""
    x, w, _, _ = make_inputs(7, 16, 13)
    labels, ignored = _labels_with_one_bad(13, bad(13))
    logits, a = x @ w.t(), torch.full((7,), 0.5)
    loss, g = lowering._row_loss_and_grad_reference(logits, labels, a, -100, 3.0, 1.0, 0.1)
    want_loss, want_g = lowering._row_loss_and_grad_reference(logits, ignored, a, -100, 3.0, 1.0, 0.1)
    rows = torch.arange(7) != 2
    assert loss[2].isnan() and g[2].isnan().all()
    assert (loss[[0, 4]] == 0).all() and (g[[0, 4]] == 0).all()
    torch.testing.assert_close(loss[rows], want_loss[rows])
    torch.testing.assert_close(g[rows], want_g[rows])
