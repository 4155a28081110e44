"""The fused op ``sloth.lowering.moe.moe_experts``: forward and every gradient against transformers' eager loop.

Oracle (STYLE.md, habit 5): ``moe_experts_pattern`` (transformers 5.24 ``Qwen3MoeExperts.forward``) run at the
tested dtype is "eager"; run in float64 it is the reference. Shapes are odd on purpose (H=24, I=20: bf16 rows of
40 bytes, which torch._grouped_mm refuses, so bf16 takes the Triton grouped GEMM there, interpreted; fp32 rows of 80
and 96 bytes take torch._grouped_mm's CPU kernel); one aligned bf16 shape takes torch._grouped_mm in bf16, and
``test_grouped_gemm_backends_agree`` compares the plan of the device it runs on with every other backend there.
"""
from __future__ import annotations

import functools

import pytest
import torch

import sloth.lowering.moe as lowering
import sloth.lowering.moe_kernels as moe_kernels
import sloth.lowering.moe_routing as moe_routing
from sloth.lowering.backend_choice import triton_interpreter_on
from sloth.lowering.moe import ACTIVATIONS, UNGATED_ACTIVATIONS, moe_experts, moe_experts_pattern, register
from op_checks import RecordOps
from tolerance import assert_close

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}
GRAD_NAMES = ("out", "dx", "d_top_k_weights", "d_gate_up_proj", "d_down_proj")


def make_inputs(T, H, I, E, K, seed=0, unused_experts=(), gated=True, device="cpu"):
    """fp32 masters (x, top_k_index, top_k_weights, gate_up_proj, down_proj, dout); experts in ``unused_experts``
    get no token. Weights scaled ~1/sqrt(fan-in) so activations stay O(1) and reach the GLU's bend. With
    ``gated=False`` the first weight is an ungated expert's up projection [E, I, H]. Drawn on the CPU (the same
    values on every device) and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor([e for e in range(E) if e not in unused_experts])
    # K distinct experts a token, as a router's top-k gives.
    index = torch.stack([used[torch.randperm(len(used), generator=g)[:K]] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    x = torch.randn(T, H, generator=g)
    gate_up = torch.randn(E, 2 * I if gated else I, H, generator=g) * 2 / H ** 0.5
    down = torch.randn(E, H, I, generator=g) / I ** 0.5
    return tuple(t.to(device) for t in (x, index, weights, gate_up, down, torch.randn(T, H, generator=g)))


def forward_backward(fn, x, index, weights, gate_up, down, dout, act, frozen=False, **options):
    leaves = [t.detach().requires_grad_(not (frozen and i >= 2)) for i, t in enumerate((x, weights, gate_up, down))]
    x, weights, gate_up, down = leaves
    out = fn(x, index, weights, gate_up, down, act, **options)
    wrt = [x, weights] if frozen else [x, weights, gate_up, down]
    return [out.detach(), *torch.autograd.grad(out, wrt, dout.to(out.dtype))]


def check_against_pattern(masters, dtype, act, frozen=False, **options):
    """Forward and every gradient of the op against the pattern at ``dtype`` and in float64; ``options`` are
    passed to both (``gated=False``)."""
    x, index, weights, gate_up, down, dout = masters
    low = [t.to(dtype) for t in (x, weights, gate_up, down, dout)]
    args = lambda ts: (ts[0], index, ts[1], ts[2], ts[3], ts[4])  # noqa: E731
    actual = forward_backward(moe_experts, *args(low), act, frozen, **options)
    eager = forward_backward(moe_experts_pattern, *args(low), act, frozen, **options)
    reference = forward_backward(moe_experts_pattern, *args([t.double() for t in low]), act, frozen, **options)
    for name, a, e, r in zip(GRAD_NAMES, actual, eager, reference):
        assert_close(name, a, e, r)
    return actual


# ---------------------------------------------------------------------------------------------------
# Forward and every gradient
# ---------------------------------------------------------------------------------------------------

SHAPES = {  # id -> (T, H, I, E, K, unused experts)
    "T13-H24-I20-E5-K2": (13, 24, 20, 5, 2, ()),
    "T13-H24-I20-E5-K2-expert3-empty": (13, 24, 20, 5, 2, (3,)),
    "T9-H24-I20-E6-K1-experts0,5-empty": (9, 24, 20, 6, 1, (0, 5)),
    "T1-H24-I20-E5-K3": (1, 24, 20, 5, 3, ()),
    "T17-H32-I16-E4-K2-aligned": (17, 32, 16, 4, 2, ()),
    # every token to experts 0 and 1, the other three empty: one group holds all T rows, groups at the end are empty
    "T13-H24-I20-E5-K2-all-to-0,1": (13, 24, 20, 5, 2, (2, 3, 4)),
    "T17-H32-I16-E4-K2-aligned-all-to-0,1": (17, 32, 16, 4, 2, (2, 3)),
}

CASES = [pytest.param(shape, dtype, act, id=f"{sid}-{DTYPE_IDS[dtype]}-{act}")
         for sid, shape in SHAPES.items() for dtype in (torch.float32, torch.bfloat16) for act in ACTIVATIONS
         if act == "silu" or sid == "T13-H24-I20-E5-K2"]


@pytest.mark.parametrize("shape,dtype,act", CASES)
def test_forward_and_gradients_match_pattern(shape, dtype, act, device):
    T, H, I, E, K, unused = shape
    masters = make_inputs(T, H, I, E, K, unused_experts=unused, device=device)
    out, dx, dw, dgu, ddown = check_against_pattern(masters, dtype, act)
    assert out.dtype == dx.dtype == dgu.dtype == ddown.dtype == dtype and dw.dtype == dtype
    for e in unused:  # an expert with no token gets an exactly zero gradient
        assert not dgu[e].any() and not ddown[e].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp32_router_weights_with_low_precision_x(dtype, device):
    # Routers often hand fp32 weights to bf16 experts; the gradient comes back in the weights' dtype.
    x, index, weights, gate_up, down, dout = make_inputs(13, 32, 16, 5, 2, device=device)
    x, gate_up, down, dout = (t.to(dtype) for t in (x, gate_up, down, dout))
    actual = forward_backward(moe_experts, x, index, weights, gate_up, down, dout, "silu")
    eager = forward_backward(moe_experts_pattern, x, index, weights, gate_up, down, dout, "silu")
    reference = forward_backward(moe_experts_pattern, x.double(), index, weights.double(), gate_up.double(),
                                 down.double(), dout.double(), "silu")
    for name, a, e, r in zip(GRAD_NAMES, actual, eager, reference):
        assert_close(name, a, e, r)
    assert actual[2].dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# GPT-OSS's experts: biases, interleaved gate/up, the clamped GLU
# ---------------------------------------------------------------------------------------------------

GPT_OSS_GRAD_NAMES = (*GRAD_NAMES, "d_gate_up_bias", "d_down_bias")
VARIANTS = {  # id -> (act, interleaved, biases)
    "swiglu_oai-interleaved-biases": ("swiglu_oai", True, True),  # GPT-OSS itself
    "swiglu_oai-halves": ("swiglu_oai", False, False),
    "silu-interleaved": ("silu", True, False),
    "gelu-biases": ("gelu", False, True),
    "silu_clamped-halves": ("silu_clamped", False, False),  # DeepSeek-V4, Hunyuan-V4
    "silu_clamped-interleaved-biases": ("silu_clamped", True, True),
}


def check_variant(masters, biases_masters, dtype, act, interleaved, frozen=False, **options):
    """Forward and every gradient (x, router weights, expert weights and, when present, both biases) of the op
    against the pattern at ``dtype`` and in float64; experts and biases frozen when ``frozen``; ``options`` passed
    to both (``gated=False``)."""
    x, index, weights, gate_up, down, dout = masters

    def run(fn, cast):
        x_, w_, gu_, d_ = (cast(t).requires_grad_() for t in (x, weights, gate_up, down))
        for t in (gu_, d_):
            t.requires_grad_(not frozen)
        b = [cast(t).requires_grad_(not frozen) for t in biases_masters]
        out = fn(x_, index, w_, gu_, d_, act, *(b or (None, None)), interleaved=interleaved, alpha=1.702, limit=7.0,
                 **options)
        wrt = [x_, w_] + ([] if frozen else [gu_, d_, *b])
        return [out.detach(), *torch.autograd.grad(out, wrt, cast(dout))]

    actual = run(moe_experts, lambda t: t.to(dtype))
    eager = run(moe_experts_pattern, lambda t: t.to(dtype))
    reference = run(moe_experts_pattern, lambda t: t.to(dtype).double())
    for name, a, e, r in zip(GPT_OSS_GRAD_NAMES, actual, eager, reference):
        assert_close(name, a, e, r)
    return actual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["T13-H24-I20-E5-K2-expert3-empty", "T17-H32-I16-E4-K2-aligned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpt_oss_variants_match_pattern(variant, shape, dtype, device):
    act, interleaved, with_biases = VARIANTS[variant]
    T, H, I, E, K, unused = SHAPES[shape]
    masters = list(make_inputs(T, H, I, E, K, seed=5, unused_experts=unused, device=device))
    masters[3] = masters[3] * 6  # pre-activations up to ~15: past GPT-OSS's limit of 7, so both clamps bind
    g = torch.Generator().manual_seed(6)
    biases = [torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g) * 0.5] if with_biases else []
    biases = [b.to(device) for b in biases]
    gu = torch.einsum("th,eih->tei", masters[0], masters[3])
    assert (gu > 7).any() and (gu < -7).any()  # the clamp's masks are exercised, not only its identity
    out, dx, dw, dgu, ddown, *dbias = check_variant(masters, biases, dtype, act, interleaved)
    for e in unused:  # an expert with no token: exactly zero gradients, biases' included
        assert not dgu[e].any() and not ddown[e].any() and all(not d[e].any() for d in dbias)
    assert len(dbias) == (2 if with_biases else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_segment_sum_sums_each_experts_rows(dtype, scaled, device):
    # The biases' gradients: each expert's sorted rows summed in fp32 (no atomics), empty experts (first, middle and
    # last) exactly zero, against the fp64 sum by expert id.
    g = torch.Generator().manual_seed(3)
    ids = torch.sort(torch.tensor([1, 1, 2, 4, 4, 4, 5, 1, 2, 2, 5, 4, 1, 1, 1, 2, 4] * 3, device=device)).values
    offs = torch.searchsorted(ids, torch.arange(7, device=device), right=True, out_int32=True)
    rows = torch.randn(ids.shape[0], 37, generator=g).to(device).to(dtype)
    scale = torch.rand(ids.shape[0], generator=g).to(device) if scaled else None
    out = moe_kernels.segment_sum(rows, offs, ids, scale, dtype)
    eager = moe_kernels.segment_sum_reference(rows, offs, ids, scale, dtype)
    values = rows.double() * (scale.double()[:, None] if scaled else 1)
    reference = torch.zeros(7, 37, dtype=torch.float64, device=device).index_add_(0, ids, values)
    assert out.dtype == dtype and not out[[0, 3, 6]].any()
    assert_close("segment_sum", out, eager, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpt_oss_frozen_experts_and_biases(dtype, device):
    # LoRA on attention only: experts and their biases frozen get no gradient; x and the router weights theirs.
    T, H, I, E, K, unused = SHAPES["T13-H24-I20-E5-K2"]
    masters = make_inputs(T, H, I, E, K, seed=7, device=device)
    g = torch.Generator().manual_seed(8)
    biases = [torch.randn(E, 2 * I, generator=g).to(device), torch.randn(E, H, generator=g).to(device)]
    check_variant(masters, biases, dtype, "swiglu_oai", True, frozen=True)


def planned_backend(dtype: torch.dtype, device: str) -> str:
    """The backend lowering/moe.py's ``_grouped_mm_plan`` takes for the aligned shape (H=32, I=16, 34 rows over 4
    experts) under GEMM_CHOICE "auto": on the CPU torch._grouped_mm's kernel (every float); on a GPU of sm90 or
    later bf16 is "mixed" (_grouped_mm, with Triton's GEMM where the tokens are read through the order: 8.5 rows an
    expert, under GATHER_ROWS_PER_EXPERT), on sm80 Triton's GEMM; fp32 on a GPU the reference (``_triton_gemm_runs``:
    not fp32 there, and torch._grouped_mm's fast kernel is bf16 only)."""
    if torch.device(device).type != "cuda":
        return "grouped_mm"
    capability = torch.cuda.get_device_capability(torch.device(device))
    if dtype == torch.bfloat16 and capability >= (9, 0):
        return "mixed"
    if dtype == torch.bfloat16 and capability >= (8, 0):
        return "triton"
    return "reference"


@functools.cache
def _grouped_mm_refusal(dtype: torch.dtype, device: str) -> str | None:
    """Why torch._grouped_mm does not run at ``dtype`` on ``device`` (asked of it with one small call), or None."""
    a = torch.zeros(4, 16, dtype=dtype, device=device)
    b = torch.zeros(2, 16, 16, dtype=dtype, device=device)
    try:
        torch._grouped_mm(a, b, offs=torch.tensor([2, 4], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError) as error:
        return f"torch._grouped_mm does not run {dtype} on {device}: {str(error).splitlines()[0]}"
    return None


def why_not_here(backend: str, dtype: torch.dtype, device: str) -> str | None:
    """Why ``backend`` (GroupedGemm's, forced) cannot run here, or None: Triton's GEMM ("triton", and "mixed"'s
    gathered GEMMs) needs a GPU or the interpreter, torch._grouped_mm ("grouped_mm", "mixed") may refuse the dtype.
    The reference runs everywhere."""
    if backend in ("triton", "mixed") and torch.device(device).type != "cuda" and not triton_interpreter_on():
        return f"{backend}: Triton's grouped GEMM needs a GPU or TRITON_INTERPRET=1"
    if backend in ("grouped_mm", "mixed") and (reason := _grouped_mm_refusal(dtype, device)):
        return f"{backend}: {reason}"
    return None


def skip_unless_runs(backend: str, dtype: torch.dtype, device: str) -> None:
    if reason := why_not_here(backend, dtype, device):
        pytest.skip(reason)


@pytest.mark.parametrize("backend", ["grouped_mm", "mixed", "triton", "reference"])
@pytest.mark.parametrize("act,gated", [("silu", True), ("relu2", False)], ids=["gated-silu", "ungated-relu2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_gemm_backends_agree(monkeypatch, dtype, act, gated, backend, device):
    # The aligned shape takes this device's plan (``planned_backend``: torch._grouped_mm's CPU kernel on the CPU;
    # "mixed" for bf16 and the reference for fp32 on an H100); every other backend that runs here (the Triton grouped
    # GEMM, tokens read through the sort order, weight gradients too; the mixed; torch._grouped_mm; the reference)
    # must give the same numbers, every gradient within the rule.
    plan = planned_backend(dtype, device)
    if backend == plan:
        pytest.skip(f"{backend} is this device's plan at {dtype}: the side every other backend is compared with")
    skip_unless_runs(backend, dtype, device)
    monkeypatch.setattr(lowering, "GEMM_CHOICE", "auto")
    masters = make_inputs(17, 32, 16, 4, 2, unused_experts=(1,), gated=gated, device=device)
    x, w1, w2 = (masters[i].to(dtype) for i in (0, 3, 4))
    assert lowering._grouped_mm_plan(x, w1, w2, (), 34) == plan
    planned = check_against_pattern(masters, dtype, act, gated=gated)
    monkeypatch.setattr(lowering, "_grouped_mm_plan", lambda *args: backend)
    other = check_against_pattern(masters, dtype, act, gated=gated)
    for name, a, b in zip(GRAD_NAMES, planned, other):
        torch.testing.assert_close(a, b, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-4 if
                                   dtype == torch.float32 else 2e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("choice", ["auto", "triton", "grouped_mm", "mixed"])
@pytest.mark.parametrize("interpreted", [True, False], ids=["interpreter", "plain-cpu"])
def test_pattern_and_plan_agree_on_the_reference(monkeypatch, choice, interpreted):
    # patterns/moe.py refuses large experts where the op would take its reference GEMM (gemm_runs False); the op's
    # plan must then be the reference and otherwise not, under every GEMM_CHOICE and with or without the
    # interpreter (found in review: gemm_runs said yes under "triton" on a plain CPU while the plan took the reference).
    monkeypatch.setattr(lowering, "GEMM_CHOICE", choice)
    monkeypatch.setattr(lowering, "triton_interpreter_on", lambda: interpreted)
    for H, I, dtype in ((32, 16, torch.float32), (32, 16, torch.bfloat16), (24, 20, torch.bfloat16)):
        masters = make_inputs(5, H, I, 4, 2)
        x, w1, w2 = masters[0].to(dtype), masters[3].to(dtype), masters[4].to(dtype)
        runs = lowering.gemm_runs(x.device, dtype, H, I)
        assert runs == (lowering._grouped_mm_plan(x, w1, w2, (), 10) != "reference"), (H, I, dtype)


@pytest.mark.parametrize("backend", ["grouped_mm", "mixed", "triton", "reference"])
def test_lora_experts_on_every_backend(monkeypatch, backend, device):
    # LoRA on both expert GEMMs, adapters and experts training: their products read the gathered tokens too (the
    # Triton GEMM through the order, the others on the formed copy); every gradient within the rule on each backend
    # that runs here (one that does not is skipped with the reason, not passed over).
    skip_unless_runs(backend, torch.float32, device)
    masters = make_inputs(17, 32, 16, 4, 2, unused_experts=(2,), device=device)
    adapters = make_adapters(4, 32, 16, 8, device=device)
    monkeypatch.setattr(lowering, "_grouped_mm_plan", lambda *args: backend)
    check_lora(masters, adapters, torch.float32, base_trains=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_frozen_experts_get_no_gradient(dtype, device):
    # LoRA freezes the expert weights: they get no gradient, and the backward op is told not to form them.
    masters = make_inputs(13, 24, 20, 5, 2, device=device)
    x, index, weights, gate_up, down, dout = (t.to(dtype) if t.is_floating_point() else t for t in masters)
    x, weights = x.requires_grad_(True), weights.requires_grad_(True)
    out = moe_experts(x, index, weights, gate_up, down, "silu")
    with RecordOps() as rec:
        out.backward(dout)
    assert gate_up.grad is None and down.grad is None and x.grad is not None and weights.grad is not None
    (_, args, outputs), = [c for c in rec.calls if c[0] == torch.ops.sloth.moe_experts_backward.default]
    assert list(args[-4:]) == [True, True, False, False]
    assert outputs[2].numel() == 0 and outputs[3].numel() == 0
    check_against_pattern(masters, dtype, "silu", frozen=True)


@pytest.mark.parametrize("backend", ["grouped_mm", "mixed", "triton", "reference"])
@pytest.mark.parametrize("variant,dtype", [("gpt-oss", torch.float32), ("gpt-oss", torch.bfloat16),
                                           ("ungated", torch.bfloat16)], ids=["gpt-oss-fp32", "gpt-oss-bf16",
                                                                              "ungated-bf16"])
def test_lora_on_gpt_oss_and_ungated_experts_on_every_backend(monkeypatch, variant, dtype, backend, device):
    # LoRA on both GEMMs of GPT-OSS's experts (weights stored [E, H, 2I] / [E, I, H] and passed as transposed views,
    # biases, interleaved gate/up, the clamped GLU) and of ungated experts (NemotronH's relu2, up_proj [E, I, H]):
    # since 2026-12-06 a GPU takes the mixed GEMMs with expert adapters too, so each backend must give every gradient
    # within the rule. Sizes and rank whose rows are multiples of 16 bytes in bf16, as torch._grouped_mm (the first
    # two backends) needs (the plan never gives it others).
    T, H, I, E, K, r = 17, 32, 16, 4, 2, 8
    skip_unless_runs(backend, dtype, device)
    monkeypatch.setattr(lowering, "_grouped_mm_plan", lambda *args: backend)
    if variant == "gpt-oss":
        x, index, weights, gate_up_t, down_t, biases, dout = _gpt_oss_inputs(T, H, I, E, K, device=device)
        masters = (x, index, weights, gate_up_t.detach().transpose(1, 2), down_t.detach().transpose(1, 2), dout)
        grads = check_lora(masters, make_adapters(E, H, I, r, permuted=True, device=device), dtype, act="swiglu_oai",
                           biases=tuple(b.detach() for b in biases), interleaved=True)
    else:
        masters = make_inputs(T, H, I, E, K, unused_experts=(2,), gated=False, device=device)
        grads = check_lora(masters, make_adapters(E, H, I, r, permuted=True, gated=False, device=device), dtype,
                           act="relu2", gated=False)
    for grad in grads[3:]:
        assert grad.abs().max() > 0  # every adapter factor trains
        assert not grad[2].any()  # expert 2 gets no token: an exactly zero adapter gradient


@pytest.mark.parametrize("route", ["counting", "sort"])
@pytest.mark.parametrize("variant", ["qwen3", "gpt-oss", "lora", "ungated"])
def test_no_host_sync_and_nothing_of_size_T_by_E(variant, route, monkeypatch, device):
    # No .item()/.tolist() (aten._local_scalar_dense) and no nonzero (data-dependent shape), forward or backward;
    # GPT-OSS's variant with its biases and their gradients, and LoRA on the experts, too; with either dispatch
    # (lowering/moe_routing.py's counting sort, or ROUTE_CHOICE "sort"'s PyTorch ops).
    monkeypatch.setattr(moe_routing, "ROUTE_CHOICE", route)
    T, H, I, E, K = 13, 24, 20, 7, 2
    x, index, weights, gate_up, down, _ = make_inputs(T, H, I, E, K, gated=variant != "ungated", device=device)
    g = torch.Generator().manual_seed(1)
    extra = {"gpt-oss": ("swiglu_oai", torch.randn(E, 2 * I, generator=g).to(device),
                         torch.randn(E, H, generator=g).to(device), True),
             "lora": ("silu", None, None, False, 1.702, 7.0, *make_adapters(E, H, I, 3, device=device), 2.0, 0.5),
             # ungated, with biases and LoRA on both GEMMs
             "ungated": ("relu2", torch.randn(E, I, generator=g).to(device), torch.randn(E, H, generator=g).to(device),
                         False, 1.702, 7.0,
                         *make_adapters(E, H, I, 3, gated=False, device=device), 2.0, 0.5, False),
             }.get(variant, ("silu",))
    calls = _recorded_forward_backward(x, index, weights, gate_up, down, *extra)
    names = [name for name, _ in calls]
    # The op's own calls were recorded (its GEMMs may be Triton's): the sort, or the counting sort's [blocks, E + 1]
    # counts.
    if route == "sort":
        assert "aten.sort.stable" in names, names
    else:
        assert "aten.sort.stable" not in names, names
        assert any(o.shape == (1, E + 1) and o.dtype == torch.int32 for _, outs in calls for o in outs
                   if isinstance(o, torch.Tensor)), names
    assert not [n for n in names if "_local_scalar_dense" in n or "nonzero" in n], names
    for name, outs in calls:
        for o in outs:
            if isinstance(o, torch.Tensor) and o.dim() >= 2:
                assert o.shape[-1] != E or o.shape[-2] not in (T, T * K), f"{name} made {tuple(o.shape)}"


# ---------------------------------------------------------------------------------------------------
# Ungated experts (NemotronH's, Ergo's): h = act(W_up x), gated=False, the first weight [E, I, H]
# ---------------------------------------------------------------------------------------------------

UNGATED_CASES = [pytest.param(shape, dtype, act, id=f"{sid}-{DTYPE_IDS[dtype]}-{act}-ungated")
                 for sid, shape in SHAPES.items() for dtype in (torch.float32, torch.bfloat16)
                 for act in UNGATED_ACTIVATIONS if act == "relu2" or sid == "T13-H24-I20-E5-K2"]


@pytest.mark.parametrize("shape,dtype,act", UNGATED_CASES)
def test_ungated_forward_and_gradients_match_pattern(shape, dtype, act, device):
    T, H, I, E, K, unused = shape
    masters = make_inputs(T, H, I, E, K, unused_experts=unused, gated=False, device=device)
    out, dx, dw, d_up, d_down = check_against_pattern(masters, dtype, act, gated=False)
    assert d_up.shape == (E, I, H) and d_down.shape == (E, H, I)
    assert out.dtype == dx.dtype == d_up.dtype == d_down.dtype == dw.dtype == dtype
    assert d_up.abs().max() > 0 and dw.abs().max() > 0
    for e in unused:  # an expert with no token gets an exactly zero gradient
        assert not d_up[e].any() and not d_down[e].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("frozen", [False, True], ids=["train", "frozen"])
@pytest.mark.parametrize("act", ["relu2", "gelu_tanh"])
def test_ungated_with_biases_matches_pattern(act, frozen, dtype, device):
    # transformers' has_bias with has_gate=False: up bias [E, I], down bias [E, H] (inside the router weighting)
    T, H, I, E, K, unused = SHAPES["T13-H24-I20-E5-K2-expert3-empty"]
    masters = make_inputs(T, H, I, E, K, seed=2, unused_experts=unused, gated=False, device=device)
    g = torch.Generator().manual_seed(6)
    biases = [torch.randn(E, I, generator=g).to(device), torch.randn(E, H, generator=g).to(device) * 0.5]
    grads = check_variant(masters, biases, dtype, act, False, frozen=frozen, gated=False)
    assert len(grads) == (3 if frozen else 7)
    if not frozen:
        out, dx, dw, d_up, d_down, d_b1, d_b2 = grads
        assert d_b1.shape == (E, I) and d_b1.abs().max() > 0 and d_b2.abs().max() > 0
        for e in unused:
            assert not d_up[e].any() and not d_down[e].any() and not d_b1[e].any() and not d_b2[e].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ungated_frozen_experts_get_no_gradient(dtype, device):
    # LoRA on attention only: the ungated experts frozen get no gradient, and the backward op forms none.
    masters = make_inputs(13, 24, 20, 5, 2, gated=False, device=device)
    x, index, weights, up, down, dout = (t.to(dtype) if t.is_floating_point() else t for t in masters)
    x, weights = x.requires_grad_(True), weights.requires_grad_(True)
    out = moe_experts(x, index, weights, up, down, "relu2", gated=False)
    with RecordOps() as rec:
        out.backward(dout)
    assert up.grad is None and down.grad is None and x.grad is not None and weights.grad is not None
    (_, args, outputs), = [c for c in rec.calls if c[0] == torch.ops.sloth.moe_experts_backward.default]
    assert list(args[10:14]) == [True, True, False, False] and args[-1] is False  # compute_*, then gated
    assert outputs[0].shape == x.shape and outputs[2].numel() == 0 and outputs[3].numel() == 0
    check_against_pattern(masters, dtype, "relu2", frozen=True, gated=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ungated_transposed_layout_matches_pattern_and_needs_no_copy(dtype, device):
    # Ergo's layout (is_transposed=True): up stored [E, H, I], down [E, I, H], passed as transposed views; the
    # weight gradients come back in the stored layout.
    masters = list(make_inputs(13, 24, 20, 5, 2, seed=3, unused_experts=(2,), gated=False, device=device))
    masters[3], masters[4] = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in masters[3:5])
    out, dx, dw, d_up, d_down = check_against_pattern(masters, dtype, "relu2", gated=False)
    assert d_up.transpose(1, 2).is_contiguous() and d_down.transpose(1, 2).is_contiguous()
    up_t, down_t = (masters[i].transpose(1, 2).to(dtype).requires_grad_(True) for i in (3, 4))
    moe_experts(masters[0].to(dtype), masters[1], masters[2].to(dtype), up_t.transpose(1, 2),
                down_t.transpose(1, 2), "relu2", gated=False).backward(masters[5].to(dtype))
    assert up_t.grad.is_contiguous() and down_t.grad.is_contiguous()
    torch.testing.assert_close(up_t.grad, d_up.transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("on", [("gate_up", "down"), ("gate_up",), ("down",)], ids=["both", "up", "down"])
def test_ungated_lora_on_experts_matches_merged_weights(on, dtype, device):
    # peft's target_parameters on up_proj [E, I, H] and down_proj: B1 [E, I, r]
    T, H, I, E, K, r, unused = LORA_CASES["T13-H24-I20-E5-K2-r3-expert3-empty"]
    grads = check_lora(make_inputs(T, H, I, E, K, unused_experts=unused, gated=False, device=device),
                       make_adapters(E, H, I, r, gated=False, device=device), dtype, on, act="relu2", gated=False)
    for grad in grads[3:]:
        assert grad.abs().max() > 0
        for e in unused:
            assert not grad[e].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ungated_lora_with_training_base_and_peft_views(dtype, device):
    masters = make_inputs(17, 32, 16, 4, 2, gated=False, device=device)
    check_lora(masters, make_adapters(4, 32, 16, 4, permuted=True, gated=False, device=device), dtype, base_trains=True,
               act="silu", gated=False)


def test_opcheck_ungated(device):
    register()
    x, index, weights, up, down, _ = make_inputs(13, 24, 20, 5, 2, unused_experts=(2,), gated=False, device=device)
    g = torch.Generator().manual_seed(4)
    b1, b2 = (torch.randn(5, n, generator=g).to(device).requires_grad_(True) for n in (20, 24))
    args = (x.requires_grad_(True), index, weights.requires_grad_(True), up.requires_grad_(True),
            down.requires_grad_(True), "relu2", b1, b2, False, 1.702, 7.0, None, None, None, None, 1.0, 1.0, False)
    torch.library.opcheck(torch.ops.sloth.moe_experts.default, args)
    x, weights, up, down, b1, b2 = (t.detach() for t in (x, weights, up, down, b1, b2))  # the backward has none
    _, u, order, offs = torch.ops.sloth.moe_experts(x, index, weights, up, down, "relu2", b1, b2, False, 1.702, 7.0,
                                                    None, None, None, None, 1.0, 1.0, False)
    assert u.shape == (26, 20)
    torch.library.opcheck(torch.ops.sloth.moe_experts_backward.default,
                          (torch.randn(13, 24, generator=g).to(device), x, index, weights, up, down, u, order, offs,
                           "relu2",
                           True, True, True, True, b1, b2, False, 1.702, 7.0, True, True, None, None, None, None,
                           1.0, 1.0, False, False, False))


# ---------------------------------------------------------------------------------------------------
# The two kernels between the GEMMs (lowering/moe_kernels.py), against the math they replace
# ---------------------------------------------------------------------------------------------------

def _permutation(n, seed, device="cpu"):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,K,H", [(7, 3, 37), (1, 1, 5), (5, 2, 2100)])  # 2100: two column blocks
def test_combine_sums_each_tokens_rows(T, K, H, dtype, scaled, device):
    g = torch.Generator().manual_seed(T * H)
    rows = torch.randn(T * K, H, generator=g).to(device)
    scale = torch.softmax(torch.randn(T, K, generator=g).to(device), -1) if scaled else None
    order = _permutation(T * K, H, device=device)
    inverse, token = moe_routing.invert_order(order, K)
    assert torch.equal(token, order // K)
    assert torch.equal(order[inverse], torch.arange(T * K, device=device))

    def eager(rows, scale):  # the first version's math at the tested dtype: gather, scale, sum over K
        r = rows[inverse].view(T, K, H)
        return (r * scale.unsqueeze(-1) if scale is not None else r).sum(1)

    actual = moe_kernels.combine(rows.to(dtype), inverse, K, scale, dtype)
    assert actual.shape == (T, H) and actual.dtype == dtype
    low_scale = scale.to(dtype) if scale is not None else None
    assert_close("combine", actual, eager(rows.to(dtype), low_scale),
                 eager(rows.double(), scale.double() if scale is not None else None))


@pytest.mark.parametrize("want_dw,want_hw", [(True, True), (True, False), (False, False)], ids=["dw-hw", "dw", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act,interleaved,gated", [(a, False, True) for a in ACTIVATIONS]
                         + [("swiglu_oai", True, True), ("silu_clamped", False, True), ("silu", True, True)]
                         + [(a, False, False) for a in UNGATED_ACTIVATIONS],
                         ids=[*ACTIVATIONS, "swiglu_oai-interleaved", "silu_clamped", "silu-interleaved",
                              *(f"{a}-ungated" for a in UNGATED_ACTIVATIONS)])
@pytest.mark.parametrize("T,K,I", [(7, 3, 37), (3, 2, 300)])  # 300: the column loop runs twice
def test_glu_backward_weighted_matches_autograd(T, K, I, act, interleaved, gated, dtype, want_dw, want_hw, device):
    # The manual derivative against autograd of the expert GLU's eager math (ungated: of act(u)); a limit of 3 so
    # that the clamped GLUs' clamps bind on these pre-activations (up to ~6).
    g = torch.Generator().manual_seed(I + K)
    S = T * K
    c, gu = torch.randn(S, I, generator=g).to(device), torch.randn(S, 2 * I if gated else I, generator=g).to(device) * 2
    weights = torch.softmax(torch.randn(T, K, generator=g).to(device), -1)
    order = _permutation(S, I, device=device)
    alpha, limit = 1.702, 3.0

    def eager(c, gu, weights):  # autograd of w_r * <c_r, h(gu_r)> at the tested dtype: (d_gu, dw, w h)
        gu, weights = gu.detach().requires_grad_(), weights.detach().requires_grad_()
        w = weights.reshape(-1)[order].unsqueeze(1)
        h = moe_kernels.expert_glu_math(gu, act, interleaved, alpha, limit, gated)
        d_gu, dw = torch.autograd.grad((w * h * c).sum(), (gu, weights))
        return d_gu, dw.reshape(-1), (h * w).detach()

    d_gu, dw, hw = moe_kernels.glu_backward_weighted(c.to(dtype), gu.to(dtype), weights.to(dtype), order,
                                                     lowering.ACTIVATIONS.get(act, act), want_dw, want_hw,
                                                     interleaved, alpha, limit, gated=gated)
    expected = eager(c.to(dtype), gu.to(dtype), weights.to(dtype))
    reference = eager(c.double(), gu.double(), weights.double())
    assert d_gu.shape == gu.shape
    assert_close("d_gu", d_gu, expected[0], reference[0])
    assert (dw is not None) == want_dw and (hw is not None) == want_hw
    if want_dw:
        assert_close("dw", dw, expected[1], reference[1])
    if want_hw:
        assert_close("hw", hw, expected[2], reference[2])


@pytest.mark.parametrize("passes", [True, False], ids=["torch<=2.13", "torch>=2.14"])
@pytest.mark.parametrize("act", ["swiglu_oai", "silu_clamped"])
def test_clamped_glu_derivative_at_the_bound_follows_the_convention(monkeypatch, act, passes, device):
    # At g == limit and u == +-limit torch.clamp's backward passes the gradient up to torch 2.13 and not from 2.14
    # (lowering/torch_conventions.py); the kernel and its reference follow CLAMP_PASSES_AT_BOUND, both ways here
    # whichever torch runs (the launcher passes it as a constexpr argument: one compiled kernel each).
    monkeypatch.setattr(moe_kernels, "CLAMP_PASSES_AT_BOUND", passes)
    limit = 3.0
    gate = torch.tensor([[limit, limit, 1.0, 1.0]], device=device)
    up = torch.tensor([[1.0, 1.0, limit, -limit]], device=device)
    gu, c = torch.cat([gate, up], 1), torch.ones(1, 4, device=device)
    weights, order = torch.ones(1, 1, device=device), torch.zeros(1, dtype=torch.int64, device=device)
    for backward in (moe_kernels.glu_backward_weighted, moe_kernels.glu_backward_weighted_reference):
        d_gu, _, _ = backward(c, gu, weights, order, act, False, False, False, 1.702, limit)
        d_gate, d_up = d_gu[0, :4], d_gu[0, 4:]
        assert bool((d_gate[:2] != 0).all()) == passes, (backward.__name__, d_gate)  # the gate at its bound
        assert bool((d_up[2:] != 0).all()) == passes, (backward.__name__, d_up)  # the up at +-limit
        assert bool((d_gate[2:] != 0).all() and (d_up[:2] != 0).all())  # inside the bounds: always


def test_the_kernels_run_where_triton_runs(monkeypatch, device):
    # Under the interpreter (or on a GPU) the op must take the kernels, not their PyTorch references.
    from sloth.lowering.backend_choice import use_triton

    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("Triton runs neither on this device nor through the interpreter")

    def refuse(*_args, **_kwargs):
        raise AssertionError("the PyTorch reference ran where the kernel should")

    monkeypatch.setattr(moe_kernels, "combine_reference", refuse)
    monkeypatch.setattr(moe_kernels, "glu_backward_weighted_reference", refuse)
    monkeypatch.setattr(moe_kernels, "expert_glu_forward_reference", refuse)
    monkeypatch.setattr(moe_kernels, "segment_sum_reference", refuse)
    check_against_pattern(make_inputs(13, 24, 20, 5, 2, device=device), torch.float32, "silu")
    masters = list(make_inputs(13, 24, 20, 5, 2, device=device))
    masters[3] = masters[3] * 6
    g = torch.Generator().manual_seed(6)
    check_variant(masters, [torch.randn(5, 40, generator=g).to(device), torch.randn(5, 24, generator=g).to(device)],
                  torch.bfloat16, "swiglu_oai", True)
    # ungated experts with biases: the GATED=False forward (bias written back) and backward
    check_variant(make_inputs(13, 24, 20, 5, 2, gated=False, device=device),
                  [torch.randn(5, 20, generator=g).to(device), torch.randn(5, 24, generator=g).to(device)],
                  torch.bfloat16, "relu2", False, gated=False)


# ---------------------------------------------------------------------------------------------------
# Compilation and torch.library registration
# ---------------------------------------------------------------------------------------------------

def test_compiles_without_graph_break(device):
    # The op is defined before compiling (Dynamo does not trace torch.library's definition machinery).
    register()
    masters = make_inputs(13, 24, 20, 5, 2, device=device)

    def fn(x, index, weights, gate_up, down, act):
        return torch.ops.sloth.moe_experts(x, index, weights, gate_up, down, act)[0] * 2

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    actual = forward_backward(compiled, *masters, "silu")
    expected = forward_backward(fn, *masters, "silu")
    for name, a, b in zip(GRAD_NAMES, actual, expected):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------------
# LoRA on the experts: W_eff = W + s B A per expert, the adapters' products inside the op
# ---------------------------------------------------------------------------------------------------

def make_adapters(E, H, I, r, seed=7, permuted=False, gated=True, device="cpu"):
    """(B1 [E, 2I, r], A1 [E, r, H], B2 [E, H, r], A2 [E, r, I]) fp32 masters, B nonzero so A's gradient is not zero
    (peft starts B at zero); ``permuted``: B as peft's ``reshape(n, r, E).permute(2, 0, 1)`` views; ``gated=False``:
    B1 [E, I, r], the up projection's."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((E, 2 * I if gated else I, r), (E, r, H), (E, H, r), (E, r, I))
    factors = [(torch.randn(shape, generator=g) / shape[-1] ** 0.5).to(device) for shape in shapes]
    if permuted:
        factors = [f.permute(1, 2, 0).contiguous().permute(2, 0, 1) if i % 2 == 0 else f
                   for i, f in enumerate(factors)]
    return factors


def check_lora(masters, adapters, dtype, on=("gate_up", "down"), base_trains=False, scales=(2.0, 0.5), act="silu",
               biases=(None, None), interleaved=False, **options):
    """Forward and every gradient (x, router weights, each given adapter factor and, when ``base_trains``, the
    expert weights) of the op against the pattern (the adapters merged by baddbmm, as peft does) at ``dtype`` and
    in float64; ``biases`` (frozen) and ``interleaved`` as the op takes them; ``options`` passed to both
    (``gated=False``)."""
    x, index, weights, gate_up, down, dout = masters

    def run(fn, cast):
        x_, w_ = (cast(t).requires_grad_() for t in (x, weights))
        gu_, d_ = (cast(t).requires_grad_(base_trains) for t in (gate_up, down))
        factors = [cast(t).requires_grad_() if (i < 2 and "gate_up" in on) or (i >= 2 and "down" in on) else None
                   for i, t in enumerate(adapters)]
        b1, b2 = (cast(b) if b is not None else None for b in biases)
        out = fn(x_, index, w_, gu_, d_, act, b1, b2, interleaved, 1.702, 7.0, *factors, *scales, **options)
        wrt = [x_, w_, *([gu_, d_] if base_trains else []), *(f for f in factors if f is not None)]
        return [out.detach(), *torch.autograd.grad(out, wrt, cast(dout))]

    # the factors' views kept: .to() of a permuted view keeps its strides
    actual = run(moe_experts, lambda t: t.detach().to(dtype))
    eager = run(moe_experts_pattern, lambda t: t.detach().to(dtype))
    reference = run(moe_experts_pattern, lambda t: t.detach().to(dtype).double())
    names = ["out", "dx", "d_top_k_weights", *(["d_gate_up_proj", "d_down_proj"] if base_trains else []),
             *(n for part in on for n in (f"d_{part}_lora_b", f"d_{part}_lora_a"))]
    for name, a, e, r in zip(names, actual, eager, reference, strict=True):
        assert_close(name, a, e, r)
    return actual


LORA_CASES = {  # id -> (T, H, I, E, K, r, unused experts)
    "T13-H24-I20-E5-K2-r3-expert3-empty": (13, 24, 20, 5, 2, 3, (3,)),
    "T17-H32-I16-E4-K2-r8-aligned": (17, 32, 16, 4, 2, 8, ()),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(LORA_CASES))
@pytest.mark.parametrize("on", [("gate_up", "down"), ("gate_up",), ("down",)], ids=["both", "gate_up", "down"])
def test_lora_on_experts_matches_merged_weights(on, case, dtype, device):
    T, H, I, E, K, r, unused = LORA_CASES[case]
    grads = check_lora(make_inputs(T, H, I, E, K, unused_experts=unused, device=device),
                       make_adapters(E, H, I, r, device=device), dtype, on)
    for grad in grads[3:]:
        assert grad.abs().max() > 0  # every adapter factor trains
        for e in unused:  # an expert with no token: an exactly zero adapter gradient
            assert not grad[e].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_on_experts_with_training_base_and_peft_views(dtype, device):
    # The expert weights training beside their adapters, and the B factors as the permuted views peft hands.
    masters = make_inputs(13, 24, 20, 5, 2, device=device)
    check_lora(masters, make_adapters(5, 24, 20, 4, permuted=True, device=device), dtype, base_trains=True)


def _recorded_forward_backward(*args):
    """The aten calls of the op's own forward and backward functions (lowering.moe_experts_forward /
    moe_experts_backward; a dispatch mode does not see inside the registered custom op), every gradient asked
    for: a list of (op name, outputs)."""
    x, index, weights, gate_up, down, act, *rest = args
    rest = (*rest, *lowering._DEFAULTS[len(rest):])
    b1, b2, interleaved, alpha, limit, lb1, la1, lb2, la2, s1, s2, gated, _recompute_gu = rest
    with RecordOps() as rec:
        out, gu, order, offs = lowering.moe_experts_forward(*args)
        lowering.moe_experts_backward(torch.ones_like(out), x, index, weights, gate_up, down, gu, order, offs, act,
                                      True, True, True, True, b1, b2, interleaved, alpha, limit, b1 is not None,
                                      b2 is not None, lb1, la1, lb2, la2, s1, s2, lb1 is not None, lb2 is not None,
                                      gated)
    return [(str(func), out if isinstance(out, (tuple, list)) else (out,)) for func, _, out in rec.calls]


@pytest.mark.parametrize("backend", ["plan", "grouped_mm", "mixed", "triton", "reference"])
def test_lora_on_experts_forms_no_merged_weight(monkeypatch, backend, device):
    # Nothing of the expert stack's shape [E, n, k] (either stack, either layout) is formed in the forward or the
    # backward but the expert weights' own gradients (asked for here), whichever backend runs the GEMMs ("plan": this
    # device's): peft's merged weight and its gradient are what the adapters' products inside the op avoid. Counted
    # as storages: a tensor filled in place or viewed (the reference's [E, k*n] sum viewed as [E, k, n]) is the one
    # storage it was formed in, and views of the weights themselves form nothing.
    if backend != "plan":
        skip_unless_runs(backend, torch.float32, device)
        monkeypatch.setattr(lowering, "_grouped_mm_plan", lambda *args, b=backend: b)
    x, index, weights, gate_up, down, _ = make_inputs(13, 32, 16, 4, 2, device=device)
    calls = _recorded_forward_backward(x, index, weights, gate_up, down, "silu", None, None, False, 1.702, 7.0,
                                       *make_adapters(4, 32, 16, 8, device=device), 2.0, 0.5)
    stacks = {(4, 32, 32), (4, 32, 16), (4, 16, 32)}
    given = {w.untyped_storage().data_ptr() for w in (gate_up, down)}
    made: dict[int, list] = {}  # every output stays alive in `calls`: no address is reused while recorded
    for name, outs in calls:
        for o in outs:
            if isinstance(o, torch.Tensor) and tuple(o.shape) in stacks and o.untyped_storage().data_ptr() not in given:
                made.setdefault(o.untyped_storage().data_ptr(), []).append((name, tuple(o.shape)))
    assert len(made) == 2, made  # d gate_up_proj and d down_proj, which the call asked for
    assert calls and not any(name.startswith("sloth.") for name, _ in calls)  # the op's inner calls, not the op


def test_opcheck_lora(device):
    register()
    x, index, weights, gate_up, down, _ = make_inputs(13, 24, 20, 5, 2, unused_experts=(2,), device=device)
    b1, a1, b2, a2 = (t.requires_grad_(True) for t in make_adapters(5, 24, 20, 3, permuted=True, device=device))
    args = (x.requires_grad_(True), index, weights.requires_grad_(True), gate_up, down, "silu", None, None, False,
            1.702, 7.0, b1, a1, b2, a2, 2.0, 0.5)
    torch.library.opcheck(torch.ops.sloth.moe_experts.default, args)


def test_opcheck(device):
    register()
    x, index, weights, gate_up, down, _ = make_inputs(13, 24, 20, 5, 2, unused_experts=(2,), device=device)
    args = (x.requires_grad_(True), index, weights.requires_grad_(True), gate_up.requires_grad_(True),
            down.requires_grad_(True), "gelu_tanh")
    torch.library.opcheck(torch.ops.sloth.moe_experts.default, args)


def test_opcheck_backward(device):
    register()
    x, index, weights, gate_up, down, dout = make_inputs(13, 24, 20, 5, 2, device=device)
    _, gu, order, offs = torch.ops.sloth.moe_experts(x, index, weights, gate_up, down, "gelu")
    for flags in ((True, True, True, True), (True, False, False, True)):
        torch.library.opcheck(torch.ops.sloth.moe_experts_backward.default,
                              (dout, x, index, weights, gate_up, down, gu, order, offs, "gelu", *flags))


def _gpt_oss_inputs(T=13, H=24, I=20, E=5, K=2, device="cpu"):
    """GPT-OSS's layout: weights stored [E, H, 2I] / [E, I, H] and passed as transposed views, with biases; expert 2
    gets no token."""
    x, index, weights, gate_up, down, dout = make_inputs(T, H, I, E, K, unused_experts=(2,), device=device)
    gate_up_t = (gate_up * 6).transpose(1, 2).contiguous().requires_grad_(True)
    down_t = down.transpose(1, 2).contiguous().requires_grad_(True)
    g = torch.Generator().manual_seed(4)
    biases = (torch.randn(E, 2 * I, generator=g).to(device).requires_grad_(True),
              torch.randn(E, H, generator=g).to(device).requires_grad_(True))
    return x, index, weights, gate_up_t, down_t, biases, dout


def test_opcheck_gpt_oss_layout(device):
    # The transposed views' weight gradients come back in the stored layout: fake and real strides must agree.
    register()
    x, index, weights, gate_up_t, down_t, (b1, b2), _ = _gpt_oss_inputs(device=device)
    args = (x.requires_grad_(True), index, weights.requires_grad_(True), gate_up_t.transpose(1, 2),
            down_t.transpose(1, 2), "swiglu_oai", b1, b2, True, 1.702, 7.0)
    torch.library.opcheck(torch.ops.sloth.moe_experts.default, args)


def test_gpt_oss_layout_weight_gradients_need_no_copy(device):
    register()
    x, index, weights, gate_up_t, down_t, (b1, b2), dout = _gpt_oss_inputs(device=device)
    _, gu, order, offs = torch.ops.sloth.moe_experts(x, index, weights, gate_up_t.transpose(1, 2),
                                                     down_t.transpose(1, 2), "swiglu_oai", b1, b2, True, 1.702, 7.0)
    grads = torch.ops.sloth.moe_experts_backward(dout, x, index, weights, gate_up_t.transpose(1, 2),
                                                 down_t.transpose(1, 2), gu, order, offs, "swiglu_oai", True, True,
                                                 True, True, b1, b2, True, 1.702, 7.0, True, True)
    d_gate_up, d_down = grads[2], grads[3]
    assert d_gate_up.transpose(1, 2).is_contiguous() and d_down.transpose(1, 2).is_contiguous()
    out = moe_experts(x, index, weights, gate_up_t.transpose(1, 2), down_t.transpose(1, 2), "swiglu_oai", b1, b2,
                      True, 1.702, 7.0)
    out.backward(dout)
    assert gate_up_t.grad.is_contiguous() and down_t.grad.is_contiguous()
    torch.testing.assert_close(gate_up_t.grad, d_gate_up.transpose(1, 2))


def test_fake_shapes_on_meta():
    register()
    x, index, weights, gate_up, down, _ = (t.to("meta") for t in make_inputs(13, 24, 20, 5, 3))
    out, gu, order, offs = torch.ops.sloth.moe_experts(x, index, weights, gate_up.bfloat16().float(), down, "silu")
    assert out.shape == (13, 24) and out.dtype == x.dtype and gu.shape == (39, 40)
    assert order.shape == (39,) and offs.shape == (5,) and offs.dtype == torch.int32


def test_fake_shapes_on_meta_ungated():
    register()
    x, index, weights, up, down, _ = (t.to("meta") for t in make_inputs(13, 24, 20, 5, 3, gated=False))
    out, u, order, offs = torch.ops.sloth.moe_experts(x, index, weights, up, down, "relu2", None, None, False, 1.702,
                                                      7.0, None, None, None, None, 1.0, 1.0, False)
    assert out.shape == (13, 24) and u.shape == (39, 20) and order.shape == (39,) and offs.shape == (5,)


def test_register_is_idempotent():
    register()
    register()
    assert hasattr(torch.ops.sloth, "moe_experts") and hasattr(torch.ops.sloth, "moe_experts_backward")


# ---------------------------------------------------------------------------------------------------
# Input errors
# ---------------------------------------------------------------------------------------------------

def _args(**changes):
    x, index, weights, gate_up, down, _ = make_inputs(4, 8, 6, 3, 2)
    args = dict(x=x, top_k_index=index, top_k_weights=weights, gate_up_proj=gate_up, down_proj=down, act="silu")
    args.update({k: (v(args[k]) if callable(v) else v) for k, v in changes.items()})
    return args


BAD_INPUTS = [
    pytest.param(dict(act="relu"), ValueError, r"act must be one of .*'silu'.*got 'relu'", id="act-relu"),
    pytest.param(dict(act="relu2"), ValueError, r"got 'relu2' \(an activation of ungated experts: gated=False\)",
                 id="act-relu2-gated"),
    pytest.param(dict(act="swiglu_oai", gated=False, gate_up_proj=lambda t: t[:, :6]), ValueError,
                 r"act of ungated experts \(gated=False\) must be one of .*'relu2'.*got 'swiglu_oai'",
                 id="ungated-act-swiglu_oai"),
    pytest.param(dict(gated=False, interleaved=True, gate_up_proj=lambda t: t[:, :6]), ValueError,
                 r"interleaved gate/up needs gated experts", id="ungated-interleaved"),
    # a gated [E, 2I, H] weight handed to the ungated op: its I is read as 2I, which down_proj refutes
    pytest.param(dict(gated=False), ValueError, r"down_proj must be \[E, H, I\] = \(3, 8, 12\)",
                 id="ungated-given-gated-weight"),
    pytest.param(dict(gated=False, gate_up_proj=lambda t: t[:, :6, :7]), ValueError,
                 r"gate_up_proj must be \[E, I \(ungated: the up projection\), H\] with H = 8", id="ungated-wrong-H"),
    pytest.param(dict(gated=False, gate_up_proj=lambda t: t[:, :6], gate_up_bias=torch.zeros(3, 12)), ValueError,
                 r"gate_up_bias must be \[3, 6\], got \(3, 12\)", id="ungated-bias-shape"),
    pytest.param(dict(x=lambda t: t[None]), ValueError, r"x must be \[T, H\], got shape \(1, 4, 8\)", id="x-3d"),
    pytest.param(dict(x=lambda t: t.double()), TypeError, r"x must be .*float64", id="x-float64"),
    pytest.param(dict(top_k_index=lambda t: t.float()), TypeError, r"top_k_index must be int32 or int64",
                 id="index-float"),
    pytest.param(dict(top_k_index=lambda t: t[:3]), ValueError, r"top_k_index must be \[T, K\] with T = 4",
                 id="index-wrong-T"),
    pytest.param(dict(top_k_weights=lambda t: t[:, :1]), ValueError, r"top_k_weights must have top_k_index's shape",
                 id="weights-wrong-K"),
    pytest.param(dict(gate_up_proj=lambda t: t[:, :, :7]), ValueError, r"gate_up_proj must be \[E, 2I, H\] with H = 8",
                 id="gate-up-wrong-H"),
    pytest.param(dict(gate_up_proj=lambda t: t[:, :11]), ValueError, r"gate_up_proj must be \[E, 2I, H\]",
                 id="gate-up-odd-2I"),
    pytest.param(dict(down_proj=lambda t: t[:2]), ValueError, r"down_proj must be \[E, H, I\] = \(3, 8, 6\)",
                 id="down-wrong-E"),
    pytest.param(dict(down_proj=lambda t: t[..., :5]), ValueError, r"down_proj must be \[E, H, I\]", id="down-wrong-I"),
    pytest.param(dict(down_proj=lambda t: t.bfloat16()), TypeError, r"down_proj must have x's dtype", id="down-bf16"),
    pytest.param(dict(gate_up_bias=torch.zeros(3, 11)), ValueError, r"gate_up_bias must be \[3, 12\], got \(3, 11\)",
                 id="gate-up-bias-shape"),
    pytest.param(dict(down_bias=torch.zeros(3, 8, dtype=torch.bfloat16)), TypeError,
                 r"down_bias must have x's dtype", id="down-bias-bf16"),
    pytest.param(dict(gate_up_lora_b=torch.zeros(3, 12, 2)), ValueError,
                 r"gate_up_lora_b and gate_up_lora_a must be given together", id="lora-a-missing"),
    pytest.param(dict(down_lora_b=torch.zeros(3, 6, 2), down_lora_a=torch.zeros(3, 2, 6)), ValueError,
                 r"down_lora_b must be \[E, n, r\] with \(E, n\) = \(3, 8\)", id="lora-b-wrong-n"),
    pytest.param(dict(gate_up_lora_b=torch.zeros(3, 12, 2), gate_up_lora_a=torch.zeros(3, 3, 8)), ValueError,
                 r"gate_up_lora_a must be \[E, r, k\] = \(3, 2, 8\)", id="lora-a-wrong-r"),
    pytest.param(dict(gate_up_lora_b=torch.zeros(3, 12, 2, dtype=torch.bfloat16), gate_up_lora_a=torch.zeros(3, 2, 8)),
                 TypeError, r"gate_up_lora_b must have x's dtype", id="lora-b-bf16"),
]


@pytest.mark.parametrize("changes,error,message", BAD_INPUTS)
def test_input_errors_name_the_problem(changes, error, message):
    with pytest.raises(error, match=message):
        moe_experts(**_args(**changes))


def _op_grads(masters, dtype, extra, trains, **options):
    """The op's output and the gradients of every float input that ``trains`` names (x, router weights, expert
    weights, biases, factors), with ``extra`` (the arguments after ``act``) and ``options``."""
    x, index, weights, gate_up, down, dout = masters
    x_, w_, gu_, d_ = (t.to(dtype).requires_grad_(name in trains) for t, name in
                       zip((x, weights, gate_up, down), ("x", "w", "experts", "experts")))
    extra = [t.to(dtype).requires_grad_() if isinstance(t, torch.Tensor) else t for t in extra]
    out = moe_experts(x_, index, w_, gu_, d_, *extra, **options)
    wrt = [t for t in (x_, w_, gu_, d_, *extra) if isinstance(t, torch.Tensor) and t.requires_grad]
    return [out.detach(), *torch.autograd.grad(out, wrt, dout.to(dtype))]


RECOMPUTE_CASES = {  # id -> (make the arguments after act from E, H, I; what trains; gated)
    "qwen3-frozen": (lambda E, H, I: ["silu"], ("x", "w"), True),
    "experts-train": (lambda E, H, I: ["gelu_tanh"], ("x", "w", "experts"), True),
    "gpt-oss-biases": (lambda E, H, I: ["swiglu_oai", torch.randn(E, 2 * I), torch.randn(E, H), True],
                       ("x", "w", "experts"), True),
    "lora-both": (lambda E, H, I: ["silu", None, None, False, 1.702, 7.0, *make_adapters(E, H, I, 4), 2.0, 0.5],
                  ("x", "w"), True),
    "ungated-relu2-bias-lora": (lambda E, H, I: ["relu2", torch.randn(E, I), None, False, 1.702, 7.0,
                                                 *make_adapters(E, H, I, 4, gated=False), 2.0, 0.5],
                                ("x", "w"), False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(RECOMPUTE_CASES))
def test_recompute_gu_gives_the_same_bits_and_keeps_no_gu(case, dtype, device):
    # moe_recompute: the backward forms gu again with the forward's own calls, so every output and gradient is
    # the one the kept gu gives, bit for bit; and the forward returns an empty gu, so nothing of it is saved.
    make_extra, trains, gated = RECOMPUTE_CASES[case]
    T, H, I, E, K = 13, 24, 20, 5, 2
    masters = make_inputs(T, H, I, E, K, unused_experts=(3,), gated=gated, device=device)
    torch.manual_seed(0)
    extra = [t.to(device) if isinstance(t, torch.Tensor) else t for t in make_extra(E, H, I)]
    kept = _op_grads(masters, dtype, extra, trains, gated=gated)
    recomputed = _op_grads(masters, dtype, extra, trains, gated=gated, recompute_gu=True)
    assert len(kept) == len(recomputed) >= 3
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    x, index, weights, gate_up, down, _ = (t.to(dtype) if t.is_floating_point() else t for t in masters)
    args = [t.to(dtype) if isinstance(t, torch.Tensor) else t for t in extra]
    with torch.no_grad():
        _, gu, order, _ = torch.ops.sloth.moe_experts(x, index, weights, gate_up, down, *args,
                                                      *lowering._DEFAULTS[len(args) - 1:-2], gated, True)
    assert gu.shape == (0, gate_up.shape[1]) and order.shape == (T * K,)
