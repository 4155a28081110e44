"""The RMSNorm family pass: what it matches (exact counts), what it must refuse, and that the compiled
result equals eager under the tolerance rule (tests/tolerance.py), forward and every gradient.

Every case compiles with ``torch.compile(fn, backend="sloth", options={"inner": ...})`` and reads
``sloth.last_report()``. "eager" is the same function run uncompiled at the tested dtype; the reference is
the same function in float64, its fp32 upcasts turned into no-ops by ``_StayFloat64`` (otherwise the
fp64 run would silently round through fp32 and be no better than eager).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Optional, Union

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import sloth
from sloth.compiler.backend import sloth_backend
from tolerance import assert_close
from pattern_checks import counting_backend, forward_backward, line_of, params_of, seeded

FP32_EPS = torch.finfo(torch.float32).eps
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


class _StayFloat64(TorchFunctionMode):
    """Run code written for low precision entirely in float64.

    ``.float()`` / ``.to(torch.float32)`` of a float64 tensor become no-ops, and ``F.rms_norm`` with
    ``eps=None`` gets the eps it would use for an fp32/bf16/fp16 input (float32's), not float64's.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.dtype == torch.float64:
            if func is torch.Tensor.float:
                return first
            if func is torch.Tensor.to and len(args) <= 2 and set(kwargs) <= {"dtype"} \
                    and kwargs.get("dtype", args[1] if len(args) > 1 else None) is torch.float32:
                return first
            if func in (F.rms_norm, torch.rms_norm):
                bound = {**dict(zip(("input", "normalized_shape", "weight", "eps"), args)), **kwargs}
                if bound.get("eps") is None:
                    bound["eps"] = FP32_EPS
                return func(bound.pop("input"), bound.pop("normalized_shape"), **bound)
        return func(*args, **kwargs)


def _tensor(shape, dtype, ref: bool, *, scale: float = 1.0, shift: float = 0.0, seed: int = 0) -> torch.Tensor:
    """Seeded values rounded to ``dtype``; for the reference, those same values in float64."""
    v = (torch.randn(shape, generator=seeded(seed)) * scale + shift).to(dtype)
    return v.double() if ref else v


# ---------------------------------------------------------------------------------------------------
# The functions and modules under test (user code: the report points at these lines)
# ---------------------------------------------------------------------------------------------------

def llama_norm(x, w):
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + 1e-6)
    return w * h.to(x.dtype)


def gemma_norm(x, w):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (h * (1.0 + w.float())).type_as(x)


def gemma_norm_weight_first(x, w):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return ((w.float() + 1.0) * h).to(x.dtype)


def weightless_norm(x):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def functional_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def functional_norm_default_eps(x, w):
    return F.rms_norm(x, (x.shape[-1],), weight=w, eps=None)


def functional_weightless_default_eps(x):
    return F.rms_norm(x, [x.shape[-1]])


def qk_norm(x, w):
    # q/k-norm over head_dim: (B, T, H*Dh) -> (B, T, H, Dh), normalised per head, then heads first.
    b, t, _ = x.shape
    return llama_norm(x.view(b, t, 3, 32), w).transpose(1, 2)


def olmo2_norm(x, w):
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (w * h).to(dtype)


def sqrt_division_norm(x, w):
    h = x.float()
    return w * (h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def sum_over_d_norm(x, w):
    h = x.float()
    ms = h.pow(2).sum(-1, keepdim=True) / h.shape[-1]
    return w * (h * torch.rsqrt(ms + 1e-6)).to(x.dtype)


def two_norms_shared_upcast(x, w):
    h = x.float()  # one upcast read by two norms: the first replacement must leave it for the second
    a = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    b = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-2)
    return (a * w).to(x.dtype) + (b * w).to(x.dtype)


def no_upcast_norm(x, w):
    # Computed at x's own dtype (no fp32 upcast): the fused op computes in fp32, which is only better.
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def checkpointed_norm(x, w):
    # Activation checkpointing: Dynamo puts the norm into the body of a higher-order op.
    return torch.utils.checkpoint.checkpoint(llama_norm, x, w, use_reentrant=False) * 2


def two_norms(x, w):
    h = llama_norm(x, w)
    return gemma_norm(h + x, w * 0.1)


class MulAddRMSNorm(nn.Module):
    """Spelled with torch.mul / torch.add / dim= keywords, as some model ports do."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.to(dtype=torch.float32)
        variance = torch.mean(torch.mul(h, h), dim=-1, keepdim=True)
        h = torch.mul(h, torch.rsqrt(torch.add(variance, self.variance_epsilon)))
        return torch.mul(self.weight, h.to(x.dtype))


class Block(nn.Module):
    """A pre-norm residual block with two norms, the way decoder layers hold them."""

    def __init__(self, hidden: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-6)
        self.post_attention_layernorm = MulAddRMSNorm(hidden)

    def forward(self, x):
        h = x + self.input_layernorm(x) * 0.5
        return h + self.post_attention_layernorm(h)


def test_float64_reference_mode():
    # The oracle itself: under _StayFloat64 the upcasts are no-ops and F.rms_norm's default eps is fp32's.
    x, w = torch.randn(3, 64, dtype=torch.float64) * 1e-4, torch.randn(64, dtype=torch.float64)
    with _StayFloat64():
        ref = llama_norm(x, w)
        ref_default_eps = functional_norm_default_eps(x, w)
    assert ref.dtype == torch.float64 and 0 < (ref - llama_norm(x, w)).abs().max() < 1e-5
    torch.testing.assert_close(ref_default_eps, F.rms_norm(x, (64,), w, FP32_EPS), rtol=0, atol=0)
    assert (ref_default_eps - F.rms_norm(x, (64,), w)).abs().max() > 0.1  # float64's own eps differs


# ---------------------------------------------------------------------------------------------------
# Case plumbing: make(dtype, ref) -> (callable, args); params of a module get gradients too
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    id: str
    make: Callable[[torch.dtype, bool], tuple[Callable, list[torch.Tensor]]]
    count: Optional[int]  # None: either way is right, only the values are checked
    reason: Optional[str] = None  # for near-misses: a word the rejection must contain (None: no rejection needed)


def fn_case(id: str, fn: Callable, shape=(3, 64), *, count: int = 1, weight: Optional[str] = "llama",
            weight_dtype: Optional[torch.dtype] = None, weight_size: Optional[int] = None,
            x_scale: Union[float, Callable[[torch.dtype], float]] = 1.0, reason: Optional[str] = None,
            reference: Optional[Callable] = None) -> Case:
    """``reference``: the same math for the float64 run, where ``fn`` cannot run under _StayFloat64."""
    def make(dtype, ref):
        args = [_tensor(shape, dtype, ref, scale=x_scale(dtype) if callable(x_scale) else x_scale, seed=1)]
        if weight is not None:
            # Llama-style weights sit near 1, Gemma's near 0 (it multiplies by 1 + w).
            args.append(_tensor((weight_size or shape[-1],), weight_dtype or dtype, ref, scale=0.5,
                                shift=1.0 if weight == "llama" else 0.0, seed=2))
        return (reference or fn) if ref else fn, args
    return Case(id, make, count, reason)


def module_case(id: str, factory: Callable[[], nn.Module], shape=(2, 3, 64), *, count: int = 1,
                x_scale: Union[float, Callable[[torch.dtype], float]] = 1.0) -> Case:
    def make(dtype, ref):
        module = factory()
        with torch.no_grad():
            for i, p in enumerate(module.parameters()):
                p.copy_(torch.randn(p.shape, generator=seeded(10 + i)) * 0.5 + 1.0)
        module = module.to(dtype)
        if ref:
            module = module.double()
        return module, [_tensor(shape, dtype, ref, scale=x_scale(dtype) if callable(x_scale) else x_scale, seed=1)]
    return Case(id, make, count)


def check_case(case: Case, dtype: torch.dtype, inner: str = "eager", **compile_kwargs) -> sloth.Report:
    """Compile, check the count (and rejection), and compare output and gradients with eager."""
    fn, args = case.make(dtype, False)
    eager = forward_backward(fn, args, params_of(fn))
    fn, args = case.make(dtype, True)
    with _StayFloat64():
        reference = forward_backward(fn, args, params_of(fn), dy_dtype=eager[0].dtype)
    fn, args = case.make(dtype, False)
    compiled = torch.compile(fn, backend="sloth", options={"inner": inner}, **{"fullgraph": True, **compile_kwargs})
    actual = forward_backward(compiled, args, params_of(fn))
    report = sloth.last_report()
    assert report is not None
    if case.count is not None:
        assert report.counts.get("rms_norm", 0) == case.count, str(report)
    if case.reason is not None:
        reasons = [r.reason for r in report.rejections if r.family == "rms_norm"]
        assert any(case.reason in r for r in reasons), f"no rejection mentioning {case.reason!r}: {reasons}"
    names = ["out"] + [f"grad[{i}]" for i in range(len(actual) - 1)]
    assert len(actual) == len(eager) == len(reference)
    for name, a, e, r in zip(names, actual, eager, reference):
        assert_close(f"{case.id}-{str(dtype)[6:]}: {name}", a, e, r)
    return report


# ---------------------------------------------------------------------------------------------------
# Matches: exact counts, output and gradients equal to eager
# ---------------------------------------------------------------------------------------------------

def _eps_matters(dtype: torch.dtype) -> float:
    """x scale for eps=None cases: rows with mean square ~1e-8, below fp32's eps (1.2e-7), so a wrong
    default eps shows. (bf16 once needed x ~ 1: Triton 3.6's interpreter truncated the kernel's bf16
    stores, doubling its error; lowering/rounding.py rounds them now.)"""
    return 1e-4


MATCHES = [
    fn_case("llama", llama_norm),
    fn_case("llama-D100-3d", llama_norm, shape=(2, 3, 100)),
    fn_case("llama-fp32-weight", llama_norm, weight_dtype=torch.float32),
    fn_case("gemma", gemma_norm, weight="gemma"),
    fn_case("gemma-w-plus-1", gemma_norm_weight_first, weight="gemma"),
    fn_case("weightless", weightless_norm, weight=None),
    fn_case("F.rms_norm", functional_norm),
    fn_case("F.rms_norm-fp32-weight", functional_norm, weight_dtype=torch.float32),
    fn_case("F.rms_norm-eps-None", functional_norm_default_eps, x_scale=_eps_matters),
    fn_case("F.rms_norm-no-weight-eps-None", functional_weightless_default_eps, weight=None, x_scale=_eps_matters),
    module_case("nn.RMSNorm", lambda: nn.RMSNorm(64)),
    module_case("nn.RMSNorm-no-affine-eps-None", lambda: nn.RMSNorm(64, elementwise_affine=False),
                x_scale=_eps_matters),
    fn_case("qk-norm-4d", qk_norm, shape=(2, 5, 96), weight_size=32),
    fn_case("olmo2", olmo2_norm),
    fn_case("sqrt-division", sqrt_division_norm),
    fn_case("sum-over-D", sum_over_d_norm),
    module_case("torch.mul-torch.add-dim-kwargs", lambda: MulAddRMSNorm(64)),
    fn_case("two-norms", two_norms, count=2),
    fn_case("two-norms-shared-upcast", two_norms_shared_upcast, count=2),
    fn_case("no-upcast", no_upcast_norm),
    # The checkpoint's recompute runs in the autograd engine, outside _StayFloat64: the float64 run
    # does without the checkpoint (same values, no recompute).
    fn_case("checkpointed", checkpointed_norm, reference=lambda x, w: llama_norm(x, w) * 2),
    module_case("block-two-norms", lambda: Block(64), count=2),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MATCHES, ids=[c.id for c in MATCHES])
def test_match(case, dtype):
    report = check_case(case, dtype)
    assert not [r for r in report.rejections if r.family == "rms_norm"], str(report)


GRAD_CASES = ["llama", "gemma", "nn.RMSNorm", "qk-norm-4d", "F.rms_norm-eps-None", "block-two-norms", "checkpointed"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [c for c in MATCHES if c.id in GRAD_CASES],
                         ids=[c.id for c in MATCHES if c.id in GRAD_CASES])
def test_match_aot_eager(case, dtype):
    check_case(case, dtype, inner="aot_eager")


@pytest.mark.parametrize("case,dtype", [
    pytest.param(MATCHES[0], torch.bfloat16, id="llama-bf16"),
    pytest.param(next(c for c in MATCHES if c.id == "block-two-norms"), torch.float32, id="block-two-norms-fp32"),
])
def test_match_inductor(case, dtype):
    check_case(case, dtype, inner="inductor")


def test_the_fused_op_is_in_the_graph():
    graphs = []

    def capture(gm, example_inputs):
        out = sloth_backend(gm, example_inputs, options={"inner": "eager"})
        graphs.append(gm)
        return out

    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    torch.compile(llama_norm, backend=capture, fullgraph=True)(x, w)
    fused = [n for n in graphs[0].graph.nodes if n.target is torch.ops.sloth.rms_norm.default]
    assert len(fused) == 1
    assert not [n for n in graphs[0].graph.nodes if n.target in (torch.rsqrt, torch.mean, torch.square)]
    _, weight, eps, offset, out_dtype = fused[0].args
    assert weight.op == "placeholder" and eps == 1e-6 and offset == 0.0 and out_dtype is torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_default_eps_is_float32_eps(dtype):
    # torch.rms_norm with eps=None uses the eps of its compute type, float32, for all three dtypes.
    x = torch.randn(3, 64, dtype=dtype)
    torch.compile(functional_weightless_default_eps, backend="sloth", options={"inner": "eager"})(x)
    (site,) = sloth.last_report().sites
    assert f"eps={FP32_EPS:g}," in site.detail, site.detail


def test_gemma_offset_reaches_the_op():
    report = check_case(fn_case("gemma", gemma_norm, weight="gemma"), torch.float32)
    assert "weight+1" in report.sites[0].detail


# ---------------------------------------------------------------------------------------------------
# Near-misses: must not match, must say why (where there is an RMSNorm-shaped subgraph), must not crash
# ---------------------------------------------------------------------------------------------------

def mean_over_dim0(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)).to(x.dtype)


def keepdim_false_unsqueeze(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1).unsqueeze(-1) + 1e-6)).to(x.dtype)


def variance_also_used(x, w):
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    return w * (h * torch.rsqrt(var + 1e-6)).to(x.dtype) + var.to(x.dtype)


def rsqrt_also_used(x, w):
    h = x.float()
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * (h * r).to(x.dtype) + r.to(x.dtype)


def eps_after_sqrt(x, w):
    h = x.float()
    return w * (h / (torch.sqrt(h.pow(2).mean(-1, keepdim=True)) + 1e-6)).to(x.dtype)


def other_tensor_times_rsqrt(x, w):
    # w plays the part of "another tensor": the rsqrt of x's mean square multiplies w, not x.
    h = x.float()
    return w.float() * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def gated_norm(x, g):
    # The normalised value times an activation of x's own shape (gated norms): not a weight.
    return weightless_norm(x) * g


def gated_case() -> Case:
    def make(dtype, ref):
        return gated_norm, [_tensor((3, 64), dtype, ref, seed=1), _tensor((3, 64), dtype, ref, seed=2)]
    return Case("times-activation", make, count=1)


def two_trailing_dims(x):
    return F.rms_norm(x, x.shape[-2:], None, 1e-6)


def tensor_eps_norm(x, eps):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def tensor_eps_case() -> Case:
    def make(dtype, ref):
        eps = torch.tensor(1e-6, dtype=torch.float64 if ref else torch.float32)
        return tensor_eps_norm, [_tensor((3, 64), dtype, ref, seed=1), eps]
    return Case("eps-is-a-tensor", make, count=0, reason="eps is a tensor")


NEAR_MISSES = [
    fn_case("mean-over-dim0", mean_over_dim0, reason="not the last dimension"),
    # rsqrt(unsqueeze(mean) + eps): the mean does not feed the add directly, so the pass does not even
    # see an RMSNorm shape; count 0 is all there is to check.
    fn_case("keepdim-false-unsqueeze", keepdim_false_unsqueeze),
    fn_case("variance-also-used", variance_also_used, reason="other users"),
    fn_case("rsqrt-also-used", rsqrt_also_used, reason="other users"),
    fn_case("eps-after-sqrt", eps_after_sqrt),  # no rsqrt at all: nothing to report, nothing to crash on
    fn_case("other-tensor-times-rsqrt", other_tensor_times_rsqrt, shape=(64, 64),
            reason="different tensor"),
    fn_case("F.rms_norm-two-dims", two_trailing_dims, shape=(2, 3, 64), weight=None, reason="trailing dims"),
    fn_case("hidden-over-max", weightless_norm, shape=(1, 65537), weight=None, reason="exceeds"),
    tensor_eps_case(),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", NEAR_MISSES, ids=[c.id for c in NEAR_MISSES])
def test_near_miss_is_left_alone(case, dtype):
    check_case(dataclasses.replace(case, count=0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_multiply_by_activation_is_not_taken_as_weight(dtype):
    graphs = []

    def capture(gm, example_inputs):
        out = sloth_backend(gm, example_inputs, options={"inner": "eager"})
        graphs.append(gm)
        return out

    check_case(gated_case(), dtype)
    torch.compile(gated_norm, backend=capture)(torch.randn(3, 64), torch.randn(3, 64))
    (fused,) = [n for n in graphs[0].graph.nodes if n.target is torch.ops.sloth.rms_norm.default]
    assert fused.args[1] is None and torch.mul in [n.target for n in fused.users]


def pure_float64_norm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_float64_is_refused():
    case = fn_case("float64", pure_float64_norm, count=0, reason="float64")
    check_case(case, torch.float64)


def test_float64_input_through_an_fp32_upcast_still_equals_eager():
    # x.to(float32) of a float64 x narrows; whatever the pass does with the fp32 part, values must hold.
    x = torch.randn(3, 64, dtype=torch.float64)
    w = torch.randn(64, dtype=torch.float64)
    out = torch.compile(llama_norm, backend="sloth", options={"inner": "eager"}, fullgraph=True)(x, w)
    torch.testing.assert_close(out, llama_norm(x, w), rtol=1e-6, atol=1e-6)


def test_rejected_norm_next_to_a_matched_one():
    def fn(x, w):
        return llama_norm(x, w) + mean_over_dim0(x, w)

    report = check_case(fn_case("mixed", fn, shape=(64, 64), reason="not the last dimension"), torch.bfloat16)
    assert len(report.rejections) == 1


# ---------------------------------------------------------------------------------------------------
# Options, errors, modes
# ---------------------------------------------------------------------------------------------------

def _causes(exc: BaseException) -> list[BaseException]:
    """exc and everything it wraps (Dynamo wraps backend errors in BackendCompilerFailed)."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return seen


def test_patterns_empty_disables_the_family():
    x, w = torch.randn(3, 64), torch.randn(64)
    out = torch.compile(llama_norm, backend="sloth", options={"inner": "eager", "patterns": []})(x, w)
    report = sloth.last_report()
    assert report.counts.get("rms_norm", 0) == 0 and report.disabled == sorted(sloth.FAMILIES)
    assert "disabled" in str(report) and "rms_norm" in str(report)
    torch.testing.assert_close(out, llama_norm(x, w))


def test_patterns_listing_the_family_enables_it():
    x, w = torch.randn(3, 64), torch.randn(64)
    torch.compile(llama_norm, backend="sloth", options={"inner": "eager", "patterns": ["rms_norm"]})(x, w)
    assert sloth.last_report().counts == {"rms_norm": 1}
    assert sloth.last_report().disabled == sorted(set(sloth.FAMILIES) - {"rms_norm"})


@pytest.mark.parametrize("options,name", [
    ({"patterns": ["rms_nrom"]}, "rms_nrom"),
    ({"patterns": "no_such_family"}, "no_such_family"),
    ({"inner": "eager", "no_such_option": 1}, "no_such_option"),
    ({"inner": "inductor", "no_such_option": 1}, "no_such_option"),
    ({"inner": "tvm"}, "tvm"),
], ids=["pattern-typo", "pattern-string", "option-eager", "option-inductor", "inner"])
def test_bad_options_raise_value_error_naming_them(options, name):
    x, w = torch.randn(3, 64), torch.randn(64)
    with pytest.raises(Exception) as info:
        torch.compile(llama_norm, backend="sloth", options=options)(x, w)
    value_errors = [e for e in _causes(info.value) if isinstance(e, ValueError)]
    assert value_errors and name in str(value_errors[0]), repr(info.value)
    # Called directly, the backend raises the ValueError itself (before looking at the graph).
    with pytest.raises(ValueError, match=name):
        sloth_backend(torch.fx.symbolic_trace(lambda t: t + 1), [x], options=options)


def test_typo_option_with_eager_inner_is_called_unknown():
    with pytest.raises(ValueError, match="unknown"):
        sloth_backend(torch.fx.symbolic_trace(lambda t: t + 1), [torch.randn(2)],
                      options={"inner": "eager", "pattern": ["rms_norm"]})


def test_fullgraph_and_graph_break():
    x, w = torch.randn(3, 64), torch.randn(64)

    def with_break(x, w):
        h = llama_norm(x, w)
        torch._dynamo.graph_break()
        return llama_norm(h, w)

    calls = []

    def counting(gm, example_inputs):
        calls.append(gm)
        return sloth_backend(gm, example_inputs, options={"inner": "eager"})

    out = torch.compile(with_break, backend=counting)(x, w)
    torch.testing.assert_close(out, with_break(x, w), rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 and sloth.last_report().counts == {"rms_norm": 1}
    assert sloth.report().counts == {"rms_norm": 2} and sloth.report().graphs == 2  # every graph, merged
    with pytest.raises(Exception, match="graph_break|graph break"):
        torch.compile(with_break, backend="sloth", options={"inner": "eager"}, fullgraph=True)(x, w)


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_no_grad_inference(inner):
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        out = torch.compile(llama_norm, backend="sloth", options={"inner": inner}, fullgraph=True)(x, w)
        eager = llama_norm(x, w)
    assert sloth.last_report().counts == {"rms_norm": 1}
    assert not out.requires_grad
    with _StayFloat64():
        ref = llama_norm(x.detach().double(), w.detach().double())
    assert_close("out", out, eager, ref)


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_mark_dynamic_batch_no_recompile(inner):
    calls: list = []
    compiled = torch.compile(llama_norm, backend=counting_backend(calls, inner))
    w = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    for rows in (5, 9):
        x = torch.randn(rows, 64, dtype=torch.bfloat16, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        out = compiled(x, w)
        out.sum().backward()
        assert sloth.last_report().counts == {"rms_norm": 1}
        eager_x = x.detach().requires_grad_(True)
        eager_w = w.detach().requires_grad_(True)
        eager = llama_norm(eager_x, eager_w)
        eager.sum().backward()
        torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(x.grad, eager_x.grad, rtol=2e-2, atol=2e-2)
    assert len(calls) == 1, f"{len(calls)} compiles for two batch sizes"
    w.grad = None


def test_dynamic_true_no_recompile_and_correct():
    calls: list = []
    compiled = torch.compile(llama_norm, backend=counting_backend(calls, "eager"), dynamic=True)
    w = torch.randn(64)
    for rows in (5, 9):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(compiled(x, w), llama_norm(x, w), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1


def test_dynamic_true_still_fuses():
    torch.compile(llama_norm, backend="sloth", options={"inner": "eager"}, dynamic=True)(
        torch.randn(5, 64), torch.randn(64))
    assert sloth.last_report().counts == {"rms_norm": 1}, str(sloth.last_report())


def norm_with_eps(x, w, eps):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_eps_argument_values_are_honoured(inner):
    compiled = torch.compile(norm_with_eps, backend="sloth", options={"inner": inner})
    x, w = torch.randn(3, 64) * 1e-2, torch.randn(64)
    outs = {}
    for eps in (1e-6, 1e-2, 0.5, 1e-6):
        outs[eps] = compiled(x, w, eps)
        assert sloth.last_report().counts == {"rms_norm": 1}
        torch.testing.assert_close(outs[eps], norm_with_eps(x, w, eps), rtol=1e-5, atol=1e-6)
    assert (outs[1e-6] - outs[0.5]).abs().max() > 0.1


def test_eps_argument_does_not_recompile_per_value():
    calls: list = []
    compiled = torch.compile(norm_with_eps, backend=counting_backend(calls, "eager"))
    x, w = torch.randn(3, 64), torch.randn(64)
    for eps in (1e-6, 1e-5, 1e-4, 1e-3, 1e-2):
        compiled(x, w, eps)
    assert len(calls) <= 2, f"{len(calls)} compiles for 5 eps values"


# ---------------------------------------------------------------------------------------------------
# Report, explain, profiler
# ---------------------------------------------------------------------------------------------------

def test_report_names_family_and_user_source_line():
    torch.compile(llama_norm, backend="sloth", options={"inner": "eager"})(torch.randn(3, 64), torch.randn(64))
    text = str(sloth.last_report())
    lineno, code = line_of(llama_norm, "torch.rsqrt")
    assert "rms_norm: 1" in text and "sloth.rms_norm" in text
    assert f"test_rms_norm_pattern.py:{lineno}" in text and code in text, text


def test_report_points_past_torch_frames_to_the_module_user():
    block = Block(64)
    torch.compile(block, backend="sloth", options={"inner": "eager"})(torch.randn(2, 3, 64))
    report = sloth.last_report()
    text = str(report)
    lineno, code = line_of(Block.forward, "self.input_layernorm(x)")
    assert f"test_rms_norm_pattern.py:{lineno}" in text and code in text, text
    assert sorted(s.module for s in report.sites) == ["input_layernorm", "post_attention_layernorm"]


def test_report_lists_rejections_with_reason_and_line():
    torch.compile(mean_over_dim0, backend="sloth", options={"inner": "eager"})(torch.randn(3, 64), torch.randn(64))
    text = str(sloth.last_report())
    lineno, _ = line_of(mean_over_dim0, "torch.rsqrt")
    assert "nothing replaced" in text and "not the last dimension" in text
    assert f"test_rms_norm_pattern.py:{lineno}" in text, text


def test_explain_counts_without_compiling():
    x, w = torch.randn(3, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    report = sloth.explain(two_norms, x, w)
    assert isinstance(report, sloth.Report)
    assert report.counts == {"rms_norm": 2} and report.graphs == 1
    assert x.grad is None
    miss = sloth.explain(mean_over_dim0, x, w)
    assert miss.counts == {} and len(miss.rejections) == 1


def test_explain_merges_graphs():
    def with_break(x, w):
        h = llama_norm(x, w)
        torch._dynamo.graph_break()
        return two_norms(h, w)

    report = sloth.explain(with_break, torch.randn(3, 64), torch.randn(64))
    assert report.graphs == 2 and report.counts == {"rms_norm": 3}


def test_profiler_shows_sloth_ops():
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(llama_norm, backend="sloth", options={"inner": "aot_eager"})
    compiled(x, w)  # compile outside the trace
    with torch.profiler.profile() as prof:
        compiled(x, w).sum().backward()
    names = {e.name for e in prof.events()}
    assert "sloth::rms_norm" in names and "sloth::rms_norm_backward" in names
    with torch.profiler.profile() as prof:
        llama_norm(x, w).sum().backward()
    assert not {e.name for e in prof.events()} & {"sloth::rms_norm", "sloth::rms_norm_backward"}


# ---------------------------------------------------------------------------------------------------
# Bugs found while writing these tests
# ---------------------------------------------------------------------------------------------------

def mean_with_dtype_keyword(x, w):
    # Upcasting inside the reduction: torch.mean(..., dtype=torch.float32) on a bf16 square.
    var = torch.mean(x.pow(2), dim=-1, keepdim=True, dtype=torch.float32)
    return w * (x * torch.rsqrt(var + 1e-6)).to(x.dtype)


def test_mean_with_dtype_keyword_does_not_crash():
    # Matching it or leaving it are both fine; crashing the compile is not.
    check_case(fn_case("mean-dtype-kwarg", mean_with_dtype_keyword, count=None), torch.bfloat16)


def add_alpha_eps(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(torch.add(h.pow(2).mean(-1, keepdim=True), 1e-3, alpha=100.0))).to(x.dtype)


def add_alpha_weight(x, w):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.add(w.float(), 1.0, alpha=3.0)).to(x.dtype)


@pytest.mark.parametrize("fn", [add_alpha_eps, add_alpha_weight], ids=["eps-alpha", "weight-offset-alpha"])
def test_add_with_alpha_is_not_misread(fn):
    x = torch.randn(3, 64) * 0.1
    w = torch.randn(64)
    out = torch.compile(fn, backend="sloth", options={"inner": "eager"})(x, w)
    torch.testing.assert_close(out, fn(x, w), rtol=1e-5, atol=1e-5)


def test_fusing_emits_no_warnings():
    # Regression: _replace once erased h = x.float() twice (it feeds both the square and the multiply),
    # and torch.fx warned "erase_node(h) on an already erased node" on every Llama/Gemma-style match.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(llama_norm, backend="sloth", options={"inner": "eager"})(
            torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16))
    assert sloth.last_report().counts == {"rms_norm": 1}
    assert not [w for w in caught if "already erased" in str(w.message)], [str(w.message) for w in caught]
