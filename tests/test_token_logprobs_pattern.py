"""The token_logprobs family (patterns/token_logprobs.py): per-token log-probabilities and entropy of a linear head,
as DPO, GRPO and RLOO losses write them, found in the graph and replaced by ``sloth.linear_token_logprobs``;
values and gradients equal to eager's; the near-misses reported with their reason."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sloth

torch.manual_seed(0)


class Head(nn.Module):
    def __init__(self, hidden=16, vocab=50, bias=False, dtype=torch.float32):
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=bias).to(dtype)


def selective(lsm, ids):
    return torch.gather(lsm, dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)


def dpo_style(head, h, ids):
    logits = head.lm_head(h).float()
    return selective(F.log_softmax(logits, dim=-1), ids).sum(-1)


def grpo_style(head, h, ids, temperature=0.7):
    # TRL's GRPO: the last position's logits dropped, divided by the temperature, log-probs and the entropy
    logits = head.lm_head(h)[:, :-1, :] / temperature
    lsm = logits.float().log_softmax(-1)
    logp = lsm.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(lsm * lsm.exp()).sum(dim=-1)
    return (logp.exp() * 0.3 - 0.01 * entropy).mean()


def softcapped(head, h, ids):
    logits = 30.0 * torch.tanh(head.lm_head(h).float() / 30.0)
    lsm = torch.log_softmax(logits, -1)
    return torch.gather(lsm, 2, ids[..., None])[..., 0].mean()


FORMS = {"dpo": dpo_style, "grpo": grpo_style, "softcap": softcapped}


def run(fn, head, h, ids):
    h = h.detach().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    out = fn(head, h, ids)
    out.float().sum().backward()
    return out.detach(), h.grad, *(p.grad for p in head.parameters() if p.requires_grad)


def fused_against_eager(form, head, h, ids, rtol=1e-4, atol=1e-5):
    """``form`` compiled with sloth against eager (conftest.py starts each test with Dynamo and the report fresh):
    the value and every gradient within ``rtol``/``atol``; sloth's report."""
    want = run(form, head, h, ids)
    got = run(torch.compile(form, backend="sloth"), head, h, ids)
    for a, b in zip(got, want):
        assert (a is None) == (b is None), "a gradient where eager has none, or none where it has one"
        if a is not None:
            torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)
    return sloth.report()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_is_fused_with_eagers_values_and_gradients(form, bias):
    report = fused_against_eager(FORMS[form], Head(bias=bias), torch.randn(2, 7, 16), torch.randint(0, 50, (2, 7)))
    assert report.counts.get("token_logprobs") == 1, report
    site = next(s for s in report.sites if s.family == "token_logprobs")
    assert ("entropy" in site.detail) == (form == "grpo"), site.detail


def _dx_in_forward_seen(monkeypatch) -> set[int]:
    """The ``dx_in_forward`` each call of the op (on fakes and for real) is given."""
    import sloth.lowering.token_logprobs as lowering
    seen, parts = set(), lowering._forward_parts

    def spy(dx_in_forward, entropy):
        seen.add(dx_in_forward)
        return parts(dx_in_forward, entropy)
    monkeypatch.setattr(lowering, "_forward_parts", spy)
    return seen


@pytest.mark.parametrize("form, frozen, bits", [("dpo", True, {1}), ("grpo", True, {0}), ("grpo", False, {0})])
def test_a_frozen_head_takes_dx_from_the_forward(form, frozen, bits, monkeypatch):
    # LoRA's frozen head: the log-probabilities' row gradients of x in the forward; an entropy that records a
    # gradient (GRPO's entropy term) or a trained head: all recomputed in the backward, one pass (the pass's
    # _dx_in_forward says why)
    head = Head().requires_grad_(not frozen)
    seen = _dx_in_forward_seen(monkeypatch)
    report = fused_against_eager(FORMS[form], head, torch.randn(2, 7, 16), torch.randint(0, 50, (2, 7)))
    assert report.counts.get("token_logprobs") == 1, report
    assert seen == bits, seen


def logged_entropy(head, h, ids):
    # GRPO-style: the entropy read under no_grad for a metric, before the gather; the log-softmax written twice
    logits = head.lm_head(h).float()
    lsm = logits.log_softmax(-1)
    index = ids.unsqueeze(-1)
    with torch.no_grad():
        entropy = -(logits.log_softmax(-1).exp() * lsm).sum(-1)
    return lsm.gather(-1, index).squeeze(-1) * 0.5 + entropy


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trained"])
def test_an_entropy_logged_under_no_grad_gets_no_gradient(frozen, monkeypatch):
    # the op goes before the no_grad block (its log-probabilities record a gradient) and its entropy is detached,
    # as the graph had it; with a frozen head the forward computes the log-probabilities' part alone
    head = Head().requires_grad_(not frozen)
    seen = _dx_in_forward_seen(monkeypatch)
    h, ids = torch.randn(2, 7, 16), torch.randint(0, 50, (2, 7))
    report = fused_against_eager(logged_entropy, head, h, ids)
    assert report.counts.get("token_logprobs") == 1, report
    assert seen == ({1} if frozen else {0}), seen

    def both(head, h, ids):
        logits = head.lm_head(h).float()
        lsm = logits.log_softmax(-1)
        with torch.no_grad():
            entropy = -(lsm.exp() * lsm).sum(-1)
        return lsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1), entropy

    logp, entropy = torch.compile(both, backend="sloth")(head, h.requires_grad_(True), ids)
    assert logp.requires_grad and not entropy.requires_grad
    torch.testing.assert_close(entropy, both(head, h, ids)[1])


def test_a_bf16_head_under_the_tolerance_rule():
    # the fused op computes in fp32 from the bf16 tile, as eager does after .float(): within bf16 rounding
    fused_against_eager(dpo_style, Head(dtype=torch.bfloat16), torch.randn(3, 5, 16, dtype=torch.bfloat16),
                        torch.randint(0, 50, (3, 5)), rtol=2e-2, atol=2e-2)


def _reasons():
    return [r.reason for r in sloth.report().rejections if r.family == "token_logprobs"]


def test_two_gathers_of_one_log_softmax_are_reported():
    head = Head()

    def two(h, a, b):
        lsm = F.log_softmax(head.lm_head(h), dim=-1)
        return (selective(lsm, a) - selective(lsm, b)).sum()

    h = torch.randn(2, 3, 16)
    a, b = torch.randint(0, 50, (2, 3)), torch.randint(0, 50, (2, 3))
    torch.testing.assert_close(torch.compile(two, backend="sloth")(h, a, b), two(h, a, b))
    assert _reasons() == ["one log-softmax gathered at two sets of labels"], _reasons()


def test_a_log_softmax_read_elsewhere_is_reported_and_kept():
    head = Head()

    def returned(h, ids):
        lsm = F.log_softmax(head.lm_head(h), dim=-1)
        return selective(lsm, ids).sum(), lsm

    h, ids = torch.randn(2, 3, 16), torch.randint(0, 50, (2, 3))
    got, want = torch.compile(returned, backend="sloth")(h, ids), returned(h, ids)
    torch.testing.assert_close(got, want)
    assert sloth.report().counts.get("token_logprobs") is None
    assert any("other users" in r for r in _reasons()), _reasons()


def test_logits_that_are_not_a_linears_are_left_alone():
    def plain(z, ids):
        return selective(F.log_softmax(z, dim=-1), ids).sum()

    z, ids = torch.randn(2, 3, 9), torch.randint(0, 9, (2, 3))
    torch.testing.assert_close(torch.compile(plain, backend="sloth")(z, ids), plain(z, ids))
    assert sloth.report().counts.get("token_logprobs") is None and _reasons() == []


def trl_rows_loop(head, h, ids):
    # TRL's selective_log_softmax for bf16 logits: a log_softmax per batch row, gathered at that row's labels
    logits = head.lm_head(h)
    rows = [F.log_softmax(row, dim=-1).gather(dim=-1, index=labels.unsqueeze(-1)) for row, labels in zip(logits, ids)]
    return torch.stack(rows).squeeze(-1).sum()


def trl_entropy_chunks(head, h, ids):
    # TRL's entropy_from_logits: the logits flattened, the entropy over chunks of rows (4 here, 128 in TRL)
    logits = head.lm_head(h)
    flat = logits.reshape(-1, logits.shape[-1])
    entropies = []
    for chunk in flat.split(4, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        entropies.append(-(torch.exp(logps) * logps).sum(-1))
    return torch.cat(entropies).reshape(logits.shape[:-1]).mean()


@pytest.mark.parametrize("form, sites", [(trl_rows_loop, 2), (trl_entropy_chunks, 3)],
                         ids=["trl-rows-loop", "trl-entropy-chunks"])
def test_trls_loops_are_fused_site_by_site(form, sites):
    report = fused_against_eager(form, Head(), torch.randn(2, 5, 16), torch.randint(0, 50, (2, 5)))
    assert report.counts.get("token_logprobs") == sites, report


def shifted(head, h, ids):
    # the last position dropped, log-probabilities and entropy (no float: under dynamic=True Dynamo makes a Python
    # float such as a temperature a symbolic input, which no family reads as a constant scale)
    lsm = F.log_softmax(head.lm_head(h)[:, :-1].float(), dim=-1)
    return (selective(lsm, ids[:, 1:]) + (lsm.exp() * lsm).sum(-1, keepdim=True).squeeze(-1)).sum()


def test_symbolic_lengths_stay_symbolic():
    head = Head()
    compiled = torch.compile(shifted, backend="sloth", dynamic=True)
    for t in (7, 9, 12):
        h, ids = torch.randn(2, t, 16), torch.randint(0, 50, (2, t))
        want = run(shifted, head, h, ids)
        got = run(compiled, head, h, ids)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert sloth.report().counts == {"token_logprobs": 1}, sloth.report()  # one graph, symbolic in the length


def trl_fp32_logsumexp(head, h, ids):
    # TRL's selective_log_softmax for float32 logits: the label's logit minus a logsumexp per batch row
    logits = head.lm_head(h)
    index = ids.unsqueeze(-1)
    selected = torch.gather(logits, dim=-1, index=index)
    lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return (selected - lse.unsqueeze(-1)).squeeze(-1).sum()


def logsumexp_kept(head, h, ids):
    z = head.lm_head(h)[:, :-1] / 0.9
    return (z.gather(-1, ids[:, 1:, None]) - z.logsumexp(-1, keepdim=True)).mean()


@pytest.mark.parametrize("form", [trl_fp32_logsumexp, logsumexp_kept], ids=["trl-fp32-rows", "keepdim"])
def test_the_log_softmax_written_out_with_logsumexp(form):
    report = fused_against_eager(form, Head(bias=True), torch.randn(3, 6, 16), torch.randint(0, 50, (3, 6)))
    assert report.counts.get("token_logprobs") == 1, report


def flat_view_entropy(head, h, ids):
    # the logits viewed as [N, V] with no row selection after the view, log-probabilities and entropy
    lsm = F.log_softmax(head.lm_head(h).view(-1, 50), dim=-1)
    return (lsm.gather(-1, ids.view(-1, 1)).squeeze(-1) - (lsm.exp() * lsm).sum(-1)).sum()


def flat_view_entropy_alone(head, h, ids):
    lsm = F.log_softmax(head.lm_head(h).view(-1, 50), dim=-1)
    return (lsm.exp() * lsm).sum(-1) @ torch.arange(lsm.shape[0], dtype=lsm.dtype)


def labels_after_the_entropy(head, h, ids):
    lsm = F.log_softmax(head.lm_head(h), dim=-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    labels = (ids + 1) % 50
    return (lsm.gather(-1, labels[..., None]).squeeze(-1) + ent).sum()


@pytest.mark.parametrize("form, fused", [(flat_view_entropy, 1), (flat_view_entropy_alone, 0),
                                         (labels_after_the_entropy, 0)],
                         ids=["flat-view", "flat-view-entropy-alone", "labels-after-entropy"])
def test_views_and_orders_give_eagers_shapes(form, fused):
    # found in review: the entropy took x's shape where a view had flattened the logits, and the op was placed
    # before labels computed after the entropy (now refused: the entropy's readers come before the labels)
    report = fused_against_eager(form, Head(), torch.randn(2, 7, 16), torch.randint(0, 50, (2, 7)))
    assert report.counts.get("token_logprobs", 0) == fused and not report.failed, report
    if not fused:  # refused with the reason, the graph as it was
        why = "no labels give the entropy's shape" if form is flat_view_entropy_alone else \
            "the entropy is read before the labels are computed"
        assert any(why in r.reason for r in report.rejections), report


def test_a_log_softmax_repeated_after_a_no_grad_one_keeps_its_gradient():
    # the first log-softmax under no_grad (a logged entropy), the second recording the log-probabilities' gradient:
    # the entropy's and the log-probabilities' sites each their own
    def later(head, h, ids):
        logits = head.lm_head(h).float()
        with torch.no_grad():
            lsm0 = logits.log_softmax(-1)
            entropy = -(lsm0.exp() * lsm0).sum(-1)
        return logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1) + entropy

    fused_against_eager(later, Head(), torch.randn(2, 7, 16), torch.randint(0, 50, (2, 7)))


def lsm_under_no_grad(head, h, ids):
    # the log-softmax (or, below, the linear) under no_grad and read outside it: the graph's value has no gradient
    logits = head.lm_head(h).float()
    with torch.no_grad():
        lsm = logits.log_softmax(-1)
    return selective(lsm, ids) + h.sum(-1)


def linear_under_no_grad(head, h, ids):
    with torch.no_grad():
        logits = head.lm_head(h).float()
    return selective(logits.log_softmax(-1), ids) + h.sum(-1)


@pytest.mark.parametrize("form", [lsm_under_no_grad, linear_under_no_grad], ids=lambda f: f.__name__)
def test_what_no_grad_made_gets_no_gradient_from_the_op(form):
    report = fused_against_eager(form, Head(), torch.randn(2, 7, 16), torch.randint(0, 50, (2, 7)))
    assert report.counts.get("token_logprobs") == 1, report


def scaled_in_place(head, h, ids):
    logits = head.lm_head(h).float()
    logits.mul_(3.0)
    return selective(logits.log_softmax(-1), ids)


def written_between_two(head, h, ids):
    # the same logits' log-softmax twice, the logits written in place between: two values, not one
    logits = head.lm_head(h).float()
    first = selective(logits.log_softmax(-1), ids)
    logits.div_(2.0)
    second = logits.log_softmax(-1)
    return first + (second.exp() * second).sum(-1)


@pytest.mark.parametrize("form", [scaled_in_place, written_between_two], ids=lambda f: f.__name__)
def test_logits_written_in_place_keep_eagers_values(form):
    report = fused_against_eager(form, Head(), torch.randn(2, 7, 16), torch.randint(0, 50, (2, 7)))
    assert any("written in place" in r for r in _reasons()), (_reasons(), report)


def test_two_log_softmaxes_each_gathered_are_two_sites():
    def two(head, h, ids):
        logits = head.lm_head(h).float()
        return selective(logits.log_softmax(-1), ids) - selective(logits.log_softmax(-1), ids.flip(-1))

    report = fused_against_eager(two, Head(), torch.randn(2, 7, 16), torch.randint(0, 50, (2, 7)))
    assert report.counts.get("token_logprobs") == 2, report
