"""The sink-attention family (``sink_attention``): attention with one sink logit per head, written out as matmuls
and a softmax, becomes ``sloth.sink_attention`` when its mask is a proven causal window; loss and every
gradient (the sinks' included) within the tolerance rule of eager's; every other form stays, with the reason."""
from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sloth
from tests.pattern_checks import seeded
from tests.test_models import VOCAB, assert_model_close, loss_and_grads
from tests.test_moe_pattern import _compare, moe_model
from checkpointing import enable_checkpointing

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _gpt_oss(dtype: torch.dtype) -> nn.Module:
    """Tiny GPT-OSS (a sliding layer, then a full one) with a window of 4 of its 11 tokens, sinks drawn large
    enough to take a real share of each row (they start at 0... or small)."""
    model = moe_model("gpt_oss", "grouped_mm", dtype)
    model.config.sliding_window = 4
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(2 * torch.randn(p.shape, generator=seeded(3)).to(p.dtype))
    return model


def _sites(report) -> list[str]:
    return [s.detail for s in report.sites if s.family == "sink_attention"]


@DTYPES
def test_gpt_oss_attention_is_fused(dtype) -> None:
    model = _gpt_oss(dtype)
    ours, eager, reference, report = _compare(model, dtype)
    details = _sites(report)
    assert len(details) == model.config.num_hidden_layers, str(report)
    assert any("sliding window of 4" in d for d in details) and any("causal" in d for d in details), details
    heads = f"{model.config.num_attention_heads} heads over {model.config.num_key_value_heads}"
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert all(heads in d for d in details), details  # the op reads k and v before transformers' repeat_kv
    assert not [r for r in report.rejections if r.family == "sink_attention"], str(report)
    assert all(f"model.layers.{i}.self_attn.sinks" in ours[1] for i in range(model.config.num_hidden_layers))
    assert_model_close(ours, eager, reference, dtype)


def test_gpt_oss_checkpointed_layers() -> None:
    # With gradient checkpointing each layer is a body that receives its mask as an input: the call sites' masks
    # are proven (a sliding and a full one), the bodies rewritten.
    model = _gpt_oss(torch.float32)
    enable_checkpointing(model, use_reentrant=False)
    model.train()
    ours, eager, reference, report = _compare(model, torch.float32)
    assert len(_sites(report)) == model.config.num_hidden_layers, str(report)
    assert_model_close(ours, eager, reference, torch.float32)


def test_gpt_oss_through_inductor() -> None:
    # sloth's default inner compiler: the op and its window bounds (an op of their own) pass through Inductor.
    model = _gpt_oss(torch.float32)
    ours, eager, reference, report = _compare(model, torch.float32, inner="inductor")
    assert len(_sites(report)) == model.config.num_hidden_layers, str(report)
    assert_model_close(ours, eager, reference, torch.float32)


class SinkDecoder(nn.Module):
    """A decoder written unlike GPT-OSS: one qkv projection split with ``split``, heads by ``view`` + ``permute``,
    keys and values repeated with ``repeat_interleave``, scores divided by sqrt(d), the window built from
    ``torch.ones(...).tril() & .triu(...)`` and applied with ``masked_fill`` (or ``where``), the sinks a
    [1, H, 1, 1] parameter, the row max by ``amax``, the sink column dropped with ``[..., :T]``.
    ``mask`` picks the mask: "window" (``window`` tokens), "prefix" (a prefix-LM mask: not a window), "none"
    (bidirectional), "where" (the window through ``torch.where``); ``dropout`` the attention dropout."""

    def __init__(self, dim=32, heads=4, kv_heads=2, layers=2, window=3, mask="window", dropout=0.0):
        super().__init__()
        self.heads, self.kv_heads, self.d, self.window, self.mask, self.dropout = \
            heads, kv_heads, dim // heads, window, mask, dropout
        self.embed = nn.Embedding(VOCAB, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, (heads + 2 * kv_heads) * self.d) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(heads * self.d, dim, bias=False) for _ in range(layers))
        self.sinks = nn.ParameterList(nn.Parameter(torch.randn(1, heads, 1, 1, generator=seeded(5)))
                                      for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def attend(self, x: torch.Tensor, i: int) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv[i](x).split([self.heads * self.d, self.kv_heads * self.d, self.kv_heads * self.d], -1)
        q = q.view(b, t, self.heads, self.d).permute(0, 2, 1, 3)
        k = k.view(b, t, self.kv_heads, self.d).permute(0, 2, 1, 3)
        v = v.view(b, t, self.kv_heads, self.d).permute(0, 2, 1, 3)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        ones = torch.ones(t, t, dtype=torch.bool, device=x.device)
        allowed = ones.tril() & ones.triu(-(self.window - 1))
        if self.mask == "prefix":
            allowed = ones.tril() | (torch.arange(t, device=x.device) < 3)[None, :]
        if self.mask == "where":
            scores = torch.where(allowed, scores, float("-inf"))
        elif self.mask != "none":
            scores = scores.masked_fill(~allowed, float("-inf"))
        logits = torch.cat([scores, self.sinks[i].expand(b, -1, t, 1)], dim=3)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        p = logits.softmax(-1)[..., :t]
        p = F.dropout(p, self.dropout, self.training)
        return self.out[i]((p @ v).transpose(1, 2).reshape(b, t, -1))

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for i in range(len(self.qkv)):
            x = x + self.attend(x, i)
        logits = self.head(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return types.SimpleNamespace(loss=loss, logits=logits)


def _run(model: nn.Module, dtype: torch.dtype) -> tuple:
    model = model.to(dtype)
    ids = torch.randint(0, VOCAB, (2, 13), generator=seeded(1))
    ours = loss_and_grads(model, ids, torch.compile(model, backend="sloth", options={"inner": "aot_eager"}))
    report = sloth.report()
    eager = loss_and_grads(model, ids)
    reference = loss_and_grads(model.double(), ids)
    model.to(dtype)
    return ours, eager, reference, report


@DTYPES
@pytest.mark.parametrize("window, mask", [(3, "window"), (13, "window"), (40, "where"), (1, "window")],
                         ids=["window-3", "window-t", "where-past-t", "window-1"])
def test_hand_written_sink_attention(window, mask, dtype) -> None:
    ours, eager, reference, report = _run(SinkDecoder(window=window, mask=mask), dtype)
    details = _sites(report)
    assert len(details) == 2, str(report)
    assert all(("causal" if window >= 13 else f"sliding window of {window}") in d for d in details), details
    assert all("4 heads over 2" in d for d in details), details  # the op reads k and v before repeat_interleave
    assert all(f"sinks.{i}" in ours[1] for i in range(2))
    assert_model_close(ours, eager, reference, dtype)


@pytest.mark.parametrize("mask, dropout, reason", [
    ("prefix", 0.0, "not one interval of keys ending at the query"),
    ("none", 0.0, "bidirectional attention"),
    ("window", 0.1, "attention dropout (0.1) is on"),
])
def test_other_forms_stay_with_the_reason(mask, dropout, reason) -> None:
    model = SinkDecoder(mask=mask, dropout=dropout).eval() if dropout == 0 else SinkDecoder(mask=mask, dropout=dropout)
    ids = torch.randint(0, VOCAB, (2, 13), generator=seeded(1))
    torch.manual_seed(0)
    ours = loss_and_grads(model, ids, torch.compile(model, backend="sloth", options={"inner": "aot_eager"}))
    report = sloth.report()
    assert not _sites(report), str(report)
    reasons = [r.reason for r in report.rejections if r.family == "sink_attention"]
    assert len(reasons) == 2 and all(reason in r for r in reasons), reasons
    if dropout == 0:  # the graph left as it was computes what eager does
        eager = loss_and_grads(model, ids)
        torch.testing.assert_close(ours[0], eager[0], rtol=1e-5, atol=1e-6)


def test_padding_mask_stays_with_the_reason() -> None:
    # A padding mask makes the attention mask a function of the user's attention_mask: no compile-time proof.
    model = _gpt_oss(torch.float32)
    ids = torch.randint(3, VOCAB, (2, 11), generator=seeded(1))
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :3] = 0
    compiled = torch.compile(model, backend="sloth", options={"inner": "aot_eager"})
    ours = compiled(input_ids=ids, attention_mask=attention_mask, labels=ids).loss
    report = sloth.report()
    assert not _sites(report), str(report)
    reasons = [r.reason for r in report.rejections if r.family == "sink_attention"]
    assert len(reasons) == model.config.num_hidden_layers and all("graph input" in r for r in reasons), reasons
    torch.testing.assert_close(ours, model(input_ids=ids, attention_mask=attention_mask, labels=ids).loss,
                               rtol=1e-5, atol=1e-6)


def test_attention_weights_read_elsewhere_stay() -> None:
    # output_attentions returns the probabilities: the op never makes them, so the site stays.
    model = _gpt_oss(torch.float32)
    ids = torch.randint(3, VOCAB, (2, 11), generator=seeded(1))
    compiled = torch.compile(model, backend="sloth", options={"inner": "aot_eager"})
    compiled(input_ids=ids, labels=ids, output_attentions=True)
    report = sloth.report()
    assert not _sites(report), str(report)
    reasons = [r.reason for r in report.rejections if r.family == "sink_attention"]
    assert reasons and all("read outside the attention" in r for r in reasons), reasons
