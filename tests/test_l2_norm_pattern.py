"""The L2-norm family pass: the forms it matches (exact counts, the eps semantics each keeps), what it refuses and
why, and that the compiled result equals eager under the tolerance rule, forward and gradient.

"eager" is the function uncompiled at the tested dtype, the reference the same function in float64 (its fp32
upcasts made no-ops by ``StayFloat64``).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F

import sloth
from op_checks import StayFloat64
from pattern_checks import forward_backward, graph_of, seeded
from tolerance import assert_close

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def normalize(x):
    return F.normalize(x, dim=-1, eps=1e-6)


def normalize_positive_dim(x):
    return F.normalize(x, 2, x.dim() - 1)  # p and dim positional, the default eps 1e-12


def normalize_upcast(x):
    return F.normalize(x.float(), p=2.0, dim=-1).to(x.dtype)


def rsqrt_sum(x):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def sqrt_division(x):
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def no_eps(x):
    return x * torch.rsqrt(torch.sum(x**2, -1, keepdim=True))


def qk_heads(q, k):
    # q/k L2-norm on heads, [B, H, T, Dh]: two sites.
    return F.normalize(q, dim=-1, eps=1e-6) @ rsqrt_sum(k).transpose(-1, -2)


def llama4_l2norm(x):
    # transformers' Llama4TextL2Norm: a *mean* of squares, i.e. an RMSNorm without weight (rms_norm's site).
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)


def normalize_dim0(x):
    return F.normalize(x, dim=0, eps=1e-6)


def normalize_p1(x):
    return F.normalize(x, p=1.0, dim=-1)


def sum_over_dim0(x):
    return x * torch.rsqrt(x.pow(2).sum(0, keepdim=True) + 1e-6)


def sum_also_used(x):
    s = x.pow(2).sum(-1, keepdim=True)
    return x * torch.rsqrt(s + 1e-6) + s


def rsqrt_times_other(x, y):
    return y * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def tensor_eps(x, eps):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


@dataclasses.dataclass
class Case:
    id: str
    fn: Callable
    count: int = 1
    reason: Optional[str] = None
    shape: tuple = (7, 33)
    rms_norm: int = 0


def _args(case: Case, dtype: torch.dtype, ref: bool) -> list[torch.Tensor]:
    out = []
    for i, name in enumerate(inspect.signature(case.fn).parameters):
        out.append(torch.tensor(1e-6) if name == "eps" else
                   (torch.randn(case.shape, generator=seeded(1 + i)) * 0.3).to(dtype))
    return [t.double() for t in out] if ref else out


def check_case(case: Case, dtype: torch.dtype, inner: str = "eager") -> sloth.Report:
    eager = forward_backward(case.fn, _args(case, dtype, False), [])
    with StayFloat64():
        reference = forward_backward(case.fn, _args(case, dtype, True), [], dy_dtype=eager[0].dtype)
    compiled = torch.compile(case.fn, backend="sloth", options={"inner": inner}, fullgraph=True)
    actual = forward_backward(compiled, _args(case, dtype, False), [])
    report = sloth.last_report()
    assert report.counts.get("l2_norm", 0) == case.count, str(report)
    assert report.counts.get("rms_norm", 0) == case.rms_norm, str(report)
    reasons = [r.reason for r in report.rejections if r.family == "l2_norm"]
    if case.reason is None:
        assert not reasons, str(report)
    else:
        assert any(case.reason in r for r in reasons), f"no rejection mentioning {case.reason!r}: {reasons}"
    for i, (a, e, r) in enumerate(zip(actual, eager, reference)):
        assert_close(f"{case.id}-{str(dtype)[6:]}: {'out' if i == 0 else f'grad[{i - 1}]'}", a, e, r)
    return report


MATCHES = [
    Case("F.normalize", normalize),
    Case("F.normalize-positive-dim-3d", normalize_positive_dim, shape=(2, 3, 100)),
    Case("F.normalize-upcast", normalize_upcast),
    Case("rsqrt-sum", rsqrt_sum),
    Case("sqrt-division", sqrt_division),
    Case("no-eps", no_eps),
    Case("qk-heads", qk_heads, count=2, shape=(2, 2, 5, 16)),
    Case("llama4-mean-is-rms-norm", llama4_l2norm, count=0, rms_norm=1),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MATCHES, ids=[c.id for c in MATCHES])
def test_match(case, dtype):
    check_case(case, dtype)


def test_match_aot_eager():
    check_case(MATCHES[6], torch.bfloat16, inner="aot_eager")


@pytest.mark.parametrize("fn,clamp,eps", [(normalize, True, 1e-6), (normalize_positive_dim, True, 1e-12),
                                          (sqrt_division, False, 1e-6), (no_eps, False, 0.0)],
                         ids=["F.normalize", "F.normalize-default-eps", "sqrt-division", "no-eps"])
def test_each_site_keeps_its_eps_semantics(fn, clamp, eps):
    gm = graph_of(fn, torch.randn(3, 33))
    (fused,) = [n for n in gm.graph.nodes if n.target is torch.ops.sloth.l2_norm.default]
    assert fused.args[1:3] == (eps, clamp)
    assert not [n for n in gm.graph.nodes if n.target in (torch.rsqrt, torch.sum, torch.square, F.normalize)]


NEAR_MISSES = [
    Case("F.normalize-dim0", normalize_dim0, count=0, reason="not the last dimension", shape=(33, 33)),
    Case("F.normalize-p1", normalize_p1, count=0, reason="p=1.0"),
    Case("sum-over-dim0", sum_over_dim0, count=0, reason="not the last dimension", shape=(33, 33)),
    Case("sum-also-used", sum_also_used, count=0, reason="other users"),
    Case("rsqrt-times-other", rsqrt_times_other, count=0, reason="different tensor"),
    Case("eps-is-a-tensor", tensor_eps, count=0, reason="eps is a tensor"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", NEAR_MISSES, ids=[c.id for c in NEAR_MISSES])
def test_near_miss_is_left_alone(case, dtype):
    check_case(case, dtype)


def test_float64_is_refused():
    check_case(Case("float64", normalize, count=0, reason="float64"), torch.float64)
