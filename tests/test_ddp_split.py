"""sloth under DDP when Dynamo's DDP optimizer splits the graph at gradient buckets (issue 21).

A 4-layer Llama with r = 64 adapters on every linear under ``DistributedDataParallel(bucket_cap_mb=1)`` (one
process, a one-rank gloo group): the adapters' gradients fill more than one bucket, so Dynamo compiles the model
in pieces and sloth sees each piece alone. Checked: the pieces' records stay their own (they share the whole
graph's meta dict: compiler/backend.py), the causal mask made in the first piece is proven there and used
``is_causal`` in the others (runtime/proven_masks.py), every GLU and LoRA site is replaced or, where the split
cut it, reported as cut (patterns/glu.py and patterns/lora.py, cut_sites), and the loss and every gradient
follow the tolerance rule. And the same report for a graph break inside a GLU, where a frozen router-like
projection returned beside it is no cut.
"""
from __future__ import annotations

import zlib

import pytest
import torch

import sloth
from sloth.runtime import proven_masks
from test_models import assert_model_close

pytest.importorskip("peft")


def lora_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = get_peft_model(transformers.LlamaForCausalLM(config),
                           LoraConfig(r=64, lora_alpha=64, target_modules="all-linear", lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # nonzero B: gradients reach every adapter and the input
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return model.to(dtype)


IDS = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(model: torch.nn.Module, forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = forward(input_ids=IDS, labels=IDS).loss
    loss.backward()
    grads = {n.replace("module.", "").replace("_orig_mod.", ""): p.grad.detach().clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def test_split_pieces_keep_their_sites_or_report_the_cut(one_rank_group) -> None:
    single = lora_llama()
    sloth.reset_report()
    torch.compile(single, backend="sloth", options={"inner": "aot_eager"})(input_ids=IDS, labels=IDS)
    whole = dict(sloth.report().counts)

    eager = _loss_and_grads(model := lora_llama(), model)
    reference = _loss_and_grads(model := lora_llama(torch.float64), model)
    model = lora_llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    torch._dynamo.reset()  # the single-process graph would otherwise serve the same code under DDP too
    sloth.reset_report()
    proven_masks.reset()
    ours = _loss_and_grads(model, torch.compile(ddp, backend="sloth", options={"inner": "aot_eager"}))
    report = sloth.report()
    assert report.graphs >= 2, str(report)  # the split this test is about happened
    assert_model_close(ours, eager, reference, torch.float32)
    assert not report.unexplained, str(report)
    assert proven_masks.calls["causal"] >= 1 and proven_masks.calls["masked"] == 0, proven_masks.calls
    cut = {}
    for r in report.rejections:
        if r.reason.startswith("cut apart by a graph boundary"):
            cut[r.family] = cut.get(r.family, 0) + 1
    assert cut, str(report)  # this model's split falls inside a layer's MLP
    for family in ("rms_norm", "rope", "glu", "lora", "cross_entropy", "causal_mask"):
        assert report.counts.get(family, 0) + cut.get(family, 0) == whole[family], (family, str(report))


class _BrokenMLP(torch.nn.Module):
    """A gated MLP with a graph break between the activation and its product, and a frozen router-like small
    projection whose logits only leave the first graph (no adapter: its weight is frozen)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 24, bias=False)
        self.down = torch.nn.Linear(24, 16, bias=False)
        self.router = torch.nn.Linear(16, 4, bias=False).requires_grad_(False)
        self.gate.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = torch.nn.functional.silu(self.gate(x))
        logits = self.router(x)
        torch._dynamo.graph_break()
        return self.down(act * self.up(x)) + logits.sum(-1, keepdim=True)


def test_a_graph_break_inside_a_glu_is_reported_as_a_cut() -> None:
    torch.manual_seed(0)
    model = _BrokenMLP()
    x = torch.randn(3, 16, requires_grad=True)
    eager = model(x)
    sloth.reset_report()
    torch._dynamo.reset()
    ours = torch.compile(model, backend="sloth", options={"inner": "aot_eager"})(x)
    torch.testing.assert_close(ours, eager)
    report = sloth.report()
    cut = [r.family for r in report.rejections if r.reason.startswith("cut apart by a graph boundary")]
    assert cut == ["glu"], str(report)  # the activation; not the frozen router's logits
    assert not report.unexplained, str(report)
