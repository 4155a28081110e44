"""RMSNorm microbenchmark: eager pattern vs Inductor vs sloth's fused op.

Measures, for each shape x weight-gradient on/off x mode (fwd, bwd, fwd+bwd) x provider:
median time, achieved bandwidth over the minimal bytes, that bandwidth as a share of a
device-to-device copy measured at the start, and the peak memory one call allocates above its inputs.

Providers:
  eager     `sloth.patterns.rms_norm.rms_norm_pattern` (plain PyTorch; the meaning and the baseline)
  inductor  `torch.compile` of that same function
  sloth     `sloth.lowering.rms_norm.rms_norm` (the fused Triton op, with its registered backward)

Run: ``python -m benchmarks.ops.rms_norm`` (H200), ``python -m benchmarks.ops.rms_norm --smoke`` (CPU,
tiny shapes, Triton interpreter: proves the code paths, its timings mean nothing).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import common
from benchmarks.ops import harness

EPS = 1e-5  # Llama 3's rms_norm_eps
FP32_BYTES = 4

# (name, rows N = batch x tokens, hidden D). 4096 x 4096 is one Llama-3-8B step of 2 x 2048 tokens;
# 16384 x 4096 is the long-context row of DESIGN.md's table (1 x 16384).
SHAPES = [("llama3-8b", 4096, 4096), ("long-ctx", 16384, 4096),
          ("qk-norm", 4096 * 32, 128)]  # Qwen3's q-norm: every head of 4096 tokens, head_dim 128
SMOKE_SHAPES = [("tiny", 8, 64), ("tiny-odd", 5, 100)]  # 100: not a power of two, masks exercised
MODES = ["fwd", "bwd", "fwd+bwd"]
PROVIDERS = ["eager", "inductor", "sloth"]
# ms / GB/s / % copy: end to end per call (host overhead included); kernel ms / kernel % copy: the
# GPU kernels alone (see common.kernel_ms), the number a busy training step sees.
COLUMNS = ["shape", "dw", "mode", "provider", "ms", "GB/s", "% copy", "x eager", "kernel ms", "kernel % copy",
           "peak MiB", "max err", "error"]

NormFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def minimal_bytes(n: int, d: int, x_bytes: int, w_bytes: int, mode: str, weight_grad: bool) -> int:
    """Bytes a perfect kernel must move; the roofline every provider is held to.

    fwd:  read x (N D) and w (D), write y (N D)                      -> 2 N D e + D e_w
    bwd:  read x, dy (N D each), w (D), rstd (N fp32), write dx (N D)
          and, with a weight gradient, dw (D); per-program dw partials are
          an implementation's cost, not the floor                     -> 3 N D e + D e_w + 4 N (+ D e_w)
    fwd+bwd: the sum (x is read once by each pass)
    """
    fwd = 2 * n * d * x_bytes + d * w_bytes
    bwd = 3 * n * d * x_bytes + d * w_bytes + n * FP32_BYTES + (d * w_bytes if weight_grad else 0)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def make_provider(name: str) -> NormFn:
    """The function `name` benchmarks, as f(x, w) -> y."""
    if name == "eager":
        from sloth.patterns.rms_norm import rms_norm_pattern

        return lambda x, w: rms_norm_pattern(x, w, EPS)
    if name == "inductor":
        from sloth.patterns.rms_norm import rms_norm_pattern

        # A fresh cache per case: no recompile limit reached across 12 cases, and no graph compiled
        # with buffer donation reused by the bwd mode (see `run_case`).
        torch._dynamo.reset()
        compiled = torch.compile(rms_norm_pattern, dynamic=False)
        return lambda x, w: compiled(x, w, EPS)
    if name == "sloth":
        from sloth.lowering.rms_norm import rms_norm

        return lambda x, w: rms_norm(x, w, EPS)
    raise ValueError(f"unknown provider {name!r}")


@dataclass
class Inputs:
    x: torch.Tensor  # (N, D), requires grad: hidden states always need one, even under LoRA
    w: torch.Tensor  # (D,), requires grad only when the weight is trained (frozen under LoRA)
    dy: torch.Tensor  # (N, D), upstream gradient


def make_inputs(n: int, d: int, dtype: torch.dtype, weight_grad: bool, device: str) -> Inputs:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, d, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    # Weights near 1 as trained norms are, but not all 1 so a wrong broadcast shows.
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(device=device, dtype=dtype)
    dy = torch.randn(n, d, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return Inputs(x.requires_grad_(True), w.requires_grad_(weight_grad), dy)


def run_case(fn: NormFn, inp: Inputs, mode: str) -> tuple[float, float | None, int | None]:
    """(median ms per call, kernel ms per call, peak bytes above inputs) of one mode (harness.time_case)."""
    return harness.time_case(fn, [inp.x, inp.w], mode)


def forward_error(fn: NormFn, reference: NormFn, inp: Inputs) -> float:
    """Largest |y - y_eager|: a benchmark of a wrong kernel is worthless, so check before timing."""
    with torch.no_grad():
        return (fn(inp.x, inp.w).float() - reference(inp.x, inp.w).float()).abs().max().item()


def backward_error(fn: NormFn, reference: NormFn, inp: Inputs) -> float:
    """Largest |grad - grad_eager| over dx (and dw when the weight is trained), relative to the
    largest eager gradient entry: the backward kernel is checked on the device before it is timed."""
    wrt = [t for t in (inp.x, inp.w) if t.requires_grad]
    ours = torch.autograd.grad(fn(inp.x, inp.w), wrt, inp.dy)
    theirs = torch.autograd.grad(reference(inp.x, inp.w), wrt, inp.dy)
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(ours, theirs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU-capable tiny shapes; proves the code paths")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dw", choices=["both", "on", "off"], default="both", help="weight gradient (off = LoRA)")
    parser.add_argument("--shapes", default=None, help="NxD,NxD,... (default: Llama-3-8B and 16k context)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (smoke: no file)")
    args = parser.parse_args(argv)

    common.use_triton_interpreter_without_cuda()  # before sloth imports triton
    common.import_sloth()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    if args.shapes:
        shapes = [(s, *map(int, s.split("x"))) for s in args.shapes.split(",")]
    else:
        shapes = SMOKE_SHAPES if args.smoke else SHAPES
    weight_grads = {"both": [False, True], "on": [True], "off": [False]}[args.dw]
    providers, modes = args.providers.split(","), args.modes.split(",")

    copy_gbps = common.copy_bandwidth_gbps()
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + written)", flush=True)

    reference = make_provider("eager")
    rows: list[dict[str, Any]] = []
    for shape_name, n, d in shapes:
        for weight_grad in weight_grads:
            inp = make_inputs(n, d, dtype, weight_grad, device)
            for mode in modes:
                nbytes = minimal_bytes(n, d, inp.x.element_size(), inp.w.element_size(), mode, weight_grad)
                eager_ms = None
                for provider in providers:
                    row: dict[str, Any] = {"shape": f"{shape_name} {n}x{d}", "dw": "on" if weight_grad else "off",
                                           "mode": mode, "provider": provider, "bytes": nbytes}
                    try:
                        fn = make_provider(provider)
                        if mode == "fwd":
                            row["max err"] = forward_error(fn, reference, inp)
                        elif mode == "bwd":
                            row["max err"] = backward_error(fn, reference, inp)
                        ms, kernel, peak = run_case(fn, inp, mode)
                    except Exception as exc:  # one broken provider must not hide the others' numbers
                        traceback.print_exc()
                        row["error"] = f"{type(exc).__name__}: {exc}"[:120]
                        rows.append(row)
                        continue
                    eager_ms = ms if provider == "eager" else eager_ms
                    row.update(harness.timing_columns(ms, kernel, peak, nbytes, copy_gbps, eager_ms))
                    rows.append(row)
                    print(f"{row['shape']:>22} dw={row['dw']:<3} {mode:<7} {provider:<8} {ms:8.4f} ms "
                          f"{row['GB/s']:7.0f} GB/s", flush=True)

    print()
    print(common.render_text(COLUMNS, rows))
    config = {"dtype": args.dtype, "eps": EPS, "smoke": args.smoke, "copy_gbps": copy_gbps,
              "bytes_formula": minimal_bytes.__doc__}
    record = common.result_record("rms_norm", config, COLUMNS, rows)
    if not args.smoke or args.results_dir:
        for path in common.write_result(record, args.results_dir, "-smoke" if args.smoke else ""):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
