"""MoE experts benchmark: transformers' eager expert loop and its grouped_mm path against sloth's op.

    python -m benchmarks.ops.moe_experts [--smoke]

Qwen3-30B-A3B (Qwen3-MoE) shape: 4096 tokens, H=2048, I=768, E=128 experts, top-8, bf16, SwiGLU; uniform random
routing. The op is GEMM-bound: FLOPs fwd 6 S H I (S = T K assignments: gate_up 4 S H I, down 2 S H I), bwd about
twice that (12 S H I with the weight gradients), so a TFLOP/s column is added. Minimal bytes (the "% copy"
columns): the expert weights once (3 E I H e) plus x and out (2 T H e) forward, twice that backward.
No inductor provider: Dynamo breaks the eager loop's graph at its data-dependent ``nonzero``.
"""
from __future__ import annotations

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


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)
    from sloth.lowering.moe import moe_experts, moe_experts_pattern

    T, H, I, E, K = (13, 24, 20, 5, 2) if args.smoke else (4096, 2048, 768, 128, 8)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    copy_gbps = common.copy_bandwidth_gbps()
    gen = torch.Generator(device="cpu").manual_seed(0)
    index = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(device)
    weights = torch.softmax(torch.randn(T, K, generator=gen), -1).to(device, dtype).requires_grad_()
    x = torch.randn(T, H, generator=gen).to(device, dtype).requires_grad_()
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(device, dtype).requires_grad_()
    down = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(device, dtype).requires_grad_()
    providers = {"eager": lambda *a: moe_experts_pattern(*a, "silu"), "transformers grouped_mm": _transformers_grouped,
                 "sloth": lambda *a: moe_experts(*a, "silu")}
    e = x.element_size()
    fwd_bytes = (3 * E * I * H + 2 * T * H) * e
    nbytes = {"fwd": fwd_bytes, "bwd": 2 * fwd_bytes, "fwd+bwd": 3 * fwd_bytes}
    S = T * K
    flops = {"fwd": 6 * S * H * I, "bwd": 12 * S * H * I, "fwd+bwd": 18 * S * H * I}
    rows = harness.run(f"T{T} H{H} I{I} E{E} K{K}", providers, [x, index, weights, gate_up, down], nbytes, copy_gbps)
    columns = harness.COLUMNS[:4] + ["TFLOP/s"] + harness.COLUMNS[4:]
    for row in rows:
        if row.get("ms"):
            row["TFLOP/s"] = flops[row["mode"]] / (row["ms"] * 1e-3) / 1e12
    print(common.render_text(columns, rows))
    if not args.smoke:
        record = common.result_record("moe_experts", {"dtype": "bfloat16", "copy_gbps": copy_gbps}, columns, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
