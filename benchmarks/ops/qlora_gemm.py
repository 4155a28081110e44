"""Where a 4-bit weight should be dequantised: into a reused buffer then cuBLAS (lowering/qlora.py, Unsloth's
choice) or inside the matmul's main loop (lowering/nf4_matmul.py). Issue 6 asks for both, measured.

    python -m benchmarks.ops.qlora_gemm [--smoke]

``y = x @ W.T`` at the four Llama-3-8B projection shapes, 4096 tokens, bf16 x, NF4 weight with block size
64 and an fp32 absmax (a nested absmax is dequantised first by both paths alike and is not timed).
Random codes and scales: speed does not depend on the values. Providers: ``cublas-bf16`` (the weight
already dense, the floor), ``dequant+cublas`` (sloth's path: the NF4 kernel writes a reused bf16 buffer,
then F.linear), and ``fused`` at each launch setting of nf4_matmul.CONFIGS. GPU kernel ms and TFLOP/s
against the measured bf16 matmul peak; errors relative to dequant+cublas.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import common
from benchmarks.ops import harness

SHAPES = (("q/o", 4096, 4096), ("k/v", 4096, 1024), ("gate/up", 4096, 14336), ("down", 14336, 4096))
COLUMNS = ["shape", "provider", "kernel ms", "TFLOP/s", "% peak", "vs dequant+cublas", "max rel err", "error"]


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)
    from sloth.lowering import nf4_matmul as fused
    from sloth.lowering.nf4 import dequantize_4bit

    tokens, shapes = (24, (("q/o", 64, 48),)) if args.smoke else (4096, SHAPES)
    peak = common.matmul_tflops() if device == "cuda" else 1.0
    blocksize = 64
    rows: list[dict[str, Any]] = []
    for name, k, n in shapes:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(tokens, k, generator=gen).to(device, torch.bfloat16)
        packed = torch.randint(0, 256, (n * k // 2,), generator=gen, dtype=torch.uint8).to(device)
        absmax = (torch.rand(n * k // blocksize, generator=gen) * 0.1).to(device)
        buffer = torch.empty(n, k, dtype=torch.bfloat16, device=device)
        dense = dequantize_4bit(packed, absmax, blocksize, "nf4", (n, k), torch.bfloat16)
        providers = {"dequant+cublas": lambda: F.linear(x, dequantize_4bit(packed, absmax, blocksize, "nf4", (n, k),
                                                                            torch.bfloat16, out=buffer)),
                     "cublas-bf16": lambda: F.linear(x, dense)}  # the baseline first: the others' ratio is to it
        for i, config in enumerate(fused.CONFIGS):
            providers[f"fused {config['block_m']}x{config['block_n']}x{config['block_k']} w{config['num_warps']}"
                      f" s{config['num_stages']}"] = (
                lambda c=config: fused.nf4_matmul(x, packed, absmax, blocksize, "nf4", n, k, config=c))
        ref = providers["dequant+cublas"]().float()
        flops = 2 * tokens * n * k
        base = None
        for provider, fn in providers.items():
            row: dict[str, Any] = {"shape": f"{name} {tokens}x{k}->{n}", "provider": provider}
            try:
                row["max rel err"] = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
                ms = common.kernel_ms(fn) if device == "cuda" else common.bench_ms(fn)
            except Exception as exc:  # a launch setting that does not fit is a row, not a crash
                row["error"] = f"{type(exc).__name__}: {exc}"[:120]
                rows.append(row)
                continue
            base = ms if provider == "dequant+cublas" else base
            row.update({"kernel ms": ms, "TFLOP/s": flops / (ms * 1e-3) / 1e12,
                        "% peak": 100 * flops / (ms * 1e-3) / 1e12 / peak,
                        "vs dequant+cublas": base / ms if base else None})
            rows.append(row)
            print(f"{row['shape']:>26} {provider:<28} {ms:8.4f} ms  {row['TFLOP/s']:7.1f} TFLOP/s", flush=True)
    print(common.render_text(COLUMNS, rows))
    if not args.smoke:
        record = common.result_record("qlora_gemm", {"dtype": "bfloat16 x, NF4 weight", "blocksize": blocksize,
                                                     "tokens": tokens, "matmul_tflops": peak}, COLUMNS, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows if not r["provider"].startswith("fused")) else 0


if __name__ == "__main__":
    sys.exit(main())
