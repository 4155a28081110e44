"""End-to-end benchmark: one LoRA training step of a random-weight Llama or Qwen3-MoE, eager vs Inductor vs
Liger vs sloth.

The workload is /work/shared/BENCHMARKING.md's, so our numbers sit beside DESIGN.md's peer table:
a transformers model built from a config (random bf16 weights, SDPA attention), peft LoRA r=16,
alpha=16, dropout 0 on every q/k/v/o/gate/up/down projection, fused AdamW on the trainable
parameters, `model(input_ids=ids, labels=ids)` on one fixed random batch. 3 warm-up steps (the first
one's wall time is reported as warm-up/compile seconds), then 8 steps timed between two CUDA events;
peak memory is `torch.cuda.max_memory_allocated()` over those 8 steps (and `max_memory_reserved()`, the
number to read under CUDA graphs, whose pools the first misses). Weights and batch come from
seed 0, so every variant trains the same model on the same data: the first step's loss (before any
update) must agree to bf16 rounding. Final losses drift apart after a few AdamW steps even between
eager and Inductor (seen: 11.63 vs 11.38 after 11 steps), because Adam's first updates are about
lr * sign(g), which turns rounding-level gradient differences into lr-sized weight differences.

    python -m benchmarks.e2e --model llama3-8b --variant sloth --batch 2 --seq 2048   # one run
    python -m benchmarks.e2e --all --model llama3-8b --batch 2 --seq 2048             # every variant
    python -m benchmarks.e2e --smoke --all                                            # CPU, 2-layer toy
    python -m benchmarks.e2e --all --model qwen3-moe --batch 2 --seq 2048             # the MoE row
    python -m benchmarks.e2e --all --model gpt-oss-20b --layers 8                     # GPT-OSS-20B on 8 layers

`--all` runs each variant in its own process (a fresh CUDA allocator, Dynamo cache and peak counter),
one after another, and writes JSON and a markdown table to benchmarks/results/ (and $OUT if set).
`--distributed fsdp2|ddp` wraps the LoRA model in FSDP2 (fully_shard per layer, then the root) or DDP in a
one-process group before compiling it: what the wrapping costs at world size 1 (issue 21); `fsdp2-per-layer`
compiles each decoder layer before sharding it instead (torchtitan's recipe), `ddp-one-graph` turns Dynamo's DDP
optimizer off.

MFU = model FLOPs per step / step time / a measured bf16 matmul rate (8192^3, or --peak-tflops).
Model FLOPs per step, T = batch x seq tokens, recomputation under checkpointing not counted:
  frozen matmul weights (base projections, lm_head), P params:  4 P T   (forward 2PT + input grad 2PT;
                                                                          no weight grad)
  trainable matmul weights (LoRA A and B), P params:             6 P T   (+ weight grad 2PT)
  causal attention, per layer: QK^T and PV are 2 b s^2 (heads x head_dim) each forward, backward
  is twice forward, causal halves it:                             6 b s^2 (heads x head_dim) layers
  experts stored as [E, ...] parameters (Qwen3-MoE): top-k of E experts per token, 4 P_expert k T; the
  router's [E, H] weight as a frozen matmul.
For Llama-3-8B at 2 x 2048 that is 1.23e14 + 1.0e12 + 6.6e12 = 1.31e14, DESIGN.md's floor; for the
Qwen3-MoE shape 1.63e13 + 2.5e12 = 1.88e13.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarks import common, copy_overlap
from benchmarks import variants as sloth_variants

VARIANTS = ["eager", "inductor", "liger", "sloth", "unsloth"]  # unsloth: not in --all's default (wheels)
# fsdp2-per-layer: torchtitan's recipe (each decoder layer compiled, then sharded; the rest eager); ddp-one-graph:
# DDP with Dynamo's DDP optimizer off (torch._dynamo.config.optimize_ddp = False: one graph, no bucket splits).
DISTRIBUTED = ["none", "fsdp2", "fsdp2-per-layer", "ddp", "ddp-one-graph"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# name -> (transformers architecture, config fields, LoRA targets). The MoE model is issue 5's Qwen3-MoE
# shape (Qwen3-30B-A3B's layer, 12 layers): its experts are 3-D parameters, not nn.Linear, so LoRA goes on
# attention only, as in DESIGN.md's MoE row.
MODELS: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                                tie_word_embeddings=False), LORA_TARGETS),
    "qwen3-moe": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=12,
                                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                                    num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                                    vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=32768,
                                    tie_word_embeddings=False), ATTENTION_TARGETS),
    # GPT-OSS-20B (24 layers, 32 experts, top-4; experts with biases, interleaved gate/up and the clamped GLU):
    # attention with sinks has no SDPA path in transformers, so it runs "eager" ([B, heads, T, T] scores), and
    # its sliding-window layers are counted in the MFU as full ones (the FLOPs overstate them). --layers cuts it.
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                    num_experts_per_tok=4, vocab_size=201088, rms_norm_eps=1e-5,
                                    max_position_embeddings=131072, tie_word_embeddings=False), ATTENTION_TARGETS),
    # The smoke models: every code path of the big ones (GQA, gated MLP or experts, RMSNorm, RoPE), seconds
    # on a CPU.
    "tiny-llama": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256, rope_theta=500000.0, rms_norm_eps=1e-5,
                                 max_position_embeddings=256, tie_word_embeddings=False), LORA_TARGETS),
    "tiny-qwen3-moe": ("qwen3_moe", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                         vocab_size=256, rms_norm_eps=1e-6, max_position_embeddings=256,
                                         tie_word_embeddings=False), ATTENTION_TARGETS),
    "tiny-gpt-oss": ("gpt_oss", dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                                     vocab_size=256, rms_norm_eps=1e-5, max_position_embeddings=256,
                                     tie_word_embeddings=False), ATTENTION_TARGETS),
}
SMOKE_MODEL = {"llama3-8b": "tiny-llama", "qwen3-moe": "tiny-qwen3-moe", "gpt-oss-20b": "tiny-gpt-oss"}
# Architectures whose experts are transformers 5.x stacked [E, ...] parameters (peft target_parameters LoRA).
MOE_ARCHS = ("qwen3_moe", "gpt_oss")
COLUMNS = ["variant", "step ms", "tok/s", "MFU %", "x eager", "peak GiB", "reserved GiB", "warm-up s", "first loss", "loss", "graphs",
           "sloth sites", "sloth calls",
           "error"]


def _columns(args: argparse.Namespace) -> list[str]:
    """COLUMNS, with the --distributed engine beside the variant when there is one."""
    return COLUMNS if args.distributed == "none" else [COLUMNS[0], "distributed", *COLUMNS[1:]]


# ----------------------------------------------------------------------------- one run


def _mask_versions() -> dict[str, int]:
    from sloth.runtime import proven_masks

    return dict(proven_masks.calls)


def sloth_op_calls(step: Callable[[], Any]) -> dict[str, int] | None:
    """sloth's op calls in one more ``step``, by op (backward ops included), from a profile of the host only: what
    runs, where the report counts what was compiled. The two differ where Dynamo reuses one compiled graph for
    several modules: under FSDP2 the graph breaks at each sharded decoder layer, and the layers after the first
    two reuse a compiled layer graph (CPU, tiny Llama: the report counted 24 sites at 2 and at 12 layers, the
    unwrapped model 26 at 2 and 50 at 4; at 4 layers every sloth op ran as often per step as unwrapped)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith(("sloth::", "sloth_rt::"))}


def _quantize_linears_nf4(model: torch.nn.Module) -> int:
    """Swap every ``nn.Linear`` under ``model.model`` (not the lm_head) for a bitsandbytes NF4
    ``Linear4bit`` holding the same weight, quantised on the move to CUDA (shared/BENCHMARKING.md's
    QLoRA recipe: no from_pretrained). Returns how many were swapped."""
    import bitsandbytes as bnb

    swapped = 0
    for parent in list(model.model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                             module=q).cuda()
                if child.bias is not None:
                    q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                setattr(parent, name, q)
                swapped += 1
    return swapped


def random_base_model(args: argparse.Namespace, device: str) -> tuple[torch.nn.Module, Any]:
    """The random-weight bf16 model of ``args.model`` (seed 0, so every variant gets the same weights) on
    ``device``, and its config; SDPA attention, no KV cache."""
    from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig, Qwen3MoeConfig

    arch, fields, _ = MODELS[args.model]
    fields = dict(fields)
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    fields["max_position_embeddings"] = max(fields["max_position_embeddings"], args.seq)
    cfg = {"llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig, "gpt_oss": GptOssConfig}[arch](**fields)
    cfg._attn_implementation = "eager" if arch == "gpt_oss" else "sdpa"  # GPT-OSS's sinks: no SDPA path
    cfg.use_cache = False  # training: no KV cache (checkpointing would turn it off with a warning anyway)
    torch.manual_seed(0)
    # Built on the device: an 8B model initialises in seconds there, minutes on the CPU.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model, cfg


def expert_targets(args: argparse.Namespace) -> list[str] | None:
    """peft ``target_parameters`` for --lora-experts: the stacked expert weights of transformers 5.x MoE blocks."""
    if not args.lora_experts:
        return None
    if MODELS[args.model][0] not in MOE_ARCHS:
        raise SystemExit(f"--lora-experts needs an MoE model, not {args.model}")
    return ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def build_model(args: argparse.Namespace, device: str) -> tuple[torch.nn.Module, Any]:
    """The random-weight LoRA (or, with --qlora, NF4 QLoRA) model, on `device`, and its config."""
    from peft import LoraConfig, get_peft_model

    arch, _, targets = MODELS[args.model]
    if args.variant == "unsloth":
        from benchmarks import unsloth_variant

        return unsloth_variant.build_model(args, device, targets, random_base_model)
    if args.variant == "liger":
        # Liger patches the model family's classes (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy); it
        # must run before the model is built (shared/BENCHMARKING.md).
        import liger_kernel.transformers as liger

        getattr(liger, f"apply_liger_kernel_to_{arch}")()

    model, cfg = random_base_model(args, device)
    if args.qlora:
        _quantize_linears_nf4(model)
    if args.grad_ckpt:
        # Non-reentrant: works with frozen embeddings (no enable_input_require_grads) and with Dynamo.
        # transformers >= 5.2x names it activation_checkpointing_enable (the old name warns, and goes in v6).
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM",
                      target_parameters=expert_targets(args))
    model = get_peft_model(model, lora)
    model.train()
    return model, cfg


def _n_experts(cfg: Any) -> Optional[int]:
    """The routed experts of an MoE config (Qwen3-MoE's ``num_experts``, GPT-OSS's ``num_local_experts``), or None."""
    return getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)


def step_flops(model: torch.nn.Module, cfg: Any, batch: int, seq: int) -> dict[str, float]:
    """Model FLOPs of one training step, split as in the module docstring."""
    tokens = batch * seq
    frozen = trainable = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            # in x out, not weight.numel(): a 4-bit weight is stored packed, two values per byte.
            params = module.in_features * module.out_features
            if module.weight.requires_grad:
                trainable += params
            else:
                frozen += params
        elif _n_experts(cfg) and hasattr(module, "gate_up_proj"):
            # Experts stored as [E, ...] parameters: each token multiplies by top-k of the E experts.
            per_expert = sum(p[0].numel() for p in module.parameters(recurse=False) if p.dim() == 3)
            frozen += per_expert * cfg.num_experts_per_tok
        elif _n_experts(cfg) and module.__class__.__name__.endswith("Router"):
            frozen += sum(p.numel() for p in module.parameters(recurse=False) if p.dim() == 2)  # [E, H]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 6 * batch * seq**2 * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers
    matmul = 4 * frozen * tokens + 6 * trainable * tokens
    return {"total": float(matmul + attention), "matmul": float(matmul), "attention": float(attention),
            "frozen_matmul_params": float(frozen), "trainable_params": float(trainable)}


def init_process_group(kind: str, cuda: bool) -> None:
    """The one-process group (world size 1, rank 0) that --distributed ``kind`` runs in: NCCL on CUDA, gloo on the
    CPU, a TCP rendezvous on a free local port. Nothing for "none"; main destroys the group after the run."""
    if kind == "none":
        return
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)


def wrap_distributed(model: torch.nn.Module, kind: str, cuda: bool,
                     compile_layer: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    """``model`` (the peft model) under --distributed ``kind``, as tests/test_distributed.py wraps it; compiled
    afterwards, the whole of it, as the plain run is, except under fsdp2-per-layer, where each decoder layer is
    ``compile_layer(layer)`` before it is sharded. The optimizer must be built from the returned model's
    parameters: fully_shard replaces each parameter with a DTensor shard (at world size 1, the whole tensor)."""
    if kind == "none":
        return model
    if kind.startswith("ddp"):
        # Dynamo's DDP optimizer (torch._dynamo.config.optimize_ddp, on unless ddp-one-graph) splits the compiled
        # graph at the gradient buckets' boundaries; a sloth site a split cuts stays, with its reason in the report.
        torch._dynamo.config.optimize_ddp = kind != "ddp-one-graph"
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if cuda else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    base = model.get_base_model()  # peft's wrapper -> the transformers model
    # The benchmark's base weights are bf16 already, so no mixed-precision policy: each parameter keeps its own
    # dtype, and the step computes what the plain one does (peft keeps the LoRA weights in fp32, its
    # autocast_adapter_dtype; a bf16 param_dtype would round them). FSDP2 wants one dtype among a group's
    # trainable parameters only (the fp32 adapters); the frozen bf16 base weights are sharded beside them.
    policy = MixedPrecisionPolicy() if base.dtype == torch.bfloat16 else \
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = base.model.layers
    for i, layer in enumerate(layers):
        if kind == "fsdp2-per-layer":
            layer = layers[i] = compile_layer(layer)
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


GUARD_FILTERS = {"none": None, "skip-nn-modules": "skip_guard_on_all_nn_modules_unsafe"}


def compile_model(model: torch.nn.Module, variant: str, sloth_options: dict[str, Any],
                  inductor_options: dict[str, Any] | None = None, guard_filter: str = "none") -> Callable[..., Any]:
    """``model`` as ``variant`` runs it; ``guard_filter`` names one of torch.compiler's guard filters
    (GUARD_FILTERS), handed to Dynamo as ``options["guard_filter_fn"]`` (benchmarks/guard_cost.py)."""
    if variant in ("eager", "liger", "unsloth"):  # Unsloth compiles its own regions
        return model
    extra = {} if GUARD_FILTERS[guard_filter] is None else \
        {"guard_filter_fn": getattr(torch.compiler, GUARD_FILTERS[guard_filter])}
    if variant == "inductor":
        return torch.compile(model, options={**(inductor_options or {}), **extra} or None)
    if variant == "sloth":
        return torch.compile(model, backend="sloth", options={**(sloth_options or {}), **extra} or None)
    raise ValueError(f"unknown variant {variant!r}")


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """Build, warm up and time one variant; returns one result row (plus details)."""
    common.use_triton_interpreter_without_cuda()  # before peft or sloth import triton
    if args.variant == "unsloth":
        from benchmarks import unsloth_variant

        unsloth_variant.import_first()  # before anything imports transformers
    sloth = common.import_sloth() if args.variant == "sloth" else None
    if sloth is not None:
        sloth_variants.apply(args.sloth_variant)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: use --smoke for the CPU toy run")
    if args.distributed != "none" and args.variant == "unsloth":
        raise SystemExit("--distributed: not for unsloth (it builds and compiles its own model)")
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    init_process_group(args.distributed, cuda)  # before the model is built; main destroys it
    model, cfg = build_model(args, device)
    flops = step_flops(model, cfg, args.batch, args.seq)
    compile_as_variant = lambda module: compile_model(  # noqa: E731  (the variant's compile, for any module)
        module, args.variant, json.loads(args.sloth_options), json.loads(args.inductor_options), args.guard_filter)
    model = wrap_distributed(model, args.distributed, cuda, compile_as_variant)
    trainable = [p for p in model.parameters() if p.requires_grad]  # after wrapping: FSDP2's DTensors
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    # Under fsdp2-per-layer the layers are compiled already and the rest runs eagerly.
    compiled = model if args.distributed == "fsdp2-per-layer" else compile_as_variant(model)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))

    # A row that asks for CUDA graphs (Inductor's triton.cudagraphs) marks each step's start, as their docs ask;
    # the others run as a user's loop does, unmarked, whether or not sloth's plan captures CUDA graphs itself.
    mark_steps = any(json.loads(o).get("triton.cudagraphs") for o in (args.sloth_options, args.inductor_options))

    def step() -> torch.Tensor:
        # The previous replay's outputs may be overwritten once the next step starts, which is why the loss kept
        # is a clone.
        if mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().clone()

    warmup_walls, warmup_losses = [], []
    for _ in range(args.warmup):
        start = time.perf_counter()
        warmup_losses.append(step())
        sync()
        warmup_walls.append(time.perf_counter() - start)

    # A full collection now, so none falls inside the timed steps. Compiling leaves 275-350k more Python objects
    # (830-900k in all for a 32-layer model, 550k for the eager one) and a generation-2 collection walks them all:
    # 0.46-0.63 s on the CPU here (benchmarks/gc_cost.py); the likeliest reading of one 848 ms step among
    # 248-267 ms ones on the H200 (2026-11-30, GPU idle meanwhile). It comes once after compiling, when the
    # objects compiling made move to the oldest generation, and then only after a quarter as many again have
    # survived (thousands of steps): a start-up cost, which the timed window should not sample by luck. Every
    # variant gets the same; the timed steps' collections are in the record ("gc in timed steps").
    gc.collect()
    gc_pauses = common.GcPauses()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        # An event between steps (no sync): each step's own time, so one slow step shows as such.
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
        # nvidia-smi polls the driver (NVML) every 100 ms from a process of its own; --no-telemetry leaves it
        # out, to see whether that polling slows a host-bound step (the record then has no "gpu telemetry")
        telemetry = contextlib.nullcontext() if args.no_telemetry else common.GpuTelemetry()
        allocator_before = common.allocator_counters()
        with telemetry, gc_pauses:
            marks[0].record()
            for i in range(args.steps):
                loss = step()
                marks[i + 1].record()
            torch.cuda.synchronize()
        step_ms = marks[0].elapsed_time(marks[-1]) / args.steps
        steps_ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        gpu = None if args.no_telemetry else telemetry.summary()
        allocator = {k: v - allocator_before[k] for k, v in common.allocator_counters().items()}
        peak_gib = torch.cuda.max_memory_allocated() / common.GiB
        # What the allocator holds, private pools included: under CUDA graphs the activations live in a graph's
        # pool, allocated once while recording, and max_memory_allocated over the replays misses them.
        reserved_gib = torch.cuda.max_memory_reserved() / common.GiB
    else:
        start = time.perf_counter()
        with gc_pauses:
            for _ in range(args.steps):
                loss = step()
        step_ms = (time.perf_counter() - start) * 1e3 / args.steps
        peak_gib = reserved_gib = None
        steps_ms, gpu, allocator = [], None, None

    # One more step each, after the timed ones: the host syncs in it and where (none expected in a steady step), what
    # sloth's offload moved in it, and with --copy-overlap how much of those copies compute hid.
    sync_sites = copy_overlap.sync_sites(step) if cuda else None
    # Under --distributed only: one more step (a long-context step is minutes) for what the report undercounts.
    op_calls = sloth_op_calls(step) if sloth is not None and args.distributed != "none" else None
    offload_step = None
    if sloth is not None and sloth.report().offload:  # offload ran (the user's option or the plan)
        from sloth.runtime import offload as offload_runtime

        offload_runtime.reset_stats()
        step()
        offload_step = dataclasses.asdict(offload_runtime.stats)
        offload_step["pinned pool GiB"] = offload_runtime.pool.nbytes / common.GiB
    overlap = None
    if args.copy_overlap and cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            step()
            torch.cuda.synchronize()
        overlap = copy_overlap.copy_overlap(prof)
        print(f"copy overlap: {overlap}", flush=True)
    if args.profile and cuda:
        profile_step(step, args)
    if args.host_profile:
        host_profile_step(step, sync, args)
    memory_at_peak = None
    if args.memory_peak and cuda:
        memory_at_peak = memory_peak_step(step, args)
    peak_tflops = args.peak_tflops or common.matmul_tflops()
    tokens = args.batch * args.seq
    # sloth.report() merges every graph compiled in this process (graph breaks, checkpointed layers).
    report = sloth.report() if sloth is not None else None
    counts = report.counts if report is not None else None
    dynamo = torch._dynamo.utils.counters
    return {
        "variant": args.variant,
        "distributed": args.distributed,
        "step ms": step_ms,
        "tok/s": tokens / (step_ms * 1e-3),
        "MFU %": 100 * flops["total"] / (step_ms * 1e-3) / (peak_tflops * 1e12),
        "peak GiB": peak_gib,
        "reserved GiB": reserved_gib,
        "warm-up s": warmup_walls[0] if warmup_walls else None,
        "first loss": warmup_losses[0].float().item() if warmup_losses else None,
        "loss": loss.float().item(),
        "sloth sites": sum(counts.values()) if counts else (0 if counts is not None else None),
        "graphs": dynamo["stats"]["unique_graphs"] if args.variant != "eager" else None,
        "graph breaks": sum(dynamo["graph_break"].values()) if args.variant != "eager" else None,
        "sloth counts": counts,
        "sloth calls": sum(op_calls.values()) if op_calls is not None else None,
        "sloth op calls": op_calls,
        # Calls of graphs reading a mask another graph made, by attention version run, and the masks checked on
        # the device (runtime/proven_masks.py), over the whole run.
        "mask versions": _mask_versions() if sloth is not None else None,
        # sloth's own share of the warm-up (compile) time, per pass: the pre-grad pipeline's (compiler/pipeline.py)
        # and the post-grad passes' (compiler/late_passes.py)
        "sloth pass s": dict(report.pass_seconds) if report is not None else None,
        "sloth variants": list(args.sloth_variant) if sloth is not None else None,
        "sloth report": str(report) if report is not None else None,
        "syncs per step": None if sync_sites is None else len(sync_sites),
        "sync sites": sync_sites,
        "offload per step": offload_step,
        "copy overlap": overlap,
        "warm-up walls s": warmup_walls,
        "steps ms": steps_ms,
        "step ms median": statistics.median(steps_ms) if steps_ms else None,
        "gpu telemetry": gpu,
        "gc in timed steps": gc_pauses.summary(),
        "allocator in timed steps": allocator,
        "memory at peak": memory_at_peak,
        "flops": flops,
        "peak_tflops": peak_tflops,
    }


# Kernel-name families for the profile summary, first match wins (cuBLAS/cuDNN/CUTLASS GEMMs, the
# flash/efficient attention kernels SDPA picks, Triton kernels Inductor generated, sloth's own).
_KERNEL_FAMILIES = (("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
                    ("attention", ("flash", "fmha", "attention", "attn")),
                    ("sloth", ("_rms_norm", "_rope", "_glu", "_lce", "_lora", "_nf4")),
                    ("inductor", ("triton_",)),
                    ("other", ("",)))


def _family(kernel: str) -> str:
    name = kernel.lower()
    return next(f for f, keys in _KERNEL_FAMILIES if any(k in name for k in keys))


def _gpu_idle_lines(prof: Any, top: int) -> list[str]:
    """Where the GPU waits within the profiled step: from the first kernel's start to the last kernel's end, the
    time no kernel runs, as gaps between kernels (by size, by the kernel that ends each gap: what the GPU was
    waiting for the host to launch, and by the host ops running meanwhile), plus the host's lead-in before the
    first kernel. A step bound by its host shows many small gaps; one bound by its GPU, few."""
    from torch.autograd import DeviceType

    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not kernels:
        return ["GPU idle: no kernels recorded"]
    cpu_start = min((e.time_range.start for e in events if e.device_type == DeviceType.CPU), default=kernels[0][0])
    gaps, spans, busy_end = [], [], kernels[0][1]
    for start, end, name in kernels[1:]:
        if start > busy_end:
            gaps.append((start - busy_end, busy_end - kernels[0][0], name))
            spans.append((busy_end, start))
        busy_end = max(busy_end, end)
    span, idle = busy_end - kernels[0][0], sum(g[0] for g in gaps)
    lines = [f"GPU idle: first kernel to last {span / 1e3:.2f} ms, no kernel running for {idle / 1e3:.2f} ms in "
             f"{len(gaps)} gaps; host lead-in before the first kernel {(kernels[0][0] - cpu_start) / 1e3:.2f} ms",
             f"{'gap us':>12} {'gaps':>6} {'ms':>8}"]
    for lo, hi in ((0, 5), (5, 20), (20, 100), (100, 1000), (1000, float("inf"))):
        sized = [g[0] for g in gaps if lo <= g[0] < hi]
        lines.append(f"{f'{lo}-{hi}':>12} {len(sized):6d} {sum(sized) / 1e3:8.2f}")
    by_next: dict[str, list[float]] = {}
    for size, _, name in gaps:
        by_next.setdefault(name[:90], []).append(size)
    lines += ["", "idle before each kernel (what the GPU waited for)", f"{'ms':>8} {'gaps':>6}  kernel"]
    lines += [f"{sum(v) / 1e3:8.2f} {len(v):6d}  {k}" for k, v in sorted(by_next.items(), key=lambda kv: -sum(kv[1]))[:top]]
    lines += ["", "largest gaps", f"{'us':>8} {'at ms':>8}  next kernel"]
    lines += [f"{size:8.1f} {at / 1e3:8.2f}  {name[:90]}" for size, at, name in sorted(gaps, reverse=True)[:top]]
    lines += ["", "host ops running while the GPU waited (idle time inside each op's span; nested ops each count)",
              f"{'ms':>8}  op"]
    lines += [f"{ms:8.2f}  {name[:100]}" for name, ms in _idle_by_host_op(events, spans)[:top]]
    return lines


def _idle_by_host_op(events: list, spans: list[tuple[float, float]]) -> list[tuple[str, float]]:
    """(CPU op name, ms of GPU idle time within that op's calls), most first: what the host was doing while the
    GPU had nothing to run. ``spans`` are the idle intervals, sorted and disjoint, on the events' clock."""
    import bisect

    from torch.autograd import DeviceType

    ends = [end for _, end in spans]
    overlap: dict[str, float] = {}
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        t0, t1 = e.time_range.start, e.time_range.end
        i, total = bisect.bisect_right(ends, t0), 0.0
        while i < len(spans) and spans[i][0] < t1:
            total += min(t1, spans[i][1]) - max(t0, spans[i][0])
            i += 1
        if total > 0:
            overlap[e.name] = overlap.get(e.name, 0.0) + total
    return sorted(((name, us / 1e3) for name, us in overlap.items()), key=lambda kv: -kv[1])


def profile_step(step: Callable[[], Any], args: argparse.Namespace, top: int = 40) -> None:
    """Profile one training step: GPU time per kernel family and the ``top`` kernels by GPU time,
    written as text to ``_text_file(args, "profile")``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    # Kernels only: with CPU activity on, each aten op also carries its kernels' time as its own "self device
    # time", which would count every GEMM twice (the first H200 profiles of 2026-11-29 19:32 did).
    events = [e for e in averages if e.self_device_time_total > 0 and e.device_type == DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    families: dict[str, float] = {}
    for e in events:
        families[_family(e.key)] = families.get(_family(e.key), 0.0) + e.self_device_time_total
    lines = [f"one step, {args.variant}, {args.model} L{args.layers or 'all'} b{args.batch} s{args.seq}"
             f"{' qlora' if args.qlora else ''}{' ckpt' if args.grad_ckpt else ''}: "
             f"GPU kernel time {total / 1e3:.2f} ms",
             "", "family      ms      %"]
    by_time = sorted(families.items(), key=lambda kv: -kv[1])
    lines += [f"{f:<9} {us / 1e3:8.2f} {100 * us / total:6.1f}" for f, us in by_time]
    lines += ["", f"{'ms':>8} {'%':>5} {'calls':>6}  family     kernel"]
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        lines.append(f"{e.self_device_time_total / 1e3:8.2f} {100 * e.self_device_time_total / total:5.1f} "
                     f"{e.count:6d}  {_family(e.key):<9}  {e.key[:110]}")
    # The host side: CPU time by op (self time, so nested calls are not counted twice). A step whose wall
    # time exceeds its GPU kernel time is waiting on this.
    cpu = sorted((e for e in averages if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    cpu_total = sum(e.self_cpu_time_total for e in cpu)
    lines += ["", f"host: CPU self time {cpu_total / 1e3:.2f} ms (profiled, so inflated)",
              f"{'ms':>8} {'%':>5} {'calls':>6}  op"]
    lines += [f"{e.self_cpu_time_total / 1e3:8.2f} {100 * e.self_cpu_time_total / cpu_total:5.1f} {e.count:6d}  "
              f"{e.key[:110]}" for e in cpu[:top]]
    lines += [""] + _gpu_idle_lines(prof, top)
    path = _text_file(args, "profile")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]), flush=True)


def _run_tag(args: argparse.Namespace) -> str:
    """What tells a run's text files apart from another variant's in one call: ``-qlora``, ``-lora-experts``, the
    sloth options set to true (``-offload-tiled_mlp``) and those given as a dict, with its keys set to true
    (``{"offload": {"mid_layer": true}}``: ``-offload-mid_layer``), those given as a list with its items
    (``{"disable": ["lean_backward"]}``: ``-disable-lean_backward``) and the measurement variants, so a second run
    does not write over the first's."""
    flags = [name for name, on in (("qlora", args.qlora), ("lora-experts", args.lora_experts)) if on]
    flags += list(args.sloth_variant)
    for key, value in json.loads(args.sloth_options).items():
        if value is True:
            flags.append(key)
        elif isinstance(value, dict):
            flags.append("-".join([key, *(k for k, v in value.items() if v is True)]))
        elif isinstance(value, list) and value:
            flags.append("-".join([key, *map(str, value)]))
    return "".join(f"-{flag}" for flag in flags)


def _text_file(args: argparse.Namespace, kind: str, extra: str = "") -> Path:
    """Where a run's text file of ``kind`` (profile, hostprofile, memory-peak) goes: $OUT, else --results-dir, else
    benchmarks/results, as <kind>-<variant>-<model><run tag>-L<layers><extra>.txt (``_run_tag``)."""
    out_dir = (Path(os.environ["OUT"]) if os.environ.get("OUT")
               else args.results_dir or Path(__file__).parent / "results")
    return out_dir / f"{kind}-{args.variant}-{args.model}{_run_tag(args)}-L{args.layers or 'all'}{extra}.txt"


def memory_peak_step(step: Callable[[], Any], args: argparse.Namespace) -> str:
    """One more step with the allocator's history recorded: what is alive at its peak and who allocated it
    (benchmarks/memory_peak.py), written to ``_text_file(args, "memory-peak", "-b<batch>-s<seq>")``; returns its
    first line (the peak and what the step found allocated)."""
    from benchmarks import memory_peak

    text = memory_peak.measure(step, _text_file(args, "memory-peak", f"-b{args.batch}-s{args.seq}"))
    print(text[:3000], flush=True)
    return text.splitlines()[0]


def host_profile_step(step: Callable[[], Any], sync: Callable[[], None], args: argparse.Namespace,
                      steps: int = 2, top: int = 45) -> None:
    """Where the host's time goes: ``steps`` steps under cProfile, the ``top`` Python functions and builtins by
    own time (tottime) and sloth's own functions by cumulative time, written as text to
    ``_text_file(args, "hostprofile")``. cProfile slows Python down (about 2x on call-heavy code), so read the
    shares, not the absolute times. A step without CUDA graphs whose wall time exceeds its GPU kernel time
    (--profile) is bound by this. Caveat, seen on the H200 (Python 3.12): the autograd engine runs the backward
    on a device thread, and the two threads' events confuse cProfile's accounting (custom_ops.backend_impl got
    half of all own time, 0.5 ms a call, while its callees were cheap); the per-function call counts and the
    callees' cumulative times are the trustworthy part."""
    import cProfile
    import io
    import pstats

    sync()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    host_s = time.perf_counter() - start  # the host's issuing time (the GPU may still be running)
    sync()
    wall_s = time.perf_counter() - start
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    text.write(f"{steps} steps, {args.variant}, {args.model} L{args.layers or 'all'} b{args.batch} s{args.seq}"
               f"{' qlora' if args.qlora else ''}: host {host_s * 1e3 / steps:.1f} ms a step under cProfile, "
               f"wall with the GPU's tail {wall_s * 1e3 / steps:.1f} ms\n\n=== by own time\n")
    stats.sort_stats("tottime").print_stats(top)
    text.write("\n=== sloth's functions by cumulative time\n")
    stats.sort_stats("cumulative").print_stats(r"lowering|compiler|runtime", top)
    path = _text_file(args, "hostprofile")
    path.write_text(text.getvalue())
    print(text.getvalue()[:3000], flush=True)


# ----------------------------------------------------------------------------- driver


def _child_args(args: argparse.Namespace, variant: str, json_out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.e2e", "--variant", variant, "--json-out", str(json_out),
           "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--sloth-options", args.sloth_options,
           "--inductor-options", args.inductor_options, "--guard-filter", args.guard_filter,
           "--distributed", args.distributed]
    for name in args.sloth_variant:
        cmd += ["--sloth-variant", name]
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    if args.grad_ckpt:
        cmd.append("--grad-ckpt")
    if args.qlora:
        cmd.append("--qlora")
    if args.lora_experts:
        cmd.append("--lora-experts")
    if args.profile:
        cmd.append("--profile")
    if args.host_profile:
        cmd.append("--host-profile")
    if args.copy_overlap:
        cmd.append("--copy-overlap")
    if args.memory_peak:
        cmd.append("--memory-peak")
    if args.no_telemetry:
        cmd.append("--no-telemetry")
    if args.smoke:
        cmd.append("--smoke")
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    return cmd


def _num(value: Optional[float], spec: str) -> str:
    """``value`` formatted by ``spec``, or "-" where nothing was measured (a run without warm-up steps has no
    warm-up time and no first loss apart from its one step)."""
    return "-" if value is None else format(value, spec)


def run_all(args: argparse.Namespace) -> int:
    """Each variant in its own subprocess, in order; one progress line per run; JSON + table at the end."""
    variants = args.variants.split(",")
    columns = _columns(args)
    if not args.peak_tflops:
        # Measured once, here, so every row shares one denominator; freed before the children start.
        args.peak_tflops = common.matmul_tflops()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"bf16 matmul peak (measured): {args.peak_tflops:.0f} TFLOP/s", flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, variant in enumerate(variants, 1):
            json_out, log = Path(tmp) / f"{variant}.json", Path(tmp) / f"{variant}.log"
            engine = "" if args.distributed == "none" else f" under {args.distributed}"
            print(f"[{i}/{len(variants)}] {variant}{engine}: running ...", flush=True)
            start = time.perf_counter()
            rc: int | str
            with log.open("w") as fh:
                try:
                    # the peers run peft as a user has it: sloth's polyfill of peft's ParamWrapper (LoRA on the
                    # experts, compiler/integrations/peft_experts.py) only where sloth is the backend
                    env = {**os.environ, "PYTHONUNBUFFERED": "1",
                           **({} if variant == "sloth" else {"SLOTH_PEFT_TRACEABLE": "0"})}
                    rc = subprocess.run(_child_args(args, variant, json_out), stdout=fh, stderr=subprocess.STDOUT,
                                        timeout=args.timeout, env=env).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            wall = time.perf_counter() - start
            if rc == 0 and json_out.exists():
                row = json.loads(json_out.read_text())
                print(f"[{i}/{len(variants)}] {variant}{engine}: {_num(row['step ms'], '.1f')} ms/step, "
                      f"{_num(row['tok/s'], '.0f')} tok/s, MFU {_num(row['MFU %'], '.1f')}%, "
                      f"peak {_gib(row['peak GiB'])}, warm-up {_num(row['warm-up s'], '.1f')} s, "
                      f"first loss {_num(row['first loss'], '.5f')}, loss {_num(row['loss'], '.4f')}, "
                      f"graphs {row['graphs']}, "
                      f"sloth {row['sloth counts']}, {row.get('sloth calls')} op calls, "
                      f"masks {row.get('mask versions')} ({wall:.0f} s)",
                      flush=True)
                if row.get("steps ms"):
                    steps = " ".join(f"{t:.1f}" for t in row["steps ms"])
                    print(f"    steps ms {steps}; GPU {row.get('gpu telemetry')}; gc {row.get('gc in timed steps')}; "
                          f"allocator {row.get('allocator in timed steps')}",
                          flush=True)
            else:
                tail = log.read_text().splitlines()[-25:]
                error = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), f"exit {rc}")
                row = {"variant": variant, "distributed": args.distributed, "error": error.strip()[:160]}
                print(f"[{i}/{len(variants)}] {variant}{engine}: FAILED ({rc}, {wall:.0f} s); last lines:", flush=True)
                print("\n".join("    " + ln for ln in tail), flush=True)
            rows.append(row)
    eager = next((r for r in rows if r["variant"] == "eager" and "step ms" in r), None)
    for r in rows:
        if eager and "step ms" in r:
            r["x eager"] = eager["step ms"] / r["step ms"]
    print()
    print(common.render_text(columns, rows))
    config = {k: v for k, v in vars(args).items() if k not in ("all", "json_out", "variant", "results_dir")}
    config["tokens_per_step"] = args.batch * args.seq
    config["flops_formula"] = "4 P_frozen T + 6 P_trainable T + 6 b s^2 (heads x head_dim) layers (causal)"
    record = common.result_record("e2e", config, columns, rows)
    if not args.smoke or args.results_dir:
        suffix = f"-{args.model}-b{args.batch}-s{args.seq}" + ("-qlora" if args.qlora else "") + (
            "-lora-experts" if args.lora_experts else "") + (
            "-ckpt" if args.grad_ckpt else "") + (
            f"-{args.distributed}" if args.distributed != "none" else "") + (
            f"-L{args.layers}" if args.layers else "") + ("-smoke" if args.smoke else "")
        for path in common.write_result(record, args.results_dir, suffix):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


def _gib(value: float | None) -> str:
    return f"{value:.1f} GiB" if value is not None else "- GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="run every variant of --variants, each in a subprocess")
    parser.add_argument("--variant", choices=VARIANTS, default="eager")
    parser.add_argument("--variants", default=",".join(VARIANTS[:4]),
                        help="for --all; add unsloth with its wheels installed (benchmarks/unsloth_wheels.sh)")
    parser.add_argument("--model", choices=list(MODELS), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=0, help="shrink the model to N decoder layers")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--grad-ckpt", action="store_true", help="non-reentrant gradient checkpointing")
    parser.add_argument("--qlora", action="store_true", help="NF4 base weights (bitsandbytes Linear4bit)")
    parser.add_argument("--lora-experts", action="store_true",
                        help="LoRA on the stacked expert weights too (peft target_parameters; MoE models)")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile one step and write its kernel table (see profile_step)")
    parser.add_argument("--host-profile", action="store_true",
                        help="after timing, run two steps under cProfile and write where the host's time goes")
    parser.add_argument("--copy-overlap", action="store_true",
                        help="profile one more step: how much of the host<->device copies compute hid")
    parser.add_argument("--memory-peak", action="store_true",
                        help="one more step with the allocator's history: what is alive at its peak, by allocating "
                             "site (benchmarks/memory_peak.py; memory-peak-<variant>-<model>-...txt)")
    parser.add_argument("--no-telemetry", action="store_true",
                        help="time the steps without nvidia-smi sampling the GPU's clock and power beside them")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="MFU denominator; measured if 0")
    parser.add_argument("--sloth-variant", action="append", default=[], choices=sorted(sloth_variants.VARIANTS),
                        help="a measurement variant (benchmarks/variants.py), repeatable")
    parser.add_argument("--sloth-options", default="{}", help='JSON, e.g. \'{"inner": "aot_eager"}\'')
    parser.add_argument("--inductor-options", default="{}",
                        help='JSON Inductor config for the inductor variant, e.g. \'{"triton.cudagraphs": true}\'')
    parser.add_argument("--guard-filter", choices=sorted(GUARD_FILTERS), default="none",
                        help="a torch.compiler guard filter for the compiled variants (skip-nn-modules: "
                             "skip_guard_on_all_nn_modules_unsafe; benchmarks/guard_cost.py)")
    parser.add_argument("--distributed", choices=DISTRIBUTED, default="none",
                        help="wrap the model in FSDP2 (fully_shard per decoder layer, then the root) or DDP in a "
                             "one-process group (NCCL; gloo on the CPU) before compiling it")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU toy: the tiny model of --model's architecture, batch 2 x 32, 2 + 2 steps")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per variant under --all")
    parser.add_argument("--json-out", type=Path, default=None, help="(internal) write the one row here")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (smoke: none)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.batch, args.seq = SMOKE_MODEL.get(args.model, args.model), 2, 32
        args.warmup, args.steps = min(args.warmup, 2), min(args.steps, 2)

    if args.all:
        return run_all(args)
    try:
        row = run_one(args)
    finally:
        if args.distributed != "none" and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if args.json_out:
        args.json_out.write_text(json.dumps(row, default=str))
    print(json.dumps({k: row[k] for k in _columns(args) if k in row}, default=str))
    if not args.json_out and (not args.smoke or args.results_dir):
        record = common.result_record("e2e", vars(args) | {"results_dir": None, "json_out": None}, _columns(args),
                                      [row])
        engine = "" if args.distributed == "none" else f"-{args.distributed}"
        for path in common.write_result(record, args.results_dir, f"-{args.model}-{args.variant}{engine}"):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
