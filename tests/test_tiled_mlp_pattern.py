"""``options={"tiled_mlp": ...}``: a LoRA MLP's two ops made one ``sloth.lora_mlp_tiled`` (patterns/tiled_mlp.py).

peft LoRA models (Llama's separate gate and up, Phi-3's merged gate_up_proj), plain and gradient-checkpointed:
every MLP's three sites become the tiled op when it has more rows than a block, and the loss and every LoRA
gradient match eager under the tolerance rule; MLPs that fit one block, or whose projections are not joined,
stay as they were and their sites say why; bad option values are refused.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sloth
from checkpointing import enable_checkpointing
from pattern_checks import seeded
from test_lora_pattern import VOCAB, loss_and_grads, tiny_peft_model
from tolerance import assert_close

MLP = ("gate_proj", "up_proj", "down_proj")


def tiny_tiled_model(model_type: str, dtype: torch.dtype, checkpointed: bool = False) -> nn.Module:
    """tests/test_lora_pattern.py's two-layer peft model, LoRA on attention and the MLP (Phi-3's fused qkv and
    gate_up projections), optionally with transformers' non-reentrant checkpointing, in training mode."""
    targets = ["q_proj", "v_proj", *MLP] if model_type == "llama" else ["qkv_proj", "gate_up_proj", "down_proj"]
    model = tiny_peft_model(model_type, dtype, 2, target_modules=targets)
    if checkpointed:
        enable_checkpointing(model, use_reentrant=False)
        model.enable_input_require_grads()
    return model.train()


def run_compiled(model: nn.Module, dtype: torch.dtype, options: dict, reference: bool = True) -> sloth.Report:
    """Compile with ``options``, train one step, compare the loss and every LoRA gradient with eager's."""
    ids = torch.randint(3, VOCAB, (2, 11), generator=seeded(1))  # 22 rows
    if reference:
        ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model).double(), ids)
    eager_loss, eager_grads = loss_and_grads(model, ids)
    sloth.reset_report()
    compiled = torch.compile(model, backend="sloth", options={"inner": "aot_eager", **options})
    loss, grads = loss_and_grads(model, ids, run=compiled)
    assert grads.keys() == eager_grads.keys() and all("lora_" in n for n in grads), sorted(grads)
    if reference:
        eps = torch.finfo(dtype).eps
        assert_close("loss", loss, eager_loss, ref_loss, atol=4 * eps * ref_loss.abs().item())
        for name, grad in grads.items():
            ref = ref_grads[name]
            assert_close(f"grad {name}", grad, eager_grads[name], ref,
                         atol=0.5 * eps * ref.pow(2).mean().sqrt().item())
    return sloth.report()


def mlp_sites(report: sloth.Report) -> list:
    return [s for s in report.sites if s.family == "lora" and s.module.rsplit(".", 1)[-1] in
            (*MLP, "gate_up_proj")]


@pytest.mark.parametrize("model_type,checkpointed,dtype,option,kept", [
    pytest.param("llama", False, torch.float32, 8, "recomputed per block", id="llama-fp32"),
    pytest.param("llama", False, torch.bfloat16, {"rows": 8, "recompute": False}, "kept", id="llama-bf16-kept"),
    pytest.param("llama", True, torch.bfloat16, 8, "recomputed per block", id="llama-checkpointed-bf16"),
    pytest.param("phi3", False, torch.float32, {"rows": 8, "recompute": False}, "kept", id="phi3-merged-fp32-kept")])
def test_every_mlp_is_tiled_and_matches_eager(model_type, checkpointed, dtype, option, kept):
    report = run_compiled(tiny_tiled_model(model_type, dtype, checkpointed), dtype, {"tiled_mlp": option})
    sites = mlp_sites(report)
    assert len(sites) == 2 * (3 if model_type == "llama" else 2), str(report)
    assert all(s.op == "sloth.lora_mlp_tiled" and f"tiled: 3 blocks of 8 rows, gate and up {kept}" in s.detail
               for s in sites), str(report)
    assert report.counts.get("lora", 0) == len([s for s in report.sites if s.family == "lora"])
    assert not [r for r in report.rejections if r.family == "lora"], str(report)


def test_an_mlp_that_fits_one_block_is_left_as_two_ops():
    report = run_compiled(tiny_tiled_model("llama", torch.float32), torch.float32, {"tiled_mlp": 64},
                          reference=False)
    downs = [s for s in mlp_sites(report) if s.module.endswith("down_proj")]
    assert len(downs) == 2 and all(s.op == "sloth.glu_lora_linear" and "22 rows fit one block of 64" in s.detail
                                   for s in downs), str(report)


def test_projections_not_joined_are_not_tiled_and_say_why():
    report = run_compiled(tiny_tiled_model("llama", torch.float32), torch.float32,
                          {"tiled_mlp": 8, "share_lora_input": False}, reference=False)
    downs = [s for s in mlp_sites(report) if s.module.endswith("down_proj")]
    assert len(downs) == 2 and all("tiled_mlp needs share_lora_input on" in s.detail for s in downs), str(report)


@pytest.mark.parametrize("value", [0, -4, 2.5, "yes", {"rows": 8, "recompute": "no"}, {"blocks": 8}])
def test_bad_values_are_refused(value):
    model = torch.nn.Linear(4, 4)
    # The ValueError reaches the caller inside Dynamo's BackendCompilerFailed.
    with pytest.raises(Exception, match="tiled_mlp must be True, False, a positive number of rows per block or"):
        torch.compile(model, backend="sloth", options={"tiled_mlp": value})(torch.randn(2, 4))
