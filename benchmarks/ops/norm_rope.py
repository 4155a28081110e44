"""q/k RMSNorm + RoPE benchmark: eager, Inductor, sloth's two norms and RoPE as three ops, and the joined op.

    python -m benchmarks.ops.norm_rope [--smoke]

Qwen3-MoE's attention (the e2e MoE row): batch 2 x 2048 tokens, 32 q heads, 4 kv heads, head_dim 128, bf16, the
norm weights frozen as under LoRA; q and k are the projections' views ([b, s, h, d] memory read as [b, h, s, d]).
Minimal bytes: fwd reads q, k, cos, sin and writes both outputs; bwd reads dq, dk, q, k, cos, sin and writes the
two input gradients (the joined op's backward reads q and k for the norms' gradient).
"""
from __future__ import annotations

import sys

import torch

from benchmarks import common
from benchmarks.ops import harness


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)
    from sloth.lowering.norm_rope import norm_rope
    from sloth.lowering.rms_norm import rms_norm
    from sloth.lowering.rope import rope
    from sloth.patterns.norm_rope import qk_norm_rope_pattern

    b, s, hq, hk, d = (1, 7, 2, 1, 16) if args.smoke else (2, 2048, 32, 4, 128)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(b, s, hq, d, generator=gen).to(device, torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, hk, d, generator=gen).to(device, torch.bfloat16).transpose(1, 2).requires_grad_()
    wq = (1 + 0.1 * torch.randn(d, generator=gen)).to(device, torch.bfloat16)
    wk = (1 + 0.1 * torch.randn(d, generator=gen)).to(device, torch.bfloat16)
    theta = torch.arange(s, dtype=torch.float32)[:, None] * (1000000.0 ** (-torch.arange(0, d, 2) / d))[None]
    emb = torch.cat((theta, theta), -1).expand(b, s, d)
    cos, sin = emb.cos().to(device, torch.bfloat16), emb.sin().to(device, torch.bfloat16)

    def three_ops(q, k, c, s):
        return rope(rms_norm(q, wq, 1e-6), rms_norm(k, wk, 1e-6), c.unsqueeze(1), s.unsqueeze(1))

    def pattern(q, k, c, s):
        return qk_norm_rope_pattern(q, k, wq, wk, c, s)

    torch._dynamo.reset()
    providers = {"eager": pattern, "inductor": torch.compile(pattern, dynamic=False),
                 "sloth 3 ops": three_ops,
                 "sloth": lambda q, k, c, s: norm_rope(q, k, wq, wk, c.unsqueeze(1), s.unsqueeze(1))}
    e = q.element_size()
    tables = 2 * cos.numel() * e
    fwd = 2 * (q.numel() + k.numel()) * e + tables
    bwd = 3 * (q.numel() + k.numel()) * e + tables
    nbytes = {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}
    copy_gbps = common.copy_bandwidth_gbps()
    rows = harness.run(f"b{b} s{s} hq{hq} hk{hk} d{d}", providers, [q, k, cos, sin], nbytes, copy_gbps)
    print(common.render_text(harness.COLUMNS, rows))
    if not args.smoke:
        record = common.result_record("norm_rope", {"dtype": "bfloat16", "copy_gbps": copy_gbps}, harness.COLUMNS,
                                      rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
