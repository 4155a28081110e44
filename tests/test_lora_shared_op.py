"""The fused op ``sloth.lowering.lora_shared.lora_linear_shared``: n LoRA linears on one input as one op.

Oracle: ``patterns/lora.py``'s ``lora_pattern`` (peft's LoRA forward) once per member on the same x, run
eagerly at the tested dtypes ("eager", autograd summing the members' input gradients in x's dtype) and with
every input in float64 (the reference). Checked: every output y_i and the gradients of x, each a_i and each
b_i, under the tolerance rule (tests/tolerance.py), on the Triton path and on the PyTorch fallback.
"""
from __future__ import annotations

import math

import pytest
import torch

import sloth.lowering.lora_shared as lowering
from sloth.lowering.lora_shared import lora_linear_shared
from sloth.patterns.lora import lora_pattern
from tolerance import assert_close
from op_checks import NoLaunch, force_fallback, record_launches

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
KERNELS = ("_split_factor_kernel", "_lora_down_kernel", "_lora_up_add_kernel", "_lora_grad_kernel")
MEMBER_KERNELS = ("_split_members_kernel", "_down_members_kernel", "_up_add_members_kernel")


def make_inputs(x_shape, ns, r: int, biases, seed: int = 0, device: str = "cpu"):
    """fp32 masters: x, [w_i], [bias_i or None], [a_i], [b_i], [dy_i]; base and adapter outputs of std ~1. Drawn on
    the CPU (the same values on every device) and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    k = x_shape[-1]
    x = torch.randn(x_shape, generator=g)
    ws = [torch.randn(n, k, generator=g) / math.sqrt(k) for n in ns]
    bias = [torch.randn(n, generator=g) if has else None for n, has in zip(ns, biases)]
    a_list = [torch.randn(r, k, generator=g) / math.sqrt(k) for _ in ns]
    bs = [torch.randn(n, r, generator=g) / math.sqrt(r) for n in ns]
    dys = [torch.randn(*x_shape[:-1], n, generator=g) for n in ns]
    on = lambda ts: [None if t is None else t.to(device) for t in ts]  # noqa: E731
    return x.to(device), on(ws), on(bias), on(a_list), on(bs), on(dys)


def _pattern_members(x, ws, biases, a_list, bs, scale):
    return [lora_pattern(x, w, bias, a, b, scale) for w, bias, a, b in zip(ws, biases, a_list, bs)]


def forward_backward(fn, x, ws, biases, a_list, bs, scale, dys, need_dx=True):
    """[y_0.., dx, da_0.., db_0..] of ``fn``; bases frozen, dx None when x needs no gradient."""
    x = x.detach().requires_grad_(need_dx)
    a_list = [a.detach().requires_grad_(True) for a in a_list]
    bs = [b.detach().requires_grad_(True) for b in bs]
    ys = fn(x, ws, biases, a_list, bs, scale)
    wrt = ([x] if need_dx else []) + a_list + bs
    grads = list(torch.autograd.grad(ys, wrt, [dy.to(y.dtype) for dy, y in zip(dys, ys)]))
    dx = grads.pop(0) if need_dx else None
    return [y.detach() for y in ys] + [dx] + grads


def check(masters, dtype, adapter_dtype, scale, need_dx=True):
    x, ws, biases, a_list, bs, dys = masters
    cast = lambda ts, dt: [None if t is None else t.to(dt) for t in ts]  # noqa: E731
    args = (x.to(dtype), cast(ws, dtype), cast(biases, dtype), cast(a_list, adapter_dtype), cast(bs, adapter_dtype))
    actual = forward_backward(lora_linear_shared, *args, scale, cast(dys, dtype), need_dx)
    eager = forward_backward(_pattern_members, *args, scale, cast(dys, dtype), need_dx)
    ref_args = (x.double(), cast(ws, torch.float64), cast(biases, torch.float64), cast(a_list, torch.float64),
                cast(bs, torch.float64))
    reference = forward_backward(_pattern_members, *ref_args, scale, cast(dys, torch.float64), need_dx)
    n = len(ws)
    names = [f"y{i}" for i in range(n)] + ["dx"] + [f"da{i}" for i in range(n)] + [f"db{i}" for i in range(n)]
    for name, got, e, ref in zip(names, actual, eager, reference):
        if e is None:
            assert got is None, name
            continue
        assert got.dtype == e.dtype and got.shape == e.shape, name
        assert_close(name, got, e, ref)


# (x shape, N_i, r, bias_i, scale): q/k/v-like (one wide, two narrow) and gate/up-like pairs, odd sizes so every
# kernel block has a masked tail, r = 5 and 16 (n r = 15, 32, 48 columns of the shared h), 257 rows (the grad
# kernel's row splits), a 3-D x, K past one down tile, mixed biases.
SHAPES = [
    ((37, 70), (45, 13, 13), 5, (False, False, False), 2.0),
    ((3, 70), (45, 13, 13), 16, (True, False, True), 0.5),
    ((257, 16), (33, 33), 5, (True, True), -1.5),
    ((2, 37, 70), (45, 13, 13), 16, (False, True, False), 2.0),
    ((37, 300), (130, 29), 16, (False, False), 0.5),
    ((19, 40), (21, 8, 8, 33), 4, (False, True, False, False), 1.5),  # four members: two launches per kernel
]
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


def _id(x_shape, ns, r, biases, scale):
    return (f"M{'x'.join(map(str, x_shape[:-1]))}-K{x_shape[-1]}-N{'+'.join(map(str, ns))}-r{r}"
            f"-bias{''.join('1' if b else '0' for b in biases)}-s{scale:g}")


CASES = [pytest.param(*shape, dt, adt, id=f"{_id(*shape)}-{DTYPE_IDS[dt]}-adapter-{DTYPE_IDS[adt]}")
         for shape in SHAPES for dt, adt in DTYPE_PAIRS]


@pytest.mark.parametrize("x_shape,ns,r,biases,scale,dtype,adapter_dtype", CASES)
def test_matches_pattern(x_shape, ns, r, biases, scale, dtype, adapter_dtype, device):
    masters = make_inputs(x_shape, ns, r, biases, device=device)
    check(masters, dtype, adapter_dtype, scale)


@pytest.mark.parametrize("need_dx", [True, False], ids=["dx", "no-dx"])
def test_fallback_and_frozen_input(need_dx, monkeypatch, device):
    """The PyTorch fallback is the same op; without dx (a frozen embedding's output) only da, db are formed."""
    masters = make_inputs((37, 70), (45, 13, 13), 16, (True, False, False), device=device)
    check(masters, torch.bfloat16, torch.float32, 2.0, need_dx=need_dx)
    import sloth.lowering.lora as lora_lowering
    import sloth.lowering.lora_members as members_lowering

    force_fallback(monkeypatch, lowering)  # the op's own switch to its reference path
    force_fallback(monkeypatch, lora_lowering, *KERNELS)  # and no kernel of lora.py or lora_members.py may launch
    for name in MEMBER_KERNELS:
        monkeypatch.setattr(members_lowering, name, NoLaunch())
    check(masters, torch.bfloat16, torch.float32, 2.0, need_dx=need_dx)


def test_one_launch_reads_x_for_every_member(monkeypatch, device):
    """What the op is for: the members' h comes from one down launch over x, the members' da from one grad
    problem over x, and the per-member adapter kernels run as one launch for all members; launches counted by
    kernel."""
    from collections import Counter

    import sloth.lowering.lora as lora_lowering
    import sloth.lowering.lora_members as members_lowering

    if not lora_lowering.use_triton(torch.empty(0, device=device)):
        pytest.skip("no Triton here")
    launches = record_launches(monkeypatch, lora_lowering, *KERNELS)
    launches_members = record_launches(monkeypatch, members_lowering, *MEMBER_KERNELS)
    x, ws, biases, a_list, bs, dys = make_inputs((37, 70), (45, 13, 13), 16, (False,) * 3, device=device)
    forward_backward(lora_linear_shared, x.bfloat16(), [w.bfloat16() for w in ws], biases, a_list, bs, 2.0,
                     [d.bfloat16() for d in dys])
    # forward: 1 split + 1 down (h over x), 1 up for the 3 members; backward: 1 split + 1 down for the 3 g_i,
    # 1 up (dx), 1 grad (da) + 2 (db pairs)
    calls = Counter(name for name, _, _ in launches + launches_members)
    assert calls == {"_split_factor_kernel": 1, "_lora_down_kernel": 1, "_up_add_members_kernel": 1,
                     "_split_members_kernel": 1, "_down_members_kernel": 1, "_lora_up_add_kernel": 1,
                     "_lora_grad_kernel": 3}, calls


def test_bad_inputs(device):
    x, ws, biases, a_list, bs, _ = make_inputs((4, 8), (5, 3), 2, (False, False), device=device)
    lowering.register()
    a = torch.cat(a_list)
    with pytest.raises(ValueError, match="one entry per linear"):
        torch.ops.sloth.lora_linear_shared(x, ws, [None], a, bs, 1.0)
    with pytest.raises(ValueError, match="stacked by rows"):
        torch.ops.sloth.lora_linear_shared(x, ws, biases, a[:3], bs, 1.0)
    with pytest.raises(ValueError, match="shapes do not chain"):
        torch.ops.sloth.lora_linear_shared(x, [ws[0], ws[0][:, :4]], biases, a, bs, 1.0)


# ---------------------------------------------------------------------------------------------------
# The 4-bit op: the dense op on bitsandbytes' dequantised weights, bit for bit
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("quant_type,nested", [("nf4", True), ("fp4", False)], ids=["nf4-nested", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_4bit_equals_the_dense_op_on_the_dequantised_weights(quant_type, nested, dtype, device):
    """sloth.qlora_linear_shared dequantises each member's weight bit for bit as bitsandbytes does
    (tests/test_nf4_op.py) and then runs the dense op's arithmetic: outputs and every gradient are equal."""
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    x, ws, biases, a_list, bs, dys = make_inputs((5, 7, 64), (45, 13, 13), 4, (False, True, False), device=device)
    states = [bnb_functional.quantize_4bit(w.to(dtype), blocksize=64, quant_type=quant_type,
                                           compress_statistics=nested) for w in ws]
    dense = [bnb_functional.dequantize_4bit(q, st) for q, st in states]
    lists = ([q for q, _ in states], [st.absmax for _, st in states],
             *(([st.state2.code for _, st in states], [st.state2.absmax for _, st in states],
                [st.offset for _, st in states]) if nested else ([], [], [])))
    lowering.register()

    def quantised(x, ws_unused, biases, a_list, bs, scale):
        return torch.ops.sloth.qlora_linear_shared(x, *lists, [w.shape[0] for w in ws], 64, 64, quant_type, biases,
                                                   torch.cat(a_list), bs, scale)[:-1]

    cast = [None if b is None else b.to(dtype) for b in biases]
    args = (x.to(dtype), dense, cast, a_list, bs, 2.0, [d.to(dtype) for d in dys])
    got = forward_backward(quantised, *args)
    want = forward_backward(lora_linear_shared, *args)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), i


def test_4bit_bad_lists(device):
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    q, st = bnb_functional.quantize_4bit(torch.randn(8, 64, device=device), blocksize=64, quant_type="nf4",
                                         compress_statistics=True)
    lowering.register()
    x, a, b = torch.randn(3, 64, device=device), torch.randn(4, 64, device=device), torch.randn(8, 2, device=device)
    with pytest.raises(ValueError, match="all empty or one per linear"):
        torch.ops.sloth.qlora_linear_shared(x, [q, q], [st.absmax, st.absmax], [st.state2.code], [], [], [8, 8], 64,
                                            64, "nf4", [None, None], a, [b, b], 1.0)
