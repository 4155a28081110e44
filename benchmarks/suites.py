"""Named benchmark suites: what the GPU sessions run on the device, each a few device-call-sized calls.

    python -m benchmarks.suites --list                          # the suites, their calls, steps and time limits
    python -m benchmarks.suites lora_8b --out $OUT              # every call of a suite, one after another
    python -m benchmarks.suites lora_8b:default --out $OUT      # one call (fits one 10-minute device call)
    python -m benchmarks.suites moe:rows ops:moe --out $OUT     # several calls in one device call
    python -m benchmarks.suites lora_8b --dry-run               # print the commands, run nothing

Each step is one command (``python -m benchmarks.<module> ARGS``) under a time limit; its output goes to
``<out>/logs/<suite>/<step>.log`` and a few lines of it (the rows) are printed. The benchmarks write their own
records to benchmarks/results/ and, because ``OUT`` is set to ``--out`` for them, to ``--out`` too. At the end
the logs are packed into ``<out>/logs.tgz`` (``logs-<time>.tgz`` beside an earlier one) and, where more than 8
files would come back from the device, the markdown tables into ``tables.tgz``: the device tool returns at most
8 files. Wheels carried in ``.whl/`` (liger-kernel, bitsandbytes, trl) and ``.whl/unsloth/`` (benchmarks/
unsloth_wheels.sh) are installed into /tmp/wheels first and put on ``PYTHONPATH``; ``GIT_COMMIT`` is set from
git where the caller did not set it (the device's copy of the checkout may carry stale git metadata: set it).

The steps are those of the former benchmarks/h200_rows.sh, its invocations kept argument for argument (the
limits too, taken from the part each step came from); benchmarks/README.md lists the parts that were dropped. A
call's limits add to at most ``CALL_LIMIT_S``; tests/test_benchmarks_index.py checks that, and that every module,
option, pass name and measurement variant (benchmarks/variants.py) a step names still exists.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALL_LIMIT_S = 600  # the device tool's limit for one command
FILES_BACK = 8  # the device tool returns at most this many files from $OUT

# Most rows run sloth without the logits (Unsloth and Liger do not return them while training either); since
# issue 17 the headline is sloth's default options, and that option is the extra row.
NO_LOGITS = '{"return_logits": false}'
NO_TWINS = '{"return_logits": false, "disable": ["runtime_twins"]}'
NO_LOGITS_CG = '{"return_logits": false, "triton.cudagraphs": true}'
# "memory": "off" where a row isolates one saver: the plan (compiler/planner.py) would add the tiled MLP at 16k.
OFFLOAD = '{"offload": true, "return_logits": false, "memory": "off"}'
OFFLOAD_TILED = '{"offload": true, "tiled_mlp": true, "return_logits": false}'
MID_TILED = '{"offload": {"mid_layer": true}, "return_logits": false, "tiled_mlp": true}'

E2E_ROWS = r"^\[.*(ms/step|FAILED)|^    steps ms"  # e2e's result and per-step lines
OP_ROWS = r"^ *shape |  fwd\+bwd  |^wrote "  # an op table's header and fwd+bwd rows (progress lines end in GB/s)


@dataclass(frozen=True)
class Step:
    """One command: ``python ARGV`` with ``env`` added, killed (rc 124) after ``limit_s``; the log lines matching
    ``show`` and not ``hide`` (the last ``tail`` of them, when set) are printed after it."""
    name: str
    limit_s: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    show: str = ""
    hide: str = ""
    tail: int = 0

    @property
    def module(self) -> str:
        return self.argv[1] if self.argv[:1] == ("-m",) else ""

    def command(self, out: Path) -> list[str]:
        return [a.replace("{out}", str(out)) for a in self.argv]

    def shell(self, out: Path) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        return (env + " " if env else "") + "python " + shlex.join(self.command(out))


@dataclass(frozen=True)
class Call:
    """Steps that fit one device call (their limits add to at most CALL_LIMIT_S) and belong on one machine."""
    name: str
    about: str
    steps: tuple[Step, ...]
    carry: str = ""  # what the device call must carry, besides the tree

    @property
    def limit_s(self) -> int:
        return sum(s.limit_s for s in self.steps)


@dataclass(frozen=True)
class Suite:
    name: str
    about: str
    calls: tuple[Call, ...]
    device: bool = True  # False: a CPU is enough, and no call is bound by the device's limit


def e2e(name: str, limit_s: int, *args: str, env: dict[str, str] | None = None) -> Step:
    """benchmarks/e2e.py (a training step per variant, each in its own process); MFU against 790 TFLOP/s."""
    return Step(name, limit_s, ("-m", "benchmarks.e2e", "--peak-tflops", "790", *args), tuple((env or {}).items()),
                show=E2E_ROWS, tail=6)


def op(name: str, limit_s: int, module: str, *args: str, show: str = OP_ROWS, hide: str = "GB/s$",
       tail: int = 0) -> Step:
    """A benchmarks/ops module; by default its table's header and fwd+bwd rows are printed."""
    return Step(name, limit_s, ("-m", f"benchmarks.ops.{module}", *args), show=show, hide=hide, tail=tail)


def module(name: str, limit_s: int, mod: str, *args: str, show: str = "", hide: str = "", tail: int = 0) -> Step:
    return Step(name, limit_s, ("-m", f"benchmarks.{mod}", *args), show=show, hide=hide, tail=tail)


# 20 s of bf16 matmuls before the first timed run, so that it meets a GPU at its power cap as the later runs do
# (every run of 2026-11-30's records ran with the SW power cap throttle active in all samples, ~690 W of 700)
BURN = module("burn", 60, "suites", "--burn")

LLAMA_16K = ("--all", "--batch", "1", "--seq", "16384", "--grad-ckpt", "--warmup", "2", "--steps", "3")
MOE = ("--all", "--model", "qwen3-moe")

SUITES: tuple[Suite, ...] = (
    Suite("lane", "the GPU test lane: every op test and CUDA check on the device, with a record "
          "(benchmarks/gpu_lane.py; about 9 minutes)", (
        Call("lane", "the whole lane, a call of its own",
             (module("gpu_lane", 595, "gpu_lane", "--out", "{out}/lane", show=r"^# GPU lane|^\| s(hared|erial) "),)),
    )),
    Suite("lora_8b", "Llama-3-8B, LoRA r=16 on every linear, batch 2 x 2048 (the README's headline rows)", (
        Call("default", "sloth as a user runs it (default options) beside return_logits=False, then Unsloth, "
             "20 timed steps each after a burn", (
                 BURN,
                 e2e("lora-sloth-default", 150, "--all", "--steps", "20", "--variants", "sloth"),
                 e2e("lora-sloth-rlf", 130, "--all", "--steps", "20", "--variants", "sloth",
                     "--sloth-options", NO_LOGITS),
                 e2e("lora-unsloth", 150, "--all", "--steps", "20", "--variants", "unsloth"),
             ), carry=".whl/unsloth and the bitsandbytes wheel"),
        Call("peers", "eager, Inductor and Liger (Inductor compiles the 8B step for ~130 s), then sloth under "
             "CUDA graphs", (
                 e2e("lora-peers", 350, "--all", "--variants", "eager,inductor,liger", "--model", "llama3-8b"),
                 e2e("lora-sloth-cg", 150, "--all", "--steps", "20", "--variants", "sloth",
                     "--sloth-options", NO_LOGITS_CG),
             ), carry="the liger-kernel wheel"),
    )),
    Suite("qlora_8b", "Llama-3-8B QLoRA (bitsandbytes NF4 base weights), batch 2 x 2048", (
        Call("default", "sloth's default options beside return_logits=False, then Unsloth, after a burn", (
            BURN,
            e2e("qlora-sloth-default", 150, "--all", "--qlora", "--steps", "20", "--variants", "sloth"),
            e2e("qlora-sloth-rlf", 140, "--all", "--qlora", "--steps", "20", "--variants", "sloth",
                "--sloth-options", NO_LOGITS),
            e2e("qlora-unsloth", 160, "--all", "--qlora", "--steps", "20", "--variants", "unsloth"),
        ), carry=".whl (bitsandbytes) and .whl/unsloth"),
        Call("peers", "eager and Inductor (Liger has no QLoRA path), then sloth under CUDA graphs", (
            e2e("qlora-peers", 300, "--all", "--qlora", "--variants", "eager,inductor"),
            e2e("qlora-sloth-cg", 160, "--all", "--qlora", "--variants", "sloth", "--sloth-options", NO_LOGITS_CG),
        ), carry="the bitsandbytes wheel"),
    )),
    Suite("long_context", "Llama-3-8B LoRA with gradient checkpointing at 1 x 16k and 1 x 64k tokens (issue 19)", (
        Call("16k", "sloth's default options (the plan: offload's mid_layer and the tiled MLP at 16k), offload alone "
             "without logits (what is alive at its peak), offload's mid_layer with the tiled MLP, then Unsloth", (
                 e2e("long16k-default", 150, *LLAMA_16K, "--variants", "sloth"),
                 e2e("long16k-offload", 130, *LLAMA_16K, "--variants", "sloth", "--memory-peak",
                     "--sloth-options", OFFLOAD),
                 e2e("long16k-mid-tiled", 120, *LLAMA_16K, "--variants", "sloth", "--sloth-options", MID_TILED),
                 e2e("long16k-unsloth", 175, *LLAMA_16K, "--variants", "unsloth"),
             ), carry=".whl"),
        Call("64k", "offload's device check (gradients bit-equal, no host sync; it warms the GPU), then 64k "
             "tokens: sloth with mid_layer and the tiled MLP, Unsloth", (
                 module("offload_check", 90, "offload_check", tail=2),
                 e2e("long64k-mid-tiled", 290, "--all", "--batch", "1", "--seq", "65536", "--grad-ckpt",
                     "--warmup", "1", "--steps", "2", "--variants", "sloth", "--sloth-options", MID_TILED),
                 e2e("long64k-unsloth", 200, "--all", "--batch", "1", "--seq", "65536", "--grad-ckpt",
                     "--warmup", "1", "--steps", "1", "--variants", "unsloth"),
             ), carry=".whl"),
    )),
    Suite("longest", "the longest context each trains, one step each (its peak, and that it trains; issue 19): "
          "32 layers at 128k and 256k, 4 layers at 256k, 320k and 512k (the 32-layer peak adds a fixed sum)", (
        Call("128k", "Unsloth, then sloth with offload and the tiled MLP", (
            e2e("long128k-unsloth", 290, "--all", "--batch", "1", "--seq", "131072", "--grad-ckpt", "--warmup", "0",
                "--steps", "1", "--variants", "unsloth"),
            e2e("long128k-tiled", 280, "--all", "--batch", "1", "--seq", "131072", "--grad-ckpt", "--warmup", "0",
                "--steps", "1", "--variants", "sloth", "--sloth-options", OFFLOAD_TILED),
        ), carry=".whl"),
        Call("256k", "sloth at 256k (one step, its compile's; 420 s were not enough on 2026-12-03)", (
            e2e("long256k-tiled", 570, "--all", "--batch", "1", "--seq", "262144", "--grad-ckpt", "--warmup", "0",
                "--steps", "1", "--variants", "sloth", "--sloth-options", OFFLOAD_TILED),
        )),
        Call("256k-unsloth", "Unsloth at 256k", (
            e2e("long256k-unsloth", 570, "--all", "--batch", "1", "--seq", "262144", "--grad-ckpt", "--warmup", "0",
                "--steps", "1", "--variants", "unsloth"),
        ), carry=".whl"),
        *(Call(f"l4-{k}k", f"4 layers at {k}k tokens: sloth, then Unsloth", (
            e2e(f"long{k}k-L4-sloth", s_limit, "--all", "--layers", "4", "--batch", "1", "--seq", str(k * 1024),
                "--grad-ckpt", "--warmup", "0", "--steps", "1", "--variants", "sloth",
                "--sloth-options", OFFLOAD_TILED),
            e2e(f"long{k}k-L4-unsloth", u_limit, "--all", "--layers", "4", "--batch", "1", "--seq", str(k * 1024),
                "--grad-ckpt", "--warmup", "0", "--steps", "1", "--variants", "unsloth"),
        ), carry=".whl") for k, s_limit, u_limit in ((256, 200, 200), (320, 260, 220), (512, 300, 280))),
    )),
    Suite("moe", "Qwen3-MoE (12 layers, 128 experts, top-8), LoRA on attention or on attention and experts, "
          "batch 2 x 2048 (issue 20); GPT-OSS-20B on 8 layers", (
        Call("rows", "sloth's default options and Unsloth, then both with LoRA on the experts", (
            e2e("moe-sloth", 100, *MOE, "--variants", "sloth", "--steps", "16"),
            e2e("moe-unsloth", 140, *MOE, "--variants", "unsloth", "--steps", "16"),
            e2e("moe-experts-sloth", 90, *MOE, "--lora-experts", "--variants", "sloth", "--steps", "12"),
            e2e("moe-experts-unsloth", 140, *MOE, "--lora-experts", "--variants", "unsloth", "--steps", "12"),
        ), carry=".whl"),
        Call("peers", "eager and Inductor, then Liger's Qwen3-MoE patch (its fused MoE autotunes ~4 minutes)", (
            e2e("moe-peers", 300, *MOE, "--variants", "eager,inductor", "--steps", "12"),
            e2e("moe-liger", 240, *MOE, "--variants", "liger"),
        ), carry="the liger-kernel wheel"),
        Call("experts-peers", "eager and Inductor with LoRA on the experts (peft's own forward, graph breaks "
             "and all)", (
            e2e("moe-experts-peers", 330, *MOE, "--lora-experts", "--variants", "eager,inductor"),
        )),
        Call("diagnostics", "the memory target's options (moe_recompute, no logits); the default step's kernel "
             "table, idle gaps, host syncs, cProfile and memory peak; 1 x 128 tokens, where the step is its host's", (
                 e2e("moe-lean", 150, *MOE, "--variants", "sloth", "--steps", "16",
                     "--sloth-options", '{"moe_recompute": true, "return_logits": false}'),
                 e2e("moe-diag", 230, *MOE, "--variants", "sloth", "--profile", "--host-profile", "--memory-peak"),
                 e2e("moe-host-bound", 70, *MOE, "--batch", "1", "--seq", "128", "--variants", "sloth", "--steps", "30",
                     "--no-telemetry"),
             )),
        Call("gpt-oss", "GPT-OSS-20B on 8 layers (attention with sinks), LoRA on attention: eager and Inductor, "
             "sloth", (
            e2e("gpt-oss-peers", 400, "--all", "--model", "gpt-oss-20b", "--layers", "8",
                "--variants", "eager,inductor"),
            e2e("gpt-oss-sloth", 160, "--all", "--model", "gpt-oss-20b", "--layers", "8", "--variants", "sloth"),
        )),
        Call("gpt-oss-unsloth", "Unsloth's GPT-OSS step, on the machine of gpt-oss", (
            e2e("gpt-oss-unsloth", 300, "--all", "--model", "gpt-oss-20b", "--layers", "8", "--variants", "unsloth"),
        ), carry=".whl"),
    )),
    Suite("ops", "the per-op benchmarks (benchmarks/ops/): eager vs Inductor vs sloth, with Liger, TRL and "
          "bitsandbytes where their wheels are carried", (
        Call("norms-loss", "LayerNorm, L2 norm, the fused linear cross-entropy (beside Liger's and TRL 1.16's fused "
             "LM head), a residual add before RMSNorm, the q/k norms joined with RoPE", (
                 op("layer_norm", 100, "layer_norm"),
                 op("l2_norm", 45, "l2_norm"),
                 op("cross_entropy", 200, "cross_entropy"),
                 op("residual_norm", 90, "residual_norm"),
                 op("norm_rope", 60, "norm_rope"),
             ), carry="the liger-kernel and trl-1.16 wheels"),
        Call("moe", "the MoE experts op at Qwen3-MoE's, GPT-OSS-20B's, LoRA and ungated (Nemotron) shapes; "
             "the routers", (
            op("moe_experts", 80, "moe_experts"),
            op("moe_experts_gpt_oss", 100, "moe_experts", "--gpt-oss"),
            op("moe_experts_lora", 80, "moe_experts", "--lora"),
            op("moe_experts_ungated", 110, "moe_experts", "--ungated"),
            op("moe_router", 90, "moe_router"),
        )),
        Call("attention-gemm", "attention with sinks; every SDPA kernel PyTorch has; torch._grouped_mm against the "
             "Triton grouped GEMM; the GLU + LoRA backward's hidden written vs recomputed (bits and time)", (
                 op("sink_attention", 130, "sink_attention"),
                 op("attention", 100, "attention", show=r"s16384.*(sdpa-default|cudnn)", hide="", tail=4),
                 op("grouped_gemm", 130, "grouped_gemm", show=r"^\{", hide=""),
                 op("glu_lora_backward", 90, "glu_lora_backward", show=".", hide="Warn"),
             )),
        Call("lora", "LoRA linears sharing one input; the up_add kernel at the step's shapes with candidates "
             "beside; NF4 dequantised in the matmul's loop vs buffer + cuBLAS", (
                 op("lora_shared", 200, "lora_shared", show=r"fwd\+bwd", hide="", tail=8),
                 op("lora_insitu_up_add", 150, "lora_insitu", "--only", "up_add", show=".", hide="^  ", tail=22),
                 op("qlora_gemm", 200, "qlora_gemm", show=".", hide="", tail=30),
             ), carry="the bitsandbytes wheel"),
        Call("lora-down-nf4", "the LoRA down kernel at the step's shapes, split-K candidates beside; NF4/FP4 "
             "dequantisation bit-exact against bitsandbytes, timed", (
                 op("lora_insitu_down", 300, "lora_insitu", "--only", "down", show=".", hide="^  ", tail=22),
                 op("nf4", 120, "nf4", show=".", hide="", tail=4),
             ), carry="the bitsandbytes wheel"),
    )),
    Suite("host", "where the host's time goes (without CUDA graphs the 8B step waits on its host)", (
        Call("launch", "host us per Triton launch and per sloth op call; a cProfile of two LoRA and two QLoRA steps", (
            module("launch_overhead", 150, "launch_overhead", show=r"^\{"),
            e2e("lora-sloth-hostprof", 150, "--all", "--variants", "sloth", "--sloth-options", NO_LOGITS,
                "--host-profile"),
            e2e("qlora-sloth-hostprof", 170, "--all", "--qlora", "--variants", "sloth", "--sloth-options", NO_LOGITS,
                "--host-profile"),
        ), carry="the bitsandbytes wheel"),
        Call("idle", "kernel tables and where each step's GPU waits: sloth LoRA and QLoRA, Unsloth QLoRA", (
            e2e("lora-sloth-profile", 150, "--all", "--variants", "sloth", "--sloth-options", NO_LOGITS, "--profile"),
            e2e("qlora-sloth-profile", 160, "--all", "--qlora", "--variants", "sloth", "--sloth-options", NO_LOGITS,
                "--profile"),
            e2e("qlora-unsloth-profile", 180, "--all", "--qlora", "--variants", "unsloth", "--profile"),
        ), carry=".whl"),
        Call("compile", "the 8B LoRA step's compile (first warm-up step) with sloth's pass times, and Inductor's "
             "(issue 24)", (
                 e2e("compile-sloth", 150, "--all", "--warmup", "3", "--steps", "4", "--variants", "sloth"),
                 e2e("compile-inductor", 220, "--all", "--warmup", "3", "--steps", "4", "--variants", "inductor"),
             )),
    )),
    Suite("distributed", "the 8B LoRA step under DDP and FSDP2 in a one-process NCCL group, beside the plain step "
          "(issue 21)", (
        Call("sloth", "plain, DDP, and FSDP2 with 8 warm-up steps (its steps were still falling after 3)", (
            e2e("ws1-sloth", 130, "--all", "--steps", "8", "--variants", "sloth"),
            e2e("ws1-sloth-ddp", 160, "--all", "--steps", "8", "--variants", "sloth", "--distributed", "ddp"),
            e2e("ws1-sloth-fsdp2", 210, "--all", "--warmup", "8", "--steps", "8", "--variants", "sloth",
                "--distributed", "fsdp2"),
        )),
        Call("inductor", "Inductor plain and under FSDP2, after a burn", (
            BURN,
            e2e("ws1-inductor", 220, "--all", "--steps", "8", "--variants", "inductor"),
            e2e("ws1-inductor-fsdp2", 260, "--all", "--steps", "8", "--variants", "inductor", "--distributed", "fsdp2"),
        )),
    )),
    Suite("ablations", "each pass switched off and each measurement variant (benchmarks/variants.py), against the "
          "default on one machine (when a variant leaves the code, its step goes with it)", (
        Call("dense", "the 8B LoRA step without logits: the default, the runtime twins off, the LoRA down kernels "
             "without the factor split launch; then 20 steps with the GLU output recomputed beside the default", (
                 e2e("lora-sloth", 120, "--all", "--variants", "sloth", "--sloth-options", NO_LOGITS),
                 e2e("lora-sloth-no-twins", 130, "--all", "--variants", "sloth", "--sloth-options", NO_TWINS),
                 e2e("lora-sloth-nosplit", 120, "--all", "--variants", "sloth", "--sloth-options", NO_LOGITS,
                     "--sloth-variant", "lora_down_tf32x3"),
                 e2e("lora-sloth-20", 100, "--all", "--steps", "20", "--variants", "sloth",
                     "--sloth-options", NO_LOGITS),
                 e2e("lora-sloth-recompute", 90, "--all", "--steps", "20", "--variants", "sloth",
                     "--sloth-options", NO_LOGITS, "--sloth-variant", "glu_lora_recompute_hidden"),
             )),
        Call("lean", "the 16k step with and without the lean backward's rewrites", (
                 e2e("long16k-default", 150, *LLAMA_16K, "--variants", "sloth"),
                 e2e("long16k-default-off", 150, *LLAMA_16K, "--variants", "sloth",
                     "--sloth-options", '{"disable": ["lean_backward"]}'),
             )),
        Call("moe", "the Qwen3-MoE step: the default, the dispatch by sort, every expert GEMM by torch._grouped_mm, "
             "the q/k norms and RoPE apart, the rotated q/k recomputed", (
                 e2e("moe-sloth", 100, *MOE, "--variants", "sloth", "--steps", "16"),
                 e2e("moe-route-sort", 90, *MOE, "--variants", "sloth", "--steps", "16",
                     "--sloth-variant", "moe_route_sort"),
                 e2e("moe-grouped-mm", 100, *MOE, "--variants", "sloth", "--steps", "16",
                     "--sloth-variant", "moe_gemm_grouped_mm"),
                 e2e("moe-unjoined", 110, *MOE, "--variants", "sloth", "--steps", "16",
                     "--sloth-variant", "norm_rope_apart"),
                 e2e("moe-norm-rope-recompute", 110, *MOE, "--variants", "sloth", "--steps", "16",
                     "--sloth-variant", "norm_rope_recompute"),
             )),
        Call("moe-triton", "the Qwen3-MoE step with every expert GEMM in Triton beside the default (mixed)", (
            e2e("grouped-moe-default", 165, *MOE, "--variants", "sloth", "--steps", "16"),
            e2e("grouped-moe-triton", 165, *MOE, "--variants", "sloth", "--steps", "16",
                "--sloth-variant", "moe_gemm_triton"),
        )),
    )),
    Suite("cpu", "measurements a CPU is enough for: Dynamo's guard cost, a garbage collection's cost, the coverage "
          "sweep over transformers' causal LMs (its table and JSON to --out, not docs/)", (
        Call("host-objects", "guard_cost and gc_cost (a 32-layer tiny Llama with LoRA, the 8B model's tensor count)", (
            module("guard_cost", 600, "guard_cost", show=".", tail=12),
            module("gc_cost", 600, "gc_cost", show=".", tail=12),
        )),
        Call("coverage", "every decoder-only causal LM, one training step eagerly and through sloth", (
            module("coverage", 7200, "coverage", "--jobs", "2", "--json-out", "{out}/coverage.json",
                   "--out", "{out}/coverage.md", show=".", tail=5),
        )),
    ), device=False),
)


def suite_by_name() -> dict[str, Suite]:
    return {s.name: s for s in SUITES}


def select(specs: list[str]) -> list[tuple[Suite, Call]]:
    """'lora_8b' -> every call of that suite; 'lora_8b:peers' -> that call."""
    suites = suite_by_name()
    chosen = []
    for spec in specs:
        name, _, call_name = spec.partition(":")
        if name not in suites:
            raise SystemExit(f"unknown suite {name!r}; --list shows them")
        calls = [c for c in suites[name].calls if not call_name or c.name == call_name]
        if not calls:
            raise SystemExit(f"suite {name} has no call {call_name!r}: {', '.join(c.name for c in suites[name].calls)}")
        chosen += [(suites[name], c) for c in calls]
    return chosen


def listing() -> str:
    lines = []
    for suite in SUITES:
        total = sum(c.limit_s for c in suite.calls)
        where = "device" if suite.device else "CPU"
        lines.append(f"{suite.name}  ({where}; {len(suite.calls)} calls, limits add to {total} s)")
        lines.append(f"    {suite.about}")
        for call in suite.calls:
            carry = f"; carry {call.carry}" if call.carry else ""
            lines.append(f"  {suite.name}:{call.name}  ({call.limit_s} s{carry}): {call.about}")
            lines.append("      " + ", ".join(s.name for s in call.steps))
    return "\n".join(lines)


def burn(seconds: float = 20.0) -> None:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    print("burn done")


def _environment(out: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OUT=str(out))
    if not env.get("GIT_COMMIT"):
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        env["GIT_COMMIT"] = done.stdout.strip() if done.returncode == 0 else "unknown"
    wheels = sorted(ROOT.glob(".whl/*.whl")) + sorted(ROOT.glob(".whl/unsloth/*.whl"))
    if wheels:
        # --upgrade: a call chained onto a warm machine adds its wheels beside those an earlier call installed
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade",
                        "--target", "/tmp/wheels", *map(str, wheels)], stderr=subprocess.DEVNULL)
    if Path("/tmp/wheels").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in ("/tmp/wheels", env.get("PYTHONPATH", "")) if p)
    return env


def _summary(step: Step, log: Path) -> list[str]:
    if not step.show:
        return []
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if re.search(step.show, line) and not (step.hide and re.search(step.hide, line))]
    return lines[-step.tail:] if step.tail else lines


def run_step(step: Step, out: Path, logs: Path, env: dict[str, str]) -> int:
    log = logs / f"{step.name}.log"
    with open(log, "w") as fh:
        # a session of its own, so that a timeout also ends the processes the step started (e2e's variants)
        proc = subprocess.Popen([sys.executable, *step.command(out)], cwd=ROOT, env={**env, **dict(step.env)},
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=step.limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = 124
    print(f"{step.name}: rc {rc}" + (f" (past its {step.limit_s} s)" if rc == 124 else ""), flush=True)
    for line in _summary(step, log):
        print(line, flush=True)
    return rc


def _pack(out: Path) -> None:
    """The logs into one archive; the markdown tables into another where more than FILES_BACK files would remain."""
    logs = out / "logs"
    if logs.is_dir():
        archive = out / "logs.tgz"
        if archive.exists():
            archive = out / f"logs-{datetime.datetime.now().strftime('%H%M%S')}.tgz"
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(logs, arcname="logs")
        shutil.rmtree(logs)
    if len(list(out.iterdir())) > FILES_BACK:
        tables = sorted(out.glob("*.md"))
        if tables:
            with tarfile.open(out / "tables.tgz", "w:gz") as tar:
                for path in tables:
                    tar.add(path, arcname=path.name)
            for path in tables:
                path.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=listing())
    parser.add_argument("suites", nargs="*", help="SUITE or SUITE:CALL, several in order")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/sloth-suites"),
                        help="logs, and a copy of every record (default: $OUT, else /tmp/sloth-suites)")
    parser.add_argument("--list", action="store_true", help="the suites, their calls and steps")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--burn", type=float, nargs="?", const=20.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.burn is not None:
        burn(args.burn)
        return 0
    if args.list or not args.suites:
        print(listing())
        return 0
    chosen = select(args.suites)
    out = args.out.resolve()
    if args.dry_run:
        for suite, call in chosen:
            carry = f"; carry {call.carry}" if call.carry else ""
            print(f"# {suite.name}:{call.name}  (limits add to {call.limit_s} s{carry})")
            for step in call.steps:
                print(f"{step.shell(out)}  # {step.limit_s} s, logs/{suite.name}/{step.name}.log")
        return 0
    env = _environment(out)
    failed = []
    for suite, call in chosen:
        logs = out / "logs" / suite.name
        logs.mkdir(parents=True, exist_ok=True)
        print(f"== {suite.name}:{call.name} ({call.limit_s} s of limits)", flush=True)
        for step in call.steps:
            if run_step(step, out, logs, env) != 0:
                failed.append(f"{suite.name}:{call.name}:{step.name}")
    _pack(out)
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
