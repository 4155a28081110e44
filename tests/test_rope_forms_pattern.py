"""The RoPE family's stacked interleaved forms (patterns/rope_forms.py), and the rule that every form the pass fuses
is also an anchor (compiler/anchors.py): a form the pass stops fusing is then reported, never silent.

The forms are written as their projects write them (llama2.c's ``apply_rotary_emb``, torchtune's
``RotaryPositionalEmbeddings``, ChatGLM's partial rotary) and run inside a tiny attention module (q, k, v
projections viewed as [b, s, h, d], RoPE, causal SDPA) compiled with ``backend="sloth"``. "eager" is the module
uncompiled at the tested dtype; the reference is the module on float64 copies, without the ``x.float()`` upcast
(which would round float64 to float32). Output and the gradients of the q, k and v projections are compared
under the tolerance rule (tests/tolerance.py).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sloth
from sloth.compiler import families
from sloth.compiler.backend import sloth_backend
from sloth.patterns.rope import negated_halves_rope_pattern
from tolerance import assert_close
from pattern_checks import seeded
from test_rope_pattern import MATCHES, make_args

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
B, S, H, D = 2, 7, 3, 10  # 5 pairs a head
ROT = 6  # ChatGLM's partial rotary: the first 6 dims, 3 pairs
MAX_LEN = 16


# ---------------------------------------------------------------------------------------------------
# The forms under test (user code). ``upcast`` is False only for the float64 reference.
# ---------------------------------------------------------------------------------------------------

def up(x, upcast):
    return x.float() if upcast else x


def broadcast_view(freqs, x):
    # llama2.c's reshape_for_broadcast: [s, d/2] -> [1, s, 1, d/2] for x [b, s, h, d/2]
    shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs.view(shape)


def llama2c(xq, xk, freqs_cos, freqs_sin, upcast=True):
    # karpathy/llama2.c model.py apply_rotary_emb, as written there.
    xq_r, xq_i = up(xq, upcast).reshape(xq.shape[:-1] + (-1, 2)).unbind(-1)
    xk_r, xk_i = up(xk, upcast).reshape(xk.shape[:-1] + (-1, 2)).unbind(-1)
    freqs_cos = broadcast_view(freqs_cos[: xq.shape[1]], xq_r)
    freqs_sin = broadcast_view(freqs_sin[: xq.shape[1]], xq_r)
    xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin
    xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
    xk_out_r = xk_r * freqs_cos - xk_i * freqs_sin
    xk_out_i = xk_r * freqs_sin + xk_i * freqs_cos
    xq_out = torch.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)
    xk_out = torch.stack([xk_out_r, xk_out_i], dim=-1).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def llama2c_in_dtype(xq, xk, freqs_cos, freqs_sin, upcast=True):
    # The copies that rotate in the activations' dtype: no upcast, the tables cast to it, flatten(-2).
    xq_r, xq_i = xq.reshape(*xq.shape[:-1], -1, 2).unbind(-1)
    xk_r, xk_i = xk.reshape(*xk.shape[:-1], -1, 2).unbind(-1)
    cos = broadcast_view(freqs_cos[: xq.shape[1]], xq_r).to(xq_r.dtype)
    sin = broadcast_view(freqs_sin[: xq.shape[1]], xq_r).to(xq_r.dtype)
    xq_out = torch.stack([xq_r * cos - xq_i * sin, xq_r * sin + xq_i * cos], dim=-1).flatten(-2)
    xk_out = torch.stack([xk_r * cos - xk_i * sin, xk_r * sin + xk_i * cos], dim=-1).flatten(-2)
    return xq_out, xk_out


def torchtune_rotate(x, cache, upcast=True):
    # pytorch/torchtune RotaryPositionalEmbeddings.forward: a [max_len, d/2, 2] (cos, sin) cache.
    seq_len = x.size(1)
    rope_cache = cache[:seq_len]
    xshaped = up(x, upcast).reshape(*x.shape[:-1], -1, 2)
    rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out = torch.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    x_out = x_out.flatten(3)
    return x_out.type_as(x)


def torchtune(q, k, cache, upcast=True):
    # One module called on q and on k: each slices its own table, so two single launches.
    return torchtune_rotate(q, cache, upcast), torchtune_rotate(k, cache, upcast)


def shared_table_respelled(q, k, cache, upcast=True):
    # One table for q and k (one launch), members as explicit indices and select, reshape back to x's shape.
    t = cache[: q.shape[1]][None, :, None]

    def rot(x):
        xs = up(x, upcast).view(*x.shape[:-1], D // 2, 2)
        x0, x1 = xs[:, :, :, :, 0], xs.select(-1, 1)
        c, s = t[..., 0], t[..., 1]
        return torch.stack((c * x0 - s * x1, s * x0 + c * x1), dim=4).reshape(x.shape).type_as(x)
    return rot(q), rot(k)


def chatglm(q, k, cache, upcast=True):
    # ChatGLM's apply_rotary_pos_emb: the first ROT dims rotated in pairs, the rest passed through; no upcast (its
    # cache comes in the activations' dtype).
    rope_cache = cache[: q.shape[1], : ROT // 2].to(q.dtype).view(1, q.shape[1], 1, ROT // 2, 2)

    def rot(x):
        x, x_pass = x[..., :ROT], x[..., ROT:]
        xshaped = x.reshape(*x.shape[:-1], ROT // 2, 2)
        x_out2 = torch.stack(
            [
                xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
            ],
            -1,
        )
        return torch.cat((x_out2.flatten(3), x_pass), dim=-1)
    return rot(q), rot(k)


def stacked_as_halves(q, k, freqs_cos, freqs_sin, upcast=True):
    # The rotated members stacked over dim -2: [y0..., y1...], DeepSeek's de-interleaved layout.
    c, s = freqs_cos[: q.shape[1], None], freqs_sin[: q.shape[1], None]

    def rot(x):
        x0, x1 = up(x, upcast).reshape(*x.shape[:-1], -1, 2).unbind(-1)
        return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-2).flatten(-2).type_as(x)
    return rot(q), rot(k)


def near_miss(rotate):
    """q rotated by ``rotate(x0, x1, c, s, x)`` (a stack), k left as it is."""
    def rope(q, k, freqs_cos, freqs_sin, upcast=True):
        x0, x1 = up(q, upcast).reshape(*q.shape[:-1], -1, 2).unbind(-1)
        c, s = broadcast_view(freqs_cos[: q.shape[1]], x0), broadcast_view(freqs_sin[: q.shape[1]], x0)
        return rotate(x0, x1, c, s, q), k
    return rope


def sign_flipped(x0, x1, c, s, x):
    return torch.stack([x0 * c + x1 * s, x1 * c - x0 * s], -1).flatten(3).type_as(x)


def pair_swapped(x0, x1, c, s, x):
    return torch.stack([x1 * c - x0 * s, x0 * c + x1 * s], -1).flatten(3).type_as(x)


def tables_swapped(x0, x1, c, s, x):
    return torch.stack([x0 * c - x1 * s, x1 * s + x0 * c], -1).flatten(3).type_as(x)


def cast_before_stack(x0, x1, c, s, x):
    # genmo's apply_rotary_emb_qk_real (ComfyUI): each rotated member cast to x's dtype, then stacked.
    return torch.stack([(x0 * c - x1 * s).type_as(x), (x0 * s + x1 * c).type_as(x)], dim=-1).flatten(-2)


def stacked_over_batch(x0, x1, c, s, x):
    return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], 0).permute(1, 2, 3, 4, 0).flatten(3).type_as(x)


def flattened_over_heads(x0, x1, c, s, x):
    return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], -1).flatten(2).view(x.shape).type_as(x)


def member_returned(q, k, freqs_cos, freqs_sin, upcast=True):
    x0, x1 = up(q, upcast).reshape(*q.shape[:-1], -1, 2).unbind(-1)
    c, s = broadcast_view(freqs_cos[: q.shape[1]], x0), broadcast_view(freqs_sin[: q.shape[1]], x0)
    out = torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], -1).flatten(3).type_as(q)
    return out, k + x0.sum(-1, keepdim=True).to(k.dtype)


def flux_matrices(q, k, freqs_cos, freqs_sin, upcast=True):
    # black-forest-labs/flux math.py: rope() builds [[cos, -sin], [sin, cos]] per pair, apply_rope multiplies.
    c, s = freqs_cos[: q.shape[1]], freqs_sin[: q.shape[1]]
    freqs_cis = torch.stack([c, -s, s, c], dim=-1).view(1, q.shape[1], 1, D // 2, 2, 2)
    xq_ = up(q, upcast).reshape(*q.shape[:-1], -1, 1, 2)
    xk_ = up(k, upcast).reshape(*k.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*q.shape).type_as(q), xk_out.reshape(*k.shape).type_as(k)


# ---------------------------------------------------------------------------------------------------
# The module and the plumbing
# ---------------------------------------------------------------------------------------------------

class TinyAttention(nn.Module):
    """Projections [b, s, h*d] viewed as heads [b, s, h, d] (llama2.c's and torchtune's layout), q and k rotated
    by ``rope``, causal attention."""

    def __init__(self, rope: Callable, upcast: bool = True):
        super().__init__()
        self.rope, self.upcast = rope, upcast

    def forward(self, qp, kp, vp, *tables):
        b, s, _ = qp.shape
        q, k, v = (p.view(b, s, -1, D) for p in (qp, kp, vp))
        q, k = self.rope(q, k, *tables, upcast=self.upcast)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2).reshape(b, s, -1)


@dataclasses.dataclass
class Form:
    id: str
    rope: Callable
    ops: dict  # sloth op -> number of sites; empty: nothing replaced
    cache: bool = False  # a [max_len, d/2, 2] (cos, sin) table instead of freqs_cos, freqs_sin
    reason: Optional[str] = None  # near-misses: a phrase the rejection contains


def inputs(form: Form, dtype: torch.dtype, ref: bool) -> list[torch.Tensor]:
    g = seeded(5)
    projections = [torch.randn(B, S, H * D, generator=g).to(dtype) for _ in range(3)]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.arange(MAX_LEN, dtype=torch.float64)[:, None] * inv_freq
    tables = [torch.stack([angles.cos(), angles.sin()], -1)] if form.cache else [angles.cos(), angles.sin()]
    tables = [t.float() for t in tables]  # both projects keep fp32 tables
    if ref:
        projections, tables = [p.double() for p in projections], [t.double() for t in tables]
    return projections + tables


def forward_backward(module: Callable, args: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """[out, d qp, d kp, d vp] for a seeded cotangent rounded to ``dtype``."""
    args = [a.detach().requires_grad_(i < 3) for i, a in enumerate(args)]
    out = module(*args)
    cot = torch.randn(out.shape, generator=seeded(3)).to(dtype).to(out.dtype)
    return [out.detach(), *torch.autograd.grad(out, args[:3], cot)]


def check_form(form: Form, dtype: torch.dtype, inner: str = "eager") -> sloth.Report:
    eager = forward_backward(TinyAttention(form.rope), inputs(form, dtype, False), dtype)
    reference = forward_backward(TinyAttention(form.rope, upcast=False), inputs(form, dtype, True), dtype)
    compiled = torch.compile(TinyAttention(form.rope), backend="sloth", options={"inner": inner}, fullgraph=True)
    actual = forward_backward(compiled, inputs(form, dtype, False), dtype)
    report = sloth.last_report()
    ops: dict = {}
    for site in report.sites:
        if site.family == "rope":
            ops[site.op] = ops.get(site.op, 0) + 1
    assert ops == form.ops, str(report)
    assert report.counts.get("rope", 0) == sum(form.ops.values()), str(report)
    reasons = [r.reason for r in report.rejections if r.family == "rope"]
    if form.reason is None:
        assert not reasons, str(report)
    else:
        assert any(form.reason in r for r in reasons), f"no rejection mentioning {form.reason!r}: {reasons}"
    for name, a, e, r in zip(("out", "d_qp", "d_kp", "d_vp"), actual, eager, reference):
        assert_close(f"{form.id}-{str(dtype)[6:]}: {name}", a, e, r)
    return report


PAIR = {"sloth.rope": 1}
TWO_SINGLES = {"sloth.rope_single": 2}

FORMS = [
    Form("llama2c", llama2c, PAIR),
    Form("llama2c-in-dtype", llama2c_in_dtype, PAIR),
    Form("torchtune", torchtune, TWO_SINGLES, cache=True),
    Form("shared-table-respelled", shared_table_respelled, PAIR, cache=True),
    Form("chatglm-partial", chatglm, PAIR, cache=True),
    Form("stacked-as-halves", stacked_as_halves, PAIR),
]

NEAR_MISSES = [
    Form("sign-flipped", near_miss(sign_flipped), {}, reason="wrong sign"),
    Form("pair-swapped", near_miss(pair_swapped), {}, reason="other order"),
    Form("tables-swapped", near_miss(tables_swapped), {}, reason="wrong sign or tables"),
    Form("stacked-over-batch", near_miss(stacked_over_batch), {}, reason="stacked over dim 0"),
    Form("flattened-over-heads", near_miss(flattened_over_heads), {}, reason="not reshaped back"),
    Form("member-returned", member_returned, {}, reason="other users"),
    Form("flux-rotation-matrices", flux_matrices, {}, reason="2x2 matrix per pair"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS, ids=[f.id for f in FORMS])
def test_stacked_form_fuses(form, dtype):
    check_form(form, dtype)


def test_stacked_form_fuses_aot_eager():
    check_form(FORMS[0], torch.bfloat16, inner="aot_eager")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", NEAR_MISSES, ids=[f.id for f in NEAR_MISSES])
def test_near_miss_is_refused_with_reason(form, dtype):
    check_form(form, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_members_cast_before_the_stack(dtype):
    # In fp32 the casts change nothing and canonicalisation drops them: the plain form, fused. In bf16 each
    # member is rounded before the stack: refused, with the reason.
    fp32 = dtype == torch.float32
    form = Form("cast-before-stack", near_miss(cast_before_stack), {"sloth.rope_single": 1} if fp32 else {},
                reason=None if fp32 else "cast before the stack")
    check_form(form, dtype)


def test_cos_requiring_grad_is_refused():
    qp = torch.randn(B, S, H * D)
    cos, sin = torch.randn(MAX_LEN, D // 2, requires_grad=True), torch.randn(MAX_LEN, D // 2)
    rope = near_miss(lambda x0, x1, c, s, x: torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], -1).flatten(3))
    out = torch.compile(TinyAttention(rope), backend="sloth", options={"inner": "eager"})(qp, qp, qp, cos, sin)
    report = sloth.last_report()
    assert report.counts.get("rope", 0) == 0 and any("requires grad" in r.reason for r in report.rejections)
    out.sum().backward()
    assert cos.grad is not None and cos.grad.abs().sum() > 0


def test_one_table_member_node_for_q_and_k():
    # torchtune writes rope_cache[..., 0] twice a tensor: the op gets one inserted table[..., k] per table and member.
    graphs = []

    def capture(gm, example_inputs):
        out = sloth_backend(gm, example_inputs, options={"inner": "eager"})
        graphs.append(gm)
        return out

    form = next(f for f in FORMS if f.id == "shared-table-respelled")
    torch.compile(TinyAttention(form.rope), backend=capture, fullgraph=True)(*inputs(form, torch.float32, False))
    nodes = list(graphs[0].graph.nodes)
    (fused,) = [n for n in nodes if n.target is torch.ops.sloth.rope.default]
    q, k, cos, sin, interleaved = fused.args
    assert interleaved is True
    assert cos.target is operator.getitem and cos.args[1] == (Ellipsis, 0)
    assert sin.target is operator.getitem and sin.args[1] == (Ellipsis, 1) and sin.args[0] is cos.args[0]
    assert not [n for n in nodes if n.target in (torch.stack, torch.sub, "unbind", "select")]


# ---------------------------------------------------------------------------------------------------
# Concatenated forms: cat([y1, y2], -1) of signed sums of products of x's halves (or even/odd elements)
# ---------------------------------------------------------------------------------------------------

def nanochat_tables(freqs_cos, freqs_sin, x):
    # nanochat's cos[None, :, None, :] for x [b, s, h, d], in the activations' dtype (its COMPUTE_DTYPE)
    return (freqs_cos[: x.shape[1]][None, :, None].to(x.dtype), freqs_sin[: x.shape[1]][None, :, None].to(x.dtype))


def concatenated(rotate, parts="halves", rotated=("q", "k")):
    """The ``rotated`` of q and k each rotated by ``rotate(x1, x2, cos, sin)`` (y1, y2), concatenated over the last
    dim."""
    def rope(q, k, freqs_cos, freqs_sin, upcast=True):
        cos, sin = nanochat_tables(freqs_cos, freqs_sin, q)

        def rot(x):
            d = x.shape[3] // 2
            x1, x2 = (x[..., :d], x[..., d:]) if parts == "halves" else (x[..., ::2], x[..., 1::2])
            return torch.cat(rotate(x1, x2, cos, sin), 3)
        return tuple(rot(x) if name in rotated else x for name, x in (("q", q), ("k", k)))
    return rope


def nanochat(x1, x2, cos, sin):
    # karpathy/nanochat gpt.py apply_rotary_emb, as written there: the rotation by -theta.
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    return y1, y2


def by_minus_theta_sub(x1, x2, cos, sin):
    return x1 * cos + x2 * sin, x2 * cos - x1 * sin


def by_minus_theta_negated_product(x1, x2, cos, sin):
    return sin * x2 + cos * x1, -(sin * x1) + cos * x2


def by_minus_theta_negated_half(x1, x2, cos, sin):
    return x2 * sin + x1 * cos, (-x1) * sin + x2 * cos


def by_minus_theta_times_minus_one(x1, x2, cos, sin):
    return x1 * cos + x2 * sin, x1 * (sin * -1) + x2 * cos


def by_minus_theta_negated_term(x1, x2, cos, sin):
    return x1 * cos + x2 * sin, -(x1 * sin - x2 * cos)


def by_theta_plus_pi(x1, x2, cos, sin):
    # cos and sin both negated: [[-c, s], [-s, -c]], the rotation by theta + pi.
    return -(x1 * cos) + x2 * sin, -x2 * cos - x1 * sin


def gpt_oss_double_negation(x1, x2, cos, sin):
    # GPT-OSS's rotation, its minus written as a sum with a negated sine and a double negation elsewhere.
    return x1 * cos + x2 * (-sin), -(-(x2 * cos)) + x1 * sin


def negated_table_once(q, k, freqs_cos, freqs_sin, upcast=True):
    # -sin computed once from the table and read by q's and k's rotations.
    cos, sin = nanochat_tables(freqs_cos, freqs_sin, q)
    neg_sin = -sin

    def rot(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * cos - x2 * neg_sin, x2 * cos + x1 * neg_sin], -1)
    return rot(q), rot(k)


def tables_per_product(q, k, freqs_cos, freqs_sin, upcast=True):
    # Each product slices and views its table again: equal values, not one node (and q's not k's: two launches).
    def rot(x):
        x1, x2 = x.chunk(2, -1)
        cos, sin = (lambda: nanochat_tables(freqs_cos, freqs_sin, x)[0]), (lambda: nanochat_tables(freqs_cos,
                                                                                                  freqs_sin, x)[1])
        return torch.cat([x1 * cos() + x2 * sin(), x1 * -sin() + x2 * cos()], -1)
    return rot(q), rot(k)


def pattern_oracle(q, k, freqs_cos, freqs_sin, upcast=True):
    cos, sin = nanochat_tables(freqs_cos, freqs_sin, q)
    return negated_halves_rope_pattern(q, cos, sin), negated_halves_rope_pattern(k, cos, sin)


def nanochat_partial(q, k, freqs_cos, freqs_sin, upcast=True):
    # The first ROT dims rotated as nanochat does (on the halves of x[..., :ROT]), the rest passed through.
    cos, sin = nanochat_tables(freqs_cos[:, : ROT // 2], freqs_sin[:, : ROT // 2], q)

    def rot(x):
        x_rot, x_pass = x[..., :ROT], x[..., ROT:]
        x1, x2 = x_rot.chunk(2, -1)
        return torch.cat([torch.cat(nanochat(x1, x2, cos, sin), -1), x_pass], -1)
    return rot(q), rot(k)


def q_only(rotate, parts="halves"):
    return concatenated(rotate, parts, rotated=("q",))


def not_orthogonal(x1, x2, cos, sin):
    # y2 = x1 * sin + x2 * cos: [[c, s], [s, c]], neither a rotation nor a reflection.
    return x1 * cos + x2 * sin, x1 * sin + x2 * cos


def reflection(x1, x2, cos, sin):
    # [[c, s], [s, -c]]: a reflection.
    return x1 * cos + x2 * sin, x1 * sin - x2 * cos


def halves_swapped_in_cat(x1, x2, cos, sin):
    # GPT-OSS's two results concatenated the other way round: [[s, c], [c, -s]], a reflection.
    return x2 * cos + x1 * sin, x1 * cos - x2 * sin


def two_tensors(q, k, freqs_cos, freqs_sin, upcast=True):
    # q's even elements rotated with k's odd ones: not one tensor's rotation.
    cos, sin = nanochat_tables(freqs_cos, freqs_sin, q)
    q0, k1 = q[..., ::2], k[..., 1::2]
    return torch.cat([q0 * cos + k1 * sin, q0 * (-sin) + k1 * cos], 3), k


def unequal_halves(q, k, freqs_cos, freqs_sin, upcast=True):
    # x[..., :4] and x[..., 4:8]: narrows of x that are not its halves.
    cos, sin = nanochat_tables(freqs_cos[:, :4], freqs_sin[:, :4], q)
    x1, x2 = q[..., :4], q[..., 4:8]
    return torch.cat([torch.cat(nanochat(x1, x2, cos, sin), 3), q[..., 8:]], 3), k


def half_product_returned(q, k, freqs_cos, freqs_sin, upcast=True):
    cos, sin = nanochat_tables(freqs_cos, freqs_sin, q)
    x1, x2 = q[..., : D // 2], q[..., D // 2:]
    y1 = x1 * cos + x2 * sin
    return torch.cat([y1, x1 * (-sin) + x2 * cos], 3), k + y1.sum(-1, keepdim=True)


CONCATENATED = [
    Form("nanochat", concatenated(nanochat), PAIR),
    Form("by-minus-theta-sub", concatenated(by_minus_theta_sub), PAIR),
    Form("by-minus-theta-negated-product", concatenated(by_minus_theta_negated_product), PAIR),
    Form("by-minus-theta-negated-half", concatenated(by_minus_theta_negated_half), PAIR),
    Form("by-minus-theta-times-minus-one", concatenated(by_minus_theta_times_minus_one), PAIR),
    Form("by-minus-theta-negated-term", concatenated(by_minus_theta_negated_term), PAIR),
    Form("by-theta-plus-pi", concatenated(by_theta_plus_pi), PAIR),
    Form("gpt-oss-double-negation", concatenated(gpt_oss_double_negation), PAIR),
    Form("negated-table-once", negated_table_once, PAIR),
    Form("tables-per-product", tables_per_product, TWO_SINGLES),
    Form("negated-halves-rope-pattern", pattern_oracle, PAIR),
    Form("nanochat-partial", nanochat_partial, PAIR),
    Form("nanochat-q-only", q_only(nanochat), {"sloth.rope_single": 1}),
    Form("deinterleave-by-minus-theta", concatenated(nanochat, "even/odd"), PAIR),
    Form("deinterleave-by-minus-theta-sub", concatenated(by_minus_theta_sub, "even/odd"), PAIR),
]

CONCATENATED_NEAR_MISSES = [
    Form("not-orthogonal", q_only(not_orthogonal), {}, reason="[[a, b], [b, a]] (x1, x2), not a rotation"),
    Form("reflection", q_only(reflection), {}, reason="[[a, b], [b, -a]] (x1, x2), not a rotation [[c, -s], [s, "
                                                      "c]] (the a terms need one sign, the b terms opposite signs); "
                                                      "a reflection"),
    Form("halves-swapped-in-cat", q_only(halves_swapped_in_cat), {}, reason="a reflection"),
    Form("even-odd-not-orthogonal", q_only(not_orthogonal, "even/odd"), {}, reason="even/odd elements are rotated "
                                                                                   "with the wrong sign"),
    Form("two-tensors", two_tensors, {}, reason="two tensors' parts"),
    Form("unequal-halves", unequal_halves, {}, reason="another split"),
    Form("half-product-returned", half_product_returned, {}, reason="other users"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", CONCATENATED, ids=[f.id for f in CONCATENATED])
def test_concatenated_form_fuses(form, dtype):
    check_form(form, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", CONCATENATED_NEAR_MISSES, ids=[f.id for f in CONCATENATED_NEAR_MISSES])
def test_concatenated_near_miss_is_refused_with_reason(form, dtype):
    check_form(form, dtype)


@pytest.mark.parametrize("form_id, negated", [("nanochat", {"sin"}), ("by-theta-plus-pi", {"cos", "sin"}),
                                              ("deinterleave-by-minus-theta", {"sin"})])
def test_negated_tables_are_one_node_for_q_and_k(form_id, negated):
    # The op reads the tables the signs call for, each negated by one node shared by q and k (halves: doubled too);
    # the user's own negations and the rotation's nodes are gone.
    graphs = []

    def capture(gm, example_inputs):
        out = sloth_backend(gm, example_inputs, options={"inner": "eager"})
        graphs.append(gm)
        return out

    form = next(f for f in CONCATENATED if f.id == form_id)
    torch.compile(TinyAttention(form.rope), backend=capture, fullgraph=True)(*inputs(form, torch.float32, False))
    nodes = list(graphs[0].graph.nodes)
    (fused,) = [n for n in nodes if n.target is torch.ops.sloth.rope.default]
    halves = form_id != "deinterleave-by-minus-theta"
    tables = dict(zip(("cos", "sin"), fused.args[2:4]))
    for name, table in tables.items():
        if halves:
            assert table.target is torch.cat and table.args[0][0] is table.args[0][1]
            table = table.args[0][0]
        assert (table.target is torch.neg) == (name in negated), (name, table)
    assert [n.target for n in nodes].count(torch.neg) == len(negated)
    assert not [n for n in nodes if n.target in (torch.sub, torch.add, torch.mul)
                or (n.target is torch.narrow and n.args[1] == -1) or (n.target is operator.getitem and isinstance(n.args[1], tuple)
                    and any(isinstance(i, slice) and i.step == 2 for i in n.args[1]))]
    assert fused.args[4:6] == (True, True) if not halves else not any(fused.args[4:6])


# ---------------------------------------------------------------------------------------------------
# Every form the pass fuses is an anchor
# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def anchors_erased():
    """Wraps the rope pass: counts the rope anchors (compiler/anchors.py) each run erases, over every graph."""
    erased: list = []
    (i, rope), = [(i, p) for i, p in enumerate(families.family_passes()) if p.name == "rope"]

    def run(gm, example_inputs, **kwargs):
        before = [n for n in gm.graph.nodes if rope.anchor(n)]
        out = rope.run(gm, example_inputs, **kwargs)
        alive = set(gm.graph.nodes)
        erased.extend(n for n in before if n not in alive)
        return out

    families._registry[i] = dataclasses.replace(rope, run=run)
    try:
        yield erased
    finally:
        families._registry[i] = rope


def rotated_tensors(report: sloth.Report) -> int:
    return sum(2 if site.op in ("sloth.rope", "sloth.norm_rope") else 1 for site in report.sites
               if site.family == "rope")


FUSED = [pytest.param(("rope_pattern", c), id=c.id) for c in MATCHES] + \
        [pytest.param(("forms", f), id=f.id) for f in FORMS + CONCATENATED]


@pytest.mark.parametrize("case", FUSED)
def test_every_fused_form_is_an_anchor(case, anchors_erased):
    """Each tensor the pass rotates erases exactly one anchor: a fused form that no anchor sees (a silent miss
    the day the pass stops fusing it) fails here."""
    source, c = case
    if source == "rope_pattern":
        torch.compile(c.fn, backend="sloth", options={"inner": "eager"})(*make_args(c, torch.float32, False))
    else:
        torch.compile(TinyAttention(c.rope), backend="sloth", options={"inner": "eager"})(
            *inputs(c, torch.float32, False))
    report = sloth.last_report()
    assert rotated_tensors(report) > 0, str(report)
    assert len(anchors_erased) == rotated_tensors(report), (anchors_erased, str(report))
    assert not report.anchors_left.get("rope"), str(report)
