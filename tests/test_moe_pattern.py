"""The MoE experts family (``moe_route``): routed experts, whatever code ran them, become ``sloth.moe_experts``;
loss and every gradient equal eager's; the variants the op does not compute stay, with the reason. The routers
of these models are checked here too (``moe_router``: one per layer, in the model's form); the router family's
own forms and refusals are in tests/test_moe_router_pattern.py."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

import sloth
from sloth.compiler.options import parse_options
from tests.pattern_checks import seeded
from tests.test_models import VOCAB, assert_model_close, loss_and_grads, tiny_config

# MoE model types whose experts are transformers 5.x stacked [E, 2I, H] / [E, H, I] parameters: Qwen2-MoE adds
# a sigmoid-gated shared expert outside the routed ones, Mixtral and MiniMax renormalise the top-k, OLMoE and
# Granite-MoE have their own routers.
MOE_TYPES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "minimax", "granitemoe"]
# Their routers' form, as the moe_router family reports it (patterns/moe_router.py).
ROUTER_FORMS = {"qwen3_moe": "softmax, top-2, 4", "qwen2_moe": "softmax, top-2, 4", "olmoe": "softmax, top-2, 4",
                "mixtral": "softmax, top-2, renormalised, 4", "minimax": "softmax, top-2, renormalised, 4",
                "granitemoe": "top-2, softmax over the k, 4", "gpt_oss": "top-2, softmax over the k, 4"}


def moe_model(model_type: str, experts: str, dtype: torch.dtype = torch.float32, **config) -> nn.Module:
    """A tiny MoE model: 4 experts, top-2, width 16, every layer sparse, experts run by ``experts``; ``config``
    sets more of its config's attributes."""
    cfg = tiny_config(model_type)
    for key, value in dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]).items():
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    for key, value in config.items():
        setattr(cfg, key, value)
    if model_type == "gpt_oss":
        cfg._attn_implementation = "eager"  # GPT-OSS has no SDPA path (sinks)
    cfg._experts_implementation = experts
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def _lora_on_experts(model: nn.Module, experts: str, first: str) -> nn.Module:
    """``model`` with peft LoRA r=4 on q_proj and on the stacked expert weights ``{experts}.{first}`` and
    ``{experts}.down_proj`` (``target_parameters``); B random, so that every A gets a nonzero gradient too."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                             target_parameters=[f"{experts}.{first}", f"{experts}.down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=seeded(5))
    return model


def _assert_every_expert_adapter_trains(ours: tuple, eager: tuple, count: int) -> None:
    """``count`` expert adapter factors, each with a nonzero gradient through sloth and eagerly."""
    adapters = [n for n in eager[1] if "experts" in n and "lora_" in n]
    assert len(adapters) == count, adapters
    for name in adapters:
        assert ours[1][name].abs().max() > 0 and eager[1][name].abs().max() > 0, name


def _compare(model: nn.Module, dtype: torch.dtype, **options) -> tuple:
    """(sloth's, eager's, fp64 eager's) loss and gradients, and sloth's report (sloth given ``options`` too); the
    fp64 reference runs transformers' eager expert loop (grouped_mm has no float64 kernel)."""
    ids = torch.randint(3, VOCAB, (2, 11), generator=seeded(1))
    sloth.reset_report()
    ours = loss_and_grads(model, ids, torch.compile(model, backend="sloth", options={"inner": "aot_eager", **options}))
    report = sloth.report()
    eager = loss_and_grads(model, ids)
    experts = model.config._experts_implementation
    model.config._experts_implementation = "eager"
    reference = loss_and_grads(model.double(), ids)
    model.to(dtype)
    model.config._experts_implementation = experts
    return ours, eager, reference, report


@pytest.mark.parametrize("model_type, experts", [(t, "grouped_mm") for t in MOE_TYPES]
                         + [("qwen3_moe", "batched_mm"), ("mixtral", "batched_mm")])
def test_transformers_moe_experts_are_fused(model_type: str, experts: str) -> None:
    model = moe_model(model_type, experts)
    ours, eager, reference, report = _compare(model, torch.float32)
    assert report.counts.get("moe_route") == model.config.num_hidden_layers, str(report)
    assert not [r for r in report.rejections if r.family == "moe_route"], str(report)
    assert all("experts, top-2, silu" in s.detail for s in report.sites if s.family == "moe_route")
    routers = [s.detail for s in report.sites if s.family == "moe_router"]  # the router before them too
    assert len(routers) == model.config.num_hidden_layers and all(ROUTER_FORMS[model_type] in d for d in routers), \
        str(report)
    assert any("experts.gate_up_proj" in name for name in ours[1])
    assert_model_close(ours, eager, reference, torch.float32)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_top_1_routing_is_fused(model_type: str) -> None:
    # K = 1: no sum over k marks the experts' output, and the tokens gathered in expert order have x's shape; the
    # probes choose among the candidates. Every layer fused, loss and gradients eager's.
    model = moe_model(model_type, "grouped_mm")
    model.config.num_experts_per_tok = 1
    for module in model.modules():
        for name in ("top_k", "num_experts_per_tok"):
            if isinstance(getattr(module, name, None), int):
                setattr(module, name, 1)
    ours, eager, reference, report = _compare(model, torch.float32)
    assert report.counts.get("moe_route") == model.config.num_hidden_layers, str(report)
    assert all("experts, top-1, silu" in s.detail for s in report.sites if s.family == "moe_route"), str(report)
    assert_model_close(ours, eager, reference, torch.float32)


def test_transformers_moe_bf16() -> None:
    model = moe_model("qwen3_moe", "grouped_mm", torch.bfloat16)
    ours, eager, reference, report = _compare(model, torch.bfloat16)
    assert report.counts.get("moe_route") == model.config.num_hidden_layers, str(report)
    assert report.counts.get("moe_router") == model.config.num_hidden_layers, str(report)
    assert_model_close(ours, eager, reference, torch.bfloat16)


def test_frozen_experts_get_no_gradient() -> None:
    # LoRA on attention only leaves the experts frozen: they get no gradient (and the op forms none), the router
    # and everything else theirs, equal to eager's.
    model = moe_model("qwen3_moe", "grouped_mm")
    for name, p in model.named_parameters():
        p.requires_grad_("experts" not in name)
    ours, eager, reference, report = _compare(model, torch.float32)
    assert report.counts.get("moe_route") == model.config.num_hidden_layers, str(report)
    assert not [n for n in ours[1] if "experts" in n] and any("mlp.gate" in n for n in ours[1])
    assert_model_close(ours, eager, reference, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_recompute_option(dtype) -> None:
    # options={"moe_recompute": True}: every layer's op recomputes its first GEMM in the backward (the report
    # says so; tests/test_moe_op.py checks that the op then keeps no gu); loss and gradients eager's.
    model = moe_model("qwen3_moe", "grouped_mm", dtype)
    ours, eager, reference, report = _compare(model, dtype, moe_recompute=True)
    sites = [s.detail for s in report.sites if s.family == "moe_route"]
    assert len(sites) == model.config.num_hidden_layers and all("recomputed in backward" in d for d in sites), \
        str(report)
    assert_model_close(ours, eager, reference, dtype)
    with pytest.raises(ValueError, match="moe_recompute must be True or False"):
        parse_options({"moe_recompute": "yes"})


def _scale_gpt_oss_experts(model: nn.Module, factor: float) -> None:
    """Widen GPT-OSS's gate/up weights so the tiny model's pre-activations pass the clamp at 7 (at init they stay
    near 0, where the clamped GLU and a plain one agree) and give the biases values to learn from."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts.gate_up_proj" in name and not name.endswith("bias"):
                p.mul_(factor)
            elif "experts" in name and name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=seeded(9)).to(p.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("frozen", [False, True], ids=["experts-train", "experts-frozen"])
def test_gpt_oss_experts_are_fused(dtype, frozen) -> None:
    # GPT-OSS: transposed [E, H, 2I] / [E, I, H] weights, gate/up interleaved, biases on both GEMMs (the down one
    # added in place), the clamped GLU (alpha 1.702, limit 7, up + 1). With frozen experts (LoRA on attention)
    # neither weights nor biases get a gradient; x and the router theirs.
    model = moe_model("gpt_oss", "grouped_mm", dtype)
    _scale_gpt_oss_experts(model, 40.0)
    if frozen:
        for name, p in model.named_parameters():
            p.requires_grad_("experts" not in name)
    ours, eager, reference, report = _compare(model, dtype)
    assert report.counts.get("moe_route") == model.config.num_hidden_layers, str(report)
    assert not [r for r in report.rejections if r.family in ("moe_route", "moe_router")], str(report)
    assert report.counts.get("moe_router") == model.config.num_hidden_layers, str(report)
    assert all("swiglu_oai (alpha 1.702, limit 7), interleaved gate/up, biases, transposed weights" in s.detail
               for s in report.sites if s.family == "moe_route"), str(report)
    trained = [n for n in ours[1] if "experts" in n]
    assert (not trained) if frozen else any(n.endswith("experts.down_proj_bias") for n in trained), trained
    assert_model_close(ours, eager, reference, dtype)


class HandWrittenMoe(nn.Module):
    """An MoE block written unlike any transformers class: softmax over the top-k logits, one gathered weight per
    assignment through ``bmm``, gate and up split with ``split``, GELU (tanh), and ``index_add_`` back to the
    tokens. ``offset`` adds a constant to ``up`` (GPT-OSS's ``(up + 1)``), ``clamp`` caps the gate (GPT-OSS's
    limit 7, which unit-sized inputs never reach): other functions, which must stay."""

    def __init__(self, hidden: int = 24, inter: int = 12, experts: int = 5, top_k: int = 2, offset: float = 0.0,
                 clamp: float = 0.0):
        super().__init__()
        g = seeded(3)
        self.router = nn.Parameter(torch.randn(experts, hidden, generator=g) / hidden ** 0.5)
        self.w_in = nn.Parameter(torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5)
        self.top_k, self.inter, self.offset, self.clamp = top_k, inter, offset, clamp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, chosen = torch.topk(F.linear(x, self.router), self.top_k, dim=-1)
        weights = logits.softmax(-1)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        expert = chosen.flatten()
        gu = torch.bmm(self.w_in[expert], x[token].unsqueeze(-1)).squeeze(-1)
        gate, up = gu.split(self.inter, dim=-1)
        if self.clamp:
            gate = gate.clamp(max=self.clamp)
        h = F.gelu(gate, approximate="tanh") * (up + self.offset)
        y = torch.bmm(self.w_out[expert], h.unsqueeze(-1)).squeeze(-1) * weights.flatten()[:, None]
        return torch.zeros_like(x).index_add_(0, token, y) + x


def _hand_written_grads(module: nn.Module, x: torch.Tensor, run=None) -> tuple:
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = (module if run is None else run)(x)
    out.pow(2).mean().backward()
    # Copies: a caller may change the module's dtype after (``.double()`` converts the .grad it holds in place).
    return out.detach(), {"x": x.grad, **{n: None if p.grad is None else p.grad.clone()
                                         for n, p in module.named_parameters()}}


def _hand_written_through_sloth(module: nn.Module, x: torch.Tensor) -> tuple:
    """(sloth's output and gradients, sloth's report), after checking them against eager's and fp64's by the
    tolerance rule: max error at most 2x eager's, plus 1e-6 of the reference's size."""
    sloth.reset_report()
    ours = _hand_written_grads(module, x, torch.compile(module, backend="sloth", options={"inner": "aot_eager"}))
    report = sloth.report()
    eager = _hand_written_grads(module, x)
    reference = _hand_written_grads(module.double(), x.double())
    module.float()
    for name in eager[1]:
        err, eager_err = ((ours[1][name] - reference[1][name]).abs().max(),
                          (eager[1][name] - reference[1][name]).abs().max())
        assert err <= 2 * eager_err + 1e-6 * reference[1][name].abs().max(), (name, err, eager_err)
    assert (ours[0] - reference[0]).abs().max() <= 2 * (eager[0] - reference[0]).abs().max() + 1e-6
    return ours, report


@pytest.mark.parametrize("top_k", [2, 1])
def test_hand_written_moe_is_fused(top_k: int) -> None:
    _, report = _hand_written_through_sloth(HandWrittenMoe(top_k=top_k), torch.randn(13, 24, generator=seeded(4)))
    assert report.counts.get("moe_route") == 1 and report.counts.get("moe_router") == 1, str(report)
    assert f"5 experts, top-{top_k}, gelu_tanh" in next(s.detail for s in report.sites if s.family == "moe_route")


class HandWrittenClampedMoe(nn.Module):
    """GPT-OSS's expert math (``style="oai"``; ``"silu"``: DeepSeek-V4's, the clamps around a plain SwiGLU) written
    unlike transformers: weights stored [E, H, 2I], gathered per assignment and applied by ``@`` on row vectors
    (the first GEMM by ``einsum`` in the silu style), gate and up interleaved and split by
    ``unflatten(-1, (I, 2)).unbind(-1)``, the clamps as ``clip`` and ``clamp_max``, the constant on the left of the
    sigmoid's product, biases added out of place, and the tokens' sum by ``scatter_add`` over a flattened index."""

    def __init__(self, hidden: int = 24, inter: int = 12, experts: int = 5, top_k: int = 2, limit: float = 6.0,
                 alpha: float = 1.5, style: str = "oai"):
        super().__init__()
        g = seeded(11)
        self.router = nn.Parameter(torch.randn(experts, hidden, generator=g) / hidden ** 0.5)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, 2 * inter, generator=g) * 3 / hidden ** 0.5)
        self.b_in = nn.Parameter(torch.randn(experts, 2 * inter, generator=g))
        self.w_out = nn.Parameter(torch.randn(experts, inter, hidden, generator=g) / inter ** 0.5)
        self.b_out = nn.Parameter(torch.randn(experts, hidden, generator=g) * 0.5)
        self.top_k, self.inter, self.limit, self.alpha, self.style = top_k, inter, limit, alpha, style

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = F.linear(x, self.router).softmax(-1)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        expert = chosen.reshape(-1)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        if self.style == "silu":  # the first GEMM by einsum
            gu = torch.einsum("sh,shn->sn", x[token], self.w_in[expert]) + self.b_in[expert]
        else:
            gu = (x[token].unsqueeze(1) @ self.w_in[expert]).squeeze(1) + self.b_in[expert]
        gate, up = gu.unflatten(-1, (self.inter, 2)).unbind(-1)
        gate, up = torch.clamp_max(gate, self.limit), up.clip(-self.limit, self.limit)
        if self.style == "oai":  # GPT-OSS's
            h = gate * torch.sigmoid(self.alpha * gate) * (1 + up)
        else:  # DeepSeek-V4's: the clamps around a plain SwiGLU
            h = F.silu(gate) * up
        y = ((h.unsqueeze(1) @ self.w_out[expert]).squeeze(1) + self.b_out[expert]) * weights.reshape(-1, 1)
        return torch.zeros_like(x).scatter_add(0, token[:, None].expand_as(y), y) + x


@pytest.mark.parametrize("style, expected", [
    ("oai", "swiglu_oai (alpha 1.5, limit 6), interleaved gate/up, biases, transposed weights"),
    ("silu", "silu_clamped (limit 6), interleaved gate/up, biases, transposed weights")])
def test_hand_written_clamped_moe_is_fused(style, expected) -> None:
    ours, report = _hand_written_through_sloth(HandWrittenClampedMoe(style=style),
                                               torch.randn(13, 24, generator=seeded(12)))
    assert report.counts.get("moe_route") == 1, str(report)
    detail = next(s.detail for s in report.sites if s.family == "moe_route")
    assert expected in detail, detail
    assert set(ours[1]) == {"x", "router", "w_in", "b_in", "w_out", "b_out"}


@pytest.mark.parametrize("variant", [{"offset": 1.0}, {"clamp": 7.0}], ids=["offset", "clamp"])
def test_offset_or_clamped_glu_stays_with_reason(variant) -> None:
    module = HandWrittenMoe(**variant)
    x = torch.randn(13, 24, generator=seeded(4))
    sloth.reset_report()
    compiled = torch.compile(module, backend="sloth", options={"inner": "aot_eager"})
    torch.testing.assert_close(compiled(x), module(x))
    report = sloth.report()
    [reason] = [r.reason for r in report.rejections if r.family == "moe_route"]
    assert report.counts.get("moe_route", 0) == 0 and "not sum_k w * down(act(gate x) * up x)" in reason, reason


# NemotronH (transformers 5.25), a hybrid Mamba model with ungated relu2 experts (up_proj [E, I, H], has_gate=False):
# a Mamba layer, an MoE layer, an attention layer and a second MoE layer, the Mamba mixer and the shared expert
# shrunk (their defaults are 8192 and 7688 wide); one group for its grouped router.
NEMOTRON_H = dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"], mamba_num_heads=4,
                  mamba_head_dim=16, n_groups=1, ssm_state_size=8, moe_shared_expert_intermediate_size=32, n_group=1,
                  topk_group=1)


@pytest.mark.parametrize("experts,dtype", [("grouped_mm", torch.float32), ("batched_mm", torch.float32),
                                           ("grouped_mm", torch.bfloat16)],
                         ids=["grouped_mm-fp32", "batched_mm-fp32", "grouped_mm-bf16"])
def test_nemotron_h_ungated_experts_are_fused(experts, dtype) -> None:
    model = moe_model("nemotron_h", experts, dtype, **NEMOTRON_H)
    assert model.config.mlp_hidden_act == "relu2" and not any("gate_up" in n for n, _ in model.named_parameters())
    ours, eager, reference, report = _compare(model, dtype)
    moe_layers = model.config.layers_block_type.count("moe")
    assert moe_layers == 2 and report.counts.get("moe_route") == moe_layers, str(report)
    assert not [r for r in report.rejections if r.family == "moe_route"], str(report)
    details = [s.detail for s in report.sites if s.family == "moe_route"]
    assert all(d.startswith("4 experts, top-2, relu2, ungated, ") for d in details), details
    assert sum(n.endswith(("experts.up_proj", "experts.down_proj")) for n in ours[1]) == 2 * moe_layers
    assert_model_close(ours, eager, reference, dtype)


def test_nemotron_h_peft_lora_on_ungated_experts() -> None:
    # peft's target_parameters on the ungated stacks (up_proj [E, I, H], down_proj): the op takes the factors, every
    # expert adapter trains (B starts random so A's gradient is not zero), within the rule of eager's.
    model = _lora_on_experts(moe_model("nemotron_h", "grouped_mm", **NEMOTRON_H), "mixer.experts", "up_proj")
    ours, eager, reference, report = _compare(model, torch.float32)
    assert report.counts.get("moe_route") == 2, str(report)
    assert not [r for r in report.rejections if r.family == "moe_route"], str(report)
    assert all("relu2, ungated, LoRA r=4 on up and down (its products inside the op, no merged weight)" in s.detail
               for s in report.sites if s.family == "moe_route"), str(report)
    _assert_every_expert_adapter_trains(ours, eager, 8)  # A and B of up and down, two MoE layers
    assert_model_close(ours, eager, reference, torch.float32)


# Ergo (transformers 5.25): ungated relu2 experts stored transposed ([E, H, I], [E, I, H]) and called with one route
# a row and unit weights; each route's output goes through its expert's RMSNorm before the weighted sum over k.
# A dense first layer, two sparse ones; the shared expert shrunk (8192 wide by default).
ERGO = dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"], shared_intermediate_size=32)


@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm"])
def test_ergo_experts_are_fused_inside_their_per_route_norm(experts) -> None:
    # The sum over k reads the post-expert norm (refused); the experts' own call, top-1 with unit weights, is fused,
    # and the norm, the router weighting and the sum stay around it.
    from transformers import CONFIG_MAPPING

    if "ergo" not in CONFIG_MAPPING:
        pytest.skip("transformers has no ergo in this version")
    model = moe_model("ergo", experts, **ERGO)
    ours, eager, reference, report = _compare(model, torch.float32)
    assert report.counts.get("moe_route") == 2, str(report)
    assert not [r for r in report.rejections if r.family == "moe_route"], str(report)
    assert all(s.detail == "4 experts, top-1, relu2, ungated, transposed weights, float32"
               for s in report.sites if s.family == "moe_route"), str(report)
    assert sum(n.endswith(("experts.up_proj", "experts.down_proj", "post_expert_norm.weight")) for n in ours[1]) == 6
    assert_model_close(ours, eager, reference, torch.float32)


class HandWrittenUngatedMoe(nn.Module):
    """Ungated experts written unlike transformers: sigmoid router renormalised over the top-k, weights stored
    transposed ([E, H, I] and [E, I, H], applied to row vectors), the up GEMM by ``einsum`` on gathered weights, the
    down GEMM by ``bmm``, the tokens' sum by ``index_add_``. ``act``: ``"relu2"`` as ``F.relu(u) ** 2``,
    ``"silu"`` written out as ``u * sigmoid(u)``; near-misses the op must not take: ``"relu"`` (an activation it
    lacks) and ``"relu2+1"`` (``relu(u)^2 + 1``, an offset)."""

    def __init__(self, hidden: int = 24, inter: int = 12, experts: int = 5, top_k: int = 2, act: str = "relu2"):
        super().__init__()
        g = seeded(21)
        self.router = nn.Parameter(torch.randn(experts, hidden, generator=g) / hidden ** 0.5)
        self.w_up = nn.Parameter(torch.randn(experts, hidden, inter, generator=g) * 2 / hidden ** 0.5)
        self.w_down = nn.Parameter(torch.randn(experts, inter, hidden, generator=g) / inter ** 0.5)
        self.top_k, self.act = top_k, act

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each assignment's token, its expert, the router weights [T, K]): sigmoid scores, top-k, renormalised."""
        scores = torch.sigmoid(x @ self.router.t())
        weights, chosen = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        return token, chosen.reshape(-1), weights

    def _down_and_sum(self, x: torch.Tensor, h: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
        """The down GEMM on gathered weights, weighted, summed back to the tokens by index_add_, plus x."""
        y = torch.bmm(h.unsqueeze(1), self.w_down[expert]).squeeze(1) * weights.reshape(-1, 1)
        return torch.zeros_like(x).index_add_(0, token, y) + x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        token, expert, weights = self._route(x)
        u = torch.einsum("sh,shi->si", x[token], self.w_up[expert])
        if self.act == "silu":
            h = u * torch.sigmoid(u)
        elif self.act == "relu":
            h = F.relu(u)
        else:
            h = F.relu(u) ** 2 + (1.0 if self.act == "relu2+1" else 0.0)
        return self._down_and_sum(x, h, token, expert, weights)


@pytest.mark.parametrize("act,inter", [("relu2", 12), ("relu2", 24), ("silu", 12)],
                         ids=["relu2", "relu2-square", "silu-by-hand"])
def test_hand_written_ungated_moe_is_fused(act, inter) -> None:
    # inter = hidden = 24: both ungated layouts fit the square weights; the probes pick the transposed one
    ours, report = _hand_written_through_sloth(HandWrittenUngatedMoe(inter=inter, act=act),
                                               torch.randn(13, 24, generator=seeded(22)))
    assert report.counts.get("moe_route") == 1, str(report)
    detail = next(s.detail for s in report.sites if s.family == "moe_route")
    assert f"5 experts, top-2, {act}, ungated, transposed weights, float32" == detail, detail
    assert set(ours[1]) == {"x", "router", "w_up", "w_down"}


@pytest.mark.parametrize("act", ["relu", "relu2+1"])
def test_ungated_near_miss_stays_with_reason(act) -> None:
    module = HandWrittenUngatedMoe(act=act)
    x = torch.randn(13, 24, generator=seeded(22))
    sloth.reset_report()
    compiled = torch.compile(module, backend="sloth", options={"inner": "aot_eager"})
    torch.testing.assert_close(compiled(x), module(x))
    report = sloth.report()
    [reason] = [r.reason for r in report.rejections if r.family == "moe_route"]
    assert report.counts.get("moe_route", 0) == 0, str(report)
    assert "it is not sum_k w * down(act(up x)) for any activation of ungated experts" in reason, reason


def test_experts_the_fallback_cannot_hold_stay_with_reason(monkeypatch) -> None:
    # Where neither torch._grouped_mm nor the Triton grouped GEMM runs (the CPU without Triton's interpreter, widths
    # not a multiple of 16 bytes), the op's fallback gathers one expert weight per row; past REFERENCE_BYTES the site
    # stays, saying why.
    from sloth.lowering import moe as lowering_moe
    from sloth.patterns import moe as pattern_moe

    monkeypatch.setattr(lowering_moe, "gemm_runs", lambda *args: False)
    monkeypatch.setattr(pattern_moe, "REFERENCE_BYTES", 0)
    module = HandWrittenMoe()
    x = torch.randn(13, 24, generator=seeded(4))
    sloth.reset_report()
    torch.testing.assert_close(torch.compile(module, backend="sloth", options={"inner": "aot_eager"})(x), module(x))
    [reason] = [r.reason for r in sloth.report().rejections if r.family == "moe_route"]
    assert "neither torch._grouped_mm nor sloth's Triton grouped GEMM runs" in reason, reason
    assert "GiB of expert weights" in reason, reason


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_an_op_that_cannot_run_on_the_fakes_leaves_the_experts_with_reason(model_type, monkeypatch) -> None:
    # Seen when the op was registered as a triton_op (since removed): its value could not be computed on the graph's
    # fakes, and the pass then failed on it (an AttributeError out of the backend). Now the graph stays as it was
    # (GPT-OSS's transposed weight views, inserted for the op, removed again) and the report says why.
    from sloth.patterns import moe as pattern_moe

    real = pattern_moe.insert_call

    def insert_call(graph, before, target, args, kwargs=None, **kw):
        if target is torch.ops.sloth.moe_experts.default:
            kw["value"] = None  # what compute_value gives when the op raises on fakes
        return real(graph, before, target, args, kwargs, **kw)

    monkeypatch.setattr(pattern_moe, "insert_call", insert_call)
    model = moe_model(model_type, "grouped_mm")
    ours, eager, reference, report = _compare(model, torch.float32)
    assert not report.counts.get("moe_route"), str(report)
    reasons = {r.reason for r in report.rejections if r.family == "moe_route"}
    assert reasons == {"the fused op could not be evaluated on this graph's fake values: the experts run as written"}, \
        reasons
    assert not report.unexplained.get("moe_route"), str(report)
    assert_model_close(ours, eager, reference, torch.float32)


@pytest.mark.parametrize("model_type,dtype", [("qwen3_moe", torch.float32), ("qwen3_moe", torch.bfloat16),
                                              ("gpt_oss", torch.float32), ("mixtral", torch.bfloat16)],
                         ids=["qwen3_moe-fp32", "qwen3_moe-bf16", "gpt_oss-fp32", "mixtral-bf16"])
def test_peft_lora_on_experts_is_one_graph_and_every_adapter_trains(model_type, dtype, tmp_path) -> None:
    # peft's target_parameters puts LoRA on the stacked expert weights (W + s B A, a parametrization formed each
    # step). Dynamo traces sloth's traceable form of it (compiler/integrations/peft_experts.py) in one graph, the op
    # takes the factors (no merged weight), and every expert adapter (A and B of gate_up and of down, each layer) gets a
    # nonzero gradient within the tolerance rule of eager's (B starts random here so A's gradient is not zero).
    # Unsloth's GPT-OSS LoRA once left every expert adapter frozen while saying it had enabled them: this is the
    # test that would have caught it.
    # GPT-OSS: its transposed [E, H, 2I] layout, biases and clamped GLU, the factors transposed for the op
    model = _lora_on_experts(moe_model(model_type, "grouped_mm", dtype), "mlp.experts", "gate_up_proj")
    ours, eager, reference, report = _compare(model, dtype, dump=str(tmp_path))
    assert report.graphs == 1, str(report)  # peft's own forward: 7 graph breaks a layer
    [folder] = report.dumps  # the graph before sloth's passes and after the last: the merged weights, then none
    stages = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
    before, after = ([line for line in open(os.path.join(folder, f)) if not line.lstrip().startswith("#")]
                     for f in (stages[0], stages[-1]))  # the code, not the source-line comments
    merges = lambda code: sum("= torch.baddbmm(" in line for line in code)  # noqa: E731
    assert merges(before) == 2 * model.config.num_hidden_layers and merges(after) == 0
    assert any("sloth.moe_experts" in line for line in after)
    assert report.counts.get("moe_route") == model.config.num_hidden_layers, str(report)
    assert not [r for r in report.rejections if r.family == "moe_route"], str(report)
    assert all("LoRA r=4 on gate_up and down (its products inside the op, no merged weight)" in s.detail
               for s in report.sites if s.family == "moe_route"), str(report)
    _assert_every_expert_adapter_trains(ours, eager, 4 * model.config.num_hidden_layers)  # A, B of gate_up, down
    assert_model_close(ours, eager, reference, dtype)


# Hand-written experts with per-expert LoRA factors applied beside each expert GEMM (3-D nn.Parameters, the base
# experts frozen, B random so the adapter matters and A's gradient is not zero): the op takes them as its LoRA
# arguments (patterns/moe_adapters.py), the products as grouped GEMMs at rank r.
class GatheredLoraMoe(nn.Module):
    """Rows gathered per assignment, every GEMM a ``bmm`` on gathered weights (W_in [E, 2I, H], W_out [E, H, I]),
    factors stored like peft's (A [E, r, k], B [E, n, r]) and applied to column vectors, dropout (off in eval) on
    the adapter's input, the scale ``alpha / r`` after gB, the down adapter added by ``+=``. ``adapt``: the GEMMs
    with an adapter; ``tensor_scale``: the scale a (frozen) tensor parameter, which the op cannot take. Factors
    in another dtype than the module's are cast to it around the adapter (``_lora``)."""

    def __init__(self, hidden: int = 24, inter: int = 12, experts: int = 5, top_k: int = 2, r: int = 4,
                 alpha: float = 8.0, adapt: tuple = ("gate_up", "down"), tensor_scale: bool = False):
        super().__init__()
        g = seeded(31)
        frozen = lambda *shape, fan_in: nn.Parameter(  # noqa: E731
            torch.randn(*shape, generator=g) / fan_in ** 0.5, requires_grad=False)
        self.router = nn.Parameter(torch.randn(experts, hidden, generator=g) / hidden ** 0.5)
        self.w_in, self.w_out = frozen(experts, 2 * inter, hidden, fan_in=hidden), frozen(experts, hidden, inter,
                                                                                         fan_in=inter)
        for name, k, n in (("in", hidden, 2 * inter), ("out", inter, hidden)):
            if ("gate_up" if name == "in" else "down") in adapt:
                setattr(self, f"a_{name}", nn.Parameter(torch.randn(experts, r, k, generator=g) / k ** 0.5))
                setattr(self, f"b_{name}", nn.Parameter(torch.randn(experts, n, r, generator=g) / r ** 0.5))
        scale = alpha / r
        self.scale = nn.Parameter(torch.tensor(scale), requires_grad=False) if tensor_scale else scale
        self.drop = nn.Dropout(0.1)
        self.top_k, self.inter, self.adapt = top_k, inter, adapt

    def _lora(self, rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        lo = torch.bmm(a[expert], self.drop(rows).to(a.dtype).unsqueeze(-1))
        return (torch.bmm(b[expert], lo).squeeze(-1) * self.scale).to(rows.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, chosen = torch.topk(F.linear(x, self.router), self.top_k, dim=-1)
        weights = logits.softmax(-1)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        expert = chosen.flatten()
        rows = x[token]
        gu = torch.bmm(self.w_in[expert], rows.unsqueeze(-1)).squeeze(-1)
        if "gate_up" in self.adapt:
            gu = gu + self._lora(rows, self.a_in, self.b_in, expert)
        gate, up = gu.split(self.inter, dim=-1)
        h = F.silu(gate) * up
        y = torch.bmm(self.w_out[expert], h.unsqueeze(-1)).squeeze(-1)
        if "down" in self.adapt:
            y += self._lora(h, self.a_out, self.b_out, expert)
        y = y * weights.flatten()[:, None]
        return torch.zeros_like(x).index_add_(0, token, y) + x


class SortedLoraMoe(nn.Module):
    """Sort-based dispatch, every GEMM ``torch._grouped_mm`` in bf16 (its only dtype under compile), else ``einsum``
    on one gathered weight a row (the float64 reference too), weights stored transposed (W_in [E, H, 2I], W_out
    [E, I, H]: ``x @ W[e]``), factors too (A [E, k, r], B [E, r, n]), the scale on the adapter's input for gate/up
    and as ``torch.add``'s alpha for down, GELU (tanh) experts. Rank 8 and width 16: torch._grouped_mm wants
    16-byte strides (bf16 rank 4 or width 12 are 8 and 24 bytes)."""

    def __init__(self, hidden: int = 24, inter: int = 16, experts: int = 5, top_k: int = 2, r: int = 8,
                 scale: float = 0.5):
        super().__init__()
        g = seeded(41)
        self.router = nn.Parameter(torch.randn(experts, hidden, generator=g) / hidden ** 0.5)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, 2 * inter, generator=g) / hidden ** 0.5,
                                 requires_grad=False)
        self.w_out = nn.Parameter(torch.randn(experts, inter, hidden, generator=g) / inter ** 0.5,
                                  requires_grad=False)
        self.a_in = nn.Parameter(torch.randn(experts, hidden, r, generator=g) / hidden ** 0.5)
        self.b_in = nn.Parameter(torch.randn(experts, r, 2 * inter, generator=g) / r ** 0.5)
        self.a_out = nn.Parameter(torch.randn(experts, inter, r, generator=g) / inter ** 0.5)
        self.b_out = nn.Parameter(torch.randn(experts, r, hidden, generator=g) / r ** 0.5)
        self.experts, self.top_k, self.scale = experts, top_k, scale

    @staticmethod
    def _gemm(rows: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if rows.dtype == torch.bfloat16:  # (torch._grouped_mm's only dtype under compile)
            return torch._grouped_mm(rows, w, offs)
        return torch.einsum("sk,skn->sn", rows, w[ids])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = F.linear(x, self.router).softmax(-1).topk(self.top_k, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        ids, token = flat[order], order // self.top_k
        offs = (flat[:, None] == torch.arange(self.experts, device=x.device)).sum(0).cumsum(0).to(torch.int32)
        rows = x[token]
        gu = self._gemm(rows, self.w_in, offs, ids) + self._gemm(
            self._gemm(rows * self.scale, self.a_in, offs, ids), self.b_in, offs, ids)
        gate, up = gu.chunk(2, dim=-1)
        h = F.gelu(gate, approximate="tanh") * up
        y = torch.add(self._gemm(h, self.w_out, offs, ids),
                      self._gemm(self._gemm(h, self.a_out, offs, ids), self.b_out, offs, ids), alpha=self.scale)
        y = y * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, y)


def _loss_and_grads(module: nn.Module, x: torch.Tensor, run=None) -> tuple:
    """(output, loss, {name: gradient}) of ``(out ** 2).mean()``: x's and each trainable parameter's."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = (module if run is None else run)(x)
    loss = out.float().pow(2).mean().to(out.dtype)
    loss.backward()
    grads = {"x": x.grad, **{n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}}
    return out.detach(), loss.detach(), grads


def _adapters_through_sloth(module: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(sloth's (loss, gradients), eager's, sloth's report) of ``module`` at ``dtype``, after checking output and
    gradients against the float64 module's by the tolerance rule (tests/tolerance.py; assert_model_close's)."""
    from tests.tolerance import assert_close

    module.to(dtype)
    x = x.to(dtype)
    sloth.reset_report()
    ours = _loss_and_grads(module, x, torch.compile(module, backend="sloth", options={"inner": "aot_eager"}))
    report = sloth.report()
    eager = _loss_and_grads(module, x)
    reference = _loss_and_grads(module.double(), x.double())
    module.to(dtype)
    assert set(ours[2]) == set(eager[2]) == set(reference[2]), (set(ours[2]), set(eager[2]))
    assert_close("out", ours[0], eager[0], reference[0],
                 atol=0.5 * torch.finfo(dtype).eps * reference[0].pow(2).mean().sqrt().item())
    assert_model_close(ours[1:], eager[1:], reference[1:], dtype)
    return ours[1:], eager[1:], report


def _assert_every_expert_factor_trains(ours: tuple, eager: tuple, names: list[str], experts: int) -> None:
    """Each factor in ``names`` has a nonzero gradient for every one of ``experts`` experts, through sloth and
    eagerly; the frozen expert weights none."""
    for name in names:
        for grads in (ours[1], eager[1]):
            assert all(grads[name][e].abs().max() > 0 for e in range(experts)), name
    assert not {"w_in", "w_out"} & set(ours[1]) and not {"w_in", "w_out"} & set(eager[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("style", ["gathered", "sorted"])
def test_adapters_beside_the_expert_gemms_are_fused(style, dtype) -> None:
    # The old pass read the factors as other inputs of the region and refused it, and paired the adapters' own
    # GEMMs as expert MLPs (three refusals); now one site, the factors the op's LoRA arguments.
    module = (GatheredLoraMoe() if style == "gathered" else SortedLoraMoe()).eval()
    ours, eager, report = _adapters_through_sloth(module, torch.randn(13, 24, generator=seeded(32)), dtype)
    assert report.counts.get("moe_route") == 1 and report.counts.get("moe_router") == 1, str(report)
    assert not [r for r in report.rejections if r.family == "moe_route"], str(report)
    detail = next(s.detail for s in report.sites if s.family == "moe_route")
    act, layout, rank = ("silu", "", 4) if style == "gathered" else ("gelu_tanh", ", transposed weights", 8)
    assert detail == (f"5 experts, top-2, {act}{layout}, LoRA r={rank} on gate_up and down (beside the expert GEMMs, "
                      f"its products inside the op), {str(dtype).replace('torch.', '')}"), detail
    _assert_every_expert_factor_trains(ours, eager, ["a_in", "b_in", "a_out", "b_out"], 5)
    assert "router" in ours[1]


def test_adapter_beside_the_first_gemm_only_is_fused() -> None:
    module = GatheredLoraMoe(adapt=("gate_up",)).eval()
    ours, eager, report = _adapters_through_sloth(module, torch.randn(13, 24, generator=seeded(33)), torch.float32)
    assert report.counts.get("moe_route") == 1, str(report)
    detail = next(s.detail for s in report.sites if s.family == "moe_route")
    assert "LoRA r=4 on gate_up (beside the expert GEMMs, its products inside the op)" in detail, detail
    _assert_every_expert_factor_trains(ours, eager, ["a_in", "b_in"], 5)


def _stays_with_reason(module: nn.Module, x: torch.Tensor) -> str:
    """The one moe_route reason of a module sloth must leave as written (its output eager's: moe_route alone, so
    that no other family's rounding differs; dropout drawn from the same seed), and no site."""
    sloth.reset_report()
    compiled = torch.compile(module, backend="sloth", options={"inner": "aot_eager", "patterns": ["moe_route"]})
    torch.manual_seed(0)
    ours = compiled(x)
    torch.manual_seed(0)
    torch.testing.assert_close(ours, module(x))
    report = sloth.report()
    assert not report.counts.get("moe_route"), str(report)
    assert not report.unexplained.get("moe_route"), str(report)
    [reason] = [r.reason for r in report.rejections if r.family == "moe_route"]
    return reason


def test_adapter_with_a_tensor_scale_stays_with_reason() -> None:
    reason = _stays_with_reason(GatheredLoraMoe(tensor_scale=True).eval(), torch.randn(13, 24, generator=seeded(34)))
    assert "an adapter applied beside the expert GEMMs: the adapter is scaled by a tensor" in reason, reason


def test_adapter_with_dropout_in_training_stays_with_reason() -> None:
    reason = _stays_with_reason(GatheredLoraMoe().train(), torch.randn(13, 24, generator=seeded(34)))
    assert "dropout (p=0.1) on the adapter is active in training" in reason, reason


class TwoAdaptersLoraMoe(GatheredLoraMoe):
    """A second adapter (its own factors, rank 2) summed beside the gate/up GEMM after the first: the op takes one
    adapter a GEMM."""

    def __init__(self):
        super().__init__()
        g = seeded(35)
        self.a_in2 = nn.Parameter(torch.randn(5, 2, 24, generator=g) / 24 ** 0.5)
        self.b_in2 = nn.Parameter(torch.randn(5, 24, 2, generator=g) / 2 ** 0.5)

    def _lora(self, rows, a, b, expert):
        out = super()._lora(rows, a, b, expert)
        return out + super()._lora(rows, self.a_in2, self.b_in2, expert) if a is self.a_in else out


def test_two_adapters_beside_one_gemm_stay_with_reason() -> None:
    # Not recognised as adapters (the sum of the two is what meets the base GEMM's result): the experts, which read
    # the factors, are reported for each GEMM pair tried, and run as written with eager's output.
    module, x = TwoAdaptersLoraMoe().eval(), torch.randn(13, 24, generator=seeded(34))
    sloth.reset_report()
    compiled = torch.compile(module, backend="sloth", options={"inner": "aot_eager", "patterns": ["moe_route"]})
    torch.testing.assert_close(compiled(x), module(x))
    report = sloth.report()
    reasons = [r.reason for r in report.rejections if r.family == "moe_route"]
    assert not report.counts.get("moe_route") and not report.unexplained.get("moe_route"), str(report)
    read_factors = "the experts also read the graph input 'L_self_parameters_a_in"
    assert reasons and all(read_factors in r for r in reasons), reasons


def test_float32_adapter_beside_bfloat16_experts_stays_with_reason() -> None:
    # Decided: refused, not fused. The op takes factors in the tokens' dtype; fusing would round the factors and
    # the adapter's products to bf16 where the code computes them in fp32 (as peft's target_parameters fold, whose
    # mixed dtypes patterns/moe.py also leaves to the op as a computed weight rather than as factors).
    module = GatheredLoraMoe().eval().to(torch.bfloat16)
    for name in ("a_in", "b_in", "a_out", "b_out"):
        getattr(module, name).data = getattr(module, name).data.float()
    reason = _stays_with_reason(module, torch.randn(13, 24, generator=seeded(34)).to(torch.bfloat16))
    assert "the adapter's factors are float32 beside bfloat16 expert weights" in reason, reason


class SomeExpertsLoraMoe(GatheredLoraMoe):
    """Factors for the first 4 of 5 experts only, the last expert's rows reading the fourth's (clamped ids): an
    adapter the op, one an expert, cannot take."""

    def __init__(self):
        super().__init__()
        for name in ("a_in", "b_in", "a_out", "b_out"):
            setattr(self, name, nn.Parameter(getattr(self, name).data[:4].clone()))

    def _lora(self, rows, a, b, expert):
        return super()._lora(rows, a, b, expert.clamp(max=a.shape[0] - 1))


def test_adapter_on_some_experts_stays_with_reason() -> None:
    reason = _stays_with_reason(SomeExpertsLoraMoe().eval(), torch.randn(13, 24, generator=seeded(34)))
    assert "the adapter's factors hold 4 and 4 experts' weights, the expert weights 5" in reason, reason


class UngatedLoraMoe(HandWrittenUngatedMoe):
    """HandWrittenUngatedMoe (relu2, weights stored transposed) with frozen experts and an adapter beside its up
    GEMM, written as ``x @ A[e] @ B[e]`` on row vectors, the scale divided on between the two factors."""

    def __init__(self, r: int = 4):
        super().__init__()
        g = seeded(51)
        hidden, inter = self.w_up.shape[1:]
        self.w_up.requires_grad_(False)
        self.w_down.requires_grad_(False)
        self.a_up = nn.Parameter(torch.randn(5, hidden, r, generator=g) / hidden ** 0.5)
        self.b_up = nn.Parameter(torch.randn(5, r, inter, generator=g) / r ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        token, expert, weights = self._route(x)
        rows = x[token].unsqueeze(1)
        u = (rows @ self.w_up[expert] + (rows @ self.a_up[expert]) / 4.0 @ self.b_up[expert]).squeeze(1)
        return self._down_and_sum(x, F.relu(u) ** 2, token, expert, weights)


def test_adapter_beside_ungated_experts_is_fused() -> None:
    ours, eager, report = _adapters_through_sloth(UngatedLoraMoe(), torch.randn(13, 24, generator=seeded(52)),
                                                  torch.float32)
    assert report.counts.get("moe_route") == 1, str(report)
    detail = next(s.detail for s in report.sites if s.family == "moe_route")
    assert detail == ("5 experts, top-2, relu2, ungated, transposed weights, LoRA r=4 on up (beside the expert GEMMs, "
                      "its products inside the op), float32"), detail
    for name in ("a_up", "b_up"):
        assert all(g[name][e].abs().max() > 0 for g in (ours[1], eager[1]) for e in range(5)), name
    assert not {"w_up", "w_down"} & set(ours[1])
