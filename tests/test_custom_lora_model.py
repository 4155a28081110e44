"""A decoder written by hand, in styles no transformers class uses, with hand-written LoRA adapters.

Matching the math and not the names: every projection carries an adapter written another way (peft's
``base + B(A(x)) * s``; ``F.linear(x, W) + s * (x @ A.T) @ B.T``; the scale on x; ``alpha / r`` as a division;
``x @ W.t()`` for the base; the adapter first in the sum), the norm is ``x / sqrt(mean(x^2) + eps) * w``, the
MLP's gate is ``x * sigmoid(x)``, and the loss is ``nll_loss(log_softmax(...))``. Every adapted linear must
become a sloth op (q, k, v and gate, up joined), and the loss and every adapter gradient must satisfy the
whole-model tolerance rule against the float64 model, in fp32 and bf16 (adapters in fp32 under bf16, as
peft keeps them).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sloth
from pattern_checks import seeded
from test_models import assert_model_close

HIDDEN, HEADS, HEAD_DIM, INTER, VOCAB, RANK, LAYERS = 48, 4, 12, 80, 67, 4, 2


def _frozen(*shape: int, gen: torch.Generator) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=gen) / math.sqrt(shape[-1]), requires_grad=False)


class Adapter(nn.Module):
    """A rank-RANK adapter (A [r, in], B [out, r]), B non-zero so every gradient is."""

    def __init__(self, n_in: int, n_out: int, gen: torch.Generator):
        super().__init__()
        self.A = nn.Parameter(torch.randn(RANK, n_in, generator=gen) / math.sqrt(n_in))
        self.B = nn.Parameter(torch.randn(n_out, RANK, generator=gen) * 0.1)


class Block(nn.Module):
    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.norm1 = nn.Parameter(1 + 0.3 * torch.randn(HIDDEN, generator=gen), requires_grad=False)
        self.norm2 = nn.Parameter(1 + 0.3 * torch.randn(HIDDEN, generator=gen), requires_grad=False)
        self.wq, self.wk, self.wv = (_frozen(HEADS * HEAD_DIM, HIDDEN, gen=gen) for _ in range(3))
        self.wo = _frozen(HIDDEN, HEADS * HEAD_DIM, gen=gen)
        self.w_gate, self.w_up = _frozen(INTER, HIDDEN, gen=gen), _frozen(INTER, HIDDEN, gen=gen)
        self.w_down = _frozen(HIDDEN, INTER, gen=gen)
        self.aq, self.ak, self.av = (Adapter(HIDDEN, HEADS * HEAD_DIM, gen) for _ in range(3))
        self.ao = Adapter(HEADS * HEAD_DIM, HIDDEN, gen)
        self.a_gate, self.a_up = Adapter(HIDDEN, INTER, gen), Adapter(HIDDEN, INTER, gen)
        self.a_down = Adapter(INTER, HIDDEN, gen)

    @staticmethod
    def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self._norm(x, self.norm1)
        ha = h.to(self.aq.A.dtype)  # peft's cast of x to the adapter's dtype, once for the three
        # q: peft's form; k: the scale in front, x @ A.T @ B.T; v: the adapter first, alpha / r divided
        q = F.linear(h, self.wq) + F.linear(F.linear(ha, self.aq.A), self.aq.B) * 2.0
        k = 2.0 * (ha @ self.ak.A.T) @ self.ak.B.T + h @ self.wk.t()
        v = (F.linear(F.linear(ha, self.av.A), self.av.B) * 8.0 / RANK).to(h.dtype) + F.linear(h, self.wv)
        q, k, v = (t.to(x.dtype).view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        # o: the scale on x
        o = F.linear(att, self.wo) + F.linear(F.linear((2.0 * att).to(self.ao.A.dtype), self.ao.A), self.ao.B)
        x = x + o.to(x.dtype)
        h = self._norm(x, self.norm2)
        ha = h.to(self.a_gate.A.dtype)
        gate = (F.linear(h, self.w_gate) + F.linear(F.linear(ha, self.a_gate.A), self.a_gate.B) * 2.0).to(x.dtype)
        up = (F.linear(h, self.w_up) + F.linear(F.linear(ha, self.a_up.A), self.a_up.B) * 2.0).to(x.dtype)
        act = gate * torch.sigmoid(gate) * up
        down = F.linear(act, self.w_down) + 2.0 * F.linear(F.linear(act.to(self.a_down.A.dtype), self.a_down.A),
                                                           self.a_down.B)
        return x + down.to(x.dtype)


class HandWrittenDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        gen = seeded(11)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen), requires_grad=False)
        self.blocks = nn.ModuleList(Block(gen) for _ in range(LAYERS))
        self.head = _frozen(VOCAB, HIDDEN, gen=gen)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed[ids]
        for block in self.blocks:
            x = block(x)
        logits = (x @ self.head.t()).float()
        return F.nll_loss(F.log_softmax(logits[:, :-1].reshape(-1, VOCAB), -1), ids[:, 1:].reshape(-1))


def _loss_and_grads(model: nn.Module, ids: torch.Tensor, run=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = (model if run is None else run)(ids)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _model(dtype: torch.dtype) -> nn.Module:
    model = HandWrittenDecoder()
    for p in model.parameters():  # adapters stay fp32 under a 16-bit model, as peft keeps them
        if not p.requires_grad:
            p.data = p.data.to(dtype)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hand_written_decoder_every_adapter_fused_and_within_the_rule(dtype):
    model = _model(dtype)
    ids = torch.randint(0, VOCAB, (2, 13), generator=seeded(12))
    reference = _loss_and_grads(copy.deepcopy(model).double(), ids)
    eager = _loss_and_grads(model, ids)
    actual = _loss_and_grads(model, ids, run=torch.compile(model, backend="sloth"))
    report = sloth.report()
    ops = sorted(site.op for site in report.sites if site.family == "lora")
    # Per layer: q, k, v joined; gate, up joined; o alone; down takes the GLU in.
    assert ops == sorted(["sloth.lora_linear_shared"] * 5 * LAYERS + ["sloth.lora_linear", "sloth.glu_lora_linear"]
                         * LAYERS), str(report)
    assert not [r for r in report.rejections if r.family == "lora"], str(report)
    assert actual[1].keys() == eager[1].keys() and len(actual[1]) == 7 * 2 * LAYERS
    assert_model_close(actual, eager, reference, dtype)


def test_dynamo_guard_filter_passes_through_sloths_options():
    """``guard_filter_fn`` beside sloth's options (README: skipping the module guards a step evaluates) goes
    to Dynamo, not to sloth or Inductor: the adapters are fused and the loss and gradients are unchanged."""
    model = _model(torch.float32)
    ids = torch.randint(0, VOCAB, (2, 13), generator=seeded(12))
    eager = _loss_and_grads(model, ids)
    torch._dynamo.reset()
    run = torch.compile(model, backend="sloth",
                        options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    actual = _loss_and_grads(model, ids, run=run)
    assert sloth.report().counts.get("lora", 0) == 7 * LAYERS, str(sloth.report())
    again = _loss_and_grads(model, ids, run=run)  # the second call runs the compiled graph under the filter
    for got in (actual, again):
        torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-5)
        assert got[1].keys() == eager[1].keys()
        for name in eager[1]:
            torch.testing.assert_close(got[1][name], eager[1][name], rtol=1e-4, atol=1e-5)
