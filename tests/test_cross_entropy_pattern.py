"""The linear + cross-entropy family pass (``"cross_entropy"``): what it matches (exact counts), what it must
refuse and why, and that the compiled loss and every gradient equal eager under the tolerance rule.

Every case compiles with ``torch.compile(fn, backend="sloth", options={"inner": "aot_eager"})`` and reads
``sloth.last_report()``. "eager" is the same function uncompiled at the tested dtype; the reference is the
same function in float64 (``StayFloat64`` keeps ``.float()`` upcasts from dropping back to fp32).
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sloth
from sloth.patterns.cross_entropy import causal_lm_loss_pattern, linear_cross_entropy_pattern
from sloth.compiler.fx_utils import linear_parts
from tolerance import assert_close, slack
from op_checks import StayFloat64
from pattern_checks import counting_backend, graph_of, seeded

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
H, V = 24, 40


# ---------------------------------------------------------------------------------------------------
# The functions under test: (x [B, T, H], w [V, H], b [V], y [B, T]) -> loss
# ---------------------------------------------------------------------------------------------------

def plain(x, w, b, y):
    return F.cross_entropy(F.linear(x, w).float().view(-1, V), y.view(-1))


def with_bias_sum(x, w, b, y):
    logits = F.linear(x, w, b)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")


def positional_none(x, w, b, y):
    return F.cross_entropy(F.linear(x, w).view(-1, V).float(), y.view(-1).clamp(min=-1), None, None, -1, None, "none",
                           0.1)


def scaled_softcapped(x, w, b, y):  # Gemma 2 after Cohere-style scaling
    logits = F.linear(x, w) * 0.5
    logits = 3.0 * torch.tanh(logits / 3.0)
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1), label_smoothing=0.1)


def divided_softcap_right(x, w, b, y):  # Granite's division, the cap on the right
    logits = F.linear(x, w).float() / 4.0
    logits = torch.tanh(logits / 2.0) * 2.0
    return F.cross_entropy(logits.view(-1, V), y.view(-1))


def rows_2d(x, w, b, y):
    return F.cross_entropy(F.linear(x.view(-1, H), w, b), y.view(-1).clamp(min=3), ignore_index=3)


def hf_loss_mean(x, w, b, y):
    return causal_lm_loss_pattern(x, w, y)


def hf_loss_num_items(x, w, b, y):
    return causal_lm_loss_pattern(x, w, y, torch.tensor(9))


def tied_matmul(x, w, b, y):  # a tied head written by hand
    return F.cross_entropy((x @ w.t()).float().view(-1, V), y.view(-1))


def tied_matmul_T(x, w, b, y):
    return F.cross_entropy(torch.matmul(x, w.T).view(-1, V), y.view(-1), reduction="sum")


def nll_of_log_softmax(x, w, b, y):
    logits = F.linear(x, w, b).float().view(-1, V)
    return F.nll_loss(F.log_softmax(logits, dim=-1), y.view(-1), reduction="sum")


def nll_of_log_softmax_method(x, w, b, y):
    return F.nll_loss(F.linear(x, w).view(-1, V).log_softmax(1), y.view(-1).clamp(min=5), ignore_index=5)


class HeadAndLoss(nn.Module):
    """nn.Linear + nn.CrossEntropyLoss modules."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(H, V, bias=False)
        self.loss = nn.CrossEntropyLoss(ignore_index=-100)

    def forward(self, x, w, b, y):
        return self.loss(self.head(x).float().flatten(0, 1), y.flatten())


def two_heads(x, w, b, y):
    a = F.cross_entropy(F.linear(x, w).float().view(-1, V), y.view(-1))
    return a + F.cross_entropy(F.linear(x * 2.0, w, b).view(-1, V), y.view(-1), reduction="sum")


# Hand-written causal-LM losses shift the logits, not the labels: the same rows of x are read (lowering the slice).

def shifted_slice(x, w, b, y):  # F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
    return F.cross_entropy(F.linear(x, w)[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1))


def shifted_contiguous_upcast_first(x, w, b, y):  # transformers' DefaultCrossEntropyLoss: upcast, then shift
    logits = F.linear(x, w, b).float()
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = y[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1))


def shifted_ignore_index_sum(x, w, b, y):  # ignore_index=-1 (nanoGPT's), the upcast after the shift
    shift_logits = F.linear(x, w)[..., :-1, :].contiguous()
    shift_labels = y.clamp(min=-1)[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)).float(), shift_labels.view(-1),
                           ignore_index=-1, reduction="sum")


def shifted_narrow_softcapped(x, w, b, y):  # Gemma 2's cap after a scale, the shift as a narrow
    logits = 3.0 * torch.tanh(F.linear(x, w) * 0.5 / 3.0)
    return F.cross_entropy(logits.narrow(1, 0, x.shape[1] - 1).flatten(0, 1).float(), y[:, 1:].flatten(),
                           label_smoothing=0.1)


def shifted_flat_rows(x, w, b, y):  # the rows sliced after flattening: logits.view(-1, V)[:-1]
    return F.cross_entropy(F.linear(x, w, b).view(-1, V)[1:], y.view(-1)[:-1], reduction="none")


def shifted_nll(x, w, b, y):
    return F.nll_loss(F.log_softmax(F.linear(x, w)[:, 1:].reshape(-1, V).float(), -1), y[:, :-1].reshape(-1))


def last_position(x, w, b, y):  # one position per sequence: an integer index of the rows
    return F.cross_entropy(F.linear(x, w, b)[:, -1], y[:, -1].clamp(min=0))


def chunked_litgpt(x, w, b, y):  # litgpt's chunked_cross_entropy after logits[..., :-1, :]: a loss per chunk
    logits = F.linear(x, w)[..., :-1, :].reshape(-1, V)
    targets = y[..., 1:].reshape(-1)
    losses = [F.cross_entropy(lc, tc, ignore_index=-100, reduction="none")
              for lc, tc in zip(logits.split(5), targets.split(5))]
    count = (targets != -100).sum()
    return torch.cat(losses).sum() / count.maximum(torch.ones_like(count))


# A slice of the classes reads those rows of the head: (x @ w.T + b)[..., a:b] = x @ w[a:b].T + b[a:b].

def vocabulary_narrowed(x, w, b, y):  # a slice of the classes, not of the rows
    return F.cross_entropy(F.linear(x, w).narrow(-1, 0, V - 4).reshape(-1, V - 4), y.view(-1).clamp(0, V - 5))


def padded_head_softcapped(x, w, b, y):  # karpathy/nanochat: a head padded to a multiple of 64, sliced back, capped
    logits = F.linear(x, w, b)
    logits = logits[..., :V - 3]
    logits = logits.float()
    logits = 15 * torch.tanh(logits / 15)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.clamp(max=V - 4).view(-1), ignore_index=-100)


def rows_and_vocabulary_sliced(x, w, b, y):  # the shift and a slice of the classes in one index
    return F.cross_entropy(F.linear(x, w)[:, :-1, :-1].reshape(-1, V - 1), y[:, 1:].reshape(-1).clamp(0, V - 2))


def vocabulary_range_twice(x, w, b, y):  # classes 3:35, sliced twice, with a bias, the shift in between
    logits = F.linear(x, w, b)[..., 3:].float()[:, 1:]
    return F.cross_entropy(logits[..., :-5].reshape(-1, V - 8), y[:, :-1].clamp(max=V - 9).reshape(-1),
                           reduction="sum")


MATCHES = {
    plain: (1, "mean, ignore_index=-100"),
    with_bias_sum: (1, "sum, ignore_index=-100, bias"),
    positional_none: (1, "none, ignore_index=-1, label_smoothing=0.1"),
    scaled_softcapped: (1, "softcap=3, logit_scale=0.5, label_smoothing=0.1"),
    divided_softcap_right: (1, "softcap=2, logit_scale=0.25"),
    rows_2d: (1, "ignore_index=3, bias"),
    hf_loss_mean: (1, "mean, ignore_index=-100"),
    hf_loss_num_items: (1, "sum, ignore_index=-100"),
    tied_matmul: (1, "mean"),
    tied_matmul_T: (1, "sum"),
    nll_of_log_softmax: (1, "sum, ignore_index=-100, bias"),
    nll_of_log_softmax_method: (1, "mean, ignore_index=5"),
    HeadAndLoss: (1, "mean"),
    two_heads: (2, "ignore_index=-100"),
    shifted_slice: (1, "mean, ignore_index=-100, rows of the logits selected"),
    shifted_contiguous_upcast_first: (1, "mean, ignore_index=-100, bias, rows of the logits selected"),
    shifted_ignore_index_sum: (1, "sum, ignore_index=-1, rows of the logits selected"),
    shifted_narrow_softcapped: (1, "softcap=3, logit_scale=0.5, label_smoothing=0.1, rows of the logits selected"),
    shifted_flat_rows: (1, "none, ignore_index=-100, bias, rows of the logits selected"),
    shifted_nll: (1, "mean, ignore_index=-100, rows of the logits selected"),
    last_position: (1, "mean, ignore_index=-100, bias, rows of the logits selected"),
    chunked_litgpt: (4, "none, ignore_index=-100, rows of the logits selected"),
    vocabulary_narrowed: (1, "classes 0:36 of the head's 40 rows: those rows of w are read, V=36"),
    padded_head_softcapped: (1, "softcap=15, bias, classes 0:37 of the head's 40 rows"),
    rows_and_vocabulary_sliced: (1, "rows of the logits selected: the same rows of x are read, classes 0:39 of"),
    vocabulary_range_twice: (1, "sum, ignore_index=-100, bias, rows of the logits selected: the same rows of x are "
                                "read, classes 3:35 of the head's 40 rows"),
}


def make_inputs(dtype, ref: bool):
    g = seeded(0)
    x = torch.randn(2, 9, H, generator=g)
    w = torch.randn(V, H, generator=g) / H ** 0.5 * 2
    b = torch.randn(V, generator=g)
    y = torch.randint(0, V, (2, 9), generator=g)
    y[0, ::4] = -100
    y[1, 5] = 3
    cast = torch.float64 if ref else dtype
    return x.to(dtype).to(cast), w.to(dtype).to(cast), b.to(dtype).to(cast), y


def run(fn: Callable, inputs, compiled: bool, autocast: bool = False):
    """(loss, dx, dw, db) for ``fn``; a module's head weight is ``w``'s values (the same graph shape). ``autocast``:
    the forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``, the backward outside it, as a training
    loop runs them; a function returning (loss, logits) is differentiated through its loss."""
    x, w, b, y = [t.detach().clone() for t in inputs]
    x.requires_grad_(True), w.requires_grad_(True), b.requires_grad_(True)
    if isinstance(fn, type):
        module = fn().to(w.dtype)
        with torch.no_grad():
            module.head.weight.copy_(w)
        w = module.head.weight
        call = module
    else:
        call = fn
    if compiled:
        call = torch.compile(call, backend="sloth", options={"inner": "aot_eager"})
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = call(x, w, b, y)
    loss = loss[0] if isinstance(loss, tuple) else loss
    dy = torch.randn(loss.shape, generator=seeded(5)).to(loss.dtype)
    grads = torch.autograd.grad(loss, (x, w, b), dy, allow_unused=True)
    return (loss.detach(), *[g if g is not None else torch.zeros_like(t) for g, t in zip(grads, (x, w, b))])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", list(MATCHES), ids=lambda f: f.__name__)
def test_match_and_equal_eager(fn, dtype):
    count, fragment = MATCHES[fn]
    actual = run(fn, make_inputs(dtype, False), compiled=True)
    report = sloth.last_report()
    assert report.counts == {"cross_entropy": count}, str(report)
    assert all(fragment in s.detail for s in report.sites), str(report)
    assert not report.rejections, str(report)
    eager = run(fn, make_inputs(dtype, False), compiled=False)
    with StayFloat64():
        reference = run(fn, make_inputs(dtype, True), compiled=False)
    for name, a, e, r in zip(("loss", "dx", "dw", "db"), actual, eager, reference):
        atol = None
        if name == "loss":  # a scalar cannot carry the 2x rule (tests/test_models.py)
            atol = 2 * torch.finfo(dtype).eps * r.abs().max().item() + 1e-5
        assert_close(name, a, e, r, atol=atol)


def test_pattern_functions_agree():
    """The documented meaning: the HF loss is the generic pattern on shifted labels."""
    x, w, _, y = make_inputs(torch.float32, False)
    shifted = F.pad(y, (0, 1), value=-100)[..., 1:]
    torch.testing.assert_close(causal_lm_loss_pattern(x, w, y),
                               linear_cross_entropy_pattern(x, w, None, shifted.contiguous()))


# ---------------------------------------------------------------------------------------------------
# Near-misses: left as they were, with the reason
# ---------------------------------------------------------------------------------------------------

def returns_logits(x, w, b, y):
    logits = F.linear(x, w)
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1)), logits


def class_weights(x, w, b, y):
    return F.cross_entropy(F.linear(x, w).view(-1, V), y.view(-1), weight=b.abs())


def float64(x, w, b, y):
    return F.cross_entropy(F.linear(x.double(), w.double()).view(-1, V), y.view(-1))


def narrowing_cast(x, w, b, y):
    return F.cross_entropy(F.linear(x, w).float().to(torch.bfloat16).view(-1, V), y.view(-1))


def soft_targets(x, w, b, y):
    return F.cross_entropy(F.linear(x, w).view(-1, V), F.one_hot(y.clamp(min=0), V).float().view(-1, V))


def two_tanh(x, w, b, y):
    return F.cross_entropy(torch.tanh(torch.tanh(F.linear(x, w))).view(-1, V), y.view(-1))


def k_dim_loss(x, w, b, y):
    return F.cross_entropy(F.linear(x, w).transpose(1, 2), y.clamp(min=0))


def logits_logged(x, w, b, y):  # the fp32 upcast of bf16 logits read outside the loss: a copy to keep
    logits = F.linear(x.bfloat16(), w.bfloat16()).float()
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + 0.0 * logits.mean()


def log_softmax_over_rows(x, w, b, y):
    return F.nll_loss(F.log_softmax(F.linear(x, w).view(-1, V), dim=0), y.view(-1))


def log_probs_returned(x, w, b, y):
    logp = torch.log_softmax(F.linear(x, w).view(-1, V), -1)
    return F.nll_loss(logp, y.view(-1)), logp


def vocabulary_strided(x, w, b, y):  # every other class: not a contiguous range of the head's rows
    return F.cross_entropy(F.linear(x, w)[..., ::2].reshape(-1, V // 2), y.view(-1).clamp(max=V // 2 - 1))


def vocabulary_gathered(x, w, b, y):  # classes picked by a tensor of indices: a gather, not a slice
    classes = torch.arange(0, V - 4, device=x.device)
    return F.cross_entropy(F.linear(x, w)[..., classes].reshape(-1, V - 4), y.view(-1).clamp(max=V - 5))


def rows_gathered(x, w, b, y):  # rows picked by a tensor of positions: a gather, not a slice
    positions = torch.arange(0, x.shape[1], 2, device=x.device)
    return F.cross_entropy(F.linear(x, w)[:, positions].reshape(-1, V), y[:, positions].reshape(-1))


def rows_reshaped_then_sliced(x, w, b, y):  # the sequence split in three, then sliced: no view of x says that
    return F.cross_entropy(F.linear(x, w).view(2, 3, 3, V)[:, 1:].reshape(-1, V), y.view(2, 3, 3)[:, 1:].reshape(-1))


REJECTIONS = {
    vocabulary_strided: "sliced along the vocabulary (last) dim with step 2, so the classes read are not a contiguous",
    vocabulary_gathered: "the logits are indexed with a tensor over the vocabulary (last) dim (a gather of classes)",
    rows_gathered: "the logits are indexed with a tensor (a gather of rows)",
    rows_reshaped_then_sliced: "a view reshapes the logits' rows before they are sliced",
    log_softmax_over_rows: "log_softmax is over dim 0",
    log_probs_returned: "the log-probabilities have other users",
    logits_logged: "the logits are also returned or used elsewhere after the upcast to torch.float32",
    class_weights: "class weights",
    float64: "float64",
    narrowing_cast: "a cast to torch.bfloat16",
    soft_targets: "soft targets",
    two_tanh: "two tanh",
}


@pytest.mark.parametrize("fn", list(REJECTIONS), ids=lambda f: f.__name__)
def test_near_miss_is_left_with_reason(fn):
    x, w, b, y = make_inputs(torch.float32, False)
    want = fn(x, w, b, y)
    got = torch.compile(fn, backend="sloth", options={"inner": "aot_eager"})(x, w, b, y)
    report = sloth.last_report()
    assert report.counts.get("cross_entropy", 0) == 0, str(report)
    reasons = [r.reason for r in report.rejections if r.family == "cross_entropy"]
    assert len(reasons) == 1 and REJECTIONS[fn] in reasons[0], str(report)
    torch.testing.assert_close(got, want)


def softcapped_logits_returned(x, w, b, y):  # Gemma 2: the softcapped logits, in the model's dtype, returned
    logits = 3.0 * torch.tanh(F.linear(x, w, b) / 3.0)
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1)), logits


def shifted_logits_returned(x, w, b, y):  # a hand-written causal LM returning (loss, logits)
    logits = F.linear(x, w, b)
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, V), y[:, 1:].reshape(-1)), logits


def vocabulary_sliced_logits_returned(x, w, b, y):  # a padded head's logits returned whole, the loss on V - 4
    logits = F.linear(x, w, b)
    return F.cross_entropy(logits[..., :V - 4].float().reshape(-1, V - 4), y.clamp(max=V - 5).view(-1)), logits


@pytest.mark.parametrize("return_logits", [True, False], ids=["kept", "dropped"])
@pytest.mark.parametrize("fn", [returns_logits, softcapped_logits_returned, shifted_logits_returned,
                                vocabulary_sliced_logits_returned], ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", DTYPES)
def test_returned_logits_fuse(fn, dtype, return_logits):
    """The loss fuses and the logits are returned as the graph computes them (in the model's dtype), or
    empty with return_logits=False; the loss and every gradient equal eager, the returned logits'
    gradient included (autograd adds the graph's linear's contribution to the sloth op's)."""
    x, w, b, y = make_inputs(dtype, False)
    xs, ws, bs = (t.detach().requires_grad_(True) for t in (x, w, b))
    x, w, b = (t.requires_grad_(True) for t in (x, w, b))
    xr, wr, br = (t.requires_grad_(True) for t in make_inputs(dtype, True)[:3])

    def loss_and_grads(f, x, w, b, keep_logits):
        loss, logits = f(x, w, b, y)
        total = loss + (0.01 * logits.float().square().sum() if keep_logits else 0.0)
        total.backward()
        kinds.append(type(logits).__name__)
        return total.detach(), logits.detach(), (x.grad, w.grad, b.grad)

    kinds = []
    compiled = torch.compile(fn, backend="sloth", options={"inner": "aot_eager", "return_logits": return_logits})
    got, got_logits, got_grads = loss_and_grads(compiled, xs, ws, bs, return_logits)
    report = sloth.last_report()
    assert report.counts == {"cross_entropy": 1}, str(report)
    # The head trains here: the graph computes the logits (patterns/returned_logits.py's "computed" slot)
    detail = "logits also returned (kept)" if return_logits else "return_logits=False: logits not returned"
    assert detail in report.sites[0].detail, str(report)
    assert kinds[0] == "Tensor", kinds
    want, want_logits, want_grads = loss_and_grads(fn, x, w, b, return_logits)
    with StayFloat64():
        ref, _, ref_grads = loss_and_grads(fn, xr, wr, br, return_logits)
    if return_logits:
        assert got_logits.dtype == dtype
        torch.testing.assert_close(got_logits, want_logits)
    else:
        assert got_logits.numel() == 0 and got_logits.dtype == dtype
    assert_close("loss", got, want, ref, atol=torch.finfo(dtype).eps * ref.abs().item())
    for name, g, e, r in zip("xwb", got_grads, want_grads, ref_grads):
        if r is None:  # returns_logits has no bias
            assert g is None and e is None
            continue
        assert_close(f"grad {name}", g, e, r, atol=0.5 * torch.finfo(dtype).eps * r.pow(2).mean().sqrt().item())


@pytest.mark.parametrize("fn", [returns_logits, softcapped_logits_returned, shifted_logits_returned],
                         ids=lambda f: f.__name__)
def test_returned_logits_are_what_the_loss_reads(fn):
    # The projection the graph computes for the caller is the op's logits argument (flattened to [N, V], its
    # rows selected as the loss selected them), so the op computes no logits of its own: one lm_head matmul a
    # step instead of two.
    x, w, b, y = make_inputs(torch.float32, False)
    graph = graph_of(fn, x, w, b, y)
    (fused,) = [n for n in graph.graph.nodes if n.target is torch.ops.sloth.linear_cross_entropy.default]
    logits = fused.args[11]
    assert isinstance(logits, torch.fx.Node), fused.format_node()
    source = logits.args[0] if logits.target is torch.flatten else logits
    if fn is shifted_logits_returned:
        assert source.target is torch.narrow and source.args[1:] == (-2, 0, 8), source.format_node()
        source = source.args[0]
    assert linear_parts(source) is not None, source.format_node()
    assert "the loss reads them" in sloth.last_report().sites[0].detail


def test_returned_logits_not_differentiated_cost_no_backward_matmul():
    # A compiled graph materialises a zero gradient for each differentiable output the caller leaves alone;
    # the returned logits are put back into autograd outside it (patterns/returned_logits.py), so a backward
    # of the loss alone runs no matmul over the vocabulary, and one through the logits gets their gradient.
    from op_checks import RecordOps

    x, w, b, y = make_inputs(torch.float32, False)
    x.requires_grad_(True)
    compiled = torch.compile(returns_logits, backend="sloth", options={"inner": "aot_eager"})
    loss, logits = compiled(x, w, b, y)
    assert "their gradient only when one arrives" in sloth.last_report().sites[0].detail, str(sloth.last_report())
    with RecordOps() as rec:
        loss.backward()
    over_vocab = [f for f, args, _ in rec.calls if f in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                  and any(isinstance(a, torch.Tensor) and V in a.shape for a in args)]
    assert not over_vocab, over_vocab
    torch.testing.assert_close(x.grad, torch.autograd.grad(returns_logits(x, w, b, y)[0], x)[0])
    x.grad = None
    loss, logits = compiled(x, w, b, y)
    logits.sum().backward()  # the logits alone: x @ w.T's gradient, ones @ w
    torch.testing.assert_close(x.grad, torch.ones(2, 9, V) @ w)


def test_return_logits_must_be_a_bool_or_lazy():
    x, w, b, y = make_inputs(torch.float32, False)
    with pytest.raises(Exception, match="return_logits must be True, False or 'lazy'"):
        torch.compile(returns_logits, backend="sloth", options={"inner": "eager", "return_logits": "no"})(x, w, b, y)


def not_from_a_linear(x, w, b, y):
    return F.cross_entropy((x @ w.t().abs()).view(-1, V), y.view(-1))  # not a projection by w


def log_softmax_gather(x, w, b, y):
    logp = F.log_softmax(F.linear(x, w).view(-1, V), -1)
    return -logp.gather(-1, y.view(-1, 1).clamp(min=0)).mean()  # the gather form: not matched


@pytest.mark.parametrize("fn", [not_from_a_linear, k_dim_loss], ids=lambda f: f.__name__)
def test_a_loss_not_on_a_linear_is_reported(fn):
    """A cross-entropy this family has no kernel for (a matmul by something other than a weight's transpose, a
    transpose between the logits and the loss) is still an anchor: left as it was, and the report says so."""
    x, w, b, y = make_inputs(torch.float32, False)
    got = torch.compile(fn, backend="sloth", options={"inner": "aot_eager"})(x, w, b, y)
    report = sloth.last_report()
    assert report.counts.get("cross_entropy", 0) == 0, str(report)
    (rejection,) = [r for r in report.rejections if r.family == "cross_entropy"]
    assert "does not read the logits of a linear" in rejection.reason, str(report)
    torch.testing.assert_close(got, fn(x, w, b, y))


def test_the_gather_form_is_not_an_anchor():
    """``-log_softmax(z).gather(-1, y)`` calls no cross-entropy (its ignore_index is a mask written by hand):
    no site, no near-miss."""
    x, w, b, y = make_inputs(torch.float32, False)
    torch.compile(log_softmax_gather, backend="sloth", options={"inner": "aot_eager"})(x, w, b, y)
    report = sloth.last_report()
    assert report.counts.get("cross_entropy", 0) == 0, str(report)
    assert not [r for r in report.rejections if r.family == "cross_entropy"], str(report)


def test_frozen_head_skips_weight_gradient():
    x, w, b, y = make_inputs(torch.float32, False)
    x.requires_grad_(True)
    loss = torch.compile(plain, backend="sloth", options={"inner": "aot_eager"})(x, w, b, y)
    assert sloth.last_report().counts == {"cross_entropy": 1}
    loss.backward()
    assert w.grad is None
    x2 = x.detach().requires_grad_(True)
    plain(x2, w, b, y).backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_loss_after_a_fused_norm_forms_its_gradient_in_the_forward():
    # The loss reads x from the fused final RMSNorm: that node's value must still say x requires grad, or the
    # loss computes no gradient in the forward and its backward redoes the N x V x H matmul.
    def norm_then_loss(h, g, w, labels):
        hf = h.float()
        x = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype) * g
        return F.cross_entropy(F.linear(x, w).float(), labels)

    gen = seeded(3)
    h = torch.randn(6, 16, generator=gen, requires_grad=True)
    g, w = torch.randn(16, generator=gen), torch.randn(40, 16, generator=gen)
    labels = torch.randint(0, 40, (6,), generator=gen)
    graphs: list = []  # each graph sloth compiled, rewritten in place

    loss = torch.compile(norm_then_loss, backend=counting_backend(graphs, "eager"), fullgraph=True)(h, g, w, labels)
    assert sloth.last_report().counts == {"rms_norm": 1, "cross_entropy": 1}
    (fused,) = [n for n in graphs[0].graph.nodes if n.target is torch.ops.sloth.linear_cross_entropy.default]
    assert fused.args[9:11] == (True, False)  # compute_dx, compute_dw (the head is frozen)
    loss.backward()
    h2 = h.detach().requires_grad_(True)
    norm_then_loss(h2, g, w, labels).backward()
    torch.testing.assert_close(h.grad, h2.grad)


def test_under_no_grad_no_gradient_is_formed_in_the_forward():
    # An evaluation forward of a model whose head is a trainable Parameter: the fused loss must not form dW
    # (an extra N x V x H matmul), although the head's fake value still says requires_grad.
    head = nn.Linear(16, 40, bias=False)
    gen = seeded(5)
    x = torch.randn(6, 16, generator=gen)
    labels = torch.randint(0, 40, (6,), generator=gen)
    graphs: list = []  # each graph sloth compiled, rewritten in place

    with torch.no_grad():
        loss = torch.compile(lambda x, y: F.cross_entropy(head(x).float(), y),
                             backend=counting_backend(graphs, "eager"))(x, labels)
    (fused,) = [n for n in graphs[0].graph.nodes if n.target is torch.ops.sloth.linear_cross_entropy.default]
    assert fused.args[9:11] == (False, False)
    torch.testing.assert_close(loss, F.cross_entropy(head(x).float(), labels))


def test_pass_can_be_switched_off():
    x, w, b, y = make_inputs(torch.float32, False)
    others = [f for f in sloth.FAMILIES if f != "cross_entropy"]
    torch.compile(plain, backend="sloth", options={"inner": "eager", "patterns": others})(x, w, b, y)
    report = sloth.last_report()
    assert report.counts.get("cross_entropy", 0) == 0 and report.disabled == ["cross_entropy"]


def test_through_inductor():
    x, w, b, y = make_inputs(torch.float32, False)
    fn = scaled_softcapped
    got = torch.compile(fn, backend="sloth", options={"inner": "inductor"})(x, w, b, y)
    assert sloth.last_report().counts == {"cross_entropy": 1}
    torch.testing.assert_close(got, fn(x, w, b, y))


def test_dynamic_token_count_does_not_recompile():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return sloth.sloth_backend(gm, example_inputs, options={"inner": "aot_eager"})

    compiled = torch.compile(plain, backend=backend, dynamic=True)
    _, w, b, _ = make_inputs(torch.float32, False)
    for t in (5, 11):
        x = torch.randn(2, t, H)
        y = torch.randint(0, V, (2, t))
        torch.testing.assert_close(compiled(x, w, b, y), plain(x, w, b, y))
    assert len(calls) == 1 and sloth.last_report().counts == {"cross_entropy": 1}


@pytest.mark.parametrize("fn", [shifted_slice, shifted_ignore_index_sum, chunked_litgpt, padded_head_softcapped],
                         ids=lambda f: f.__name__)
def test_shifted_with_dynamic_lengths(fn):
    """With a symbolic sequence length the slices stay ``x[:, :-1]`` / ``split(5)[i]`` (canonicalisation makes
    narrows of static bounds only): the same sites fuse, and the shifted ones without recompiling."""
    calls: list = []
    compiled = torch.compile(fn, backend=counting_backend(calls, "aot_eager"), dynamic=True)
    _, w, b, _ = make_inputs(torch.float32, False)
    for t in (9, 10):  # 16 and 18 shifted rows: four chunks of at most 5 either way
        x = torch.randn(2, t, H, generator=seeded(t), requires_grad=True)
        y = torch.randint(0, V, (2, t), generator=seeded(t))
        got = compiled(x, w, b, y)
        report = sloth.last_report()
        assert report.counts == {"cross_entropy": 4 if fn is chunked_litgpt else 1}, str(report)
        want = fn(x, w, b, y)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0])
    if fn is not chunked_litgpt:
        assert len(calls) == 1


def test_vocabulary_slice_reads_a_view_of_the_head():
    """The sliced classes are rows of w and b: the op reads ``w.narrow(0, a, n)`` and ``b.narrow(0, a, n)`` (views,
    no copy), and no node computes the logits any more."""
    x, w, b, y = make_inputs(torch.float32, False)
    graph = graph_of(vocabulary_range_twice, x, w, b, y)
    (fused,) = [n for n in graph.graph.nodes if n.target is torch.ops.sloth.linear_cross_entropy.default]
    for arg in fused.args[1:3]:
        assert arg.target is torch.narrow and arg.args[1:] == (0, 3, V - 8), arg.format_node()
        assert arg.args[0].op == "placeholder", arg.format_node()
    graph.graph.eliminate_dead_code()  # what AOTAutograd and Inductor do after the passes
    assert not [n for n in graph.graph.nodes if linear_parts(n) is not None], graph.code


def test_chunked_loss_never_forms_the_whole_logits():
    """litgpt's loss per chunk of the logits: each chunk's op reads its rows of x, and nothing else reads the
    projection, so no matmul over all the rows runs (the profiler sees the ops of the compiled graph)."""
    x, w, b, y = make_inputs(torch.float32, False)
    x.requires_grad_(True)
    compiled = torch.compile(chunked_litgpt, backend="sloth", options={"inner": "aot_eager"})
    compiled(x, w, b, y)
    with torch.profiler.profile(record_shapes=True) as prof:
        loss = compiled(x, w, b, y)
    row_counts = [shapes[0][0] for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::matmul")
                  for shapes in [[s for s in e.input_shapes if len(s) == 2]] if shapes]
    assert row_counts and max(row_counts) <= 5, row_counts
    torch.testing.assert_close(loss, chunked_litgpt(x, w, b, y))


def test_out_of_range_label_in_a_compiled_loss_is_nan():
    """A label >= V reaches the kernel (eager raises IndexError; the kernel cannot without a host sync): the
    compiled loss is NaN, never a finite number, and the gradient of the offending row of x is NaN."""
    x, w, b, y = make_inputs(torch.float32, False)
    y[1, 4] = V
    with pytest.raises(IndexError):
        shifted_slice(x, w, b, y)
    x.requires_grad_(True)
    loss = torch.compile(shifted_slice, backend="sloth", options={"inner": "aot_eager"})(x, w, b, y)
    assert sloth.last_report().counts == {"cross_entropy": 1}
    assert loss.isnan()
    (dx,) = torch.autograd.grad(loss, x)
    bad = torch.zeros(2, 9, dtype=torch.bool)
    bad[1, 3] = True  # the logits of position 3 predict label 4
    assert dx[bad].isnan().all() and not dx[~bad].isnan().any()


def test_return_logits_false_that_cannot_apply_says_so():
    """Logits returned and also read by someone else (here: their mean is returned too) stay; the report
    says that return_logits=False did not apply instead of claiming the logits were dropped."""
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    w = torch.randn(24, 16, requires_grad=True)
    labels = torch.randint(0, 24, (6,))

    def fn(x, w, labels):
        logits = torch.nn.functional.linear(x, w)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        return loss, logits, logits.mean()

    compiled = torch.compile(fn, backend="sloth", options={"inner": "eager", "return_logits": False})
    loss, logits, mean = compiled(x, w, labels)
    want_loss, want_logits, want_mean = fn(x, w, labels)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(logits, want_logits)
    (site,) = [s for s in sloth.report().sites if s.family == "cross_entropy"]
    assert "return_logits=False cannot apply" in site.detail, site.detail


# ---------------------------------------------------------------------------------------------------
# Under autocast (TRL's bf16=True around a float32 model): Dynamo's graph holds no casts, the projection's value is
# bf16 from float32 x and w; the op gets them cast to bf16, as autocast's F.linear did, and computes the loss in
# float32, as autocast's cross_entropy does.
# ---------------------------------------------------------------------------------------------------

def autocast_in_the_function(x, w, b, y):  # the context inside the compiled function: enter/exit nodes in the graph
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return plain(x, w, b, y)


AUTOCAST_CASES = [plain, with_bias_sum, scaled_softcapped, shifted_contiguous_upcast_first, nll_of_log_softmax,
                  chunked_litgpt, padded_head_softcapped, returns_logits, autocast_in_the_function]


@pytest.mark.parametrize("fn", AUTOCAST_CASES, ids=lambda f: f.__name__)
def test_under_autocast_the_op_computes_what_autocast_would(fn):
    inputs = make_inputs(torch.float32, False)
    actual = run(fn, inputs, compiled=True, autocast=True)
    report = sloth.last_report()
    assert report.counts == {"cross_entropy": 4 if fn is chunked_litgpt else 1}, str(report)
    assert all("float32, under autocast: in bfloat16" in s.detail for s in report.sites), str(report)
    assert not report.rejections, str(report)
    eager = run(fn, inputs, compiled=False, autocast=True)
    with StayFloat64():
        reference = run(fn, make_inputs(torch.float32, True), compiled=False)
    if fn is not scaled_softcapped:  # whose scale and cap eager runs in bf16, the op in fp32
        # the same bf16 logits as autocast's linear, then fp32 math: the loss agrees to fp32 summation order
        torch.testing.assert_close(actual[0], eager[0], rtol=1e-5, atol=1e-5)
    for name, a, e, r in zip(("loss", "dx", "dw", "db"), actual, eager, reference):
        assert a.dtype == e.dtype, name  # each gradient cast back to its float32 input's dtype
        # bf16's roundoff, which autocast's matmuls have, in the rule's small term
        assert_close(name, a, e, r, atol=slack(torch.bfloat16, r))


def test_under_autocast_the_op_reads_x_and_w_in_bf16():
    x, w, b, y = make_inputs(torch.float32, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = graph_of(with_bias_sum, x, w, b, y)
    (fused,) = [n for n in graph.graph.nodes if n.target is torch.ops.sloth.linear_cross_entropy.default]
    for arg in fused.args[:3]:
        assert arg.meta["example_value"].dtype == torch.bfloat16, arg.format_node()
    assert fused.meta["example_value"][0].dtype == torch.float32


def test_causal_lm_under_autocast():
    """A float32 transformers causal LM run as TRL's bf16=True runs it: one fused loss, loss and gradients as eager
    under autocast (bf16 precision, against the float64 model)."""
    import copy
    from test_models import VOCAB, assert_model_close, build

    model = build("llama", torch.float32)
    ids = torch.randint(3, VOCAB, (2, 11), generator=seeded(1))

    def loss_grads(m, run=None, autocast=True):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = (m if run is None else run)(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}

    reference = loss_grads(copy.deepcopy(model).double(), autocast=False)
    eager = loss_grads(model)
    actual = loss_grads(model, torch.compile(model, backend="sloth", options={"inner": "aot_eager"}))
    report = sloth.report()
    assert report.counts.get("cross_entropy", 0) == 1, str(report)
    (site,) = [s for s in report.sites if s.family == "cross_entropy"]
    assert "under autocast: in bfloat16" in site.detail and "logits also returned (kept)" in site.detail, str(report)
    assert not [r for r in report.rejections if r.family == "cross_entropy"], str(report)
    assert actual[1].keys() == eager[1].keys()
    assert_model_close(actual, eager, reference, torch.bfloat16)
