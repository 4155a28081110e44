"""A causal mask made in one graph and read in others (graph breaks, FSDP2's per-module graphs, DDP's splits):
the making graph proves it and marks the tensor it returns, the reading graphs run ``is_causal`` only for a
marked, unchanged tensor (patterns/causal_mask.py, patterns/mask_inputs.py, runtime/proven_masks.py).

A hand-written model whose graph breaks between the mask and each layer: the loss and every gradient equal
eager's, the layers' SDPA sites are reported, and every call took the causal version. A mask the caller builds
(proven by nobody) is checked on its device once per tensor (the ``mask_check`` option): a causal one runs
causal, a sliding window, or a causal mask written in place since, runs as written with eager's values; with the
option off it is kept without a check. The runtime verdict is refused to a tensor written in place since, to
another tensor of the same values, and is forgotten with its tensor; the device check reads bool and additive
masks.
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sloth
from pattern_checks import seeded
from sloth.runtime import proven_masks

T = 9


class Layer(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.qkv, self.o, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, :, :t, :t])  # a slice that keeps it all
        return x + self.o(a.transpose(1, 2).reshape(b, t, d))


class SplitModel(nn.Module):
    """The mask made in the first graph; each layer in a graph of its own after a break, reading it as an input."""

    def __init__(self):
        super().__init__()
        self.emb, self.layer0, self.layer1 = nn.Embedding(50, 32), Layer(), Layer()

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        t = ids.shape[1]
        if mask is None:
            mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()[None, None]
        x = self.emb(ids)
        torch._dynamo.graph_break()
        x = self.layer0(x, mask)
        torch._dynamo.graph_break()
        x = self.layer1(x, mask)
        return x.float().pow(2).mean()


def step(run, model: nn.Module, ids: torch.Tensor, *args) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = run(ids, *args)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def split_model():
    torch.manual_seed(0)
    model = SplitModel()
    ids = torch.randint(0, 50, (2, T), generator=seeded(1))
    torch._dynamo.reset()
    sloth.reset_report()
    proven_masks.reset()
    return model, ids, torch.compile(model, backend="sloth", options={"inner": "aot_eager"})


def test_a_mask_from_another_graph_runs_causal_with_eager_values(split_model):
    model, ids, compiled = split_model
    eager = step(model, model, ids)
    for _ in range(2):
        ours = step(compiled, model, ids)
        torch.testing.assert_close(ours[0], eager[0])
        for mine, theirs in zip(ours[1], eager[1]):
            torch.testing.assert_close(mine, theirs)
    report = sloth.report()
    sites = [s for s in report.sites if s.family == "causal_mask"]
    assert len(sites) == 2 and all(s.op == "is_causal=True when proven" and f"{T} x {T} mask from graph input"
                                   in s.detail for s in sites), str(report)
    assert not report.unexplained, str(report)
    assert proven_masks.calls == {"causal": 4, "masked": 0, "checked": 0}  # two layer graphs, two steps; all proven


def test_a_mask_the_caller_builds_runs_as_written(split_model):
    model, ids, compiled = split_model
    window = torch.ones(T, T, dtype=torch.bool).tril().triu(-2)[None, None]  # a sliding window: not causal
    eager = step(model, model, ids, window)
    ours = step(compiled, model, ids, window)
    torch.testing.assert_close(ours[0], eager[0])
    for mine, theirs in zip(ours[1], eager[1]):
        torch.testing.assert_close(mine, theirs)
    report = sloth.report()
    kept = [r.reason for r in report.rejections if r.family == "causal_mask"]
    assert len(kept) == 2 and all("is not the causal mask" in r for r in kept), str(report)
    # Checked once on its device while compiling, then compiled once, as written: nothing to choose per call.
    assert proven_masks.calls == {"causal": 0, "masked": 0, "checked": 1}


def test_a_causal_mask_the_caller_builds_is_checked_once_per_tensor(split_model):
    model, ids, compiled = split_model
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]  # built eagerly: no graph proves it
    eager = step(model, model, ids, mask)
    for _ in range(2):
        ours = step(compiled, model, ids, mask)
        torch.testing.assert_close(ours[0], eager[0])
        for mine, theirs in zip(ours[1], eager[1]):
            torch.testing.assert_close(mine, theirs)
    sites = [s for s in sloth.report().sites if s.family == "causal_mask"]
    assert len(sites) == 2 and all("checked causal on the device" in s.detail for s in sites), str(sloth.report())
    # One check (while compiling, on the tensor the first call got), then lookups: 2 layers x 2 steps causal.
    assert proven_masks.calls == {"causal": 4, "masked": 0, "checked": 1}
    step(compiled, model, ids, mask.clone())  # the same values in a new tensor: checked again, once
    assert proven_masks.calls == {"causal": 6, "masked": 0, "checked": 2}


def test_a_mask_that_stops_being_causal_runs_as_written(split_model):
    # Compiled with a causal mask (both versions), then given a window of the same shape, then the causal mask
    # written in place: each is checked on its values and runs masked, with eager's values.
    model, ids, compiled = split_model
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    step(compiled, model, ids, causal)
    window = torch.ones(T, T, dtype=torch.bool).tril().triu(-2)[None, None]
    for mask in (window, causal):
        eager = step(model, model, ids, mask)
        ours = step(compiled, model, ids, mask)
        torch.testing.assert_close(ours[0], eager[0])
        for mine, theirs in zip(ours[1], eager[1]):
            torch.testing.assert_close(mine, theirs)
        causal[..., 0, 1] = True  # token 0 may now see token 1: no longer causal, the same tensor
    assert proven_masks.calls == {"causal": 2, "masked": 4, "checked": 3}, proven_masks.calls


def test_mask_check_off_keeps_a_mask_nobody_proved(split_model):
    model, ids, _ = split_model
    compiled = torch.compile(model, backend="sloth", options={"inner": "aot_eager", "mask_check": False})
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    eager = step(model, model, ids, mask)
    ours = step(compiled, model, ids, mask)
    torch.testing.assert_close(ours[0], eager[0])
    kept = [r.reason for r in sloth.report().rejections if r.family == "causal_mask"]
    assert len(kept) == 2 and all("mask_check is off" in r for r in kept), kept
    assert proven_masks.calls == {"causal": 0, "masked": 0, "checked": 0}  # no device check, no sync


@pytest.mark.parametrize("rows_per_block", [3, 1024])
def test_causal_values_reads_bool_and_additive_masks(monkeypatch, rows_per_block):
    monkeypatch.setattr(proven_masks, "_ROWS_PER_BLOCK", rows_per_block)  # several blocks of rows, and one
    causal = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril()
    additive = torch.zeros(2, 1, 7, 7).masked_fill(~causal, float("-inf"))
    lowest = torch.zeros(2, 1, 7, 7, dtype=torch.bfloat16).masked_fill(~causal, torch.finfo(torch.bfloat16).min)
    assert proven_masks.causal_values(causal) and proven_masks.causal_values(additive)
    assert proven_masks.causal_values(lowest)
    assert proven_masks.causal_values(torch.ones(5, 9, dtype=torch.bool).tril())  # more keys than queries
    hole = causal.clone()
    hole[1, 0, 6, 2] = False  # one row of one batch element misses a key: padding-like
    assert not proven_masks.causal_values(hole)
    ahead = causal.clone()
    ahead[0, 0, 5, 6] = True  # a future key
    assert not proven_masks.causal_values(ahead)
    bias = additive.clone()
    bias[0, 0, 3, 1] = -0.5  # an additive bias, not a mask
    assert not proven_masks.causal_values(bias)
    assert not proven_masks.causal_values(causal.int())


def test_the_mark_holds_for_that_tensor_unchanged_only():
    proven_masks.reset()
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    proven_masks.mark(mask)
    assert proven_masks.is_proven(mask)
    assert not proven_masks.is_proven(mask.clone())  # the same values, another tensor
    mask[0, 3] = True  # written in place after it was proven
    assert not proven_masks.is_proven(mask)
    proven_masks.mark(mask)
    del mask
    gc.collect()
    assert not proven_masks._verdicts  # forgotten with its tensor


class WritesItsMask(nn.Module):
    """A layer graph that writes into the mask it receives before attending: the proof of the graph that made
    the mask no longer holds there."""

    def __init__(self):
        super().__init__()
        self.emb, self.layer = nn.Embedding(50, 32), Layer()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        x = self.emb(ids)
        torch._dynamo.graph_break()
        mask[..., 0] = True  # every query may now see the first key: still causal (j = 0 <= i), but written
        mask[..., 1, 2] = True  # and one future key: not causal
        return self.layer(x, mask).float().pow(2).mean()


def test_a_mask_written_in_the_reading_graph_runs_as_written():
    torch._dynamo.reset()
    sloth.reset_report()
    proven_masks.reset()
    torch.manual_seed(0)
    model = WritesItsMask()
    ids = torch.randint(0, 50, (2, T), generator=seeded(1))
    eager = step(model, model, ids)
    ours = step(torch.compile(model, backend="sloth", options={"inner": "aot_eager"}), model, ids)
    torch.testing.assert_close(ours[0], eager[0])
    for mine, theirs in zip(ours[1], eager[1]):
        torch.testing.assert_close(mine, theirs)
    kept = [r.reason for r in sloth.report().rejections if r.family == "causal_mask"]
    assert len(kept) == 1 and "writes in place" in kept[0], kept


def test_mask_check_must_be_a_bool(split_model):
    model, ids, _ = split_model
    with pytest.raises(Exception, match="mask_check must be True or False"):  # inside Dynamo's wrapper
        torch.compile(model, backend="sloth", options={"mask_check": "yes"})(ids)
