"""The join of q/k RMSNorms with the RoPE after them (patterns/norm_rope.py): where it happens, where it must not,
what the report says, and that the backward recomputes the rotated pair instead of keeping it.

Whole-model numerics of the joined op run in tests/test_models.py (Qwen3 and Gemma 3 through every family) and the
op's own in tests/test_norm_rope_op.py; here each graph is also compared with eager under the tolerance rule.
"""
from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sloth
import sloth.patterns.norm_rope as pattern_module
from sloth.compiler.backend import sloth_backend
from test_models import VOCAB, assert_model_close, build, loss_and_grads
from test_recompute import _partitioned
from tolerance import assert_close


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("sloth.")]


def _capture(options: dict, graphs: list):
    """A backend: sloth's passes (eager inner), each rewritten Dynamo graph kept in ``graphs``."""
    def backend(gm, example_inputs):
        compiled = sloth_backend(gm, example_inputs, options={"inner": "eager", **options})
        graphs.append(gm)
        return compiled

    return backend


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_transformers_attention_with_qk_norms_is_one_op(model_type, dtype):
    if model_type == "qwen3_moe":  # its experts as an eager loop, which the float64 reference can run
        from test_moe_pattern import moe_model

        model = moe_model(model_type, "eager", dtype)
        with torch.no_grad():  # random norm weights, as build() makes them
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.5)
    else:
        model = build(model_type, dtype)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    reference = loss_and_grads(copy.deepcopy(model).double(), ids)
    eager = loss_and_grads(model, ids)
    graphs: list = []
    torch._dynamo.reset()
    sloth.reset_report()
    ours = loss_and_grads(model, ids, run=torch.compile(model, backend=_capture({}, graphs)))
    ops = [op for g in graphs for op in _ops(g)]
    assert ops.count("sloth.norm_rope.default") == layers and "sloth.rope.default" not in ops, ops
    report = sloth.report()
    joined = [s for s in report.sites if s.op == "sloth.norm_rope"]
    # per layer: the rope site and its two norms (q_norm, k_norm), each saying it was joined
    assert sorted(s.family for s in joined) == ["rms_norm"] * 2 * layers + ["rope"] * layers, str(report)
    assert all(s.module.endswith(("q_norm", "k_norm")) for s in joined if s.family == "rms_norm"), str(report)
    assert all("joined" in s.detail for s in joined), str(report)
    assert_model_close(ours, eager, reference, dtype)


class HandWrittenAttention(nn.Module):
    """Per-head q/k norms through ``F.rms_norm``, heads kept after the sequence ([b, s, h, d], permuted for the
    attention only after the RoPE), and GPT-J's interleaved RoPE written with complex numbers; sloth has no
    class for any of it."""

    def __init__(self, hidden: int = 48, heads: int = 3, head_dim: int = 16):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.Linear(hidden, 3 * heads * head_dim, bias=False)
        self.out = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_scale = nn.Parameter(1 + 0.3 * torch.randn(head_dim))
        self.k_scale = nn.Parameter(1 + 0.3 * torch.randn(head_dim))
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        q = F.rms_norm(q, (self.head_dim,), self.q_scale, eps=1e-5)
        k = F.rms_norm(k, (self.head_dim,), self.k_scale, eps=1e-5)
        angles = torch.arange(s, device=x.device).float()[:, None] * self.inv_freq  # [s, d/2]
        freqs = torch.polar(torch.ones_like(angles), angles)[:, None, :]  # over heads
        q = torch.view_as_real(torch.view_as_complex(q.float().reshape(b, s, self.heads, -1, 2)) * freqs)
        k = torch.view_as_real(torch.view_as_complex(k.float().reshape(b, s, self.heads, -1, 2)) * freqs)
        q, k = q.flatten(3).to(x.dtype).permute(0, 2, 1, 3), k.flatten(3).to(x.dtype).permute(0, 2, 1, 3)
        o = F.scaled_dot_product_attention(q, k, v.permute(0, 2, 1, 3), is_causal=True)
        return self.out(o.permute(0, 2, 1, 3).reshape(b, s, -1))


def test_hand_written_attention_joins_and_matches_eager():
    torch.manual_seed(0)
    model = HandWrittenAttention()
    x = torch.randn(2, 7, 48, requires_grad=True)
    graphs: list = []
    torch._dynamo.reset()
    sloth.reset_report()
    out = torch.compile(model, backend=_capture({}, graphs))(x)
    ops = [op for g in graphs for op in _ops(g)]
    assert "sloth.norm_rope.default" in ops and "sloth.rms_norm.default" not in ops, (ops, str(sloth.report()))
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    params = [x, model.q_scale, model.k_scale, model.qkv.weight]
    ours = torch.autograd.grad(out, params, dy)
    eager_out = model(x)
    eager = torch.autograd.grad(eager_out, params, dy)
    ref_model = copy.deepcopy(model).double()
    x64 = x.detach().double().requires_grad_(True)
    ref_out = ref_model(x64)
    reference = torch.autograd.grad(ref_out, [x64, ref_model.q_scale, ref_model.k_scale, ref_model.qkv.weight],
                                    dy.double())
    assert_close("out", out.detach(), eager_out.detach(), ref_out.detach())
    for name, a, e, r in zip(("dx", "d q_scale", "d k_scale", "d qkv"), ours, eager, reference):
        assert_close(name, a, e, r)


class NormedQueryReadTwice(nn.Module):
    """Qwen3's attention, except that the normalised q is also returned: the norm must stay for that reader."""

    def __init__(self, hidden: int = 32, heads: int = 2, head_dim: int = 16, k_norm: bool = True):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.q_w = nn.Parameter(1 + 0.3 * torch.randn(head_dim))
        self.k_w = nn.Parameter(1 + 0.3 * torch.randn(head_dim)) if k_norm else None
        self.return_normed_q = True

    @staticmethod
    def norm(x, w):
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.norm(self.q_proj(x).view(b, s, -1, self.head_dim), self.q_w).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        k = (self.norm(k, self.k_w) if self.k_w is not None else k).transpose(1, 2)
        rot = lambda t: torch.cat((-t[..., t.shape[-1] // 2:], t[..., :t.shape[-1] // 2]), -1)  # noqa: E731
        q_r, k_r = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        out = F.scaled_dot_product_attention(q_r, k_r, k_r, is_causal=True)
        return (out, q) if self.return_normed_q else out


def _rope_tables(s: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.arange(s).float()[:, None] * inv
    emb = torch.cat((emb, emb), -1)
    return emb.cos()[None, None], emb.sin()[None, None]


@pytest.mark.parametrize("case", ["normed-q-read-elsewhere", "k-without-norm", "switched-off"])
def test_not_joined_where_a_norm_must_stay(case, monkeypatch):
    torch.manual_seed(0)
    model = NormedQueryReadTwice(k_norm=case != "k-without-norm")
    model.return_normed_q = case == "normed-q-read-elsewhere"
    if case == "switched-off":
        monkeypatch.setattr(pattern_module, "JOIN", False)  # benchmarks/variants.py's norm_rope_apart
    x = torch.randn(2, 5, 32)
    cos, sin = _rope_tables(5, 16)
    graphs: list = []
    torch._dynamo.reset()
    sloth.reset_report()
    ours = torch.compile(model, backend=_capture({}, graphs))(x, cos, sin)
    ops = [op for g in graphs for op in _ops(g)]
    assert "sloth.norm_rope.default" not in ops and "sloth.rope.default" in ops, ops
    assert ops.count("sloth.rms_norm.default") == (1 if case == "k-without-norm" else 2), ops
    assert not any(s.op == "sloth.norm_rope" for s in sloth.report().sites)
    eager = model(x, cos, sin)
    for a, e in zip(ours if isinstance(ours, tuple) else (ours,), eager if isinstance(eager, tuple) else (eager,)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_backward_recomputes_the_rotated_pair_instead_of_keeping_it(monkeypatch):
    # benchmarks/variants.py's norm_rope_recompute (off by default: compiler/recompute.py says why)
    import sloth.compiler.recompute as recompute

    monkeypatch.setattr(recompute, "RECOMPUTED_OPS", (*recompute.RECOMPUTED_OPS, "norm_rope"))
    torch.manual_seed(0)
    model = NormedQueryReadTwice()
    model.return_normed_q = False
    x = torch.randn(2, 5, 32)
    cos, sin = _rope_tables(5, 16)
    grads, graphs = {}, {}
    for recompute in (False, True):
        graphs[recompute] = {}
        torch._dynamo.reset()
        sloth.reset_report()
        out = torch.compile(model, backend=_partitioned({"recompute": recompute}, graphs[recompute]))(x, cos, sin)
        grads[recompute] = torch.autograd.grad(out.sum(), list(model.parameters()))
        assert sloth.report().recomputed == ({"norm_rope": 1} if recompute else {}), str(sloth.report())
    forward_kept = {r: [n for n in graphs[r]["forward"].graph.nodes if n.op == "output"][0].args[0] for r in graphs}

    def kept_rotations(outputs):  # the forward's outputs that are the op's results (getitems of it)
        return sum(1 for o in outputs if isinstance(o, torch.fx.Node) and o.target is operator.getitem
                   and o.args[0].target is torch.ops.sloth.norm_rope.default)

    assert kept_rotations(forward_kept[False]) == 2 and kept_rotations(forward_kept[True]) == 0
    assert _ops(graphs[False]["backward"]).count("sloth.norm_rope.default") == 0
    assert _ops(graphs[True]["backward"]).count("sloth.norm_rope.default") == 1
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_by_default_the_rotated_pair_is_kept():
    torch.manual_seed(0)
    model = NormedQueryReadTwice()
    model.return_normed_q = False
    x = torch.randn(2, 5, 32)
    cos, sin = _rope_tables(5, 16)
    graphs: dict = {}
    torch._dynamo.reset()
    sloth.reset_report()
    torch.compile(model, backend=_partitioned({}, graphs))(x, cos, sin).sum().backward()
    assert "norm_rope" not in sloth.report().recomputed, str(sloth.report())
    assert _ops(graphs["backward"]).count("sloth.norm_rope.default") == 0
