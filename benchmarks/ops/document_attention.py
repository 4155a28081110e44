"""Document-causal (packed) attention, forward and forward+backward, by every kernel that can run it.

    python -m benchmarks.ops.document_attention [--smoke]

One packed row of T tokens, documents of log-normal lengths (benchmarks/packed_sft.py's: median 300) and
pads at the tail; Llama-3-8B's heads (32 query, 8 key/value, head_dim 128), bf16, q/k/v as transformers views
its projections. Providers:

    sloth          sloth.document_attention on the per-token document bounds (the op the pass inserts)
    sdpa-mask      SDPA under transformers' dense [1, 1, T, T] bool mask, k/v repeated (what runs without sloth)
    varlen         torch.nn.attention.varlen.varlen_attn on cu_seqlens, max_seqlen read on the host (its best
                   case: a sync per batch is not counted)
    varlen-T       the same with max_seqlen = T (the sync-free bound)
    flex           compiled flex_attention with a document block mask (the mask's build not counted; it is
                   timed alone as "flex-mask")

Errors are relative to sdpa-mask. TFLOP/s counts each document's causal half.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks import common
from benchmarks.ops import harness

COLUMNS = ["shape", "mode", "provider", "kernel ms", "TFLOP/s", "peak MiB", "max rel err", "error"]
# Tile candidates for sloth's kernels, (BLOCK_M, BLOCK_N, num_warps, num_stages): "sloth" runs the default
# (lowering/document_attention.GPU_TILES), "sloth-<name>" each of these.
TILES = {
    "big": dict(fwd=(128, 128, 8, 2), dkdv=(128, 64, 8, 2), dq=(128, 64, 8, 2)),
    "small": dict(fwd=(64, 64, 4, 3), dkdv=(32, 128, 4, 3), dq=(128, 32, 4, 3)),
    "mixed": dict(fwd=(128, 64, 4, 3), dkdv=(64, 128, 8, 2), dq=(128, 64, 8, 3)),
}


def _lengths(tokens: int, seed: int = 0) -> list[int]:
    from benchmarks.packed_sft import document_lengths

    lengths, out = document_lengths(tokens, seed, 300.0 if tokens > 1024 else 12.0, 0.9, 1, 4096), []
    for n in lengths:
        if sum(out) + n > tokens:
            break
        out.append(n)
    return out + [1] * (tokens - sum(out))  # the tail: pads, each its own document


def _providers(lengths: list[int], tokens: int, device: str, skip: set[str]) -> dict[str, Callable]:
    from sloth.lowering.document_attention import allowed_from_bounds, document_attention
    from sloth.runtime.packing import document_bounds

    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    bounds = document_bounds(pos, "position_reset")
    mask = allowed_from_bounds(bounds)
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    longest = max(lengths)

    def repeat(k: torch.Tensor, heads: int) -> torch.Tensor:
        return k.repeat_interleave(heads // k.shape[1], dim=1)

    providers: dict[str, Callable] = {
        "sloth": lambda q, k, v: document_attention(q, k, v, bounds),
        **{f"sloth-{name}": lambda q, k, v: document_attention(q, k, v, bounds) for name in (TILES if device == "cuda"
                                                                                              else ())},
        "sdpa-mask": lambda q, k, v: F.scaled_dot_product_attention(q, repeat(k, q.shape[1]), repeat(v, q.shape[1]),
                                                                    attn_mask=mask),
    }
    try:
        from torch.nn.attention.varlen import varlen_attn

        def varlen(max_len: int) -> Callable:
            def run(q, k, v):
                # varlen takes [total, heads, dim]; GQA implicit on torch 2.11 (enable_gqa= on 2.12+)
                qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))
                extra = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
                out = varlen_attn(qt, kt, vt, cu, cu, max_len, max_len, window_size=(-1, 0), **extra)
                return out.transpose(0, 1)[None]
            return run

        providers["varlen"] = varlen(longest)
        providers["varlen-T"] = varlen(tokens)
    except Exception as exc:  # noqa: BLE001 - an older torch: a row saying so
        print(f"varlen_attn unavailable: {exc}")
    try:
        if "flex" in skip:
            raise RuntimeError("skipped (--skip)")
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))

        def document(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        build = torch.compile(lambda: create_block_mask(document, None, None, tokens, tokens, device=device))
        block_mask = build()
        compiled = torch.compile(flex_attention, dynamic=False)
        providers["flex"] = lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=True)
        providers["flex-mask"] = lambda q, k, v: build().kv_num_blocks
    except Exception as exc:  # noqa: BLE001
        print(f"flex unavailable: {exc}")
    return providers


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", default="", help="providers to leave out, comma-separated (e.g. flex,flex-mask)")
    args, device = harness.start(__doc__, argv, parser)
    from sloth.lowering import document_attention as lowering

    shapes = [(256, 4, 2, 16)] if args.smoke else [(16384, 32, 8, 128), (65536, 32, 8, 128)]
    rows: list[dict[str, Any]] = []
    for tokens, heads, kv_heads, dim in shapes:
        torch._dynamo.reset()
        lengths = _lengths(tokens)
        providers = _providers(lengths, tokens, device, set(args.skip.split(",")))
        if tokens > 16384:
            providers.pop("sdpa-mask")  # its [T, T] mask and scores: 4 GiB of bools, 32 x 8 GiB of scores
        gen = torch.Generator().manual_seed(0)

        def proj(h: int) -> torch.Tensor:
            t = torch.randn(1, tokens, h, dim, generator=gen).to(device, torch.bfloat16)
            return t.transpose(1, 2).requires_grad_()

        q, k, v = proj(heads), proj(kv_heads), proj(kv_heads)
        dy = torch.randn(1, heads, tokens, dim, generator=gen).to(device, torch.bfloat16)
        causal = sum(n * (n + 1) // 2 for n in lengths)
        flops = {"fwd": 4 * heads * dim * causal, "fwd+bwd": 12 * heads * dim * causal}
        reference = "sdpa-mask" if "sdpa-mask" in providers else "sloth"
        with torch.no_grad():
            ref = providers[reference](q, k, v).float()
        ref_grads = torch.autograd.grad(providers[reference](q, k, v), (q, k, v), dy)
        shape = f"T{tokens} docs {len(lengths)} longest {max(lengths)} h{heads}/{kv_heads} d{dim}"
        for name, fn in providers.items():
            for mode in ("fwd",) if name == "flex-mask" else ("fwd", "fwd+bwd"):
                row: dict[str, Any] = {"shape": shape, "mode": mode, "provider": name}
                lowering.TILES_OVERRIDE = TILES.get(name.removeprefix("sloth-")) if name.startswith("sloth-") else None
                try:
                    if name != "flex-mask":
                        row["max rel err"] = harness.max_rel_err(fn, [q, k, v], mode, [ref], ref_grads, [dy])
                    if name == "flex-mask":  # an int block mask, no gradient: its build time alone
                        kernel, peak = common.kernel_ms(lambda: fn(q, k, v)), None
                    else:
                        _, kernel, peak = harness.time_case(fn, [q, k, v], mode)
                except Exception as exc:  # noqa: BLE001 - a provider that cannot run this shape is a row
                    row["error"] = f"{type(exc).__name__}: {exc}"[:160]
                    rows.append(row)
                    print(f"{shape} {mode} {name}: {row['error']}", flush=True)
                    continue
                finally:
                    lowering.TILES_OVERRIDE = None
                row.update({"kernel ms": kernel,
                            "TFLOP/s": flops[mode] / (kernel * 1e-3) / 1e12 if kernel and name != "flex-mask" else None,
                            "peak MiB": peak / common.MiB if peak is not None else None})
                rows.append(row)
                print(f"{shape} {mode:<7} {name:<10} kernel {kernel or float('nan'):8.3f} ms "
                      f"{row['TFLOP/s'] or float('nan'):6.0f} TFLOP/s err {row.get('max rel err', float('nan')):.2e}",
                      flush=True)
    print(common.render_text(COLUMNS, rows), flush=True)
    if not args.smoke:
        record = common.result_record("document_attention", {"dtype": "bfloat16", "lengths": "log-normal median 300",
                                                             "default tiles": lowering.GPU_TILES, "tiles": TILES},
                                      COLUMNS, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
