"""The MoE experts' grouped GEMMs: ``torch._grouped_mm`` (after gathering the tokens' rows) against sloth's Triton
grouped GEMM (lowering/grouped_gemm.py, the gather in its loads), one GEMM at a time.

    python -m benchmarks.ops.grouped_gemm [--smoke]

Shapes, 4096 tokens, bf16, uniform random top-k routing: Qwen3-MoE (H 2048, I 768, 128 experts, top-8),
Mixtral-8x7B (H 4096, I 14336, 8 experts, top-2), GPT-OSS-20B (H 2880, I 2880, 32 experts, top-4). For each,
the op's GEMMs (S = T K sorted rows; W1 [E, 2I, H], W2 [E, H, I] as transformers stores them):

    gate_up    out = x[tok] @ W1[e]^T      [S, 2I]   forward (tokens gathered)
    down       out = h @ W2[e]^T           [S, H]    forward
    c          out = dout[tok] @ W2[e]     [S, I]    backward (output gradients gathered)
    dx         out = d_gu @ W1[e]          [S, H]    backward
    dW2        out[e] = dout_e^T (w h)_e   [E, H, I] backward, experts that train

Rows per provider: "grouped_mm" (``torch._grouped_mm``, with the ``x[tok]`` gather it needs timed in), "triton" at
its default tiles, and the Triton kernel at other tiles (``--configs``), to choose the default from. Each row also
gives the largest difference from ``torch._grouped_mm`` relative to that output's largest value.
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import common

SHAPES = {  # name -> (tokens, H, I, E, top-k)
    "qwen3-moe": (4096, 2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 4096, 14336, 8, 2),
    "gpt-oss-20b": (4096, 2880, 2880, 32, 4),
}
# tile sizes tried beside the default (lowering/grouped_gemm.py's _config)
CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
]


def _routing(tokens: int, experts: int, top_k: int, device: str):
    """(token of each sorted row [S], group ends [E] int32), from uniform random top-k choices."""
    index = torch.rand(tokens, experts, device=device).topk(top_k, -1).indices
    ids, order = torch.sort(index.reshape(-1), stable=True)
    offs = torch.searchsorted(ids, torch.arange(experts, device=device), right=True, out_int32=True)
    return order // top_k, offs


def _cases(name: str, device: str, dtype: torch.dtype):
    """(gemm name, FLOPs, torch._grouped_mm's callable, {tiles label: Triton callable}) for one shape."""
    from sloth.lowering.grouped_gemm import grouped_mm, grouped_mm_weight

    tokens, hidden, inter, experts, top_k = SHAPES[name]
    tok, offs = _routing(tokens, experts, top_k, device)
    rows = tok.shape[0]
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w1 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype) / inter ** 0.5
    h = torch.randn(rows, inter, device=device, dtype=dtype)
    d_gu = torch.randn(rows, 2 * inter, device=device, dtype=dtype)
    dout_rows = torch.randn(rows, hidden, device=device, dtype=dtype)

    def triton(a, b, gather, config=None):
        return lambda: grouped_mm(a, b, offs, tok if gather else None, config=config)

    gemms = [
        ("gate_up", 2 * rows * hidden * 2 * inter, lambda: torch._grouped_mm(x[tok], w1.transpose(1, 2), offs=offs),
         (x, w1.transpose(1, 2), True)),
        ("down", 2 * rows * inter * hidden, lambda: torch._grouped_mm(h, w2.transpose(1, 2), offs=offs),
         (h, w2.transpose(1, 2), False)),
        ("c", 2 * rows * hidden * inter, lambda: torch._grouped_mm(x[tok], w2, offs=offs), (x, w2, True)),
        ("dx", 2 * rows * 2 * inter * hidden, lambda: torch._grouped_mm(d_gu, w1, offs=offs), (d_gu, w1, False)),
    ]
    for gemm, flops, theirs, (a, b, gather) in gemms:
        ours = {"triton": triton(a, b, gather), **{_label(c): triton(a, b, gather, c) for c in CONFIGS}}
        yield gemm, flops, theirs, ours
    yield ("dW2", 2 * rows * hidden * inter, lambda: torch._grouped_mm(dout_rows.t(), h, offs=offs),
           {"triton": lambda: grouped_mm_weight(dout_rows, h, offs),
            **{_label(c): (lambda c=c: grouped_mm_weight(dout_rows, h, offs, config=c)) for c in CONFIGS}})


def _label(config: dict) -> str:
    return "triton {BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages}".format(**config)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the Qwen3-MoE shape only, the default tiles only")
    args = parser.parse_args(argv)
    common.import_sloth()
    if not torch.cuda.is_available():
        print("grouped_gemm: needs a CUDA device")
        return 1
    rows_out = []
    for name in (["qwen3-moe"] if args.smoke else list(SHAPES)):
        for gemm, flops, theirs, ours in _cases(name, "cuda", torch.bfloat16):
            expected = theirs().float()
            scale = expected.abs().max().item() or 1.0
            ms = common.bench_ms(theirs)
            rows_out.append({"shape": name, "gemm": gemm, "provider": "grouped_mm", "ms": round(ms, 4),
                             "TFLOP/s": round(flops / ms / 1e9, 1), "max rel diff": 0.0})
            print(rows_out[-1], flush=True)
            for label, fn in ours.items():
                if args.smoke and label != "triton":
                    continue
                try:
                    diff = (fn().float() - expected).abs().max().item() / scale
                    ms = common.bench_ms(fn)
                except Exception as error:  # a tile setting that does not compile (shared memory): say so
                    rows_out.append({"shape": name, "gemm": gemm, "provider": label, "ms": None, "TFLOP/s": None,
                                     "max rel diff": f"{type(error).__name__}: {str(error)[:80]}"})
                    print(rows_out[-1], flush=True)
                    continue
                rows_out.append({"shape": name, "gemm": gemm, "provider": label, "ms": round(ms, 4),
                                 "TFLOP/s": round(flops / ms / 1e9, 1), "max rel diff": f"{diff:.2e}"})
                print(rows_out[-1], flush=True)
    record = common.result_record("grouped_gemm", {"shapes": SHAPES, "dtype": "bf16", "tokens": 4096},
                                  ["shape", "gemm", "provider", "ms", "TFLOP/s", "max rel diff"], rows_out)
    common.write_result(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
