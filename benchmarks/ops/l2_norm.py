"""L2-norm microbenchmark: eager pattern vs Inductor vs sloth's fused op.

Measures, for each shape x eps form x mode (fwd, bwd, fwd+bwd) x provider: median time, achieved
bandwidth over the minimal bytes, that bandwidth as a share of a device-to-device copy measured at the
start, and the peak memory one call allocates above its inputs. The same columns as
benchmarks/ops/rms_norm.py, with "form" in place of "dw" (an L2 norm has no weight):

  clamp   x / max(||x||, eps)          F.normalize(x, dim=-1), eps 1e-12 (its default)
  add     x * rsqrt(sum(x^2) + eps)    the q/k L2-norm as linear-attention code writes it, eps 1e-6
                                       (FLA's l2norm; transformers' Qwen3-Next `l2norm`)

Providers:
  eager     the pattern of that form: `sloth.patterns.l2_norm.normalize_pattern` (clamp) or
            `l2_norm_pattern` (add; fp32 inside, cast back)
  inductor  `torch.compile` of that same function
  sloth     `sloth.lowering.l2_norm.l2_norm(x, eps, clamp)` (the fused Triton op, with its registered backward)
There is no Liger row: Liger-Kernel has no L2-norm op (0.8.5's norms are RMSNorm, fused add + RMSNorm,
LayerNorm, GroupNorm, PolyNorm and DyT; F.normalize appears only inside its cosine-similarity loss).

Run: ``python -m benchmarks.ops.l2_norm`` (H200), ``python -m benchmarks.ops.l2_norm --smoke`` (CPU,
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

EPS = {"clamp": 1e-12, "add": 1e-6}  # F.normalize's default; FLA's and transformers' l2norm default
FORMS = list(EPS)

# (name, rows N, hidden D, the forms its models use).
# 131072 x 128: Qwen3-Next's linear-attention (gated DeltaNet) q and k, 16 heads each of head_dim 128, every
#   head of 4096 tokens (2 x 2048): 4096 * 32 rows, normalised in the `add` form;
# 4096 x 4096: full-width rows, F.normalize over a 4096-wide hidden state (nGPT-style normalised hidden
#   states, or a 4096-wide embedding model's pooled outputs), 4096 of them.
SHAPES = [("qwen3-next-qk", 4096 * 32, 128, ["add"]), ("full-width", 4096, 4096, ["clamp"])]
SMOKE_SHAPES = [("tiny", 8, 64, FORMS), ("tiny-odd", 5, 100, FORMS)]  # 100: not a power of two, masks exercised
MODES = ["fwd", "bwd", "fwd+bwd"]
PROVIDERS = ["eager", "inductor", "sloth"]
# ms / GB/s / % copy: end to end per call (host overhead included); kernel ms / kernel % copy: the
# GPU kernels alone (see common.kernel_ms), the number a busy training step sees.
COLUMNS = ["shape", "form", "mode", "provider", "ms", "GB/s", "% copy", "x eager", "kernel ms", "kernel % copy",
           "peak MiB", "max err", "error"]

NormFn = Callable[[torch.Tensor], torch.Tensor]


def minimal_bytes(n: int, d: int, x_bytes: int, mode: str) -> int:
    """Bytes a perfect kernel must move; the roofline every provider is held to.

    fwd:  read x (N D), write y (N D)                                -> 2 N D e
    bwd:  read x, dy (N D each), write dx (N D); the row's sum of
          squares is recomputed from the row the backward loads      -> 3 N D e
    fwd+bwd: the sum (x is read once by each pass)
    """
    fwd = 2 * n * d * x_bytes
    bwd = 3 * n * d * x_bytes
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _pattern(form: str) -> Callable[[torch.Tensor, float], torch.Tensor]:
    from sloth.patterns.l2_norm import l2_norm_pattern, normalize_pattern

    return {"clamp": normalize_pattern, "add": l2_norm_pattern}[form]


def make_provider(name: str, form: str) -> NormFn:
    """The function `name` benchmarks for eps form `form`, as f(x) -> y."""
    eps = EPS[form]
    if name == "eager":
        pattern = _pattern(form)
        return lambda x: pattern(x, eps)
    if name == "inductor":
        # A fresh cache per case: no recompile limit reached across the cases, and no graph compiled
        # with buffer donation reused by the bwd mode (see harness.time_case).
        torch._dynamo.reset()
        compiled = torch.compile(_pattern(form), dynamic=False)
        return lambda x: compiled(x, eps)
    if name == "sloth":
        from sloth.lowering.l2_norm import l2_norm

        clamp = form == "clamp"
        return lambda x: l2_norm(x, eps, clamp)
    raise ValueError(f"unknown provider {name!r}")


@dataclass
class Inputs:
    x: torch.Tensor  # (N, D), requires grad
    dy: torch.Tensor  # (N, D), upstream gradient


def make_inputs(n: int, d: int, dtype: torch.dtype, device: str) -> Inputs:
    gen = torch.Generator(device="cpu").manual_seed(0)
    # Row scales spread over two decades, as q/k projections' are, so the per-row scale is exercised.
    scale = torch.logspace(-1, 1, n)[torch.randperm(n, generator=gen)].unsqueeze(1)
    x = (scale * torch.randn(n, d, generator=gen)).to(device=device, dtype=dtype)
    dy = torch.randn(n, d, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return Inputs(x.requires_grad_(True), dy)


def run_case(fn: NormFn, inp: Inputs, mode: str) -> tuple[float, float | None, int | None]:
    """(median ms per call, kernel ms per call, peak bytes above inputs) of one mode (harness.time_case)."""
    return harness.time_case(fn, [inp.x], mode)


def forward_error(fn: NormFn, reference: NormFn, inp: Inputs) -> float:
    """Largest |y - y_eager| (y is at most 1 in magnitude): checked before timing."""
    with torch.no_grad():
        return (fn(inp.x).float() - reference(inp.x).float()).abs().max().item()


def backward_error(fn: NormFn, reference: NormFn, inp: Inputs) -> float:
    """Largest |dx - dx_eager| relative to the largest eager dx entry: the backward kernel is checked
    on the device before it is timed."""
    (ours,) = torch.autograd.grad(fn(inp.x), [inp.x], inp.dy)
    (theirs,) = torch.autograd.grad(reference(inp.x), [inp.x], inp.dy)
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU-capable tiny shapes; proves the code paths")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--forms", default=None,
                        help="clamp,add: every shape in these eps forms (default: each shape's own; --shapes: both)")
    parser.add_argument("--shapes", default=None, help="NxD,NxD,... (default: Qwen3-Next q/k heads, full width)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (smoke: no file)")
    args = parser.parse_args(argv)

    common.use_triton_interpreter_without_cuda()  # before sloth imports triton
    common.import_sloth()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    if args.shapes:
        shapes = [(s, *map(int, s.split("x")), FORMS) for s in args.shapes.split(",")]
    else:
        shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.forms:
        forms = args.forms.split(",")
        unknown = set(forms) - set(FORMS)
        if unknown:
            parser.error(f"unknown forms {sorted(unknown)}; known: {FORMS}")
        shapes = [(name, n, d, forms) for name, n, d, _ in shapes]
    providers, modes = args.providers.split(","), args.modes.split(",")

    copy_gbps = common.copy_bandwidth_gbps()
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + written)", flush=True)

    rows: list[dict[str, Any]] = []
    for shape_name, n, d, shape_forms in shapes:
        inp = make_inputs(n, d, dtype, device)
        for form in shape_forms:
            reference = make_provider("eager", form)
            for mode in modes:
                nbytes = minimal_bytes(n, d, inp.x.element_size(), mode)
                eager_ms = None
                for provider in providers:
                    row: dict[str, Any] = {"shape": f"{shape_name} {n}x{d}", "form": form, "mode": mode,
                                           "provider": provider, "bytes": nbytes}
                    try:
                        fn = make_provider(provider, form)
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
                    print(f"{row['shape']:>22} {form:<5} {mode:<7} {provider:<8} {ms:8.4f} ms "
                          f"{row['GB/s']:7.0f} GB/s", flush=True)

    print()
    print(common.render_text(COLUMNS, rows))
    config = {"dtype": args.dtype, "eps": EPS, "smoke": args.smoke, "copy_gbps": copy_gbps,
              "bytes_formula": minimal_bytes.__doc__}
    record = common.result_record("l2_norm", config, COLUMNS, rows)
    if not args.smoke or args.results_dir:
        for path in common.write_result(record, args.results_dir, "-smoke" if args.smoke else ""):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
