"""The op checks at the shapes of real models, on CUDA tensors: the same oracles and tolerance rule as the op tests
(tests/test_moe_op.py, test_layer_norm_op.py, test_l2_norm_op.py, test_tiled_mlp_op.py, test_sink_attention_op.py,
test_moe_router_op.py, test_moe_router_biased_op.py, test_norm_rope_op.py, test_rope_op.py), which run their own odd
shapes on the ``device`` fixture's device (CUDA on a GPU machine), at sizes the interpreter could not run; and the
GPU's own choices: the MoE op's bf16 GEMMs take ``torch._grouped_mm`` (sm90) at aligned sizes, the counting-sort
dispatch, the Qwen3-MoE layer's shape among them. Skipped, with that reason, where there is no GPU. The model-sized
cases run alone in the GPU lane (benchmarks/gpu_lane.py's SERIAL).
"""
from __future__ import annotations

import pytest
import torch

import test_l2_norm_op as l2_tests
import test_layer_norm_op as ln_tests
import test_moe_op as moe_tests
import test_moe_router_op as router_tests
import test_moe_router_biased_op as biased_router_tests
import test_norm_rope_op as norm_rope_tests
import test_rope_op as rope_tests
import test_sink_attention_op as sink_tests
import test_tiled_mlp_op as tiled_tests
from op_checks import record_launches
import sloth.lowering.moe as moe
from sloth.lowering.norm_rope import norm_rope
from sloth.lowering.rope import rope

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the kernels run in the "
                                "interpreter in the CPU tests instead")
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _cuda(tensors):
    return [t.cuda() for t in tensors]


# Qwen3-MoE's layer (1024 tokens) in bf16: torch._grouped_mm with the tokens read through the order in the Triton
# grouped GEMM ("mixed"), or Triton's throughout ("triton"); the unaligned bf16 shape runs Triton's either way. fp32
# keeps the reference GEMM unless "triton" is forced (lowering/moe.py's _triton_gemm_runs says why: at 512 tokens of
# this layer's widths its router-weight gradient was 2.9x eager's error on an H100).
@pytest.mark.parametrize("gemm", ["auto", "triton"])
@pytest.mark.parametrize("T,H,I,E,K,unused,dtype", [
    pytest.param(13, 24, 20, 5, 2, (3,), torch.float32, id="odd-fp32"),  # fp32: the reference unless forced
    pytest.param(13, 24, 20, 5, 2, (3,), torch.bfloat16, id="odd-bf16"),  # unaligned: Triton's grouped GEMM
    pytest.param(300, 256, 96, 16, 4, (5,), torch.float16, id="aligned-fp16"),  # _grouped_mm takes no fp16
    pytest.param(300, 256, 96, 16, 4, (5,), torch.float32, id="aligned-fp32"),
    pytest.param(300, 256, 96, 16, 4, (5,), torch.bfloat16, id="aligned-bf16"),  # _grouped_mm in bf16
    pytest.param(1024, 2048, 768, 128, 8, (), torch.bfloat16, id="qwen3-moe-bf16")])
def test_moe_experts_on_cuda(T, H, I, E, K, unused, dtype, gemm, monkeypatch):
    monkeypatch.setattr(moe, "GEMM_CHOICE", gemm)
    masters = _cuda(moe_tests.make_inputs(T, H, I, E, K, unused_experts=unused))
    runs = moe.grouped_mm_runs(masters[0].device, dtype, H, I)  # sm90, bf16, 16-byte rows
    few_rows = T * K <= moe.GATHER_ROWS_PER_EXPERT * E
    triton = "triton" if dtype != torch.float32 or gemm == "triton" else "reference"
    expected = ("mixed" if few_rows else "grouped_mm") if gemm == "auto" and runs else triton
    plan = moe._grouped_mm_plan(masters[0].to(dtype), masters[3].to(dtype), masters[4].to(dtype), (), T * K)
    assert plan == expected
    moe_tests.check_against_pattern(masters, dtype, "silu")
    moe_tests.check_against_pattern(masters, dtype, "gelu_tanh", frozen=True)


# The counting-sort dispatch (lowering/moe_routing.py) and the backward's invert_order compiled for the GPU, value for
# value against the stable sort:
# Qwen3-MoE's step (2 x 2048 tokens of top-8 over 128 experts: 128 blocks), the largest it takes there (MAX_BLOCKS
# blocks), DeepSeek-V3's 256 experts, GPT-OSS's 32 of top-4, and every token to one expert.
@pytest.mark.parametrize("tokens,top_k,n_experts,one_expert", [
    (4096, 8, 128, False), (8192, 8, 128, False), (4096, 8, 256, False), (4096, 4, 32, False), (777, 2, 8, False),
    (4096, 8, 128, True)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_moe_routing_on_cuda(tokens, top_k, n_experts, one_expert, dtype, monkeypatch):
    import sloth.lowering.moe_routing as moe_routing

    launched = record_launches(monkeypatch, moe_routing, "_route_counts_kernel", "_route_scatter_kernel",
                               "_invert_order_kernel")
    g = torch.Generator(device="cuda").manual_seed(tokens + n_experts)
    index = torch.full((tokens, top_k), 7, dtype=dtype, device="cuda") if one_expert else \
        torch.randint(0, n_experts, (tokens, top_k), generator=g, dtype=dtype, device="cuda")
    got, want = moe_routing.route(index, n_experts), moe_routing.route_reference(index, n_experts)
    for name, a, b in zip(moe_routing.Routing._fields, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    inverse, token = moe_routing.invert_order(got.order, top_k)  # the backward's
    assert torch.equal(inverse, want.inverse) and torch.equal(token, want.token)
    assert len(launched) == 3  # the kernels, not the fallbacks


# Ungated experts (NemotronH's relu2, silu), their GATED=False kernels compiled for the GPU; the last at the shape of
# Nemotron-3-Nano-30B-A3B's experts (hidden 2688, width 1856, 128 experts, top-6) over 1024 tokens.
@pytest.mark.parametrize("T,H,I,E,K,unused,dtype", [
    pytest.param(13, 24, 20, 5, 2, (3,), torch.float32, id="odd-fp32"),
    pytest.param(13, 24, 20, 5, 2, (3,), torch.bfloat16, id="odd-bf16"),
    pytest.param(300, 256, 96, 16, 4, (5,), torch.bfloat16, id="aligned-bf16"),
    pytest.param(1024, 2688, 1856, 128, 6, (), torch.bfloat16, id="nemotron-nano-bf16")])
def test_moe_ungated_on_cuda(T, H, I, E, K, unused, dtype):
    masters = _cuda(moe_tests.make_inputs(T, H, I, E, K, unused_experts=unused, gated=False))
    moe_tests.check_against_pattern(masters, dtype, "relu2", gated=False)
    moe_tests.check_against_pattern(masters, dtype, "silu", frozen=True, gated=False)


@pytest.mark.parametrize("T,H,I,E,K,unused,dtype", [
    pytest.param(13, 24, 20, 5, 2, (3,), torch.float32, id="odd-fp32"),
    pytest.param(13, 24, 20, 5, 2, (3,), torch.bfloat16, id="odd-bf16"),
    pytest.param(300, 256, 96, 16, 4, (5,), torch.bfloat16, id="aligned-bf16"),
    pytest.param(1024, 2880, 2880, 32, 4, (), torch.bfloat16, id="gpt-oss-20b-bf16")])  # GPT-OSS-20B's experts
def test_moe_gpt_oss_on_cuda(T, H, I, E, K, unused, dtype):
    # GPT-OSS's variant (biases, interleaved gate/up, the clamped GLU), its two kernels compiled for the GPU
    masters = list(_cuda(moe_tests.make_inputs(T, H, I, E, K, seed=5, unused_experts=unused)))
    masters[3] = masters[3] * 6  # pre-activations past the clamp at 7
    g = torch.Generator().manual_seed(6)
    biases = _cuda([torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g) * 0.5])
    moe_tests.check_variant(masters, biases, dtype, "swiglu_oai", True)
    moe_tests.check_variant(masters, biases, dtype, "swiglu_oai", True, frozen=True)


@pytest.mark.parametrize("T,H,I,E,K,r,dtype", [
    pytest.param(13, 24, 20, 5, 2, 3, torch.float32, id="odd-fp32"),
    pytest.param(13, 24, 20, 5, 2, 3, torch.bfloat16, id="odd-bf16"),
    pytest.param(300, 256, 96, 16, 4, 16, torch.bfloat16, id="aligned-bf16"),
    pytest.param(1024, 2048, 768, 128, 8, 16, torch.bfloat16, id="qwen3-moe-r16-bf16")])
@pytest.mark.parametrize("gemm", ["auto", "mixed"])
def test_moe_lora_on_cuda(T, H, I, E, K, r, dtype, gemm, monkeypatch):
    # LoRA on both expert GEMMs (peft's target_parameters), the adapters' grouped products on the GPU, base frozen;
    # "mixed" reads the tokens through the order in Triton's GEMM for the base's and the adapters' gathered products
    # (the default since 2026-12-06 where the experts average few rows: "auto" takes it at the aligned shapes)
    monkeypatch.setattr(moe, "GEMM_CHOICE", gemm)
    masters = _cuda(moe_tests.make_inputs(T, H, I, E, K))
    adapters = _cuda(moe_tests.make_adapters(E, H, I, r, permuted=True))
    if dtype == torch.bfloat16 and moe.grouped_mm_runs(masters[0].device, dtype, H, I) and r == 16:
        factors = tuple(f.to(dtype).contiguous() for f in adapters)
        plan = moe._grouped_mm_plan(masters[0].to(dtype), masters[3].to(dtype), masters[4].to(dtype), factors, T * K)
        assert plan == "mixed"
    moe_tests.check_lora(masters, adapters, dtype)


# GPT-OSS-20B's attention (64 query heads over 8, head_dim 64) at 1024 tokens: a sliding layer (window 128) and a
# full one.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64, 8, 64, 1024, 128), (2, 64, 8, 64, 1024, 1024)],
                         ids=["gpt-oss-window-128", "gpt-oss-full"])
def test_sink_attention_on_cuda(shape, dtype):
    sink_tests.check(shape, dtype, device="cuda", name=str(shape))


# Qwen3-MoE's router over a bs 2 x 2048 step's 4096 tokens.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(router_tests.MODES))
@pytest.mark.parametrize("case", [(4096, 128, 8)], ids=["qwen3-moe-4096"])
def test_moe_router_on_cuda(case, mode, dtype):
    router_tests.check(case, router_tests.MODES[mode], dtype, device="cuda")


# DeepSeek-V3's grouped router (256 experts, 8 groups, top-4 groups, top-8) over 4096 tokens.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", list(biased_router_tests.FORMS))
@pytest.mark.parametrize("case", [(4096, 256, 8, 8, 4)], ids=["deepseek-v3-4096"])
def test_moe_router_biased_on_cuda(case, form, dtype):
    biased_router_tests.check(case, biased_router_tests.FORMS[form], dtype, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4096, 2048)], ids=["4096x2048"])
def test_layer_norm_on_cuda(shape, dtype):
    x, w, b, dy = _cuda(ln_tests.make_inputs(shape, shift=0.5))
    for style in ("wb", "w", "none"):
        ln_tests.check(style, x, w, b, dy, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4096, 128)], ids=["4096x128"])
def test_l2_norm_on_cuda(shape, dtype):
    x, dy = _cuda(l2_tests.make_inputs(shape))
    for mode in l2_tests.MODES:
        l2_tests.check(mode, x, dy, dtype, eps=1e-6)


@pytest.mark.parametrize("dtype,adapter_dtype", tiled_tests.DTYPE_PAIRS)
@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
@pytest.mark.parametrize("rows,hidden,inter,rank,tile_rows", [(3000, 512, 1408, 16, 1024)])
@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_tiled_mlp_on_cuda(dtype, adapter_dtype, merged, rows, hidden, inter, rank, tile_rows, recompute):
    tiled_tests.check(dtype, adapter_dtype, "silu", merged, rows, hidden, inter, rank, tile_rows, recompute,
                      device="cuda")


# The joined q/k norms and RoPE (lowering/norm_rope.py) at Qwen3-MoE's attention (32 q and 4 k heads of 128, 2 x 2048
# tokens), the norm weights trained (their partial sums) and frozen.
@pytest.mark.parametrize("shape,rot,interleaved", [
    pytest.param((2, 32, 4, 2048, 128, "bhsd"), None, False, id="qwen3-moe")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rope_on_cuda(shape, rot, interleaved, dtype):
    inputs = norm_rope_tests.make_inputs(*shape, dtype, rot=rot, interleaved=interleaved, device="cuda")
    layout = shape[-1]
    norm_rope_tests.check_against_pattern(norm_rope_tests.fused(layout, interleaved),
                                          norm_rope_tests.pattern(layout, interleaved), inputs)


# bshd_out: q and k (and in the backward their gradients) written in the projection's [b, s, h, d] memory, the
# Qwen3-MoE and Llama-3-8B attention shapes at 2 x 2048 tokens; checked against the pattern, and the SDPA output
# then in [b, s, h * d] rows (cuDNN's lays it out like its query; flash's always is).
@pytest.mark.parametrize("shape", [(2, 32, 4, 2048, 128, "bhsd"), (2, 32, 8, 2048, 128, "bhsd"),
                                   (2, 3, 1, 7, 64, "bhsd")], ids=["qwen3-moe", "llama-3-8b", "odd"])
@pytest.mark.parametrize("joined", [False, True], ids=["rope", "norm_rope"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bshd_out_on_cuda(shape, joined, dtype):
    if joined:
        inputs = norm_rope_tests.make_inputs(*shape, dtype, device="cuda")
        c, s = inputs[4].unsqueeze(1), inputs[5].unsqueeze(1)
        fused = lambda q, k, wq, wk, cos, sin: norm_rope(q, k, wq, wk, c, s, bshd_out=True)  # noqa: E731
        qo, ko, dq, dk, *_ = norm_rope_tests.check_against_pattern(fused, norm_rope_tests.pattern("bhsd"), inputs)
    else:
        inputs = _cuda(rope_tests.make_inputs(*shape, dtype))
        c, s = inputs[2].unsqueeze(1), inputs[3].unsqueeze(1)
        fused = lambda q, k, cos, sin: rope(q, k, c, s, False, False, True)  # noqa: E731
        qo, ko, dq, dk = rope_tests.check_against_pattern(fused, rope_tests.pattern_pair("bhsd"), inputs)
    assert all(t.transpose(1, 2).is_contiguous() for t in (qo, ko, dq, dk))
    if dtype != torch.float32 and shape[3] > 64:
        kv = ko.repeat_interleave(qo.shape[1] // ko.shape[1], 1)
        out = torch.nn.functional.scaled_dot_product_attention(qo, kv, kv, is_causal=True)
        assert out.transpose(1, 2).is_contiguous()  # the o projection's rows, a view


# DeepSeek-V3's de-interleaving RoPE layout (pairs in, halves out) at its rope heads (64 dims, 128 q heads, one k head
# shared by all) over 2 x 2048 tokens.
@pytest.mark.parametrize("shape,deinterleave", [
    pytest.param((2, 128, 1, 2048, 64, "bhsd"), True, id="deinterleave-deepseek-v3")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_pairs_on_cuda(shape, deinterleave, dtype):
    inputs = _cuda(rope_tests.make_interleaved_inputs(*shape, dtype))
    layout = shape[-1]
    if deinterleave:
        rope_tests.check_against_pattern(rope_tests.fused_interleaved(layout, deinterleave=True),
                                         rope_tests.pattern_deinterleaving(layout), inputs)
    else:
        rope_tests.check_against_pattern(rope_tests.fused_interleaved(layout), rope_tests.pattern_interleaved(layout),
                                         inputs)
