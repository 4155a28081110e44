"""LayerNorm microbenchmark: eager PyTorch vs Inductor vs sloth's fused op vs Liger's LayerNorm.

Measures, for each shape x weight-and-bias gradient on/off x mode (fwd, bwd, fwd+bwd) x provider:
median time, achieved bandwidth over the minimal bytes, that bandwidth as a share of a
device-to-device copy measured at the start, and the peak memory one call allocates above its inputs.
The same columns as benchmarks/ops/rms_norm.py; "dw/db" on is full fine-tuning, off a frozen norm (LoRA).

Providers (all with a weight and a bias, as nn.LayerNorm has them; Liger's op requires both):
  eager     `sloth.patterns.layer_norm.layer_norm_pattern` (F.layer_norm: PyTorch's native fused kernel)
  inductor  `torch.compile` of that same function
  sloth     `sloth.lowering.layer_norm.layer_norm` (the fused Triton op, with its registered backward)
  liger     `liger_kernel.ops.layer_norm.LigerLayerNormFunction.apply(x, w, b, eps)` when liger_kernel
            imports; else its rows carry the import error

Run: ``python -m benchmarks.ops.layer_norm`` (H200), ``python -m benchmarks.ops.layer_norm --smoke`` (CPU,
tiny shapes, Triton interpreter: proves the code paths, its timings mean nothing).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import common
from benchmarks.ops import harness

EPS = 1e-5  # nn.LayerNorm's default, and the layer_norm_eps of GPT-J, Pythia and phi-2

# (name, rows N = batch x tokens, hidden D). Models whose norms are LayerNorms with a bias:
# 4096 x 4096: GPT-J-6B / Pythia-6.9B (hidden 4096) at 2 x 2048 tokens, the step of rms_norm.py's llama3-8b row;
# 16384 x 4096: the same width at 1 x 16384 tokens (the long-context row);
# 4096 x 2560: phi-2 / Pythia-2.8B (GPT-NeoX, hidden 2560) at 2 x 2048: a width that is not a power of two.
SHAPES = [("gpt-j-6b", 4096, 4096), ("long-ctx", 16384, 4096), ("phi-2", 4096, 2560)]
SMOKE_SHAPES = [("tiny", 8, 64), ("tiny-odd", 5, 100)]  # 100: not a power of two, masks exercised
MODES = ["fwd", "bwd", "fwd+bwd"]
PROVIDERS = ["eager", "inductor", "sloth", "liger"]
# ms / GB/s / % copy: end to end per call (host overhead included); kernel ms / kernel % copy: the
# GPU kernels alone (see common.kernel_ms), the number a busy training step sees.
COLUMNS = ["shape", "dw/db", "mode", "provider", "ms", "GB/s", "% copy", "x eager", "kernel ms", "kernel % copy",
           "peak MiB", "max err", "error"]

NormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ProviderUnavailable(RuntimeError):
    """A provider that cannot run here (Liger not installed): its rows say why, without a traceback."""


def minimal_bytes(n: int, d: int, x_bytes: int, w_bytes: int, mode: str, weight_grad: bool) -> int:
    """Bytes a perfect kernel must move; the roofline every provider is held to.

    fwd:  read x (N D), w and b (D each), write y (N D)             -> 2 N D e + 2 D e_w
    bwd:  read x, dy (N D each), w (D), write dx (N D) and, with the
          parameter gradients, dw and db (D each); the row's mean and
          rstd are recomputed from the row the backward loads anyway
          (Liger saves them instead: 8 N bytes, its cost, not the floor),
          per-program dw/db partials are an implementation's cost   -> 3 N D e + D e_w (+ 2 D e_w)
    fwd+bwd: the sum (x is read once by each pass)
    """
    fwd = 2 * n * d * x_bytes + 2 * d * w_bytes
    bwd = 3 * n * d * x_bytes + d * w_bytes + (2 * d * w_bytes if weight_grad else 0)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _liger_layer_norm() -> NormFn:
    """Liger's LayerNorm as f(x, w, b), or ProviderUnavailable with the import's error."""
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except Exception as exc:  # not installed, or fails to import on this torch/triton: the rows say so
        raise ProviderUnavailable(f"liger_kernel does not import ({type(exc).__name__}: {exc})") from exc
    # liger_kernel/ops/layer_norm.py (0.8.5): forward(ctx, X, W, B, eps); W and B are required.
    return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)


def _liger_version() -> str | None:
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None


def make_provider(name: str) -> NormFn:
    """The function `name` benchmarks, as f(x, w, b) -> y."""
    if name == "eager":
        from sloth.patterns.layer_norm import layer_norm_pattern

        return lambda x, w, b: layer_norm_pattern(x, w, b, EPS)
    if name == "inductor":
        from sloth.patterns.layer_norm import layer_norm_pattern

        # A fresh cache per case: no recompile limit reached across 18 cases, and no graph compiled
        # with buffer donation reused by the bwd mode (see harness.time_case).
        torch._dynamo.reset()
        compiled = torch.compile(layer_norm_pattern, dynamic=False)
        return lambda x, w, b: compiled(x, w, b, EPS)
    if name == "sloth":
        from sloth.lowering.layer_norm import layer_norm

        return lambda x, w, b: layer_norm(x, w, b, EPS)
    if name == "liger":
        return _liger_layer_norm()
    raise ValueError(f"unknown provider {name!r}")


@dataclass
class Inputs:
    x: torch.Tensor  # (N, D), requires grad: hidden states always need one, even under LoRA
    w: torch.Tensor  # (D,), requires grad only when the norm is trained (frozen under LoRA)
    b: torch.Tensor  # (D,), as w
    dy: torch.Tensor  # (N, D), upstream gradient


def make_inputs(n: int, d: int, dtype: torch.dtype, weight_grad: bool, device: str) -> Inputs:
    gen = torch.Generator(device="cpu").manual_seed(0)
    # A non-zero mean per row, as hidden states have, so that the centring is exercised.
    x = (torch.randn(n, d, generator=gen) + 0.5 * torch.randn(n, 1, generator=gen)).to(device=device, dtype=dtype)
    # Weights near 1 and biases near 0 as trained norms have, but neither constant so a wrong broadcast shows.
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(device=device, dtype=dtype)
    b = (0.1 * torch.randn(d, generator=gen)).to(device=device, dtype=dtype)
    dy = torch.randn(n, d, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return Inputs(x.requires_grad_(True), w.requires_grad_(weight_grad), b.requires_grad_(weight_grad), dy)


def run_case(fn: NormFn, inp: Inputs, mode: str) -> tuple[float, float | None, int | None]:
    """(median ms per call, kernel ms per call, peak bytes above inputs) of one mode (harness.time_case)."""
    return harness.time_case(fn, [inp.x, inp.w, inp.b], mode)


def forward_error(fn: NormFn, reference: NormFn, inp: Inputs) -> float:
    """Largest |y - y_eager|: a benchmark of a wrong kernel is worthless, so check before timing."""
    with torch.no_grad():
        return (fn(inp.x, inp.w, inp.b).float() - reference(inp.x, inp.w, inp.b).float()).abs().max().item()


def backward_error(fn: NormFn, reference: NormFn, inp: Inputs) -> float:
    """Largest |grad - grad_eager| over dx (and dw, db when the norm is trained), relative to the
    largest eager gradient entry: the backward kernel is checked on the device before it is timed."""
    wrt = [t for t in (inp.x, inp.w, inp.b) if t.requires_grad]
    ours = torch.autograd.grad(fn(inp.x, inp.w, inp.b), wrt, inp.dy)
    theirs = torch.autograd.grad(reference(inp.x, inp.w, inp.b), wrt, inp.dy)
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(ours, theirs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU-capable tiny shapes; proves the code paths")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dw", choices=["both", "on", "off"], default="both",
                        help="weight and bias gradients (off = frozen norm, LoRA)")
    parser.add_argument("--shapes", default=None, help="NxD,NxD,... (default: GPT-J-6B, 16k context, phi-2)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results (smoke: no file)")
    args = parser.parse_args(argv)

    common.use_triton_interpreter_without_cuda()  # before sloth (or liger_kernel) imports triton
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
                    row: dict[str, Any] = {"shape": f"{shape_name} {n}x{d}", "dw/db": "on" if weight_grad else "off",
                                           "mode": mode, "provider": provider, "bytes": nbytes}
                    try:
                        fn = make_provider(provider)
                        if mode == "fwd":
                            row["max err"] = forward_error(fn, reference, inp)
                        elif mode == "bwd":
                            row["max err"] = backward_error(fn, reference, inp)
                        ms, kernel, peak = run_case(fn, inp, mode)
                    except Exception as exc:  # one broken provider must not hide the others' numbers
                        unavailable = isinstance(exc, ProviderUnavailable)
                        if not unavailable:
                            traceback.print_exc()
                        row["error"] = (str(exc) if unavailable else f"{type(exc).__name__}: {exc}")[:120]
                        rows.append(row)
                        continue
                    eager_ms = ms if provider == "eager" else eager_ms
                    row.update(harness.timing_columns(ms, kernel, peak, nbytes, copy_gbps, eager_ms))
                    rows.append(row)
                    print(f"{row['shape']:>22} dw/db={row['dw/db']:<3} {mode:<7} {provider:<8} {ms:8.4f} ms "
                          f"{row['GB/s']:7.0f} GB/s", flush=True)

    print()
    print(common.render_text(COLUMNS, rows))
    config = {"dtype": args.dtype, "eps": EPS, "smoke": args.smoke, "copy_gbps": copy_gbps,
              "liger_kernel": _liger_version(), "bytes_formula": minimal_bytes.__doc__}
    record = common.result_record("layer_norm", config, COLUMNS, rows)
    if not args.smoke or args.results_dir:
        for path in common.write_result(record, args.results_dir, "-smoke" if args.smoke else ""):
            print(f"wrote {path}")
    # Liger is a peer measured when it can run; its failures are shown, not this benchmark's.
    return 1 if any("error" in r and r["provider"] != "liger" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
