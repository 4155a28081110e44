"""A per-op benchmark harness: providers x modes (fwd, bwd, fwd+bwd) on one set of inputs.

An op here is ``fn(*inputs) -> Tensor or tuple of Tensors``; the inputs that require grad get
gradients, with fixed random cotangents. For each provider and mode: median ms per call (host
included, ``common.bench_ms``), GPU kernel ms (``common.kernel_ms``), both as % of the measured copy
bandwidth over the minimal bytes the caller states, peak memory above the inputs, and the largest
error of the output (fwd) or the gradients (bwd) against the first provider, relative to its largest
entry. RMSNorm has its own script (benchmarks/ops/rms_norm.py) with the same columns.
"""
from __future__ import annotations

import argparse
import traceback
from typing import Any, Callable, Sequence

import torch

from benchmarks import common

MODES = ("fwd", "bwd", "fwd+bwd")
COLUMNS = ["shape", "mode", "provider", "ms", "% copy", "x eager", "kernel ms", "kernel % copy", "vs inductor",
           "peak MiB", "max rel err", "error"]


def start(doc: str, argv: list[str] | None, parser: argparse.ArgumentParser | None = None
          ) -> tuple[argparse.Namespace, str]:
    """(parsed args, device) for an op benchmark's main: ``--smoke`` added to ``parser`` (a fresh one with
    ``doc`` as its description by default), the Triton interpreter switched on when there is no GPU, and
    sloth importable; the device is "cuda" when there is one, else "cpu"."""
    if parser is None:
        parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: proves the code paths")
    args = parser.parse_args(argv)
    common.use_triton_interpreter_without_cuda()
    common.import_sloth()
    return args, "cuda" if torch.cuda.is_available() else "cpu"


def _outputs(result: Any) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def _grad_inputs(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]


def rel_err(ours: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """The largest of max|a - b| / max|b| over the pairs."""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
               for a, b in zip(ours, ref))


def max_rel_err(fn: Callable, inputs: Sequence[Any], mode: str, ref_out: Sequence[torch.Tensor],
                ref_grads: Sequence[torch.Tensor], dys: Sequence[torch.Tensor]) -> float:
    """``rel_err`` of ``fn(*inputs)``'s outputs against ``ref_out`` (mode "fwd"), else of the gradients of the
    inputs that require one, for cotangents ``dys``, against ``ref_grads``."""
    if mode == "fwd":
        with torch.no_grad():
            return rel_err(_outputs(fn(*inputs)), ref_out)
    return rel_err(torch.autograd.grad(_outputs(fn(*inputs)), _grad_inputs(inputs), dys), ref_grads)


def time_case(fn: Callable, inputs: Sequence[Any], mode: str) -> tuple[float, float | None, int | None]:
    """(median ms per call, kernel ms per call, peak bytes above inputs) of ``fn`` in one mode.

    bwd replays the backward on a retained graph. AOTAutograd donates saved tensors to the backward
    by default and refuses retain_graph then; its config is read when the forward compiles and when
    the backward first runs, so donation stays off for the whole bwd case (and only there).
    """
    with torch._functorch.config.patch(donated_buffer=mode != "bwd"):
        return _time_case(fn, inputs, mode)


def _time_case(fn: Callable, inputs: Sequence[Any], mode: str) -> tuple[float, float | None, int | None]:
    wrt = _grad_inputs(inputs)
    outs = _outputs(fn(*inputs))
    dys = [torch.randn_like(o) for o in outs]
    if mode == "fwd":
        call: Callable[[], Any] = lambda: fn(*inputs)  # noqa: E731
    elif mode == "fwd+bwd":
        call = lambda: torch.autograd.backward(_outputs(fn(*inputs)), dys)  # noqa: E731
    else:
        call = lambda: torch.autograd.backward(outs, dys, retain_graph=True)  # noqa: E731
    call()
    for t in wrt:
        t.grad = None
    peak = common.peak_memory_bytes(call)
    for t in wrt:
        t.grad = None
    ms = common.bench_ms(call, grad_to_none=wrt)
    kernel = common.kernel_ms(call, grad_to_none=wrt)
    for t in wrt:
        t.grad = None
    return ms, kernel, peak


def timing_columns(ms: float, kernel: float | None, peak: int | None, nbytes: int, copy_gbps: float,
                   eager_ms: float | None) -> dict[str, Any]:
    """The norm benchmarks' timing cells of one row (benchmarks/ops/rms_norm.py, layer_norm.py, l2_norm.py):
    ms and GB/s end to end over ``nbytes``, as % of the copy bandwidth, against eager, and the kernels' alone."""
    gbps = nbytes / (ms * 1e-3) / 1e9
    kernel_gbps = nbytes / (kernel * 1e-3) / 1e9 if kernel else None
    return {"ms": ms, "GB/s": gbps, "% copy": 100 * gbps / copy_gbps, "x eager": eager_ms / ms if eager_ms else None,
            "kernel ms": kernel, "kernel % copy": 100 * kernel_gbps / copy_gbps if kernel else None,
            "peak MiB": peak / common.MiB if peak is not None else None}


def run(shape: str, providers: dict[str, Callable], inputs: Sequence[Any], nbytes: dict[str, int],
        copy_gbps: float) -> list[dict[str, Any]]:
    """Rows for one shape: every provider in every mode."""
    rows: list[dict[str, Any]] = []
    names = list(providers)
    wrt = _grad_inputs(inputs)
    with torch.no_grad():
        ref_out = _outputs(providers[names[0]](*inputs))
    dys = [torch.randn_like(o) for o in ref_out]
    ref_grads = torch.autograd.grad(_outputs(providers[names[0]](*inputs)), wrt, dys)
    for mode in MODES:
        base: dict[str, float] = {}
        for name, fn in providers.items():
            row: dict[str, Any] = {"shape": shape, "mode": mode, "provider": name}
            try:
                if mode in ("fwd", "bwd"):
                    row["max rel err"] = max_rel_err(fn, inputs, mode, ref_out, ref_grads, dys)
                ms, kernel, peak = time_case(fn, inputs, mode)
            except Exception as exc:  # one broken provider must not hide the others' numbers
                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {exc}"[:120]
                rows.append(row)
                continue
            base.setdefault(name, kernel or ms)
            gbps = nbytes[mode] / (ms * 1e-3) / 1e9
            row.update({"ms": ms, "% copy": 100 * gbps / copy_gbps,
                        "x eager": (rows_ms(rows, mode, "eager") or ms) / ms,
                        "kernel ms": kernel,
                        "kernel % copy": 100 * nbytes[mode] / (kernel * 1e-3) / 1e9 / copy_gbps if kernel else None,
                        "vs inductor": (base.get("inductor") / kernel) if kernel and "inductor" in base else None,
                        "peak MiB": peak / common.MiB if peak is not None else None})
            rows.append(row)
            print(f"{shape:>28} {mode:<7} {name:<8} {ms:8.4f} ms  kernel {kernel or float('nan'):8.4f} ms", flush=True)
    return rows


def rows_ms(rows: list[dict[str, Any]], mode: str, provider: str) -> float | None:
    for r in rows:
        if r["mode"] == mode and r["provider"] == provider and "ms" in r:
            return r["ms"]
    return None
