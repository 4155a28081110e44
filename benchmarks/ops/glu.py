"""Gated-MLP activation benchmark: ``act(gate) * up`` as eager, Inductor and sloth's fused op.

    python -m benchmarks.ops.glu [--smoke]

Llama-3-8B shapes: 4096 tokens x intermediate 14336, bf16, SwiGLU and GeGLU-tanh. Minimal bytes:
fwd reads gate and up, writes y (3 N I e); bwd reads gate, up, dy and writes d_gate, d_up (5 N I e).
"""
from __future__ import annotations

import sys

import torch

from benchmarks import common
from benchmarks.ops import harness


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)
    from sloth.lowering.glu import glu
    from sloth.patterns.glu import PATTERNS

    n, inter = (8, 100) if args.smoke else (4096, 14336)
    copy_gbps = common.copy_bandwidth_gbps()
    rows = []
    for activation in ("silu", "gelu_tanh"):
        pattern = PATTERNS[activation]
        torch._dynamo.reset()
        compiled = torch.compile(pattern, dynamic=False)
        providers = {"eager": pattern, "inductor": compiled,
                     "sloth": lambda g, u, a=activation: glu(g, u, a)}
        gen = torch.Generator(device="cpu").manual_seed(0)
        gate, up = (torch.randn(n, inter, generator=gen).to(device, torch.bfloat16).requires_grad_() for _ in range(2))
        e = gate.element_size()
        nbytes = {"fwd": 3 * n * inter * e, "bwd": 5 * n * inter * e, "fwd+bwd": 8 * n * inter * e}
        rows += harness.run(f"{activation} {n}x{inter}", providers, [gate, up], nbytes, copy_gbps)
    print(common.render_text(harness.COLUMNS, rows))
    if not args.smoke:
        record = common.result_record("glu", {"dtype": "bfloat16", "copy_gbps": copy_gbps}, harness.COLUMNS, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
