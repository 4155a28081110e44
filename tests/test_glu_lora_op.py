"""``sloth.glu_lora_linear`` (and ``glu_qlora_linear``): the LoRA down projection with its GLU input, against
the two patterns composed.

Forward and every gradient (gate, up, A, B) against ``lora_pattern(glu_pattern(gate, up), ...)`` with the
tolerance rule (fp64 reference), for SwiGLU and GeGLU, separate and merged gate/up, fp32 and bf16, odd
shapes; and the point of the op: the GLU's output is not among the tensors saved for backward.
"""
from __future__ import annotations

import pytest
import torch

from sloth.lowering.glu_lora import glu_lora_linear
from sloth.patterns.glu import PATTERNS
from sloth.patterns.lora import lora_pattern
from op_checks import record_launches
from pattern_checks import forward_backward, seeded
from tolerance import assert_close


def make_inputs(rows: int, inter: int, out: int, rank: int, device: str = "cpu"):
    """gate, up, w, a, b in fp32, drawn on the CPU (the same values on every device) and moved to ``device``."""
    gen = seeded(3)
    gate, up = torch.randn(rows, inter, generator=gen), torch.randn(rows, inter, generator=gen)
    w = torch.randn(out, inter, generator=gen) / inter**0.5
    a = torch.randn(rank, inter, generator=gen) / inter**0.5
    b = torch.randn(out, rank, generator=gen) / rank**0.5
    return tuple(t.to(device) for t in (gate, up, w, a, b))


def check_against_composed(fused, composed, args, dtype) -> None:
    """Output and the gradients of gate, up, a, b: the tolerance rule against the composed patterns in fp64."""
    actual = forward_backward(fused, args, [])
    eager = forward_backward(composed, args, [])
    reference = forward_backward(composed, [t.double() for t in args], [], dy_dtype=dtype)
    for name, ours, theirs, ref in zip(("y", "d_gate", "d_up", "da", "db"), actual, eager, reference):
        assert_close(name, ours, theirs, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
@pytest.mark.parametrize("rows,inter,out,rank", [(37, 24, 20, 4), (5, 70, 33, 16)])
def test_matches_the_composed_patterns(dtype, activation, merged, rows, inter, out, rank, device):
    gate, up, w, a, b = make_inputs(rows, inter, out, rank, device)
    pattern = PATTERNS[activation]

    def fused(gate, up, a, b, w=w.to(dtype)):
        if merged:  # one [rows, 2 * inter] projection, gate half first, read in place
            return glu_lora_linear(torch.cat([gate, up], -1), None, activation, w, None, a, b, 2.0)
        return glu_lora_linear(gate, up, activation, w, None, a, b, 2.0)

    def composed(gate, up, a, b, w=w):
        return lora_pattern(pattern(gate, up), w.to(gate.dtype), None, a, b, 2.0)

    check_against_composed(fused, composed, [gate.to(dtype), up.to(dtype), a, b], dtype)


def test_the_glu_output_is_not_saved(device):
    # Saved for backward: gate, up, w, a, b and the [rows, r] adapter activation, never [rows, inter] hidden.
    gate, up, w, a, b = make_inputs(37, 24, 20, 4, device)
    gate, up, a, b = (t.requires_grad_() for t in (gate, up, a, b))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        glu_lora_linear(gate, up, "silu", w, None, a, b, 2.0)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == sorted([(37, 24), (37, 24), (20, 24), (4, 24), (20, 4), (37, 4)]), shapes
    assert all(t.data_ptr() in {gate.data_ptr(), up.data_ptr(), w.data_ptr(), a.data_ptr(), b.data_ptr()}
               or t.shape == (37, 4) for t in saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "double-quantised"])
def test_4bit_base_matches_the_composed_patterns(dtype, nested, device):
    # sloth.glu_qlora_linear: the same with a bitsandbytes NF4 base, against the patterns on the weight
    # bitsandbytes itself dequantises.
    functional = pytest.importorskip("bitsandbytes.functional")
    from sloth.lowering.glu_lora import register_4bit

    register_4bit()
    # 128 inputs: whole 64-element blocks per row, which bitsandbytes' CPU dequantisation needs
    # (tests/test_qlora.py says why).
    gate, up, w, a, b = make_inputs(37, 128, 20, 4, device)
    packed, state = functional.quantize_4bit(w.to(dtype), blocksize=64, quant_type="nf4", compress_statistics=nested)
    w_dq = functional.dequantize_4bit(packed, state).to(dtype)
    quant = (packed, state.absmax, state.state2.code if nested else None, state.state2.absmax if nested else None,
             state.offset if nested else None, 20, 128, 64, "nf4")

    def fused(gate, up, a, b):
        y, _ = torch.ops.sloth.glu_qlora_linear(gate, up, "silu", *quant, None, a, b, 2.0)
        return y

    def composed(gate, up, a, b):
        return lora_pattern(PATTERNS["silu"](gate, up), w_dq.to(gate.dtype), None, a, b, 2.0)

    check_against_composed(fused, composed, [gate.to(dtype), up.to(dtype), a, b], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu_erf"])
@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
def test_the_backward_takes_hidden_from_the_glu_backward(monkeypatch, dtype, activation, merged, device):
    # The backward's hidden comes from the GLU backward's pass (written over d_hidden), not from a GLU forward
    # launch of its own, and every gradient is bit for bit the recomputing backward's
    # (FUSED_HIDDEN False).
    from sloth.lowering import glu as glu_lowering
    from sloth.lowering import glu_lora as glu_lora_lowering

    gate, up, w, a, b = make_inputs(37, 70, 33, 4, device)
    gate, up, w = gate.to(dtype), up.to(dtype), w.to(dtype)
    x = torch.cat([gate, up], -1) if merged else gate
    dy = torch.randn(37, 33, generator=seeded(5)).to(device, dtype)

    def grads(fused_hidden: bool):
        monkeypatch.setattr(glu_lora_lowering, "FUSED_HIDDEN", fused_hidden)
        xs = [t.clone().requires_grad_() for t in ((x, a, b) if merged else (x, up, a, b))]
        y = glu_lora_linear(xs[0], None if merged else xs[1], activation, w, None, xs[-2], xs[-1], 2.0)
        with monkeypatch.context() as mp:
            launches = record_launches(mp, glu_lowering, "_glu_fwd_kernel", "_glu_bwd_kernel")
            y.backward(dy)
        return [t.grad for t in xs], [(name, kwargs.get("STORE_Y")) for name, _, kwargs in launches]

    fused, fused_launches = grads(True)
    recomputed, recomputed_launches = grads(False)
    assert fused_launches == [("_glu_bwd_kernel", True)], fused_launches
    assert recomputed_launches == [("_glu_fwd_kernel", None), ("_glu_bwd_kernel", False)], recomputed_launches
    for ours, theirs in zip(fused, recomputed):
        assert torch.equal(ours, theirs)
