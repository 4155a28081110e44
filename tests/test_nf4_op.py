"""4-bit dequantisation ``sloth.lowering.nf4``: bit for bit against bitsandbytes.

Oracle: random weights quantised by ``bitsandbytes.functional.quantize_4bit`` (nf4 and fp4, blocksize 64
and 128, with and without double quantisation), dequantised by ``bitsandbytes.functional.dequantize_4bit``
(the public API) and by bitsandbytes' default backend (``backends/default/ops.py``, the device-independent
PyTorch implementation). Results are compared with ``torch.equal``: exact values, where -0.0 equals +0.0
(bitsandbytes' own backends disagree on the sign of FP4's code 0b1000; ``test_signed_zero`` pins ours,
CUDA's). The nested absmax is compared bit for bit (int32 views).

One bitsandbytes CPU exception, skipped rather than matched: its AVX-512 ``dequantize_4bit`` kernel (taken
when K % 16 == 0) reads absmax per row, ``absmax[row * (K // blocksize) + col // blocksize]``
(csrc/cpu_ops.cpp), which is not the layout its quantiser wrote when K % blocksize != 0. There only the
default backend (and CUDA's flat kernel) is the oracle.

bitsandbytes wraps its default backend in ``torch.compile``; the oracles run with the compiler stance
"force_eager" so the test does not compile them afresh in each test (conftest resets dynamo).
"""
from __future__ import annotations

import zlib

import pytest
import torch

bnb_functional = pytest.importorskip("bitsandbytes.functional")

import sloth.lowering.nf4 as lowering  # noqa: E402
from sloth.lowering.nf4 import dequantize_4bit, dequantize_4bit_nested, dequantize_absmax  # noqa: E402
from op_checks import force_fallback, record_launches  # noqa: E402

KERNELS = ("_dequantize_4bit_kernel", "_dequantize_absmax_kernel")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SHAPES = [(7, 64), (33, 130), (1, 1), (257, 96), (5, 77)]  # N*K odd for (1, 1) and (5, 77)


def _default_backend(q, absmax, blocksize, quant_type, shape, dtype):
    from bitsandbytes.backends.default import ops as default_ops

    compute = getattr(default_ops._dequantize_4bit_compute, "__wrapped__", default_ops._dequantize_4bit_compute)
    code = bnb_functional.get_4bit_type(quant_type, device=q.device)
    return compute(q.reshape(-1), absmax, code, blocksize, shape, dtype)


def _bnb_cpu_reads_absmax_per_row(device: torch.device, shape, blocksize: int) -> bool:
    """Where bitsandbytes' CPU AVX-512 kernel may use its per-row absmax indexing (module docstring)."""
    k = shape[-1]
    return device.type == "cpu" and k % 16 == 0 and k % blocksize != 0


def _nested_absmax(state) -> torch.Tensor:
    return dequantize_absmax(state.absmax, state.state2.absmax, state.state2.code, state.offset,
                             state.state2.blocksize)


@pytest.fixture(params=["triton", "fallback"])
def path(request, monkeypatch):
    if request.param == "fallback":
        force_fallback(monkeypatch, lowering, *KERNELS)
    return request.param


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_matches_bitsandbytes(quant_type, blocksize, nested, shape, path, device):
    g = torch.Generator().manual_seed(zlib.crc32(repr((quant_type, blocksize, nested, shape)).encode()))
    for dtype in DTYPES:
        w = (torch.randn(shape, generator=g) * 3).to(device=device, dtype=dtype)
        q, state = bnb_functional.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type,
                                                compress_statistics=nested)
        with torch.compiler.set_stance("force_eager"):
            expected = bnb_functional.dequantize_4bit(q, state)
            if nested:
                absmax_bnb = bnb_functional.dequantize_blockwise(state.absmax, state.state2)
                absmax_bnb += state.offset
                absmax = _nested_absmax(state)
                assert torch.equal(absmax.view(torch.int32), absmax_bnb.view(torch.int32)), "nested absmax"
            else:
                absmax = state.absmax
            default = _default_backend(q, absmax, blocksize, quant_type, shape, dtype)

        got = dequantize_4bit(q, absmax, blocksize, quant_type, shape, dtype)

        assert got.dtype == dtype and got.shape == shape
        assert torch.equal(got, default), f"{dtype}: differs from bitsandbytes' default backend"
        if not _bnb_cpu_reads_absmax_per_row(w.device, shape, blocksize):
            assert torch.equal(got, expected), f"{dtype}: differs from bitsandbytes.functional.dequantize_4bit"
        if nested:  # the one-launch form, each block's absmax dequantised inside the weight kernel
            one = dequantize_4bit_nested(q, state.absmax, state.state2.absmax, state.state2.code, state.offset,
                                         blocksize, quant_type, shape, dtype, state.state2.blocksize)
            assert one.dtype == dtype and one.shape == shape
            assert torch.equal(one.view(torch.uint8), got.view(torch.uint8)), f"{dtype}: nested in one launch"


def test_triton_and_fallback_same_bits(device, monkeypatch):
    """Both paths agree to the bit, signed zeros included, on every code of both tables."""
    g = torch.Generator().manual_seed(1)
    shape, blocksize = (9, 129), 64
    n = shape[0] * shape[1]
    packed = torch.randint(0, 256, ((n + 1) // 2, 1), generator=g, dtype=torch.uint8).to(device)
    absmax = (torch.rand(-(-n // blocksize), generator=g) * 4).to(device)
    absmax[3] = 0.0  # an all-zero block
    results = {}
    for path in ("triton", "fallback"):
        if path == "fallback":
            force_fallback(monkeypatch, lowering, *KERNELS)
        for quant_type in ("nf4", "fp4"):
            for dtype in DTYPES:
                results[path, quant_type, dtype] = dequantize_4bit(packed, absmax, blocksize, quant_type, shape, dtype)
    for quant_type in ("nf4", "fp4"):
        for dtype in DTYPES:
            a, b = results["triton", quant_type, dtype], results["fallback", quant_type, dtype]
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{quant_type} {dtype}"


def test_signed_zero(path, device):
    """FP4 code 0b1000 gives -0.0 (CUDA's kernel), NF4's zero code 0b0111 gives +0.0; element 2i is the high
    nibble."""
    absmax = torch.tensor([2.0], device=device)
    fp4 = dequantize_4bit(torch.tensor([0x80, 0x08], dtype=torch.uint8, device=device), absmax, 64, "fp4",
                          (1, 4), torch.float32)
    assert torch.equal(torch.signbit(fp4), torch.tensor([[True, False, False, True]], device=device))
    nf4 = dequantize_4bit(torch.tensor([0x7F], dtype=torch.uint8, device=device), absmax, 64, "nf4",
                          (1, 2), torch.bfloat16)
    assert torch.equal(nf4.float(), torch.tensor([[0.0, 2.0]], device=device)) and not torch.signbit(nf4).any()


def test_nested_absmax_two_roundings(path, device):
    """``code * absmax2`` is rounded to fp32 before ``+ offset``, as bitsandbytes' two ops: equal bits to
    bitsandbytes on 5000 blocks (20 second-level blocks), and different from the fused (FMA) result."""
    g = torch.Generator().manual_seed(2)
    absmax = torch.rand(5000, generator=g).to(device) * 0.3 + 0.01
    q, state2 = bnb_functional.quantize_blockwise(absmax - absmax.mean(), blocksize=256)
    offset = absmax.mean()
    with torch.compiler.set_stance("force_eager"):
        expected = bnb_functional.dequantize_blockwise(q, state2)
    expected += offset
    got = dequantize_absmax(q, state2.absmax, state2.code, offset, 256)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    # A Python float offset is rounded to fp32 first, as torch's ``absmax += float`` does.
    got_float = dequantize_absmax(q, state2.absmax, state2.code, float(offset), 256)
    assert torch.equal(got_float.view(torch.int32), expected.view(torch.int32))
    # The same absmax inside the weight kernel: NF4 code 15 is 1.0, so an fp32 weight of all-0xFF bytes
    # (blocksize 64) reads back each block's absmax.
    packed = torch.full((5000 * 32,), 0xFF, dtype=torch.uint8, device=device)
    weight = dequantize_4bit_nested(packed, q, state2.absmax, state2.code, offset, 64, "nf4", (5000, 64),
                                    torch.float32)
    assert torch.equal(weight[:, 0].contiguous().view(torch.int32), expected.view(torch.int32))
    # What an FMA would give (one rounding): it differs, so the two roundings are observable.
    scale = state2.absmax.double().repeat_interleave(256)[:5000]
    fused = (state2.code.double()[q.long()] * scale + offset.double()).float()
    assert not torch.equal(fused, expected)


@pytest.mark.parametrize("name", KERNELS)
def test_nested_absmax_launch_disables_fp_fusion(name, device, monkeypatch):
    """Both kernels that dequantise a nested absmax are launched with enable_fp_fusion=False (the interpreter
    ignores it; a GPU would otherwise contract the multiply and the add into one FMA)."""
    if not lowering.use_triton(torch.empty(0, device=device)):
        pytest.skip("no Triton here")
    launches = record_launches(monkeypatch, lowering, name)
    q = torch.randint(0, 256, (300,), dtype=torch.uint8, device=device)
    if name == "_dequantize_absmax_kernel":
        dequantize_absmax(q, torch.ones(2, device=device), torch.linspace(-1, 1, 256, device=device), 0.5)
    else:
        dequantize_4bit_nested(torch.zeros(300 * 32, dtype=torch.uint8, device=device), q, torch.ones(2, device=device),
                               torch.linspace(-1, 1, 256, device=device), 0.5, 64, "nf4", (300, 64), torch.bfloat16)
    assert launches and all(k.get("enable_fp_fusion") is False for _, _, k in launches)


def test_strided_inputs_and_offset_forms(device):
    """The kernels read their tensors flat from data_ptr: contiguous inputs of any shape are passed as they are
    (bitsandbytes' [bytes, 1]); strided ones are copied first. A 0-d, a 1-element and a float offset agree."""
    g = torch.Generator().manual_seed(5)
    shape = (33, 130)
    w = torch.randn(shape, generator=g).to(device=device, dtype=torch.bfloat16)
    q, state = bnb_functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    s2 = state.state2
    expected = dequantize_4bit_nested(q, state.absmax, s2.absmax, s2.code, state.offset, 64, "nf4", shape,
                                      torch.bfloat16)

    def strided(t):  # the same values, every other element of a buffer twice as long
        buf = torch.zeros((t.numel(), 2), dtype=t.dtype, device=t.device)
        buf[:, 0] = t.reshape(-1)
        return buf[:, 0]

    got = dequantize_4bit_nested(strided(q), strided(state.absmax), strided(s2.absmax), strided(s2.code),
                                 state.offset, 64, "nf4", shape, torch.bfloat16)
    assert not strided(q).is_contiguous() and torch.equal(got, expected)
    for offset in (state.offset.reshape(()), state.offset.reshape(1), float(state.offset)):
        got = dequantize_4bit_nested(q, state.absmax, s2.absmax, s2.code, offset, 64, "nf4", shape, torch.bfloat16)
        assert torch.equal(got, expected), type(offset)
    absmax = _nested_absmax(state)
    assert torch.equal(dequantize_4bit(strided(q), strided(absmax), 64, "nf4", shape, torch.bfloat16), expected)


def test_out_buffer(path, device):
    g = torch.Generator().manual_seed(3)
    shape = (33, 130)
    w = torch.randn(shape, generator=g).to(device=device, dtype=torch.bfloat16)
    q, state = bnb_functional.quantize_4bit(w, blocksize=64, quant_type="nf4")
    expected = dequantize_4bit(q, state.absmax, 64, "nf4", shape, torch.bfloat16)
    buf = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
    got = dequantize_4bit(q.reshape(-1), state.absmax, 64, "nf4", shape, torch.bfloat16, out=buf)
    assert got is buf and torch.equal(buf, expected)
    with pytest.raises(ValueError, match="out must be"):
        dequantize_4bit(q, state.absmax, 64, "nf4", shape, torch.float16, out=buf)
    with pytest.raises(ValueError, match="out must be"):
        dequantize_4bit(q, state.absmax, 64, "nf4", shape, torch.bfloat16, out=buf[:, :64])


def test_bad_inputs(device):
    shape, n = (7, 64), 7 * 64
    q = torch.zeros((n // 2, 1), dtype=torch.uint8, device=device)
    absmax = torch.ones(n // 64, device=device)
    with pytest.raises(ValueError, match="quant_type"):
        dequantize_4bit(q, absmax, 64, "int4", shape, torch.bfloat16)
    with pytest.raises(ValueError, match="absmax must have ceil"):
        dequantize_4bit(q, absmax[:-1], 64, "nf4", shape, torch.bfloat16)
    with pytest.raises(ValueError, match="absmax must have ceil"):
        dequantize_4bit(q, absmax, 128, "nf4", shape, torch.bfloat16)
    with pytest.raises(TypeError, match="packed must be uint8"):
        dequantize_4bit(q.view(torch.int8), absmax, 64, "nf4", shape, torch.bfloat16)
    with pytest.raises(ValueError, match="packed must hold"):
        dequantize_4bit(q[:-1], absmax, 64, "nf4", shape, torch.bfloat16)
    with pytest.raises(TypeError, match="absmax must be torch.float32"):
        dequantize_4bit(q, absmax.half(), 64, "nf4", shape, torch.bfloat16)
    with pytest.raises(ValueError, match="blocksize"):
        dequantize_4bit(q, absmax, 48, "nf4", shape, torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        dequantize_4bit(q, absmax, 64, "nf4", shape, torch.int32)
    code2 = torch.linspace(-1, 1, 256, device=device)
    q8 = torch.zeros(300, dtype=torch.uint8, device=device)
    with pytest.raises(TypeError, match="absmax_u8 must be uint8"):
        dequantize_absmax(q8.float(), torch.ones(2, device=device), code2, 0.0)
    with pytest.raises(ValueError, match="state2_absmax must have"):
        dequantize_absmax(q8, torch.ones(1, device=device), code2, 0.0)
    with pytest.raises(ValueError, match="state2_code must have 256"):
        dequantize_absmax(q8, torch.ones(2, device=device), code2[:16], 0.0)

