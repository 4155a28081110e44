"""The packed-attention family: packed batches (position ids restarting per document, no attention mask) get
``sloth.document_attention`` in every layer, with the loss and every gradient of eager, and masks that are
not document-causal stay with a reason.

Models: transformers' Llama and Qwen3 (SDPA, the mask transformers builds under Dynamo from position ids),
with and without gradient checkpointing; batches from ``DataCollatorWithFlattening`` and in TRL's
padding-free form (pads at position 0, each its own document); hand-written models whose masks follow the
other two rules (documents from ``position == 0`` and from document ids).
"""
from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import sloth
from sloth.patterns.packed_attention import probe_ids
from sloth.runtime.packing import RULES, document_bounds
from sloth.lowering.document_attention import allowed_from_bounds
from checkpointing import enable_checkpointing
from test_models import assert_model_close
from pattern_checks import seeded

VOCAB = 96


def tiny(model_type: str, dtype: torch.dtype = torch.float32, **extra) -> nn.Module:
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128, use_cache=False,
        attn_implementation="sdpa", **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


def flattened_batch(lengths: list[int], seed: int = 0, **collator_kwargs) -> dict[str, torch.Tensor]:
    """``DataCollatorWithFlattening``'s batch of random documents of ``lengths``."""
    g = seeded(seed)
    features = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    collator = transformers.DataCollatorWithFlattening(return_tensors="pt", **collator_kwargs)
    return dict(collator(features))


def trl_padding_free_batch(lengths: list[int], pad_to: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """TRL's padding-free batch: documents back to back, position ids only, pads at position 0 (each its own
    length-1 document), labels -100 on each document's first token and on the pads."""
    g = seeded(seed)
    ids = torch.cat([torch.randint(0, VOCAB, (n,), generator=g) for n in lengths])
    pos = torch.cat([torch.arange(n) for n in lengths])
    labels = ids.clone()
    labels[torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)] = -100
    pad = pad_to - len(ids)
    ids = torch.cat([ids, torch.zeros(pad, dtype=torch.long)])
    pos = torch.cat([pos, torch.zeros(pad, dtype=torch.long)])
    labels = torch.cat([labels, torch.full((pad,), -100)])
    return {"input_ids": ids[None], "position_ids": pos[None], "labels": labels[None]}


def loss_and_grads(model: nn.Module, batch: dict, run=None):
    model.zero_grad(set_to_none=True)
    loss = (model if run is None else run)(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check(model: nn.Module, batch: dict, dtype: torch.dtype = torch.float32, inner: str = "aot_eager"):
    """sloth against eager and a float64 copy on ``batch``; returns sloth's report."""
    reference = copy.deepcopy(model).double()
    ref = loss_and_grads(reference, batch)
    eager = loss_and_grads(model, batch)
    sloth.reset_report()
    ours = loss_and_grads(model, batch, torch.compile(model, backend="sloth", options={"inner": inner}))
    assert_model_close(ours, eager, ref, dtype)
    return sloth.report()


@pytest.mark.parametrize("model_type, checkpointing", [("llama", False), ("llama", True), ("qwen3", True)],
                         ids=["llama-plain", "llama-checkpointed", "qwen3-checkpointed"])
def test_flattened_batch_matches_eager(model_type, checkpointing):
    model = tiny(model_type)
    if checkpointing:
        enable_checkpointing(model, use_reentrant=False)
        model.train()  # transformers checkpoints only in training mode; the model has no dropout
    report = check(model, flattened_batch([7, 13, 1, 11]))
    assert report.counts.get("packed_attention") == 2, str(report)
    assert not [r for r in report.rejections if r.family in ("packed_attention", "causal_mask")], str(report)
    assert all("position_reset" in s.detail for s in report.sites if s.family == "packed_attention")
    if checkpointing:
        assert all("checkpointed layer" in s.detail for s in report.sites if s.family == "packed_attention")


def test_flash_attention_kwargs_and_inductor():
    """The collator's varlen kwargs (cu_seq_lens, max_length) ride along, unread by SDPA; Inductor compiles."""
    batch = flattened_batch([5, 9, 2], return_flash_attn_kwargs=True)
    assert "cu_seq_lens_q" in batch
    report = check(tiny("llama"), batch, inner="inductor")
    assert report.counts.get("packed_attention") == 2, str(report)


def test_trl_padding_free_with_padded_tail():
    """Pads at position 0 are length-1 documents: no row is empty, nothing becomes NaN."""
    report = check(tiny("qwen3"), trl_padding_free_batch([6, 10, 3], pad_to=24))
    assert report.counts.get("packed_attention") == 2, str(report)


def test_bf16_packed_model():
    report = check(tiny("llama", torch.bfloat16), flattened_batch([9, 4, 12], seed=3), dtype=torch.bfloat16)
    assert report.counts.get("packed_attention") == 2, str(report)


class HandPacked(nn.Module):
    """Attention written by hand over a packed row, its mask built from ``ids`` by ``rule``'s own formula."""

    def __init__(self, rule: str, d: int = 32, heads: int = 4, window: Optional[int] = None):
        super().__init__()
        g = seeded(5)
        self.rule, self.heads = rule, heads
        self.window = 3 if rule == "window" else window  # a sliding window on top of the rule's documents
        self.qkv = nn.Parameter(torch.randn(3 * d, d, generator=g) / d**0.5)

    def forward(self, x, ids):
        b, t, d = x.shape
        q, k, v = F.linear(x, self.qkv).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.rule == "position_zero":
            doc = torch.cumsum((ids == 0).int(), dim=-1)
        elif self.rule == "id_change":  # segment ids: a new segment wherever the id changes
            doc = torch.cumsum(F.pad((ids[:, 1:] != ids[:, :-1]).int(), (1, 0)), dim=-1)
        else:  # ids compared as they are: equal ids anywhere in the row attend to each other
            doc = ids
        i = torch.arange(t, device=x.device)
        mask = (doc[:, :, None] == doc[:, None, :]) & (i[None, :, None] >= i[None, None, :])
        if self.window is not None:  # not document-causal where rows are longer than the window
            mask = mask & (i[None, :, None] - i[None, None, :] < self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return out.transpose(1, 2).reshape(b, t, d)


@pytest.mark.parametrize("rule, ids", [
    ("position_zero", [[0, 1, 2, 3, 0, 1, 0, 1, 2]]),
    ("id_change", [[7, 7, 7, 2, 2, 9, 9, 9, 9]]),
])
def test_hand_written_masks_follow_their_rule(rule, ids):
    model = HandPacked(rule)
    x = torch.randn(1, 9, 32, generator=seeded(6))
    ids = torch.tensor(ids)
    sloth.reset_report()
    got = torch.compile(model, backend="sloth", options={"inner": "eager"})(x, ids)
    report = sloth.report()
    assert report.counts.get("packed_attention") == 1, str(report)
    assert f"({rule} of" in report.sites[0].detail
    torch.testing.assert_close(got, model(x, ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", ["window", "equal_ids"])
def test_masks_that_are_not_document_causal_stay_with_reason(rule):
    """A sliding window; ids compared for equality (ids that come back later in the row make one document of
    tokens that are not adjacent, which no document bounds can say)."""
    model = HandPacked(rule)
    x, ids = torch.randn(1, 9, 32, generator=seeded(6)), torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    sloth.reset_report()
    torch.compile(model, backend="sloth", options={"inner": "eager"})(x, ids)
    report = sloth.report()
    assert not report.counts.get("packed_attention"), str(report)
    [reason] = [r.reason for r in report.rejections if r.family == "packed_attention"]
    assert "not document-causal under any rule" in reason, reason


def test_padding_mask_with_positions_stays_with_reason():
    """An attention mask makes transformers build a padding mask; with the positions it reads two inputs."""
    model = tiny("llama")
    ids = torch.randint(0, VOCAB, (2, 8), generator=seeded(1))
    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[1, :3] = 0
    sloth.reset_report()
    torch.compile(model, backend="sloth", options={"inner": "eager"})(
        input_ids=ids, attention_mask=attention_mask, position_ids=torch.arange(8).expand(2, 8))
    report = sloth.report()
    assert not report.counts.get("packed_attention"), str(report)
    reasons = [r.reason for r in report.rejections if r.family == "packed_attention"]
    assert reasons and all("not document-causal" in r or "more than one graph input" in r for r in reasons), reasons


def test_dynamic_lengths_are_taken():
    """dynamic=True: one graph of symbolic length, its mask probed at the traced length and at LONG_PROBE tokens;
    every length after it runs the op, as eager."""
    model = HandPacked("position_zero")
    compiled = torch.compile(model, backend="sloth", options={"inner": "eager"}, dynamic=True)
    for ids in ([[0, 1, 2, 3, 0, 1, 0, 1, 2]], [[0, 1, 0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]], [[0, 1, 2, 0, 1]]):
        ids = torch.tensor(ids)
        x = torch.randn(1, ids.shape[1], 32, generator=seeded(ids.shape[1]))
        torch.testing.assert_close(compiled(x, ids), model(x, ids), rtol=1e-5, atol=1e-6)
    report = sloth.report()
    assert report.graphs == 1 and report.counts.get("packed_attention") == 1, str(report)
    assert "symbolic-length" in report.sites[0].detail and "(position_zero of" in report.sites[0].detail


def test_dynamic_length_window_wider_than_the_traced_length_stays():
    """A 64-token window is nothing at 9 tokens (a static graph of 9 takes it, rightly), but a symbolic-length graph
    runs at any length: the long probe shows the window, and the mask stays."""
    model = HandPacked("position_zero", window=64)
    x, ids = torch.randn(1, 9, 32, generator=seeded(6)), torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    torch.compile(model, backend="sloth", options={"inner": "eager"})(x, ids)
    assert sloth.report().counts.get("packed_attention") == 1, str(sloth.report())
    sloth.reset_report()
    torch._dynamo.reset()
    got = torch.compile(model, backend="sloth", options={"inner": "eager"}, dynamic=True)(x, ids)
    torch.testing.assert_close(got, model(x, ids), rtol=1e-5, atol=1e-6)
    report = sloth.report()
    assert not report.counts.get("packed_attention"), str(report)
    [reason] = [r.reason for r in report.rejections if r.family == "packed_attention"]
    assert "not document-causal under any rule" in reason and "(4096 tokens)" in reason, reason


def test_trl_packed_rows_of_changing_length():
    """TRL's packing: every step's packed row has another length, so Dynamo's second graph has a symbolic one. Both
    graphs run the op in every layer, and each step's loss and gradients are eager's (against float64)."""
    model = tiny("qwen3")
    compiled = torch.compile(model, backend="sloth", options={"inner": "aot_eager"})
    for lengths, pad in (([6, 10, 3], 24), ([5, 9, 7, 4], 29), ([3, 3], 8)):
        batch = trl_padding_free_batch(lengths, pad)
        ref = loss_and_grads(copy.deepcopy(model).double(), batch)
        eager = loss_and_grads(model, batch)
        assert_model_close(loss_and_grads(model, batch, compiled), eager, ref, torch.float32)
    report = sloth.report()
    assert report.graphs == 2 and report.counts.get("packed_attention") == 4, str(report)
    assert sum("symbolic-length" in s.detail for s in report.sites if s.family == "packed_attention") == 2
    assert not [r for r in report.rejections if r.family in ("packed_attention", "causal_mask")], str(report)


def test_probes_tell_the_rules_apart():
    """Each rule's mask differs from every other rule's on some probe, so a match picks one rule."""
    probes = probe_ids((2, 16), torch.long, "cpu")
    for rule in RULES:
        for other in RULES:
            if other != rule:
                assert any(not torch.equal(allowed_from_bounds(document_bounds(p, rule)),
                                           allowed_from_bounds(document_bounds(p, other))) for p in probes)


def test_under_autocast_the_op_runs_in_autocasts_dtype():
    """Under bf16 autocast (TRL's default ``bf16=True`` with an fp32 model) SDPA casts q, k and v to bf16; the
    replacement casts them explicitly (custom ops get no autocast casts) and returns bf16, as SDPA does."""
    model = tiny("llama")
    batch = flattened_batch([6, 9, 4], seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(**batch).loss
        sloth.reset_report()
        ours = torch.compile(model, backend="sloth", options={"inner": "aot_eager"})(**batch).loss
    report = sloth.report()
    assert report.counts.get("packed_attention") == 2, str(report)
    assert not [r for r in report.rejections if r.family == "packed_attention"], str(report)
    torch.testing.assert_close(ours, eager, rtol=2e-2, atol=2e-2)


def _rows_only(monkeypatch, block_elements: int) -> list:
    """A 0-byte budget: the mask is checked a block of query rows at a time (patterns/mask_rows.py), as a packed
    batch of 128k tokens is on the device; [B, T] ids stay small enough to be made whole (SMALL_SHARE 2).
    Returns the list of blocks the check evaluated (first row, rows), filled as it runs."""
    from sloth.patterns import causal_mask, mask_rows

    monkeypatch.setattr(causal_mask, "CPU_EVALUATION_BYTES", 0)
    monkeypatch.setattr(mask_rows, "ROW_BLOCK_ELEMENTS", block_elements)
    monkeypatch.setattr(mask_rows, "SMALL_SHARE", 2)
    seen, blocks = [], mask_rows.RowBlocks.blocks

    def recording(self, given=None):
        for first_row, value in blocks(self, given):
            seen.append((first_row, value.shape[-2]))
            yield first_row, value

    monkeypatch.setattr(mask_rows.RowBlocks, "blocks", recording)
    return seen


def test_flattened_batch_checked_by_row_blocks(monkeypatch):
    seen = _rows_only(monkeypatch, 3 * 32)  # 32 tokens: blocks of 3 rows, the last one short
    model = tiny("llama")
    enable_checkpointing(model, use_reentrant=False)
    model.train()
    report = check(model, flattened_batch([7, 13, 1, 11]))
    assert report.counts.get("packed_attention") == 2, str(report)
    assert all("position_reset" in s.detail for s in report.sites if s.family == "packed_attention")
    assert (0, 3) in seen and (30, 2) in seen, seen[:12]


@pytest.mark.parametrize("rule, expected", [("position_zero", "replaced"), ("id_change", "replaced"),
                                            ("window", "not document-causal"), ("equal_ids", "not document-causal")])
def test_hand_written_masks_by_row_blocks(monkeypatch, rule, expected):
    seen = _rows_only(monkeypatch, 3 * 9)
    ids = {"position_zero": [[0, 1, 2, 3, 0, 1, 0, 1, 2]], "id_change": [[7, 7, 7, 2, 2, 9, 9, 9, 9]]}.get(
        rule, [[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    model, x, ids = HandPacked(rule), torch.randn(1, 9, 32, generator=seeded(6)), torch.tensor(ids)
    sloth.reset_report()
    got = torch.compile(model, backend="sloth", options={"inner": "eager"})(x, ids)
    report = sloth.report()
    torch.testing.assert_close(got, model(x, ids), rtol=1e-5, atol=1e-6)
    assert seen and {rows for _, rows in seen} == {3}, seen
    if expected == "replaced":
        assert report.counts.get("packed_attention") == 1 and f"({rule} of" in report.sites[0].detail, str(report)
    else:
        [reason] = [r.reason for r in report.rejections if r.family == "packed_attention"]
        assert "not document-causal under any rule" in reason, reason
