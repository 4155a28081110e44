"""LoRA linears sharing one input: eager, Inductor, one sloth op each, and sloth's joined op, at Llama-3-8B shapes.

    python -m benchmarks.ops.lora_shared [--smoke]

4096 tokens, bf16 activations and frozen bf16 bases, LoRA r=16 adapters in fp32 (peft's default), scale 1:
a Llama-3-8B layer's q, k, v (4096 -> 4096, 1024, 1024) and gate, up (4096 -> 14336 twice), x and every
adapter factor requiring grad. Providers: ``eager`` (peft's math per projection, lora_pattern), ``inductor``
(torch.compile of that), ``sloth`` (one sloth.lora_linear per projection) and ``sloth-shared`` (one
sloth.lora_linear_shared for the group, lowering/lora_shared.py). The "ms" column includes the host's time
per call, which is what the joined op saves; "kernel ms" is the GPU's.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from benchmarks import common
from benchmarks.ops import harness
from benchmarks.ops.lora import COLUMNS, add_matmul_rate, bytes_and_flops

# (name, K in, [N out of each member]) of one Llama-3-8B decoder layer.
GROUPS = (("q,k,v", 4096, (4096, 1024, 1024)), ("gate,up", 4096, (14336, 14336)))


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)
    from sloth.lowering.lora import lora_linear
    from sloth.lowering.lora_shared import lora_linear_shared
    from sloth.patterns.lora import lora_pattern

    tokens, rank = (37, 4) if args.smoke else (4096, 16)
    groups = (("q,k,v", 40, (24, 8, 8)),) if args.smoke else GROUPS
    copy_gbps = common.copy_bandwidth_gbps()
    peak_tflops = common.matmul_tflops() if device == "cuda" else 1.0
    rows: list[dict[str, Any]] = []
    for name, k, ns in groups:
        torch._dynamo.reset()
        n_members = len(ns)

        def split(args):  # (x, w_0.., a_0.., b_0..) -> x, ws, as, bs
            x, rest = args[0], args[1:]
            return x, rest[:n_members], rest[n_members:2 * n_members], rest[2 * n_members:]

        def eager(*args):
            x, ws, a_list, bs = split(args)
            return tuple(lora_pattern(x, w, None, a, b, 1.0) for w, a, b in zip(ws, a_list, bs))

        def one_op_each(*args):
            x, ws, a_list, bs = split(args)
            return tuple(lora_linear(x, w, None, a, b, 1.0) for w, a, b in zip(ws, a_list, bs))

        def joined(*args):
            x, ws, a_list, bs = split(args)
            return tuple(lora_linear_shared(x, ws, [None] * n_members, a_list, bs, 1.0))

        providers = {"eager": eager, "inductor": torch.compile(eager, dynamic=False), "sloth": one_op_each,
                     "sloth-shared": joined}
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(tokens, k, generator=gen).to(device, torch.bfloat16).requires_grad_()
        ws = [(torch.randn(n, k, generator=gen) / k**0.5).to(device, torch.bfloat16) for n in ns]
        a_list = [(torch.randn(rank, k, generator=gen) / k**0.5).to(device).requires_grad_() for _ in ns]
        bs = [(torch.randn(n, rank, generator=gen) / rank**0.5).to(device).requires_grad_() for n in ns]
        nbytes, flops = bytes_and_flops(tokens, k, sum(ns))
        shape = f"{name} {tokens}x{k}->{'+'.join(map(str, ns))} r{rank}"
        case_rows = harness.run(shape, providers, [x, *ws, *a_list, *bs], nbytes, copy_gbps)
        rows += add_matmul_rate(case_rows, flops, peak_tflops)
    columns = COLUMNS
    print(common.render_text(columns, rows))
    if not args.smoke:
        config = {"dtype": "bfloat16 activations and bases, float32 adapters", "tokens": tokens, "rank": rank,
                  "scale": 1.0}
        for path in common.write_result(common.result_record("lora_shared", config, columns, rows)):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
