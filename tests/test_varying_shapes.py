"""Batches of varying length, as real fine-tuning feeds them, and evaluation under no_grad after training.

Dynamo compiles the first shape statically and, on the second, one graph with a symbolic sequence length
(automatic dynamic shapes); sloth's families must still replace every site of that dynamic graph, or report it,
and the loss and gradients must stay within the tolerance rule for every batch.
"""
from __future__ import annotations

import copy

import pytest
import torch

import sloth
from sloth.compiler.backend import last_report, sloth_backend
from pattern_checks import seeded
from test_models import assert_model_close, build, loss_and_grads

# 10 batches of 5 distinct lengths, some repeating, in no order (20 of 7 before: the same paths, twice the
# CI time).
LENGTHS = [5, 9, 5, 12, 7, 9, 16, 5, 12, 7]
EXPECTED = {"rms_norm": 5, "rope": 2, "glu": 2, "cross_entropy": 1, "lora": 14}  # 2 layers, LoRA on every linear


def lora_llama() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("llama", torch.float32), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; non-zero B makes every A gradient non-zero too
            torch.nn.init.normal_(p, std=0.1, generator=seeded(7))
    return model


def recording_backend(reports: list):
    def backend(gm, example_inputs):
        compiled = sloth_backend(gm, example_inputs, options={"inner": "aot_eager"})
        reports.append(last_report())
        return compiled
    return backend


def test_ten_batches_of_five_lengths_compile_twice_and_match_eager():
    model = lora_llama()
    reference = copy.deepcopy(model).double()
    reports: list = []
    compiled = torch.compile(model, backend=recording_backend(reports))
    gen = seeded(21)
    for step, length in enumerate(LENGTHS):
        ids = torch.randint(3, 96, (2, length), generator=gen)
        actual = loss_and_grads(model, ids, run=compiled)
        if step % 4 == 0 or step == len(LENGTHS) - 1:  # eager and fp64 on every fourth batch: the rule's oracle
            assert_model_close(actual, loss_and_grads(model, ids), loss_and_grads(reference, ids), torch.float32)
        else:
            torch.testing.assert_close(actual[0], loss_and_grads(model, ids)[0], rtol=1e-5, atol=1e-6)
    # The static graph of the first length, then one dynamic graph for every other length.
    assert len(reports) == 2, [str(r) for r in reports]
    for report in reports:
        assert report.counts == EXPECTED and not report.rejections, str(report)


def test_padded_batches_of_varying_length_report_the_kept_mask():
    # A padding mask is read from an input, so the causal-mask family keeps it and says why, in the static and
    # the dynamic graph alike; every other family replaces its sites; losses equal eager's.
    model = lora_llama()
    reports: list = []
    compiled = torch.compile(model, backend=recording_backend(reports))
    gen = seeded(22)
    for length in (6, 9, 13, 9):
        ids = torch.randint(3, 96, (2, length), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, : length // 3] = 0  # left padding of the second row
        labels = ids.masked_fill(mask == 0, -100)
        got = compiled(input_ids=ids, attention_mask=mask, labels=labels).loss
        want = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(reports) == 2, [str(r) for r in reports]
    for report in reports:
        assert report.counts == EXPECTED, str(report)
        masked = report.anchors_left.get("causal_mask", 0)
        reasons = [r.reason for r in report.rejections if r.family == "causal_mask"]
        # static: a mask read from an input is kept; dynamic: the family refuses symbolic lengths first (it
        # proves a mask causal by evaluating it at the lengths, which a symbolic length does not give)
        assert len(reasons) == masked > 0 and all("graph input" in r or "symbolic" in r for r in reasons), \
            str(report)


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full-fine-tuning"])
def test_evaluation_under_no_grad_after_training(full):
    model = build("llama", torch.float32) if full else lora_llama()
    compiled = torch.compile(model, backend="sloth", options={"inner": "aot_eager"})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gen = seeded(23)
    for length in (7, 11):  # a static and a dynamic graph, trained
        ids = torch.randint(3, 96, (2, length), generator=gen)
        compiled(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    for length in (7, 11, 15):
        ids = torch.randint(3, 96, (2, length), generator=gen)
        with torch.no_grad():
            got = compiled(input_ids=ids, labels=ids)
            want = model(input_ids=ids, labels=ids)
        assert not got.loss.requires_grad
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert sloth.report().counts.get("cross_entropy", 0) >= 1
