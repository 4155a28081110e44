"""MoE experts benchmark: transformers' eager expert loop and its grouped_mm path against sloth's op.

    python -m benchmarks.ops.moe_experts [--smoke] [--gpt-oss | --lora | --ungated]

Qwen3-30B-A3B (Qwen3-MoE) shape: 4096 tokens, H=2048, I=768, E=128 experts, top-8, bf16, SwiGLU; uniform random
routing. The op is GEMM-bound: FLOPs fwd 6 S H I (S = T K assignments: gate_up 4 S H I, down 2 S H I), bwd about
twice that (12 S H I with the weight gradients), so a TFLOP/s column is added. Minimal bytes (the "% copy"
columns): the expert weights once (3 E I H e) plus x and out (2 T H e) forward, twice that backward.
No inductor provider: Dynamo breaks the eager loop's graph at its data-dependent ``nonzero``.

``--gpt-oss``: GPT-OSS-20B's experts instead (H=2880, I=2880, E=32, top-4): weights stored transposed
(``[E, H, 2I]``, ``[E, I, H]``), biases on both GEMMs, gate/up interleaved, the clamped GLU (alpha 1.702, limit 7),
as transformers' ``GptOssExperts`` computes them and as sloth's op takes them (transposed views, ``swiglu_oai``).

``--lora``: the Qwen3-MoE shape with LoRA r=16 on both expert weights (peft's ``target_parameters``), the experts
frozen and the adapters training: peft's way (the merged weight ``baddbmm(W, B, A)`` each step, then transformers'
grouped_mm path), sloth's op on that merged weight (sloth before the factors), and sloth's op on the factors (what
the pattern now gives it). FLOPs and bytes columns count the base experts only.

``--ungated``: Nemotron-3-Nano's experts (transformers' ``NemotronHExperts``, ``has_gate=False``): H=2688, I=1856,
E=128, top-6, ``up_proj [E, I, H]``, ``down_proj [E, H, I]``, ``h = relu(u)^2`` (the op's ``gated=False``, "relu2").
FLOPs: 4 S H I forward (two GEMMs of S H I), so the TFLOP/s column counts 2/3 of a gated expert's; bytes: the two
weights once (2 E I H e) plus x and out.
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import common
from benchmarks.ops import harness


def _transformers_grouped(x, index, weights, gate_up, down):
    """transformers 5.x's ``grouped_mm`` experts forward (sort, histc, ``torch._grouped_mm``, un-permute) on these
    weights: what a user's MoE runs without sloth, under ``config._experts_implementation = "grouped_mm"``."""
    import types

    import torch.nn.functional as F
    from transformers.integrations.moe import _default_apply_gate, grouped_mm_experts_forward

    experts = types.SimpleNamespace(gate_up_proj=gate_up, down_proj=down, num_experts=gate_up.shape[0], has_gate=True,
                                    has_bias=False, is_transposed=False, has_post_expert_norm=False,
                                    _is_expert_parallel=False, act_fn=F.silu)
    experts._apply_gate = lambda gate_up_out: _default_apply_gate(experts, gate_up_out)
    return grouped_mm_experts_forward(experts, x, index, weights)


def _transformers_gpt_oss(x, index, weights, gate_up, down, gate_up_bias, down_bias):
    """transformers 5.x's ``grouped_mm`` forward as ``GptOssExperts`` runs it: transposed weights, biases, its
    ``_apply_gate`` (interleaved gate/up, clamps, ``(up + 1)``)."""
    import types

    from transformers.integrations.moe import grouped_mm_experts_forward
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = types.SimpleNamespace(gate_up_proj=gate_up, down_proj=down, gate_up_proj_bias=gate_up_bias,
                                    down_proj_bias=down_bias, num_experts=gate_up.shape[0], has_gate=True,
                                    has_bias=True, is_transposed=True, has_post_expert_norm=False,
                                    _is_expert_parallel=False, alpha=1.702, limit=7.0)
    experts._apply_gate = lambda gate_up_out: GptOssExperts._apply_gate(experts, gate_up_out)
    return grouped_mm_experts_forward(experts, x, index, weights)


def _transformers_ungated(x, index, weights, up, down):
    """transformers 5.x's ``grouped_mm`` forward as ``NemotronHExperts`` runs it: no gate, relu2 on the up GEMM."""
    import types

    from transformers.integrations.moe import grouped_mm_experts_forward

    experts = types.SimpleNamespace(up_proj=up, down_proj=down, num_experts=up.shape[0], has_gate=False,
                                    has_bias=False, is_transposed=False, has_post_expert_norm=False,
                                    _is_expert_parallel=False, act_fn=lambda u: torch.relu(u).square())
    return grouped_mm_experts_forward(experts, x, index, weights)


def _gpt_oss_providers():
    """(name -> fn of x, index, weights, gate_up [E, H, 2I], down [E, I, H], gate_up_bias, down_bias)."""
    from sloth.lowering.moe import moe_experts, moe_experts_pattern

    def views(fn):
        return lambda x, i, w, gu, d, b1, b2: fn(x, i, w, gu.transpose(1, 2), d.transpose(1, 2), "swiglu_oai", b1, b2,
                                                 interleaved=True, alpha=1.702, limit=7.0)
    return {"eager": views(moe_experts_pattern), "transformers grouped_mm": _transformers_gpt_oss,
            "sloth": views(moe_experts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpt-oss", action="store_true", help="GPT-OSS-20B's experts (see the docstring)")
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 on Qwen3-MoE's experts (see the docstring)")
    parser.add_argument("--ungated", action="store_true", help="Nemotron-3-Nano's relu2 experts (see the docstring)")
    args, device = harness.start(__doc__, argv, parser)
    from sloth.lowering.moe import moe_experts, moe_experts_pattern

    if args.gpt_oss:
        return _main_gpt_oss(args, device)
    if args.lora:
        return _main_lora(args, device)
    if args.ungated:
        return _main_ungated(args, device)
    T, H, I, E, K = (13, 24, 20, 5, 2) if args.smoke else (4096, 2048, 768, 128, 8)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gen, index, weights, x = _routed_tokens(T, H, E, K, device, dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(device, dtype).requires_grad_()
    down = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(device, dtype).requires_grad_()
    providers = {"eager": lambda *a: moe_experts_pattern(*a, "silu"), "transformers grouped_mm": _transformers_grouped,
                 "sloth": lambda *a: moe_experts(*a, "silu")}
    return _measure(args, "moe_experts", f"T{T} H{H} I{I} E{E} K{K}", providers,
                    [x, index, weights, gate_up, down], (T, H, I, E, K))


def _main_gpt_oss(args, device: str) -> int:
    T, H, I, E, K = (13, 24, 20, 5, 2) if args.smoke else (4096, 2880, 2880, 32, 4)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gen, index, weights, x = _routed_tokens(T, H, E, K, device, dtype)
    # gate/up scaled so pre-activations pass the clamp at 7 now and then, as trained GPT-OSS weights do
    gate_up = (torch.randn(E, H, 2 * I, generator=gen) * 3 / H ** 0.5).to(device, dtype).requires_grad_()
    down = (torch.randn(E, I, H, generator=gen) / I ** 0.5).to(device, dtype).requires_grad_()
    gate_up_bias = torch.randn(E, 2 * I, generator=gen).to(device, dtype).requires_grad_()
    down_bias = (torch.randn(E, H, generator=gen) * 0.1).to(device, dtype).requires_grad_()
    return _measure(args, "moe_experts_gpt_oss", f"gpt-oss T{T} H{H} I{I} E{E} K{K}", _gpt_oss_providers(),
                    [x, index, weights, gate_up, down, gate_up_bias, down_bias], (T, H, I, E, K))


def _main_lora(args, device: str) -> int:
    from sloth.lowering.moe import moe_experts

    T, H, I, E, K, r = (13, 24, 20, 5, 2, 4) if args.smoke else (4096, 2048, 768, 128, 8, 16)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gen, index, weights, x = _routed_tokens(T, H, E, K, device, dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(device, dtype)  # frozen
    down = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(device, dtype)
    # peft's factors in the op's layout ([E, n, r] and [E, r, k]), B nonzero as after some training
    factors = [(torch.randn(shape, generator=gen) / shape[-1] ** 0.5).to(device, dtype).requires_grad_()
               for shape in ((E, 2 * I, r), (E, r, H), (E, H, r), (E, r, I))]
    scale = 2.0

    def merged(gu, d, b1, a1, b2, a2):  # what peft's parametrization forms each step
        return torch.baddbmm(gu, b1, a1, alpha=scale), torch.baddbmm(d, b2, a2, alpha=scale)

    providers = {
        "peft + transformers grouped_mm": lambda x_, i, w, gu, d, *f: _transformers_grouped(x_, i, w, *merged(gu, d, *f)),
        "sloth, merged weight": lambda x_, i, w, gu, d, *f: moe_experts(x_, i, w, *merged(gu, d, *f), "silu"),
        "sloth, factors": lambda x_, i, w, gu, d, *f: moe_experts(x_, i, w, gu, d, "silu", None, None, False, 1.702,
                                                                  7.0, *f, scale, scale)}
    return _measure(args, "moe_experts_lora", f"lora r{r} T{T} H{H} I{I} E{E} K{K}", providers,
                    [x, index, weights, gate_up, down, *factors], (T, H, I, E, K))


def _main_ungated(args, device: str) -> int:
    from sloth.lowering.moe import moe_experts, moe_experts_pattern

    T, H, I, E, K = (13, 24, 16, 5, 2) if args.smoke else (4096, 2688, 1856, 128, 6)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gen, index, weights, x = _routed_tokens(T, H, E, K, device, dtype)
    up = (torch.randn(E, I, H, generator=gen) / H ** 0.5).to(device, dtype).requires_grad_()
    down = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(device, dtype).requires_grad_()
    providers = {"eager": lambda *a: moe_experts_pattern(*a, "relu2", gated=False),
                 "transformers grouped_mm": _transformers_ungated,
                 "sloth": lambda *a: moe_experts(*a, "relu2", gated=False)}
    return _measure(args, "moe_experts_ungated", f"ungated relu2 T{T} H{H} I{I} E{E} K{K}", providers,
                    [x, index, weights, up, down], (T, H, I, E, K), gated=False)


def _routed_tokens(T: int, H: int, E: int, K: int, device: str, dtype: torch.dtype) -> tuple:
    """(the seeded generator, for the weights drawn next; uniform random routing, K distinct experts a token
    [T, K]; softmax router weights [T, K]; tokens [T, H]), the last two requiring grad."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    index = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(device)
    weights = torch.softmax(torch.randn(T, K, generator=gen), -1).to(device, dtype).requires_grad_()
    x = torch.randn(T, H, generator=gen).to(device, dtype).requires_grad_()
    return gen, index, weights, x


def _measure(args, benchmark: str, label: str, providers: dict, inputs: list, shape: tuple, gated: bool = True
             ) -> int:
    """Time ``providers`` on ``inputs`` (harness.run), add the TFLOP/s column, print the table and, unless --smoke,
    write the ``benchmark`` record; the exit status (1 when a provider failed). ``gated``: three weight matrices an
    expert (gate, up, down), else two."""
    T, H, I, E, K = shape
    copy_gbps = common.copy_bandwidth_gbps()
    e = inputs[0].element_size()
    mats = 3 if gated else 2
    fwd_bytes = (mats * E * I * H + 2 * T * H) * e
    nbytes = {"fwd": fwd_bytes, "bwd": 2 * fwd_bytes, "fwd+bwd": 3 * fwd_bytes}
    S = T * K
    flops = {"fwd": 2 * mats * S * H * I, "bwd": 4 * mats * S * H * I, "fwd+bwd": 6 * mats * S * H * I}
    rows = harness.run(label, providers, inputs, nbytes, copy_gbps)
    columns = harness.COLUMNS[:4] + ["TFLOP/s"] + harness.COLUMNS[4:]
    for row in rows:
        if row.get("ms"):
            row["TFLOP/s"] = flops[row["mode"]] / (row["ms"] * 1e-3) / 1e12
    print(common.render_text(columns, rows))
    if not args.smoke:
        record = common.result_record(benchmark, {"dtype": "bfloat16", "copy_gbps": copy_gbps}, columns, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
