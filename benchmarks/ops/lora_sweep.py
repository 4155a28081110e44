"""Sweep of the LoRA adapter kernels' launch settings at Llama-3-8B shapes (H200).

    python -m benchmarks.ops.lora_sweep

Times each of lowering/lora.py's three kernels on the bytes they must move (the adapter part of a LoRA
linear is bandwidth-bound: r = 16 columns against 4096-14336 wide activations), for every setting in
the grids below, at 4096 tokens, bf16 activations, fp32 adapter, r = 16:

    down     h = x @ a.T            reads x [M, K]                 (forward; backward's dy @ b alike)
    up_add   y = base + s h @ b.T   reads base, writes y [M, N]    (forward; backward's dx alike)
    grad     da = s g.T @ x         reads x [M, K]                 (backward; db alike)

and prints the best setting per kernel (largest summed % of copy over the shapes); DOWN_CONFIG,
UP_CONFIG and GRAD_CONFIG in lowering/lora.py cite its result.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from benchmarks import common

SHAPES = ((4096, 4096, 4096), (4096, 4096, 14336), (4096, 14336, 4096))  # (M, K, N): q/o, gate/up, down
GRIDS: dict[str, dict[str, tuple]] = {
    "down": dict(block_m=(32, 64, 128), block_k=(64, 128, 256), num_warps=(4, 8), num_stages=(3,)),
    "up_add": dict(block_m=(32, 64, 128), block_n=(64, 128, 256), num_warps=(4, 8), num_stages=(2,)),
    "grad": dict(block_m=(32, 64), block_k=(64, 128), num_warps=(4, 8), num_stages=(3,), programs=(264, 528, 1056)),
}


def main() -> None:
    common.import_sloth()
    import sloth.lowering.lora as lowering

    copy_gbps = common.copy_bandwidth_gbps()
    configs = {"down": "DOWN_CONFIG", "up_add": "UP_CONFIG", "grad": "GRAD_CONFIG"}
    shipped = ", ".join(f"{k} {getattr(lowering, v)}" for k, v in configs.items())
    print(f"copy {copy_gbps:.0f} GB/s; shipped: {shipped}")
    gen = torch.Generator(device="cpu").manual_seed(0)
    cases: dict[str, list[tuple[Callable[[], Any], int]]] = {"down": [], "up_add": [], "grad": []}
    for m, k, n in SHAPES:
        x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
        a = (torch.randn(16, k, generator=gen) / k**0.5).cuda()
        b = (torch.randn(n, 16, generator=gen) / 4).cuda()
        base = torch.randn(m, n, generator=gen).to("cuda", torch.bfloat16)
        h = torch.randn(m, 16, generator=gen).cuda()
        cases["down"].append((lambda x=x, a=a: lowering._down(x, a.t()), m * k * 2))
        cases["up_add"].append((lambda base=base, h=h, b=b: lowering._up_add_(base, h, b.t(), 0.5), 2 * m * n * 2))
        cases["grad"].append((lambda h=h, x=x: lowering._grad(h, x, 0.5), m * k * 2))
    best: dict[str, tuple[float, dict]] = {}
    for kernel, grid in GRIDS.items():
        name = configs[kernel]
        shipped = dict(getattr(lowering, name))
        for values in itertools.product(*grid.values()):
            setting = dict(zip(grid.keys(), values))
            setattr(lowering, name, {**shipped, **setting})
            try:
                pcts = []
                for fn, nbytes in cases[kernel]:
                    ms = common.kernel_ms(fn)
                    pcts.append(100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbps)
            except Exception as exc:  # a setting Triton cannot compile (shared memory, registers)
                print(f"{kernel:<7} {setting}: {type(exc).__name__}", flush=True)
                continue
            finally:
                setattr(lowering, name, shipped)
            print(f"{kernel:<7} {setting}: " + "  ".join(f"{p:5.1f}%" for p in pcts), flush=True)
            if sum(pcts) > best.get(kernel, (0.0, {}))[0]:
                best[kernel] = (sum(pcts), setting)
    print("\nbest (summed % of copy over q/o, gate/up, down):")
    for kernel, (score, setting) in best.items():
        print(f"  {kernel}: {setting} -> mean {score / len(SHAPES):.1f}% of copy")


if __name__ == "__main__":
    main()
