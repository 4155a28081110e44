"""``sloth.lora_mlp_tiled``: a LoRA MLP a block of rows at a time, against the composed patterns.

Forward and every gradient (x and the gate's, up's and down's adapters) against
``lora(glu(lora(x), lora(x)))`` with the tolerance rule (fp64 reference), for SwiGLU and GeGLU, separate and
merged gate/up, fp32 and bf16 (adapters in fp32 as peft keeps them, and in bf16, whose gradients the op sums
over blocks in fp32), odd shapes with a ragged last block; and the point of the op: nothing of the
intermediate width is saved for the backward when gate and up are recomputed, and only they when kept.
"""
from __future__ import annotations

import pytest
import torch

from sloth.lowering.tiled_mlp import lora_mlp_tiled
from sloth.patterns.glu import PATTERNS
from sloth.patterns.lora import lora_pattern
from pattern_checks import seeded
from tolerance import assert_close

SCALE, SCALE_D = 2.0, 0.5


def make_weights(hidden: int, inter: int, rank: int, merged: bool):
    gen = seeded(5)
    n_up = 2 * inter if merged else inter
    w_gate = torch.randn(n_up, hidden, generator=gen) / hidden**0.5  # the merged projection when merged
    w_up = None if merged else torch.randn(inter, hidden, generator=gen) / hidden**0.5
    w_down = torch.randn(hidden + 3, inter, generator=gen) / inter**0.5  # out width != hidden: a wrong view shows
    adapters = [torch.randn(rank, hidden, generator=gen) / hidden**0.5, torch.randn(n_up, rank, generator=gen) / rank,
                torch.randn(rank, hidden, generator=gen) / hidden**0.5, torch.randn(inter, rank, generator=gen) / rank,
                torch.randn(rank, inter, generator=gen) / inter**0.5,
                torch.randn(hidden + 3, rank, generator=gen) / rank]
    if merged:
        del adapters[2:4]
    return w_gate, w_up, w_down, adapters


def forward_backward(fn, args: list[torch.Tensor], dy_dtype: torch.dtype) -> list[torch.Tensor]:
    """[out, d(arg) for each arg] for a seeded cotangent drawn on the CPU (the same on every device)."""
    args = [a.detach().requires_grad_(True) for a in args]
    y = fn(*args)
    dy = torch.randn(y.shape, generator=seeded(3)).to(dy_dtype).to(device=y.device, dtype=y.dtype)
    return [y.detach(), *torch.autograd.grad(y, args, dy)]


def check(dtype, adapter_dtype, activation, merged, rows, hidden, inter, rank, tile_rows, recompute,
          device="cpu") -> None:
    """Output and every gradient of the tiled op against the composed patterns: the tolerance rule, fp64 reference
    (also run by tests/test_cuda_ops.py on CUDA tensors)."""
    x = torch.randn(1, rows, hidden, generator=seeded(7))
    w_gate, w_up, w_down, adapters = make_weights(hidden, inter, rank, merged)
    w_gate, w_up, w_down = (None if w is None else w.to(device) for w in (w_gate, w_up, w_down))
    adapters = [t.to(device) for t in adapters]
    glu = PATTERNS[activation]

    def fused(x, *adapters):
        wt = x.dtype
        if merged:
            a_g, b_g, a_d, b_d = adapters
            return lora_mlp_tiled(x, [w_gate.to(wt)], [None], [a_g], [b_g], SCALE, activation,
                                  w_down.to(wt), None, a_d, b_d, SCALE_D, tile_rows, recompute)
        a_g, b_g, a_u, b_u, a_d, b_d = adapters
        return lora_mlp_tiled(x, [w_gate.to(wt), w_up.to(wt)], [None, None], [a_g, a_u], [b_g, b_u], SCALE,
                              activation, w_down.to(wt), None, a_d, b_d, SCALE_D, tile_rows, recompute)

    def composed(x, *adapters):
        wt = x.dtype
        if merged:
            a_g, b_g, a_d, b_d = adapters
            gate, up = lora_pattern(x, w_gate.to(wt), None, a_g, b_g, SCALE).chunk(2, -1)
        else:
            a_g, b_g, a_u, b_u, a_d, b_d = adapters
            gate = lora_pattern(x, w_gate.to(wt), None, a_g, b_g, SCALE)
            up = lora_pattern(x, w_up.to(wt), None, a_u, b_u, SCALE)
        return lora_pattern(glu(gate, up), w_down.to(wt), None, a_d, b_d, SCALE_D)

    args = [x.to(device=device, dtype=dtype), *(t.to(adapter_dtype) for t in adapters)]
    actual = forward_backward(fused, args, dtype)
    eager = forward_backward(composed, args, dtype)
    reference = forward_backward(composed, [t.double() for t in args], dtype)
    names = ["y", "dx", "da_gate", "db_gate"] + ([] if merged else ["da_up", "db_up"]) + ["da_down", "db_down"]
    for name, ours, theirs, ref in zip(names, actual, eager, reference):
        assert_close(name, ours, theirs, ref)


DTYPE_PAIRS = [pytest.param(torch.float32, torch.float32, id="fp32"),
               pytest.param(torch.bfloat16, torch.float32, id="bf16"),  # peft's fp32 adapters on a bf16 model
               pytest.param(torch.bfloat16, torch.bfloat16, id="bf16-all")]  # gradients summed over blocks in fp32
SHAPES = [(37, 24, 40, 4, 8), (19, 33, 70, 16, 19), (23, 16, 30, 8, 64)]  # a ragged last block, one block, one short


@pytest.mark.parametrize("dtype,adapter_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_matches_the_composed_patterns(dtype, adapter_dtype, merged, recompute, device):
    check(dtype, adapter_dtype, "silu", merged, *SHAPES[0], recompute, device)


@pytest.mark.parametrize("dtype,adapter_dtype", [DTYPE_PAIRS[0], DTYPE_PAIRS[2]])
@pytest.mark.parametrize("rows,hidden,inter,rank,tile_rows", SHAPES[1:], ids=["one-block", "one-short-block"])
@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_blocks_of_other_sizes(dtype, adapter_dtype, rows, hidden, inter, rank, tile_rows, recompute, device):
    check(dtype, adapter_dtype, "silu", False, rows, hidden, inter, rank, tile_rows, recompute, device)


@pytest.mark.parametrize("dtype,adapter_dtype", DTYPE_PAIRS[:2])
@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu_erf"])
def test_other_activations(dtype, adapter_dtype, activation, device):  # the activation only reaches the GLU's kernels
    check(dtype, adapter_dtype, activation, False, *SHAPES[0], recompute=True, device=device)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_what_is_saved(recompute, device):
    # Recomputed: nothing of the intermediate width is saved. Kept: gate and up, and nothing else of that width
    # (no hidden, as the two ops it replaces).
    rows, hidden, inter, rank = 37, 24, 40, 4
    x = torch.randn(rows, hidden, generator=seeded(7)).to(device).requires_grad_()
    w_gate, w_up, w_down, adapters = (t if t is None or isinstance(t, list) else t.to(device)
                                      for t in make_weights(hidden, inter, rank, merged=False))
    a_g, b_g, a_u, b_u, a_d, b_d = (t.to(device).requires_grad_() for t in adapters)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = lora_mlp_tiled(x, [w_gate, w_up], [None, None], [a_g, a_u], [b_g, b_u], SCALE, "silu", w_down, None,
                           a_d, b_d, SCALE_D, 8, recompute)
    big = [tuple(t.shape) for t in saved if t.shape[0] == rows and t.shape[-1] >= inter]
    assert big == ([] if recompute else [(rows, inter), (rows, inter)]), f"tensors of the intermediate width: {big}"
    assert any(t.data_ptr() == x.data_ptr() for t in saved)  # x, from which each block's gate and up come again
    y.sum().backward()
    assert all(t.grad is not None for t in (x, a_g, b_g, a_u, b_u, a_d, b_d))


def test_bad_input_is_refused_with_a_reason(device):
    def randn(*shape):
        return torch.randn(*shape, device=device)

    x, w, a, b = randn(5, 8), randn(12, 8), randn(2, 8), randn(12, 2)
    with pytest.raises(ValueError, match="tile_rows must be a positive"):
        lora_mlp_tiled(x, [w, w], [None, None], [a, a], [b, b], 1.0, "silu", randn(8, 12), None, randn(2, 12),
                       randn(8, 2), 1.0, 0, True)
    with pytest.raises(ValueError, match="down projection's weight must be"):
        lora_mlp_tiled(x, [w, w], [None, None], [a, a], [b, b], 1.0, "silu", randn(8, 11), None, randn(2, 11),
                       randn(8, 2), 1.0, 4)
