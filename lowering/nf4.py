"""4-bit (NF4 / FP4) weight dequantisation, bit for bit bitsandbytes' ``dequantize_4bit``.

A bitsandbytes 4-bit weight ``W [N, K]`` is stored as ``packed`` (uint8, ``(N*K + 1) // 2`` bytes, two
elements a byte), ``absmax`` (float32, one per block of ``blocksize`` consecutive elements of the
flattened, row-major ``W``; ``nblocks = ceil(N*K / blocksize)``) and a 16-entry code table. In PyTorch::

    idx = torch.stack([packed.flatten() >> 4, packed.flatten() & 0xF], 1).flatten()[:N*K]  # high nibble first
    W = (CODE[idx] * absmax.repeat_interleave(blocksize)[:N*K]).to(dtype).view(N, K)        # fp32 product

With double quantisation (``compress_statistics=True``) ``absmax`` itself is stored as uint8 codes into
bitsandbytes' 256-entry dynamic map, in blocks of ``blocksize2 = 256`` with their own fp32 absmax, plus
one fp32 offset (the mean of the original absmax)::

    absmax = state2_code[absmax_u8] * state2_absmax.repeat_interleave(256)[:nblocks]  # rounded to fp32
    absmax = absmax + offset                                                          # rounded again

Memory traffic (the roofline): ``dequantize_4bit`` reads N*K/2 bytes of codes plus 4*nblocks bytes of
absmax (1/8 or 1/16 of the codes' bytes for blocksize 64 or 128) and writes N*K*e bytes (e = 2 for
bf16/fp16, 4 for fp32): about 2.56 bytes an element for bf16 at blocksize 64, so a 4096 x 14336 weight
moves ~150 MB. ``dequantize_absmax`` reads nblocks bytes plus 4*nblocks/256 (and the 1 KB code) and
writes 4*nblocks.

Where the bit layout comes from (bitsandbytes 0.50.2: its Python source, its csrc/ on GitHub, and the
installed CPU library's outputs):

* Nibble order: element 2i is the HIGH nibble of byte i, element 2i+1 the low one
  (``backends/default/ops.py``: ``packed = (q8[::2] << 4) | q8[1::2]``; CUDA ``kDequantizeBlockwise``:
  ``vals[2j] = lut[q >> 4]``, ``vals[2j+1] = lut[q & 0x0F]``). For odd N*K the last low nibble is padding.
* Code tables: ``functional.get_4bit_type`` (copied below); the CUDA ``nf4_dequantization_lut`` /
  ``fp4_dequantization_lut`` literals in ``csrc/kernels.cu`` round to the same fp32 values.
* The product ``code * absmax`` is formed in fp32 and rounded once to the output dtype (round to nearest
  even): CUDA assigns the fp32 product to a ``T``; ``_dequantize_4bit_compute`` multiplies fp32 tensors and
  calls ``.to(dtype)`` last. There is no add, so no FMA question here.
* Double quantisation: ``functional.dequantize_4bit`` runs ``dequantize_blockwise(absmax, state2)`` (one
  kernel writing ``code * absmax2`` to an fp32 tensor) and then ``absmax += offset`` (a second op), so
  the product is rounded to fp32 before the add. Both kernels here that dequantise a nested absmax form it
  with PTX's explicitly rounded multiply and add, which are never contracted into one FMA (Triton
  contracts a plain ``a * b + c`` by default on GPUs), and are also launched with
  ``enable_fp_fusion=False``; the interpreter never fuses.
* Sign of zero for FP4 code 0b1000 ("-0"): bitsandbytes' backends disagree. The CUDA kernel
  (``fp4_dequantization_lut[v & 7] * sign``) and the CPU scalar kernel give -0.0; ``get_4bit_type`` (whose
  ``-0`` is a Python int, so +0.0) and the CPU AVX-512 kernel give +0.0. The table below follows CUDA,
  the backend this module's kernel replaces. The two compare equal (``torch.equal``), and as a matmul
  operand they contribute nothing either way.
* Known bitsandbytes CPU discrepancy: its AVX-512 ``dequantize_4bit`` kernel (taken when K % 16 == 0)
  indexes absmax per row, ``absmax[row * (K // blocksize) + col // blocksize]``, which equals the flat
  layout only when K % blocksize == 0. Its own quantiser, the CUDA kernel, the CPU scalar kernel and
  the default (PyTorch) backend all use the flat layout, which is what this module computes.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from .backend_choice import triton_interpreter_on, use_triton
from .host_math import cdiv

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' quantize_4bit accepts these

# bitsandbytes.functional.get_4bit_type("nf4"): quantiles of N(0, 1) (QLoRA), in code order.
_NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
# bitsandbytes.functional.get_4bit_type("fp4"): [0, 0.0625, 8, 12, 4, 6, 2, 3] (1 sign bit, 2 exponent
# bits, 1 mantissa bit, in bit-pattern order), then the negatives, divided by 12 in fp32. Written as
# those divisions so the fp32 rounding is bitsandbytes' own (csrc/kernels.cu's fp4_dequantization_lut
# literals 0.005208333333f, 0.66666667f, ... round to the same floats). Code 0b1000 is -0.0 as in CUDA.
_FP4_MAGNITUDES = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0)


@functools.cache
def code_table(quant_type: str, device: torch.device) -> torch.Tensor:
    """The 16 fp32 code values of ``quant_type`` on ``device`` (cached: one tiny tensor per device).

    The LoRA pattern pass asks for it when it places a 4-bit op, so the table is made at compile time: made
    on the first run instead, it would be allocated inside a CUDA graph's private pool when the graph is
    run with CUDA graphs (Inductor's ``triton.cudagraphs``), which then refuses it as an untracked live
    allocation (seen on the H200)."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        if quant_type == "nf4":
            return torch.tensor(_NF4_CODE, dtype=torch.float32, device=device)
        mags = torch.tensor(_FP4_MAGNITUDES, dtype=torch.float32) / 12.0
        return torch.cat([mags, -mags]).to(device)


@triton.jit
def _to_output_dtype(b_x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE, rounded to nearest even, the same bits compiled or interpreted.

    bf16 is rounded with integer ops (bitsandbytes' CPU ``float_to_bf16``; equal to the GPU's
    ``cvt.rn.bf16.f32`` for every non-NaN input, overflow to inf included): the Triton interpreter
    converts fp32 -> bf16 by truncation. NaN never arises here (finite codes times finite absmax).
    fp16 and fp32 go through ``.to``, round to nearest even in both. (lowering/rounding.py's ``round_to``
    uses the GPU's own conversion instead; this kernel keeps the integer path everywhere because that is
    the one checked bit for bit against bitsandbytes' CUDA kernel on the H200.)
    """
    if DTYPE == tl.bfloat16:
        b_bits = b_x.to(tl.uint32, bitcast=True)
        b_bits = b_bits + 0x7FFF + ((b_bits >> 16) & 1)
        return (b_bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return b_x.to(DTYPE)


@triton.jit
def _scaled_plus_offset(b_code, b_scale, offset, INTERPRETED: tl.constexpr):
    """``code * scale`` rounded to fp32, then ``+ offset`` rounded again: bitsandbytes' two ops, never one FMA.
    Compiled, as PTX ``mul.rn.f32`` and ``add.rn.f32`` (an explicit rounding mode: the PTX optimiser never
    contracts them; no flush of subnormals, as nvcc's default; libdevice's ``mul_rn`` would add ``.ftz``), so
    the two roundings do not depend on the launch's ``enable_fp_fusion`` (Inductor drops launch options when
    it launches a user kernel); interpreted, numpy arithmetic, which never fuses."""
    if INTERPRETED:
        return b_code * b_scale + offset
    b_scaled = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [b_code, b_scale], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [b_scaled, offset], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _dequantize_4bit_tile(
    i_b, p_packed, p_absmax, p_code, p_out,
    p_absmax2, p_code2, p_offset,
    n_elements, n_bytes,
    BLOCKSIZE: tl.constexpr, BLOCK_BYTES: tl.constexpr, NESTED: tl.constexpr, BLOCKSIZE2: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Packed bytes [i_b * BLOCK_BYTES, (i_b + 1) * BLOCK_BYTES) -> 2*BLOCK_BYTES consecutive output elements.
    NESTED: ``p_absmax`` holds uint8 codes and each block's absmax is dequantised here
    (``_dequantize_absmax_kernel``'s math, two roundings, ``_scaled_plus_offset``) instead of by a kernel
    launch of its own."""
    i_b = i_b.to(tl.int64)
    o_byte = i_b * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    m_byte = o_byte < n_bytes
    b_packed = tl.load(p_packed + o_byte, mask=m_byte, other=0).to(tl.int32)
    # Both elements of a byte (2i, 2i+1) lie in one absmax block: blocksize is even.
    o_block = o_byte // (BLOCKSIZE // 2)
    if NESTED:
        b_q = tl.load(p_absmax + o_block, mask=m_byte, other=0).to(tl.int32)
        b_absmax2 = tl.load(p_absmax2 + o_block // BLOCKSIZE2, mask=m_byte, other=0.0)
        b_absmax = _scaled_plus_offset(tl.load(p_code2 + b_q), b_absmax2, tl.load(p_offset), INTERPRETED)
    else:
        b_absmax = tl.load(p_absmax + o_block, mask=m_byte, other=0.0)
    b_hi = tl.load(p_code + (b_packed >> 4)) * b_absmax  # element 2i
    b_lo = tl.load(p_code + (b_packed & 0xF)) * b_absmax  # element 2i + 1
    o_out = i_b * (2 * BLOCK_BYTES) + tl.arange(0, 2 * BLOCK_BYTES)
    b_out = _to_output_dtype(tl.interleave(b_hi, b_lo), p_out.dtype.element_ty)
    tl.store(p_out + o_out, b_out, mask=o_out < n_elements)


@triton.jit
def _dequantize_4bit_kernel(
    p_packed, p_absmax, p_code, p_out,
    p_absmax2, p_code2, p_offset,
    n_elements, n_bytes,
    BLOCKSIZE: tl.constexpr, BLOCK_BYTES: tl.constexpr, NESTED: tl.constexpr, BLOCKSIZE2: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One program: BLOCK_BYTES packed bytes -> 2*BLOCK_BYTES output elements (``_dequantize_4bit_tile``)."""
    _dequantize_4bit_tile(tl.program_id(0), p_packed, p_absmax, p_code, p_out, p_absmax2, p_code2, p_offset,
                          n_elements, n_bytes, BLOCKSIZE, BLOCK_BYTES, NESTED, BLOCKSIZE2, INTERPRETED)


@triton.jit
def _dequantize_4bit_members_kernel(
    p_code, p_out,
    p_packed0, p_absmax0, p_absmax20, p_code20, p_offset0, start0, n_elements0, n_bytes0, blocks0,
    p_packed1, p_absmax1, p_absmax21, p_code21, p_offset1, start1, n_elements1, n_bytes1, blocks1,
    p_packed2, p_absmax2, p_absmax22, p_code22, p_offset2, start2, n_elements2, n_bytes2,
    BLOCKSIZE: tl.constexpr, BLOCK_BYTES: tl.constexpr, NESTED: tl.constexpr, BLOCKSIZE2: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Up to three weights of one quantisation (block size, quant type, nesting) in one launch, weight i
    written from element start_i of ``p_out``: programs [0, blocks0) dequantise weight 0, the next blocks1
    weight 1, the rest weight 2 (``_dequantize_4bit_tile`` on each weight's own tensors)."""
    i_b = tl.program_id(0)
    if i_b < blocks0:
        _dequantize_4bit_tile(i_b, p_packed0, p_absmax0, p_code, p_out + start0, p_absmax20, p_code20, p_offset0,
                              n_elements0, n_bytes0, BLOCKSIZE, BLOCK_BYTES, NESTED, BLOCKSIZE2, INTERPRETED)
    elif i_b < blocks0 + blocks1:
        _dequantize_4bit_tile(i_b - blocks0, p_packed1, p_absmax1, p_code, p_out + start1, p_absmax21, p_code21,
                              p_offset1, n_elements1, n_bytes1, BLOCKSIZE, BLOCK_BYTES, NESTED, BLOCKSIZE2,
                              INTERPRETED)
    else:
        _dequantize_4bit_tile(i_b - blocks0 - blocks1, p_packed2, p_absmax2, p_code, p_out + start2, p_absmax22,
                              p_code22, p_offset2, n_elements2, n_bytes2, BLOCKSIZE, BLOCK_BYTES, NESTED,
                              BLOCKSIZE2, INTERPRETED)


@triton.jit
def _dequantize_absmax_kernel(
    p_q, p_absmax2, p_code2, p_offset, p_out,
    n_elements,
    BLOCKSIZE2: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_n = i_b * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < n_elements
    b_q = tl.load(p_q + o_n, mask=m_n, other=0).to(tl.int32)
    b_absmax2 = tl.load(p_absmax2 + o_n // BLOCKSIZE2, mask=m_n, other=0.0)
    b_out = _scaled_plus_offset(tl.load(p_code2 + b_q), b_absmax2, tl.load(p_offset), INTERPRETED)
    tl.store(p_out + o_n, b_out, mask=m_n)


_BLOCK_BYTES = 1024  # 2048 output elements a program; not yet swept on the H200
_ABSMAX_BLOCK = 1024


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def _check_4bit_inputs(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str,
                       shape: Sequence[int], dtype: torch.dtype, out: Optional[torch.Tensor],
                       absmax_dtype: torch.dtype = torch.float32) -> int:
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"sloth.nf4: quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"sloth.nf4: packed must be uint8 (two 4-bit codes a byte), got {packed.dtype}")
    if absmax.dtype != absmax_dtype:
        raise TypeError(f"sloth.nf4: absmax must be {absmax_dtype} (float32, or the uint8 codes of a nested "
                        f"state for dequantize_4bit_nested), got {absmax.dtype}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"sloth.nf4: dtype must be float32, bfloat16 or float16, got {dtype}")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"sloth.nf4: blocksize must be one of {BLOCKSIZES}, got {blocksize}")
    if len(shape) == 0 or any(int(s) < 0 for s in shape):
        raise ValueError(f"sloth.nf4: shape must be non-negative sizes, e.g. (N, K), got {tuple(shape)}")
    n = _numel(shape)
    if packed.numel() != (n + 1) // 2:
        raise ValueError(f"sloth.nf4: packed must hold (numel + 1) // 2 = {(n + 1) // 2} bytes for shape "
                         f"{tuple(shape)}, got {packed.numel()}")
    nblocks = cdiv(n, blocksize)
    if absmax.numel() != nblocks:
        raise ValueError(f"sloth.nf4: absmax must have ceil({n} / {blocksize}) = {nblocks} entries (one per "
                         f"block), got {absmax.numel()}")
    if absmax.device != packed.device:
        raise ValueError(f"sloth.nf4: absmax is on {absmax.device} but packed is on {packed.device}")
    if out is not None:
        if tuple(out.shape) != tuple(int(s) for s in shape) or out.dtype != dtype:
            raise ValueError(f"sloth.nf4: out must be {dtype} of shape {tuple(shape)}, got {out.dtype} "
                             f"{tuple(out.shape)}")
        if out.device != packed.device:
            raise ValueError(f"sloth.nf4: out is on {out.device} but packed is on {packed.device}")
        if not out.is_contiguous():
            raise ValueError("sloth.nf4: out must be contiguous")
    return n


def dequantize_4bit_reference(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str,
                              shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The module docstring's math in plain PyTorch (same bits as the kernel): the fallback path."""
    n = _numel(shape)
    flat = packed.reshape(-1)
    idx = torch.stack([flat >> 4, flat & 0xF], 1).reshape(-1)[:n].long()
    vals = code_table(quant_type, packed.device)[idx]
    nblocks = absmax.numel()
    vals = torch.nn.functional.pad(vals, (0, nblocks * blocksize - n)).view(nblocks, blocksize)
    return (vals * absmax.view(-1, 1)).reshape(-1)[:n].to(dtype).view(*shape)


def dequantize_4bit(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str,
                    shape: Sequence[int], dtype: torch.dtype, out: Optional[torch.Tensor] = None
                    ) -> torch.Tensor:
    """``torch.ops.bitsandbytes.dequantize_4bit.default(packed, absmax, blocksize, quant_type, shape, dtype)``.

    ``packed``: uint8, ``(N*K + 1) // 2`` bytes (shape ``(bytes, 1)`` as bitsandbytes stores it, or flat);
    ``absmax``: float32, one per block (already dequantised when the state is nested: see
    ``dequantize_absmax``). ``out``: an optional contiguous ``dtype`` tensor of ``shape`` to write into
    (a reused buffer); it is returned.
    """
    n = _check_4bit_inputs(packed, absmax, blocksize, quant_type, shape, dtype, out)
    if not use_triton(packed):
        w = dequantize_4bit_reference(packed, absmax, blocksize, quant_type, shape, dtype)
        return w if out is None else out.copy_(w)
    if out is None:
        out = torch.empty(tuple(int(s) for s in shape), dtype=dtype, device=packed.device)
    _launch_4bit(packed, absmax, None, blocksize, quant_type, n, out)
    return out


def _launch_4bit(packed: torch.Tensor, absmax: torch.Tensor, nested: Optional[tuple], blocksize: int,
                 quant_type: str, n: int, out: torch.Tensor) -> None:
    """One launch of ``_dequantize_4bit_kernel`` into ``out``; ``nested`` = (state2_absmax, state2_code,
    offset tensor, blocksize2) when ``absmax`` holds the uint8 codes of a double-quantised state."""
    if not n:
        return
    absmax2, code2, offset, blocksize2 = nested if nested is not None else (absmax, absmax, absmax, 256)
    n_bytes = (n + 1) // 2
    _dequantize_4bit_kernel[(cdiv(n_bytes, _BLOCK_BYTES),)](
        _flat(packed), _flat(absmax), code_table(quant_type, packed.device), out, _flat(absmax2), _flat(code2),
        offset,
        n, n_bytes,
        BLOCKSIZE=blocksize, BLOCK_BYTES=_BLOCK_BYTES, NESTED=nested is not None, BLOCKSIZE2=blocksize2,
        INTERPRETED=triton_interpreter_on(), num_warps=4, enable_fp_fusion=False,
    )


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels read it, element i at data_ptr + i: itself when contiguous (whatever its shape:
    bitsandbytes stores packed weights as [bytes, 1]), else a contiguous copy. ``reshape(-1)``, used before,
    cost an aten call even when it changed nothing and returned a strided 1-D tensor as it was, which the
    kernels then read wrongly (tests/test_nf4_op.py::test_strided_inputs_and_offset_forms)."""
    return t if t.is_contiguous() else t.contiguous()


def _offset_tensor(offset: Union[torch.Tensor, float], device: torch.device) -> torch.Tensor:
    """``offset`` as a 1-element fp32 tensor on ``device`` (read by the kernel: no host sync); bitsandbytes'
    own offset (a 0-d fp32 tensor on the weight's device) is used as it is."""
    if isinstance(offset, torch.Tensor):
        if offset.numel() != 1:
            raise ValueError(f"sloth.nf4: offset must be a scalar, got shape {tuple(offset.shape)}")
        if offset.dtype == torch.float32 and offset.device == device:
            return offset
        return offset.reshape(1).to(device=device, dtype=torch.float32)
    return torch.tensor([offset], dtype=torch.float32, device=device)


def dequantize_absmax_reference(absmax_u8: torch.Tensor, state2_absmax: torch.Tensor, state2_code: torch.Tensor,
                                offset: torch.Tensor, blocksize2: int) -> torch.Tensor:
    """Plain PyTorch: the product rounded to fp32, then the add (two ops, as bitsandbytes)."""
    n = absmax_u8.numel()
    scale = state2_absmax.repeat_interleave(blocksize2)[:n]
    return state2_code[absmax_u8.reshape(-1).long()] * scale + offset


def _check_absmax_inputs(absmax_u8: torch.Tensor, state2_absmax: torch.Tensor, state2_code: torch.Tensor,
                         blocksize2: int) -> None:
    if absmax_u8.dtype != torch.uint8:
        raise TypeError(f"sloth.nf4: absmax_u8 must be uint8 (nested absmax codes), got {absmax_u8.dtype}")
    if state2_absmax.dtype != torch.float32 or state2_code.dtype != torch.float32:
        raise TypeError(f"sloth.nf4: state2_absmax and state2_code must be float32, got {state2_absmax.dtype} "
                        f"and {state2_code.dtype}")
    if state2_code.numel() != 256:
        raise ValueError(f"sloth.nf4: state2_code must have 256 entries, got {state2_code.numel()}")
    if blocksize2 <= 0:
        raise ValueError(f"sloth.nf4: blocksize2 must be positive, got {blocksize2}")
    nblocks2 = cdiv(absmax_u8.numel(), blocksize2)
    if state2_absmax.numel() != nblocks2:
        raise ValueError(f"sloth.nf4: state2_absmax must have ceil({absmax_u8.numel()} / {blocksize2}) = "
                         f"{nblocks2} entries, got {state2_absmax.numel()}")
    for name, t in (("state2_absmax", state2_absmax), ("state2_code", state2_code)):
        if t.device != absmax_u8.device:
            raise ValueError(f"sloth.nf4: {name} is on {t.device} but absmax_u8 is on {absmax_u8.device}")


def dequantize_absmax(absmax_u8: torch.Tensor, state2_absmax: torch.Tensor, state2_code: torch.Tensor,
                      offset: Union[torch.Tensor, float], blocksize2: int = 256) -> torch.Tensor:
    """The fp32 absmax of a nested (double-quantised) bitsandbytes QuantState ``qs``::

        dequantize_absmax(qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset, qs.state2.blocksize)

    equals bit for bit ``dequantize_blockwise(qs.absmax, qs.state2) + qs.offset``, what
    ``bitsandbytes.functional.dequantize_4bit`` computes before dequantising the weight.
    """
    _check_absmax_inputs(absmax_u8, state2_absmax, state2_code, blocksize2)
    n = absmax_u8.numel()
    offset_t = _offset_tensor(offset, absmax_u8.device)
    if not use_triton(absmax_u8):
        return dequantize_absmax_reference(absmax_u8, state2_absmax.reshape(-1), state2_code.reshape(-1),
                                           offset_t, blocksize2)
    out = torch.empty(n, dtype=torch.float32, device=absmax_u8.device)
    if n:
        _dequantize_absmax_kernel[(cdiv(n, _ABSMAX_BLOCK),)](
            _flat(absmax_u8), _flat(state2_absmax), _flat(state2_code), offset_t, out,
            n,
            BLOCKSIZE2=blocksize2, BLOCK=_ABSMAX_BLOCK, INTERPRETED=triton_interpreter_on(), num_warps=4,
            enable_fp_fusion=False,
        )
    return out


def dequantize_4bit_nested(packed: torch.Tensor, absmax_u8: torch.Tensor, state2_absmax: torch.Tensor,
                           state2_code: torch.Tensor, offset: Union[torch.Tensor, float], blocksize: int,
                           quant_type: str, shape: Sequence[int], dtype: torch.dtype, blocksize2: int = 256
                           ) -> torch.Tensor:
    """``dequantize_4bit(packed, dequantize_absmax(absmax_u8, state2_absmax, state2_code, offset, blocksize2),
    ...)`` bit for bit, in one kernel launch (the absmax of each block dequantised where it is used)."""
    if not use_triton(packed):
        absmax = dequantize_absmax(absmax_u8, state2_absmax, state2_code, offset, blocksize2)
        return dequantize_4bit(packed, absmax, blocksize, quant_type, shape, dtype)
    _check_absmax_inputs(absmax_u8, state2_absmax, state2_code, blocksize2)
    n = _check_4bit_inputs(packed, absmax_u8, blocksize, quant_type, shape, dtype, None, absmax_dtype=torch.uint8)
    out = torch.empty(tuple(int(s) for s in shape), dtype=dtype, device=packed.device)
    _launch_4bit(packed, absmax_u8, (state2_absmax, state2_code, _offset_tensor(offset, absmax_u8.device),
                                     blocksize2), blocksize, quant_type, n, out)
    return out


WEIGHTS_PER_LAUNCH = 3


def dequantize_4bit_members(packed: Sequence[torch.Tensor], absmax: Sequence[torch.Tensor],
                            nested: Optional[Sequence[tuple]], blocksize: int, quant_type: str,
                            shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
    """Several 4-bit weights [N_i, K] of one block size and quant type, dequantised into one [sum N_i, K]
    tensor (weight i in rows sum_{j<i} N_j onwards), bit for bit ``dequantize_4bit`` of each (or
    ``dequantize_4bit_nested`` when ``nested`` gives each weight's (state2_absmax, state2_code, offset,
    blocksize2); ``absmax`` then holds the uint8 codes), one launch per three weights."""
    n_members = len(packed)
    if n_members == 0 or len(absmax) != n_members or len(shapes) != n_members or \
            (nested is not None and len(nested) != n_members):
        raise ValueError(f"sloth.nf4: one packed, absmax and shape (and nested state) per weight, got "
                         f"{n_members}, {len(absmax)}, {len(shapes)}" + (f", {len(nested)}" if nested else ""))
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if any(len(s) != 2 or s[1] != shapes[0][1] for s in shapes):
        raise ValueError(f"sloth.nf4: the weights must be 2-D with one column count, got {shapes}")
    blocksizes2 = sorted({m[3] for m in nested}) if nested is not None else [256]
    if len(blocksizes2) != 1:
        raise ValueError(f"sloth.nf4: the nested states must share their block size, got {blocksizes2}")
    if nested is not None:
        for q, a, (absmax2, code2, _, blocksize2) in zip(packed, absmax, nested):
            _check_absmax_inputs(a, absmax2, code2, blocksize2)
    sizes = [_check_4bit_inputs(q, a, blocksize, quant_type, s, dtype, None,
                                absmax_dtype=torch.uint8 if nested is not None else torch.float32)
             for q, a, s in zip(packed, absmax, shapes)]
    device = packed[0].device
    if not use_triton(packed[0]):
        parts = [dequantize_4bit_nested(q, a, m[0], m[1], m[2], blocksize, quant_type, s, dtype, m[3])
                 if nested is not None else dequantize_4bit(q, a, blocksize, quant_type, s, dtype)
                 for q, a, s, m in zip(packed, absmax, shapes, nested or [None] * n_members)]
        return torch.cat(parts, 0)
    out = torch.empty((sum(s[0] for s in shapes), shapes[0][1]), dtype=dtype, device=device)
    members, start = [], 0
    for i in range(n_members):
        absmax2, code2, offset, _ = nested[i] if nested is not None else (absmax[i], absmax[i], absmax[i], 256)
        if nested is not None:
            absmax2, code2, offset = _flat(absmax2), _flat(code2), _offset_tensor(offset, device)
        n_bytes = (sizes[i] + 1) // 2
        members.append((_flat(packed[i]), _flat(absmax[i]), absmax2, code2, offset, start, sizes[i], n_bytes,
                        cdiv(n_bytes, _BLOCK_BYTES)))
        start += sizes[i]
    for i0 in range(0, n_members, WEIGHTS_PER_LAUNCH):
        group = [m for m in members[i0:i0 + WEIGHTS_PER_LAUNCH] if m[6]]  # an empty weight gets no programs
        if not group:
            continue
        args = []
        for j, m in enumerate(group + [group[0]] * (WEIGHTS_PER_LAUNCH - len(group))):
            args += list(m[:8])
            if j < WEIGHTS_PER_LAUNCH - 1:
                args.append(m[8] if j < len(group) else 0)
        _dequantize_4bit_members_kernel[(sum(m[8] for m in group),)](
            code_table(quant_type, device), out, *args,
            BLOCKSIZE=blocksize, BLOCK_BYTES=_BLOCK_BYTES, NESTED=nested is not None, BLOCKSIZE2=blocksizes2[0],
            INTERPRETED=triton_interpreter_on(), num_warps=4,
            enable_fp_fusion=False,
        )
    return out
