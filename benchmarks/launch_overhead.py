"""Host time of sloth's launches and ops on the GPU machine, with and without lowering/fast_launch.py.

    python -m benchmarks.launch_overhead          (CUDA)

Tiny shapes, so the GPU finishes each kernel before the host has issued the next: the wall time of a loop of
calls is then the host's time per call. Reported per row: microseconds per call through Triton's own dispatch
(``kernel[grid]``) and through the cached launcher, and whether the two produced bit-identical outputs.
"""
from __future__ import annotations

import sys
import time

import torch

from benchmarks import common


def _host_us(fn, reps: int = 400) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):  # the best of five loops: the machine's other work only ever adds time
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> int:
    common.import_sloth()
    from sloth.lowering import lora, registration, rms_norm
    from sloth.lowering.fast_launch import cached

    dev, bf16 = "cuda", torch.bfloat16
    torch.manual_seed(0)
    m, k, n, r = 16, 4096, 4096, 16
    x = torch.randn(m, k, device=dev, dtype=bf16)
    w = torch.randn(n, k, device=dev, dtype=bf16) / 64
    a = torch.randn(r, k, device=dev) / 64
    b = torch.randn(n, r, device=dev) / 64
    dy = torch.randn(m, n, device=dev, dtype=bf16)
    nw = torch.randn(k, device=dev, dtype=bf16)
    base = torch.randn(m, n, device=dev, dtype=bf16)
    h = torch.randn(m, r, device=dev)
    lora.register()
    rms_norm.register()

    q = b.t()

    def up_add(launcher):
        return lambda: launcher[(1, 64)](base, h, q, base, m, n, r, base.stride(0), q.stride(0), q.stride(1),
                                         base.stride(0), 0.5,
                                         BLOCK_M=64, BLOCK_N=64, BLOCK_R=16, num_warps=4, num_stages=2)

    ops = {
        "one launch (_lora_up_add_kernel)": None,
        "sloth::lora_linear": lambda: torch.ops.sloth.lora_linear(x, w, None, a, b, 2.0),
        "sloth::lora_linear_backward": lambda: torch.ops.sloth.lora_linear_backward(dy, x, w, a, b, h, 2.0, True),
        "sloth::rms_norm": lambda: torch.ops.sloth.rms_norm(x, nw, 1e-6, 0.0, bf16),
        "sloth::rms_norm_backward": lambda: torch.ops.sloth.rms_norm_backward(x, x, nw, 1e-6, 0.0, True),
        "lora_forward, no dispatcher": lambda: lora.lora_forward(x, w, None, a, b, 2.0),
    }
    rows = []
    for name, fn in ops.items():
        row = {"call": name}
        outs = {}
        for mode in ("triton", "cached"):
            registration.FAST_LAUNCH = mode == "cached"
            if fn is None:
                call = up_add(lora._lora_up_add_kernel if mode == "triton" else cached(lora._lora_up_add_kernel))
            else:
                call = fn
            row[f"{mode} us"] = round(_host_us(call), 2)
            torch.manual_seed(1)
            out = call()
            torch.cuda.synchronize()
            outs[mode] = [t.clone() for t in (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(t, torch.Tensor)]
        row["saved us"] = round(row["triton us"] - row["cached us"], 2)
        row["bit-identical"] = all(torch.equal(p, q) for p, q in zip(outs["triton"], outs["cached"])) \
            if fn is not None else "-"
        rows.append(row)
        print(row, flush=True)
    registration.FAST_LAUNCH = True
    columns = ["call", "triton us", "cached us", "saved us", "bit-identical"]
    record = common.result_record("launch_overhead", {"m": m, "k": k, "n": n, "r": r, "dtype": "bf16"}, columns,
                                  rows)
    common.write_result(record)
    return 0 if all(r["bit-identical"] in (True, "-") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
