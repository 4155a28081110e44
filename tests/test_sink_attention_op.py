"""The fused op ``sloth.lowering.sink_attention``: forward and dq, dk, dv, d sinks against the pattern function.

Oracle: ``patterns/sink_attention.sink_attention_pattern`` (GPT-OSS's eager attention: the sink column
concatenated to the scores, softmax, dropped) under the additive mask of the same window, run eagerly at the
tested dtype ("eager") and in float64 (the reference). Shapes are odd on purpose: tokens not a multiple of any
tile, head dims that are not powers of 2, grouped heads; windows of 1 token (the sink against the diagonal
alone), narrower than a tile, wider than one, and at least T (plain causal).
"""
from __future__ import annotations

import pytest
import torch

import sloth.lowering.sink_attention as lowering
from sloth.lowering.sink_attention import sink_attention, window_bounds
from sloth.patterns.sink_attention import sink_attention_pattern
from tolerance import assert_close
from op_checks import force_fallback

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}

# (batch, query heads, key heads, head_dim, tokens, window)
CASES = {
    "gqa-window-5": (2, 4, 2, 24, 37, 5),
    "mha-window-1": (1, 3, 3, 40, 21, 1),
    "mqa-window-20": (1, 4, 1, 16, 45, 20),
    "gqa-causal": (2, 4, 2, 16, 29, 29),
    "gqa-window-past-t": (1, 2, 1, 8, 19, 500),
}


def window_mask(tokens: int, window: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """The additive [T, T] mask of a causal window: 0 where i - window < j <= i, -inf elsewhere."""
    i = torch.arange(tokens, device=device)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return torch.zeros(tokens, tokens, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


def inputs(batch, heads, kv_heads, head_dim, tokens, seed=0, device="cpu"):
    """q, k, v, sinks and dout in fp32, drawn on the CPU (the same values on every device) and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    # q laid out [B, T, H, D] and viewed as [B, H, T, D], as transformers' projections are.
    q = torch.randn(batch, tokens, heads, head_dim, generator=g).transpose(1, 2)
    k = torch.randn(batch, kv_heads, tokens, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, tokens, head_dim, generator=g)
    sinks = 2 * torch.randn(heads, generator=g)  # large enough that the sink takes a real share of each row
    dout = torch.randn(batch, heads, tokens, head_dim, generator=g)
    return q.to(device), k.to(device), v.to(device), sinks.to(device), dout.to(device)


def forward_backward(fn, tensors, dout):
    tensors = [t.detach().requires_grad_(True) for t in tensors]
    out = fn(*tensors)
    return [out.detach(), *torch.autograd.grad(out, tensors, dout.to(out.dtype))]


def check(shape, dtype, device="cpu", name=""):
    """Forward and every gradient of the op against the pattern at ``shape`` (a CASES value) on ``device``."""
    batch, heads, kv_heads, head_dim, tokens, window = shape
    q, k, v, sinks, dout = inputs(batch, heads, kv_heads, head_dim, tokens, device=device)
    bounds = window_bounds(q, window)
    scale = head_dim ** -0.5

    def pattern(dt):
        return lambda q, k, v, s: sink_attention_pattern(q, k, v, s, window_mask(tokens, window, dt, device), scale)

    ours = forward_backward(lambda *t: sink_attention(*t, bounds, scale), [t.to(dtype) for t in (q, k, v, sinks)],
                            dout)
    eager = forward_backward(pattern(dtype), [t.to(dtype) for t in (q, k, v, sinks)], dout)
    ref = forward_backward(pattern(torch.float64), [t.double() for t in (q, k, v, sinks)], dout)
    terms = cancelling_terms(q, k, v, sinks, dout, window_mask(tokens, window, torch.float64, device), scale)
    for label, a, e, r in zip(("out", "dq", "dk", "dv", "dsinks"), ours, eager, ref):
        assert_close(f"{name} {label}", a, e, r, operand_scale=terms.get(label, 0.0))


def cancelling_terms(q, k, v, sinks, dout, mask, scale) -> dict[str, float]:
    """RMS of the terms dq and dk cancel from (tests/tolerance.py's ``operand_scale``), in float64: the softmax's
    backward is ds = p (dp - delta) with delta = sum_j p_j dp_j, so dq = scale ds k sums p dp k and p delta k, which
    cancel where one key takes most of a row (a window of 1 beside a small sink: ds = p (1 - p) dp). The kernel forms
    delta as rowsum(out * dout), as every FlashAttention backward does, not from its own dp, so its error is
    roundoff at the size of p dp k, not of dq."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale + mask
    sink = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
    p = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    p_dp = p * (dout @ v.transpose(-1, -2))
    return {"dq": float((p_dp @ k * scale).pow(2).mean().sqrt()),
            "dk": float((p_dp.transpose(-1, -2) @ q * scale).pow(2).mean().sqrt())}


@pytest.mark.parametrize("dtype", list(DTYPE_IDS), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_pattern(case, dtype, device):
    check(CASES[case], dtype, device, name=case)


@pytest.mark.parametrize("dtype", list(DTYPE_IDS), ids=list(DTYPE_IDS.values()))
def test_fallback_matches_pattern(monkeypatch, dtype, device):
    # The plain-PyTorch path (a CPU without the interpreter) is held to the same rule, and launches nothing.
    force_fallback(monkeypatch, lowering.doc, "_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")
    monkeypatch.setattr(lowering, "use_triton", lambda t: False)
    check(CASES["gqa-window-5"], dtype, device, name="fallback")


def test_sink_takes_its_share(device):
    # A sink far above every score takes (nearly) all of each row's mass: the output goes to 0. A sink far below
    # takes none: the op is then plain windowed attention.
    q, k, v, sinks, _ = inputs(1, 2, 2, 16, 9, device=device)
    bounds = window_bounds(q, 4)
    assert sink_attention(q, k, v, torch.full((2,), 80.0, device=device), bounds).abs().max() < 1e-12
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                             attn_mask=window_mask(9, 4, torch.float32, device))
    torch.testing.assert_close(sink_attention(q, k, v, torch.full((2,), -80.0, device=device), bounds), plain,
                               rtol=1e-5, atol=1e-5)


def test_window_bounds(device):
    q = torch.zeros(2, 1, 6, 4, device=device)
    bounds = window_bounds(q, 3)
    assert bounds.dtype == torch.int32 and bounds.shape == (2, 2, 6)
    assert bounds[0, 1].tolist() == [0, 0, 0, 1, 2, 3]  # start = max(0, i - 2)
    assert bounds[1, 0].tolist() == [3, 4, 5, 6, 6, 6]  # end = min(T, i + 3): one past the last row that sees i
    with pytest.raises(ValueError, match="at least 1 token"):
        window_bounds(q, 0)


def test_bad_sinks_are_named(device):
    q, k, v, _, _ = inputs(1, 4, 2, 16, 7, device=device)
    bounds = window_bounds(q, 7)
    with pytest.raises(ValueError, match=r"sinks must be a float \[4\] tensor"):
        sink_attention(q, k, v, torch.zeros(2, device=device), bounds)
    with pytest.raises(ValueError, match="bounds must be int32"):
        sink_attention(q, k, v, torch.zeros(4, device=device), bounds.long())


def test_opcheck(device):
    q, k, v, sinks, _ = inputs(1, 2, 1, 8, 11, device=device)
    lowering.register()
    args = (q, k, v, sinks.requires_grad_(), window_bounds(q, 4), 0.25)
    torch.library.opcheck(torch.ops.sloth.sink_attention.default, args)
