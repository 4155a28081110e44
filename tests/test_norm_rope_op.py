"""The fused op ``sloth.lowering.norm_rope.norm_rope`` (q/k RMSNorm, then RoPE, in one launch): forward, dq, dk and
both norm weights' gradients against the pattern functions.

Oracle (STYLE.md, habit 5): ``patterns/norm_rope.py``'s ``qk_norm_rope_pattern`` (Qwen3's norm, then
transformers' RoPE; Gemma 3's ``(1 + w)`` with ``offset=1``; GPT-J's interleaved pairs through
``interleaved_rope_pattern``) run eagerly at the tested dtype is "eager"; the same on float64 copies is the
reference, under ``StayFloat64`` so the norm's fp32 upcast stays float64. The inputs are laid out as the attention
sees them: ``bhsd`` is ``view(b, s, h, d).transpose(1, 2)`` of a projection (non-contiguous), ``bshd`` keeps heads
after the sequence. Tensors on the ``device`` fixture's device (tests/conftest.py); tests/test_cuda_ops.py adds
Qwen3-MoE's shape on CUDA.
"""
from __future__ import annotations

import pytest
import torch

import sloth.lowering.norm_rope as lowering
from sloth.lowering.norm_rope import norm_rope
from sloth.patterns.norm_rope import qk_norm_rope_pattern, qk_rms_norm_pattern
from sloth.patterns.rope import interleaved_rope_pattern
from op_checks import StayFloat64, force_fallback, record_launches
from tolerance import assert_close

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def make_inputs(b, hq, hk, s, d, layout, dtype, rot=None, interleaved=False, weights="both", seed=0,
                device="cpu"):
    """q, k (before their norms), the norms' weights (None where ``weights`` leaves one out), cos/sin [b, s, rot]
    (one entry a pair when ``interleaved``), cotangents dq, dk; all rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    rot = rot or d
    q = torch.randn(b, s, hq, d, generator=g).mul(3).to(dtype)  # not unit rows: the norm has work to do
    k = torch.randn(b, s, hk, d, generator=g).to(dtype)
    if layout == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    wq = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype) if weights in ("both", "q") else None
    wk = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype) if weights in ("both", "k") else None
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.randint(0, 64, (b, s), generator=g).float()[..., None] * inv_freq
    emb = freqs if interleaved else torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    dq = torch.randn(q.shape, generator=g).to(dtype)
    dk = torch.randn(k.shape, generator=g).to(dtype)
    return [t if t is None else (t.to(device) if t.dim() != 4 else t.detach().to(device))
            for t in (q, k, wq, wk, cos, sin, dq, dk)]


def _dim(layout: str) -> int:
    return 1 if layout == "bhsd" else 2


def fused(layout, interleaved=False, offset=0.0):
    dim = _dim(layout)
    return lambda q, k, wq, wk, cos, sin: norm_rope(q, k, wq, wk, cos.unsqueeze(dim), sin.unsqueeze(dim),
                                                    offset=offset, interleaved=interleaved)


def pattern(layout, interleaved=False, offset=0.0):
    dim = _dim(layout)
    if not interleaved:
        return lambda q, k, wq, wk, cos, sin: qk_norm_rope_pattern(q, k, wq, wk, cos, sin, offset=offset,
                                                                   unsqueeze_dim=dim)

    def run(q, k, wq, wk, cos, sin):
        c, s = cos.unsqueeze(dim), sin.unsqueeze(dim)
        r = 2 * c.shape[-1]
        out = []
        for x, w in ((q, wq), (k, wk)):
            n = qk_rms_norm_pattern(x, w, offset=offset)
            out.append(torch.cat((interleaved_rope_pattern(n[..., :r], c, s), n[..., r:]), -1))
        return tuple(out)

    return run


def forward_backward(fn, q, k, wq, wk, cos, sin, dq, dk):
    """(q_out, k_out, dq_in, dk_in, d wq, d wk) of ``fn`` for cotangents dq, dk; a missing weight's entry is None."""
    q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)  # detach keeps a strided view's layout
    wq = wq if wq is None else wq.detach().requires_grad_(True)
    wk = wk if wk is None else wk.detach().requires_grad_(True)
    qo, ko = fn(q, k, wq, wk, cos, sin)
    wanted = [t for t in (q, k, wq, wk) if t is not None]
    grads = iter(torch.autograd.grad((qo, ko), wanted, (dq.to(qo.dtype), dk.to(ko.dtype))))
    return [qo.detach(), ko.detach(), *(None if t is None else next(grads) for t in (q, k, wq, wk))]


NAMES = ("q_out", "k_out", "dq", "dk", "d q_weight", "d k_weight")


def check_against_pattern(ours, oracle, inputs):
    """Run ``ours`` and ``oracle`` at the inputs' dtype and ``oracle`` in float64; apply the tolerance rule to every
    output and gradient. Returns ours."""
    actual = forward_backward(ours, *inputs)
    eager = forward_backward(oracle, *inputs)
    with StayFloat64():
        reference = forward_backward(oracle, *(t if t is None else t.double() for t in inputs))
    assert reference[0].dtype == torch.float64
    for name, a, e, r in zip(NAMES, actual, eager, reference):
        if r is None:
            assert a is None, name
            continue
        assert_close(name, a, e, r)
    return actual


# (b, heads of q, heads of k, seq, head_dim, layout)
SHAPES = [(1, 1, 1, 1, 16, "bhsd"), (2, 3, 1, 7, 64, "bhsd"), (2, 2, 2, 33, 96, "bshd"), (1, 4, 2, 9, 24, "bhsd")]
CASES = [pytest.param(shape, dtype, id=f"B{shape[0]}-Hq{shape[1]}-Hk{shape[2]}-S{shape[3]}-D{shape[4]}-{shape[5]}-"
                                       f"{DTYPE_IDS[dtype]}")
         for shape in SHAPES for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("shape,dtype", CASES)
def test_matches_pattern(shape, dtype, device):
    inputs = make_inputs(*shape, dtype, device=device)
    qo, ko, *_ = check_against_pattern(fused(shape[-1]), pattern(shape[-1]), inputs)
    assert qo.dtype == dtype and qo.shape == inputs[0].shape and ko.shape == inputs[1].shape
    assert qo.is_contiguous() and ko.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_partial_rotary_passes_the_rest_normalised(dtype, device):
    # Phi-style partial rotary (32 of 96 dims rotate): the last 64 are normalised, weighted and passed through.
    inputs = make_inputs(2, 3, 1, 7, 96, "bhsd", dtype, rot=32, device=device)
    check_against_pattern(fused("bhsd"), pattern("bhsd"), inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rot", [None, 16], ids=["full", "partial"])
def test_interleaved_pairs(dtype, rot, device):
    inputs = make_inputs(2, 3, 2, 7, 48, "bhsd", dtype, rot=rot, interleaved=True, device=device)
    check_against_pattern(fused("bhsd", interleaved=True), pattern("bhsd", interleaved=True), inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemma_offset(dtype, device):
    inputs = make_inputs(1, 4, 2, 9, 32, "bhsd", dtype, device=device)
    inputs[2], inputs[3] = inputs[2] - 1, inputs[3] - 1  # Gemma stores w with (1 + w) applied: near zero
    check_against_pattern(fused("bhsd", offset=1.0), pattern("bhsd", offset=1.0), inputs)


@pytest.mark.parametrize("weights", ["none", "q", "k"])
def test_weightless_norms(weights, device):
    inputs = make_inputs(2, 2, 1, 5, 32, "bhsd", torch.float32, weights=weights, device=device)
    actual = check_against_pattern(fused("bhsd"), pattern("bhsd"), inputs)
    assert (actual[4] is None) == (weights in ("none", "k")) and (actual[5] is None) == (weights in ("none", "q"))


def test_frozen_weights_get_no_gradient_and_launch_no_partials(monkeypatch, device):
    # LoRA freezes the norms: the backward asks for no weight gradient, so no partials buffer is summed.
    q, k, wq, wk, cos, sin, dq, dk = make_inputs(2, 3, 1, 7, 64, "bhsd", torch.bfloat16, device=device)
    q.requires_grad_(True)
    k.requires_grad_(True)
    launches = record_launches(monkeypatch, lowering, "_norm_rope_fwd_kernel", "_norm_rope_bwd_kernel")
    qo, ko = fused("bhsd")(q, k, wq, wk, cos, sin)
    dq_in, dk_in = torch.autograd.grad((qo, ko), (q, k), (dq, dk))
    assert [name for name, _, _ in launches] == ["_norm_rope_fwd_kernel", "_norm_rope_bwd_kernel"]
    kwargs = launches[1][2]
    assert not kwargs["COMPUTE_DW_Q"] and not kwargs["COMPUTE_DW_K"]
    reference = forward_backward(pattern("bhsd"), q, k, wq, wk, cos, sin, dq, dk)
    torch.testing.assert_close(dq_in, reference[2], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fallback_matches_pattern(dtype, monkeypatch, device):
    # Where Triton cannot run (a CPU without the interpreter) the op takes its PyTorch reference.
    force_fallback(monkeypatch, lowering, "_norm_rope_fwd_kernel", "_norm_rope_bwd_kernel")
    inputs = make_inputs(2, 2, 2, 5, 24, "bshd", dtype, rot=16, device=device)
    check_against_pattern(fused("bshd"), pattern("bshd"), inputs)


def test_opcheck(device):
    q, k, wq, wk, cos, sin, _, _ = make_inputs(2, 3, 1, 7, 32, "bhsd", torch.float32, device=device)
    lowering.register()
    args = (q.requires_grad_(True), k.requires_grad_(True), wq.requires_grad_(True), wk, cos.unsqueeze(1),
            sin.unsqueeze(1), 1e-6, 1e-5, 0.0, 0.0, torch.float32, False)
    torch.library.opcheck(torch.ops.sloth.norm_rope.default, args)


def test_cos_sin_gradient_is_refused(device):
    q, k, wq, wk, cos, sin, dq, dk = make_inputs(1, 2, 1, 5, 16, "bhsd", torch.float32, device=device)
    cos = cos.unsqueeze(1).requires_grad_(True)
    qo, ko = norm_rope(q.requires_grad_(True), k, wq, wk, cos, sin.unsqueeze(1))
    with pytest.raises(RuntimeError, match="cos and sin get no gradient"):
        (qo.sum() + ko.sum()).backward()


def test_bad_inputs_name_the_problem(device):
    q, k, wq, wk, cos, sin, _, _ = make_inputs(1, 2, 1, 5, 16, "bhsd", torch.float32, device=device)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    with pytest.raises(ValueError, match="q_weight must have shape"):
        norm_rope(q, k, wq[:8], wk, c, s)
    with pytest.raises(ValueError, match="one head dim"):
        norm_rope(q, k[..., :8], wq, wk, c, s)
    with pytest.raises(TypeError, match="k_weight must be float32"):
        norm_rope(q, k, wq, wk.to(torch.int32), c, s)


@pytest.mark.parametrize("input_layout", ["bhsd", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fallback", [False, True], ids=["triton", "reference"])
def test_bshd_out_writes_that_layout_with_the_same_values(input_layout, dtype, fallback, monkeypatch, device):
    # Results and the input gradients in the projection's [b, s, h, d] memory (lowering/rope.py, "Output layout"),
    # whatever the input's layout; the weights' gradients unchanged.
    q, k, wq, wk, cos, sin, dq, dk = make_inputs(2, 3, 1, 7, 24, "bhsd", dtype, rot=16, device=device)
    if input_layout == "contiguous":
        q, k = q.contiguous(), k.contiguous()
    if fallback:
        force_fallback(monkeypatch, lowering, "_norm_rope_fwd_kernel", "_norm_rope_bwd_kernel")
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    runs = {bshd: forward_backward(lambda q, k, wq, wk, cos, sin: norm_rope(q, k, wq, wk, c, s, bshd_out=bshd),
                                   q, k, wq, wk, cos, sin, dq, dk) for bshd in (False, True)}
    for i, (name, plain, laid) in enumerate(zip(NAMES, runs[False], runs[True])):
        if i < 4:
            one_head = laid.shape[1] == 1  # k's single head: both layouts are one memory
            assert plain.is_contiguous() and laid.transpose(1, 2).is_contiguous(), name
            assert one_head or not laid.is_contiguous(), name
        assert torch.equal(plain, laid), name


def test_bshd_out_opcheck(device):
    q, k, wq, wk, cos, sin, dq, dk = make_inputs(2, 3, 1, 7, 32, "bhsd", torch.float32, device=device)
    lowering.register()
    args = (q.requires_grad_(True), k.requires_grad_(True), wq.requires_grad_(True), wk, cos.unsqueeze(1),
            sin.unsqueeze(1), 1e-6, 1e-5, 0.0, 0.0, torch.float32, False, True)
    torch.library.opcheck(torch.ops.sloth.norm_rope.default, args)
