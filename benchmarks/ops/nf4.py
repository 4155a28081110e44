"""NF4/FP4 dequantisation: bit-exactness against bitsandbytes on the GPU, and its time.

    python -m benchmarks.ops.nf4          (CUDA with bitsandbytes installed)

For NF4 and FP4, block sizes 64 and 128, with and without double quantisation, bf16/fp16/fp32 and three
shapes (Llama-3-8B's 4096 x 4096 and 1024 x 14336, and an odd 33 x 130): quantise random weights with
bitsandbytes, dequantise with bitsandbytes and with lowering/nf4.py, compare the bits. Then the kernel
time of both dequantising a 14336 x 4096 double-quantised NF4 weight (reads 29 MB, writes 117 MB in bf16).
"""
from __future__ import annotations

import sys

import torch

from benchmarks import common


def main() -> int:
    common.import_sloth()
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    from sloth.lowering import nf4

    mismatches = 0
    for quant_type in ("nf4", "fp4"):
        for blocksize in (64, 128):
            for nested in (True, False):
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    for shape in ((4096, 4096), (33, 130), (1024, 14336)):
                        w = torch.randn(shape, device="cuda", dtype=dtype) / 60
                        packed, state = quantize_4bit(w, blocksize=blocksize, quant_type=quant_type,
                                                      compress_statistics=nested)
                        ref = dequantize_4bit(packed, state)
                        absmax = nf4.dequantize_absmax(state.absmax, state.state2.absmax, state.state2.code,
                                                       state.offset) if nested else state.absmax
                        ours = nf4.dequantize_4bit(packed, absmax, blocksize, quant_type, tuple(state.shape),
                                                   ref.dtype)
                        bits = {2: torch.int16, 4: torch.int32}[ref.element_size()]
                        if not torch.equal(ours.view(bits), ref.view(bits)):
                            mismatches += 1
                            print(f"MISMATCH {quant_type} blocksize {blocksize} nested {nested} {dtype} {shape}")
    print(f"nf4/fp4 dequantisation bit-exact vs bitsandbytes on CUDA: {mismatches == 0} (72 cases)")
    w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) / 60
    packed, state = quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    absmax = nf4.dequantize_absmax(state.absmax, state.state2.absmax, state.state2.code, state.offset)
    ours = common.kernel_ms(lambda: nf4.dequantize_4bit(packed, absmax, 64, "nf4", (14336, 4096), torch.bfloat16))
    theirs = common.kernel_ms(lambda: dequantize_4bit(packed, state))
    print(f"dequantise 14336 x 4096 NF4 (double-quantised), kernel ms: sloth {ours:.4f} "
          f"(absmax kernel not included), bitsandbytes {theirs:.4f}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
