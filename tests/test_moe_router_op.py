"""The fused op ``sloth.lowering.moe_router``: routing weights, chosen experts and d logits against the pattern.

Oracle: the router as transformers writes it (``router_pattern`` below: softmax over the experts in fp32, top-k,
the optional renormalisation; or top-k of the logits, softmax over the k), run eagerly at the tested dtype
("eager") and in float64 (the reference). The indices must equal the reference's exactly; the weights and the
logits' gradient follow the tolerance rule.

Logits are tie-free by construction (each row a random choice of distinct values representable in bf16), so that
the experts chosen do not depend on rounding or on how ``torch.topk`` breaks ties; ties are tested on their own
(the op takes the lower index). Shapes: the experts of Qwen3-MoE (128, top-8), Mixtral (8, top-2), OLMoE (64,
top-8), GPT-OSS (32, top-4), Qwen2-MoE's 60, top-1, k = E, the kernel's limits (512 experts, top-32), token
counts that leave a partial last program and several programs.
"""
from __future__ import annotations

import pytest
import torch

import sloth.lowering.moe_router as lowering
from sloth.lowering.moe_router import moe_router
from tolerance import assert_close, rms
from op_checks import force_fallback

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}

# (tokens, experts, k)
CASES = {
    "qwen3-moe": (37, 128, 8),
    "mixtral": (19, 8, 2),
    "olmoe": (23, 64, 8),
    "gpt-oss": (13, 32, 4),
    "qwen2-moe-top1": (11, 60, 1),
    "k-equals-experts": (6, 5, 5),
    "many-programs": (601, 16, 3),  # 256 rows a program at 16 experts: three programs, the last partial
    "limits": (3, 512, 32),
}
# (softmax_first, renorm)
MODES = {"softmax-topk": (True, False), "softmax-topk-renorm": (True, True), "topk-softmax": (False, False)}

# 2**12 distinct bf16 values in [-6, 6]: any choice of them without repeats is a tie-free row in every dtype.
_DISTINCT = torch.linspace(-6, 6, 2 ** 14).bfloat16().unique().float()


def tie_free_logits(tokens: int, experts: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """Drawn on the CPU (the same values on every device) and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.stack([torch.randperm(len(_DISTINCT), generator=g)[:experts] for _ in range(tokens)]) \
        if tokens else torch.empty(0, experts, dtype=torch.int64)
    return _DISTINCT[picks].to(device)


def router_pattern(logits: torch.Tensor, k: int, softmax_first: bool, renorm: bool):
    """The router as transformers' MoE blocks write it, computing in the dtype it is given when that is float64
    (the reference) and in fp32 otherwise."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if softmax_first:
        w, idx = torch.topk(torch.nn.functional.softmax(logits, dim=-1, dtype=dtype), k, dim=-1)
        if renorm:
            w = w / w.sum(dim=-1, keepdim=True)
    else:
        top, idx = torch.topk(logits, k, dim=-1)
        w = torch.nn.functional.softmax(top, dim=-1, dtype=dtype)
    return w, idx


def run(fn, logits: torch.Tensor, dw: torch.Tensor):
    logits = logits.detach().requires_grad_(True)
    w, idx = fn(logits)
    (dl,) = torch.autograd.grad(w, logits, dw.to(w.dtype))
    return w.detach(), idx, dl


def check(case, mode, dtype, device="cpu", out_dtype=None, seed=0):
    tokens, experts, k = case
    softmax_first, renorm = mode
    logits = tie_free_logits(tokens, experts, seed, device)
    dw = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    out_dtype = torch.float32 if out_dtype is None else out_dtype

    def eager(l):
        w, idx = router_pattern(l, k, softmax_first, renorm)
        return (w if l.dtype == torch.float64 else w.to(out_dtype)), idx

    ours = run(lambda l: moe_router(l, k, softmax_first, renorm, out_dtype), logits.to(dtype), dw)
    theirs = run(eager, logits.to(dtype), dw)
    ref = run(eager, logits.double(), dw)
    assert ours[1].dtype == torch.int64 and torch.equal(ours[1], ref[1]), f"{case} {mode}: other experts chosen"
    assert torch.equal(theirs[1], ref[1])  # the logits are tie-free: eager picks the same
    assert_close(f"{case} {mode} weights", ours[0], theirs[0], ref[0])
    # d logits cancels: dl[idx_i] = w_i (dw_i - c), c = sum_j w_j dw_j (0 exactly at top-1 renormalised, where w = 1;
    # reference RMS 1e-17), so its rounding is at the size of the terms w_i dw_i, those of its E entries.
    terms = ref[0] * dw.double()
    assert_close(f"{case} {mode} d logits", ours[2], theirs[2], ref[2],
                 operand_scale=rms(terms) * (k / experts) ** 0.5)


@pytest.mark.parametrize("dtype", list(DTYPE_IDS), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_pattern(case, mode, dtype, device):
    check(CASES[case], MODES[mode], dtype, device)


@pytest.mark.parametrize("mode", list(MODES))
def test_weights_in_bf16_from_fp32_logits(mode, device):
    # The graph may hold the weights in another dtype than the logits (a bf16 model whose router upcasts).
    check(CASES["olmoe"], MODES[mode], torch.float32, device, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", list(DTYPE_IDS), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("mode", list(MODES))
def test_fallback_matches_pattern(monkeypatch, mode, dtype, device):
    # The plain-PyTorch path (a CPU without the interpreter) is held to the same rule, and launches nothing.
    force_fallback(monkeypatch, lowering, "_moe_router_fwd_kernel", "_moe_router_bwd_kernel")
    check(CASES["qwen3-moe"], MODES[mode], dtype, device)


@pytest.mark.parametrize("mode", list(MODES))
def test_ties_pick_the_lower_index(mode, device):
    # Equal scores: the first k experts, in index order, each weighted 1/k (renormalised or softmaxed over the k)
    # or 1/E (the softmax over all, not renormalised); the gradient is the pattern's at those indices.
    softmax_first, renorm = MODES[mode]
    logits = torch.zeros(4, 6, device=device).requires_grad_(True)
    w, idx = moe_router(logits, 3, softmax_first, renorm)
    assert idx.tolist() == [[0, 1, 2]] * 4
    expected = 1 / 6 if softmax_first and not renorm else 1 / 3
    torch.testing.assert_close(w, torch.full((4, 3), expected, device=device))
    dw = torch.randn(4, 3, device=device)
    (dl,) = torch.autograd.grad(w, logits, dw)
    torch.testing.assert_close(dl, lowering.moe_router_backward_reference(dw, logits.detach(), idx, softmax_first,
                                                                          renorm))
    # A row with a tie among the leaders only: the tied pair comes lower index first.
    row = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.0]], device=device)
    assert moe_router(row, 3, softmax_first, renorm)[1].tolist() == [[1, 3, 4]]


def test_strided_logits(device):
    # Logits sliced out of a wider projection (a row stride past the experts, 12 bytes past an aligned address) and a
    # transposed view (its experts not contiguous) give what their contiguous copy gives, bit for bit, d logits too:
    # the kernels do not specialise on the logits' alignment (lowering/moe_router.py).
    wide = tie_free_logits(9, 40, device=device)
    for view in (wide[:, 3:35], tie_free_logits(32, 9, device=device).t()):
        dw = torch.randn(view.shape[0], 4, generator=torch.Generator().manual_seed(1)).to(device)
        for mode in MODES.values():
            w, idx, dl = run(lambda l: moe_router(l, 4, *mode), view, dw)
            w_c, idx_c, dl_c = run(lambda l: moe_router(l, 4, *mode), view.contiguous(), dw)
            assert torch.equal(idx, idx_c) and torch.equal(w, w_c) and torch.equal(dl, dl_c)


def test_no_tokens(device):
    logits = torch.zeros(0, 8, device=device, requires_grad=True)
    w, idx = moe_router(logits, 2, True, True)
    assert w.shape == (0, 2) and idx.shape == (0, 2)
    (dl,) = torch.autograd.grad(w.sum(), logits, allow_unused=True)
    assert dl is None or dl.shape == (0, 8)


def test_bad_input_is_named(device):
    with pytest.raises(ValueError, match=r"\[tokens, experts\]"):
        moe_router(torch.zeros(2, 3, 8, device=device), 2)
    with pytest.raises(ValueError, match=r"\[tokens, experts\]"):
        moe_router(torch.zeros(4, 8, dtype=torch.int64, device=device), 2)
    with pytest.raises(ValueError, match="k must be in"):
        moe_router(torch.zeros(4, 8, device=device), 0)
    with pytest.raises(ValueError, match="k must be in"):
        moe_router(torch.zeros(4, 8, device=device), 9)
    with pytest.raises(ValueError, match="k must be in"):
        moe_router(torch.zeros(4, 64, device=device), lowering.MAX_TOP_K + 1)
    with pytest.raises(ValueError, match="one-pass limit"):
        moe_router(torch.zeros(4, lowering.MAX_EXPERTS + 1, device=device), 2)


def test_opcheck(device):
    lowering.register()
    logits = tie_free_logits(7, 12, device=device).requires_grad_()
    for mode in MODES.values():
        torch.library.opcheck(torch.ops.sloth.moe_router.default, (logits, 3, *mode, torch.float32))
