"""Sweep of ``BWD_PROGRAMS_PER_SM``: RMSNorm backward kernel time with a weight gradient, per setting.

    python -m benchmarks.ops.rms_norm_sweep        (H200; prints kernel ms and % of copy bandwidth)

The constant in lowering/rms_norm.py cites this sweep's result.
"""
from __future__ import annotations

import torch

from benchmarks import common
from benchmarks.ops.rms_norm import EPS, make_inputs, minimal_bytes, run_case


def main() -> None:
    common.import_sloth()
    import sloth.lowering.rms_norm as lowering

    copy_gbps = common.copy_bandwidth_gbps()
    print(f"copy {copy_gbps:.0f} GB/s")
    for n, d in [(4096, 4096), (16384, 4096), (131072, 128)]:
        inp = make_inputs(n, d, torch.bfloat16, True, "cuda")
        nbytes = minimal_bytes(n, d, 2, 2, "bwd", True)
        for per_sm in (1, 2, 4, 8, 16, 32):
            lowering.BWD_PROGRAMS_PER_SM = lowering.BWD_PROGRAMS_PER_SM_NARROW = per_sm
            _, kernel, _ = run_case(lambda x, w: lowering.rms_norm(x, w, EPS), inp, "bwd")
            pct = 100 * nbytes / (kernel * 1e-3) / 1e9 / copy_gbps
            print(f"{n}x{d} programs/SM={per_sm:<3} bwd kernel {kernel:.4f} ms  {pct:5.1f}% of copy", flush=True)


if __name__ == "__main__":
    main()
