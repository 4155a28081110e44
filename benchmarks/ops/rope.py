"""RoPE benchmark: q and k rotated by the same cos/sin, as eager, Inductor and sloth's fused op.

    python -m benchmarks.ops.rope [--smoke]

Llama-3-8B shapes: batch 2 x 2048 tokens, 32 q heads, 8 kv heads, head_dim 128, bf16; q and k are the
transposed views of the projections ([b, s, h, d] memory read as [b, h, s, d]), as transformers makes
them. Minimal bytes: fwd reads q, k, cos, sin and writes both outputs; bwd reads dq, dk, cos, sin and
writes the two input gradients: 2 (Q + K) e + 2 C e each way (C = b s d, the cos/sin table).
"""
from __future__ import annotations

import sys

import torch

from benchmarks import common
from benchmarks.ops import harness


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)
    from sloth.lowering.rope import rope
    from sloth.patterns.rope import rope_rotate_half_pattern

    b, s, hq, hk, d = (1, 7, 2, 1, 16) if args.smoke else (2, 2048, 32, 8, 128)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(b, s, hq, d, generator=gen).to(device, torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, hk, d, generator=gen).to(device, torch.bfloat16).transpose(1, 2).requires_grad_()
    theta = torch.arange(s, dtype=torch.float32)[:, None] * (500000.0 ** (-torch.arange(0, d, 2) / d))[None]
    emb = torch.cat((theta, theta), -1).expand(b, s, d)
    cos, sin = emb.cos().to(device, torch.bfloat16), emb.sin().to(device, torch.bfloat16)

    torch._dynamo.reset()
    compiled = torch.compile(rope_rotate_half_pattern, dynamic=False)
    providers = {"eager": rope_rotate_half_pattern, "inductor": compiled,
                 "sloth": lambda q, k, c, s: rope(q, k, c.unsqueeze(1), s.unsqueeze(1))}
    e = q.element_size()
    one_way = 2 * (q.numel() + k.numel()) * e + 2 * cos.numel() * e
    nbytes = {"fwd": one_way, "bwd": one_way, "fwd+bwd": 2 * one_way}
    copy_gbps = common.copy_bandwidth_gbps()
    rows = harness.run(f"b{b} s{s} hq{hq} hk{hk} d{d}", providers, [q, k, cos, sin], nbytes, copy_gbps)
    print(common.render_text(harness.COLUMNS, rows))
    if not args.smoke:
        record = common.result_record("rope", {"dtype": "bfloat16", "copy_gbps": copy_gbps}, harness.COLUMNS, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
