"""Residual add + RMSNorm: does fusing the add into sloth's norm pay? (issue 22's "measure before keeping it")

    python -m benchmarks.ops.residual_norm [--smoke]

In a pre-norm decoder layer the residual sum ``h = x + r`` (the stream plus the attention or MLP output) feeds
both the next norm, ``y = rms_norm(h) * w``, and the next residual add, so both ``h`` and ``y`` leave the block.
Inductor fuses the add into the norm's kernel when it compiles both; sloth's norm is a custom op, so in sloth's
graph the add stays a kernel of its own in front of it, and in the backward the residual gradient
``dh = dh_next + d(norm)/dh`` is another add after the norm's backward. A fused op would move, per element of
``h`` (bf16 units of T x H): forward read x, r, write h, y (4, against 3 + 2 = 5 with the add apart); backward
read h, dy, dh_next, write dh (4, against 3 + 3 = 6). So at most a fifth of the forward's and a third of the
backward's traffic, and at most the add kernels' time.

Providers, each on ``(x, r, w) -> (h, y)`` with a frozen weight (LoRA) and a trained one:
  eager            the two lines in plain PyTorch
  inductor         ``torch.compile`` of them: Inductor's own fused add + norm, the bound a fused sloth op would
                   approach
  sloth today      ``torch.compile`` of the add with sloth's ``rms_norm`` op: the add and the residual gradient's
                   add as Inductor kernels beside sloth's norm kernels, which is what sloth's graph runs now
  sloth norm only  sloth's ``rms_norm`` of ``h`` given (no add; its own inputs), the floor of the norm's part

The decision reads "sloth today" against "inductor" fwd+bwd: their difference, times the step's norms (65 at
Llama-3-8B: 2 a layer and the final one), is what a fused op could save a step.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from benchmarks import common
from benchmarks.ops import harness

EPS = 1e-5  # Llama 3's rms_norm_eps


def residual_norm_eager(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + r; y = w * (h / sqrt(mean(h^2) + eps)) with Llama's fp32 upcast (the pattern sloth matches)."""
    from sloth.patterns.rms_norm import rms_norm_pattern

    h = x + r
    return h, rms_norm_pattern(h, w, EPS)


def residual_norm_sloth(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The add, then sloth's fused norm op (compiled: the add becomes an Inductor kernel, as in sloth's graph)."""
    from sloth.lowering.rms_norm import rms_norm

    h = x + r
    return h, rms_norm(h, w, EPS)


def _inputs(n: int, d: int, device: str, train_weight: bool) -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, d, generator=gen).to(device, torch.bfloat16).requires_grad_()
    r = torch.randn(n, d, generator=gen).to(device, torch.bfloat16).requires_grad_()
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(device, torch.bfloat16).requires_grad_(train_weight)
    return [x, r, w]


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)
    from sloth.lowering.rms_norm import rms_norm

    shapes = [(37, 100)] if args.smoke else [(4096, 4096), (16384, 4096)]  # 2 x 2048 and 1 x 16384 tokens
    copy_gbps = common.copy_bandwidth_gbps()
    rows: list[dict[str, Any]] = []
    for n, d in shapes:
        for train_weight in (False, True):
            torch._dynamo.reset()
            providers = {"eager": residual_norm_eager,
                         "inductor": torch.compile(residual_norm_eager, dynamic=False),
                         "sloth today": torch.compile(residual_norm_sloth, backend="inductor", dynamic=False)}
            inputs = _inputs(n, d, device, train_weight)
            unit = n * d * inputs[0].element_size()
            # Minimal bytes of a fused op (the module docstring); the weight and its gradient are negligible.
            nbytes = {"fwd": 4 * unit, "bwd": 4 * unit, "fwd+bwd": 8 * unit}
            case = f"{n}x{d} w {'trained' if train_weight else 'frozen'}"
            rows += harness.run(case, providers, inputs, nbytes, copy_gbps)
            h = (inputs[0] + inputs[1]).detach().requires_grad_()
            norm_only = harness.run(f"{case} (h given)", {"sloth norm only": lambda h, w: rms_norm(h, w, EPS)},
                                    [h, inputs[2]], {"fwd": 2 * unit, "bwd": 3 * unit, "fwd+bwd": 5 * unit},
                                    copy_gbps)
            rows += norm_only
    print(common.render_text(harness.COLUMNS, rows))
    saving = []
    for r in rows:
        if r["provider"] == "sloth today" and r["mode"] == "fwd+bwd" and r.get("kernel ms"):
            ind = next(x for x in rows if x["shape"] == r["shape"] and x["mode"] == "fwd+bwd"
                       and x["provider"] == "inductor")
            saving.append({"shape": r["shape"], "sloth today kernel ms": r["kernel ms"],
                           "inductor kernel ms": ind.get("kernel ms"), "inductor ms": ind.get("ms"),
                           "per step of 65 norms, ms": 65 * (r["kernel ms"] - (ind.get("kernel ms") or 0))})
    print(common.render_text(list(saving[0]) if saving else ["shape"], saving))
    if not args.smoke:
        config = {"dtype": "bfloat16", "eps": EPS, "copy_gbps": copy_gbps, "saving": saving}
        for path in common.write_result(common.result_record("residual_norm", config, harness.COLUMNS, rows)):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
