"""The fused op ``sloth.lowering.document_attention``: forward and dq, dk, dv against the pattern function.

Oracle: ``patterns/packed_attention.packed_attention_pattern`` (SDPA under the dense document-causal mask
``allowed_from_bounds`` builds) with k and v repeated to every query head, run eagerly at the tested dtype
("eager") and in float64 (the reference). Shapes are odd on purpose: tokens not a multiple of any tile, head
dims that are not powers of 2, grouped heads, documents that straddle tiles, length-1 documents (TRL's
pads), one document per row.
"""
from __future__ import annotations

import pytest
import torch

import sloth.lowering.document_attention as lowering
from sloth.lowering.document_attention import allowed_from_bounds, document_attention
from sloth.patterns.packed_attention import packed_attention_pattern
from sloth.runtime.packing import document_bounds, document_starts
from tolerance import assert_close
from op_checks import force_fallback

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}

# (batch, query heads, key heads, head_dim, document lengths per row)
CASES = {
    "packed-gqa": (2, 4, 2, 24, [[5, 20, 1, 11], [37]]),
    "pads-mha": (1, 3, 3, 40, [[9, 17, 1, 1, 1, 1, 1, 1]]),
    "one-doc-mqa": (1, 4, 1, 16, [[33]]),
}


def positions(lengths: list[list[int]], device: str = "cpu") -> torch.Tensor:
    """Position ids restarting at 0 for each document (DataCollatorWithFlattening's), one row per list."""
    return torch.stack([torch.cat([torch.arange(n, device=device) for n in row]) for row in lengths])


def inputs(batch, heads, kv_heads, head_dim, tokens, seed=0, device="cpu"):
    """q, k, v and dout in fp32, drawn on the CPU (the same values on every device) and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    # q laid out [B, T, H, D] and viewed as [B, H, T, D], as transformers' projections are.
    q = torch.randn(batch, tokens, heads, head_dim, generator=g).transpose(1, 2)
    k = torch.randn(batch, kv_heads, tokens, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, tokens, head_dim, generator=g)
    dout = torch.randn(batch, heads, tokens, head_dim, generator=g)
    return q.to(device), k.to(device), v.to(device), dout.to(device)


def _pattern(q, k, v, mask, scale):
    groups = q.shape[1] // k.shape[1]
    return packed_attention_pattern(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), mask, scale)


def forward_backward(fn, tensors, dout):
    tensors = [t.detach().requires_grad_(True) for t in tensors]
    out = fn(*tensors)
    return [out.detach(), *torch.autograd.grad(out, tensors, dout.to(out.dtype))]


@pytest.mark.parametrize("dtype", list(DTYPE_IDS), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_pattern(case, dtype, device):
    batch, heads, kv_heads, head_dim, lengths = CASES[case]
    pos = positions(lengths, device)
    bounds = document_bounds(pos, "position_reset")
    mask = allowed_from_bounds(bounds)
    scale = 0.3
    q, k, v, dout = inputs(batch, heads, kv_heads, head_dim, pos.shape[1], device=device)
    ours = forward_backward(lambda *t: document_attention(*t, bounds, scale), [t.to(dtype) for t in (q, k, v)], dout)
    eager = forward_backward(lambda *t: _pattern(*t, mask, scale), [t.to(dtype) for t in (q, k, v)], dout)
    ref = forward_backward(lambda *t: _pattern(*t, mask, scale), [t.double() for t in (q, k, v)], dout)
    for name, a, e, r in zip(("out", "dq", "dk", "dv"), ours, eager, ref):
        assert_close(f"{case} {name}", a, e, r.to(torch.float64))


def test_output_layout_and_default_scale(device):
    q, k, v, _ = inputs(1, 2, 2, 16, 10, device=device)
    bounds = document_bounds(torch.arange(10, device=device)[None], "position_reset")
    out = document_attention(q, k, v, bounds)
    # [B, T, H, D] storage viewed as [B, H, T, D]: transformers' transpose(1, 2).reshape reads it in place.
    assert out.shape == (1, 2, 10, 16) and out.transpose(1, 2).is_contiguous()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # one document: causal
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_reference_path_matches_kernels(monkeypatch, device):
    """Where Triton does not run, the PyTorch reference gives the same numbers."""
    batch, heads, kv_heads, head_dim, lengths = CASES["packed-gqa"]
    pos = positions(lengths, device)
    bounds = document_bounds(pos, "position_reset")
    q, k, v, dout = inputs(batch, heads, kv_heads, head_dim, pos.shape[1], device=device)
    fused = forward_backward(lambda *t: document_attention(*t, bounds), [q, k, v], dout)
    force_fallback(monkeypatch, lowering, "_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")
    fallback = forward_backward(lambda *t: document_attention(*t, bounds), [q, k, v], dout)
    for a, b in zip(fused, fallback):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_document_bounds_rules(device):
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 5, 6]], device=device)
    start, end = document_bounds(pos, "position_reset")
    assert start.tolist() == [[0, 0, 0, 3, 3, 5, 6, 7, 7]] and end.tolist() == [[3, 3, 3, 5, 5, 6, 7, 9, 9]]
    # position_zero: 5, 6 continue the document started at 0 (index 6).
    assert document_starts(pos, "position_zero").tolist() == [[True, False, False, True, False, True, True, False,
                                                                False]]
    ids = torch.tensor([[4, 4, 9, 9, 9, 4]], device=device)
    start, end = document_bounds(ids, "id_change")
    assert start.tolist() == [[0, 0, 2, 2, 2, 5]] and end.tolist() == [[2, 2, 5, 5, 5, 6]]
    # one row of ids shared by a batch of 3
    assert document_bounds(pos, "position_reset", batch=3).shape == (2, 3, 9)


def test_padded_tail_has_no_nan(device):
    """TRL's pads (position 0 each) are length-1 documents: each attends to itself, no row is empty."""
    pos = torch.tensor([[0, 1, 2, 3, 0, 0, 0, 0]], device=device)
    q, k, v, dout = inputs(1, 2, 1, 16, 8, device=device)
    out, dq, dk, dv = forward_backward(lambda *t: document_attention(*t, document_bounds(pos, "position_reset")),
                                       [q, k, v], dout)
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    # a length-1 document's output is its own value row
    torch.testing.assert_close(out[0, :, 5], v[0, 0, 5].expand(2, -1), rtol=1e-5, atol=1e-6)


def test_bad_input_is_named(device):
    q, k, v, _ = inputs(1, 4, 3, 16, 6, device=device)
    bounds = document_bounds(torch.arange(6, device=device)[None], "position_reset")
    with pytest.raises(ValueError, match="not a multiple of 3 key/value heads"):
        document_attention(q, k, v, bounds)
    q, k, v, _ = inputs(1, 4, 2, 16, 6, device=device)
    with pytest.raises(ValueError, match="bounds must be int32"):
        document_attention(q, k, v, bounds.long())
    with pytest.raises(ValueError, match="unknown document rule"):
        document_bounds(torch.arange(6, device=device)[None], "newline")
    with pytest.raises(ValueError, match="integer tensor"):
        document_bounds(torch.arange(6.0, device=device)[None], "position_reset")
