"""Attention with sinks (GPT-OSS), forward and forward+backward: sloth's op against the eager math, compiled or not.

    python -m benchmarks.ops.sink_attention [--smoke]

GPT-OSS-20B's attention (64 query heads over 8 key/value heads, head_dim 64), batch 2 x 2048 tokens, bf16, q/k/v
as transformers views its projections; a sliding layer (window 128) and a full (causal) one. Providers:

    sloth          sloth.sink_attention on window_bounds (the op the sink_attention family inserts), default tiles
    sloth-<name>   the same with the tiles of TILES (lowering/document_attention.TILES_OVERRIDE)
    eager          patterns/sink_attention.sink_attention_pattern under the additive window mask (what
                   transformers runs: [B, H, T, T + 1] scores, softmax in bf16)
    inductor       the same function through torch.compile (Inductor)

Errors are relative to the eager math in fp32. TFLOP/s counts the window's keys per query only.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from benchmarks import common
from benchmarks.ops import harness

COLUMNS = ["shape", "mode", "provider", "kernel ms", "TFLOP/s", "peak MiB", "max rel err", "error"]
TILES = {
    "m128": dict(fwd=(128, 64, 4, 3), dkdv=(64, 64, 4, 2), dq=(128, 64, 8, 2)),
    "n128": dict(fwd=(64, 128, 4, 3), dkdv=(128, 64, 8, 2), dq=(64, 128, 4, 2)),
    "wide": dict(fwd=(128, 128, 8, 2), dkdv=(128, 128, 8, 2), dq=(128, 128, 8, 2)),
}


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)
    from sloth.lowering import document_attention as tiles
    from sloth.lowering.sink_attention import sink_attention, window_bounds
    from sloth.patterns.sink_attention import sink_attention_pattern

    shapes = [(1, 64, 4, 2, 16, 16)] if args.smoke else [(2, 2048, 64, 8, 64, 128), (2, 2048, 64, 8, 64, 2048)]
    rows: list[dict[str, Any]] = []
    for batch, tokens, heads, kv_heads, dim, window in shapes:
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(0)

        def proj(h: int) -> torch.Tensor:
            t = torch.randn(batch, tokens, h, dim, generator=gen).to(device, torch.bfloat16)
            return t.transpose(1, 2).requires_grad_()

        q, k, v = proj(heads), proj(kv_heads), proj(kv_heads)
        sinks = torch.randn(heads, generator=gen).to(device, torch.bfloat16).requires_grad_()
        dy = torch.randn(batch, heads, tokens, dim, generator=gen).to(device, torch.bfloat16)
        i = torch.arange(tokens, device=device)
        allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        scale = dim ** -0.5
        bounds = window_bounds(q, window)

        def eager(q, k, v, s):
            mask = torch.zeros(tokens, tokens, device=device, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
            return sink_attention_pattern(q, k, v, s, mask, scale)

        compiled = torch.compile(eager, dynamic=False)
        providers = {"sloth": lambda q, k, v, s: sink_attention(q, k, v, s, bounds, scale),
                     **{f"sloth-{name}": lambda q, k, v, s: sink_attention(q, k, v, s, bounds, scale)
                        for name in (TILES if device == "cuda" else ())},
                     "eager": eager, "inductor": compiled}
        inputs = [q, k, v, sinks]
        full = [t.detach().float().requires_grad_() for t in inputs]
        ref = eager(*full)
        ref_grads = torch.autograd.grad(ref, full, dy.float())
        keys = sum(min(n + 1, window) for n in range(tokens))
        flops = {"fwd": 4 * batch * heads * dim * keys, "fwd+bwd": 12 * batch * heads * dim * keys}
        shape = f"B{batch} T{tokens} h{heads}/{kv_heads} d{dim} window {window}"
        for name, fn in providers.items():
            for mode in ("fwd", "fwd+bwd"):
                row: dict[str, Any] = {"shape": shape, "mode": mode, "provider": name}
                tiles.TILES_OVERRIDE = TILES.get(name.removeprefix("sloth-")) if name.startswith("sloth-") else None
                try:
                    row["max rel err"] = harness.max_rel_err(fn, inputs, mode, [ref.detach()], ref_grads, [dy])
                    _, kernel, peak = harness.time_case(fn, inputs, mode)
                except Exception as exc:  # noqa: BLE001 - a provider that cannot run this shape is a row
                    row["error"] = f"{type(exc).__name__}: {exc}"[:160]
                    rows.append(row)
                    print(f"{shape} {mode} {name}: {row['error']}", flush=True)
                    continue
                finally:
                    tiles.TILES_OVERRIDE = None
                row.update({"kernel ms": kernel, "TFLOP/s": flops[mode] / (kernel * 1e-3) / 1e12 if kernel else None,
                            "peak MiB": peak / common.MiB if peak is not None else None})
                rows.append(row)
                print(f"{shape} {mode:<7} {name:<11} kernel {kernel or float('nan'):8.3f} ms "
                      f"{row['TFLOP/s'] or float('nan'):6.0f} TFLOP/s err {row['max rel err']:.2e}", flush=True)
    print(common.render_text(COLUMNS, rows), flush=True)
    if not args.smoke:
        record = common.result_record("sink_attention", {"dtype": "bfloat16", "default tiles": tiles.GPU_TILES,
                                                         "tiles": TILES}, COLUMNS, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
