"""Sweep of the RMSNorm backward launch with a weight gradient: rows per block x warps x programs/SM.

    python -m benchmarks.ops.rms_norm_sweep        (H200; kernel ms and % of copy bandwidth per setting)

The backward with dW runs persistent programs that each sum the dW of their rows in registers; the
constants in lowering/rms_norm.py (_DW_WIDE, _DW_NARROW) cite this sweep's best settings.
"""
from __future__ import annotations

import itertools

import torch

from benchmarks import common
from benchmarks.ops.rms_norm import EPS, make_inputs, minimal_bytes, run_case


def main() -> None:
    common.import_sloth()
    import sloth.lowering.rms_norm as lowering

    copy_gbps = common.copy_bandwidth_gbps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy {copy_gbps:.0f} GB/s, {sms} SMs")
    default = lowering._bwd_launch_config
    grids = {4096: dict(block_m=(1, 2, 4), warps=(4, 8, 16), per_sm=(1, 2, 4)),
             128: dict(block_m=(16, 32, 64, 128), warps=(2, 4, 8), per_sm=(8, 16, 32, 64))}
    results = []
    for n, d in [(4096, 4096), (16384, 4096), (131072, 128)]:
        inp = make_inputs(n, d, torch.bfloat16, True, "cuda")
        nbytes = minimal_bytes(n, d, 2, 2, "bwd", True)
        grid = grids[d]
        for block_m, warps, per_sm in itertools.product(grid["block_m"], grid["warps"], grid["per_sm"]):
            blocks = triton_cdiv(n, block_m)
            lowering._bwd_launch_config = (lambda x, n_rows, n_cols, dw, bm=block_m, w=warps, p=per_sm, b=blocks:
                                           (bm, triton_next_pow2(n_cols), w, max(1, min(b, p * sms))))
            try:
                _, kernel, _ = run_case(lambda x, w: lowering.rms_norm(x, w, EPS), inp, "bwd")
            finally:
                lowering._bwd_launch_config = default
            pct = 100 * nbytes / (kernel * 1e-3) / 1e9 / copy_gbps
            results.append((n, d, block_m, warps, per_sm, kernel, pct))
            print(f"{n}x{d} BLOCK_M={block_m:<3} warps={warps:<2} programs/SM={per_sm:<3} "
                  f"bwd kernel {kernel:.4f} ms {pct:5.1f}% of copy", flush=True)
        _, kernel, _ = run_case(lambda x, w: lowering.rms_norm(x, w, EPS), inp, "bwd")
        print(f"{n}x{d} shipped default: {kernel:.4f} ms {100 * nbytes / (kernel * 1e-3) / 1e9 / copy_gbps:5.1f}%")
    print("\nbest per shape:")
    for shape in sorted({(r[0], r[1]) for r in results}):
        best = max((r for r in results if (r[0], r[1]) == shape), key=lambda r: r[6])
        print(f"  {shape[0]}x{shape[1]}: BLOCK_M={best[2]} warps={best[3]} programs/SM={best[4]} -> {best[6]:.1f}%")


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
