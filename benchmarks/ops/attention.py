"""Causal GQA attention, forward and forward+backward, by every kernel PyTorch can run it with.

    python -m benchmarks.ops.attention [--smoke]

Not a sloth op: this measures which attention kernel a Llama-3-8B-shaped step should use. transformers
calls ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` on [b, h, s, d]
views of the projections; SDPA then picks a backend by its own priority (on the H200 with torch 2.11 the
profiles in benchmarks/results/ show cuDNN's). Providers:

    sdpa-default   what SDPA picks, enable_gqa=True (the step's attention as it runs today)
    cudnn          SDPBackend.CUDNN_ATTENTION, enable_gqa=True
    cudnn-repeat   CUDNN_ATTENTION on k, v repeated to every query head (transformers' repeat_kv, which it takes
                   whenever it passes SDPA a mask: 5.17 under Dynamo; sloth's gqa_attention family undoes it)
    flash          SDPBackend.FLASH_ATTENTION, enable_gqa=True
    flash-repeat   FLASH_ATTENTION on k, v repeated to every query head (transformers' repeat_kv form)
    efficient      SDPBackend.EFFICIENT_ATTENTION on repeated k, v
    flex           torch.compile'd flex_attention with a causal block mask, enable_gqa=True

Shapes: batch 2 x 2048 and 1 x 16384 tokens, 32 query heads, 8 key/value heads, head_dim 128, bf16.
TFLOP/s counts the causal half of QK^T and PV (forward 2 b h s^2 d, backward twice that); errors are
relative to sdpa-default.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks import common
from benchmarks.ops import harness

COLUMNS = ["shape", "mode", "provider", "kernel ms", "TFLOP/s", "peak MiB", "max rel err", "error"]


def _sdpa(backend: Any, repeat: bool) -> Callable:
    from torch.nn.attention import sdpa_kernel

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if repeat:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not repeat)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not repeat)

    return run


def _flex(seq: int, device: str) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq, seq, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=True)


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)
    from torch.nn.attention import SDPBackend

    shapes = [(1, 64, 4, 2, 16)] if args.smoke else [(2, 2048, 32, 8, 128), (1, 16384, 32, 8, 128)]
    rows: list[dict[str, Any]] = []
    for batch, seq, heads, kv_heads, dim in shapes:
        torch._dynamo.reset()
        providers = {"sdpa-default": _sdpa(None, False), "cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION, False),
                     "cudnn-repeat": _sdpa(SDPBackend.CUDNN_ATTENTION, True),
                     "flash": _sdpa(SDPBackend.FLASH_ATTENTION, False),
                     "flash-repeat": _sdpa(SDPBackend.FLASH_ATTENTION, True),
                     "efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION, True)}
        try:
            providers["flex"] = _flex(seq, device)
        except Exception as exc:  # flex needs a GPU (or a recent CPU Inductor); say so and go on
            rows.append({"shape": f"b{batch} s{seq}", "provider": "flex", "error": f"{type(exc).__name__}: {exc}"[:120]})
        gen = torch.Generator(device="cpu").manual_seed(0)

        def proj(h: int) -> torch.Tensor:
            # [b, s, h, d] transposed to [b, h, s, d], as transformers views its projections
            t = torch.randn(batch, seq, h, dim, generator=gen).to(device, torch.bfloat16)
            return t.transpose(1, 2).requires_grad_()

        q, k, v = proj(heads), proj(kv_heads), proj(kv_heads)
        # causal: half of QK^T and PV's 4 b h s^2 d forward; the backward is twice the forward
        flops = {"fwd": 2 * batch * heads * seq * seq * dim, "fwd+bwd": 6 * batch * heads * seq * seq * dim}
        dy = torch.randn(batch, heads, seq, dim, generator=gen).to(device, torch.bfloat16)
        with torch.no_grad():
            ref = providers["sdpa-default"](q, k, v).float()
        ref_grads = torch.autograd.grad(providers["sdpa-default"](q, k, v), (q, k, v), dy)
        for name, fn in providers.items():
            for mode in ("fwd", "fwd+bwd"):
                row: dict[str, Any] = {"shape": f"b{batch} s{seq} h{heads}/{kv_heads} d{dim}", "mode": mode,
                                       "provider": name}
                try:
                    row["max rel err"] = harness.max_rel_err(fn, [q, k, v], mode, [ref], ref_grads, [dy])
                    _, kernel, peak = harness.time_case(fn, [q, k, v], mode)
                except Exception as exc:  # a backend that cannot run this shape is a row, not a crash
                    row["error"] = f"{type(exc).__name__}: {exc}"[:120]
                    rows.append(row)
                    print(f"{row['shape']} {mode} {name}: {row['error']}", flush=True)
                    continue
                row.update({"kernel ms": kernel, "TFLOP/s": flops[mode] / (kernel * 1e-3) / 1e12 if kernel else None,
                            "peak MiB": peak / common.MiB if peak is not None else None})
                rows.append(row)
                print(f"{row['shape']} {mode:<7} {name:<12} kernel {kernel or float('nan'):8.3f} ms "
                      f"{row['TFLOP/s'] or float('nan'):6.0f} TFLOP/s  err {row['max rel err']:.2e}", flush=True)
    print(common.render_text(COLUMNS, rows))
    if not args.smoke:
        record = common.result_record("attention", {"dtype": "bfloat16", "causal": True}, COLUMNS, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
