"""The fused op ``sloth.lowering.moe_router_biased``: routing weights, chosen experts and d logits against the
pattern.

Oracle: the router as transformers writes it (``router_pattern``: DeepSeek-V3's TopkRouter generalised over the
forms of its kin: sigmoid or softmax scores, the bias added to the scores or to the logits, groups scored by
their top-2 sum or their max, masked with -inf or 0, the renormalisation by ``sum + eps`` or ``clamp(sum, eps)``),
run eagerly at the tested dtype ("eager") and in float64 (the reference). The indices must equal the
reference's as a set per token (the op returns them in descending order of choice; transformers' ``sorted=False``
promises none); the weights, compared in that order, and the logits' gradient follow the tolerance rule.

Logits are tie-free (distinct bf16 values), the bias a fixed random draw; shapes: DeepSeek-V3's 256 experts in 8
groups, top-4 groups, top-8 at few tokens (the interpreter is slow), 64 experts in 8 groups at more tokens,
GLM-4.5-Air-like flat 128 top-8, Mixtral-sized 8 top-2, a partial last program and several programs, an expert
count that is not a power of two, k equal to the experts.
"""
from __future__ import annotations

import math

import pytest
import torch

import sloth.lowering.moe_router_biased as lowering
from sloth.lowering.moe_router_biased import moe_router_biased, RENORM_ADD, RENORM_CLAMP, RENORM_NONE
from tolerance import assert_close
from op_checks import force_fallback
from test_moe_router_op import tie_free_logits

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}
NEG_INF = float("-inf")

# name: (tokens, experts, k, n_group, topk_group)
CASES = {
    "deepseek-v3": (5, 256, 8, 8, 4),
    "grouped-64": (37, 64, 6, 8, 3),
    "flat-128": (23, 128, 8, 1, 1),
    "mixtral-sized": (19, 8, 2, 1, 1),
    "many-programs": (301, 16, 3, 4, 2),  # 256 rows a program at 16 experts: two programs, the last partial
    "padded-experts": (7, 12, 5, 4, 3),  # 12 experts in a block of 16: the padding in no group, never chosen
    "k-equals-experts": (6, 6, 6, 3, 3),
}
# name: dict of the op's options (score, choose_logits, bias, group_top2, fill, renorm, eps)
FORMS = {
    "deepseek": dict(score="sigmoid", choose_logits=False, bias=True, group_top2=True, fill=NEG_INF,
                     renorm=RENORM_ADD, eps=1e-20),
    "minimax-no-eps": dict(score="sigmoid", choose_logits=False, bias=True, group_top2=True, fill=NEG_INF,
                           renorm=RENORM_ADD, eps=0.0),
    "kolibri-logits-choice": dict(score="sigmoid", choose_logits=True, bias=True, group_top2=True, fill=NEG_INF,
                                  renorm=RENORM_NONE, eps=0.0),
    "ernie-softmax-clamp": dict(score="softmax", choose_logits=False, bias=True, group_top2=False, fill=NEG_INF,
                                renorm=RENORM_CLAMP, eps=1e-12),
    "v2-softmax-max-fill0": dict(score="softmax", choose_logits=False, bias=False, group_top2=False, fill=0.0,
                                 renorm=RENORM_NONE, eps=0.0),
}


def router_pattern(logits, bias, k, n_group, topk_group, score, choose_logits, group_top2, fill, renorm, eps):
    """The router as DeepSeek-V3's TopkRouter and its kin write it, in float64 when given float64, else fp32."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    scores = logits.sigmoid() if score == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = logits if choose_logits else scores
    if bias is not None:
        choice = choice + bias.to(dtype)
    experts = logits.shape[1]
    if n_group > 1:
        grouped = choice.view(-1, n_group, experts // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if group_top2 else grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, experts // n_group).reshape(-1, experts)
        choice = choice.masked_fill(~score_mask.bool(), fill)
    idx = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    w = (logits.gather(1, idx).sigmoid() if choose_logits else scores.gather(1, idx))
    if renorm == RENORM_ADD:
        w = w / (w.sum(dim=-1, keepdim=True) + eps)
    elif renorm == RENORM_CLAMP:
        w = w / torch.clamp(w.sum(dim=-1, keepdim=True), min=eps)
    return w, idx


def _in_order(w, idx, order):
    """w and idx permuted per row so that idx equals ``order`` (the same set of experts)."""
    where = (idx.unsqueeze(-1) == order.unsqueeze(-2)).int().argmax(dim=1)
    return w.gather(1, where), idx.gather(1, where)


def run(fn, logits, dw, order=None):
    logits = logits.detach().requires_grad_(True)
    w, idx = fn(logits)
    if order is not None:
        w, idx = _in_order(w, idx, order)
    (dl,) = torch.autograd.grad(w, logits, dw.to(w.dtype))
    return w.detach(), idx, dl


def check(case, form, dtype, seed=0, out_dtype=torch.float32, device="cpu"):
    tokens, experts, k, n_group, topk_group = case
    options = dict(form)
    use_bias = options.pop("bias")
    g = torch.Generator().manual_seed(seed + 2)
    bias = ((torch.rand(experts, generator=g) - 0.5) * 0.2).to(device) if use_bias else None
    logits = tie_free_logits(tokens, experts, seed, device)
    dw = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed + 1)).to(device)

    def ours_fn(l):
        return moe_router_biased(l, bias, k, n_group=n_group, topk_group=topk_group, out_dtype=out_dtype, **options)

    def eager(l):
        w, idx = router_pattern(l, bias, k, n_group, topk_group, **options)
        return (w if l.dtype == torch.float64 else w.to(out_dtype)), idx

    ours = run(ours_fn, logits.to(dtype), dw)
    order = ours[1]
    ref = run(eager, logits.double(), dw, order)
    theirs = run(eager, logits.to(dtype), dw, order)
    name = f"{case} {form}"
    assert ours[1].dtype == torch.int64 and torch.equal(ours[1], ref[1]), f"{name}: other experts chosen"
    assert torch.equal(theirs[1], ref[1])  # tie-free: eager chooses the same
    # In descending order of choice (the pattern's values, in float64)
    choice = logits.double().sigmoid() if options["score"] == "sigmoid" else torch.softmax(logits.double(), -1)
    if options["choose_logits"]:
        choice = logits.double()
    if bias is not None:
        choice = choice + bias.double()
    picked = choice.gather(1, ours[1])
    assert (picked[:, :-1] >= picked[:, 1:]).all(), f"{name}: not in descending order of choice"
    assert_close(f"{name} weights", ours[0], theirs[0], ref[0])
    assert_close(f"{name} d logits", ours[2], theirs[2], ref[2])


@pytest.mark.parametrize("dtype", list(DTYPE_IDS), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_pattern(case, form, dtype, device):
    check(CASES[case], FORMS[form], dtype, device=device)


def test_weights_in_bf16(device):
    check(CASES["grouped-64"], FORMS["deepseek"], torch.float32, out_dtype=torch.bfloat16, device=device)


@pytest.mark.parametrize("form", ["deepseek", "ernie-softmax-clamp"])
def test_fallback_matches_pattern(monkeypatch, form, device):
    force_fallback(monkeypatch, lowering, "_moe_router_biased_fwd_kernel", "_moe_router_biased_bwd_kernel")
    check(CASES["grouped-64"], FORMS[form], torch.float32, device=device)


def test_groups_are_kept_whole(device):
    # Two groups of 4; group 1 holds the single best expert but group 0 the better top-2 sum: top-2 scoring keeps
    # group 0, max scoring keeps group 1.
    logits = torch.tensor([[1.0, 0.9, -3.0, -3.0, 2.0, -3.0, -3.0, -3.0]], device=device)
    for top2, expected in ((True, {0, 1}), (False, {4, 5})):
        _, idx = moe_router_biased(logits, None, 2, n_group=2, topk_group=1, group_top2=top2)
        assert set(idx[0].tolist()) == expected, (top2, idx)


def test_clamp_below_eps(device):
    # renorm 2 with the selected sum under eps: the weights are s / eps and the gradient dw / eps times s'.
    logits = torch.full((3, 6), -30.0, device=device).requires_grad_(True)
    w, idx = moe_router_biased(logits, None, 2, renorm=RENORM_CLAMP, eps=1e-3)
    s = torch.sigmoid(torch.tensor(-30.0))
    torch.testing.assert_close(w, torch.full((3, 2), float(s / 1e-3), device=device))
    dw = torch.randn(3, 2, device=device)
    (dl,) = torch.autograd.grad(w, logits, dw)
    torch.testing.assert_close(dl, lowering.moe_router_biased_backward_reference(
        dw, logits.detach(), idx, "sigmoid", RENORM_CLAMP, 1e-3))


def test_ties_pick_the_lower_index(device):
    # Equal logits, no bias: the first k experts; a masked (fill 0) row keeps the lowest masked indices.
    logits = torch.zeros(2, 8, device=device)
    assert moe_router_biased(logits, None, 3)[1].tolist() == [[0, 1, 2]] * 2
    # Groups of 2; only group 3 kept (bias); k = 3 > 2 kept experts: the third is the lowest masked index (0 fill).
    bias = torch.tensor([0.0] * 6 + [5.0, 5.0], device=device)
    idx = moe_router_biased(torch.zeros(1, 8, device=device), bias, 3, n_group=4, topk_group=1, fill=0.0)[1]
    assert idx.tolist() == [[6, 7, 0]]


def test_no_tokens(device):
    logits = torch.zeros(0, 8, device=device, requires_grad=True)
    w, idx = moe_router_biased(logits, torch.zeros(8, device=device), 2, n_group=2, topk_group=1, renorm=RENORM_ADD)
    assert w.shape == (0, 2) and idx.shape == (0, 2)
    (dl,) = torch.autograd.grad(w.sum(), logits, allow_unused=True)
    assert dl is None or dl.shape == (0, 8)


def test_bad_input_is_named(device):
    with pytest.raises(ValueError, match=r"\[tokens, experts\]"):
        moe_router_biased(torch.zeros(2, 3, 8, device=device), None, 2)
    with pytest.raises(ValueError, match="bias must be"):
        moe_router_biased(torch.zeros(4, 8, device=device), torch.zeros(7, device=device), 2)
    with pytest.raises(ValueError, match="n_group must divide"):
        moe_router_biased(torch.zeros(4, 8, device=device), None, 2, n_group=3)
    with pytest.raises(ValueError, match="n_group must divide"):
        moe_router_biased(torch.zeros(4, 8, device=device), None, 2, n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="top-2 score needs 2"):
        moe_router_biased(torch.zeros(4, 8, device=device), None, 2, n_group=8, topk_group=2)
    with pytest.raises(ValueError, match="k must be in"):
        moe_router_biased(torch.zeros(4, 8, device=device), None, 9)
    with pytest.raises(ValueError, match="score must be"):
        moe_router_biased(torch.zeros(4, 8, device=device), None, 2, score="tanh")
    with pytest.raises(ValueError, match="choose_logits"):
        moe_router_biased(torch.zeros(4, 8, device=device), None, 2, score="softmax", choose_logits=True)
    with pytest.raises(ValueError, match="fill must be"):
        moe_router_biased(torch.zeros(4, 8, device=device), None, 2, n_group=2, fill=1.0)


def test_opcheck(device):
    lowering.register()
    logits = tie_free_logits(7, 16, device=device).requires_grad_()
    bias = torch.rand(16, device=device)
    torch.library.opcheck(torch.ops.sloth.moe_router_biased.default,
                          (logits, bias, 3, "sigmoid", False, 4, 2, True, NEG_INF, RENORM_ADD, 1e-20, torch.float32))
    torch.library.opcheck(torch.ops.sloth.moe_router_biased.default,
                          (logits, None, 3, "softmax", False, 1, 1, False, NEG_INF, RENORM_CLAMP, 1e-12,
                           torch.float32))
