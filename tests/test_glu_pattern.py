"""The gated-MLP family pass (``"glu"``): what it matches (exact counts), what it must refuse, and that the
compiled result equals eager under the tolerance rule (tests/tolerance.py), forward and every gradient.

Every case compiles with ``torch.compile(fn, backend="sloth", options={"inner": ...})`` and reads
``sloth.last_report()``. "eager" is the same function run uncompiled at the tested dtype; the reference is
the same function in float64 (the functions here have no fp32 upcasts, so float64 inputs stay float64).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers.activations import ACT2FN

import sloth
from sloth.compiler.canonicalize import gelu
from tolerance import assert_close
from pattern_checks import counting_backend, forward_backward, graph_of, line_of, params_of, seeded

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
N = 48  # the inner (intermediate) size of most cases


def _tensor(shape, dtype, ref: bool, *, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Seeded values rounded to ``dtype``; for the reference, those same values in float64."""
    v = (torch.randn(shape, generator=seeded(seed)) * scale).to(dtype)
    return v.double() if ref else v


# ---------------------------------------------------------------------------------------------------
# The functions and modules under test (user code: the report points at these lines)
# ---------------------------------------------------------------------------------------------------

def swiglu(g, u):
    return F.silu(g) * u


def swiglu_up_first(g, u):
    return u * F.silu(g)


def swiglu_sigmoid(g, u):
    return g * torch.sigmoid(g) * u


def swiglu_sigmoid_method_first(g, u):
    return g.sigmoid() * g * u


def swiglu_act2fn(g, u):
    return ACT2FN["silu"](g) * u


def geglu_tanh(g, u):
    return F.gelu(g, approximate="tanh") * u


def geglu_tanh_act2fn(g, u):
    return ACT2FN["gelu_pytorch_tanh"](g) * u


def geglu_tanh_formula(g, u):
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * u


def geglu_gelu_new(g, u):
    return ACT2FN["gelu_new"](g) * u  # HF's NewGELU: the formula with torch.pow(x, 3.0)


def geglu_gelu_fast(g, u):
    return ACT2FN["gelu_fast"](g) * u  # HF's FastGELU: x * 0.7978845608 * (1 + 0.044715 * x * x)


def geglu_erf(g, u):
    return F.gelu(g) * u


def geglu_erf_act2fn(g, u):
    return ACT2FN["gelu"](g) * u


def geglu_erf_formula(g, u):
    return g * 0.5 * (1.0 + torch.erf(g / math.sqrt(2.0))) * u


def swiglu_self_gated(g):
    return F.silu(g) * g  # up is the gate itself: still act(gate) * up


def merged_chunk(m):
    gate, up = m.chunk(2, dim=-1)  # Phi3
    return up * F.silu(gate)


def merged_torch_chunk(m):
    gate, up = torch.chunk(m, 2, -1)
    return F.gelu(gate, approximate="tanh") * up


def merged_slices(m):
    n = m.shape[-1] // 2
    return F.silu(m[..., :n]) * m[..., n:]


def merged_split(m):
    gate, up = m.split(m.shape[-1] // 2, dim=-1)
    return F.gelu(gate) * up


def merged_gate_second(m):
    up, gate = m.chunk(2, dim=-1)
    return F.silu(gate) * up


def two_glus(g, u):
    return swiglu(g, u) + geglu_tanh(u, g)


def checkpointed(g, u):
    return torch.utils.checkpoint.checkpoint(swiglu, g, u, use_reentrant=False) * 2


class GatedMLP(nn.Module):
    """Llama/Gemma-style MLP: gate and up from separate projections."""

    def __init__(self, hidden: int, inner: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = ACT2FN[act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MergedMLP(nn.Module):
    """Phi3-style MLP: one gate_up projection, split by chunk."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.activation_fn = nn.SiLU()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class SiLUGate(nn.Module):
    """``nn.SiLU()`` as a module, gate and up from one biased Linear each."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate, self.up, self.act = nn.Linear(hidden, inner), nn.Linear(hidden, inner), nn.SiLU()

    def forward(self, x):
        return self.act(self.gate(x)) * self.up(x)


class Stack(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.mlps = nn.ModuleList([GatedMLP(hidden, inner), MergedMLP(hidden, inner), GatedMLP(hidden, inner, "gelu")])

    def forward(self, x):
        for mlp in self.mlps:
            x = x + mlp(x)
        return x


# ---------------------------------------------------------------------------------------------------
# Case plumbing: make(dtype, ref) -> (callable, args); params of a module get gradients too
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    id: str
    make: Callable[[torch.dtype, bool], tuple[Callable, list[torch.Tensor]]]
    count: Optional[int]  # None: either way is right, only the values are checked
    reason: Optional[str] = None  # for near-misses: a word the rejection must contain (None: no rejection needed)
    detail: Optional[str] = None  # for matches: a word the site's detail must contain


def fn_case(id: str, fn: Callable, shapes=((3, N), (3, N)), *, count: int = 1, reason: Optional[str] = None,
            detail: Optional[str] = None, reference: Optional[Callable] = None) -> Case:
    """``reference``: the same math for the float64 run, where ``fn`` cannot run in float64 as written."""
    def make(dtype, ref):
        # Gates spread over [-4, 4] or so, where the activations bend.
        args = [_tensor(s, dtype, ref, scale=2.0 if i == 0 else 1.0, seed=1 + i) for i, s in enumerate(shapes)]
        return (reference or fn) if ref else fn, args
    return Case(id, make, count, reason, detail)


def module_case(id: str, factory: Callable[[], nn.Module], shape=(2, 3, 32), *, count: int = 1,
                detail: Optional[str] = None) -> Case:
    def make(dtype, ref):
        torch.manual_seed(0)
        module = factory().to(dtype)
        if ref:
            module = module.double()
        return module, [_tensor(shape, dtype, ref, seed=1)]
    return Case(id, make, count, detail=detail)


def check_case(case: Case, dtype: torch.dtype, inner: str = "eager", **compile_kwargs) -> sloth.Report:
    """Compile, check the count (and rejection), and compare output and gradients with eager."""
    fn, args = case.make(dtype, False)
    eager = forward_backward(fn, args, params_of(fn))
    fn, args = case.make(dtype, True)
    reference = forward_backward(fn, args, params_of(fn), dy_dtype=eager[0].dtype)
    fn, args = case.make(dtype, False)
    compiled = torch.compile(fn, backend="sloth", options={"inner": inner}, **{"fullgraph": True, **compile_kwargs})
    actual = forward_backward(compiled, args, params_of(fn))
    report = sloth.last_report()
    assert report is not None
    if case.count is not None:
        assert report.counts.get("glu", 0) == case.count, str(report)
    if case.reason is not None:
        reasons = [r.reason for r in report.rejections if r.family == "glu"]
        assert any(case.reason in r for r in reasons), f"no rejection mentioning {case.reason!r}: {reasons}"
    if case.detail is not None:
        details = [s.detail for s in report.sites if s.family == "glu"]
        assert all(case.detail in d for d in details), details
    names = ["out"] + [f"grad[{i}]" for i in range(len(actual) - 1)]
    assert len(actual) == len(eager) == len(reference)
    for name, a, e, r in zip(names, actual, eager, reference):
        assert_close(f"{case.id}-{str(dtype)[6:]}: {name}", a, e, r)
    return report


# ---------------------------------------------------------------------------------------------------
# Matches: exact counts, output and gradients equal to eager
# ---------------------------------------------------------------------------------------------------

MERGED = ((3, 2 * N),)

# A gated MLP's up side as function arguments: x [3, 32] and the gate and up weights [N, 32] (their gradients are
# compared too). ReLU and sigmoid products are fused only when gate and up are two projections of one input.
PROJECTED = ((3, 32), (N, 32), (N, 32))
PROJECTED_MERGED = ((2, 3, 32), (2 * N, 32))


def projected(spelling: Callable) -> Callable:
    """``spelling(gate, up)`` on two projections of one input: ``x, w_gate, w_up -> spelling(x @ w_g.T, x @ w_u.T)``."""
    def mlp(x, w_gate, w_up):
        # Weights scaled so that the gate spreads over [-6, 6] or so, where the activations bend.
        return spelling(F.linear(x, w_gate * 0.25), F.linear(x, w_up * 0.25))
    mlp.__name__ = f"projected_{spelling.__name__}"
    return mlp


def merged_projected(spelling: Callable) -> Callable:
    """``spelling(gate, up)`` on the halves of one merged projection ``x @ w_gate_up.T`` (chunk)."""
    def mlp(x, w_gate_up):
        return spelling(*F.linear(x, w_gate_up * 0.25).chunk(2, dim=-1))
    mlp.__name__ = f"merged_{spelling.__name__}"
    return mlp


def reglu(g, u):
    return F.relu(g) * u


def reglu_torch(g, u):
    return u * torch.relu(g)


def reglu_method(g, u):
    return g.relu() * u


def relu2_glu(g, u):
    return torch.square(F.relu(g)) * u  # transformers' ReLUSquaredActivation


def relu2_pow(g, u):
    return F.relu(g) ** 2 * u


def relu2_pow_method(g, u):
    return u * torch.relu(g).pow(2)


def sigmoid_glu(g, u):
    return torch.sigmoid(g) * u


def sigmoid_glu_method(g, u):
    return u * g.sigmoid()


def sigmoid_glu_functional(g, u):
    return F.sigmoid(g) * u


def swish_through_casts(g, u):
    return (g.float() * torch.sigmoid(g.float())).to(g.dtype) * u  # two casts of g: one value


def swish_sigmoid_of_cast(g, u):
    return (torch.sigmoid(g.float()) * g).to(u.dtype) * u  # g on one side, its upcast on the other


def swish_functional_sigmoid(g, u):
    return g * F.sigmoid(g) * u


def swish_wide_product(g, u):
    return (g.float() * torch.sigmoid(g)).to(g.dtype) * u  # only the product in fp32: one rounding fewer fused


def silu_round_trip(g, u):
    return F.silu(g.float()).to(g.dtype) * u  # the op computes in fp32 and rounds once anyway


def swish_cast_product(g, u):
    return (g.float() * g.float().sigmoid() * u.float()).to(g.dtype)  # the whole product in fp32


class ActMLP(nn.Module):
    """A gated MLP whose activation is a module, as transformers' ``ACT2FN[name]`` or ``nn.ReLU()`` give it."""

    def __init__(self, hidden: int, inner: int, act: nn.Module):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

MATCHES = [
    fn_case("F.silu", swiglu, detail="silu, separate"),
    fn_case("F.silu-up-first", swiglu_up_first),
    module_case("nn.SiLU", lambda: SiLUGate(32, N), detail="silu"),
    fn_case("x-times-sigmoid-x", swiglu_sigmoid, detail="silu"),
    fn_case("sigmoid-method-times-x", swiglu_sigmoid_method_first, detail="silu"),
    fn_case("ACT2FN-silu", swiglu_act2fn, detail="silu"),
    fn_case("gelu-tanh", geglu_tanh, detail="gelu_tanh"),
    fn_case("ACT2FN-gelu_pytorch_tanh", geglu_tanh_act2fn, detail="gelu_tanh"),
    fn_case("gelu-tanh-formula", geglu_tanh_formula, detail="gelu_tanh"),
    fn_case("ACT2FN-gelu_new", geglu_gelu_new, detail="gelu_tanh"),
    fn_case("ACT2FN-gelu_fast", geglu_gelu_fast, detail="gelu_tanh"),
    fn_case("gelu-erf", geglu_erf, detail="gelu_erf"),
    fn_case("ACT2FN-gelu", geglu_erf_act2fn, detail="gelu_erf"),
    fn_case("gelu-erf-formula", geglu_erf_formula, detail="gelu_erf"),
    fn_case("gate-is-up", swiglu_self_gated, shapes=((3, N),)),
    fn_case("3d", swiglu, shapes=((2, 5, 100), (2, 5, 100))),
    fn_case("merged-chunk", merged_chunk, shapes=MERGED, detail="merged gate_up"),
    fn_case("merged-torch.chunk", merged_torch_chunk, shapes=MERGED, detail="merged gate_up"),
    fn_case("merged-slices", merged_slices, shapes=((2, 3, 2 * N),), detail="merged gate_up"),
    fn_case("merged-split", merged_split, shapes=MERGED, detail="merged gate_up"),
    fn_case("merged-gate-second", merged_gate_second, shapes=MERGED, detail="separate gate and up, gate second"),
    fn_case("two-glus", two_glus, count=2),
    # The checkpoint's recompute runs in the autograd engine; the float64 run does without it (same values).
    fn_case("checkpointed", checkpointed, reference=lambda g, u: swiglu(g, u) * 2),
    module_case("llama-mlp", lambda: GatedMLP(32, N), detail="silu, separate"),
    module_case("gemma-mlp", lambda: GatedMLP(32, N, "gelu_pytorch_tanh"), detail="gelu_tanh"),
    module_case("phi3-mlp", lambda: MergedMLP(32, N), detail="silu, merged gate_up"),
    module_case("three-mlps", lambda: Stack(32, N), count=3),
    # ReLU, ReLU^2 and sigmoid gates: on two projections of one input, in every spelling
    fn_case("relu", projected(reglu), PROJECTED, detail="relu, separate"),
    fn_case("torch.relu-up-first", projected(reglu_torch), PROJECTED, detail="relu, separate"),
    fn_case("relu-method", projected(reglu_method), PROJECTED, detail="relu, separate"),
    fn_case("relu-merged", merged_projected(reglu), PROJECTED_MERGED, detail="relu, merged gate_up"),
    module_case("nn.ReLU", lambda: ActMLP(32, N, nn.ReLU()), detail="relu, separate"),
    module_case("ACT2FN-relu", lambda: GatedMLP(32, N, "relu"), detail="relu, separate"),
    fn_case("relu2-square", projected(relu2_glu), PROJECTED, detail="relu2, separate"),
    fn_case("relu2-pow", projected(relu2_pow), PROJECTED, detail="relu2, separate"),
    fn_case("relu2-pow-method-up-first", projected(relu2_pow_method), PROJECTED, detail="relu2, separate"),
    fn_case("relu2-merged", merged_projected(relu2_glu), PROJECTED_MERGED, detail="relu2, merged gate_up"),
    module_case("ACT2FN-relu2", lambda: GatedMLP(32, N, "relu2"), detail="relu2, separate"),
    fn_case("sigmoid", projected(sigmoid_glu), PROJECTED, detail="sigmoid, separate"),
    fn_case("sigmoid-method-up-first", projected(sigmoid_glu_method), PROJECTED, detail="sigmoid, separate"),
    fn_case("F.sigmoid", projected(sigmoid_glu_functional), PROJECTED, detail="sigmoid, separate"),
    fn_case("sigmoid-merged", merged_projected(sigmoid_glu), PROJECTED_MERGED, detail="sigmoid, merged gate_up"),
    module_case("ACT2FN-sigmoid", lambda: GatedMLP(32, N, "sigmoid"), detail="sigmoid, separate"),
    # SiLU written out through casts (the float64 reference runs the same math without them)
    fn_case("swish-through-casts", swish_through_casts, detail="silu", reference=swiglu),
    fn_case("swish-sigmoid-of-cast", swish_sigmoid_of_cast, detail="silu", reference=swiglu),
    fn_case("swish-F.sigmoid", swish_functional_sigmoid, detail="silu"),
    fn_case("swish-wide-product", swish_wide_product, detail="silu", reference=swiglu),
    fn_case("silu-round-trip", silu_round_trip, detail="silu", reference=swiglu),
    fn_case("swish-cast-product", swish_cast_product, detail="silu", reference=swiglu),
    fn_case("swish-through-casts-merged", merged_projected(swish_through_casts), PROJECTED_MERGED,
            detail="silu, merged gate_up", reference=merged_projected(swiglu)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MATCHES, ids=[c.id for c in MATCHES])
def test_match(case, dtype):
    report = check_case(case, dtype)
    assert not [r for r in report.rejections if r.family == "glu"], str(report)


GRAD_CASES = ["F.silu", "gelu-tanh", "gelu-erf", "merged-chunk", "merged-gate-second", "gate-is-up", "phi3-mlp",
              "three-mlps", "checkpointed", "relu", "relu2-merged", "ACT2FN-relu2", "sigmoid", "swish-through-casts"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [c for c in MATCHES if c.id in GRAD_CASES],
                         ids=[c.id for c in MATCHES if c.id in GRAD_CASES])
def test_match_aot_eager(case, dtype):
    check_case(case, dtype, inner="aot_eager")


def test_match_inductor():
    check_case(next(c for c in MATCHES if c.id == "three-mlps"), torch.bfloat16, inner="inductor")


def test_the_fused_op_is_in_the_graph():
    gm = graph_of(merged_chunk, torch.randn(3, 2 * N, dtype=torch.bfloat16))
    (fused,) = [n for n in gm.graph.nodes if n.target is torch.ops.sloth.glu.default]
    m, up, activation = fused.args
    assert m.op == "placeholder" and up is None and activation == "silu"
    assert not [n for n in gm.graph.nodes if n.target in (F.silu, torch.narrow, torch.mul, "chunk")], gm.graph

    gm = graph_of(geglu_tanh_formula, torch.randn(3, N), torch.randn(3, N))
    (fused,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert fused.target is torch.ops.sloth.glu.default and fused.args[2] == "gelu_tanh"
    assert [a.op for a in fused.args[:2]] == ["placeholder", "placeholder"]


# ---------------------------------------------------------------------------------------------------
# Near-misses: must not match, must say why (where there is a gated shape), must not crash
# ---------------------------------------------------------------------------------------------------

def relu_gate(g, u):
    return F.relu(g) * u


def silu_plus_up(g, u):
    return F.silu(g) + u


def silu_times_constant(g, u):
    return F.silu(g) * 2.0 + u


def activation_reused(g, u):
    a = F.silu(g)
    return a * u + a


def broadcast_up(g, w):
    return F.silu(g) * w  # w is [n]: a scale, not an up projection


def interleaved(m):
    return F.silu(m[..., ::2]) * m[..., 1::2]  # GPT-OSS-style interleaved gate/up


def swish_beta(g, u):
    return g * torch.sigmoid(1.5 * g) * u  # Swish-beta is not SiLU


def gelu_formula_wrong_constant(g, u):
    return 0.5 * g * (1 + torch.tanh(0.79 * (g + 0.044715 * g ** 3))) * u


def silu_in_place(g, u):
    return F.silu(g * 1.0, inplace=True) * u


def quick_gelu(g, u):
    return g * torch.sigmoid(1.702 * g) * u


NEAR_MISSES = [
    fn_case("relu", relu_gate),  # relu times a tensor that is no projection: no gated product, nothing to report
    fn_case("silu-plus-up", silu_plus_up),
    fn_case("silu-times-constant", silu_times_constant),
    fn_case("activation-reused", activation_reused, reason="other users"),
    fn_case("broadcast-up", broadcast_up, shapes=((3, N), (N,)), reason="broadcasts"),
    fn_case("interleaved-split", interleaved, shapes=MERGED, reason="not contiguous in its last dimension"),
    fn_case("swish-beta", swish_beta),
    fn_case("quick-gelu", quick_gelu),
    fn_case("gelu-formula-wrong-constant", gelu_formula_wrong_constant),
    fn_case("silu-in-place", silu_in_place),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", NEAR_MISSES, ids=[c.id for c in NEAR_MISSES])
def test_near_miss_is_left_alone(case, dtype):
    check_case(dataclasses.replace(case, count=0), dtype)


# Gated products (two projections of one input, one through a nonlinearity) the op cannot compute: each refused
# with its activation written out, so that none is a silent miss.

def tanh_glu(g, u):
    return torch.tanh(g) * u


def quick_gelu_glu(g, u):
    return g * torch.sigmoid(1.702 * g) * u  # ACT2FN["quick_gelu"], GPT-OSS's and MiniMax-M3's gate


def clamped_swiglu(g, u):
    # MiniMax-M3's dense MLP (GPT-OSS's clamped GLU, gate and up not interleaved)
    g, u = g.clamp(max=7.0), u.clamp(min=-7.0, max=7.0)
    return (u + 1.0) * (g * torch.sigmoid(g * 1.702))


def relu_read_twice(g, u):
    a = F.relu(g)
    return a * u + a


UNSUPPORTED = "is not one the glu op computes (silu, gelu_tanh, gelu_erf, relu, relu2, sigmoid)"

REFUSED = [
    fn_case("tanh", projected(tanh_glu), PROJECTED, count=0, reason=f"gate activation tanh(x) {UNSUPPORTED}"),
    fn_case("quick-gelu", projected(quick_gelu_glu), PROJECTED, count=0,
            reason=f"gate activation x * sigmoid(1.702 * x) {UNSUPPORTED}"),
    fn_case("clamped-swiglu-merged", merged_projected(clamped_swiglu), PROJECTED_MERGED, count=0,
            reason=f"gate activation clamp(x, max=7) * sigmoid(clamp(x, max=7) * 1.702) {UNSUPPORTED}"),
    module_case("ACT2FN-gelu_10", lambda: GatedMLP(32, N, "gelu_10"), count=0),  # clip(gelu(x), -10, 10)
    module_case("ACT2FN-mish", lambda: GatedMLP(32, N, "mish"), count=0),
    fn_case("relu-read-twice", projected(relu_read_twice), PROJECTED, count=0, reason="other users"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", REFUSED, ids=[c.id for c in REFUSED])
def test_unsupported_gated_product_is_reported(case, dtype):
    report = check_case(case, dtype)
    reasons = [r.reason for r in report.rejections if r.family == "glu"]
    assert len(reasons) == 1 and report.anchors_left.get("glu") == 1, str(report)
    assert case.reason is not None or UNSUPPORTED in reasons[0], reasons


def test_activation_rounded_to_another_dtype_is_refused():
    # silu computed on a float32 gate, then rounded to bfloat16 and multiplied there: no bf16 gate for the op to read.
    def fn(g, u):
        return F.silu(g).to(torch.bfloat16) * u.to(torch.bfloat16)

    report = check_case(fn_case("silu-rounded", fn, count=0), torch.float32)
    assert [r.reason for r in report.rejections if r.family == "glu"] == [
        "the activation is computed in float32 and cast to bfloat16, and its input is no bfloat16 tensor upcast; "
        "the fused kernel computes in float32 from a gate of the output's dtype"]


def test_unsupported_activation_is_named():
    report = check_case(module_case("ACT2FN-gelu_10", lambda: GatedMLP(32, N, "gelu_10"), count=0), torch.float32)
    (reason,) = [r.reason for r in report.rejections if r.family == "glu"]
    assert reason == f"gate activation clip(gelu(x, 'none'), -10, 10) {UNSUPPORTED}", reason


# Products that are no gated MLP: neither fused nor anchored (no report of the glu family at all).

def gated_attention(x, w_q, w_gate):
    q = F.linear(x, w_q)
    attention = torch.softmax(q @ q.transpose(-1, -2), -1) @ q
    return attention * torch.sigmoid(F.linear(x, w_gate))  # Qwen3-Next's output gate: attention is no projection


def relu_times_scale(x, w_gate, w_scale):
    return F.relu(F.linear(x, w_gate)) * w_scale  # a weight, not a projection


def bilinear(x, w_gate, w_up):
    return F.linear(x, w_gate) * F.linear(x, w_up)  # no nonlinearity


def activation_of_itself(x, w_gate, w_up):
    g = F.linear(x, w_gate)
    return g * torch.sigmoid(1.702 * g) + F.linear(x, w_up)  # one projection on both sides: an activation


def indexer_scores(x, q, k, w):
    # DeepSeek-V4's indexer: sum_h w_h * relu(q_h . k): relu of a matmul of two activations, one weight per head
    scores = F.relu(q @ k.transpose(-1, -2)) * 0.25
    return (scores * F.linear(x, w).transpose(1, 2).unsqueeze(-1)).sum(1)


NOT_GATED = [
    fn_case("gated-attention", gated_attention, PROJECTED, count=0),
    fn_case("relu-times-weight", relu_times_scale, ((3, 32), (N, 32), (N,)), count=0),
    fn_case("bilinear", bilinear, PROJECTED, count=0),
    fn_case("activation-of-itself", activation_of_itself, PROJECTED, count=0),
    fn_case("indexer-scores", indexer_scores, ((2, 5, 32), (2, 4, 5, 8), (2, 1, 6, 8), (4, 32)), count=0),
]


@pytest.mark.parametrize("case", NOT_GATED, ids=[c.id for c in NOT_GATED])
def test_product_that_is_no_glu_is_not_anchored(case):
    report = check_case(case, torch.float32)
    assert not [r for r in report.rejections if r.family == "glu"] and not report.anchors_left.get("glu"), \
        str(report)


def test_float64_is_refused():
    check_case(fn_case("float64", swiglu, count=0, reason="float64"), torch.float64)


def test_mixed_dtypes_are_refused():
    def fn(g, u):
        return F.silu(g) * u.float()

    g, u = torch.randn(3, N, dtype=torch.bfloat16), torch.randn(3, N, dtype=torch.bfloat16)
    out = torch.compile(fn, backend="sloth", options={"inner": "eager"}, fullgraph=True)(g, u)
    report = sloth.last_report()
    assert report.counts.get("glu", 0) == 0
    assert [r.reason for r in report.rejections] == [
        "gate is bfloat16 and up is float32; the fused kernel needs both in one of float32, bfloat16 and float16"]
    torch.testing.assert_close(out, fn(g, u))


def test_rejected_glu_next_to_a_matched_one():
    def fn(g, u):
        return swiglu(g, u) + activation_reused(u, g)

    report = check_case(fn_case("mixed", fn, reason="other users"), torch.bfloat16)
    assert len(report.rejections) == 1


# ---------------------------------------------------------------------------------------------------
# transformers' models with gates other than SiLU and GELU: every GLU site replaced or reported
# ---------------------------------------------------------------------------------------------------

MINIMAX_GATE = f"gate activation clamp(x, max=7) * sigmoid(clamp(x, max=7) * 1.702) {UNSUPPORTED}"
# model type -> (glu sites replaced, glu sites refused with the reason), tiny configs of two decoder layers
# (benchmarks/coverage.py). BitNet: relu(gate)^2 * up in each layer. DeepSeek-V4: each layer's shared expert,
# silu(clamp(gate)) * clamp(up) (its routed experts are moe_route's, and its indexer's relu(q . k) times per-head
# weights is no gated MLP). MiniMax-M3: each layer's dense MLP, (clamp(up) + 1) * clamp(g) * sigmoid(1.702 *
# clamp(g)), GPT-OSS's clamped GLU, which the glu op does not compute (the routed experts' are moe_route's).
MODEL_SITES = {"bitnet": (2, []), "deepseek_v4": (2, []), "minimax_m3_vl_text": (0, [MINIMAX_GATE] * 2)}


def tiny_model(model_type: str) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from sloth.benchmarks.coverage import tiny_config

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="eager").float().eval()


@pytest.mark.parametrize("model_type", list(MODEL_SITES))
def test_transformers_models_glu_sites_replaced_or_reported(model_type):
    model = tiny_model(model_type)
    ids = torch.randint(3, 128, (2, 9), generator=seeded(1))
    report = sloth.explain(model, input_ids=ids)
    replaced, reasons = MODEL_SITES[model_type]
    assert report.counts.get("glu", 0) == replaced, str(report)
    assert sorted(r.reason for r in report.rejections if r.family == "glu") == reasons, str(report)
    assert report.anchors_left.get("glu", 0) == len(reasons) and not report.unexplained, str(report)


def test_bitnet_relu2_glu_matches_eager():
    # BitNet's relu(gate)^2 * up fused in both layers: loss and every gradient under the whole-model rule.
    from test_models import assert_model_close, loss_and_grads

    model = tiny_model("bitnet")
    ids = torch.randint(3, 128, (2, 9), generator=seeded(1))
    reference = loss_and_grads(copy.deepcopy(model).double(), ids)
    eager = loss_and_grads(model, ids)
    actual = loss_and_grads(model, ids, run=torch.compile(model, backend="sloth", options={"inner": "aot_eager"}))
    assert sloth.last_report().counts.get("glu", 0) == 2, str(sloth.last_report())
    assert_model_close(actual, eager, reference, torch.float32)


@pytest.mark.parametrize("act,replaced", [("relu2", 1), ("tanh", 0)])
def test_peft_lora_mlp_with_other_gates(act, replaced):
    # peft's adapters on gate, up and down: the gate is base + adapter when the glu pass runs, and a sloth LoRA op
    # when the anchors are counted, after the lora pass; either way the site is replaced or refused, never silent.
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(GatedMLP(32, N, act), LoraConfig(r=4, lora_alpha=8,
                                                            target_modules=["gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 3, 32, generator=seeded(1))
    compiled = torch.compile(model, backend="sloth", options={"inner": "aot_eager"})
    out = compiled(x)
    out.sum().backward()
    report = sloth.last_report()
    assert report.counts.get("glu", 0) == replaced and report.counts.get("lora", 0) >= 1, str(report)
    reasons = [r.reason for r in report.rejections if r.family == "glu"]
    assert reasons == ([] if replaced else [f"gate activation tanh(x) {UNSUPPORTED}"]), str(report)
    assert not report.unexplained, str(report)
    torch.testing.assert_close(out, model(x))


# ---------------------------------------------------------------------------------------------------
# Options, dynamic shapes, report, explain, profiler
# ---------------------------------------------------------------------------------------------------

def test_the_family_can_be_switched_off():
    g, u = torch.randn(3, N), torch.randn(3, N)
    others = [f for f in sloth.FAMILIES if f != "glu"]
    out = torch.compile(swiglu, backend="sloth", options={"inner": "eager", "patterns": others})(g, u)
    report = sloth.last_report()
    assert report.counts.get("glu", 0) == 0 and report.disabled == ["glu"]
    torch.testing.assert_close(out, swiglu(g, u))
    torch.compile(swiglu, backend="sloth", options={"inner": "eager", "patterns": ["glu"]})(g, u)
    assert sloth.last_report().counts == {"glu": 1}


@pytest.mark.parametrize("fn", [swiglu, merged_chunk], ids=["split", "merged"])
def test_mark_dynamic_rows_no_recompile(fn):
    calls: list = []
    compiled = torch.compile(fn, backend=counting_backend(calls, "aot_eager"))
    for rows in (5, 9):
        args = [torch.randn(rows, 2 * N if fn is merged_chunk else N, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(1 if fn is merged_chunk else 2)]
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)  # on the leaves themselves: a detached copy would not carry it
        out = compiled(*args)
        got = [out, *torch.autograd.grad(out, args, torch.ones_like(out))]
        assert sloth.last_report().counts == {"glu": 1}, str(sloth.last_report())
        eager = fn(*args)
        want = [eager, *torch.autograd.grad(eager, args, torch.ones_like(eager))]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert len(calls) == 1, f"{len(calls)} compiles for two row counts"


def test_dynamic_true_still_fuses():
    compiled = torch.compile(merged_slices, backend="sloth", options={"inner": "eager"}, dynamic=True)
    for rows in (5, 9):
        m = torch.randn(rows, 2 * N)
        torch.testing.assert_close(compiled(m), merged_slices(m))
        assert sloth.last_report().counts == {"glu": 1}, str(sloth.last_report())


def test_report_names_family_module_and_user_source_line():
    torch.compile(Stack(32, N), backend="sloth", options={"inner": "eager"})(torch.randn(2, 3, 32))
    report = sloth.last_report()
    text = str(report)
    assert "glu: 3" in text and "sloth.glu" in text
    assert [s.module for s in report.sites if s.family == "glu"] == ["mlps.0", "mlps.1", "mlps.2"], text
    for cls, needle in ((GatedMLP, "self.act_fn"), (MergedMLP, "up * self.activation_fn(gate)")):
        lineno, code = line_of(cls.forward, needle)
        assert f"test_glu_pattern.py:{lineno}" in text and code in text, text


def test_report_lists_rejections_with_reason_and_line():
    torch.compile(activation_reused, backend="sloth", options={"inner": "eager"})(torch.randn(3, N), torch.randn(3, N))
    text = str(sloth.last_report())
    lineno, _ = line_of(activation_reused, "a = F.silu(g)")  # the activation, which has the other users
    assert "nothing replaced" in text and "other users" in text
    assert f"test_glu_pattern.py:{lineno}" in text, text


def test_explain_counts_without_compiling():
    g, u = torch.randn(3, N, requires_grad=True), torch.randn(3, N, requires_grad=True)
    report = sloth.explain(two_glus, g, u)
    assert report.counts == {"glu": 2} and g.grad is None


def test_profiler_shows_sloth_ops():
    g = torch.randn(3, N, dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(3, N, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(swiglu, backend="sloth", options={"inner": "aot_eager"})
    compiled(g, u)  # compile outside the trace
    with torch.profiler.profile() as prof:
        compiled(g, u).sum().backward()
    names = {e.name for e in prof.events()}
    assert "sloth::glu" in names and "sloth::glu_backward" in names


def test_one_list_of_activations():
    # The pass's patterns, the names its reasons list and the op's kernels name the same activations.
    from sloth.lowering.glu import ACTIVATIONS
    from sloth.patterns.glu import PATTERNS
    from sloth.patterns.glu_forms import ACTIVATION_NAMES

    assert tuple(PATTERNS) == ACTIVATION_NAMES and set(ACTIVATIONS) == set(ACTIVATION_NAMES)
    assert len(set(ACTIVATIONS.values())) == len(ACTIVATIONS)


def test_canonical_gelu_is_the_graph_spelling():
    # What the pass reads: every GELU spelling above becomes this one function, called positionally.
    gm = torch.fx.symbolic_trace(lambda x: gelu(x, "tanh"))
    x = torch.randn(5)
    torch.testing.assert_close(gm(x), F.gelu(x, approximate="tanh"), rtol=0, atol=0)
