"""Model code sloth has never seen: hand-written models copied from public projects (tests/outside_models/).

Each test builds one project's own model file at a tiny size on the CPU, adds LoRA (peft's, or the project's own)
or trains every weight, and runs ONE training step eagerly and through ``torch.compile(model, backend="sloth")``:
the loss and every gradient under the whole-model tolerance rule (tests/test_models.py ``assert_model_close``,
against the same model in float64), and the report's counts exactly, family by family. tests/conftest.py fails a
test that leaves a site unexplained.

The expected counts are what sloth should do with each model's math, whatever its spelling. Some spellings are
gaps being closed at the time of writing (2026-12-07): the comment above each test says which, and what the report
says today, so a test failing for that reason is a known gap, not a broken test.
"""
from __future__ import annotations

import copy
import zlib
from collections import Counter
from typing import Callable

import torch
import torch.nn.functional as F

import sloth
from test_models import assert_model_close

from outside_models import deepseek_v3, gpt_fast, gpt_fast_mixtral, mistral_inference, nanochat, nanogpt
from outside_models import torchtitan_llama3

VOCAB = 256
# The rewritten graph run as it is (custom ops through their registered autograd): every pass, the report and the
# kernels' numerics as under Inductor, at 60 s of one core for the file (90 s with "aot_eager", measured 2026-12-07);
# tests/test_models.py carries the AOTAutograd and Inductor paths.
OPTIONS = {"inner": "eager"}


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=seeded(seed))


def randomise(model: torch.nn.Module, std: float = 0.2) -> torch.nn.Module:
    """Every parameter drawn again from a seeded normal, per name (not hash(): salted): the projects leave some
    uninitialised (torch.empty) or at values a wrong kernel could ignore (unit norm weights, zero LoRA B)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, std, generator=seeded(zlib.crc32(name.encode())))
    return model


def with_peft_lora(model: torch.nn.Module, targets: list[str]) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero, which would leave every A gradient zero
                p.normal_(0.0, 0.1, generator=seeded(zlib.crc32(name.encode())))
    return model


def loss_and_grads(model: torch.nn.Module, step: Callable, compiled: bool = False):
    """Loss and gradients of ``step(model)``, the whole step (forward and loss) compiled by sloth if ``compiled``."""
    model.zero_grad(set_to_none=True)
    loss = torch.compile(step, backend="sloth", options=OPTIONS)(model) if compiled else step(model)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_step(model: torch.nn.Module, step: Callable, expected: dict[str, int], refused: dict[str, int],
               reference: Callable[[Callable], object] = lambda run: run()) -> sloth.Report:
    """One training step (``step(model) -> loss``) eager, compiled by sloth and in float64: the loss and every gradient
    within the tolerance rule, exactly ``expected`` sites replaced and ``refused`` sites left with a reason, per family.
    ``reference`` wraps the float64 run (a model whose code casts to a fixed dtype is told to cast to float64)."""
    ref_model = copy.deepcopy(model).double()
    ref_loss, ref_grads = reference(lambda: loss_and_grads(ref_model, step))
    eager_loss, eager_grads = loss_and_grads(model, step)
    assert eager_grads, "nothing trains"
    loss, grads = loss_and_grads(model, step, compiled=True)
    report = sloth.report()
    assert grads.keys() == eager_grads.keys()
    assert_model_close((loss, grads), (eager_loss, eager_grads), (ref_loss, ref_grads), torch.float32)
    assert report.counts == expected, str(report)
    assert dict(Counter(r.family for r in report.rejections)) == refused, str(report)
    return report


def lora_ops(report: sloth.Report) -> dict[str, int]:
    """How many LoRA sites became each op (sloth.lora_linear, the shared-input and the GLU-fused-down forms)."""
    ops: dict[str, int] = {}
    for site in report.sites:
        if site.family == "lora":
            ops[site.op] = ops.get(site.op, 0) + 1
    return ops


# ---------------------------------------------------------------------------------------------------
# karpathy/nanoGPT: LayerNorm through F.layer_norm with optional bias, GELU MLP (no GLU), tied embedding and head,
# the loss inside the model's forward, which also returns the logits.
# ---------------------------------------------------------------------------------------------------

def test_nanogpt_lora_step() -> None:
    torch.manual_seed(0)
    config = nanogpt.GPTConfig(block_size=64, vocab_size=VOCAB, n_layer=1, n_head=4, n_embd=64, dropout=0.0, bias=True)
    model = with_peft_lora(randomise(nanogpt.GPT(config)), ["c_attn", "c_proj", "c_fc"])
    idx, targets = tokens(1, 17, 1), tokens(1, 17, 2)
    report = check_step(model, lambda m: m(idx, targets)[1], {
        "layer_norm": 2 + 1,          # ln_1, ln_2, ln_f
        "cross_entropy": 1,           # the head and the loss, the returned logits kept
        "lora": 4,                    # c_attn, attn.c_proj, c_fc, mlp.c_proj
    }, refused={})
    assert lora_ops(report) == {"sloth.lora_linear": 4}, str(report)


# ---------------------------------------------------------------------------------------------------
# pytorch-labs/gpt-fast (dense): RMSNorm as x * rsqrt(mean(x * x)) in fp32, fused wqkv, interleaved RoPE written as
# torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], -1) on a reshaped (..., 2) view, GQA by repeat_interleave, a
# boolean causal mask indexed by the integer input_pos. Passes today (2026-12-07).
# ---------------------------------------------------------------------------------------------------

def gpt_fast_inputs(model, args, length: int, freqs_cis: torch.Tensor):
    """What Transformer.setup_caches sets, without the KV caches (a training step has none, so its keys are the
    step's ``length`` positions and the mask is ``length`` wide, not the cache's rounded-up length)."""
    model.freqs_cis = freqs_cis
    model.causal_mask = torch.tril(torch.ones(length, length, dtype=torch.bool))
    return torch.arange(length)


def test_gpt_fast_lora_step() -> None:
    torch.manual_seed(0)
    args = gpt_fast.ModelArgs(block_size=64, vocab_size=VOCAB, n_layer=1, n_head=4, n_local_heads=2, dim=64,
                              intermediate_size=96)
    model = randomise(gpt_fast.Transformer(args))
    input_pos = gpt_fast_inputs(model, args, 19, gpt_fast.precompute_freqs_cis(args.block_size, args.head_dim,
                                                                                args.rope_base, torch.float32))
    model = with_peft_lora(model, ["wqkv", "wo", "w1", "w2", "w3"])
    idx, targets = tokens(1, 19, 3), tokens(1, 19, 4)

    def step(m):
        logits = m(idx, input_pos)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    report = check_step(model, step, {
        "rms_norm": 2 + 1,
        "rope": 2,                    # q and k rotated by separate calls: one site each
        "glu": 1,
        "cross_entropy": 1,
        "lora": 5,
    }, refused={
        # the mask is causal_mask[None, None, input_pos]: the tril tensor is a graph input, its values unproven
        "packed_attention": 1, "causal_mask": 1,
        "gqa_attention": 1,           # SDPA keeps that mask
    })
    assert lora_ops(report) == {"sloth.lora_linear": 2, "sloth.lora_linear_shared": 2,
                                "sloth.glu_lora_linear": 1}, str(report)


# ---------------------------------------------------------------------------------------------------
# pytorch-labs/gpt-fast, mixtral-moe: the same attention, experts as stacked [E, F, D] parameters gathered per token
# (self.w1[expert_indices]) and applied by einsum, a softmax router renormalised in place (expert_weights /= sum).
# Every weight trains (the expert weights' gradients are compared too). The einsums keep the routes as a dim of their
# own ([T, K, I] out of W[ids] [T, K, I, D]): moe_route reads their T * K routes (patterns/moe_einsum.py) and joins
# w1 and w3 into the op's gate/up weight (patterns/moe_split.py); the router's in-place renormalisation is its own.
# ---------------------------------------------------------------------------------------------------

def test_gpt_fast_mixtral_full_step() -> None:
    torch.manual_seed(0)
    args = gpt_fast_mixtral.ModelArgs(block_size=64, vocab_size=VOCAB, n_layer=1, n_head=4, n_local_heads=2, dim=64,
                                      intermediate_size=32, num_experts=4, num_activated_experts=2)
    model = randomise(gpt_fast_mixtral.Transformer(args))
    input_pos = gpt_fast_inputs(model, args, 21, gpt_fast_mixtral.precompute_freqs_cis(args.block_size, args.head_dim,
                                                                                        args.rope_base))
    idx, targets = tokens(1, 21, 5), tokens(1, 21, 6)  # batch 1: MOEFeedForward returns [T, D], added to [1, T, D]

    def step(m):
        logits = m(idx, input_pos)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    check_step(model, step, {
        "rms_norm": 2 + 1,
        "rope": 2,
        "moe_route": 1,               # the experts' silu(x W1[e]) * (x W3[e]) then W2[e], weighted and summed
        "moe_router": 1,
        "cross_entropy": 1,
    }, refused={"packed_attention": 1, "causal_mask": 1, "gqa_attention": 1})


# ---------------------------------------------------------------------------------------------------
# mistralai/mistral-inference, Mixtral layout: its own LoRALinear (lora_B(lora_A(x)) * scaling added to the frozen
# linear) on every projection, experts as a ModuleList of FeedForward run over torch.where(selected == i), top-k of
# the gate logits then softmax, complex RoPE on q and k in one function, GQA by repeat_interleave on [S, H, D].
# Neither the experts nor the router can fuse, and no graph holds them: torch.where(selected == i) is nonzero, whose
# output shape depends on the data, a graph break inside the expert loop, so Dynamo skips MoeLayer.forward's frame
# and runs it eagerly, the gate's topk included (no router site in any graph, so no reason). What Dynamo compiles
# instead (8 graphs): each expert's FeedForward as a frame of its own, twice (the first expert's row count static,
# then one graph with a dynamic row count for the others): a dense GLU with its LoRA, counted per compile, not per
# expert. The break also cuts the step's loss off from the head: the loss's graph reads the logits as an input and
# is refused ("the loss does not read the logits of a linear projection").
# ---------------------------------------------------------------------------------------------------

def test_mistral_inference_moe_lora_step() -> None:
    torch.manual_seed(0)
    mi = mistral_inference
    args = mi.TransformerArgs(dim=64, n_layers=1, head_dim=16, hidden_dim=32, n_heads=4, n_kv_heads=2, norm_eps=1e-5,
                              vocab_size=VOCAB, moe=mi.MoeArgs(num_experts=4, num_experts_per_tok=2),
                              lora=mi.LoraArgs(rank=4, scaling=2.0))
    model = randomise(mi.Transformer(args))
    for name, p in model.named_parameters():  # "Freezing is handled at network level"
        p.requires_grad_("lora_" in name)
    model.freqs_cis  # computed once, outside the compiled step
    seqlens = [13, 8]
    ids, targets = tokens(1, sum(seqlens), 7)[0], tokens(1, sum(seqlens), 8)[0]

    report = check_step(model, lambda m: F.cross_entropy(m(ids, seqlens), targets), {
        "rms_norm": 2 + 1,
        "rope": 1,                    # q and k in one apply_rotary_emb: one site
        "glu": 2,                     # the expert FeedForward's two compiles (static, then dynamic rows)
        "lora": 4 + 3 * 2,            # wq, wk, wv, wo; w1, w2, w3 of each FeedForward compile
    }, refused={"cross_entropy": 1})
    assert lora_ops(report) == {"sloth.lora_linear": 1, "sloth.lora_linear_shared": 3 + 2 * 2,  # wq, wk, wv; w1, w3
                                "sloth.glu_lora_linear": 2}, str(report)


# ---------------------------------------------------------------------------------------------------
# deepseek-ai/DeepSeek-V3 inference/model.py: MLA (low-rank q and kv with RMSNorms on the latents, rope on a
# split-off part of q and a shared one-head k_pe, complex RoPE), F.rms_norm, a dense first layer, then an MoE of
# Expert modules in a list run over torch.where(indices == i) after bincount(...).tolist(), a grouped sigmoid
# router (Gate) and a shared-expert MLP. LoRA on attention, the dense MLP and the shared experts.
# The router fuses (Gate's in-place weights /= sum and weights *= route_scale write into the op's output once it
# reads that). The routed experts cannot, and no graph holds them: bincount(...).tolist() is a graph break (a host
# read) right after the Gate, and the loop after it breaks again at torch.where(indices == i) (nonzero: a shape
# that depends on the data), so Dynamo runs that loop eagerly and compiles each Expert as a frame of its own, twice
# (the first expert's row count static, then a dynamic one): dense GLUs, no router weight in their graphs, no
# moe_route site. 10 graphs; the loss's graph reads the logits as an input, cut off from the head by the breaks,
# and is refused ("the loss does not read the logits of a linear projection").
# ---------------------------------------------------------------------------------------------------

def test_deepseek_v3_lora_step() -> None:
    torch.manual_seed(0)
    args = deepseek_v3.ModelArgs(max_batch_size=2, max_seq_len=64, vocab_size=VOCAB, dim=64, inter_dim=96,
                                 moe_inter_dim=32, n_layers=2, n_dense_layers=1, n_heads=4, n_routed_experts=4,
                                 n_shared_experts=1, n_activated_experts=2, n_expert_groups=1, n_limited_groups=1,
                                 score_func="sigmoid", route_scale=2.5, q_lora_rank=32, kv_lora_rank=32,
                                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    # One expert group: with groups, Gate masks its sigmoid scores in place (masked_fill_), which its backward needs;
    # the source runs under inference_mode, and V3's real size (dim 7168) adds a bias first, making a new tensor.
    model = randomise(deepseek_v3.Transformer(args))
    model = with_peft_lora(model, r".*(attn\.(wq_a|wq_b|wkv_a|wkv_b|wo)|ffn\.w[123]|shared_experts\.w[123])")
    ids, targets = tokens(1, 23, 9), tokens(1, 23, 10)

    def step(m):
        logits = m(ids)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    report = check_step(model, step, {
        "rms_norm": 4 * 2 + 1,        # attn_norm, ffn_norm, q_norm, kv_norm per layer; the final norm
        "rope": 2 * 2,                # q_pe and k_pe rotated by separate calls
        "glu": 2 + 2,                 # the dense MLP and the shared experts; the two compiles of Expert
        "moe_router": 1,
        "lora": 5 * 2 + 3 * 2,
    }, refused={"cross_entropy": 1})
    assert lora_ops(report) == {"sloth.lora_linear": 6, "sloth.lora_linear_shared": 8,
                                "sloth.glu_lora_linear": 2}, str(report)


# ---------------------------------------------------------------------------------------------------
# karpathy/nanochat gpt.py: weightless F.rms_norm everywhere (after the embedding, before each sublayer, on q and k
# after RoPE), RoPE by -theta written out on the halves: cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos]), relu^2
# MLP (no GLU), value embeddings, smear and backout mixing, a padded head sliced back, then a tanh logit softcap
# before the loss.
# Parity holds; the RoPE fuses (patterns/rope_forms.py, match_concatenated), and so does the loss: the vocabulary
# slice that drops the head's padding rows is folded into the head weight (patterns/cross_entropy.py).
# ---------------------------------------------------------------------------------------------------

def test_nanochat_lora_step() -> None:
    torch.manual_seed(0)
    config = nanochat.GPTConfig(sequence_len=32, vocab_size=250, n_layer=1, n_head=4, n_kv_head=2, n_embd=64,
                                window_pattern="SL")
    model = randomise(nanochat.GPT(config))  # padded to a 256-row head, the logits sliced back to 250
    model = with_peft_lora(model, ["c_q", "c_k", "c_v", "c_proj", "c_fc"])
    idx = torch.randint(0, 250, (1, 19), generator=seeded(11))
    targets = torch.randint(0, 250, (1, 19), generator=seeded(12))

    def in_float64(run):
        nanochat.COMPUTE_DTYPE = torch.float64  # the module casts activations to it; the reference runs in fp64
        try:
            return run()
        finally:
            nanochat.COMPUTE_DTYPE = torch.float32

    report = check_step(model, lambda m: m(idx, targets), {
        "rms_norm": 1 + 4 + 1,        # after the embedding; x before attention and MLP, q and k; the final norm
        "rope": 1,                    # separate calls on q and k, the same cos/sin nodes: one sloth.rope, -sin once
        "cross_entropy": 1,
        "lora": 6,                    # c_q, c_k, c_v, attn.c_proj, c_fc, mlp.c_proj
    }, refused={}, reference=in_float64)
    assert lora_ops(report) == {"sloth.lora_linear": 3, "sloth.lora_linear_shared": 3}, str(report)


# ---------------------------------------------------------------------------------------------------
# pytorch/torchtitan: llama3's blocks (nn.RMSNorm, complex RoPE on q and k in one function, SDPA with enable_gqa)
# with torchtitan's MoE as the feed-forward (qwen3's layout): a softmax router with route_norm, tokens sorted by
# expert (histc, argsort), experts as stacked [E, F, D] parameters run by its for-loop path (w1[e] per split of
# num_tokens_per_expert.tolist()), scores applied before the experts, a shared expert. LoRA on attention and the
# shared experts; the routed experts are frozen.
# The router fuses (sloth.moe_router_biased); the routed experts cannot: num_tokens_per_expert.tolist() is a graph
# break (a host read), and the graph after it holds neither the router's ids nor its scores, only the tokens
# already sorted by expert and scaled, the stacked weights, and the token counts as constants of the graph (it
# recompiles when they change). Its loop runs each expert's GEMMs on a slice of constant size: moe_route reports
# each expert's pair ("a loop over experts: expert e's GEMMs alone, on a slice of n rows ..."; torchtitan's
# use_grouped_mm=True is the form it fuses), and the glu family fuses each slice's silu(x w1[e]^T) * (x w3[e]^T).
# The breaks skip Transformer.forward's frame (a break inside its loop over the layers): its final norm and head run
# eagerly, in no graph, and the loss's graph reads the logits as an input and is refused. 6 graphs.
# ---------------------------------------------------------------------------------------------------

def test_torchtitan_moe_lora_step() -> None:
    torch.manual_seed(0)
    tt = torchtitan_llama3
    args = tt.TransformerModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=32,
                                   max_seq_len=64, moe_enabled=True, moe_inter_dim=32,
                                   moe_args=tt.MoEArgs(num_experts=4, num_shared_experts=1, score_func="softmax",
                                                       route_norm=True, top_k=2, use_grouped_mm=False))
    model = randomise(tt.Transformer(args))
    model = with_peft_lora(model, r".*(attention\.(wq|wk|wv|wo)|shared_experts\.w[123])")
    ids, targets = tokens(1, 25, 13), tokens(1, 25, 14)

    def step(m):
        logits = m(ids)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    report = check_step(model, step, {
        "rms_norm": 2,                # attention_norm, ffn_norm (the final norm runs eagerly)
        "rope": 1,
        "glu": 1 + 4,                 # the shared expert; each of the 4 experts' slices
        "moe_router": 1,
        "lora": 4 + 3,
    }, refused={"moe_route": 4, "cross_entropy": 1})
    assert lora_ops(report) == {"sloth.lora_linear": 1, "sloth.lora_linear_shared": 5,
                                "sloth.glu_lora_linear": 1}, str(report)
