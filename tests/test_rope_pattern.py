"""The RoPE family pass: what it matches (exact counts, q and k in one launch), what it must refuse, and
that the compiled result equals eager under the tolerance rule (tests/tolerance.py), forward and the
gradients of q and k.

Every case compiles with ``torch.compile(fn, backend="sloth", options={"inner": ...})`` and reads
``sloth.last_report()``. "eager" is the same function run uncompiled at the tested dtype; the reference is
the same function on float64 copies of the same values (inv_freq in float64 too: the functions below
never upcast to fp32 themselves, so the float64 run stays float64).

The functions take projections ``[b, s, h*d]`` and position ids, and build q/k (a non-contiguous
transposed view) and cos/sin inside the graph, as transformers' attention does.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional

import pytest
import torch

import sloth
from sloth.compiler.backend import sloth_backend
from sloth.patterns.rope import rotate_half
from tolerance import assert_close
from pattern_checks import line_of, seeded

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
B, S, D = 2, 7, 16
HQ, HK = 3, 1


# ---------------------------------------------------------------------------------------------------
# The functions under test (user code: the report points at these lines)
# ---------------------------------------------------------------------------------------------------

def cos_sin(inv_freq, pos, dtype):
    """transformers' rotary embedding: [b, s, d] tables from position ids, cast to the activations' dtype."""
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def heads(p, h, layout="bhsd"):
    x = p.view(p.shape[0], p.shape[1], h, D)  # a static head dim, as attention modules write it
    return x.transpose(1, 2) if layout == "bhsd" else x


def rotate_half_chunk(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_split(x):
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)
    return torch.concat([x2 * -1, x1], -1)


def rotate_half_narrow(x):
    h = x.shape[-1] // 2
    return torch.cat([x.narrow(-1, h, h).neg(), x[:, :, :, :h]], dim=3)


def make_llama(rh=rotate_half, layout="bhsd"):
    def fn(qp, kp, inv_freq, pos):
        q, k = heads(qp, HQ, layout), heads(kp, HK, layout)
        cos, sin = cos_sin(inv_freq, pos, qp.dtype)
        dim = 1 if layout == "bhsd" else 2
        cos, sin = cos.unsqueeze(dim), sin.unsqueeze(dim)
        q_embed = (q * cos) + (rh(q) * sin)
        k_embed = (k * cos) + (rh(k) * sin)
        return q_embed, k_embed
    return fn


def operands_reordered(qp, kp, inv_freq, pos):
    q, k = heads(qp, HQ), heads(kp, HK)
    cos, sin = cos_sin(inv_freq, pos, qp.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return sin * rotate_half(q) + cos * q, rotate_half(k) * sin + k * cos


def table_rope(qp, kp, cos_cached, sin_cached):
    # A precomputed [max_len, d] table sliced to the sequence: broadcasts over batch and heads.
    q, k = heads(qp, HQ), heads(kp, HK)
    cos, sin = cos_cached[: qp.shape[1]], sin_cached[: qp.shape[1]]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def q_only(qp, kp, inv_freq, pos):
    q, k = heads(qp, HQ), heads(kp, HK)
    cos, sin = cos_sin(inv_freq, pos, qp.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * 2


def different_positions(qp, kp, inv_freq, pos):
    q, k = heads(qp, HQ), heads(kp, HK)
    cos_q, sin_q = cos_sin(inv_freq, pos, qp.dtype)
    cos_k, sin_k = cos_sin(inv_freq, pos + 3, qp.dtype)
    q_embed = q * cos_q.unsqueeze(1) + rotate_half(q) * sin_q.unsqueeze(1)
    k_embed = k * cos_k.unsqueeze(1) + rotate_half(k) * sin_k.unsqueeze(1)
    return q_embed, k_embed


def cos_where_sin(qp, kp, inv_freq, pos):
    # q multiplies rotate_half by cos: a different (still exact) op for q, so no pair with k.
    q, k = heads(qp, HQ), heads(kp, HK)
    cos, sin = cos_sin(inv_freq, pos, qp.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * cos, k * cos + rotate_half(k) * sin


def three_tensors(qp, kp, inv_freq, pos):
    q, k, v = heads(qp, HQ), heads(kp, HK), heads(kp * 0.5, HK)
    cos, sin = cos_sin(inv_freq, pos, qp.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v * cos + rotate_half(v) * sin


def partial_rotary(qp, kp, inv_freq, pos):
    # Phi/StableLM/GPT-NeoX: the first r = cos.shape[-1] dims rotate, the rest pass through.
    q, k = heads(qp, HQ), heads(kp, HK)
    cos, sin = cos_sin(inv_freq[: D // 4], pos, qp.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    q_rot, q_pass = q[..., :r], q[..., r:]
    k_rot, k_pass = k[..., :r], k[..., r:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def partial_rotary_inline(qp, kp, inv_freq, pos):
    # The rotated part sliced where it is used (two equal q[..., :r] views), k with a wider head than q.
    q = heads(qp, HQ)
    k = heads(kp, HK).repeat(1, 1, 1, 2)
    cos, sin = cos_sin(inv_freq[: D // 4], pos, qp.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    q_embed = torch.cat([q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]], dim=-1)
    k_embed = torch.cat([k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]], dim=-1)
    return q_embed, k_embed


def interleaved_cos_sin(inv_freq, pos, dtype):
    """GPT-J's per-pair tables [b, 1, s, d/2] (no doubling cat), cast to the activations' dtype."""
    freqs = pos[..., None] * inv_freq
    return freqs.cos().to(dtype)[:, None], freqs.sin().to(dtype)[:, None]


def gptj_rotate(x, cos, sin):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def interleaved_real(qp, kp, inv_freq, pos):
    # GPT-J / Meta-reference interleaved RoPE written in real arithmetic.
    q, k = heads(qp, HQ), heads(kp, HK)
    cos, sin = interleaved_cos_sin(inv_freq, pos, qp.dtype)
    return gptj_rotate(q, cos, sin), gptj_rotate(k, cos, sin)


def interleaved_respelled(qp, kp, inv_freq, pos):
    # Explicit slice bounds, operands reordered, a reshape instead of flatten, bshd layout.
    q, k = heads(qp, HQ, "bshd"), heads(kp, HK, "bshd")
    freqs = pos[..., None] * inv_freq
    cos, sin = freqs.cos().to(qp.dtype)[:, :, None], freqs.sin().to(qp.dtype)[:, :, None]

    def rot(x):
        xe, xo = x[:, :, :, 0:D:2], x[:, :, :, 1:D:2]
        return torch.stack([cos * xe - sin * xo, sin * xe + cos * xo], 4).reshape(x.shape)
    return rot(q), rot(k)


def interleaved_gptj(qp, kp, inv_freq, pos):
    # transformers' GPT-J: rotate_every_two with repeat_interleave'd per-pair tables, q and k each building
    # their own tables (so two single launches, as in GPT-J).
    def rot(x):
        cos, sin = interleaved_cos_sin(inv_freq, pos, qp.dtype)
        cos, sin = torch.repeat_interleave(cos, 2, 3), torch.repeat_interleave(sin, 2, -1)
        return x * cos + torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2) * sin
    return rot(heads(qp, HQ)), rot(heads(kp, HK))


def interleaved_partial(qp, kp, inv_freq, pos):
    # GPT-J's rotary_dim < head_dim in the even/odd stack form: the first D/2 dims rotated in pairs.
    q, k = heads(qp, HQ), heads(kp, HK)
    cos, sin = interleaved_cos_sin(inv_freq[: D // 4], pos, qp.dtype)
    r = D // 2
    return (torch.cat([gptj_rotate(q[..., :r], cos, sin), q[..., r:]], -1),
            torch.cat([gptj_rotate(k[..., :r], cos, sin), k[..., r:]], -1))


def interleaved_q_only(qp, kp, inv_freq, pos):
    q, k = heads(qp, HQ), heads(kp, HK)
    cos, sin = interleaved_cos_sin(inv_freq, pos, qp.dtype)
    return gptj_rotate(q, cos, sin), k * 2


def halves_rotate(x, cos, sin):
    # GPT-OSS's _apply_rotary_emb: rotate-half written out on the two halves, per-pair tables [..., d/2].
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def halves_gpt_oss(qp, kp, inv_freq, pos):
    q, k = heads(qp, HQ), heads(kp, HK)
    cos, sin = interleaved_cos_sin(inv_freq, pos, qp.dtype)
    return halves_rotate(q, cos, sin), halves_rotate(k, cos, sin)


def halves_respelled(qp, kp, inv_freq, pos):
    # Slices instead of chunk, every product's operands swapped, bshd layout with [b, s, 1, d/2] tables.
    q, k = heads(qp, HQ, "bshd"), heads(kp, HK, "bshd")
    freqs = pos[..., None] * inv_freq
    cos, sin = freqs.cos().to(qp.dtype)[:, :, None], freqs.sin().to(qp.dtype)[:, :, None]

    def rot(x):
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([cos * x1 - sin * x2, sin * x1 + cos * x2], -1)
    return rot(q), rot(k)


def halves_wrong_tables(qp, kp, inv_freq, pos):
    # The second half rotated with the tables swapped (x2 * sin + x1 * cos): not a rotation. Must stay.
    q = heads(qp, HQ)
    cos, sin = interleaved_cos_sin(inv_freq, pos, qp.dtype)
    x1, x2 = torch.chunk(q, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * sin + x1 * cos), dim=-1)


def meta_complex(qp, kp, inv_freq, pos):
    # Meta's reference Llama: view_as_complex(x.float()) * freqs_cis, back to real, type_as(x).
    q, k = heads(qp, HQ), heads(kp, HK)
    freqs = pos[..., None] * inv_freq
    cis = torch.polar(torch.ones_like(freqs), freqs)[:, None]

    def rot(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * cis).flatten(3).type_as(x)
    return rot(q), rot(k)


def meta_complex_reference(qp, kp, inv_freq, pos):
    # The float64 run keeps float64 (x.float() would round it to fp32) and complex128.
    q, k = heads(qp, HQ), heads(kp, HK)
    freqs = pos[..., None] * inv_freq
    cis = torch.polar(torch.ones_like(freqs), freqs)[:, None]

    def rot(x):
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(cis * xc).flatten(3)
    return rot(q), rot(k)


def even_odd_concatenated(qp, kp, inv_freq, pos):
    # DeepSeek's apply_rotary_pos_emb_interleave on q alone: pairs rotated on even/odd slices, the halves
    # concatenated (the op's de-interleaving layout).
    q = heads(qp, HQ)
    cos, sin = interleaved_cos_sin(inv_freq, pos, qp.dtype)
    x1, x2 = q[..., 0::2], q[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def deepseek_interleave(qp, kp, inv_freq, pos):
    # transformers 5.25's DeepSeek-V3 apply_rotary_pos_emb_interleave: full tables cat(freqs, freqs) halved again
    # inside, q and k (DeepSeek's k is one head shared by every q head: HK here).
    q, k = heads(qp, HQ), heads(kp, HK)
    cos, sin = cos_sin(inv_freq, pos, qp.dtype)
    cos, sin = cos[..., : cos.shape[-1] // 2].unsqueeze(1), sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    return (torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
            torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1))


def deinterleave_respelled(qp, kp, inv_freq, pos):
    # bshd layout, explicit slice bounds, every product's operands swapped.
    q, k = heads(qp, HQ, "bshd"), heads(kp, HK, "bshd")
    freqs = pos[..., None] * inv_freq
    cos, sin = freqs.cos().to(qp.dtype)[:, :, None], freqs.sin().to(qp.dtype)[:, :, None]

    def rot(x):
        xe, xo = x[:, :, :, 0:D:2], x[:, :, :, 1:D:2]
        return torch.cat((cos * xe - sin * xo, sin * xe + cos * xo), -1)
    return rot(q), rot(k)


def interleaved_stacked_over_pairs(qp, kp, inv_freq, pos):
    # stack over dim -2 then flatten: [y_even..., y_odd...], the halves layout (DeepSeek's de-interleaving op).
    q = heads(qp, HQ)
    cos, sin = interleaved_cos_sin(inv_freq, pos, qp.dtype)
    x1, x2 = q[..., ::2], q[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-2).flatten(-2)


def cohere_rotary(qp, kp, inv_freq, pos):
    # transformers' Cohere (Command-R/A): the tables repeated by pairs before the cosine (repeat_interleave(freqs,
    # 2, -1).cos() * scaling, cast), q and k upcast, rotate_half written as rotate_every_two, the result cast back.
    q, k = heads(qp, HQ), heads(kp, HK)
    emb = torch.repeat_interleave(pos[..., None] * inv_freq, 2, dim=-1)
    cos, sin = (emb.cos() * 1.0).to(qp.dtype).unsqueeze(1), (emb.sin() * 1.0).to(qp.dtype).unsqueeze(1)

    def rot(x):
        xf = x.float()
        rotated = torch.stack([-xf[..., 1::2], xf[..., ::2]], dim=-1).flatten(-2)
        return (xf * cos + rotated * sin).to(x.dtype)
    return rot(q), rot(k)


def nanochat_rotary(qp, kp, inv_freq, pos):
    # transformers' NanoChat: rotate_half with flipped signs, cat((x2, -x1)), the rotation by -theta (the op's
    # with sin negated, one node shared by q and k).
    q, k = heads(qp, HQ), heads(kp, HK)
    cos, sin = cos_sin(inv_freq, pos, qp.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return x * cos + torch.cat((x2, -x1), dim=-1) * sin
    return rot(q), rot(k)


def checkpointed(qp, kp, inv_freq, pos):
    return torch.utils.checkpoint.checkpoint(make_llama(), qp, kp, inv_freq, pos, use_reentrant=False)


LLAMA = make_llama()


# ---------------------------------------------------------------------------------------------------
# Case plumbing: make(dtype, ref) -> args; the first two (q and k projections) get gradients
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    id: str
    fn: Callable
    count: int
    ops: Optional[dict] = None  # sloth op name -> number of sites (None: not checked)
    reason: Optional[str] = None  # for near-misses: a word the rejection must contain
    table: bool = False  # pass precomputed cos/sin tables instead of (inv_freq, pos)
    reference: Optional[Callable] = None


def make_args(case: Case, dtype: torch.dtype, ref: bool, seq: int = S) -> list:
    g = seeded(1)
    qp = torch.randn(B, seq, HQ * D, generator=g).to(dtype)
    kp = torch.randn(B, seq, HK * D, generator=g).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    pos = torch.randint(0, 64, (B, seq), generator=g)
    if ref:
        qp, kp = qp.double(), kp.double()
    if case.table:
        t = torch.arange(32, dtype=torch.float64)[:, None] * inv_freq
        emb = torch.cat((t, t), -1)
        return [qp, kp, emb.cos().to(dtype).to(qp.dtype), emb.sin().to(dtype).to(qp.dtype)]
    inv_freq = inv_freq.float()
    return [qp, kp, inv_freq.double() if ref else inv_freq, pos]


def forward_backward(fn: Callable, args: list, dtype: torch.dtype) -> list[torch.Tensor]:
    """[outputs..., dq_proj, dk_proj] for seeded cotangents (rounded to ``dtype``, the tested one)."""
    args = [a.detach().requires_grad_(i < 2) for i, a in enumerate(args)]
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = seeded(3)
    cots = [torch.randn(o.shape, generator=g).to(dtype).to(o.dtype) for o in outs]
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, args[:2], cots, materialize_grads=True))


def check_case(case: Case, dtype: torch.dtype, inner: str = "eager", **compile_kwargs) -> sloth.Report:
    eager = forward_backward(case.fn, make_args(case, dtype, False), dtype)
    reference = forward_backward(case.reference or case.fn, make_args(case, dtype, True), dtype)
    compiled = torch.compile(case.fn, backend="sloth", options={"inner": inner},
                             **{"fullgraph": True, **compile_kwargs})
    actual = forward_backward(compiled, make_args(case, dtype, False), dtype)
    report = sloth.last_report()
    assert report is not None
    assert report.counts.get("rope", 0) == case.count, str(report)
    if case.ops is not None:
        ops = {}
        for s in report.sites:
            if s.family == "rope":
                ops[s.op] = ops.get(s.op, 0) + 1
        assert ops == case.ops, str(report)
    reasons = [r.reason for r in report.rejections if r.family == "rope"]
    if case.reason is not None:
        assert any(case.reason in r for r in reasons), f"no rejection mentioning {case.reason!r}: {reasons}"
    elif case.count:
        assert not reasons, str(report)
    assert len(actual) == len(eager) == len(reference)
    for i, (a, e, r) in enumerate(zip(actual, eager, reference)):
        assert_close(f"{case.id}-{str(dtype)[6:]}: [{i}]", a, e, r)
    return report


PAIR = {"sloth.rope": 1}

MATCHES = [
    Case("llama-slices", LLAMA, 1, PAIR),
    Case("chunk", make_llama(rotate_half_chunk), 1, PAIR),
    Case("split-concat-times-minus-one", make_llama(rotate_half_split), 1, PAIR),
    Case("narrow-neg-method", make_llama(rotate_half_narrow), 1, PAIR),
    Case("bshd-layout", make_llama(layout="bshd"), 1, PAIR),
    Case("operands-reordered", operands_reordered, 1, PAIR),
    Case("precomputed-table", table_rope, 1, PAIR, table=True),
    Case("partial-rotary", partial_rotary, 1, PAIR),
    # Heads of 16 and 32 dims cannot share a launch: two single ones.
    Case("partial-rotary-inline-two-head-dims", partial_rotary_inline, 2, {"sloth.rope_single": 2}),
    Case("q-only", q_only, 1, {"sloth.rope_single": 1}),
    Case("different-positions", different_positions, 2, {"sloth.rope_single": 2}),
    Case("cos-where-sin", cos_where_sin, 2, {"sloth.rope_single": 2}),
    Case("three-tensors", three_tensors, 2, {"sloth.rope": 1, "sloth.rope_single": 1}),
    # The checkpoint's recompute runs in the autograd engine; the float64 run does without it.
    Case("checkpointed", checkpointed, 1, PAIR, reference=LLAMA),
    Case("negated-rotation-nanochat", nanochat_rotary, 1, PAIR),
    Case("interleaved-gptj-real", interleaved_real, 1, PAIR),
    Case("interleaved-respelled-bshd", interleaved_respelled, 1, PAIR),
    Case("interleaved-q-only", interleaved_q_only, 1, {"sloth.rope_single": 1}),
    Case("interleaved-gptj-rotate-every-two", interleaved_gptj, 2, {"sloth.rope_single": 2}),
    Case("interleaved-partial-rotary", interleaved_partial, 1, PAIR),
    # bf16: as meta-complex, k's upcast comes after q's site and moves up to pair with q
    Case("interleaved-cohere-repeated-tables", cohere_rotary, 1, PAIR),
    Case("halves-gpt-oss", halves_gpt_oss, 1, PAIR),
    Case("deinterleave-q-only", even_odd_concatenated, 1, {"sloth.rope_single": 1}),
    Case("deinterleave-deepseek-v3", deepseek_interleave, 1, PAIR),
    Case("deinterleave-respelled-bshd", deinterleave_respelled, 1, PAIR),
    Case("deinterleave-stacked-over-pairs", interleaved_stacked_over_pairs, 1, {"sloth.rope_single": 1}),
    Case("halves-respelled-bshd", halves_respelled, 1, PAIR),
    # bf16: q.float() and k.float() are two nodes, k's after q's site: it moves up, one launch.
    Case("meta-complex", meta_complex, 1, PAIR, reference=meta_complex_reference),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MATCHES, ids=[c.id for c in MATCHES])
def test_match(case, dtype):
    check_case(case, dtype)


def meta_complex_conj(qp, kp, inv_freq, pos):
    # freqs_cis.conj(): torch.imag of the conjugate view is -sin, so the fused op is still exact.
    q = heads(qp, HQ)
    freqs = pos[..., None] * inv_freq
    cis = torch.polar(torch.ones_like(freqs), freqs)[:, None].conj()
    xc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis).flatten(3).type_as(q)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conjugated_freqs_cis_matches_exactly(dtype):
    check_case(Case("meta-complex-conj", meta_complex_conj, 1, {"sloth.rope_single": 1}), dtype)


def test_complex_freqs_cis_without_cast_matches():
    check_case(Case("complex-freqs-cis", complex_freqs, 1, {"sloth.rope_single": 1}), torch.float32)


@pytest.mark.parametrize("case", [c for c in MATCHES if c.id in ("llama-slices", "partial-rotary", "q-only",
                                                                 "interleaved-gptj-real", "interleaved-q-only")],
                         ids=lambda c: c.id)
def test_match_aot_eager(case):
    check_case(case, torch.bfloat16, inner="aot_eager")


def test_match_inductor():
    check_case(MATCHES[0], torch.float32, inner="inductor")


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_interleaved_match_compiled_inner(inner):
    check_case(next(c for c in MATCHES if c.id == "interleaved-gptj-real"), torch.float32, inner=inner)
    check_case(next(c for c in MATCHES if c.id == "meta-complex"), torch.float32, inner=inner)


def test_the_fused_op_is_in_the_graph():
    graphs = []

    def capture(gm, example_inputs):
        out = sloth_backend(gm, example_inputs, options={"inner": "eager"})
        graphs.append(gm)
        return out

    torch.compile(LLAMA, backend=capture, fullgraph=True)(*make_args(MATCHES[0], torch.bfloat16, False))
    nodes = list(graphs[0].graph.nodes)
    (fused,) = [n for n in nodes if n.target is torch.ops.sloth.rope.default]
    assert not [n for n in nodes if n.target in (torch.narrow, torch.neg)]
    assert [n.target for n in nodes].count(torch.cat) == 1  # only cos_sin's table remains
    q, k, cos, sin, *flags = fused.args
    assert q.target == "transpose" and k.target == "transpose"  # the non-contiguous views, read in place
    # ... and the rotated q and k are written in their [b, s, h, d] memory (lowering/rope.py, "Output layout")
    assert flags == [False, False, True]
    assert all(t.transpose(1, 2).is_contiguous() for t in fused.meta["example_value"])
    assert cos is not sin and cos.target == "unsqueeze"


@pytest.mark.parametrize("case_id", ["interleaved-gptj-real", "meta-complex"])
def test_interleaved_site_is_erased(case_id):
    graphs = []

    def capture(gm, example_inputs):
        out = sloth_backend(gm, example_inputs, options={"inner": "eager"})
        graphs.append(gm)
        return out

    case = next(c for c in MATCHES if c.id == case_id)
    torch.compile(case.fn, backend=capture, fullgraph=True)(*make_args(case, torch.float32, False))
    nodes = list(graphs[0].graph.nodes)
    (fused,) = [n for n in nodes if n.target is torch.ops.sloth.rope.default]
    assert fused.args[4] is True
    assert not [n for n in nodes if n.target in (torch.stack, "flatten", "reshape", torch.sub, torch.view_as_complex,
                                                 torch.view_as_real)]
    if case_id == "meta-complex":  # cos/sin are the parts of freqs_cis, taken once for q and k
        assert fused.args[2].target is torch.real and fused.args[3].target is torch.imag
    assert not [n for n in nodes if n.target is operator.getitem and isinstance(n.args[1], tuple)
                and any(isinstance(i, slice) and i.step == 2 for i in n.args[1])]


# ---------------------------------------------------------------------------------------------------
# Near-misses: must not match, must say why (where there is a RoPE-shaped subgraph), must not crash
# ---------------------------------------------------------------------------------------------------



def halves_swapped(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x1, x2), dim=-1)


def no_negation(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((x2, x1), dim=-1)


def over_seq_dim(x):
    h = x.shape[-2] // 2
    return torch.cat((-x[..., h:, :], x[..., :h, :]), dim=-2)


def rotate_half_also_returned(qp, kp, inv_freq, pos):
    q = heads(qp, HQ)
    cos, sin = cos_sin(inv_freq, pos, qp.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rq = rotate_half(q)
    return q * cos + rq * sin, rq


def mismatched_cos_sin(qp, kp, inv_freq, pos):
    q = heads(qp, HQ)
    cos, sin = cos_sin(inv_freq, pos, qp.dtype)
    return q * cos.unsqueeze(1) + rotate_half(q) * sin[:1].unsqueeze(1)


def cos_enlarges_x(qp, kp, inv_freq, pos):
    q = heads(qp[:1], HQ)  # batch 1, cos/sin batch 2
    cos, sin = cos_sin(inv_freq, pos, qp.dtype)
    return q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)


def every_two_near_miss(rotate, table):
    def fn(qp, kp, inv_freq, pos):
        q = heads(qp, HQ)
        freqs = pos[..., None] * inv_freq
        c, s = freqs.cos().to(qp.dtype)[:, None], freqs.sin().to(qp.dtype)[:, None]
        return q * table(c) + rotate(q) * table(s)
    return fn


def every_two_sign_flipped(x):
    # stack((x_odd, -x_even)): the rotation by -theta. Must stay as it was.
    return torch.stack((x[..., 1::2], -x[..., ::2]), dim=-1).flatten(-2)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def complex_freqs(qp, kp, inv_freq, pos):
    # Meta's Llama without the cast: view_as_complex(q) * freqs_cis (fp32 only: no bf16 complex).
    q = heads(qp, HQ)
    freqs = pos[..., None] * inv_freq
    cis = torch.polar(torch.ones_like(freqs), freqs)[:, None]
    qc = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2))
    return torch.view_as_real(qc * cis).flatten(-2)


def complex_divided(qp, kp, inv_freq, pos):
    # Division by freqs_cis: the rotation by -theta. Must stay as it was.
    q = heads(qp, HQ)
    freqs = pos[..., None] * inv_freq
    cis = torch.polar(torch.ones_like(freqs), freqs)[:, None]
    qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    return torch.view_as_real(qc / cis).flatten(-2).type_as(q)


def interleaved_sign_flipped(qp, kp, inv_freq, pos):
    # x1*c + x2*s: the rotation by -theta in the forward. Must stay as it was.
    q = heads(qp, HQ)
    cos, sin = interleaved_cos_sin(inv_freq, pos, qp.dtype)
    x1, x2 = q[..., ::2], q[..., 1::2]
    return torch.stack((x1 * cos + x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def interleaved_parity_swapped(qp, kp, inv_freq, pos):
    # The odd elements first: a different rotation. Must stay as it was.
    q = heads(qp, HQ)
    cos, sin = interleaved_cos_sin(inv_freq, pos, qp.dtype)
    x1, x2 = q[..., 1::2], q[..., ::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def even_odd_wrong_sign(qp, kp, inv_freq, pos):
    # The second half's sine term subtracted: not a rotation. Must stay.
    q = heads(qp, HQ)
    cos, sin = interleaved_cos_sin(inv_freq, pos, qp.dtype)
    x1, x2 = q[..., 0::2], q[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin * -1.0], dim=-1)


def make_single(rh):
    def fn(qp, kp, inv_freq, pos):
        q = heads(qp, HQ)
        cos, sin = cos_sin(inv_freq, pos, qp.dtype)
        return q * cos.unsqueeze(1) + rh(q) * sin.unsqueeze(1)
    return fn


NEAR_MISSES = [
    Case("halves-swapped", make_single(halves_swapped), 0, reason="not rotate_half"),
    Case("no-negation", make_single(no_negation), 0),  # no neg at all: a cat of slices, not RoPE-shaped
    Case("rotate-over-seq-dim", make_single(over_seq_dim), 0, reason="not the last"),
    Case("rotate-half-also-returned", rotate_half_also_returned, 0, reason="other users"),
    Case("cos-sin-shapes-differ", mismatched_cos_sin, 0, reason="different shapes"),
    Case("cos-enlarges-x", cos_enlarges_x, 0, reason="larger shape"),
    Case("every-two-sign-flipped", every_two_near_miss(every_two_sign_flipped,
                                                      lambda t: torch.repeat_interleave(t, 2, -1)), 0,
         reason="not rotate_every_two"),
    # rotate_every_two with rotate-half tables (each half a copy): not GPT-J's math. Refused with the reason.
    Case("every-two-with-halves-tables", every_two_near_miss(rotate_every_two, lambda t: torch.cat((t, t), -1)), 0,
         reason="repeat_interleave"),
    Case("complex-divided-by-freqs-cis", complex_divided, 0),
    Case("interleaved-sign-flipped", interleaved_sign_flipped, 0, reason="wrong sign"),
    Case("interleaved-parity-swapped", interleaved_parity_swapped, 0, reason="other order"),
    Case("even-odd-wrong-sign", even_odd_wrong_sign, 0),
    Case("halves-wrong-tables", halves_wrong_tables, 0, reason="wrong sign or tables"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", NEAR_MISSES, ids=[c.id for c in NEAR_MISSES])
def test_near_miss_is_left_alone(case, dtype):
    check_case(case, dtype)


def test_no_negation_is_not_a_rotation():
    # cat((x2, x1)) has one neg fewer than rotate_half: nothing RoPE-shaped to reject, and nothing matched.
    report = check_case(NEAR_MISSES[2], torch.float32)
    assert report.counts.get("rope", 0) == 0


def test_float64_is_refused():
    case = Case("float64", LLAMA, 0, reason="float64")
    check_case(case, torch.float64)


def test_cos_requiring_grad_is_refused():
    def fn(qp, cos, sin):
        q = heads(qp, HQ)
        return q * cos + rotate_half(q) * sin

    qp = torch.randn(B, S, HQ * D)
    cos, sin = torch.randn(S, D, requires_grad=True), torch.randn(S, D)
    out = torch.compile(fn, backend="sloth", options={"inner": "eager"})(qp, cos, sin)
    report = sloth.last_report()
    assert report.counts.get("rope", 0) == 0
    assert any("requires grad" in r.reason for r in report.rejections), str(report)
    out.sum().backward()
    c = cos.detach().requires_grad_(True)
    fn(qp, c, sin).sum().backward()
    torch.testing.assert_close(cos.grad, c.grad)


# ---------------------------------------------------------------------------------------------------
# Shapes that change, options, report
# ---------------------------------------------------------------------------------------------------

def test_dynamic_sequence_still_fuses_without_recompile():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return sloth_backend(gm, example_inputs, options={"inner": "eager"})

    compiled = torch.compile(LLAMA, backend=backend, dynamic=True)
    for seq in (5, 9):
        args = make_args(MATCHES[0], torch.float32, False, seq=seq)
        got, want = compiled(*args), LLAMA(*args)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert sloth.last_report().counts == {"rope": 1}, str(sloth.last_report())
    assert len(calls) == 1


def test_patterns_option_disables_the_family():
    args = make_args(MATCHES[0], torch.float32, False)
    torch.compile(LLAMA, backend="sloth", options={"inner": "eager", "patterns": ["rms_norm"]})(*args)
    report = sloth.last_report()
    assert report.counts.get("rope", 0) == 0 and "rope" in report.disabled


def test_report_names_family_and_user_source_line():
    torch.compile(LLAMA, backend="sloth", options={"inner": "eager"})(*make_args(MATCHES[0], torch.float32, False))
    text = str(sloth.last_report())
    lineno, code = line_of(make_llama, "q_embed = (q * cos)")
    assert "rope: 1" in text and "sloth.rope" in text and "q+k, head_dim 16" in text
    assert f"test_rope_pattern.py:{lineno}" in text and code in text, text


def test_report_lists_rejections_with_reason_and_line():
    fn = make_single(halves_swapped)
    torch.compile(fn, backend="sloth", options={"inner": "eager"})(*make_args(MATCHES[0], torch.float32, False))
    text = str(sloth.last_report())
    lineno, _ = line_of(make_single, "rh(q) * sin")
    assert "nothing replaced" in text and "wrong sign" in text
    assert f"test_rope_pattern.py:{lineno}" in text, text


def test_report_module_path():
    class Attention(torch.nn.Module):
        def forward(self, qp, kp, inv_freq, pos):
            return LLAMA(qp, kp, inv_freq, pos)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attention()

        def forward(self, *args):
            return self.self_attn(*args)

    torch.compile(Layer(), backend="sloth", options={"inner": "eager"})(*make_args(MATCHES[0], torch.float32, False))
    (site,) = sloth.last_report().sites
    assert site.module == "self_attn" and site.op == "sloth.rope"


def halves_partial(qp, kp, inv_freq, pos):
    # The halves form on the first D/2 dims of each head, the rest passed through.
    q, k = heads(qp, HQ), heads(kp, HK)
    cos, sin = interleaved_cos_sin(inv_freq[: D // 4], pos, qp.dtype)
    r = D // 2
    return (torch.cat([halves_rotate(q[..., :r], cos, sin), q[..., r:]], -1),
            torch.cat([halves_rotate(k[..., :r], cos, sin), k[..., r:]], -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_halves_partial_rotary(dtype):
    check_case(Case("halves-partial-rotary", halves_partial, 1, PAIR), dtype)
