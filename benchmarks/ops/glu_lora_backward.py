"""The LoRA MLP's down-projection backward (sloth::glu_lora_linear_backward) with the GLU output written by
the GLU's backward over d_hidden (lowering/glu_lora.py, the default) against the recomputing form
(``FUSED_HIDDEN = False``: a GLU forward pass of its own before the LoRA backward).

    python -m benchmarks.ops.glu_lora_backward        (CUDA; on the CPU a smoke run at small shapes)

At Llama-3-8B's MLP shape (4096 tokens, intermediate 14336, hidden 4096, r 16, bf16, SwiGLU, separate and
merged gate/up, and merged at 14344 for the misaligned layout): first the bits (every gradient of the two
forms must be equal; on the GPU each form is its own compiled kernel, so this is what the CPU tests cannot
see), then each form's time (median ms, L2 flushed, common.bench_ms). The recompute reads gate and up
(2 x 112 MiB) and writes hidden (112 MiB) in a pass of its own; the fused form writes hidden (112 MiB) from
the GLU backward's pass instead.
"""
from __future__ import annotations

import sys

import torch

from benchmarks import common


def main() -> int:
    common.import_sloth()
    from sloth.lowering import glu_lora

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rows, out, rank = (4096, 4096, 16) if cuda else (64, 48, 4)
    # (merged, intermediate): separate and merged at the 8B shape, and merged at 14344, where dy's stride
    # (14344, 8 mod 16) and gate's (28688) differ in alignment and the kernel's y stores take another layout
    # than its dy loads (the case its barrier is for)
    cases = [(False, 14336), (True, 14336), (True, 14344)] if cuda else [(False, 96), (True, 96), (True, 40)]
    gen = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*shape, scale=1.0, dtype=bf16):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    failures = 0
    for merged, inter in cases:
        gate = randn(rows, 2 * inter if merged else inter)
        up = None if merged else randn(rows, inter)
        w = randn(out, inter, scale=inter ** -0.5)
        a = randn(rank, inter, scale=inter ** -0.5, dtype=torch.float32)
        b = randn(out, rank, scale=rank ** -0.5, dtype=torch.float32)
        h = randn(rows, rank, dtype=torch.float32)
        dy = randn(rows, out)

        def backward():
            return glu_lora._glu_lora_bwd(dy, gate, up, "silu", w, a, b, h, 2.0)

        results, times = {}, {}
        for fused in (True, False):
            glu_lora.FUSED_HIDDEN = fused
            results[fused] = backward()
            times[fused] = common.bench_ms(backward)
        glu_lora.FUSED_HIDDEN = True
        equal = all(torch.equal(x, y) for x, y in zip(results[True], results[False]))
        failures += not equal
        form = "merged gate_up" if merged else "separate gate, up"
        print(f"glu_lora backward, {form}, {rows} x {inter} -> {out}, r {rank}: gradients bit-equal {equal}; "
              f"ms fused hidden {times[True]:.4f}, recomputed {times[False]:.4f} "
              f"({times[False] - times[True]:+.4f} saved)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
