"""The bias-corrected routers of the ``moe_router`` family: a top-k that only chooses the experts, over sigmoid or
softmax scores plus a bias, within the best groups or not, becomes ``sloth.moe_router_biased``; output and every
gradient within the tolerance rule of eager's; the forms the op does not compute stay, with the reason.

Transformers' routers of this kind (DeepSeek-V3 and GLM-4.5 grouped, MiniMax-M2's in-place renormalisation,
Kolibri's choice by the logits, ERNIE-4.5's softmax with a clamped renormalisation, Laguna) run through
benchmarks/coverage.py's one-model check (the whole model's loss and gradients against eager and float64);
routers written by hand in forms no transformers class uses run through ``BiasedRouter``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sloth
from tests.pattern_checks import seeded
from tests.test_moe_pattern import _hand_written_grads
from tests.test_moe_router_pattern import HIDDEN, _through_sloth

EXPERTS, GROUPS, KEPT = 8, 4, 2  # HIDDEN and _through_sloth: tests/test_moe_router_pattern.py


class BiasedRouter(nn.Module):
    """A router with a score correction bias and a stand-in for its experts: each token's output is
    ``x + sum_i w_i * table[idx_i]``, so the weights' gradient reaches the router's projection and the indices
    decide which rows of ``table`` train. ``route(logits, k, bias) -> (w, idx)`` is the form under test."""

    def __init__(self, route, top_k: int = 2, aux: bool = False):
        super().__init__()
        g = seeded(7)
        self.proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, generator=g))
        self.table = nn.Parameter(torch.randn(EXPERTS, HIDDEN, generator=g))
        self.register_buffer("bias", (torch.rand(EXPERTS, generator=g) - 0.5) * 0.4)
        self.route, self.top_k, self.aux = route, top_k, aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x @ self.proj.t()
        w, idx = self.route(logits, self.top_k, self.bias)
        out = x + (w.unsqueeze(-1).to(x.dtype) * self.table[idx]).sum(1)
        if self.aux:  # a load-balancing term reading the scores over all experts: they stay for it
            counts = F.one_hot(idx, EXPERTS).sum((0, 1)).to(x.dtype)
            out = out + (torch.sigmoid(logits).mean(0) * counts).sum() * 0.1
        return out


def grouped_by_ranks(logits, k, bias):
    # DeepSeek-V3's math, its group mask written as ranks compared with the kept count, expanded by
    # repeat_interleave, the weights gathered by torch.gather, renormalised and scaled.
    scores = torch.sigmoid(logits)
    choice = scores + bias
    group_scores = choice.unflatten(-1, (GROUPS, EXPERTS // GROUPS)).topk(2, dim=-1).values.sum(-1)
    ranks = group_scores.argsort(dim=-1, descending=True).argsort(dim=-1)
    outside = (ranks >= KEPT).repeat_interleave(EXPERTS // GROUPS, dim=-1)
    idx = choice.masked_fill(outside, float("-inf")).topk(k, dim=-1, sorted=False).indices
    w = torch.gather(scores, -1, idx)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5, idx


def grouped_by_max_one_hot(logits, k, bias):
    # Groups scored by their max (DeepSeek-V2's way), the kept groups as a summed one-hot, masked with 0.0. The
    # bias made positive: a kept expert's choice below the fill would tie the masked ones at 0 for the last places,
    # where eager's pick is torch.topk's own (the op takes the lower index).
    scores = logits.sigmoid()
    choice = bias.abs() + scores
    group_scores = choice.view(-1, GROUPS, EXPERTS // GROUPS).amax(dim=-1)
    kept = F.one_hot(group_scores.topk(KEPT, dim=-1)[1], GROUPS).sum(1).bool()
    outside = ~kept[:, :, None].expand(-1, GROUPS, EXPERTS // GROUPS).reshape(-1, EXPERTS)
    _, idx = torch.topk(torch.masked_fill(choice, outside, 0.0), k, dim=-1)
    return scores.gather(1, idx), idx


def flat_scores_written_twice(logits, k, bias):
    idx = (torch.sigmoid(logits) + bias).topk(k).indices
    w = torch.sigmoid(logits).gather(1, idx)
    return w / w.sum(dim=-1, keepdim=True), idx


def logits_choose(logits, k, bias):  # Kolibri: the biased logits choose; the weights are the sigmoid of the k
    idx = torch.topk(logits + bias, k, dim=-1)[1]
    w = logits.gather(1, idx).sigmoid()
    return torch.div(w, w.sum(-1, keepdim=True)), idx


def softmax_clamped(logits, k, bias):  # ERNIE-4.5: softmax scores, the bias as [1, E], a clamped renormalisation
    probs = F.softmax(logits, dim=-1)
    idx = torch.topk(probs + bias[None], k, dim=-1).indices
    w = probs.gather(-1, idx)
    return w / w.sum(-1, keepdim=True).clamp(min=1e-12), idx


def renormalised_and_scaled_in_place(logits, k, bias):  # DeepSeek-V3 reference's Gate: in place, then *= scale
    scores = logits.sigmoid()
    idx = torch.topk(scores + bias, k, dim=-1)[1]
    w = scores.gather(1, idx)
    w /= w.sum(dim=-1, keepdim=True)
    w *= 2.5
    return w, idx


def softmax_indices_only(logits, k, bias):  # no bias: the weights gathered from the probabilities
    probs = logits.softmax(-1)
    idx = torch.topk(probs, k, dim=-1).indices
    return probs.gather(1, idx), idx


FORMS = {
    "grouped-by-ranks": (grouped_by_ranks, f"sigmoid scores, top-{{k}} of sigmoid + bias, best {KEPT} of {GROUPS} "
                                           "groups by top-2 sum, renormalised (+1e-20)"),
    "grouped-by-max-one-hot": (grouped_by_max_one_hot, f"best {KEPT} of {GROUPS} groups by max"),
    "flat-scores-written-twice": (flat_scores_written_twice, "top-{k} of sigmoid + bias, renormalised (+0)"),
    "logits-choose": (logits_choose, "top-{k} of logits + bias, renormalised (+0)"),
    "softmax-clamped": (softmax_clamped, "softmax scores, top-{k} of softmax + bias, renormalised (clamp 1e-12)"),
    "scaled-in-place": (renormalised_and_scaled_in_place, "top-{k} of sigmoid + bias, renormalised (+0)"),
    "softmax-indices-only": (softmax_indices_only, "softmax scores, top-{k} of softmax, 8 experts"),
}


@pytest.mark.parametrize("top_k", [2, 3])
@pytest.mark.parametrize("form", list(FORMS))
def test_hand_written_routers_are_fused(form, top_k):
    route, expected = FORMS[form]
    (_, grads), report = _through_sloth(BiasedRouter(route, top_k))
    [site] = [s for s in report.sites if s.family == "moe_router"]
    assert site.op == "sloth.moe_router_biased" and expected.format(k=top_k) in site.detail, site.detail
    assert not [r for r in report.rejections if r.family == "moe_router"], str(report)
    assert grads["proj"].abs().sum() > 0 and grads["table"].abs().sum() > 0


def test_scores_an_aux_loss_reads_stay():
    (_, grads), report = _through_sloth(BiasedRouter(flat_scores_written_twice, aux=True))
    assert report.counts.get("moe_router") == 1, str(report)
    assert grads["proj"].abs().sum() > 0


def worst_groups(logits, k, bias):  # the mask keeps the worst groups: not the op's function
    scores = torch.sigmoid(logits)
    choice = scores + bias
    group_scores = choice.view(-1, GROUPS, EXPERTS // GROUPS).topk(2, dim=-1)[0].sum(-1)
    mask = torch.zeros_like(group_scores)
    mask.scatter_(1, torch.topk(group_scores, KEPT, dim=-1, largest=False)[1], 1)
    outside = ~mask.unsqueeze(-1).expand(-1, GROUPS, EXPERTS // GROUPS).reshape(-1, EXPERTS).bool()
    idx = torch.topk(choice.masked_fill(outside, float("-inf")), k, dim=-1)[1]
    return scores.gather(1, idx), idx


def bias_from_logits(logits, k, bias):
    scores = torch.sigmoid(logits)
    idx = torch.topk(scores + logits.mean(0), k, dim=-1)[1]
    return scores.gather(1, idx), idx


def bf16_scores(logits, k, bias):
    scores = torch.sigmoid(logits.bfloat16())
    idx = torch.topk(scores + bias.bfloat16(), k, dim=-1)[1]
    return scores.gather(1, idx).float(), idx


REFUSED = {
    "worst-groups": (worst_groups, "is not 'outside the best groups'"),
    "bias-from-logits": (bias_from_logits, "the bias is computed from the router's logits"),
    "bf16-scores": (bf16_scores, "the scores are not float32"),
}


@pytest.mark.parametrize("form", list(REFUSED))
def test_other_forms_stay_with_reason(form):
    route, reason = REFUSED[form]
    x = torch.randn(29, HIDDEN, generator=seeded(8))
    module = BiasedRouter(route)
    sloth.reset_report()
    ours = _hand_written_grads(module, x, torch.compile(module, backend="sloth", options={"inner": "aot_eager"}))
    report = sloth.report()
    eager = _hand_written_grads(module, x)
    torch.testing.assert_close(ours[0], eager[0])  # left as written: eager's numbers
    assert report.counts.get("moe_router", 0) == 0, str(report)
    reasons = [r.reason for r in report.rejections if r.family == "moe_router"]
    assert any(reason in r for r in reasons), reasons


def _group_mask(choice):  # DeepSeek-V3's: 1 in the kept groups, [T, G]
    group_scores = choice.view(-1, GROUPS, EXPERTS // GROUPS).topk(2, dim=-1)[0].sum(-1)
    mask = torch.zeros_like(group_scores)
    mask.scatter_(1, torch.topk(group_scores, KEPT, dim=-1)[1], 1)
    return mask


def _outside(mask):
    return ~mask.unsqueeze(-1).expand(-1, GROUPS, EXPERTS // GROUPS).reshape(-1, EXPERTS).bool()


def choice_masked_in_place(logits, k, bias):  # the topk reads the add node, written by masked_fill_
    scores = torch.sigmoid(logits)
    choice = scores + bias
    choice.masked_fill_(_outside(_group_mask(choice)), 0.0)
    return scores.gather(1, torch.topk(choice, k, dim=-1)[1]), torch.topk(choice, k, dim=-1)[1]


def group_mask_set_after(logits, k, bias):  # a setitem into the group mask after its scatter_
    scores = torch.sigmoid(logits)
    choice = scores + bias
    mask = _group_mask(choice)
    mask[:, 0] = 1.0
    idx = torch.topk(choice.masked_fill(_outside(mask), float("-inf")), k, dim=-1)[1]
    return scores.gather(1, idx), idx


def mask_inverted_in_place(logits, k, bias):
    scores = torch.sigmoid(logits)
    choice = scores + bias
    outside = _outside(_group_mask(choice))
    outside.logical_not_()
    idx = torch.topk(choice.masked_fill(outside, float("-inf")), k, dim=-1)[1]
    return scores.gather(1, idx), idx


def logits_written_after_scores(logits, k, bias):
    logits = logits * 1.0
    scores = torch.sigmoid(logits)
    logits.mul_(-1.0)
    idx = torch.topk(scores + bias, k, dim=-1)[1]
    return scores.gather(1, idx) + 0.0 * logits[:, :k], idx


def choice_set_before_topk(logits, k, bias):
    scores = torch.sigmoid(logits)
    choice = scores + bias
    choice[:, 0] = 10.0
    idx = torch.topk(choice, k, dim=-1)[1]
    return scores.gather(1, idx), idx


def logits_detached(logits, k, bias):  # the weights' gradient stops at the detach: the op's input is the detach
    scores = torch.sigmoid(logits.detach())
    idx = torch.topk(scores + bias, k, dim=-1)[1]
    return torch.gather(input=scores, dim=1, index=idx) + 0.0 * logits[:, :k], idx


def weights_written_before_renorm(logits, k, bias):
    scores = torch.sigmoid(logits)
    idx = torch.topk(scores + bias, k, dim=-1)[1]
    w = scores.gather(1, idx)
    w.mul_(2.0)
    return w / w.sum(-1, keepdim=True), idx


TRICKY = {"choice-masked-in-place": choice_masked_in_place, "group-mask-set-after": group_mask_set_after,
          "mask-inverted-in-place": mask_inverted_in_place, "logits-written-after-scores": logits_written_after_scores,
          "choice-set-before-topk": choice_set_before_topk, "logits-detached": logits_detached,
          "weights-written-before-renorm": weights_written_before_renorm}


@pytest.mark.parametrize("form", list(TRICKY))
def test_in_place_writes_and_detaches_stay_right(form):
    # Writes into the router's tensors that the op would not see, and a detach it must keep: each compiled router
    # computes what eager does, fused or left as written (then with the reason).
    (_, grads), report = _through_sloth(BiasedRouter(TRICKY[form]))
    fused = report.counts.get("moe_router", 0)
    reasons = [r.reason for r in report.rejections if r.family == "moe_router"]
    assert fused or any("writes" in r or "outside the best groups" in r for r in reasons), (fused, reasons)
    if form == "logits-detached":
        assert fused == 1, reasons


# model type: config fields set after benchmarks/coverage.py's shrinking (8 experts, grouped where it groups)
MODELS = {
    "deepseek_v3": dict(n_routed_experts=8, n_group=4, topk_group=2),
    "glm4_moe": dict(n_routed_experts=8, n_group=2, topk_group=1),
    "minimax_m2": dict(num_local_experts=8),
    "kolibri1": dict(num_experts=8, norm_topk_prob=True),
    "ernie4_5_moe": dict(moe_num_experts=8),
    "laguna": dict(num_experts=8),
}


@pytest.mark.parametrize("model_type", list(MODELS))
def test_transformers_routers_are_fused(model_type):
    from transformers import CONFIG_MAPPING

    from benchmarks.coverage import run_one

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no {model_type} in this version")
    row = run_one(model_type, MODELS[model_type])
    assert row["status"] == "ok", row.get("traceback", row)
    family = row["families"]["moe_router"]
    assert family["replaced"] >= 1 and family["left"] == 0, family
    assert row["parity"] == "pass", row["parity"]


# One group (GLM-4.5, 4.6 and 4.7, Kimi-K2 on DeepSeek-V3's code: n_group = topk_group = 1): the group mask keeps
# every expert, a [tokens, 1, experts] view of the scores that the pattern once did not take for a group view, so
# the router ran as written with three sites reported.
@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v3"])
def test_one_group_routers_are_fused(model_type):
    from transformers import CONFIG_MAPPING

    from benchmarks.coverage import run_one

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no {model_type} in this version")
    row = run_one(model_type, dict(n_routed_experts=8, n_group=1, topk_group=1))
    assert row["status"] == "ok", row.get("traceback", row)
    family = row["families"]["moe_router"]
    assert family["replaced"] >= 1 and family["left"] == 0, family
    assert row["parity"] == "pass", row["parity"]
