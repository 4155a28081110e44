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
    return out.detach(), h.grad, *(p.grad for p in head.parameters())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_is_fused_with_eagers_values_and_gradients(form, bias):
    head = Head(bias=bias)
    h, ids = torch.randn(2, 7, 16), torch.randint(0, 50, (2, 7))
    want = run(FORMS[form], head, h, ids)
    torch._dynamo.reset()
    sloth.reset_report()
    got = run(torch.compile(FORMS[form], backend="sloth"), head, h, ids)
    report = sloth.report()
    assert report.counts.get("token_logprobs") == 1, report
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    site = next(s for s in report.sites if s.family == "token_logprobs")
    assert ("entropy" in site.detail) == (form == "grpo"), site.detail


def test_a_bf16_head_under_the_tolerance_rule():
    head = Head(dtype=torch.bfloat16)
    h, ids = torch.randn(3, 5, 16, dtype=torch.bfloat16), torch.randint(0, 50, (3, 5))
    want = run(dpo_style, head, h, ids)
    torch._dynamo.reset()
    got = run(torch.compile(dpo_style, backend="sloth"), head, h, ids)
    # the fused op computes in fp32 from the bf16 tile, as eager does after .float(): within bf16 rounding
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def _reasons():
    return [r.reason for r in sloth.report().rejections if r.family == "token_logprobs"]


def test_two_gathers_of_one_log_softmax_are_reported():
    head = Head()

    def two(h, a, b):
        lsm = F.log_softmax(head.lm_head(h), dim=-1)
        return (selective(lsm, a) - selective(lsm, b)).sum()

    torch._dynamo.reset()
    sloth.reset_report()
    h = torch.randn(2, 3, 16)
    a, b = torch.randint(0, 50, (2, 3)), torch.randint(0, 50, (2, 3))
    torch.testing.assert_close(torch.compile(two, backend="sloth")(h, a, b), two(h, a, b))
    assert _reasons() == ["one log-softmax gathered at two sets of labels"], _reasons()


def test_a_log_softmax_read_elsewhere_is_reported_and_kept():
    head = Head()

    def returned(h, ids):
        lsm = F.log_softmax(head.lm_head(h), dim=-1)
        return selective(lsm, ids).sum(), lsm

    torch._dynamo.reset()
    sloth.reset_report()
    h, ids = torch.randn(2, 3, 16), torch.randint(0, 50, (2, 3))
    got, want = torch.compile(returned, backend="sloth")(h, ids), returned(h, ids)
    torch.testing.assert_close(got, want)
    assert sloth.report().counts.get("token_logprobs") is None
    assert any("other users" in r for r in _reasons()), _reasons()


def test_logits_that_are_not_a_linears_are_left_alone():
    def plain(z, ids):
        return selective(F.log_softmax(z, dim=-1), ids).sum()

    torch._dynamo.reset()
    sloth.reset_report()
    z, ids = torch.randn(2, 3, 9), torch.randint(0, 9, (2, 3))
    torch.testing.assert_close(torch.compile(plain, backend="sloth")(z, ids), plain(z, ids))
    assert sloth.report().counts.get("token_logprobs") is None and _reasons() == []
