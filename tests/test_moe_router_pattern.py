"""The MoE router family (``moe_router``): a router's top-k with its scoring, however written, becomes
``sloth.moe_router``; output and every gradient within the tolerance rule of eager's; the forms the op does not
compute stay, with the reason.

The transformers models' routers are checked with their experts in tests/test_moe_pattern.py (Qwen3-MoE,
Qwen2-MoE, OLMoE, Mixtral, MiniMax, Granite-MoE, GPT-OSS); here, routers written by hand in forms no
transformers class uses, Qwen3-MoE with ``norm_topk_prob`` (its in-place renormalisation), and the refusals.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sloth
from tests.pattern_checks import seeded
from tests.test_moe_pattern import _compare, _hand_written_grads, moe_model
from tests.test_models import assert_model_close
from op_checks import StayFloat64
from tolerance import assert_close

EXPERTS, HIDDEN = 6, 16


class Router(nn.Module):
    """A router and a stand-in for its experts: each token's output is ``sum_i w_i * table[idx_i]`` plus ``x``, so
    the routing weights' gradient reaches the router's projection and the indices decide which rows of ``table``
    train. ``route(logits) -> (w, idx)`` is the form under test; ``aux`` adds a load-balancing term that reads the
    softmax over all experts (the router's probabilities stay for it)."""

    def __init__(self, route, top_k: int = 2, aux: bool = False):
        super().__init__()
        g = seeded(7)
        self.proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, generator=g))
        self.table = nn.Parameter(torch.randn(EXPERTS, HIDDEN, generator=g))
        self.route, self.top_k, self.aux = route, top_k, aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x @ self.proj.t()
        w, idx = self.route(logits, self.top_k)
        out = x + (w.unsqueeze(-1).to(x.dtype) * self.table[idx]).sum(1)
        if self.aux:
            probs = logits.softmax(-1)
            counts = F.one_hot(idx, EXPERTS).sum((0, 1)).to(x.dtype)
            out = out + (probs.mean(0) * counts).sum() * 0.1
        return out


def softmax_topk_method_forms(logits, k):
    probs = logits.float().softmax(dim=-1)
    top = probs.topk(k)
    return top.values, top.indices


def softmax_topk_renorm_in_place(logits, k):
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    w, idx = torch.topk(probs, k, dim=1)
    w /= w.sum(dim=-1, keepdim=True)
    return w, idx


def softmax_topk_renorm_scaled_in_place(logits, k):  # DeepSeek-V3 reference's Gate (softmax): w *= route_scale
    w, idx = torch.topk(logits.softmax(-1), k, dim=-1)
    w /= w.sum(dim=-1, keepdim=True)
    w *= 2.5
    return w, idx


def softmax_topk_renorm_div(logits, k):
    w, idx = F.softmax(logits, dim=1).topk(k, -1, True, True)
    return torch.div(w, w.sum(-1, keepdim=True)), idx


def topk_then_softmax(logits, k):  # GPT-OSS's and Granite-MoE's order
    top, idx = torch.topk(logits, k, dim=-1, sorted=True)
    return F.softmax(top, dim=1, dtype=torch.float), idx


FORMS = {
    "softmax-topk-methods": (softmax_topk_method_forms, "softmax, top-{k}, 6 experts"),
    "renorm-in-place": (softmax_topk_renorm_in_place, "softmax, top-{k}, renormalised, 6 experts"),
    "renorm-scaled-in-place": (softmax_topk_renorm_scaled_in_place, "softmax, top-{k}, renormalised, 6 experts"),
    "renorm-div": (softmax_topk_renorm_div, "softmax, top-{k}, renormalised, 6 experts"),
    "topk-softmax": (topk_then_softmax, "top-{k}, softmax over the k, 6 experts"),
}


def _through_sloth(module: nn.Module, tokens: int = 29) -> tuple:
    """(sloth's output and gradients, sloth's report), after checking each against eager's and float64's (the
    forms' fp32 upcasts kept float64) by the tolerance rule."""
    x = torch.randn(tokens, HIDDEN, generator=seeded(8))
    sloth.reset_report()
    ours = _hand_written_grads(module, x, torch.compile(module, backend="sloth", options={"inner": "aot_eager"}))
    report = sloth.report()
    eager = _hand_written_grads(module, x)
    with StayFloat64():
        reference = _hand_written_grads(module.double(), x.double())
    module.float()
    assert_close("output", ours[0], eager[0], reference[0])
    for name in eager[1]:
        assert_close(f"d {name}", ours[1][name], eager[1][name], reference[1][name])
    return ours, report


@pytest.mark.parametrize("top_k", [2, 1, EXPERTS])
@pytest.mark.parametrize("form", list(FORMS))
def test_hand_written_routers_are_fused(form, top_k):
    route, expected = FORMS[form]
    (_, grads), report = _through_sloth(Router(route, top_k))
    [site] = [s for s in report.sites if s.family == "moe_router"]
    assert expected.format(k=top_k) in site.detail, site.detail
    assert not [r for r in report.rejections if r.family == "moe_router"], str(report)
    constant = top_k == 1 and form != "softmax-topk-methods"  # one weight renormalised or softmaxed: w = 1
    assert (grads["proj"].abs().sum() > 0) != constant


def test_probabilities_an_aux_loss_reads_stay():
    # The softmax over all experts feeds the aux term and the top-k: the op takes the top-k, the softmax stays
    # for the aux term, and the router's gradient is the sum of both paths, as eager's.
    (_, grads), report = _through_sloth(Router(softmax_topk_renorm_in_place, aux=True))
    assert report.counts.get("moe_router") == 1, str(report)
    assert grads["proj"].abs().sum() > 0


def test_qwen3_moe_norm_topk_prob_is_fused():
    model = moe_model("qwen3_moe", "grouped_mm", norm_topk_prob=True)
    ours, eager, reference, report = _compare(model, torch.float32)
    routers = [s.detail for s in report.sites if s.family == "moe_router"]
    assert len(routers) == model.config.num_hidden_layers and all("renormalised" in d for d in routers), str(report)
    assert_model_close(ours, eager, reference, torch.float32)


def sigmoid_router(logits, k):  # the top-k's values of sigmoid scores (tests/test_moe_router_biased_pattern.py
    # has the gathered form, which is fused)
    scores = logits.sigmoid()
    w, idx = scores.topk(k, dim=-1)
    return w / w.sum(-1, keepdim=True), idx


def smallest_k(logits, k):
    w, idx = torch.topk(logits.softmax(-1), k, dim=-1, largest=False)
    return w, idx


def indices_only_gathered_elsewhere(logits, k):  # the indices alone read; the weights gathered from other scores
    idx = torch.topk(logits.softmax(-1), k, dim=-1).indices
    return torch.sigmoid(logits).gather(1, idx), idx


def logits_read_twice(logits, k):
    top, idx = torch.topk(logits, k, dim=-1)
    return F.softmax(top, dim=-1) + 0.01 * top, idx


def logits_written_after_topk(logits, k):  # the op's backward reads the logits as they were
    w, idx = torch.topk(logits.softmax(-1), k, dim=-1)
    logits.mul_(2.0)
    return w + 0.0 * logits[:, :k], idx


def batched_scores(logits, k):  # [1, T, E]: the op takes [tokens, experts]
    w, idx = torch.topk(logits.softmax(-1).unsqueeze(0), k, dim=-1)
    return w[0], idx[0]


REFUSED = {
    "sigmoid": (sigmoid_router, "sigmoid scores"),
    "smallest": (smallest_k, "the smallest k"),
    "indices-only": (indices_only_gathered_elsewhere, "only the indices"),
    "logits-read-twice": (logits_read_twice, "not softmaxed after it"),
    "3-d": (batched_scores, "3-D"),
    "logits-written": (logits_written_after_topk, "writes in place into the router's"),
}


@pytest.mark.parametrize("form", list(REFUSED))
def test_other_forms_stay_with_reason(form):
    route, reason = REFUSED[form]
    _, report = _through_sloth(Router(route))
    assert report.counts.get("moe_router", 0) == 0, str(report)
    reasons = [r.reason for r in report.rejections if r.family == "moe_router"]
    assert len(reasons) == 1 and reason in reasons[0], reasons


def test_more_experts_than_one_pass_holds_stay_with_reason(monkeypatch):
    import sloth.lowering.moe_router as lowering

    monkeypatch.setattr(lowering, "MAX_EXPERTS", 4)
    _, report = _through_sloth(Router(softmax_topk_method_forms))
    [reason] = [r.reason for r in report.rejections if r.family == "moe_router"]
    assert "outside the kernel's limits" in reason and "experts <= 4" in reason, reason
