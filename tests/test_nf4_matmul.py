"""The fused 4-bit matmul (lowering/nf4_matmul.py, a benchmark candidate, not an op): ``x @ W.T`` with the
weight dequantised in the main loop equals dequantise-then-matmul, under the tolerance rule against fp64,
for NF4 and FP4, block sizes 32 to 128, nested absmax, bf16 and fp16, shapes that leave partial tiles.
That every launch setting compiles for the H200 is checked in test_sm90_compile.py."""
from __future__ import annotations

import pytest
import torch

from sloth.lowering.nf4 import dequantize_4bit, dequantize_absmax
from sloth.lowering.nf4_matmul import nf4_matmul
from pattern_checks import seeded
from tolerance import assert_close

bnb_functional = pytest.importorskip("bitsandbytes.functional")


@pytest.mark.parametrize("quant_type,blocksize,nested,block_k,k", [
    ("nf4", 64, True, 64, 256), ("fp4", 128, False, 64, 256), ("nf4", 128, False, 64, 256),
    ("nf4", 64, False, 128, 256),  # a K tile spanning two absmax blocks of a row
    ("nf4", 64, False, 128, 192),  # ... and a last K tile half past K
    ("fp4", 32, True, 64, 224),
], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_matmul_equals_dequantise_then_matmul(quant_type, blocksize, nested, block_k, k, dtype):
    m, n = 37, 45  # M and N leave partial tiles; K a multiple of the block size (required)
    w = torch.randn(n, k, generator=seeded(1)) / k**0.5
    packed, state = bnb_functional.quantize_4bit(w.to(dtype), blocksize=blocksize, quant_type=quant_type,
                                                 compress_statistics=nested)
    absmax = dequantize_absmax(state.absmax, state.state2.absmax, state.state2.code, state.offset,
                               state.state2.blocksize) if nested else state.absmax
    w_deq = dequantize_4bit(packed, absmax, blocksize, quant_type, (n, k), dtype)  # bit-exact with bitsandbytes
    x = torch.randn(m, k, generator=seeded(2)).to(dtype)
    config = dict(block_m=16, block_n=16, block_k=block_k, num_warps=4, num_stages=2)
    # What lies just past absmax must not be read: NaN there would reach y.
    absmax = torch.cat([absmax, torch.full((64,), float("nan"))])[:absmax.numel()]
    ours = nf4_matmul(x, packed, absmax, blocksize, quant_type, n, k, config=config)
    eager = x @ w_deq.t()
    reference = x.double() @ w_deq.double().t()
    assert ours.dtype == dtype and ours.shape == (m, n)
    assert_close("y", ours, eager, reference)


@pytest.mark.parametrize("x_dtype,blocksize,k,match", [
    (torch.bfloat16, 64, 96, "multiple of the blocksize"), (torch.bfloat16, 48, 96, "blocksize must be one of"),
    (torch.float32, 64, 128, "bfloat16 or float16")], ids=["k-splits-a-block", "blocksize", "fp32-x"])
def test_bad_inputs_are_refused(x_dtype, blocksize, k, match):
    packed = torch.zeros(4 * k // 2, dtype=torch.uint8)
    with pytest.raises((ValueError, TypeError), match=match):
        nf4_matmul(torch.randn(3, k).to(x_dtype), packed, torch.ones(4 * k // blocksize), blocksize, "nf4", 4, k)
