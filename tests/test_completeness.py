"""No site is skipped without a reason: every anchor a family looks for is replaced or reported.

compiler/anchors.py finds each family's anchors independently of its matcher; after the passes, the anchors
left in the graph must equal the reasons given ("left as they were"). tests/conftest.py checks the
``unexplained`` half of this after every test of the suite (every model any test compiles); this file checks
that the check can fail (a family whose pass does nothing leaves every one of its sites unexplained), that
the counts are exact on tiny transformers models with peft LoRA and QLoRA, and that the LoRA count agrees with
the model's own adapted linears (an oracle outside the graph).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sloth
from sloth.compiler import families
from pattern_checks import seeded


class EveryFamily(nn.Module):
    """One site of each family, written by hand: RMSNorm, rotate-half RoPE on q and k, a causal mask given to
    SDPA, a LoRA linear, an nn.LayerNorm-style norm before SwiGLU, an L2-norm of the final hidden state, the
    lm_head + cross-entropy and the same head's log-softmax read at the labels, a second attention under a packed-document mask built from position ids
    (documents start where the position is 0), a third attention with a sink logit per head under the same causal
    mask (``masked_fill``), a fourth with one key / value head repeated to both query heads, and an MoE block
    (top-2 of 3 experts, one gathered expert weight per assignment through ``bmm``, ``index_add_`` back to the
    tokens)."""

    def __init__(self, d: int = 32, heads: int = 2, vocab: int = 40, rank: int = 4):
        super().__init__()
        g = seeded(11)
        self.heads = heads
        self.norm_w = nn.Parameter(torch.randn(d, generator=g) * 0.1 + 1)
        self.qkv = nn.Parameter(torch.randn(3 * d, d, generator=g) / d**0.5)
        self.o_base = nn.Parameter(torch.randn(d, d, generator=g) / d**0.5, requires_grad=False)
        self.o_a = nn.Parameter(torch.randn(rank, d, generator=g) / d**0.5)
        self.o_b = nn.Parameter(torch.randn(d, rank, generator=g) / rank**0.5)
        self.gate_up = nn.Parameter(torch.randn(4 * d, d, generator=g) / d**0.5)
        self.down = nn.Parameter(torch.randn(d, 2 * d, generator=g) / (2 * d)**0.5)
        self.head = nn.Parameter(torch.randn(vocab, d, generator=g) / d**0.5)
        self.ln_w = nn.Parameter(torch.randn(d, generator=g) * 0.1 + 1)
        self.ln_b = nn.Parameter(torch.randn(d, generator=g) * 0.1)
        self.router = nn.Parameter(torch.randn(3, d, generator=g) / d**0.5)
        self.experts_in = nn.Parameter(torch.randn(3, 2 * 8, d, generator=g) / d**0.5)
        self.experts_out = nn.Parameter(torch.randn(3, d, 8, generator=g) / 8**0.5)
        self.sinks = nn.Parameter(torch.randn(heads, generator=g))

    def forward(self, x, cos, sin, labels, pos):
        b, t, d = x.shape
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_w
        q, k, v = F.linear(h, self.qkv).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)

        def rotate_half(z):
            half = z.shape[-1] // 2
            return torch.cat([-z[..., half:], z[..., :half]], dim=-1)

        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d)
        doc = (pos == 0).cumsum(-1)
        packed = (doc[:, None, :, None] == doc[:, None, None, :]) & mask
        a = a + F.scaled_dot_product_attention(q, k, v, attn_mask=packed).transpose(1, 2).reshape(b, t, d)
        s = (q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5).masked_fill(~mask, float("-inf"))
        s = torch.cat([s, self.sinks.view(1, -1, 1, 1).expand(b, -1, t, 1)], dim=-1)
        a = a + (s.softmax(-1)[..., :t] @ v).transpose(1, 2).reshape(b, t, d)
        kg, vg = (z[:, :1].repeat_interleave(self.heads, dim=1) for z in (k, v))  # one key head for all
        a = a + F.scaled_dot_product_attention(q, kg, vg, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + (F.linear(a, self.o_base) + F.linear(F.linear(a, self.o_a), self.o_b) * 2.0)
        gate, up = F.linear(F.layer_norm(x, (d,), self.ln_w, self.ln_b, 1e-5), self.gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, self.down)
        flat = x.reshape(b * t, d)
        weights, chosen = torch.topk(F.linear(flat, self.router).softmax(-1), 2, dim=-1)
        token, expert = torch.arange(b * t).repeat_interleave(2), chosen.flatten()
        g_e, u_e = torch.bmm(self.experts_in[expert], flat[token].unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.experts_out[expert], (F.silu(g_e) * u_e).unsqueeze(-1)).squeeze(-1)
        x = x + torch.zeros_like(flat).index_add_(0, token, y * weights.flatten()[:, None]).view(b, t, d)
        x = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
        # a DPO-style term: the head's log-softmax read at the labels
        logp = torch.gather(F.log_softmax(F.linear(x, self.head), dim=-1), -1, labels.unsqueeze(-1)).squeeze(-1)
        return F.cross_entropy(F.linear(x, self.head).float().view(-1, self.head.shape[0]), labels.view(-1)) \
            - 0.1 * logp.mean()


def every_family_inputs():
    g = seeded(12)
    x = torch.randn(2, 5, 32, generator=g)
    angles = torch.arange(5.0)[:, None] * torch.linspace(0.1, 1.0, 8)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return x, cos, sin, torch.randint(0, 40, (2, 5), generator=g), torch.tensor([[0, 1, 2, 0, 1], [0, 0, 1, 2, 3]])


def test_every_family_replaces_its_hand_written_site():
    model = EveryFamily()
    inputs = every_family_inputs()
    got = torch.compile(model, backend="sloth", options={"inner": "eager"})(*inputs)
    report = sloth.report()
    assert report.counts == {family: 1 for family in sloth.FAMILIES}, str(report)
    assert not report.anchors_left and not report.unexplained, str(report)
    torch.testing.assert_close(got, model(*inputs))


@pytest.mark.unexplained_sites
@pytest.mark.parametrize("family", sloth.FAMILIES)
def test_a_family_that_says_nothing_is_caught(monkeypatch, family):
    # The family's pass replaced by one that neither replaces nor reports: its site must show as unexplained,
    # the other families' as replaced.
    passes = [dataclasses.replace(p, run=lambda gm, *_, **__: gm) if p.name == family else p
              for p in families.family_passes()]
    monkeypatch.setattr(families, "_registry", passes)
    torch.compile(EveryFamily(), backend="sloth", options={"inner": "eager"})(*every_family_inputs())
    report = sloth.report()
    assert list(report.unexplained) == [family], str(report)
    assert report.anchors_left[family] >= 1
    unmatched = [r for r in report.rejections if "please report" in r.reason]
    assert unmatched and all(r.family == family for r in unmatched), str(report)
    # The only reasoned rejection: the causal-mask family's for the packed mask it cannot take either.
    assert all(r.family == "causal_mask" and "'L_pos_'" in r.reason for r in report.rejections if r not in unmatched)
    expected = {f: 1 for f in sloth.FAMILIES if f != family}
    if family == "moe_route":
        expected["glu"] = 2  # the experts' GLU, which the glu family takes when the experts stay
    assert report.counts == expected, str(report)


def test_a_disabled_family_is_not_unexplained():
    torch.compile(EveryFamily(), backend="sloth", options={"inner": "eager", "patterns": ["rms_norm"]})(
        *every_family_inputs())
    report = sloth.report()
    assert report.counts == {"rms_norm": 1} and not report.unexplained, str(report)


def test_a_loss_not_on_a_linear_is_reported():
    def loss_on_a_product(a, b, y):  # a similarity-matrix loss: a cross-entropy this family has no kernel for
        return F.cross_entropy(a @ b.t(), y)

    g = seeded(13)
    a, b, y = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), torch.arange(6)
    torch.compile(loss_on_a_product, backend="sloth", options={"inner": "eager"})(a, b, y)
    report = sloth.report()
    # ``a @ b.t()`` is a linear of a by the "weight" b: fused, as it should be (same math); a loss on a softmax
    # of it is not, and says so.
    assert report.counts == {"cross_entropy": 1}, str(report)
    sloth.reset_report()
    torch.compile(lambda a, y: F.cross_entropy(a.exp(), y), backend="sloth", options={"inner": "eager"})(a, y)
    report = sloth.report()
    (rejection,) = report.rejections
    assert rejection.family == "cross_entropy" and "does not read the logits of a linear" in rejection.reason


# ---------------------------------------------------------------------------------------------------
# Exact counts on transformers models with peft LoRA and QLoRA
# ---------------------------------------------------------------------------------------------------

def peft_model(model_type: str, four_bit: bool) -> nn.Module:
    if four_bit:
        from test_qlora import qlora_model

        return qlora_model(torch.bfloat16, model_type=model_type, targets="all-linear")
    from peft import LoraConfig, get_peft_model
    from test_models import build

    return get_peft_model(build(model_type, torch.float32), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


@pytest.mark.parametrize("model_type,four_bit", [("llama", False), ("qwen3", False), ("gemma3_text", False),
                                                 ("llama", True), ("qwen3", True)],
                         ids=["llama-lora", "qwen3-lora", "gemma3-lora", "llama-qlora", "qwen3-qlora"])
def test_replaced_and_reported_equal_the_anchors(model_type, four_bit):
    from peft.tuners.lora import LoraLayer

    if four_bit:
        pytest.importorskip("bitsandbytes")
    model = peft_model(model_type, four_bit)
    adapted = sum(1 for m in model.modules() if isinstance(m, LoraLayer))
    ids = torch.randint(3, 96, (2, 9), generator=seeded(8))
    torch.compile(model, backend="sloth", options={"inner": "eager"})(input_ids=ids, labels=ids).loss.backward()
    report = sloth.report()
    reasons = {f: sum(1 for r in report.rejections if r.family == f) for f in sloth.FAMILIES}
    assert not report.unexplained, str(report)
    for family in sloth.FAMILIES:
        assert report.anchors_left.get(family, 0) == reasons[family], (family, str(report))
    # The oracle outside the graph: peft's own adapted linears, each one site replaced or reported.
    assert report.counts.get("lora", 0) + reasons["lora"] == adapted, str(report)
    assert report.counts.get("lora", 0) == adapted, str(report)


def test_rope_alone_in_a_fresh_process():
    # The rope family without rms_norm in a process where no sloth.rms_norm was ever defined (in the suite's own
    # processes an earlier test has defined it): the q/k-norm join must find no norm, not fail on the missing op.
    tests = os.path.dirname(os.path.abspath(__file__))
    code = ("import os; os.environ.setdefault('TRITON_INTERPRET', '1'); import torch, sloth; "
            "from test_completeness import EveryFamily, every_family_inputs; "
            "torch.compile(EveryFamily(), backend='sloth', options={'inner': 'eager', 'patterns': ['rope']})"
            "(*every_family_inputs()); print(sloth.report().counts)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=tests,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "{'rope': 1}", result.stdout
