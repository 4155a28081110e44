"""The fused op ``sloth.lowering.token_logprobs``: per-token log-probabilities and entropy, and dx, dw, dbias, against
eager PyTorch's ``log_softmax`` of the logits.

Oracle (STYLE.md, habit 5): ``eager_token_logprobs`` below at the tested dtype is "eager"; the same function in
float64 end to end is the reference, and the tolerance rule (tests/tolerance.py) compares the two errors. Both
outputs get a seeded cotangent at once, so every gradient carries both terms of the backward.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import sloth.lowering.token_logprobs as lowering
from sloth.lowering.token_logprobs import linear_token_logprobs
from op_checks import force_fallback
from tolerance import assert_close

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def eager_token_logprobs(x, w, b, labels, ignore_index=-100, softcap=0.0, logit_scale=1.0, temperature=1.0,
                         entropy=False):
    """The op's meaning, as a DPO or GRPO loss writes it: log_softmax of the (capped, scaled) fp32 logits divided
    by the temperature, gathered at the labels; the entropy from the same log-softmax; ignored rows 0."""
    z = F.linear(x, w, b)
    z = z.float() if z.dtype != torch.float64 else z
    z = z * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    logp_all = (z / temperature).log_softmax(-1)
    valid = labels != ignore_index
    logp = torch.where(valid, logp_all.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1), 0.0)
    ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0) if entropy else None
    return logp, ent


def make_inputs(n, h, v, *, bias=False, ignored=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) / math.sqrt(h) * 2.0  # logits of std ~2: a peaked softmax
    b = torch.randn(v, generator=g) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    if ignored:
        labels[::3] = -100
    return x, w, b, labels


def forward_backward(fn, x, w, b, entropy, weight_grad=True):
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(weight_grad)
    b = b.detach().requires_grad_(weight_grad) if b is not None else None
    logp, ent = fn(x, w, b)
    g = torch.Generator().manual_seed(1)
    outs = [logp] + ([ent] if entropy else [])
    cots = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outs]
    wrt = [x] + ([w] if weight_grad else []) + ([b] if b is not None and weight_grad else [])
    grads = list(torch.autograd.grad(outs, wrt, cots))
    dx = grads.pop(0)
    dw = grads.pop(0) if weight_grad else None
    db = grads.pop(0) if b is not None and weight_grad else None
    return logp.detach(), (ent.detach() if entropy else None), dx, dw, db


def check(x32, w32, b32, labels, dtype, weight_grad=True, device="cpu", dx_in_forward=None, **opts):
    x, w, labels = x32.to(device, dtype), w32.to(device, dtype), labels.to(device)
    b = b32.to(device, dtype) if b32 is not None else None
    entropy = opts.get("entropy", False)
    actual = forward_backward(lambda a, c, d: linear_token_logprobs(a, c, d, labels, dx_in_forward=dx_in_forward,
                                                                    **opts), x, w, b, entropy, weight_grad)
    eager = forward_backward(lambda a, c, d: eager_token_logprobs(a, c, d, labels, **opts), x, w, b, entropy,
                             weight_grad)
    reference = forward_backward(lambda a, c, d: eager_token_logprobs(a, c, d, labels, **opts), x.double(),
                                 w.double(), None if b is None else b.double(), entropy, weight_grad)
    for name, a, e, r in zip(("logp", "entropy", "dx", "dw", "db"), actual, eager, reference):
        if e is None:
            assert a is None, f"{name}: the op gave what eager does not"
            continue
        assert_close(name, a, e, r)
    return actual


SHAPES = [(1, 1), (3, 7), (37, 100), (5, 1000)]


@pytest.mark.parametrize("head", ["trained", "frozen"])
@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "logp+entropy"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,v", SHAPES, ids=[f"N{n}-V{v}" for n, v in SHAPES])
def test_values_and_gradients_match_eager(n, v, dtype, entropy, head, device):
    # a frozen head: dx from the forward's parts by default; a trained one: every gradient recomputed
    x, w, b, labels = make_inputs(n, 24, v)
    logp, ent, dx, dw, _ = check(x, w, b, labels, dtype, weight_grad=head == "trained", device=device,
                                 entropy=entropy)
    assert logp.dtype == torch.float32 and logp.shape == (n,) and dx.dtype == dtype
    assert dw is None if head == "frozen" else dw.shape == (v, 24)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("differentiated", ["both", "logp", "entropy"])
@pytest.mark.parametrize("dx_in_forward", [0, 1, 2, 3])
def test_each_split_of_dx_between_forward_and_backward_gives_eager(dx_in_forward, differentiated, dtype, device):
    # the parts the forward computed, the rest recomputed: every mix, with either output's gradient absent
    x, w, b, labels = make_inputs(29, 24, 300, bias=True, ignored=True)
    x, w, b, labels = x.to(device, dtype), w.to(device, dtype), b.to(device, dtype), labels.to(device)
    outs = {}
    for name, fn in (("op", lambda a: linear_token_logprobs(a, w, b, labels, entropy=True, softcap=7.0,
                                                              dx_in_forward=dx_in_forward)),
                     ("eager", lambda a: eager_token_logprobs(a, w, b, labels, entropy=True, softcap=7.0)),
                     ("fp64", lambda a: eager_token_logprobs(a, w.double(), b.double(), labels, entropy=True,
                                                             softcap=7.0))):
        xs = (x.double() if name == "fp64" else x).detach().requires_grad_(True)
        logp, ent = fn(xs)
        g = torch.Generator().manual_seed(1)
        cot_logp, cot_ent = (torch.randn(logp.shape, generator=g).to(device, logp.dtype) for _ in range(2))
        loss = {"both": (logp * cot_logp).sum() + (ent * cot_ent).sum(), "logp": (logp * cot_logp).sum(),
                "entropy": (ent * cot_ent).sum()}[differentiated]
        outs[name] = torch.autograd.grad(loss, xs)[0]
    assert_close("dx", outs["op"], outs["eager"], outs["fp64"])


OPTIONS = {
    "bias": dict(bias=True),
    "ignored": dict(ignored=True),
    "other-ignore-index": dict(ignored=True, ignore_index=-1),
    "softcap": dict(softcap=3.0),
    "logit-scale": dict(logit_scale=0.25),
    "temperature": dict(temperature=0.7),
    "everything": dict(bias=True, ignored=True, softcap=5.0, logit_scale=1.7, temperature=1.3),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_match_eager(option, dtype, device):
    spec = dict(OPTIONS[option])
    bias, ignored = spec.pop("bias", False), spec.pop("ignored", False)
    x, w, b, labels = make_inputs(37, 24, 100, bias=bias, ignored=ignored)
    if spec.get("ignore_index") == -1:
        labels[labels == -100] = -1
    logp, ent, dx, _, _ = check(x, w, b, labels, dtype, device=device, entropy=True, **spec)
    ignored_rows = (labels == spec.get("ignore_index", -100)).to(device)
    if ignored:
        assert (logp[ignored_rows] == 0).all() and (ent[ignored_rows] == 0).all() and (dx[ignored_rows] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_frozen_head_gets_no_weight_gradient(dtype):
    x, w, b, labels = make_inputs(9, 16, 50, bias=True)
    check(x, w, b, labels, dtype, weight_grad=False, entropy=True)


@pytest.mark.parametrize("dx_in_forward", [None, 1, 2, 3], ids=["trained", "frozen-1", "frozen-2", "frozen-3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_large_vocabulary_over_several_blocks_and_chunks(dtype, dx_in_forward, monkeypatch, device):
    # two rows per chunk (one with both of dx's parts in the forward), a vocabulary of several 4096-wide blocks
    monkeypatch.setattr(lowering, "chunk_rows", lambda n, v, h, dw=False: 2)
    x, w, b, labels = make_inputs(5, 16, 9001, bias=True, ignored=True)
    check(x, w, b, labels, dtype, weight_grad=dx_in_forward is None, device=device, entropy=True, softcap=30.0,
          logit_scale=0.5, temperature=1.3, dx_in_forward=dx_in_forward)


@pytest.mark.parametrize("dx_in_forward, differentiated, recomputed", [
    (1, "logp", []), (2, "entropy", []), (3, "both", []), (1, "both", [(False, True)]), (2, "both", [(True, False)]),
    (0, "logp", [(True, False)])])
def test_the_backward_recomputes_only_what_the_forward_left(dx_in_forward, differentiated, recomputed, monkeypatch):
    # an output nothing differentiates brings no pass over the vocabulary (its gradient is None, not zeros)
    seen, original = [], lowering._recompute_grads

    def spy(grad_logp, grad_entropy, *args, **kwargs):
        seen.append((grad_logp is not None, grad_entropy is not None))
        return original(grad_logp, grad_entropy, *args, **kwargs)
    monkeypatch.setattr(lowering, "_recompute_grads", spy)
    x, w, _, labels = make_inputs(6, 8, 20)
    logp, ent = linear_token_logprobs(x.requires_grad_(True), w, None, labels, entropy=True,
                                      dx_in_forward=dx_in_forward)
    {"logp": logp.sum(), "entropy": ent.sum(), "both": logp.sum() + ent.sum()}[differentiated].backward()
    assert seen == recomputed, seen


@pytest.mark.parametrize("head", ["trained", "frozen"])
def test_the_reference_path_gives_the_same(monkeypatch, head):
    # the PyTorch reference (a CPU without the interpreter) against the kernels, on one input
    x, w, b, labels = make_inputs(11, 16, 70, bias=True, ignored=True)
    kernels = forward_backward(lambda a, c, d: linear_token_logprobs(a, c, d, labels, entropy=True, softcap=4.0),
                               x, w, b, True, weight_grad=head == "trained")
    force_fallback(monkeypatch, lowering, "_token_stats_kernel", "_token_grad_kernel")
    reference = forward_backward(lambda a, c, d: linear_token_logprobs(a, c, d, labels, entropy=True, softcap=4.0),
                                 x, w, b, True, weight_grad=head == "trained")
    for a, r in zip(kernels, reference):
        if a is not None or r is not None:
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


def test_only_one_output_differentiated():
    # the entropy asked for but unused in the loss, and the other way round
    x, w, b, labels = make_inputs(6, 16, 30)
    xs = x.requires_grad_(True)
    logp, ent = linear_token_logprobs(xs, w, None, labels, entropy=True)
    (dx,) = torch.autograd.grad(logp.sum(), xs)
    ref_logp, _ = eager_token_logprobs(xs, w, None, labels, entropy=True)
    (want,) = torch.autograd.grad(ref_logp.sum(), xs)
    torch.testing.assert_close(dx, want, rtol=1e-4, atol=1e-5)
    logp, ent = linear_token_logprobs(xs, w, None, labels, entropy=True)
    (dx,) = torch.autograd.grad(ent.sum(), xs)
    _, ref_ent = eager_token_logprobs(xs, w, None, labels, entropy=True)
    (want,) = torch.autograd.grad(ref_ent.sum(), xs)
    torch.testing.assert_close(dx, want, rtol=1e-4, atol=1e-5)


def test_a_label_out_of_range_is_nan_or_an_error():
    x, w, b, labels = make_inputs(4, 8, 10)
    labels[1] = 10
    if lowering.use_triton(x):
        logp, ent = linear_token_logprobs(x, w, None, labels, entropy=True)
        assert torch.isnan(logp[1]) and torch.isnan(ent[1]) and not torch.isnan(logp[[0, 2, 3]]).any()
    else:
        with pytest.raises(IndexError, match="sloth.linear_token_logprobs: target 10 is out of bounds"):
            linear_token_logprobs(x, w, None, labels)


@pytest.mark.parametrize("bad, error", [
    (dict(x=torch.randn(3, 4, 8)), "x must be \\[N, H\\]"),
    (dict(labels=torch.zeros(3, dtype=torch.int32)), "labels must be int64"),
    (dict(temperature=0.0), "temperature must be positive"),
    (dict(w=torch.randn(10, 8, dtype=torch.float64)), "x and w must share"),
])
def test_bad_inputs_get_a_clear_error(bad, error):
    args = dict(x=torch.randn(3, 8), w=torch.randn(10, 8), labels=torch.zeros(3, dtype=torch.long), temperature=1.0)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=error):
        linear_token_logprobs(args["x"], args["w"], None, args["labels"], temperature=args["temperature"])


@pytest.mark.parametrize("dx_in_forward", [0, 3])
def test_opcheck_forward_and_backward(dx_in_forward):
    lowering.register()
    x, w, b, labels = make_inputs(5, 8, 13, bias=True, ignored=True)
    trained = not dx_in_forward
    torch.library.opcheck(torch.ops.sloth.linear_token_logprobs.default,
                          (x.requires_grad_(True), w.requires_grad_(trained), b.requires_grad_(trained), labels, -100,
                           2.0, 0.5, 1.3, True, dx_in_forward, trained))  # statistics too, once
    _, _, stats, parts = torch.ops.sloth.linear_token_logprobs.default(x.detach(), w.detach(), b.detach(), labels,
                                                                       -100, 2.0, 0.5, 1.3, True, dx_in_forward,
                                                                       trained)
    torch.library.opcheck(torch.ops.sloth.linear_token_logprobs_backward.default,
                          (torch.randn(5), torch.randn(5), x.detach(), w.detach(), b.detach(), labels, stats, parts,
                           -100, 2.0, 0.5, 1.3, dx_in_forward, True, trained))


def test_the_entropy_s_part_needs_the_entropy():
    x, w, _, labels = make_inputs(3, 8, 10)
    with pytest.raises(ValueError, match="dx_in_forward must be 0, 1, 2 or 3"):
        linear_token_logprobs(x.requires_grad_(True), w, None, labels, dx_in_forward=2)


@pytest.mark.parametrize("offset", [3000.0, -3000.0])
def test_logits_far_from_zero_keep_their_precision(offset):
    # a bias of +-3000 on every logit: the values come from differences to the row's max, as eager's log_softmax
    # forms them, not from lse itself (an ulp of 2.4e-4 there)
    x, w, b, labels = make_inputs(9, 16, 70, bias=True)
    check(x, w, b + offset, labels, torch.float32, entropy=True)


def eager_statistics(x, w, b, labels, ignore_index=-100, softcap=0.0, logit_scale=1.0, temperature=1.0):
    """TRL's per-token metrics as TRL's trainers define them: log sum_j p_j^2, the mean logit, whether the label is
    ``argmax`` (the first maximum); 0 on ignored rows."""
    z = F.linear(x, w, b)
    z = (z.float() if z.dtype != torch.float64 else z) * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    valid = labels != ignore_index
    p = z.softmax(-1)
    top1 = (z.argmax(-1) == labels).to(z.dtype)
    return tuple(torch.where(valid, t, 0.0) for t in ((p * p).sum(-1).log(), z.mean(-1), top1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", [dict(), dict(softcap=5.0, temperature=0.8, logit_scale=1.3)],
                         ids=["plain", "capped-scaled"])
def test_statistics_match_trls_definitions(opts, dtype, monkeypatch, device):
    # several 4096-wide blocks and two rows per chunk, ignored rows; values under the tolerance rule, is-top-1 equal
    monkeypatch.setattr(lowering, "chunk_rows", lambda n, v, h, dw=False: 2)
    x32, w32, b32, labels = make_inputs(7, 16, 9001, bias=True, ignored=True)
    labels[1] = int(F.linear(x32[1:2], w32, b32).argmax())  # one row whose label is the top-1
    x, w, b, labels = x32.to(device, dtype), w32.to(device, dtype), b32.to(device, dtype), labels.to(device)
    ours = linear_token_logprobs(x, w, b, labels, statistics=True, **opts)
    assert len(ours) == 5 and ours[1] is None
    eager = eager_statistics(x, w, b, labels, **opts)
    reference = eager_statistics(x.double(), w.double(), b.double(), labels, **opts)
    for name, a, e, r in zip(("log_sum_sq_probs", "mean_logits"), ours[2:4], eager, reference):
        assert_close(name, a, e, r)
    torch.testing.assert_close(ours[4], eager[2])
    assert ours[4][1] == 1.0 and (ours[4][labels == -100] == 0).all()


def test_is_top1_is_the_first_argmax(device):
    # ties: the label tied with an earlier class is not the top-1 (argmax takes the first); with a later one it is
    w = torch.zeros(6, 2)
    w[1, 0] = w[3, 0] = 1.0  # classes 1 and 3 tie for the max on x = (1, 0)
    x = torch.tensor([[1.0, 0.0]] * 3)
    labels = torch.tensor([1, 3, 0])
    *_, top1 = linear_token_logprobs(x.to(device), w.to(device), None, labels.to(device), statistics=True)
    assert top1.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("head", ["trained", "frozen"])
def test_statistics_on_the_reference_path(monkeypatch, head):
    # the statistics' rows beside the backward's three: every output and gradient as the kernels give them
    x, w, b, labels = make_inputs(9, 16, 70, bias=True, ignored=True)

    def run():
        xs, ws, bs = (t.detach().requires_grad_(t is x or head == "trained") for t in (x, w, b))
        out = linear_token_logprobs(xs, ws, bs, labels, entropy=True, statistics=True, softcap=3.0)
        wrt = [xs] + ([ws, bs] if head == "trained" else [])
        return [o.detach() for o in out] + list(torch.autograd.grad(out[0].sum() + 2 * out[1].sum(), wrt))

    kernels = run()
    force_fallback(monkeypatch, lowering, "_token_stats_kernel", "_token_grad_kernel")
    reference = run()
    for a, r in zip(kernels, reference):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


def test_a_label_out_of_range_on_the_reference_path_names_the_op(monkeypatch):
    force_fallback(monkeypatch, lowering, "_token_stats_kernel", "_token_grad_kernel")
    x, w, b, labels = make_inputs(4, 8, 10)
    labels[2] = -5
    with pytest.raises(IndexError, match="sloth.linear_token_logprobs: target -5 is out of bounds"):
        linear_token_logprobs(x, w, None, labels)
