"""The LayerNorm family pass: what it matches (exact counts), what it must refuse and why, and that the compiled
result equals eager under the tolerance rule (tests/tolerance.py), forward and every gradient.

Each case compiles ``fn`` with ``backend="sloth"`` and reads ``sloth.last_report()``; "eager" is ``fn`` uncompiled
at the tested dtype, the reference is ``fn`` in float64 (its fp32 upcasts made no-ops by ``StayFloat64``).
"""
from __future__ import annotations

import copy
import inspect
import dataclasses
from typing import Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sloth
from op_checks import StayFloat64
from pattern_checks import forward_backward, params_of, seeded
from tolerance import assert_close

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


# ---------------------------------------------------------------------------------------------------
# The functions under test (user code)
# ---------------------------------------------------------------------------------------------------

def functional(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def functional_weight_only(x, w):
    return F.layer_norm(x, x.shape[-1:], weight=w, eps=1e-6)


def functional_no_affine_default_eps(x):
    return F.layer_norm(x, [x.shape[-1]])


def functional_then_affine(x, w, b):
    return F.layer_norm(x, (x.shape[-1],)) * w + b  # the affine step written after a plain norm


def convnext(x, w, b):
    # The hand-written form of ConvNeXt / BEiT ports: x - u written twice, eps inside a sqrt.
    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)
    x = (x - u) / torch.sqrt(s + 1e-6)
    return w * x + b


def centred_once(x, w, b):
    # The centred value kept in one variable: also an RMSNorm of d, which rms_norm must not take.
    d = x - x.mean(-1, keepdim=True)
    return b + d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def biased_var(x, w, b):
    n = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)
    return n * w + b


def correction_zero(x, w):
    v = torch.var(x, dim=-1, correction=0, keepdim=True)
    return w * ((x - x.mean(dim=-1, keepdim=True)) / torch.sqrt(v + 1e-5))


def cohere(x, w):
    # transformers' CohereLayerNorm: fp32 upcast, no bias, weight in fp32, cast back.
    dtype = x.dtype
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(variance + 1e-5)
    return (w.to(torch.float32) * h).to(dtype)


def olmo(x):
    # transformers' OlmoLayerNorm: no parameters, the norm in fp32, cast back.
    return F.layer_norm(x.to(torch.float32), (x.shape[-1],), None, None, eps=1e-5).to(x.dtype)


def bias_before_weight(x, w, b):
    # (n + b) * w is not LayerNorm's affine step: the bias is taken, the weight stays a separate product.
    return (F.layer_norm(x, (x.shape[-1],)) + b) * w


def two_norms(x, w, b):
    h = functional(x, w, b)
    return convnext(h + x, w * 0.5, b)


def llama_rms_norm(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class PreNormBlock(nn.Module):
    """A GPT-2-style block: two nn.LayerNorm, one with and one without a bias."""

    def __init__(self, d: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.ln_2 = nn.LayerNorm(d, bias=False)
        self.fc = nn.Linear(d, d)

    def forward(self, x, w):
        h = x + self.fc(self.ln_1(x))
        return h + self.ln_2(h) * w


# near-misses

def mean_over_dim0(x, w, b):
    u = x.mean(0, keepdim=True)
    s = (x - u).pow(2).mean(0, keepdim=True)
    return w * (x - u) * torch.rsqrt(s + 1e-5) + b


def unbiased_var(x, w, b):
    return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-5) * w + b


def eps_after_sqrt(x, w, b):
    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)
    return w * (x - u) / (torch.sqrt(s) + 1e-5) + b


def two_trailing_dims(x):
    return F.layer_norm(x, x.shape[-2:], None, None, 1e-5)


def mean_also_used(x, w, b):
    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)
    return (x - u) * torch.rsqrt(s + 1e-5) * w + b + u


def variance_also_used(x):
    v = x.var(-1, keepdim=True, unbiased=False)
    return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(v + 1e-5) + v


def not_centred_numerator(x):
    # rsqrt of x's variance times x itself (not x - mean): a scaled x, not a LayerNorm.
    return x * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)


def tensor_eps(x, eps):
    u = x.mean(-1, keepdim=True)
    return (x - u) * torch.rsqrt((x - u).pow(2).mean(-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------------
# Case plumbing
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    id: str
    fn: Callable
    count: int = 1
    reason: Optional[str] = None  # a fragment the layer_norm rejection must contain
    shape: tuple = (7, 33)
    rms_norm: int = 0  # RMSNorm sites sloth must find beside (0: rms_norm must take none)
    module: Optional[Callable[[], nn.Module]] = None


def _args(case: Case, dtype: torch.dtype, ref: bool) -> list[torch.Tensor]:
    """The arguments ``case.fn`` names: x, a weight w, a bias b (all of ``dtype``), an fp32 scalar eps tensor."""
    d = case.shape[-1]
    values = {
        "x": (torch.randn(case.shape, generator=seeded(1)) + 2.0).to(dtype),  # off-centre: a skipped mean shows
        "w": (torch.randn(d, generator=seeded(2)) * 0.5 + 1.0).to(dtype),
        "b": (torch.randn(d, generator=seeded(3)) * 0.5).to(dtype),
        "eps": torch.tensor(1e-5),
    }
    fn = case.fn if case.module is None else case.module().forward
    out = [values[name] for name in inspect.signature(fn).parameters]
    return [t.double() for t in out] if ref else out


def _fn(case: Case, dtype: torch.dtype, ref: bool) -> Callable:
    if case.module is None:
        return case.fn
    torch.manual_seed(0)
    module = case.module().to(dtype)
    return module.double() if ref else module


def check_case(case: Case, dtype: torch.dtype, inner: str = "eager") -> sloth.Report:
    fn = _fn(case, dtype, False)
    eager = forward_backward(fn, _args(case, dtype, False), params_of(fn))
    fn64 = _fn(case, dtype, True)
    with StayFloat64():
        reference = forward_backward(fn64, _args(case, dtype, True), params_of(fn64), dy_dtype=eager[0].dtype)
    fn = _fn(case, dtype, False)
    compiled = torch.compile(fn, backend="sloth", options={"inner": inner}, fullgraph=True)
    actual = forward_backward(compiled, _args(case, dtype, False), params_of(fn))
    report = sloth.last_report()
    assert report.counts.get("layer_norm", 0) == case.count, str(report)
    assert report.counts.get("rms_norm", 0) == case.rms_norm, str(report)
    reasons = [r.reason for r in report.rejections if r.family == "layer_norm"]
    if case.reason is None:
        assert not reasons, str(report)
    else:
        assert any(case.reason in r for r in reasons), f"no rejection mentioning {case.reason!r}: {reasons}"
    names = ["out"] + [f"grad[{i}]" for i in range(len(actual) - 1)]
    for name, a, e, r in zip(names, actual, eager, reference):
        assert_close(f"{case.id}-{str(dtype)[6:]}: {name}", a, e, r)
    return report


MATCHES = [
    Case("F.layer_norm", functional),
    Case("F.layer_norm-3d-D100", functional, shape=(2, 3, 100)),
    Case("F.layer_norm-weight-only", functional_weight_only),
    Case("F.layer_norm-no-affine-default-eps", functional_no_affine_default_eps),
    Case("F.layer_norm-then-affine", functional_then_affine),
    Case("convnext-sqrt-division", convnext),
    Case("centred-once", centred_once),
    Case("var-unbiased-False", biased_var),
    Case("var-correction-0", correction_zero),
    Case("cohere-upcast", cohere),
    Case("olmo-upcast-no-affine", olmo),
    Case("bias-before-weight", bias_before_weight),
    Case("two-norms", two_norms, count=2),
    Case("nn.LayerNorm-block", None, count=2, module=lambda: PreNormBlock(33)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MATCHES, ids=[c.id for c in MATCHES])
def test_match(case, dtype):
    check_case(case, dtype)


@pytest.mark.parametrize("case", [c for c in MATCHES if c.id in ("convnext-sqrt-division", "nn.LayerNorm-block")],
                         ids=["convnext-sqrt-division", "nn.LayerNorm-block"])
def test_match_aot_eager(case):
    check_case(case, torch.bfloat16, inner="aot_eager")


def test_the_fused_op_is_in_the_graph():
    from pattern_checks import graph_of

    x, w, b = (torch.randn(3, 33, dtype=torch.bfloat16), torch.randn(33, dtype=torch.bfloat16),
               torch.randn(33, dtype=torch.bfloat16))
    gm = graph_of(convnext, x, w, b)
    (fused,) = [n for n in gm.graph.nodes if n.target is torch.ops.sloth.layer_norm.default]
    assert not [n for n in gm.graph.nodes if n.target in (torch.rsqrt, torch.mean, torch.square, torch.sub)]
    xn, wn, bn, eps, out_dtype = fused.args
    assert [xn.op, wn.op, bn.op] == ["placeholder"] * 3 and eps == 1e-6 and out_dtype is torch.bfloat16


def test_rms_norm_is_not_taken():
    check_case(Case("llama-rms-norm", llama_rms_norm, count=0, rms_norm=1), torch.bfloat16)


NEAR_MISSES = [
    Case("mean-over-dim0", mean_over_dim0, count=0, reason="not the last dimension", shape=(33, 33)),
    Case("unbiased-var", unbiased_var, count=0, reason="unbiased"),
    Case("eps-after-sqrt", eps_after_sqrt, count=0, reason="added to the standard deviation"),
    Case("two-trailing-dims", two_trailing_dims, count=0, reason="trailing dims", shape=(2, 3, 33)),
    Case("mean-also-used", mean_also_used, count=0, reason="other users"),
    Case("variance-also-used", variance_also_used, count=0, reason="other users"),
    Case("not-centred", not_centred_numerator, count=0, reason="does not multiply x - mean(x)"),
    Case("eps-is-a-tensor", tensor_eps, count=0, reason="eps is a tensor", ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", NEAR_MISSES, ids=[c.id for c in NEAR_MISSES])
def test_near_miss_is_left_alone(case, dtype):
    check_case(case, dtype)


def test_float64_is_refused():
    check_case(Case("float64", convnext, count=0, reason="float64"), torch.float64)
    check_case(Case("float64-F.layer_norm", functional, count=0, reason="float64"), torch.float64)


def test_dynamic_eps_and_rows_do_not_recompile():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return sloth.sloth_backend(gm, example_inputs, options={"inner": "eager"})

    def norm(x, w, b, eps):
        # Written out: F.layer_norm's eps is specialised by Dynamo itself (a guard eps == value, sloth or not).
        d = x - x.mean(-1, keepdim=True)
        return d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps) * w + b

    compiled = torch.compile(norm, backend=backend, dynamic=True)
    w, b = torch.randn(33), torch.randn(33)
    for rows, eps in ((5, 1e-5), (9, 1e-2), (4, 0.5)):
        x = torch.randn(rows, 33) * 0.1
        torch.testing.assert_close(compiled(x, w, b, eps), norm(x, w, b, eps), rtol=1e-5, atol=1e-5)
        assert sloth.last_report().counts == {"layer_norm": 1}, str(sloth.last_report())
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------------
# A tiny transformers model: every nn.LayerNorm replaced, loss and gradients as eager
# ---------------------------------------------------------------------------------------------------

def count_layer_norm_calls(model: nn.Module, ids: torch.Tensor) -> int:
    """LayerNorm applications in one eager forward (the test's oracle: nn.LayerNorm modules by class)."""
    calls = [0]
    hooks = [m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
             for m in model.modules() if isinstance(m, nn.LayerNorm)]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return calls[0]


@pytest.mark.parametrize("model_type", ["gpt_neox", "phi"])
def test_transformers_model(model_type):
    from test_models import assert_model_close, build, loss_and_grads

    model = build(model_type, torch.float32)
    ids = torch.randint(3, 96, (2, 9), generator=seeded(4))
    expected = count_layer_norm_calls(model, ids)
    assert expected > model.config.num_hidden_layers  # one or two a layer, and the final norm
    reference = copy.deepcopy(model).double()
    ref = loss_and_grads(reference, ids)
    eager = loss_and_grads(model, ids)
    compiled = torch.compile(model, backend="sloth", options={"inner": "aot_eager"})
    actual = loss_and_grads(model, ids, run=compiled)
    report = sloth.report()
    assert report.counts.get("layer_norm", 0) == expected, str(report)
    assert not report.rejections, str(report)
    assert all("eps=1e-05" in s.detail for s in report.sites if s.family == "layer_norm"), str(report)
    assert_model_close(actual, eager, ref, torch.float32)
