"""LoRA linear benchmark: peft's math as eager, Inductor and sloth's fused op, at Llama-3-8B shapes.

    python -m benchmarks.ops.lora [--smoke]

4096 tokens, bf16 activations and frozen bf16 base weight, LoRA r=16 with the adapter in fp32 (peft's
default), scale 1: the seven projections of a Llama-3-8B layer (q, k/v, o, gate/up, down), x and the two
adapter factors requiring grad. The op is matmul-bound, so TFLOP/s (base GEMMs: 2MNK forward, 2MNK for
dx; the adapter's FLOPs are not counted) against the measured bf16 matmul peak is the column to read;
the base GEMMs alone set the floor.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from benchmarks import common
from benchmarks.ops import harness

# (name, K in, N out) of one Llama-3-8B decoder layer; k_proj and v_proj share a shape, gate and up too.
SHAPES = (("q/o", 4096, 4096), ("k/v", 4096, 1024), ("gate/up", 4096, 14336), ("down", 14336, 4096))


COLUMNS = harness.COLUMNS[:-1] + ["TFLOP/s", "% peak", "error"]


def bytes_and_flops(tokens: int, k: int, n: int, e: int = 2) -> tuple[dict[str, int], dict[str, int]]:
    """(minimal bytes, base-GEMM FLOPs) per mode of LoRA linears on one x [tokens, k] with n outputs in all
    (their N summed when several share x), 16-bit activations and bases. Bytes: x and w read, y written
    (fwd); dy read twice, w and x read, dx written (bwd)."""
    nbytes = {"fwd": (tokens * k + n * k + tokens * n) * e, "bwd": (2 * tokens * n + n * k + 2 * tokens * k) * e}
    nbytes["fwd+bwd"] = nbytes["fwd"] + nbytes["bwd"]
    flops = {"fwd": 2 * tokens * n * k, "bwd": 2 * tokens * n * k, "fwd+bwd": 4 * tokens * n * k}
    return nbytes, flops


def add_matmul_rate(rows: list[dict[str, Any]], flops: dict[str, int], peak_tflops: float) -> list[dict[str, Any]]:
    """``rows`` with TFLOP/s (over the GPU kernel time, else the wall time) and its % of the matmul peak."""
    for row in rows:
        ms = row.get("kernel ms") or row.get("ms")
        if ms:
            row["TFLOP/s"] = flops[row["mode"]] / (ms * 1e-3) / 1e12
            row["% peak"] = 100 * row["TFLOP/s"] / peak_tflops
    return rows


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)
    from sloth.lowering.lora import lora_linear
    from sloth.patterns.lora import lora_pattern

    tokens, rank = (37, 4) if args.smoke else (4096, 16)
    shapes = (("q/o", 24, 40),) if args.smoke else SHAPES
    copy_gbps = common.copy_bandwidth_gbps()
    peak_tflops = common.matmul_tflops() if device == "cuda" else 1.0
    rows: list[dict[str, Any]] = []
    for name, k, n in shapes:
        torch._dynamo.reset()
        pattern = lambda x, w, a, b: lora_pattern(x, w, None, a, b, 1.0)  # noqa: E731
        providers = {"eager": pattern, "inductor": torch.compile(pattern, dynamic=False),
                     "sloth": lambda x, w, a, b: lora_linear(x, w, None, a, b, 1.0)}
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(tokens, k, generator=gen).to(device, torch.bfloat16).requires_grad_()
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, torch.bfloat16)
        a = (torch.randn(rank, k, generator=gen) / k**0.5).to(device).requires_grad_()
        b = (torch.randn(n, rank, generator=gen) / rank**0.5).to(device).requires_grad_()
        nbytes, flops = bytes_and_flops(tokens, k, n)
        case_rows = harness.run(f"{name} {tokens}x{k}->{n} r{rank}", providers, [x, w, a, b], nbytes, copy_gbps)
        rows += add_matmul_rate(case_rows, flops, peak_tflops)
    columns = COLUMNS
    print(common.render_text(columns, rows))
    if not args.smoke:
        config = {"dtype": "bfloat16 activations and base, float32 adapter", "tokens": tokens, "rank": rank,
                  "copy_gbps": copy_gbps, "matmul_tflops": peak_tflops}
        record = common.result_record("lora", config, columns, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
