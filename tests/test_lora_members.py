"""Launch-level fusion of several LoRA members (lowering/lora_members.py) and several 4-bit weights
(``nf4.dequantize_4bit_members``): each member's result bit for bit what its own launch gives, in fewer
launches; four members take two launches per kernel."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import sloth.lowering.lora as lora
import sloth.lowering.lora_members as members
import sloth.lowering.nf4 as nf4
from op_checks import record_launches
from pattern_checks import seeded



@pytest.fixture(autouse=True)
def _triton_only(device):
    if not lora.use_triton(torch.empty(0, device=device)):
        pytest.skip("no Triton here")

MEMBER_KERNELS = ("_split_members_kernel", "_down_members_kernel", "_up_add_members_kernel")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


# (x dtype, factor dtype): lora._mode's three product modes.
MODES = [(torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("ks", [(300, 260, 257), (270, 300, 256, 290), (300, 0, 260, 257, 270, 256, 290)],
                         ids=["3", "4", "7-one-empty"])
@pytest.mark.parametrize("x_dtype,p_dtype", MODES, ids=["split", "tf32x3", "native"])
def test_down_members_bits_and_launches(ks, x_dtype, p_dtype, monkeypatch, device):
    """g_i = x_i @ p_i for every member as ``lora._down`` computes it alone (every K_i >= 256 or empty, so each
    member gets the tile size its own launch would; a p_i transposed view, as the forward's a.T is)."""
    g, rows, rank = seeded(0), 37, 5
    xs = [torch.randn(rows, k, generator=g).to(device, x_dtype) for k in ks]
    ps = [torch.randn(k, rank, generator=g).to(device, p_dtype) for k in ks]
    ps[1] = torch.randn(rank, ks[1], generator=g).to(device, p_dtype).t()
    want = [lora._down(x, p) for x, p in zip(xs, ps)]
    launches = record_launches(monkeypatch, members, *MEMBER_KERNELS)
    h = members.down_members(xs, ps, torch.empty(rows, len(ks) * rank, device=device))
    for i, w in enumerate(want):
        assert torch.equal(_bits(h[:, i * rank:(i + 1) * rank].contiguous()), _bits(w)), i
    per_kernel = -(-len(ks) // members.MEMBERS_PER_LAUNCH)
    split = per_kernel if x_dtype == torch.bfloat16 and p_dtype == torch.float32 else 0
    assert Counter(n for n, _, _ in launches) == {"_down_members_kernel": per_kernel,
                                                  **({"_split_members_kernel": split} if split else {})}


@pytest.mark.parametrize("ns", [(45, 13, 130), (7, 70, 9, 64), (7, 0, 70, 9, 64, 130, 1)],
                         ids=["3", "4", "7-one-empty"])
@pytest.mark.parametrize("y_dtype,q_dtype", MODES, ids=["bf16-fp32", "fp32-fp32", "bf16-bf16"])
@pytest.mark.parametrize("tiles", ["shipped", "small"])
def test_up_add_members_bits_and_launches(ns, y_dtype, q_dtype, tiles, monkeypatch, device):
    """y_i += s h_i @ q_i in place for every member as ``lora._up_add_`` does it alone. With small tiles the
    members' column groups differ in width and span several tiles each (each member's own group width)."""
    if tiles == "small":
        monkeypatch.setitem(lora.UP_CONFIG, "block_m", 16)
        monkeypatch.setitem(lora.UP_CONFIG, "block_n", 16)
        monkeypatch.setitem(lora.UP_CONFIG, "programs", 6)
        assert len({lora.up_add_groups(67, n)[1] for n in ns if n}) > 1
        assert any(lora.up_add_groups(67, n)[1] > 16 for n in ns)
    g, rows, rank = seeded(1), 67, 6
    bases = [torch.randn(rows, n, generator=g).to(device, y_dtype) for n in ns]
    h = torch.randn(rows, len(ns) * rank, generator=g).to(device)
    qs = [torch.randn(n, rank, generator=g).to(device, q_dtype).t() for n in ns]  # b.T, as the op passes it
    want = [lora._up_add_(b.clone(), h[:, i * rank:(i + 1) * rank], q, -1.5) for i, (b, q) in enumerate(zip(bases, qs))]
    launches = record_launches(monkeypatch, members, *MEMBER_KERNELS)
    members.up_add_members_(bases, h, qs, -1.5)
    for i, (got, w) in enumerate(zip(bases, want)):
        assert torch.equal(_bits(got), _bits(w)), i
    assert Counter(n for n, _, _ in launches) == {"_up_add_members_kernel": -(-len(ns) // members.MEMBERS_PER_LAUNCH)}


def _quantised(shape, blocksize, quant_type, nested, seed, device="cpu"):
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    w = (torch.randn(shape, generator=seeded(seed)) * 2).to(device)
    return bnb_functional.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)


@pytest.mark.parametrize("rows", [(9, 3, 17), (5, 1, 8, 3)], ids=["3", "4"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("quant_type,blocksize", [("nf4", 64), ("fp4", 128)])
def test_dequantize_members_bits_and_launches(rows, nested, quant_type, blocksize, monkeypatch, device):
    """Each weight's rows of the joined buffer are ``dequantize_4bit`` (or ``_nested``) of that weight alone,
    odd element counts included (K = 77)."""
    k, dtype = 77, torch.bfloat16
    states = [_quantised((n, k), blocksize, quant_type, nested, seed, device) for seed, n in enumerate(rows)]
    want = []
    for q, st in states:
        if nested:
            want.append(nf4.dequantize_4bit_nested(q, st.absmax, st.state2.absmax, st.state2.code, st.offset,
                                                   blocksize, quant_type, (st.shape[0], k), dtype))
        else:
            want.append(nf4.dequantize_4bit(q, st.absmax, blocksize, quant_type, (st.shape[0], k), dtype))
    launches = record_launches(monkeypatch, nf4, "_dequantize_4bit_members_kernel")
    nested_args = [(st.state2.absmax, st.state2.code, st.offset, st.state2.blocksize) for _, st in states] \
        if nested else None
    got = nf4.dequantize_4bit_members([q for q, _ in states], [st.absmax for _, st in states], nested_args,
                                      blocksize, quant_type, [(n, k) for n in rows], dtype)
    assert got.shape == (sum(rows), k)
    assert torch.equal(got.view(torch.int16), torch.cat(want).view(torch.int16))
    assert len(launches) == -(-len(rows) // nf4.WEIGHTS_PER_LAUNCH)
    assert all(kw.get("enable_fp_fusion") is False for _, _, kw in launches)


def test_dequantize_members_bad_inputs():
    (q, st), (q2, st2) = _quantised((4, 64), 64, "nf4", False, 0), _quantised((4, 32), 64, "nf4", False, 1)
    with pytest.raises(ValueError, match="one column count"):
        nf4.dequantize_4bit_members([q, q2], [st.absmax, st2.absmax], None, 64, "nf4", [(4, 64), (4, 32)],
                                    torch.bfloat16)
    with pytest.raises(ValueError, match="one packed, absmax and shape"):
        nf4.dequantize_4bit_members([q, q], [st.absmax], None, 64, "nf4", [(4, 64), (4, 64)], torch.bfloat16)
    with pytest.raises(ValueError, match="absmax must have"):
        nf4.dequantize_4bit_members([q, q], [st.absmax, st.absmax[:1]], None, 64, "nf4", [(4, 64), (4, 64)],
                                    torch.bfloat16)


@pytest.mark.parametrize("split_launch", [True, False], ids=["split", "tf32x3"])
def test_members_of_other_modes_refused(device, split_launch, monkeypatch):
    """Members whose x (or p) dtypes differ are refused with the reason, also where both take one product mode
    (tf32x3 for fp32 and, with DOWN_SPLIT_LAUNCH off, bf16 activations): the kernel cannot select between
    pointers of two types."""
    monkeypatch.setattr(lora, "DOWN_SPLIT_LAUNCH", split_launch)
    x = [torch.randn(4, 8, device=device).bfloat16(), torch.randn(4, 8, device=device)]
    p = [torch.randn(8, 2, device=device), torch.randn(8, 2, device=device)]
    with pytest.raises(ValueError, match="share rows, rank, dtypes and product mode"):
        members.down_members(x, p, torch.empty(4, 4, device=device))
    with pytest.raises(ValueError, match="share rows, rank, dtypes and product mode"):
        members.down_members(x[1:] * 2, [p[0], p[1].double()], torch.empty(4, 4, device=device))
