#!/bin/bash
# Issue 5's end-to-end rows on the device machine, one part per device call (each under the tool's 10-minute
# limit; Inductor alone compiles the 8B model for ~130 s). Every run writes its JSON and markdown to
# benchmarks/results and, when set, $OUT; the logs go into one logs.tgz there at the end (at most 7 files a
# part come back from the device, under its limit of 8).
#
#   bash benchmarks/h200_rows.sh lora      # eager, inductor, liger, sloth, sloth + CUDA graphs (~8 min)
#   bash benchmarks/h200_rows.sh qlora     # the same with NF4 base weights, without Liger (~9 min)
#   bash benchmarks/h200_rows.sh unsloth   # Unsloth LoRA and QLoRA, profiled (wheels: benchmarks/unsloth_wheels.sh)
#   bash benchmarks/h200_rows.sh moe       # Qwen3-MoE: eager, inductor, liger, sloth
#   bash benchmarks/h200_rows.sh long      # batch 1 x 16384 with gradient checkpointing: inductor, sloth
#   bash benchmarks/h200_rows.sh profile   # Unsloth's and sloth's LoRA steps, each with its kernel table
#   bash benchmarks/h200_rows.sh launch    # sloth LoRA: ops as custom_op, as triton_op, with CUDA graphs
#   bash benchmarks/h200_rows.sh versus    # sloth and Unsloth, LoRA and QLoRA, on one lease
#   bash benchmarks/h200_rows.sh recheck   # sloth LoRA and QLoRA again, then 4 layers as custom_op and triton_op
#   bash benchmarks/h200_rows.sh share     # sloth LoRA and QLoRA with and without share_lora_input, one lease
#   bash benchmarks/h200_rows.sh final     # versus and the QLoRA twins ablation on one lease, QLoRA first (~7 min)
#   bash benchmarks/h200_rows.sh confirm   # versus again, then sloth's LoRA step profiled
#   bash benchmarks/h200_rows.sh versus20  # versus with 20 steps after a matmul burn; per-step times, GPU clock/power
#   bash benchmarks/h200_rows.sh default default-2  # sloth's default options beside return_logits=False and Unsloth
#   bash benchmarks/h200_rows.sh robust    # versus20, then sloth LoRA under CUDA graphs (~6 min; limits add to more)
#   bash benchmarks/h200_rows.sh offload offload-2  # issue 19: 16k and 64k with checkpointing, offload on and off, Unsloth
#   bash benchmarks/h200_rows.sh ws1 ws1-2  # issue 21: FSDP2 and DDP at world size 1 beside the plain step, sloth; then
#                                          # Inductor plain and FSDP2 (two calls: the five runs need ~11 min)
#   bash benchmarks/h200_rows.sh compile-share  # issue 24: sloth's share of the 8B LoRA step's compile, beside Inductor's
#   bash benchmarks/h200_rows.sh longest-sloth long-unsloth  # issue 19: sloth at 128k/256k; Unsloth at 16k/64k
#   bash benchmarks/h200_rows.sh longest-2 # issue 19: sloth at 256k, Unsloth at 128k
#   bash benchmarks/h200_rows.sh moe-family moe-unsloth  # issue 20: the moe_experts op, the Qwen3-MoE step with and
#                                          # without moe_route; then Unsloth's (carry .whl/unsloth)
#   bash benchmarks/h200_rows.sh moe-router moe-unsloth  # issue 20: the moe_router op and the Qwen3-MoE step with and
#                                          # without the router family; then Unsloth's (carry .whl)
#   bash benchmarks/h200_rows.sh moe-router-ab  # issue 20: that A/B again under CUDA graphs and plain, 12-16 steps each
#   bash benchmarks/h200_rows.sh moe-hostprof  # issue 20: the default-options MoE step with and without nvidia-smi
#                                          # beside it, its host cProfile; the routers' CUDA checks
#   bash benchmarks/h200_rows.sh moe-new-ops  # issue 20: the ungated experts' op and the routers' timings
#   bash benchmarks/h200_rows.sh mem16k    # issue 19: what is alive at the 16k step's peak (offload; offload + tiled)
#   bash benchmarks/h200_rows.sh mem16k-offload  # the same without the tiled row
#   bash benchmarks/h200_rows.sh lean lean-mid lean-peers  # issue 19: the backward rewrites at 16k, on and off,
#                                          # tiled; mid_layer and tiled; sloth's default options and Unsloth
#   bash benchmarks/h200_rows.sh h200-lean h200-lean-2 h200-moe  # issues 19, 20 on an H200: the 16k rows with the lean
#                                          # backward and Unsloth's, 64k mid_layer + tiled, the MoE row and Unsloth's
#   bash benchmarks/h200_rows.sh gqa       # issue 19: the gqa_attention family at 16k (offload; mid_layer + tiled), Unsloth;
#                                          # the 2 x 2048 LoRA and MoE default rows; grouped vs repeated SDPA
#   bash benchmarks/h200_rows.sh gqa-2     # its second call: the checks, the peak's contents, the MoE rows
#   bash benchmarks/h200_rows.sh mem16k-mid  # issue 19: offload's mid_layer at 16k, with and without the tiled MLP
#   bash benchmarks/h200_rows.sh norm-rope  # issue 20: sloth.norm_rope's CUDA checks and op timings; the MoE row
#                                          # without and with it, then Unsloth's (carry .whl)
#   bash benchmarks/h200_rows.sh moe-versus  # issue 20: sloth's default MoE row, Unsloth's, sloth's again (carry .whl)
#   bash benchmarks/h200_rows.sh moe-versus-experts  # the same with LoRA on the experts (carry .whl)
#   bash benchmarks/h200_rows.sh moe-recompute  # issue 20: the MoE rows with moe_recompute beside the default
#   bash benchmarks/h200_rows.sh moe-diag  # issue 20: the default MoE step's kernels, host profile, syncs and memory peak
#   bash benchmarks/h200_rows.sh moe-host  # issue 20: the MoE step profiled (idle gaps), then under CUDA graphs
#   bash benchmarks/h200_rows.sh longest   # issue 19: 128k and 192k tokens, one step each: sloth with offload, Unsloth
#   bash benchmarks/h200_rows.sh glu-hidden  # glu_lora backward's hidden fused vs recomputed: bits and op time
#   bash benchmarks/h200_rows.sh glu-hidden-steps  # the LoRA and QLoRA steps both ways
#   bash benchmarks/h200_rows.sh guards    # sloth LoRA and QLoRA with Dynamo's module guards skipped
#   bash benchmarks/h200_rows.sh nosplit   # the down kernels in tf32x3 without the factor split launch, beside the default
#   bash benchmarks/h200_rows.sh lora-nosplit qlora-nosplit  # one nosplit row each (to follow a versus)
#   bash benchmarks/h200_rows.sh cg        # sloth LoRA and QLoRA under CUDA graphs
#   bash benchmarks/h200_rows.sh idle      # kernel tables and GPU idle gaps: sloth LoRA and QLoRA, Unsloth QLoRA
#   bash benchmarks/h200_rows.sh lane      # the whole GPU test lane (benchmarks/gpu_lane.py; ~9 min, a call of its
#                                          # own), in place of gpu_tests' one-file-at-a-time checks
#   bash benchmarks/h200_rows.sh twins     # sloth LoRA and QLoRA with the runtime twins off (SLOTH_RUNTIME_TWINS=0)
#   bash benchmarks/h200_rows.sh moe-families  # the MoE step with all families, without norm and RoPE, loss only
#   bash benchmarks/h200_rows.sh host      # host us per Triton launch and per sloth op call; ops.lora_shared
#   bash benchmarks/h200_rows.sh hostprof  # sloth's LoRA and QLoRA steps, two of each under cProfile
#   bash benchmarks/h200_rows.sh launch-overhead  # host us per Triton launch and per op call only
#   bash benchmarks/h200_rows.sh gemm      # NF4 dequantised in the matmul's main loop vs buffer + cuBLAS
#   bash benchmarks/h200_rows.sh insitu    # the up_add kernel at the step's shapes and strides, candidates beside
#   bash benchmarks/h200_rows.sh insitu-down  # the down kernel at the step's shapes, split-K candidates beside
#   bash benchmarks/h200_rows.sh nf4       # NF4/FP4 dequantisation bit-exact vs bitsandbytes, timed
#   bash benchmarks/h200_rows.sh heads ws1-fsdp2  # issue 22: the fused loss beside TRL's fused LM head, the residual
#                                          # add + norm; issue 21: FSDP2 at world size 1 beside the plain step
#   bash benchmarks/h200_rows.sh ws1-again # issue 21: DDP after the split fixes, FSDP2 with 8 warm-up steps
#   bash benchmarks/h200_rows.sh long256-sloth  # issue 19: sloth at 256k (then long128-unsloth, long256-unsloth)
#   bash benchmarks/h200_rows.sh long-l4-sloth  # issue 19: 4 layers at 256k and 512k (then long-l4-unsloth)
#   bash benchmarks/h200_rows.sh next-19 next-19-unsloth  # issue 19: 64k with the attention backward in head chunks,
#                                          # 16k 2048-row blocks, the chunks' CUDA tests; then Unsloth at 64k and 16k
#   bash benchmarks/h200_rows.sh chunks-16k  # issue 19: 16k with the attention backward in head chunks, its checks, Unsloth
#   bash benchmarks/h200_rows.sh grouped-gemm  # issue 20: torch._grouped_mm against the Triton grouped GEMM, checks, steps
#   bash benchmarks/h200_rows.sh grouped-gemm-2  # issue 20: the checks, the default MoE step (mixed GEMMs), lean memory
#   bash benchmarks/h200_rows.sh layout-20 layout-20-peers  # issue 20: q and k written in [b, s, h, d] memory (no
#                                          # copy of attention's output): checks, MoE rows, Unsloth's, the 8B LoRA row
#   bash benchmarks/h200_rows.sh moe-final moe-final-experts  # issue 20: the Qwen3-MoE rows, eager, Inductor, sloth,
#                                          # Unsloth; then with LoRA on the experts, sloth and Unsloth, and the
#                                          # q/k norms recomputed beside the default (what closes issue 20 on an H200)
#   bash benchmarks/h200_rows.sh moe-close  # issue 20's rows in one call: sloth, Unsloth, both with LoRA on the experts,
#                                          # then eager and Inductor (carry .whl)
#   bash benchmarks/h200_rows.sh moe-route  # issue 20: the counting-sort dispatch, CUDA checks, A/B against the sort
#   bash benchmarks/h200_rows.sh moe-experts-now  # issue 20: LoRA on the experts, checks and rows, _grouped_mm beside
#   bash benchmarks/h200_rows.sh next-20   # issue 20: the MoE row default and with moe_recompute, no logits; Unsloth
#   bash benchmarks/h200_rows.sh long320-l4  # issue 19: sloth and Unsloth at 320k on 4 layers (H100), one call
#   bash benchmarks/h200_rows.sh long256-l4  # issue 19: sloth and Unsloth at 256k on 4 layers, one call (carry .whl)
#   bash benchmarks/h200_rows.sh moe-gpt-oss  # issue 20: the moe_experts op at GPT-OSS-20B's and Qwen3-MoE's shapes
#   bash benchmarks/h200_rows.sh gpt-oss gpt-oss-unsloth  # issue 20: the GPT-OSS-20B step on 8 layers, then Unsloth's
#   bash benchmarks/h200_rows.sh moe-lora moe-lora-peers  # issue 20: LoRA on the experts: checks, the op, the step;
#                                          # then eager, Inductor and Unsloth with LoRA on the experts (carry .whl)
#   bash benchmarks/h200_rows.sh norms     # issue 22: ops.layer_norm (eager, inductor, sloth, liger; carry the
#                                          # liger_kernel wheel) and ops.l2_norm (eager, inductor, sloth), <= 145 s
#   DRY=1 bash benchmarks/h200_rows.sh lora   # print the commands only
#   bash benchmarks/h200_rows.sh moe-liger qlora-profile long-sloth   # several parts in one device call
#
# Most parts run sloth with return_logits=False (Unsloth and Liger do not return the logits while training either);
# since issue 17 the headline is sloth's default options (parts default, default-2), that option an extra row;
# wheels in .whl/ (liger, bitsandbytes, .whl/unsloth/) are installed to /tmp/wheels first when present.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${1:?usage: h200_rows.sh PART... (lora|qlora|unsloth|moe|moe-liger|long|long-sloth|profile|qlora-profile|launch|versus|final|twins|idle|recheck|qlora-recheck|host|hostprof|launch-overhead|confirm|robust|versus20|glu-hidden|glu-hidden-steps|guards|nosplit|lora-nosplit|qlora-nosplit|cg|gemm|insitu|insitu-down|nf4|share|moe-families|norms|heads|tiled|long128|long128-unsloth|long128-sloth|long256-sloth|long256-unsloth|long-l4-sloth|long-l4-unsloth|long256-l4|moe-gpt-oss|moe-lora|moe-lora-peers|gpt-oss|gpt-oss-sinks|gpt-oss-peers|gpt-oss-unsloth|long512-l4|ws1|ws1-2|ws1-fsdp2|ws1-again|ws1-recipes|moe-router|moe-router-ab|moe-hostprof|mem16k|moe-new-ops|moe-route|moe-close|next-19|next-19-unsloth|next-20|grouped-gemm|grouped-gemm-2|chunks-16k)}"
out=${OUT:-/tmp/sloth-e2e-rows}  # where the logs go (results: benchmarks/results and $OUT, by e2e itself)
mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
wheels=$(ls .whl/*.whl .whl/unsloth/*.whl 2>/dev/null)  # whichever of the two folders were carried
if [ -z "${DRY:-}" ] && [ -n "$wheels" ]; then
    # --upgrade: a call chained onto a warm machine adds its wheels beside those an earlier call installed there
    pip install -q --no-index --no-deps --upgrade --target /tmp/wheels $wheels 2>/dev/null
fi
if [ -z "${DRY:-}" ] && [ -d /tmp/wheels ]; then
    export PYTHONPATH=/tmp/wheels
fi
SLOTH='{"return_logits": false}'
SLOTH_CG='{"return_logits": false, "triton.cudagraphs": true}'
# 20 s of bf16 matmuls: the first timed run of a part meets a GPU at the power cap, as the later ones do (every
# run of 2026-11-30's records ran with the SW power cap throttle active in all samples, ~690 W of 700)
BURN="
import time, torch
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)
end = time.time() + 20
while time.time() < end:
    for _ in range(20): a @ a
    torch.cuda.synchronize()
print('burn done')"

run() {  # run NAME SECONDS ARGS...: one e2e invocation with a time limit, its log kept
    local name=$1 limit=$2
    shift 2
    if [ -n "${DRY:-}" ]; then echo "$(env | grep '^SLOTH_' | tr '\n' ' ')python -m benchmarks.e2e $*"; return; fi
    timeout "$limit" python -m benchmarks.e2e --peak-tflops 790 "$@" > "$out/logs/$name.log" 2>&1
    echo "$name: rc $?"
    grep -E "^\[.*(ms/step|FAILED)|^    steps ms" "$out/logs/$name.log" | tail -6
}

launch_overhead() {  # benchmarks/launch_overhead.py with a time limit, its rows printed, its log kept
    [ -n "${DRY:-}" ] && { echo "python -m benchmarks.launch_overhead"; return; }
    timeout 150 python -m benchmarks.launch_overhead > "$out/logs/launch_overhead.log" 2>&1
    echo "launch_overhead: rc $?"
    grep -E "^\{" "$out/logs/launch_overhead.log"
}

op_bench() {  # op_bench NAME SECONDS MODULE ARGS...: one benchmarks/ops module with a time limit, its log kept and
    # its table's header and fwd+bwd rows printed (the progress lines end in "GB/s", the table's rows do not)
    local name=$1 limit=$2 module=$3
    shift 3
    if [ -n "${DRY:-}" ]; then echo "timeout $limit python -m benchmarks.ops.$module${*:+ $*}"; return; fi
    timeout "$limit" python -m "benchmarks.ops.$module" "$@" > "$out/logs/$name.log" 2>&1
    echo "$name: rc $?"
    grep -E "^ *shape |  fwd\+bwd  |^wrote " "$out/logs/$name.log" | grep -v "GB/s$"
}

gpu_tests() {  # gpu_tests NAME SECONDS K-EXPRESSION FILE...: tests selected by -k, with a time limit, their log kept
    # (the checkout imported as sloth through a symlink: the device copy's folder is not named sloth)
    local name=$1 limit=$2 expression=$3
    shift 3
    if [ -n "${DRY:-}" ]; then echo "pytest $* -k '$expression'"; return; fi
    mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/sloth
    PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH} timeout "$limit" python -m pytest "$@" -q -n 4 -k "$expression" \
        -p no:cacheprovider > "$out/logs/$name.log" 2>&1
    echo "$name: rc $?"
    tail -3 "$out/logs/$name.log"
}

versus20() {  # versus with 20 timed steps each (per-step times, the GPU's clock, power and throttle reasons in
    # every record), after a 20 s matmul burn so the first run meets a GPU as warm as the later ones
    [ -z "${DRY:-}" ] && timeout 60 python -c "$BURN"
    run qlora-sloth 140 --all --qlora --steps 20 --variants sloth --sloth-options "$SLOTH"
    run qlora-unsloth 150 --all --qlora --steps 20 --variants unsloth
    run lora-sloth 120 --all --steps 20 --variants sloth --sloth-options "$SLOTH"
    run lora-unsloth 130 --all --steps 20 --variants unsloth
}

long128_unsloth() { run long128-unsloth 290 --all --batch 1 --seq 131072 --grad-ckpt --warmup 0 --steps 1 --variants unsloth; }
long128_sloth() {
    run long128-tiled 280 --all --batch 1 --seq 131072 --grad-ckpt --warmup 0 --steps 1 --variants sloth \
        --sloth-options '{"offload": true, "tiled_mlp": true, "return_logits": false}'
}

for part in "$@"; do
case $part in
    lane)
        if [ -n "${DRY:-}" ]; then echo "python -m benchmarks.gpu_lane --out $out/lane"; continue; fi
        python -m benchmarks.gpu_lane --out "$out/lane"; echo "lane: rc $?" ;;
    lora)
        run lora-peers 350 --all --variants eager,inductor,liger --model llama3-8b
        run lora-sloth 110 --all --variants sloth --sloth-options "$SLOTH"
        run lora-sloth-cg 120 --all --variants sloth --sloth-options "$SLOTH_CG" ;;
    qlora)
        run qlora-peers 300 --all --qlora --variants eager,inductor  # Liger's QLoRA row: DESIGN.md (time)
        run qlora-sloth 120 --all --qlora --variants sloth --sloth-options "$SLOTH"
        run qlora-sloth-cg 130 --all --qlora --variants sloth --sloth-options "$SLOTH_CG" ;;
    unsloth)
        run lora-unsloth 240 --all --variants unsloth --profile
        run qlora-unsloth 280 --all --qlora --variants unsloth ;;
    moe)
        run moe 560 --all --model qwen3-moe --variants eager,inductor,liger,sloth --sloth-options "$SLOTH" ;;
    moe-families)  # where sloth loses to Inductor on the MoE step: the same run without some families (host cost
        # per op call is 60-200 us on the H200, against ~8 us of GPU for a norm of 4096 x 2048)
        run moe-sloth 150 --all --model qwen3-moe --variants sloth --sloth-options "$SLOTH"
        run moe-sloth-no-norm-rope 150 --all --model qwen3-moe --variants sloth \
            --sloth-options '{"return_logits": false, "patterns": ["glu", "cross_entropy", "lora", "causal_mask"]}'
        run moe-sloth-loss-only 150 --all --model qwen3-moe --variants sloth \
            --sloth-options '{"return_logits": false, "patterns": ["cross_entropy", "causal_mask"]}' ;;
    moe-liger)
        run moe-liger 240 --all --model qwen3-moe --variants liger ;;
    share)  # LoRA and QLoRA with the LoRA linears that share an input joined (the default) and not, one lease
        run lora-sloth 150 --all --variants sloth --sloth-options "$SLOTH"
        run lora-sloth-unshared 130 --all --variants sloth --sloth-options '{"return_logits": false, "share_lora_input": false}'
        run qlora-sloth 150 --all --qlora --variants sloth --sloth-options "$SLOTH"
        run qlora-sloth-unshared 140 --all --qlora --variants sloth --sloth-options '{"return_logits": false, "share_lora_input": false}' ;;
    twins)  # the custom ops instead of their runtime twins (compiler/runtime_ops.py), beside a versus on one lease
        export SLOTH_RUNTIME_TWINS=0
        run lora-sloth-no-twins 130 --all --variants sloth --sloth-options "$SLOTH"
        run qlora-sloth-no-twins 150 --all --qlora --variants sloth --sloth-options "$SLOTH"
        unset SLOTH_RUNTIME_TWINS ;;
    final)  # QLoRA (the row where the host shows) first, so a cut-short call still has a same-lease pair
        run qlora-sloth 140 --all --qlora --variants sloth --sloth-options "$SLOTH"
        run qlora-unsloth 150 --all --qlora --variants unsloth
        export SLOTH_RUNTIME_TWINS=0
        run qlora-sloth-no-twins 140 --all --qlora --variants sloth --sloth-options "$SLOTH"
        unset SLOTH_RUNTIME_TWINS
        run lora-sloth 120 --all --variants sloth --sloth-options "$SLOTH"
        run lora-unsloth 130 --all --variants unsloth ;;
    confirm)  # versus on a second lease, then sloth's LoRA step profiled (its kernel table and idle gaps)
        run lora-sloth 120 --all --variants sloth --sloth-options "$SLOTH"
        run lora-unsloth 150 --all --variants unsloth
        run qlora-sloth 140 --all --qlora --variants sloth --sloth-options "$SLOTH"
        run qlora-unsloth 160 --all --qlora --variants unsloth
        run lora-sloth-profile 150 --all --variants sloth --sloth-options "$SLOTH" --profile ;;
    robust)  # versus20, then sloth's LoRA step under CUDA graphs (the step without its host: bound by the GPU alone)
        versus20
        run lora-sloth-cg 150 --all --steps 20 --variants sloth --sloth-options "$SLOTH_CG" ;;
    versus20)
        versus20 ;;
    default)  # issue 17: sloth as a user runs it (no options: the loss reads the returned logits) beside
        # return_logits=False, LoRA and QLoRA, after a burn (~7 min; carry the bitsandbytes wheel alone: with
        # Unsloth's set beside it the call passes the 64 MiB carry limit)
        [ -z "${DRY:-}" ] && timeout 60 python -c "$BURN"
        run lora-sloth-default 150 --all --steps 20 --variants sloth
        run lora-sloth-rlf 130 --all --steps 20 --variants sloth --sloth-options "$SLOTH"
        run qlora-sloth-default 150 --all --qlora --steps 20 --variants sloth
        run qlora-sloth-rlf 140 --all --qlora --steps 20 --variants sloth --sloth-options "$SLOTH" ;;
    default-2)  # its second half, chained at once onto the same machine (bitsandbytes stays installed in
        # /tmp/wheels; carry .whl/unsloth): Unsloth's LoRA, 1 x 16384 with checkpointing both ways, Unsloth's QLoRA
        run lora-unsloth 150 --all --steps 20 --variants unsloth
        run long-sloth-default 150 --all --batch 1 --seq 16384 --grad-ckpt --steps 6 --variants sloth
        run long-sloth-rlf 150 --all --batch 1 --seq 16384 --grad-ckpt --steps 6 --variants sloth --sloth-options "$SLOTH"
        run qlora-unsloth 160 --all --qlora --steps 20 --variants unsloth ;;
    offload)  # issue 19, first call (carry the bitsandbytes wheel): offload's bits on the device, then Llama-3-8B
        # LoRA at 1 x 16384 with gradient checkpointing: sloth default, sloth with offload (copies profiled, syncs
        # counted), Inductor (~8 min; the check warms the GPU in place of the burn)
        [ -z "${DRY:-}" ] && timeout 120 python -m benchmarks.offload_check > "$out/logs/offload_check.log" 2>&1
        [ -z "${DRY:-}" ] && echo "offload_check: rc $?" && tail -2 "$out/logs/offload_check.log"
        run long16-sloth 170 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 6 --variants sloth
        run long16-offload 170 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 6 --variants sloth \
            --copy-overlap --sloth-options '{"offload": true}'
        run long16-inductor 230 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 6 --variants inductor ;;
    offload-2)  # its second call, chained at once (carry .whl/unsloth): Unsloth at 16k, then 64k tokens for sloth
        # default, sloth with offload and Unsloth
        run long16-unsloth 130 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 6 --variants unsloth
        run long64-sloth 150 --all --batch 1 --seq 65536 --grad-ckpt --warmup 1 --steps 3 --variants sloth
        run long64-offload 150 --all --batch 1 --seq 65536 --grad-ckpt --warmup 1 --steps 3 --variants sloth \
            --copy-overlap --sloth-options '{"offload": true}'
        run long64-unsloth 150 --all --batch 1 --seq 65536 --grad-ckpt --warmup 1 --steps 3 --variants unsloth ;;
    ws1)  # issue 21: the 8B LoRA step with sloth's default options, plain, under FSDP2 (fully_shard per decoder layer,
        # then the root) and under DDP, each in a one-process NCCL group; after a burn (limits add to 430 s). The
        # FSDP2 run's "sloth sites" counts each compiled graph once (the layers reuse one): read "sloth calls"
        [ -z "${DRY:-}" ] && timeout 60 python -c "$BURN"
        run ws1-sloth 130 --all --steps 8 --variants sloth
        run ws1-sloth-fsdp2 160 --all --steps 8 --variants sloth --distributed fsdp2
        run ws1-sloth-ddp 140 --all --steps 8 --variants sloth --distributed ddp ;;
    ws1-2)  # its second call, chained at once onto the same machine: Inductor plain and under FSDP2 (Inductor
        # compiles the plain 8B step for ~130 s; under FSDP2, per-layer graphs: not yet measured, hence the wider
        # limit; limits add to 480 s)
        [ -z "${DRY:-}" ] && timeout 60 python -c "$BURN"
        run ws1-inductor 220 --all --steps 8 --variants inductor
        run ws1-inductor-fsdp2 260 --all --steps 8 --variants inductor --distributed fsdp2 ;;
    ws1-recipes)  # issue 21, next: the two recipes that avoid the masked attention, at world size 1 beside the plain
        # step (the per-layer recipe leaves the final norm and the fused loss to eager; limits add to 440 s)
        [ -z "${DRY:-}" ] && timeout 60 python -c "$BURN"
        run ws1-sloth 130 --all --steps 8 --variants sloth
        run ws1-sloth-fsdp2-per-layer 160 --all --steps 8 --variants sloth --distributed fsdp2-per-layer
        run ws1-sloth-ddp-one-graph 150 --all --steps 8 --variants sloth --distributed ddp-one-graph ;;
    compile-share)  # issue 24: the 8B LoRA step's compile (first warm-up step) with sloth's pass times, and Inductor's
        run compile-sloth 150 --all --warmup 3 --steps 4 --variants sloth
        run compile-inductor 220 --all --warmup 3 --steps 4 --variants inductor ;;
    longest)  # issue 19: the longest context each trains, one step each (sloth with offload, Unsloth)
        for seq in 131072 196608; do
            run "long$((seq / 1024))-offload" 200 --all --batch 1 --seq $seq --grad-ckpt --warmup 1 --steps 1 \
                --variants sloth --sloth-options '{"offload": true, "return_logits": false}'
            run "long$((seq / 1024))-unsloth" 200 --all --batch 1 --seq $seq --grad-ckpt --warmup 1 --steps 1 --variants unsloth
        done ;;
    longest-sloth)  # issue 19: sloth with offload at 128k (one warm-up, one timed step) and 256k tokens (one step, its
        # compile's: the peak and that it trains, not its time); return_logits off, as Unsloth does not return them
        run long128-offload 290 --all --batch 1 --seq 131072 --grad-ckpt --warmup 1 --steps 1 --variants sloth \
            --sloth-options '{"offload": true, "return_logits": false}'
        run long256-offload 300 --all --batch 1 --seq 262144 --grad-ckpt --warmup 0 --steps 1 --variants sloth \
            --sloth-options '{"offload": true, "return_logits": false}' ;;
    long-unsloth)  # issue 19: Unsloth at 16k (4 timed steps) and 64k (one), with room for its import and compile
        # (carry .whl/unsloth; the earlier 130-150 s limits timed out)
        run long16-unsloth 280 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 4 --variants unsloth
        run long64-unsloth 300 --all --batch 1 --seq 65536 --grad-ckpt --warmup 1 --steps 1 --variants unsloth ;;
    longest-2)  # issue 19, next: sloth at 256k with the mask proven by rows (one step, its compile's), Unsloth at
        # 128k (one step; carry .whl/unsloth)
        run long256-offload 420 --all --batch 1 --seq 262144 --grad-ckpt --warmup 0 --steps 1 --variants sloth \
            --sloth-options '{"offload": true, "return_logits": false}'
        run long128-unsloth 170 --all --batch 1 --seq 131072 --grad-ckpt --warmup 0 --steps 1 --variants unsloth ;;
    moe-family)  # issue 20: the moe_experts op against transformers' grouped_mm path and eager loop, then the
        # Qwen3-MoE step with sloth's default options (moe_route on) and with the family off (Unsloth: moe-unsloth)
        [ -z "${DRY:-}" ] && { timeout 120 python -m benchmarks.ops.moe_experts > "$out/logs/moe_experts.log" 2>&1
                               echo "moe_experts: rc $?"; grep -v Warn "$out/logs/moe_experts.log" | tail -12; }
        run moe-sloth 170 --all --model qwen3-moe --variants sloth
        run moe-sloth-no-moe 170 --all --model qwen3-moe --variants sloth --sloth-options \
            '{"patterns": ["layer_norm", "rms_norm", "l2_norm", "rope", "glu", "cross_entropy", "lora", "packed_attention", "causal_mask"]}' ;;
    moe-router)  # issue 20: the moe_router family: its CUDA op checks, the op against the eager router and Inductor,
        # then the Qwen3-MoE step with sloth's default options (the router fused) and with only the router family off
        # (limits add to 530 s; Unsloth: moe-unsloth)
        gpu_tests cuda_ops_router 120 router tests/test_cuda_ops.py
        op_bench moe_router 90 moe_router
        run moe-sloth 160 --all --model qwen3-moe --variants sloth
        run moe-sloth-no-router 160 --all --model qwen3-moe --variants sloth --sloth-options \
            '{"patterns": ["layer_norm", "rms_norm", "l2_norm", "rope", "moe_route", "glu", "cross_entropy", "lora", "packed_attention", "causal_mask", "sink_attention"]}' ;;
    moe-router-ab)  # issue 20: the router family's effect on the Qwen3-MoE step, A/B twice: under CUDA graphs (the GPU's
        # time alone: the host-bound step's wall time moves by more than the op's share between runs), then plain
        # (limits add to 650 s with the op benchmark first)
        op_bench moe_router 90 moe_router
        no_router='{"patterns": ["layer_norm", "rms_norm", "l2_norm", "rope", "moe_route", "glu", "cross_entropy", "lora", "packed_attention", "causal_mask", "sink_attention"]'
        run moe-sloth-cg 140 --all --model qwen3-moe --variants sloth --steps 12 --sloth-options '{"triton.cudagraphs": true}'
        run moe-sloth-cg-no-router 140 --all --model qwen3-moe --variants sloth --steps 12 \
            --sloth-options "$no_router, \"triton.cudagraphs\": true}"
        run moe-sloth-2 140 --all --model qwen3-moe --variants sloth --steps 16
        run moe-sloth-no-router-2 140 --all --model qwen3-moe --variants sloth --steps 16 --sloth-options "$no_router}" ;;
    moe-host)  # issue 20: where the MoE step's GPU waits (its kernel table and idle gaps), then the step under CUDA
        # graphs (the step without its host: what the GPU alone needs)
        run moe-sloth-profile 170 --all --model qwen3-moe --variants sloth --profile
        run moe-sloth-cg 170 --all --model qwen3-moe --variants sloth --sloth-options '{"triton.cudagraphs": true}' ;;
    moe-hostprof)  # issue 20: where the host's time goes in the default-options Qwen3-MoE step: the routers' CUDA
        # and experts' CUDA checks (the kernels of dc4f000 and c5bc3cd, the ungated experts'), 16 plain steps with and without nvidia-smi sampling beside
        # them (does the sampler slow a host-bound step?), a cProfile of two steps with LoRA on attention and with
        # LoRA on the experts too, the plain step again and with the allocator's expandable segments (as Unsloth sets
        # them; every record counts the allocator's driver calls in the timed steps) (SLOTH_TRITON_OP=1 does not take
        # the MoE ops: the moe_route
        # pass's fake propagation mixes fake modes when the op's function is its own fake)
        gpu_tests moe-cuda 110 "router or moe" tests/test_cuda_ops.py
        run moe-sloth-tele 90 --all --model qwen3-moe --variants sloth --steps 16
        run moe-sloth-notele 80 --all --model qwen3-moe --variants sloth --steps 16 --no-telemetry
        run moe-sloth-hostprof 80 --all --model qwen3-moe --variants sloth --host-profile --no-telemetry
        run moe-lora-experts-hostprof 100 --all --model qwen3-moe --lora-experts --variants sloth --host-profile \
            --no-telemetry
        run moe-sloth-notele-2 80 --all --model qwen3-moe --variants sloth --steps 16 --no-telemetry
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run moe-sloth-expandable 80 --all --model qwen3-moe \
            --variants sloth --steps 16 --no-telemetry ;;
    moe-unsloth)  # issue 20: Unsloth's Qwen3-MoE step, to follow moe-family on the same machine (carry .whl/unsloth)
        run moe-unsloth 200 --all --model qwen3-moe --variants unsloth ;;
    tiled)  # issue 19, first call: sloth's CUDA op checks (the tiled MLP's among them), then Llama-3-8B LoRA with
        # checkpointing, offload and the MLP tiled at 16k (beside offload alone, same lease) and 64k tokens
        gpu_tests cuda_ops 150 "" tests/test_cuda_ops.py  # every test of the file (an empty -k selects all)
        run long16-offload 170 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 4 --variants sloth \
            --sloth-options '{"offload": true}'
        run long16-tiled 170 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 4 --variants sloth \
            --sloth-options '{"offload": true, "tiled_mlp": true}'
        run long64-tiled 170 --all --batch 1 --seq 65536 --grad-ckpt --warmup 1 --steps 2 --variants sloth \
            --sloth-options '{"offload": true, "tiled_mlp": true}' ;;
    norm-rope)  # issue 20: the joined q/k norms and RoPE (sloth.norm_rope) and the interleaved RoPE layouts (GPT-J's,
        # DeepSeek-V3's de-interleaving one): their CUDA checks; norm_rope's op timings, then the Qwen3-MoE row
        # without the join (SLOTH_NORM_ROPE=0), with it, and Unsloth's right after (carry .whl)
        gpu_tests norm-rope-cuda 100 "norm_rope or rope_pairs" tests/test_cuda_ops.py
        op_bench norm-rope-op 60 norm_rope
        SLOTH_NORM_ROPE=0 run moe-sloth-unjoined 110 --all --model qwen3-moe --variants sloth --steps 16
        run moe-sloth-joined 110 --all --model qwen3-moe --variants sloth --steps 16
        run moe-unsloth 200 --all --model qwen3-moe --variants unsloth --steps 16 ;;
    moe-versus)  # issue 20: the Qwen3-MoE row with sloth's default options, Unsloth's right after on the same machine,
        # then sloth's again (the host-bound step's time moves between runs: two bracket Unsloth's) (carry .whl)
        run moe-sloth 110 --all --model qwen3-moe --variants sloth --steps 16
        run moe-unsloth 220 --all --model qwen3-moe --variants unsloth --steps 16
        run moe-sloth-2 110 --all --model qwen3-moe --variants sloth --steps 16 ;;
    moe-recompute)  # issue 20: sloth's default MoE row beside moe_recompute (the experts' gate/up formed again in the
        # backward), with and without LoRA on the experts, one machine (H100 of 2026-12-05: 19.18 vs 20.31 GiB)
        run moe-sloth 110 --all --model qwen3-moe --variants sloth --steps 16
        run moe-sloth-recompute 110 --all --model qwen3-moe --variants sloth --steps 16 \
            --sloth-options '{"moe_recompute": true}'
        run moe-lora-experts-recompute 130 --all --model qwen3-moe --lora-experts --variants sloth --steps 16 \
            --sloth-options '{"moe_recompute": true}' ;;
    moe-versus-experts)  # issue 20: the same with LoRA on the experts too, sloth then Unsloth (carry .whl)
        run moe-lora-experts-sloth 130 --all --model qwen3-moe --lora-experts --variants sloth --steps 16
        run moe-lora-experts-unsloth 240 --all --model qwen3-moe --lora-experts --variants unsloth --steps 16 ;;
    moe-diag)  # issue 20: the default-options Qwen3-MoE step, one run: its kernel table and idle gaps, the host syncs
        # of one step and where, a cProfile of two steps, and what is alive at its peak by allocating site
        run moe-sloth-diag 230 --all --model qwen3-moe --variants sloth --profile --host-profile --memory-peak ;;
    moe-new-ops)  # issue 20: the kernels that have only run on an H100 (2026-12-05): the ungated experts at Nemotron-3-Nano's
        # shape and the routers (bias-corrected ones among them) against Inductor (limits add to 200 s)
        op_bench moe_experts_ungated 110 moe_experts --ungated
        op_bench moe_router 90 moe_router ;;
    lean)  # issue 19: the backward rewrites (compiler/lean_backward.py: a recomputed down projection, or tiled MLP,
        # read only for its adapter activations dropped; the MLP's gradients written over gate and up): their CUDA
        # checks, then the 16k checkpointed step with offload and no logits with them (the default; what is alive
        # at its peak) and without (SLOTH_LEAN_BACKWARD=0), then with the tiled MLP (its peak too) (limits add
        # to 450 s)
        gpu_tests lean-cuda 70 "not nothing" tests/test_lean_backward.py
        run mem16k-lean 130 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth \
            --memory-peak --sloth-options '{"offload": true, "return_logits": false}'
        SLOTH_LEAN_BACKWARD=0 run mem16k-lean-off 110 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 \
            --variants sloth --sloth-options '{"offload": true, "return_logits": false}'
        run mem16k-lean-tiled 140 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth \
            --memory-peak --sloth-options '{"offload": true, "return_logits": false, "tiled_mlp": true}' ;;
    lean-mid)  # with mid_layer and the tiled MLP (o_proj not run again either)
        run mem16k-lean-mid-tiled 120 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth \
            --sloth-options '{"offload": {"mid_layer": true}, "return_logits": false, "tiled_mlp": true}' ;;
    lean-peers)  # its second call, chained at once: sloth's default options at 16k (no offload) with and without
        # the rewrites, then Unsloth at 16k (carry .whl)
        run long16k-default 150 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth
        SLOTH_LEAN_BACKWARD=0 run long16k-default-off 150 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 \
            --steps 3 --variants sloth
        run long16k-unsloth 250 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants unsloth ;;
    h200-lean)  # issue 19 on an H200 (2026-12-06): the lean backward's CUDA checks, then the 16k checkpointed step
        # with sloth's default options, with offload and no logits (its peak), with mid_layer and the tiled MLP
        # (limits add to 470 s; Unsloth's row follows in h200-lean-2)
        gpu_tests lean-cuda 70 "not nothing" tests/test_lean_backward.py
        run long16k-default 150 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth
        run mem16k-lean 130 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth \
            --memory-peak --sloth-options '{"offload": true, "return_logits": false}'
        run mem16k-lean-mid-tiled 120 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth \
            --sloth-options '{"offload": {"mid_layer": true}, "return_logits": false, "tiled_mlp": true}' ;;
    h200-lean-2)  # its second call, chained at once (carry .whl): Unsloth at 16k, then sloth at 64k with offload,
        # mid_layer and the tiled MLP (one warm-up, two steps)
        run long16k-unsloth 250 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants unsloth
        run long64-lean-mid-tiled 200 --all --batch 1 --seq 65536 --grad-ckpt --warmup 1 --steps 2 --variants sloth \
            --sloth-options '{"offload": {"mid_layer": true}, "return_logits": false, "tiled_mlp": true}' ;;
    h200-moe)  # issue 20 on an H200: sloth's default Qwen3-MoE row, then Unsloth's right after (carry .whl)
        run moe-sloth 110 --all --model qwen3-moe --variants sloth --steps 16
        run moe-unsloth 220 --all --model qwen3-moe --variants unsloth --steps 16 ;;
    gqa)  # issue 19 (2026-12-06): the gqa_attention family (key / value heads no longer repeated for SDPA): its
        # checks on the GPU, SDPA grouped vs repeated by kernel, then the 16k checkpointed step with offload (its
        # peak), with mid_layer and the tiled MLP, Unsloth's right after; the 2 x 2048 LoRA and the MoE default rows
        # (limits add to 560 s; carry .whl)
        gpu_tests gqa-cuda 60 "bfloat16 or float32" tests/test_gqa_attention_pattern.py
        [ -z "${DRY:-}" ] && { timeout 100 python -m benchmarks.ops.attention > "$out/logs/attention.log" 2>&1
                               echo "attention: rc $?"; grep -E "s16384.*(sdpa-default|cudnn)" "$out/logs/attention.log" | tail -4; }
        run gqa16k-offload 100 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth \
            --memory-peak --sloth-options '{"offload": true, "return_logits": false}'
        run gqa16k-mid-tiled 90 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth \
            --sloth-options '{"offload": {"mid_layer": true}, "return_logits": false, "tiled_mlp": true}'
        run gqa16k-unsloth 110 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants unsloth
        run gqa-lora 70 --all --variants sloth --steps 10
        run gqa-moe 60 --all --model qwen3-moe --variants sloth --steps 16 ;;
    gqa-short)  # the gqa part without the kernel table and Unsloth's row (for a call with ~6 min of device time
        # left; limits add to 380 s)
        gpu_tests gqa-cuda 50 "bfloat16" tests/test_gqa_attention_pattern.py
        run gqa16k-offload 90 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth \
            --sloth-options '{"offload": true, "return_logits": false}'
        run gqa16k-mid-tiled 100 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth \
            --memory-peak --sloth-options '{"offload": {"mid_layer": true}, "return_logits": false, "tiled_mlp": true}'
        run gqa-lora 75 --all --variants sloth --steps 10
        run gqa-moe 65 --all --model qwen3-moe --variants sloth --steps 16 ;;
    gqa-2)  # the second call after gqa (2026-12-06): its GPU checks again (the first call's failed on the missing
        # backend name, fixed in tests/conftest.py), what is alive at the mid_layer + tiled peak, and the MoE default
        # row with Unsloth's right after (limits add to 540 s; carry .whl)
        gpu_tests gqa-cuda 60 "bfloat16 or float32" tests/test_gqa_attention_pattern.py
        run gqa16k-mid-tiled-peak 150 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 2 --variants sloth \
            --memory-peak --sloth-options '{"offload": {"mid_layer": true}, "return_logits": false, "tiled_mlp": true}'
        run gqa-moe 110 --all --model qwen3-moe --variants sloth --steps 16
        run gqa-moe-unsloth 220 --all --model qwen3-moe --variants unsloth --steps 16 ;;
    mem16k-mid)  # issue 19: offload's mid_layer (the residual between attention and MLP saved and offloaded, so the
        # backward recomputes the attention after the MLP's backward) at 16k, what is alive at each peak, with and
        # without the tiled MLP (17.81 GiB offload + tiled on the H100 of 2026-12-05)
        run mem16k-mid 200 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 2 --variants sloth \
            --memory-peak --sloth-options '{"offload": {"mid_layer": true}, "return_logits": false}'
        run mem16k-mid-tiled 200 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 2 --variants sloth \
            --memory-peak --sloth-options '{"offload": {"mid_layer": true}, "return_logits": false, "tiled_mlp": true}' ;;
    mem16k|mem16k-offload)  # issue 19 (mem16k-offload: without the tiled row): what is alive at the 16k step's peak, by allocating site (e2e --memory-peak): sloth with
        # offload and no logits, and with the MLP tiled too (18.05 GiB on 2026-12-02, 2.5 GiB above the weights);
        # first the offload's device check (the staging slots released in the backward, ac283ba, not yet on a GPU)
        [ -z "${DRY:-}" ] && timeout 90 python -m benchmarks.offload_check > "$out/logs/offload_check.log" 2>&1
        [ -z "${DRY:-}" ] && echo "offload_check: rc $?" && tail -c 300 "$out/logs/offload_check.log"
        run mem16k-offload 200 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 2 --variants sloth \
            --memory-peak --sloth-options '{"offload": true, "return_logits": false}'
        [ "$part" = mem16k-offload ] || run mem16k-tiled 200 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 2 --variants sloth \
            --memory-peak --sloth-options '{"offload": true, "return_logits": false, "tiled_mlp": true}' ;;
    long128)  # issue 19 (carry .whl/unsloth, after a call that installed bitsandbytes): both parts below
        long128_unsloth; long128_sloth ;;
    long128-unsloth)  # Unsloth at 128k tokens, one step (the peak, and that it trains)
        long128_unsloth ;;
    long128-sloth)  # sloth (offload, tiled MLP) at 128k tokens, one step (its compile's)
        long128_sloth ;;
    long256-sloth)  # issue 19, the longest context: sloth (offload, tiled MLP) at 256k tokens, one step (its compile's;
        # 420 s were not enough on 2026-12-03: a call of its own, limit 600)
        run long256-tiled 570 --all --batch 1 --seq 262144 --grad-ckpt --warmup 0 --steps 1 --variants sloth \
            --sloth-options '{"offload": true, "tiled_mlp": true, "return_logits": false}' ;;
    long256-unsloth)  # Unsloth at 256k tokens, one step (carry .whl/unsloth)
        run long256-unsloth 570 --all --batch 1 --seq 262144 --grad-ckpt --warmup 0 --steps 1 --variants unsloth ;;
    long-l4-sloth)  # issue 19, how a step's peak grows with context, where a 32-layer step is too slow for one call
        # (512k tokens: ~700 s): Llama-3-8B cut to 4 layers (the 32-layer peak adds 28 layers' weights and adapter
        # state, a fixed sum), sloth with offload, tiled MLP and no logits, at 256k and 512k tokens, one step each
        run long256-L4-sloth 200 --all --layers 4 --batch 1 --seq 262144 --grad-ckpt --warmup 0 --steps 1 \
            --variants sloth --sloth-options '{"offload": true, "tiled_mlp": true, "return_logits": false}'
        run long512-L4-sloth 390 --all --layers 4 --batch 1 --seq 524288 --grad-ckpt --warmup 0 --steps 1 \
            --variants sloth --sloth-options '{"offload": true, "tiled_mlp": true, "return_logits": false}' ;;
    long-l4-unsloth)  # the same for Unsloth (carry .whl/unsloth)
        run long256-L4-unsloth 200 --all --layers 4 --batch 1 --seq 262144 --grad-ckpt --warmup 0 --steps 1 \
            --variants unsloth
        run long512-L4-unsloth 390 --all --layers 4 --batch 1 --seq 524288 --grad-ckpt --warmup 0 --steps 1 \
            --variants unsloth ;;
    gpt-oss)  # issue 20: GPT-OSS-20B cut to 8 layers (its attention eager: sinks have no SDPA path), LoRA r=16 on
        # attention, bs 2 x 2048: eager and Inductor, then sloth (not yet run; limits add to 560 s)
        run gpt-oss-peers 400 --all --model gpt-oss-20b --layers 8 --variants eager,inductor
        run gpt-oss-sloth 160 --all --model gpt-oss-20b --layers 8 --variants sloth ;;
    gpt-oss-sinks)  # issue 20: the sink_attention family: its CUDA op checks, the op against the eager math at
        # GPT-OSS-20B's attention, then the GPT-OSS step with sloth's default options (limits add to 460 s)
        gpu_tests cuda_ops_sink 150 sink tests/test_cuda_ops.py
        op_bench sink_attention 130 sink_attention
        run gpt-oss-sloth 180 --all --model gpt-oss-20b --layers 8 --variants sloth ;;
    gpt-oss-peers)  # its peers on the same machine: eager and Inductor (then gpt-oss-unsloth)
        run gpt-oss-peers 400 --all --model gpt-oss-20b --layers 8 --variants eager,inductor ;;
    gpt-oss-unsloth)  # Unsloth's GPT-OSS step, to follow gpt-oss on the same machine (carry .whl; not yet run)
        run gpt-oss-unsloth 300 --all --model gpt-oss-20b --layers 8 --variants unsloth ;;
    moe-gpt-oss)  # issue 20: the moe_experts op at GPT-OSS-20B's experts (biases, interleaved, clamped GLU, transposed)
        # beside transformers' grouped_mm path, then at Qwen3-MoE's (the default path), after the MoE CUDA op checks
        # (limits add to 300 s)
        gpu_tests cuda_ops_moe 120 moe tests/test_cuda_ops.py
        op_bench moe_experts_gpt_oss 100 moe_experts --gpt-oss
        op_bench moe_experts 80 moe_experts ;;
    moe-lora)  # issue 20: LoRA on the experts as the op's factors: the CUDA MoE checks (LoRA's among them) and torch
        # 2.11's Dynamo on sloth's peft polyfill (one graph), the op with LoRA r=16 at Qwen3-MoE's shape and GPT-OSS's
        # op (the segment-sum bias gradients), then the Qwen3-MoE step with LoRA on attention + experts, sloth
        # (limits add to 560 s)
        gpu_tests cuda_ops_moe_lora 150 "moe or graph or first" tests/test_cuda_ops.py tests/test_peft_experts.py
        op_bench moe_experts_lora 80 moe_experts --lora
        op_bench moe_experts_gpt_oss 100 moe_experts --gpt-oss
        run moe-lora-experts-sloth 220 --all --model qwen3-moe --lora-experts --variants sloth ;;
    moe-lora-peers)  # its peers, chained onto the same machine (carry .whl: Unsloth's set and bitsandbytes): eager and
        # Inductor (peft's own forward, graph breaks and all), then Unsloth's MoE path (limits add to 570 s)
        run moe-lora-experts-peers 330 --all --model qwen3-moe --lora-experts --variants eager,inductor
        run moe-lora-experts-unsloth 240 --all --model qwen3-moe --lora-experts --variants unsloth ;;
    long256-l4)  # long-l4-sloth and long-l4-unsloth at 256k only, one call (carry .whl: the bitsandbytes wheel cut to
        # its CPU and CUDA 13.0 libraries by benchmarks/unsloth_wheels.sh, and .whl/unsloth; limits add to 400 s)
        run long256-L4-sloth 200 --all --layers 4 --batch 1 --seq 262144 --grad-ckpt --warmup 0 --steps 1 \
            --variants sloth --sloth-options '{"offload": true, "tiled_mlp": true, "return_logits": false}'
        run long256-L4-unsloth 200 --all --layers 4 --batch 1 --seq 262144 --grad-ckpt --warmup 0 --steps 1 \
            --variants unsloth ;;
    next-19)  # issue 19: what the attention backward in head chunks (default since 2026-12-06,
        # compiler/attention_chunks.py) does at 64k (mid_layer, tiled MLP, no logits), then 16k with 2048-row MLP
        # blocks, then the chunks' CUDA tests (limits add to 570 s: a fresh machine's cold caches need them; then
        # next-19-unsloth on the same machine; carry .whl)
        run next19-64k 290 --all --batch 1 --seq 65536 --grad-ckpt --warmup 1 --steps 2 --variants sloth \
            --sloth-options '{"offload": {"mid_layer": true}, "return_logits": false, "tiled_mlp": true}'
        run next19-16k-2048 190 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth \
            --sloth-options '{"offload": {"mid_layer": true}, "return_logits": false, "tiled_mlp": 2048}'
        gpu_tests attention-chunks-cuda 90 "" tests/test_attention_chunks.py ;;
    next-19-unsloth)  # Unsloth's 64k and 16k rows, right after next-19 on the same machine (limits add to 375 s)
        run next19-64k-unsloth 200 --all --batch 1 --seq 65536 --grad-ckpt --warmup 1 --steps 1 --variants unsloth
        run next19-16k-unsloth 175 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants unsloth ;;
    chunks-16k)  # issue 19 (2026-12-06): the 16k step with the attention backward in head chunks, what is alive at its
        # peak, the chunks' CUDA checks, then Unsloth's row (limits add to 495 s; carry .whl)
        run next19-chunks 230 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants sloth \
            --memory-peak --sloth-options '{"offload": {"mid_layer": true}, "return_logits": false, "tiled_mlp": true}'
        gpu_tests attention-chunks-cuda 90 "" tests/test_attention_chunks.py
        run next19-unsloth 175 --all --batch 1 --seq 16384 --grad-ckpt --warmup 2 --steps 3 --variants unsloth ;;
    next-20)  # issue 20, for the next call: the Qwen3-MoE row with sloth's defaults, with moe_recompute and no
        # logits (the memory target's options), then Unsloth's right after (limits add to 540 s; carry .whl)
        run next20-default 170 --all --model qwen3-moe --variants sloth --steps 16
        run next20-lean 150 --all --model qwen3-moe --variants sloth --steps 16 \
            --sloth-options '{"moe_recompute": true, "return_logits": false}'
        run next20-unsloth 220 --all --model qwen3-moe --variants unsloth --steps 16 ;;
    grouped-gemm)  # issue 20 (2026-12-06): lowering/grouped_gemm.py's CUDA checks (the op on both GEMM backends, the
        # kernels), torch._grouped_mm against the Triton grouped GEMM GEMM by GEMM at three MoE shapes, then the
        # Qwen3-MoE step with each (limits add to 570 s on a cold machine)
        gpu_tests grouped-gemm-cuda 110 "moe_experts or grouped" tests/test_grouped_gemm.py tests/test_cuda_ops.py
        [ -n "${DRY:-}" ] || { timeout 130 python -m benchmarks.ops.grouped_gemm > "$out/logs/grouped_gemm.log" 2>&1
                               echo "grouped_gemm: rc $?"; grep -E "^\{" "$out/logs/grouped_gemm.log"; }
        run grouped-moe-default 165 --all --model qwen3-moe --variants sloth --steps 16
        SLOTH_MOE_GEMM=triton run grouped-moe-triton 165 --all --model qwen3-moe --variants sloth --steps 16 ;;
    grouped-gemm-2)  # issue 20 (2026-12-06): the checks again (fp32 summed in two levels, tiles fitted to the
        # device), the default step ("mixed": the gathered GEMMs in Triton), the memory target's options with the q/k
        # norms recomputed and the peak's contents, then the default step with torch._grouped_mm only
        gpu_tests grouped-gemm-cuda 100 "moe_experts or grouped" tests/test_grouped_gemm.py tests/test_cuda_ops.py
        SLOTH_NORM_ROPE_RECOMPUTE=1 run grouped2-lean-nr 140 --all --model qwen3-moe --variants sloth --steps 12 \
            --memory-peak --sloth-options '{"moe_recompute": true, "return_logits": false}'
        run grouped2-default 120 --all --model qwen3-moe --variants sloth --steps 16
        SLOTH_MOE_GEMM=grouped_mm run grouped2-grouped-mm 100 --all --model qwen3-moe --variants sloth --steps 16 ;;
    layout-20)  # issue 20 (2026-12-06 afternoon): rope and norm_rope write q and k in the projection's [b, s, h, d]
        # memory (bshd_out), so the attention's output needs no copy: their CUDA checks, the default MoE step with
        # the peak's contents, the memory target's options (limits add to 540 s on a cold machine)
        gpu_tests bshd-cuda 150 "rope or bshd" tests/test_cuda_ops.py
        run layout-moe-default 160 --all --model qwen3-moe --variants sloth --steps 16 --memory-peak
        SLOTH_NORM_ROPE_RECOMPUTE=1 run layout-moe-lean 140 --all --model qwen3-moe --variants sloth --steps 12 \
            --sloth-options '{"moe_recompute": true, "return_logits": false}' ;;
    layout-20-peers)  # its second call, chained at once (carry .whl): Unsloth's MoE row, then sloth's 8B LoRA default
        # row (the dense step's attention outputs; limits add to 400 s)
        run layout-moe-unsloth 200 --all --model qwen3-moe --variants unsloth --steps 16
        run layout-lora-default 200 --all --steps 10 --variants sloth ;;
    moe-final)  # issue 20: the Qwen3-MoE row (LoRA on attention) in one call: eager, Inductor, sloth with its default
        # options, then Unsloth right after (limits add to 570 s on a cold machine; carry .whl)
        run moe-final-peers 300 --all --model qwen3-moe --variants eager,inductor --steps 12
        run moe-final-sloth 120 --all --model qwen3-moe --variants sloth --steps 16
        run moe-final-unsloth 150 --all --model qwen3-moe --variants unsloth --steps 16 ;;
    moe-final-experts)  # its second call, chained at once: LoRA on attention and experts, sloth (the mixed GEMMs, its
        # default since 2026-12-06) then Unsloth, then the q/k norms recomputed (SLOTH_NORM_ROPE_RECOMPUTE=1, last timed
        # before q and k kept the projection's layout) beside the default MoE row (limits add to 570 s)
        run moe-final-experts-sloth 150 --all --model qwen3-moe --lora-experts --variants sloth --steps 12
        run moe-final-experts-unsloth 180 --all --model qwen3-moe --lora-experts --variants unsloth --steps 12
        SLOTH_NORM_ROPE_RECOMPUTE=1 run moe-final-norm-rope-recompute 110 --all --model qwen3-moe --variants sloth \
            --steps 16
        run moe-final-sloth-again 110 --all --model qwen3-moe --variants sloth --steps 16 ;;
    moe-close)  # issue 20's rows in one call, for a lease with little device time: sloth's default MoE row, Unsloth's,
        # both with LoRA on the experts, then eager and Inductor (the run wall times of 2026-12-06 add to ~400 s; the
        # limits to 620, so an outer timeout cuts the peers first; carry .whl)
        run close-sloth 100 --all --model qwen3-moe --variants sloth --steps 16
        run close-unsloth 140 --all --model qwen3-moe --variants unsloth --steps 16
        run close-experts-sloth 90 --all --model qwen3-moe --lora-experts --variants sloth --steps 12
        run close-experts-unsloth 140 --all --model qwen3-moe --lora-experts --variants unsloth --steps 12
        run close-peers 150 --all --model qwen3-moe --variants eager,inductor --steps 12 ;;
    moe-route)  # issue 20: the counting-sort dispatch (lowering/moe_routing.py): its CUDA checks and the MoE ops', then the
        # MoE step with it (the default) and with SLOTH_MOE_ROUTE=sort (the PyTorch ops), and both at 1 x 128 tokens,
        # where the step is its host's time (limits add to 460 s). Not the GPT-OSS-20B-shaped check: beside three other
        # test processes it ran out of an H100's 80 GB (2026-12-06); moe-gpt-oss runs it.
        gpu_tests moe-route-cuda 130 "moe_routing or moe_experts_on_cuda or moe_lora" tests/test_cuda_ops.py
        run route-counting 100 --all --model qwen3-moe --variants sloth --steps 16
        SLOTH_MOE_ROUTE=sort run route-sort 90 --all --model qwen3-moe --variants sloth --steps 16
        run route-counting-host 70 --all --model qwen3-moe --batch 1 --seq 128 --variants sloth --steps 30 --no-telemetry
        SLOTH_MOE_ROUTE=sort run route-sort-host 70 --all --model qwen3-moe --batch 1 --seq 128 --variants sloth \
            --steps 30 --no-telemetry ;;
    moe-mixed-checks)  # the op's CUDA checks with LoRA on the experts through the mixed GEMMs (limits add to 120 s)
        gpu_tests moe-lora-cuda 120 "moe_lora or moe_experts" tests/test_cuda_ops.py ;;
    moe-experts-now)  # issue 20 in one call: the op's CUDA checks with LoRA on the experts (mixed GEMMs among them),
        # the Qwen3-MoE step with LoRA on attention and experts, sloth (the mixed GEMMs, default since 2026-12-06) and
        # with _grouped_mm for every expert GEMM, then Unsloth (limits add to 540 s; carry .whl)
        gpu_tests moe-lora-cuda 110 "moe_lora" tests/test_cuda_ops.py
        run experts-now-sloth 140 --all --model qwen3-moe --lora-experts --variants sloth --steps 12
        SLOTH_MOE_GEMM=grouped_mm run experts-now-grouped-mm 100 --all --model qwen3-moe --lora-experts \
            --variants sloth --steps 12
        run experts-now-unsloth 190 --all --model qwen3-moe --lora-experts --variants unsloth --steps 12 ;;
    moe-experts-short)  # moe-experts-now without Unsloth's row, for a call with little device time (limits add to 310 s)
        gpu_tests moe-lora-cuda 100 "moe_lora" tests/test_cuda_ops.py
        run experts-now-sloth 120 --all --model qwen3-moe --lora-experts --variants sloth --steps 12
        SLOTH_MOE_GEMM=grouped_mm run experts-now-grouped-mm 90 --all --model qwen3-moe --lora-experts \
            --variants sloth --steps 12 ;;
    long320-l4)  # issue 19, the longest context on one H100 (2026-12-06): 4 layers at 320k tokens, sloth then
        # Unsloth (estimated from the 256k rows: sloth ~48 GiB, Unsloth ~83 GiB, past the H100's 79; limits add to
        # 480 s; carry .whl)
        run long320-L4-sloth 260 --all --layers 4 --batch 1 --seq 327680 --grad-ckpt --warmup 0 --steps 1 \
            --variants sloth --sloth-options '{"offload": true, "tiled_mlp": true, "return_logits": false}'
        run long320-L4-unsloth 220 --all --layers 4 --batch 1 --seq 327680 --grad-ckpt --warmup 0 --steps 1 \
            --variants unsloth ;;
    long512-l4)  # long-l4-sloth and long-l4-unsloth at 512k only, one call (carry .whl/unsloth; limits add to 580 s)
        run long512-L4-sloth 300 --all --layers 4 --batch 1 --seq 524288 --grad-ckpt --warmup 0 --steps 1 \
            --variants sloth --sloth-options '{"offload": true, "tiled_mlp": true, "return_logits": false}'
        run long512-L4-unsloth 280 --all --layers 4 --batch 1 --seq 524288 --grad-ckpt --warmup 0 --steps 1 \
            --variants unsloth ;;
    heads)  # issue 22: the fused loss against TRL 1.16's fused LM head (carry .whl/trl-1.16.0-*.whl; Liger's row needs
        # its wheel), then whether a residual add fused into the RMSNorm would pay (limits add to 290 s)
        op_bench cross_entropy 200 cross_entropy
        op_bench residual_norm 90 residual_norm ;;
    ws1-fsdp2)  # issue 21, after the proven-mask machinery: the plain step and FSDP2 at world size 1 (290 s)
        run ws1-sloth 130 --all --steps 8 --variants sloth
        run ws1-sloth-fsdp2 160 --all --steps 8 --variants sloth --distributed fsdp2 ;;
    ws1-again)  # issue 21, after the DDP-split fixes (each piece's own meta, masks proven across pieces): the plain
        # step, DDP, and FSDP2 with 8 warm-up steps (its steps were still falling after 3 on 2026-12-03; 500 s)
        run ws1-sloth 130 --all --steps 8 --variants sloth
        run ws1-sloth-ddp 160 --all --steps 8 --variants sloth --distributed ddp
        run ws1-sloth-fsdp2 210 --all --warmup 8 --steps 8 --variants sloth --distributed fsdp2 ;;
    norms)  # issue 22: LayerNorm against Inductor and Liger's LayerNorm, dW/db on and off, 3 shapes (~72 timings);
        # the L2 norm against Inductor, q/k heads and full rows (18); limits add to 145 s
        op_bench layer_norm 100 layer_norm
        op_bench l2_norm 45 l2_norm ;;
    glu-hidden)  # the glu_lora backward's hidden from the GLU backward (default) vs recomputed: bits and op time at
        # the 8B shape (benchmarks/ops/glu_lora_backward.py)
        [ -z "${DRY:-}" ] && { timeout 90 python -m benchmarks.ops.glu_lora_backward > "$out/logs/glu_lora_backward.log" 2>&1
                               echo "glu_lora_backward: rc $?"; grep -v Warn "$out/logs/glu_lora_backward.log"; } ;;
    glu-hidden-steps)  # the steps both ways on one lease (SLOTH_GLU_LORA_FUSED_HIDDEN=0: recomputed)
        run qlora-sloth 140 --all --qlora --steps 20 --variants sloth --sloth-options "$SLOTH"
        SLOTH_GLU_LORA_FUSED_HIDDEN=0 run qlora-sloth-recompute 110 --all --qlora --steps 20 --variants sloth --sloth-options "$SLOTH"
        run lora-sloth 100 --all --steps 20 --variants sloth --sloth-options "$SLOTH"
        SLOTH_GLU_LORA_FUSED_HIDDEN=0 run lora-sloth-recompute 90 --all --steps 20 --variants sloth --sloth-options "$SLOTH" ;;
    guards)  # sloth LoRA and QLoRA with Dynamo's module guards skipped (e2e --guard-filter; benchmarks/guard_cost.py)
        run lora-sloth-guards 130 --all --variants sloth --sloth-options "$SLOTH" --guard-filter skip-nn-modules
        run qlora-sloth-guards 150 --all --qlora --variants sloth --sloth-options "$SLOTH" --guard-filter skip-nn-modules ;;
    nosplit)  # the down kernels in tf32x3 instead of a factor split launch (SLOTH_LORA_DOWN_SPLIT=0), beside the default
        run lora-sloth 120 --all --variants sloth --sloth-options "$SLOTH"
        export SLOTH_LORA_DOWN_SPLIT=0
        run lora-sloth-nosplit 120 --all --variants sloth --sloth-options "$SLOTH"
        run qlora-sloth-nosplit 140 --all --qlora --variants sloth --sloth-options "$SLOTH"
        [ -z "${DRY:-}" ] && { timeout 150 python -m benchmarks.ops.lora_insitu --only down > "$out/logs/insitu-down-nosplit.log" 2>&1
                               echo "lora_insitu down, tf32x3: rc $?"; grep -E "shipped" "$out/logs/insitu-down-nosplit.log"; }
        unset SLOTH_LORA_DOWN_SPLIT ;;
    lora-nosplit)  # one row of nosplit each, to pair with a versus on one lease within the 10-minute limit
        SLOTH_LORA_DOWN_SPLIT=0 run lora-sloth-nosplit 120 --all --variants sloth --sloth-options "$SLOTH" ;;
    qlora-nosplit)
        SLOTH_LORA_DOWN_SPLIT=0 run qlora-sloth-nosplit 140 --all --qlora --variants sloth --sloth-options "$SLOTH" ;;
    cg)  # sloth LoRA and QLoRA under CUDA graphs: the step without the host (bound by the host otherwise)
        run lora-sloth-cg 150 --all --variants sloth --sloth-options "$SLOTH_CG"
        run qlora-sloth-cg 160 --all --qlora --variants sloth --sloth-options "$SLOTH_CG" ;;
    idle)  # where each step's GPU waits (e2e --profile: the gaps between kernels), sloth beside Unsloth
        run lora-sloth 150 --all --variants sloth --sloth-options "$SLOTH" --profile
        run qlora-sloth 160 --all --qlora --variants sloth --sloth-options "$SLOTH" --profile
        run qlora-unsloth 180 --all --qlora --variants unsloth --profile ;;
    qlora-profile)
        run qlora-sloth 200 --all --qlora --variants sloth --sloth-options "$SLOTH" --profile ;;
    profile)
        run lora-unsloth 270 --all --variants unsloth --profile
        run lora-sloth 200 --all --variants sloth --sloth-options "$SLOTH" --profile ;;
    launch)  # how sloth's ops are launched (lowering/registration.py), each with its kernel and host tables
        run lora-sloth 200 --all --variants sloth --sloth-options "$SLOTH" --profile
        export SLOTH_TRITON_OP=1
        run lora-sloth-triton-op 230 --all --variants sloth --sloth-options "$SLOTH" --profile
        unset SLOTH_TRITON_OP
        run lora-sloth-cg 150 --all --variants sloth --sloth-options "$SLOTH_CG" ;;
    versus)  # one lease for sloth and Unsloth (their host CPUs differ from lease to lease)
        run lora-sloth 120 --all --variants sloth --sloth-options "$SLOTH"
        run lora-unsloth 150 --all --variants unsloth
        run qlora-sloth 140 --all --qlora --variants sloth --sloth-options "$SLOTH"
        run qlora-unsloth 180 --all --qlora --variants unsloth ;;
    qlora-recheck)
        run qlora-sloth 200 --all --qlora --variants sloth --sloth-options "$SLOTH" ;;
    recheck)  # after launch-count changes; the 4-layer pair says whether triton_op compiles and what it saves
        run lora-sloth 130 --all --variants sloth --sloth-options "$SLOTH"
        run qlora-sloth 130 --all --qlora --variants sloth --sloth-options "$SLOTH"
        run l4-custom-op 90 --all --variants sloth --layers 4 --sloth-options "$SLOTH" --profile
        export SLOTH_TRITON_OP=1
        run l4-triton-op 150 --all --variants sloth --layers 4 --sloth-options "$SLOTH" --profile
        unset SLOTH_TRITON_OP ;;
    hostprof)  # where the host's time goes in sloth's LoRA and QLoRA steps (cProfile of two steps each)
        run lora-sloth-hostprof 150 --all --variants sloth --sloth-options "$SLOTH" --host-profile
        run qlora-sloth-hostprof 170 --all --qlora --variants sloth --sloth-options "$SLOTH" --host-profile ;;
    host)  # host time per Triton launch and per op call (benchmarks/launch_overhead.py), the joined LoRA op alone
        launch_overhead
        [ -z "${DRY:-}" ] && { timeout 200 python -m benchmarks.ops.lora_shared > "$out/logs/ops-lora-shared.log" 2>&1
                               echo "ops.lora_shared: rc $?"; grep -E "fwd\+bwd" "$out/logs/ops-lora-shared.log" | tail -8; }
        ;;
    launch-overhead)  # host us per Triton launch and per op call only (the first half of host)
        launch_overhead ;;
    gemm)  # NF4 dequantised inside the matmul's main loop vs into a buffer then cuBLAS (issue 6 asks for both)
        [ -z "${DRY:-}" ] && { timeout 200 python -m benchmarks.ops.qlora_gemm > "$out/logs/qlora_gemm.log" 2>&1
                               echo "qlora_gemm: rc $?"; tail -30 "$out/logs/qlora_gemm.log"; } ;;
    insitu)  # the up_add kernel at the step's shapes and strides (benchmarks/ops/lora_insitu.py), candidates beside
        [ -z "${DRY:-}" ] && { timeout 150 python -m benchmarks.ops.lora_insitu --only up_add > "$out/logs/insitu.log" 2>&1
                               echo "lora_insitu: rc $?"; grep -v "^  " "$out/logs/insitu.log" | tail -22; } ;;
    insitu-down)  # the down kernel at the step's shapes, split-K candidates beside (benchmarks/ops/lora_insitu.py)
        [ -z "${DRY:-}" ] && { timeout 300 python -m benchmarks.ops.lora_insitu --only down > "$out/logs/insitu-down.log" 2>&1
                               echo "lora_insitu down: rc $?"; grep -v "^  " "$out/logs/insitu-down.log" | tail -22; } ;;
    nf4)  # NF4/FP4 dequantisation bits vs bitsandbytes, and its time
        [ -z "${DRY:-}" ] && { timeout 120 python -m benchmarks.ops.nf4 > "$out/logs/nf4.log" 2>&1
                               echo "nf4: rc $?"; tail -4 "$out/logs/nf4.log"; } ;;
    long)
        run long 560 --all --batch 1 --seq 16384 --grad-ckpt --variants inductor,sloth --sloth-options "$SLOTH" ;;
    long-sloth)
        run long-sloth 240 --all --batch 1 --seq 16384 --grad-ckpt --variants sloth --sloth-options "$SLOTH" ;;
    *) echo "unknown part $part"; exit 2 ;;
esac
done
# logs.tgz, or logs-<time>.tgz where an earlier part list in the same $OUT left one (one device call, two lists)
archive=logs.tgz
[ -e "$out/$archive" ] && archive=logs-$(date +%H%M%S).tgz
[ -z "${DRY:-}" ] && (cd "$out" && tar czf "$archive" logs && rm -rf logs)
# At most 8 files come back: the markdown tables (each made again from its JSON) travel as one archive.
[ -z "${DRY:-}" ] && [ "$(ls "$out" | wc -l)" -gt 8 ] && (cd "$out" && tar czf tables.tgz ./*.md && rm -f ./*.md)
exit 0
