"""The fused ops ``sloth.lowering.rope.rope`` (q and k in one launch) and ``rope_single``: forward, dq and dk
against the pattern functions.

Oracle (STYLE.md, habit 5): ``patterns/rope.py``'s functions run eagerly at the tested dtype are "eager";
the same functions run on float64 copies of the same values are the reference (they contain no upcast,
so nothing can silently round the float64 run back to fp32). cos and sin get no gradient (the lowering's
docstring says why); ``test_cos_sin_gradient_is_refused`` checks that asking for one fails loudly.

Layouts: ``bhsd`` is transformers' q after ``view(b, s, h, d).transpose(1, 2)``, a non-contiguous view;
``bshd`` keeps heads after the sequence, with cos/sin unsqueezed at dim 2 instead of 1.
"""
from __future__ import annotations

import pytest
import torch

import sloth.lowering.rope as lowering
from sloth.lowering.rope import register, rope, rope_single
from sloth.patterns.rope import (deinterleaving_rope_pattern, interleaved_rope_pattern, partial_rope_pattern,
                                 rope_rotate_half_pattern, rope_single_pattern)
from tolerance import assert_close
from op_checks import force_fallback

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_inputs(b, hq, hk, s, d, layout, dtype, rot=None, seed=0, device="cpu"):
    """q, k as the attention sees them, cos/sin [b, s, rot] from positions (as transformers computes them),
    cotangents dq, dk; all rounded to ``dtype``, drawn on the CPU (the same values on every device) and moved to
    ``device`` (``.to`` keeps the bhsd views' strides)."""
    g = _gen(seed)
    rot = rot or d
    q = torch.randn(b, s, hq, d, generator=g).to(dtype)
    k = torch.randn(b, s, hk, d, generator=g).to(dtype)
    if layout == "bhsd":  # the transpose of a projection view: non-contiguous
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    pos = torch.randint(0, 64, (b, s), generator=g).float()
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    dq = torch.randn(q.shape, generator=g).to(dtype)
    dk = torch.randn(k.shape, generator=g).to(dtype)
    return tuple(t.to(device) for t in (q, k, cos, sin, dq, dk))


def forward_backward(fn, q, k, cos, sin, dq, dk):
    """(q_out, k_out, dq_in, dk_in) of ``fn(q, k, cos, sin)`` for cotangents dq, dk."""
    q = q.detach().requires_grad_(True)  # detach, not clone: clone would make a strided view contiguous
    k = k.detach().requires_grad_(True)
    qo, ko = fn(q, k, cos, sin)
    grads = torch.autograd.grad((qo, ko), (q, k), (dq.to(qo.dtype), dk.to(ko.dtype)))
    return qo.detach(), ko.detach(), *grads


def check_against_pattern(ours, pattern, inputs):
    """Run ``ours`` and ``pattern`` at the inputs' dtype and ``pattern`` in float64; apply the tolerance rule."""
    actual = forward_backward(ours, *inputs)
    eager = forward_backward(pattern, *inputs)
    reference = forward_backward(pattern, *(t.double() for t in inputs))
    assert reference[0].dtype == torch.float64
    for name, a, e, r in zip(("q_out", "k_out", "dq", "dk"), actual, eager, reference):
        assert_close(name, a, e, r)
    return actual


def _unsqueeze(layout: str) -> int:
    return 1 if layout == "bhsd" else 2


def fused_pair(layout):
    dim = _unsqueeze(layout)
    return lambda q, k, cos, sin: rope(q, k, cos.unsqueeze(dim), sin.unsqueeze(dim))


def fused_singles(layout):
    dim = _unsqueeze(layout)
    return lambda q, k, cos, sin: (rope_single(q, cos.unsqueeze(dim), sin.unsqueeze(dim)),
                                   rope_single(k, cos.unsqueeze(dim), sin.unsqueeze(dim)))


def pattern_pair(layout, partial=False):
    fn = partial_rope_pattern if partial else rope_rotate_half_pattern
    return lambda q, k, cos, sin: fn(q, k, cos, sin, unsqueeze_dim=_unsqueeze(layout))


# ---------------------------------------------------------------------------------------------------
# Forward, dq and dk: shapes x layouts x dtypes
# ---------------------------------------------------------------------------------------------------

# (b, heads of q, heads of k, seq, head_dim, layout)
SHAPES = [
    (1, 1, 1, 1, 16, "bhsd"),
    (2, 3, 1, 7, 64, "bhsd"),
    (2, 2, 2, 33, 96, "bshd"),
    (1, 3, 2, 7, 16, "bshd"),
    (2, 1, 1, 33, 64, "bhsd"),
]


def shape_id(b, hq, hk, s, d, layout) -> str:
    return f"B{b}-Hq{hq}-Hk{hk}-S{s}-D{d}-{layout}"


CASES = [pytest.param(shape, dtype, id=f"{shape_id(*shape)}-{DTYPE_IDS[dtype]}")
         for shape in SHAPES for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("shape,dtype", CASES)
def test_pair_matches_pattern(shape, dtype, device):
    inputs = make_inputs(*shape, dtype, device=device)
    qo, ko, dq, dk = check_against_pattern(fused_pair(shape[-1]), pattern_pair(shape[-1]), inputs)
    assert qo.dtype == dtype and dq.dtype == dtype and qo.shape == inputs[0].shape and dk.shape == inputs[1].shape
    assert qo.is_contiguous() and ko.is_contiguous()


@pytest.mark.parametrize("shape,dtype", [CASES[2], CASES[3]])
def test_single_matches_pattern(shape, dtype, device):
    check_against_pattern(fused_singles(shape[-1]), pattern_pair(shape[-1]), make_inputs(*shape, dtype, device=device))


PARTIAL = [pytest.param((2, 3, 1, 7, 96, "bhsd"), 32, dtype, id=f"B2-Hq3-Hk1-S7-D96-R32-bhsd-{DTYPE_IDS[dtype]}")
           for dtype in (torch.float32, torch.bfloat16)]
PARTIAL += [pytest.param((1, 2, 2, 33, 16, "bshd"), 8, torch.float32, id="B1-Hq2-Hk2-S33-D16-R8-bshd-fp32")]


@pytest.mark.parametrize("shape,rot,dtype", PARTIAL)
def test_partial_rotary_matches_pattern(shape, rot, dtype, device):
    inputs = make_inputs(*shape, dtype, rot=rot, device=device)
    qo, _, dq, _ = check_against_pattern(fused_pair(shape[-1]), pattern_pair(shape[-1], partial=True), inputs)
    q, dq_out = inputs[0], inputs[4]
    assert torch.equal(qo[..., rot:], q[..., rot:]) and torch.equal(dq[..., rot:], dq_out[..., rot:])


def test_precomputed_table_broadcasts_over_batch_and_heads(device):
    # A [s, d] table (cos_cached[:s]) broadcasts over batch and heads without unsqueeze.
    q, k, cos, sin, dq, dk = make_inputs(2, 3, 1, 7, 16, "bhsd", torch.float32, device=device)
    cos, sin = cos[0], sin[0]
    check_against_pattern(rope, lambda q_, k_, c, s: (rope_single_pattern(q_, c, s), rope_single_pattern(k_, c, s)),
                          (q, k, cos, sin, dq, dk))


def test_fp32_tables_with_bf16_inputs_give_fp32_like_eager(device):
    q, k, cos, sin, dq, dk = make_inputs(2, 3, 1, 7, 16, "bhsd", torch.bfloat16, device=device)
    cos32, sin32 = make_inputs(2, 3, 1, 7, 16, "bhsd", torch.float32, device=device)[2:4]
    qo, ko, dq_in, dk_in = check_against_pattern(fused_pair("bhsd"), pattern_pair("bhsd"), (q, k, cos32, sin32, dq, dk))
    assert (qo.dtype, ko.dtype, dq_in.dtype, dk_in.dtype) == (torch.float32, torch.float32, torch.bfloat16,
                                                              torch.bfloat16)


def test_fp16(device):
    inputs = make_inputs(2, 3, 1, 7, 64, "bhsd", torch.float16, device=device)
    check_against_pattern(fused_pair("bhsd"), pattern_pair("bhsd"), inputs)


def test_arbitrary_cos_sin_values_are_exact(device):
    # The op never assumes the halves of cos/sin are equal: random tables give the pattern's values.
    q, k, _, _, dq, dk = make_inputs(2, 2, 2, 7, 16, "bhsd", torch.float32, device=device)
    cos, sin = torch.randn(2, 7, 16, generator=_gen(5)).to(device), torch.randn(2, 7, 16, generator=_gen(6)).to(device)
    check_against_pattern(fused_pair("bhsd"), pattern_pair("bhsd"), (q, k, cos, sin, dq, dk))


def test_inputs_are_not_written(device):
    q, k, cos, sin, dq, dk = make_inputs(2, 3, 1, 7, 16, "bhsd", torch.bfloat16, device=device)
    before = [t.clone() for t in (q, k, cos, sin, dq, dk)]
    forward_backward(fused_pair("bhsd"), q, k, cos, sin, dq, dk)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, cos, sin, dq, dk)))


def test_unused_output_gets_zero_gradient(device):
    q, k, cos, sin, _, _ = make_inputs(1, 2, 2, 7, 16, "bhsd", torch.float32, device=device)
    q.requires_grad_(True)
    k.requires_grad_(True)
    qo, _ = rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1))
    qo.sum().backward()
    assert k.grad is None or torch.equal(k.grad, torch.zeros_like(k))
    q_eager = q.detach().requires_grad_(True)
    rope_single_pattern(q_eager, cos.unsqueeze(1), sin.unsqueeze(1)).sum().backward()
    torch.testing.assert_close(q.grad, q_eager.grad)


def test_cos_sin_gradient_is_refused(device):
    q, k, cos, sin, _, _ = make_inputs(1, 2, 2, 7, 16, "bhsd", torch.float32, device=device)
    cos = cos.requires_grad_(True)
    qo, ko = rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1))
    with pytest.raises(RuntimeError, match="no gradient"):
        (qo.sum() + ko.sum()).backward()


def test_zero_rows(device):
    q = torch.randn(0, 2, 7, 16, device=device, requires_grad=True)
    k = torch.randn(0, 1, 7, 16, device=device, requires_grad=True)
    cos, sin = torch.randn(0, 1, 7, 16, device=device), torch.randn(0, 1, 7, 16, device=device)
    qo, ko = rope(q, k, cos, sin)
    (qo.sum() + ko.sum()).backward()
    assert qo.shape == q.shape and q.grad.shape == q.shape


# ---------------------------------------------------------------------------------------------------
# Input errors
# ---------------------------------------------------------------------------------------------------

BAD_INPUTS = [
    pytest.param(lambda: (torch.randn(2, 7, 16), torch.randn(7, 15), torch.randn(7, 15)), ValueError,
                 r"even", id="odd-rotary-dim"),
    pytest.param(lambda: (torch.randn(2, 7, 16), torch.randn(7, 32), torch.randn(7, 32)), ValueError,
                 r"do not fit", id="rotary-over-head-dim"),
    pytest.param(lambda: (torch.randn(2, 7, 16), torch.randn(5, 16), torch.randn(5, 16)), ValueError,
                 r"do not broadcast", id="wrong-seq"),
    pytest.param(lambda: (torch.randn(2, 7, 16), torch.randn(7, 16), torch.randn(7, 8)), ValueError,
                 r"one shape", id="cos-sin-shapes"),
    pytest.param(lambda: (torch.randn(2, 7, 16, dtype=torch.float64), torch.randn(7, 16), torch.randn(7, 16)),
                 TypeError, r"float64", id="x-float64"),
    pytest.param(lambda: (torch.randn(1, 1, 2, 7, 16), torch.randn(7, 16), torch.randn(7, 16)), ValueError,
                 r"1 to 4 dims", id="x-5d"),
]


@pytest.mark.parametrize("make,error,message", BAD_INPUTS)
def test_input_errors_name_the_problem(make, error, message, device):
    x, cos, sin = (t.to(device) for t in make())
    with pytest.raises(error, match=message):
        rope_single(x, cos, sin)
    with pytest.raises(error, match=message):
        rope(x, x, cos, sin)


# ---------------------------------------------------------------------------------------------------
# torch.library registration
# ---------------------------------------------------------------------------------------------------

OPCHECK_CASES = [
    pytest.param((2, 3, 1, 7, 16, "bhsd"), torch.float32, None, id="B2-Hq3-Hk1-S7-D16-bhsd-fp32"),
    pytest.param((1, 2, 2, 5, 16, "bshd"), torch.bfloat16, None, id="B1-Hq2-Hk2-S5-D16-bshd-bf16"),
    pytest.param((1, 2, 1, 5, 24, "bhsd"), torch.float32, 8, id="B1-Hq2-Hk1-S5-D24-R8-bhsd-fp32"),
]


@pytest.mark.parametrize("shape,dtype,rot", OPCHECK_CASES)
def test_opcheck(shape, dtype, rot, device):
    register()
    q, k, cos, sin, dq, dk = make_inputs(*shape, dtype, rot=rot, device=device)
    dim = _unsqueeze(shape[-1])
    cos, sin = cos.unsqueeze(dim), sin.unsqueeze(dim)
    torch.library.opcheck(torch.ops.sloth.rope.default, (q.requires_grad_(True), k.requires_grad_(True), cos, sin))
    torch.library.opcheck(torch.ops.sloth.rope_single.default, (q, cos, sin))
    torch.library.opcheck(torch.ops.sloth.rope_backward.default, (dq, dk, cos, sin, dtype, dtype))
    torch.library.opcheck(torch.ops.sloth.rope_single_backward.default, (dq, cos, sin, dtype))


def test_register_is_idempotent():
    register()
    register()
    assert all(hasattr(torch.ops.sloth, n) for n in ("rope", "rope_backward", "rope_single", "rope_single_backward"))


# ---------------------------------------------------------------------------------------------------
# The PyTorch fallback (CPU without the interpreter, other devices)
# ---------------------------------------------------------------------------------------------------

FALLBACK_CASES = [pytest.param(shape, dtype, rot, id=f"{shape_id(*shape)}-R{rot or shape[4]}-{DTYPE_IDS[dtype]}")
                  for shape, rot in [((2, 3, 1, 7, 16, "bhsd"), None), ((1, 2, 2, 5, 24, "bshd"), 8)]
                  for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("shape,dtype,rot", FALLBACK_CASES)
def test_fallback_matches_triton(shape, dtype, rot, device):
    inputs = make_inputs(*shape, dtype, rot=rot, device=device)
    for fused in (fused_pair(shape[-1]), fused_singles(shape[-1])):
        triton_out = forward_backward(fused, *inputs)
        with pytest.MonkeyPatch.context() as mp:
            force_fallback(mp, lowering, "_rope_kernel")
            fallback_out = forward_backward(fused, *inputs)
        for name, a, b in zip(("q_out", "k_out", "dq", "dk"), fallback_out, triton_out):
            assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
            torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------------
# Interleaved (GPT-J / Meta-reference) RoPE: pair i is (x[2i], x[2i+1]), cos/sin [..., rot/2] per pair
# ---------------------------------------------------------------------------------------------------

def make_interleaved_inputs(b, hq, hk, s, d, layout, dtype, rot=None, seed=0, device="cpu"):
    """As make_inputs, with cos/sin one entry a pair: [b, s, rot/2] (the first half of transformers' table)."""
    q, k, cos, sin, dq, dk = make_inputs(b, hq, hk, s, d, layout, dtype, rot=rot, seed=seed, device=device)
    half = cos.shape[-1] // 2
    return q, k, cos[..., :half].contiguous(), sin[..., :half].contiguous(), dq, dk


def pattern_interleaved(layout):
    dim = _unsqueeze(layout)

    def rot(x, c, s):
        r = 2 * c.shape[-1]
        y = interleaved_rope_pattern(x[..., :r], c, s)
        return y if r == x.shape[-1] else torch.cat([y, x[..., r:]], -1)

    return lambda q, k, cos, sin: (rot(q, cos.unsqueeze(dim), sin.unsqueeze(dim)),
                                   rot(k, cos.unsqueeze(dim), sin.unsqueeze(dim)))


def fused_interleaved(layout, single=False, deinterleave=False):
    """The op on interleaved pairs (``deinterleave``: written as halves, DeepSeek-V3's layout), q and k in one launch
    or (``single``) one each."""
    dim = _unsqueeze(layout)
    if single:
        return lambda q, k, cos, sin: (rope_single(q, cos.unsqueeze(dim), sin.unsqueeze(dim), True, deinterleave),
                                       rope_single(k, cos.unsqueeze(dim), sin.unsqueeze(dim), True, deinterleave))
    return lambda q, k, cos, sin: rope(q, k, cos.unsqueeze(dim), sin.unsqueeze(dim), True, deinterleave)


# Odd shapes: 3 and 5 pairs (not a power of 2), one position, more k heads than q heads.
INTERLEAVED_SHAPES = [(2, 4, 2, 9, 64, "bhsd"), (1, 3, 2, 7, 6, "bshd"), (2, 1, 3, 1, 10, "bhsd")]
INTERLEAVED_CASES = [pytest.param(shape, dtype, id=f"{shape_id(*shape)}-{DTYPE_IDS[dtype]}")
                     for shape in INTERLEAVED_SHAPES for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("shape,dtype", INTERLEAVED_CASES)
def test_interleaved_matches_pattern(shape, dtype, device):
    inputs = make_interleaved_inputs(*shape, dtype, device=device)
    layout = shape[-1]
    for single in (False, True):
        qo, ko, dq, dk = check_against_pattern(fused_interleaved(layout, single), pattern_interleaved(layout), inputs)
        assert qo.dtype == dtype and dq.dtype == dtype and qo.shape == inputs[0].shape and dk.shape == inputs[1].shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interleaved_partial_rotary_passes_the_rest(dtype, device):
    inputs = make_interleaved_inputs(2, 3, 1, 7, 48, "bhsd", dtype, rot=16, device=device)
    qo, _, dq, _ = check_against_pattern(fused_interleaved("bhsd"), pattern_interleaved("bhsd"), inputs)
    assert torch.equal(qo[..., 16:], inputs[0][..., 16:]) and torch.equal(dq[..., 16:], inputs[4][..., 16:])


def test_interleaved_equals_complex_multiplication(device):
    # Meta's reference: view_as_complex(x) * freqs_cis, with cos = freqs_cis.real, sin = freqs_cis.imag.
    q, k, cos, sin, _, _ = make_interleaved_inputs(2, 2, 2, 5, 16, "bhsd", torch.float32, device=device)
    cis = torch.complex(cos, sin).unsqueeze(1)
    ref = torch.view_as_real(torch.view_as_complex(q.double().reshape(*q.shape[:-1], -1, 2)) * cis.to(torch.complex128))
    torch.testing.assert_close(rope_single(q, cos.unsqueeze(1), sin.unsqueeze(1), True), ref.flatten(-2).float())


def test_interleaved_backward_rotates_by_minus_theta(device):
    # With unit (cos, sin) the backward is the inverse rotation: it undoes the forward.
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, device=device).float()
    theta = torch.rand(2, 1, 5, 4, device=device) * 6
    y = rope_single(x, theta.cos(), theta.sin(), True)
    back = torch.ops.sloth.rope_single_backward(y, theta.cos(), theta.sin(), torch.float32, True)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)


def test_interleaved_cos_sin_wider_than_pairs_is_refused(device):
    q, k, cos, sin, _, _ = make_inputs(1, 2, 2, 3, 16, "bhsd", torch.float32, device=device)  # [.., 16]: 16 pairs > 8
    with pytest.raises(ValueError, match="do not fit"):
        rope_single(q, cos.unsqueeze(1), sin.unsqueeze(1), True)


@pytest.mark.parametrize("shape,dtype,rot", [((2, 3, 1, 5, 16, "bhsd"), torch.float32, None),
                                             ((1, 2, 2, 3, 12, "bshd"), torch.bfloat16, 8)],
                         ids=["B2-D16-fp32", "B1-D12-R8-bf16"])
def test_interleaved_opcheck(shape, dtype, rot, device):
    register()
    q, k, cos, sin, dq, dk = make_interleaved_inputs(*shape, dtype, rot=rot, device=device)
    dim = _unsqueeze(shape[-1])
    cos, sin = cos.unsqueeze(dim), sin.unsqueeze(dim)
    torch.library.opcheck(torch.ops.sloth.rope.default,
                          (q.requires_grad_(True), k.requires_grad_(True), cos, sin, True))
    torch.library.opcheck(torch.ops.sloth.rope_single.default, (q, cos, sin, True))
    torch.library.opcheck(torch.ops.sloth.rope_backward.default, (dq, dk, cos, sin, dtype, dtype, True))
    torch.library.opcheck(torch.ops.sloth.rope_single_backward.default, (dq, cos, sin, dtype, True))


@pytest.mark.parametrize("deinterleave,rot", [(False, 16), (True, None)], ids=["pairs-R16", "deinterleave"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interleaved_fallback_matches_triton(dtype, deinterleave, rot, device):
    inputs = make_interleaved_inputs(1, 2, 2, 5, 24, "bshd", dtype, rot=rot, device=device)
    for fused in (fused_interleaved("bshd", deinterleave=deinterleave),
                  fused_interleaved("bshd", single=True, deinterleave=deinterleave)):
        triton_out = forward_backward(fused, *inputs)
        with pytest.MonkeyPatch.context() as mp:
            force_fallback(mp, lowering, "_rope_kernel")
            fallback_out = forward_backward(fused, *inputs)
        for name, a, b in zip(("q_out", "k_out", "dq", "dk"), fallback_out, triton_out):
            assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
            torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------------
# De-interleaving RoPE (DeepSeek-V3's apply_rotary_pos_emb_interleave): interleaved pairs in, halves out
# ---------------------------------------------------------------------------------------------------

def pattern_deinterleaving(layout):
    dim = _unsqueeze(layout)
    return lambda q, k, cos, sin: (deinterleaving_rope_pattern(q, cos.unsqueeze(dim), sin.unsqueeze(dim)),
                                   deinterleaving_rope_pattern(k, cos.unsqueeze(dim), sin.unsqueeze(dim)))


# DeepSeek-V3's rope head is 64 dims, its k a single head shared by every q head ([b, 1, s, 64]); odd sizes too.
DEINTERLEAVING_SHAPES = [(2, 4, 1, 9, 64, "bhsd"), (1, 3, 2, 7, 6, "bshd"), (2, 1, 3, 1, 10, "bhsd")]
DEINTERLEAVING_CASES = [pytest.param(shape, dtype, id=f"{shape_id(*shape)}-{DTYPE_IDS[dtype]}")
                        for shape in DEINTERLEAVING_SHAPES for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("shape,dtype", DEINTERLEAVING_CASES)
def test_deinterleaving_matches_pattern(shape, dtype, device):
    inputs = make_interleaved_inputs(*shape, dtype, device=device)
    layout = shape[-1]
    for single in (False, True):
        qo, ko, dq, dk = check_against_pattern(fused_interleaved(layout, single, True), pattern_deinterleaving(layout),
                                               inputs)
        assert qo.dtype == dtype and dq.dtype == dtype and qo.shape == inputs[0].shape and dk.shape == inputs[1].shape
        assert qo.is_contiguous() and dq.is_contiguous()


def test_deinterleaving_is_the_interleaved_rotation_written_as_halves(device):
    q, k, cos, sin, _, _ = make_interleaved_inputs(2, 2, 2, 5, 16, "bhsd", torch.float32, device=device)
    pairs = rope_single(q, cos.unsqueeze(1), sin.unsqueeze(1), True)
    halves = rope_single(q, cos.unsqueeze(1), sin.unsqueeze(1), True, True)
    torch.testing.assert_close(halves, torch.cat([pairs[..., 0::2], pairs[..., 1::2]], -1), rtol=0, atol=0)


def test_deinterleaving_backward_undoes_the_forward(device):
    # With unit (cos, sin) the backward is the inverse rotation, reading the halves and writing the pairs back.
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, device=device).float()
    theta = torch.rand(2, 1, 5, 4, device=device) * 6
    y = rope_single(x, theta.cos(), theta.sin(), True, True)
    back = torch.ops.sloth.rope_single_backward(y, theta.cos(), theta.sin(), torch.float32, True, True)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)


def test_deinterleave_needs_interleaved(device):
    q, k, cos, sin, _, _ = make_interleaved_inputs(1, 2, 1, 3, 16, "bhsd", torch.float32, device=device)
    with pytest.raises(ValueError, match="deinterleave=True rotates interleaved pairs"):
        rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1), False, True)


def test_deinterleaving_opcheck(device):
    register()
    q, k, cos, sin, dq, dk = make_interleaved_inputs(2, 3, 1, 5, 16, "bhsd", torch.float32, device=device)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    torch.library.opcheck(torch.ops.sloth.rope.default,
                          (q.requires_grad_(True), k.requires_grad_(True), cos, sin, True, True))
    torch.library.opcheck(torch.ops.sloth.rope_single.default, (q, cos, sin, True, True))
    torch.library.opcheck(torch.ops.sloth.rope_backward.default, (dq, dk, cos, sin, torch.float32, torch.float32,
                                                                  True, True))


# ---------------------------------------------------------------------------------------------------
# bshd_out: results (and the backward's input gradients) in the projection's [b, s, h, d] memory
# ---------------------------------------------------------------------------------------------------

def _is_bshd(t: torch.Tensor) -> bool:
    return t.transpose(1, 2).is_contiguous() and not (t.shape[1] > 1 and t.shape[2] > 1 and t.is_contiguous())


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
@pytest.mark.parametrize("input_layout", ["bhsd", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fallback", [False, True], ids=["triton", "reference"])
def test_bshd_out_writes_that_layout_with_the_same_values(interleaved, input_layout, dtype, fallback, monkeypatch,
                                                          device):
    # The layout comes from the argument, not from the input: a contiguous input gets the [b, s, h, d] memory too.
    b, hq, hk, s, d = 2, 3, 1, 7, 24
    make = make_interleaved_inputs if interleaved else make_inputs
    q, k, cos, sin, dq, dk = make(b, hq, hk, s, d, "bhsd", dtype, rot=16, device=device)
    if input_layout == "contiguous":
        q, k = q.contiguous(), k.contiguous()
    if fallback:
        force_fallback(monkeypatch, lowering, "_rope_kernel")
    c, sn = cos.unsqueeze(1), sin.unsqueeze(1)
    runs = {bshd: forward_backward(lambda q, k, cos, sin: rope(q, k, c, sn, interleaved, False, bshd), q, k, cos, sin,
                                   dq, dk) for bshd in (False, True)}
    singles = forward_backward(lambda q, k, cos, sin: (rope_single(q, c, sn, interleaved, False, True),
                                                       rope_single(k, c, sn, interleaved, False, True)),
                               q, k, cos, sin, dq, dk)
    for name, plain, laid, single in zip(("q_out", "k_out", "dq", "dk"), runs[False], runs[True], singles):
        assert plain.is_contiguous() and _is_bshd(laid) and _is_bshd(single), name
        assert torch.equal(plain, laid) and torch.equal(plain, single), name  # the same kernel math, another layout


def test_bshd_out_opcheck(device):
    register()
    q, k, cos, sin, dq, dk = make_inputs(2, 3, 1, 5, 16, "bhsd", torch.float32, device=device)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    torch.library.opcheck(torch.ops.sloth.rope.default,
                          (q.requires_grad_(True), k.requires_grad_(True), cos, sin, False, False, True))
    torch.library.opcheck(torch.ops.sloth.rope_single.default, (q, cos, sin, False, False, True))
    torch.library.opcheck(torch.ops.sloth.rope_backward.default, (dq, dk, cos, sin, q.dtype, k.dtype, False, False,
                                                                  True))
    torch.library.opcheck(torch.ops.sloth.rope_single_backward.default, (dq, cos, sin, q.dtype, False, False, True))
