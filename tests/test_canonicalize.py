"""``canonicalize_pass``: every spelling of an operation becomes one canonical node, values unchanged.

Each case captures a tiny function with Dynamo (the graphs sloth really sees), canonicalises the graph,
asserts on the canonical nodes, and runs the canonical graph against the function run eagerly.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from sloth.compiler.canonicalize import canonicalize_pass, cast
from sloth.compiler.canonicalize import gelu
from sloth.compiler.fx_utils import tensor_of
from sloth.compiler.report import Report


def canonicalize(fn: Callable, *args: Any, rtol: float = 1e-6, atol: float = 1e-7) -> fx.GraphModule:
    """Capture ``fn(*args)`` with Dynamo, canonicalise it, check it still computes ``fn``; return the graph."""
    captured: dict[str, fx.GraphModule] = {}

    def capture(gm: fx.GraphModule, example_inputs):
        captured["gm"] = canonicalize_pass(gm, example_inputs, report=Report())
        return gm.forward

    out = torch.compile(fn, backend=capture, fullgraph=True)(*args)
    assert "gm" in captured, "Dynamo produced no graph"
    expected = fn(*args)
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)  # also checks dtype and shape
    return captured["gm"]


def calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def targets(gm: fx.GraphModule) -> list[Any]:
    return [n.target for n in calls(gm)]


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def placeholder(gm: fx.GraphModule, name: str) -> fx.Node:
    """The graph input for the function argument ``name`` (Dynamo calls it ``l_<name>_``)."""
    (node,) = [n for n in placeholders(gm) if n.name == f"l_{name}_"]
    return node


# ---------------------------------------------------------------------------------------------------
# square
# ---------------------------------------------------------------------------------------------------

SQUARES = {
    "method-pow": lambda x: x.pow(2),
    "operator-pow": lambda x: x ** 2,
    "operator-pow-float": lambda x: x ** 2.0,
    "torch-pow": lambda x: torch.pow(x, 2),
    "x-times-x": lambda x: x * x,
    "torch-mul-x-x": lambda x: torch.mul(x, x),
    "method-square": lambda x: x.square(),
}


@pytest.mark.parametrize("fn", list(SQUARES.values()), ids=list(SQUARES))
def test_square_spellings(fn):
    gm = canonicalize(fn, torch.randn(3, 5))
    (node,) = calls(gm)
    assert node.op == "call_function" and node.target is torch.square
    assert node.args == (placeholders(gm)[0],) and not node.kwargs


def test_x_times_other_is_not_a_square():
    gm = canonicalize(lambda x, y: x * y, torch.randn(3, 5), torch.randn(3, 5))
    assert targets(gm) == [torch.mul]


@pytest.mark.parametrize("exponent", [3, 1.5], ids=["pow3", "pow1.5"])
def test_other_powers_stay_pow(exponent):
    gm = canonicalize(lambda x: x.pow(exponent), torch.rand(3, 5))
    (node,) = calls(gm)
    assert node.target is torch.pow and node.args[1] == exponent


# ---------------------------------------------------------------------------------------------------
# mean over the last dim (and sum / D)
# ---------------------------------------------------------------------------------------------------

MEANS = {
    "method-positional": lambda x: x.mean(-1, keepdim=True),
    "torch-kwargs": lambda x: torch.mean(x, dim=-1, keepdim=True),
    "method-dim-list": lambda x: x.mean(dim=[-1], keepdim=True),
    "method-positive-dim-positional-keepdim": lambda x: x.mean(2, True),
    "torch-positive-tuple": lambda x: torch.mean(x, (2,), keepdim=True),
    "sum-div-literal": lambda x: x.sum(-1, keepdim=True) / 7,
    "sum-div-shape": lambda x: x.sum(-1, keepdim=True) / x.shape[-1],
    "torch-sum-times-reciprocal": lambda x: torch.sum(x, dim=-1, keepdim=True) * (1 / 7),
}


@pytest.mark.parametrize("fn", list(MEANS.values()), ids=list(MEANS))
def test_mean_spellings(fn):
    gm = canonicalize(fn, torch.randn(2, 3, 7))
    (node,) = calls(gm)
    assert node.op == "call_function" and node.target is torch.mean
    assert node.args == (placeholders(gm)[0], (-1,), True) and not node.kwargs


def test_mean_without_keepdim_and_over_two_dims():
    gm = canonicalize(lambda x: x.mean((1, 2)) + x.mean(dim=(0, 1)).sum(), torch.randn(2, 3, 7))
    means = [n for n in calls(gm) if n.target is torch.mean]
    assert [n.args[1:] for n in means] == [((-2, -1), False), ((-3, -2), False)]


def _sum_read_twice(x):
    s = x.sum(-1, keepdim=True)
    return s / 7 + s


@pytest.mark.parametrize("fn", [
    lambda x: x.sum(-1, keepdim=True) / 6,  # not the reduced size
    _sum_read_twice,                        # the sum is read by someone else too
    lambda x: x.sum(1, keepdim=True) / 7,   # the reduced size is 3, not 7
], ids=["wrong-divisor", "sum-used-twice", "wrong-dim"])
def test_sum_that_is_not_a_mean_stays(fn):
    gm = canonicalize(fn, torch.randn(2, 3, 7))
    assert torch.mean not in targets(gm)
    assert torch.sum in targets(gm) and torch.div in targets(gm)


def test_mean_with_dtype_is_left_alone():
    gm = canonicalize(lambda x: x.mean(-1, keepdim=True, dtype=torch.float32), torch.randn(2, 7, dtype=torch.bfloat16))
    (node,) = calls(gm)
    assert node.kwargs.get("dtype") is torch.float32 or torch.float32 in node.args


# ---------------------------------------------------------------------------------------------------
# rsqrt, and division by a square root
# ---------------------------------------------------------------------------------------------------

RSQRTS = {
    "one-over-sqrt": lambda v: 1 / torch.sqrt(v),
    "one-over-method-sqrt": lambda v: 1.0 / v.sqrt(),
    "pow-minus-half": lambda v: v ** -0.5,
    "torch-pow-minus-half": lambda v: torch.pow(v, -0.5),
    "reciprocal-sqrt": lambda v: torch.reciprocal(torch.sqrt(v)),
    "method-rsqrt": lambda v: v.rsqrt(),
}


@pytest.mark.parametrize("fn", list(RSQRTS.values()), ids=list(RSQRTS))
def test_rsqrt_spellings(fn):
    gm = canonicalize(fn, torch.rand(4, 1) + 0.5)
    (node,) = calls(gm)
    assert node.op == "call_function" and node.target is torch.rsqrt
    assert node.args == (placeholders(gm)[0],)


# x / sqrt(v) and x * rsqrt(v) round differently: up to a few fp32 ulps apart (seen: 2.5e-6 relative).
_RSQRT_TOL = dict(rtol=4e-6, atol=1e-7)


def test_divide_by_sqrt_becomes_multiply_by_rsqrt():
    gen = torch.Generator().manual_seed(0)
    gm = canonicalize(lambda x, v: x / torch.sqrt(v), torch.randn(4, 6, generator=gen),
                      torch.rand(4, 1, generator=gen) + 0.5, **_RSQRT_TOL)
    x, v = placeholder(gm, "x"), placeholder(gm, "v")
    rsqrt, mul = calls(gm)
    assert (rsqrt.target, rsqrt.args) == (torch.rsqrt, (v,))
    assert (mul.target, mul.args) == (torch.mul, (x, rsqrt))
    # The inserted node carries a fake value, which later passes read for shapes and dtypes.
    assert tensor_of(rsqrt) is not None and tuple(tensor_of(rsqrt).shape) == (4, 1)


def test_sqrt_read_elsewhere_is_kept():
    gen = torch.Generator().manual_seed(0)
    gm = canonicalize(lambda x, v: x / torch.sqrt(v) + torch.sqrt(v), torch.randn(4, 6, generator=gen),
                      torch.rand(4, 1, generator=gen) + 0.5, **_RSQRT_TOL)
    assert targets(gm).count(torch.sqrt) == 1 and torch.rsqrt in targets(gm) and torch.div not in targets(gm)


def test_one_over_x_is_reciprocal_not_rsqrt():
    gm = canonicalize(lambda v: 1 / v, torch.rand(4, 1) + 0.5)
    assert targets(gm) == [torch.reciprocal]


# ---------------------------------------------------------------------------------------------------
# casts and no-op layout calls
# ---------------------------------------------------------------------------------------------------

CASTS = {
    "float": lambda x, y: x.float(),
    "to-dtype": lambda x, y: x.to(torch.float32),
    "to-dtype-kwarg": lambda x, y: x.to(dtype=torch.float32),
    "type-as": lambda x, y: x.type_as(y),
    "type-dtype": lambda x, y: x.type(torch.float32),
    "to-other-dtype": lambda x, y: x.to(y.dtype),
}


@pytest.mark.parametrize("fn", list(CASTS.values()), ids=list(CASTS))
def test_cast_spellings(fn):
    gm = canonicalize(fn, torch.randn(3, 5, dtype=torch.bfloat16), torch.randn(2))
    (node,) = calls(gm)
    assert node.op == "call_function" and node.target is cast
    assert node.args == (placeholders(gm)[0], torch.float32) and not node.kwargs


@pytest.mark.parametrize("fn,dtype", [
    (lambda x: x.bfloat16(), torch.bfloat16),
    (lambda x: x.half(), torch.float16),
    (lambda x: x.double(), torch.float64),
], ids=["bfloat16", "half", "double"])
def test_other_cast_methods(fn, dtype):
    gm = canonicalize(fn, torch.randn(3, 5))
    (node,) = calls(gm)
    assert node.target is cast and node.args[1] is dtype


NO_OPS = {
    "to-same-dtype": lambda x: x.to(torch.float32) + 1,
    "float-on-fp32": lambda x: x.float() + 1,
    "type-as-same": lambda x: x.type_as(x) + 1,
    "contiguous": lambda x: x.contiguous() + 1,
    "view-same-shape": lambda x: x.view(x.shape) + 1,
    "view-same-sizes": lambda x: x.view(3, 5) + 1,
    "reshape-same-shape": lambda x: x.reshape(3, 5) + 1,
    "torch-reshape-same-shape": lambda x: torch.reshape(x, (3, 5)) + 1,
}


@pytest.mark.parametrize("fn", list(NO_OPS.values()), ids=list(NO_OPS))
def test_no_op_calls_disappear(fn):
    gm = canonicalize(fn, torch.randn(3, 5))
    (node,) = calls(gm)
    assert (node.target, node.args) == (torch.add, (placeholders(gm)[0], 1))


KEPT = {
    "contiguous-of-transpose": (lambda x: x.t().contiguous() + 1, "contiguous"),
    "view-changing-shape": (lambda x: x.view(-1) + 1, "view"),
    "to-with-copy": (lambda x: x.to(torch.float32, copy=True) + 1, "to"),
    # A no-op here (x is contiguous), but a view reads its layout, which a later pass may change upstream
    # (afmoe: sloth.rope changed SDPA's output layout, and the view of its transpose failed).
    "contiguous-read-by-view": (lambda x: x.contiguous().view(15) + 1, "contiguous"),
}


@pytest.mark.parametrize("fn,kept", list(KEPT.values()), ids=list(KEPT))
def test_calls_that_do_something_stay(fn, kept):
    gm = canonicalize(fn, torch.randn(3, 5))
    assert kept in targets(gm)


# ---------------------------------------------------------------------------------------------------
# binary spellings, F.rms_norm keywords, a whole norm, idempotence
# ---------------------------------------------------------------------------------------------------

BINARY = {
    "operator-add": (lambda x, y: x + y, torch.add),
    "method-add": (lambda x, y: x.add(y), torch.add),
    "method-sub": (lambda x, y: x.sub(y), torch.sub),
    "operator-truediv": (lambda x, y: x / y, torch.div),
    "true-divide": (lambda x, y: torch.true_divide(x, y), torch.div),
    "method-mul": (lambda x, y: x.mul(y), torch.mul),
}


@pytest.mark.parametrize("fn,target", list(BINARY.values()), ids=list(BINARY))
def test_binary_spellings(fn, target):
    gm = canonicalize(fn, torch.randn(3, 5), torch.rand(3, 5) + 0.5)
    (node,) = calls(gm)
    assert node.op == "call_function" and node.target is target
    assert node.args == (placeholder(gm, "x"), placeholder(gm, "y")) and not node.kwargs


@pytest.mark.parametrize("fn", [
    lambda x, w: F.rms_norm(x, (5,), weight=w, eps=1e-5),      # Dynamo passes these positionally
    lambda x, w: torch.rms_norm(x, (5,), weight=w, eps=1e-5),  # and these as keywords
], ids=["F.rms_norm", "torch.rms_norm"])
def test_functional_rms_norm_keywords_become_positional(fn):
    gm = canonicalize(fn, torch.randn(3, 5), torch.randn(5))
    (node,) = calls(gm)
    x, w = placeholder(gm, "x"), placeholder(gm, "w")
    assert node.target is torch.rms_norm and node.args == (x, (5,), w, 1e-5) and not node.kwargs


def test_functional_rms_norm_defaults_are_filled_in():
    gm = canonicalize(lambda x: F.rms_norm(x, [5]), torch.randn(3, 5))
    (node,) = calls(gm)
    assert node.target is torch.rms_norm and len(node.args) == 4 and node.args[2:] == (None, None)


def llama_norm(x, w):
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + 1e-6)
    return w * h.to(x.dtype)


def test_whole_llama_norm_is_canonical():
    gm = canonicalize(llama_norm, torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16))
    assert targets(gm) == [cast, torch.square, torch.mean, torch.add, torch.rsqrt, torch.mul, cast, torch.mul]


def test_canonicalize_is_idempotent():
    gm = canonicalize(llama_norm, torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16))
    once = str(gm.graph)
    canonicalize_pass(gm, [], report=Report())
    assert str(gm.graph) == once


def test_shape_arithmetic_is_left_alone():
    # With a dynamic batch, Dynamo records sizes as SymInt nodes; only tensor-valued nodes are rewritten.
    def fn(x):
        return x.view(x.shape[0] * 2, -1) * 2

    captured = {}

    def capture(gm, example_inputs):
        captured["gm"] = canonicalize_pass(gm, example_inputs, report=Report())
        return gm.forward

    x = torch.randn(4, 6)
    torch._dynamo.mark_dynamic(x, 0)
    out = torch.compile(fn, backend=capture)(x)
    torch.testing.assert_close(out, fn(x))
    assert operator.mul in targets(captured["gm"])  # the SymInt product stays an operator.mul


# ---------------------------------------------------------------------------------------------------
# Bugs: rewrites that change a value or crash. Each asserts what the pass promises (values unchanged).
# ---------------------------------------------------------------------------------------------------

def test_view_as_other_dtype_is_kept():
    canonicalize(lambda x: x.view(torch.int32) + 1, torch.randn(3, 5))


def test_integer_sum_over_count_is_not_a_mean():
    canonicalize(lambda x: x.sum(-1, keepdim=True) / 5, torch.randint(0, 9, (3, 5)))


def test_full_torch_sum_divided_does_not_crash():
    canonicalize(lambda x: torch.sum(x) / 15, torch.randn(3, 5))


def test_sum_with_dtype_and_int_dim_divided_does_not_crash():
    canonicalize(lambda x: torch.sum(x, -1, True, dtype=torch.float32) / 5, torch.randn(3, 5, dtype=torch.bfloat16))


def test_sum_with_dtype_divided_keeps_dtype():
    canonicalize(lambda x: torch.sum(x, (-1,), True, dtype=torch.float32) / 5,
                 torch.randn(3, 5, dtype=torch.bfloat16))


def test_integer_pow_float_two_keeps_dtype():
    canonicalize(lambda x: x ** 2.0, torch.randint(-4, 4, (3, 5)))


# ---------------------------------------------------------------------------------------------------
# Slices along one dim, chunk/split, cat, neg (RoPE's rotate_half)
# ---------------------------------------------------------------------------------------------------

SLICES = {  # each is x[..., 2:6] of a [2, 3, 16] x
    "ellipsis-slice": lambda x: x[..., 2:6],
    "full-leading-slices": lambda x: x[:, :, 2:6],
    "method-narrow-positive-dim": lambda x: x.narrow(2, 2, 4),
    "torch-narrow": lambda x: torch.narrow(x, -1, 2, 4),
    "negative-bounds": lambda x: x[..., -14:-10],
    "split-getitem": lambda x: torch.split(x, [2, 4, 10], -1)[1],
    "method-split-negative-index": lambda x: x.split([2, 4, 10], 2)[-2],
}


@pytest.mark.parametrize("fn", list(SLICES.values()), ids=list(SLICES))
def test_slice_spellings(fn):
    gm = canonicalize(fn, torch.randn(2, 3, 16))
    (node,) = calls(gm)
    assert node.op == "call_function" and node.target is torch.narrow
    assert node.args == (placeholders(gm)[0], -1, 2, 4) and not node.kwargs


@pytest.mark.parametrize("fn,start,length", [
    (lambda x: x.chunk(4, dim=-1)[1], 4, 4),
    (lambda x: torch.chunk(x, 3, -1)[2], 12, 4),   # pieces of ceil(16 / 3) = 6: the last has 4
    (lambda x: x.split(6, -1)[-1], 12, 4),
], ids=["chunk", "chunk-uneven", "split-size-uneven"])
def test_chunk_and_split_pieces(fn, start, length):
    gm = canonicalize(fn, torch.randn(2, 3, 16))
    (node,) = calls(gm)
    assert node.target is torch.narrow and node.args == (placeholders(gm)[0], -1, start, length)


def test_chunk_halves_and_split_go_away():
    gm = canonicalize(lambda x: torch.cat(x.chunk(2, -1)[::-1], -1) + torch.cat(x.split(8, -1), -1),
                      torch.randn(3, 16))
    assert not {"chunk", "split", torch.split, operator.getitem} & set(targets(gm))
    narrows = [n.args[1:] for n in calls(gm) if n.target is torch.narrow]
    assert sorted(narrows) == [(-1, 0, 8), (-1, 0, 8), (-1, 8, 8), (-1, 8, 8)]


@pytest.mark.parametrize("fn", [
    lambda x: x[..., :16] + 1,
    lambda x: x[:, 0:] + 1,
    lambda x: x[...] + 1,
    lambda x: x.narrow(-1, 0, 16) + 1,
], ids=["to-the-end", "from-zero", "ellipsis", "narrow-everything"])
def test_slice_of_everything_disappears(fn):
    gm = canonicalize(fn, torch.randn(3, 16))
    (node,) = calls(gm)
    assert (node.target, node.args) == (torch.add, (placeholders(gm)[0], 1))


@pytest.mark.parametrize("fn", [
    lambda x: x[..., ::2] + 1,         # a step: not a narrow
    lambda x: x[..., None, :4] + 1,    # a new axis
    lambda x: x[1:, :4] + 1,           # two dims at once
    lambda x: x[..., 3] + 1,           # an index drops the dim
], ids=["step", "new-axis", "two-dims", "index"])
def test_other_indexing_keeps_its_spelling(fn):
    gm = canonicalize(fn, torch.randn(3, 16))
    assert operator.getitem in targets(gm) and torch.narrow not in targets(gm)


CATS = {
    "torch-cat-dim-kwarg": lambda a, b: torch.cat((a, b), dim=-1),
    "torch-cat-positive-dim": lambda a, b: torch.cat([a, b], 1),
    "torch-concat": lambda a, b: torch.concat((a, b), -1),
    "torch-concatenate-axis": lambda a, b: torch.concatenate([a, b], axis=1),
}


@pytest.mark.parametrize("fn", list(CATS.values()), ids=list(CATS))
def test_cat_spellings(fn):
    gm = canonicalize(fn, torch.randn(3, 5), torch.randn(3, 4))
    (node,) = calls(gm)
    a, b = placeholders(gm)
    assert node.target is torch.cat and node.args == ([a, b], -1) and not node.kwargs


@pytest.mark.parametrize("fn", [lambda x: x * -1, lambda x: -1 * x, lambda x: torch.mul(x, -1.0), lambda x: x.neg(),
                                lambda x: -x], ids=["times-minus-one", "minus-one-times", "float", "method", "operator"])
def test_neg_spellings(fn):
    gm = canonicalize(fn, torch.randn(3, 5))
    (node,) = calls(gm)
    assert node.target is torch.neg and node.args == (placeholders(gm)[0],)


def test_integer_times_minus_one_keeps_dtype():
    canonicalize(lambda x: x * -1, torch.randint(-4, 4, (3, 5)))
    canonicalize(lambda x: x * -1.0, torch.randint(-4, 4, (3, 5)))  # int * float is float: stays a mul


def test_rotate_half_is_canonical_and_idempotent():
    def rope(x, cos, sin):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    gm = canonicalize(rope, torch.randn(2, 3, 16), torch.randn(3, 16), torch.randn(3, 16))
    assert targets(gm) == [torch.narrow, torch.narrow, torch.mul, torch.neg, torch.cat, torch.mul, torch.add]
    once = str(gm.graph)
    canonicalize_pass(gm, [], report=Report())
    assert str(gm.graph) == once


# ---------------------------------------------------------------------------------------------------
# Activations: SiLU and GELU spellings (the gated-MLP family reads only F.silu(x) and gelu(x, a))
# ---------------------------------------------------------------------------------------------------

SILUS = {
    "F.silu": lambda x: F.silu(x),
    "F.silu-inplace-False": lambda x: F.silu(x, inplace=False),
    "nn.SiLU": lambda x: torch.nn.SiLU()(x),
    "C-nn-silu": lambda x: torch._C._nn.silu(x),
    "x-times-sigmoid": lambda x: x * torch.sigmoid(x),
    "sigmoid-times-x": lambda x: torch.sigmoid(x) * x,
    "method-sigmoid-mul": lambda x: x.mul(x.sigmoid()),
}


@pytest.mark.parametrize("fn", list(SILUS.values()), ids=list(SILUS))
def test_silu_spellings(fn):
    gm = canonicalize(fn, torch.randn(3, 5) * 4)
    (node,) = [n for n in calls(gm) if n.target is not torch._C._log_api_usage_once]
    assert node.target is F.silu and node.args == (placeholders(gm)[0],) and not node.kwargs


_K = math.sqrt(2 / math.pi)


def _tanh_formula(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def _fast_gelu(x):  # HF's FastGELUActivation: another arrangement of the same polynomials
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


GELUS = {
    "F.gelu": (lambda x: F.gelu(x), "none"),
    "F.gelu-tanh": (lambda x: F.gelu(x, approximate="tanh"), "tanh"),
    "nn.GELU": (lambda x: torch.nn.GELU()(x), "none"),
    "nn.GELU-tanh": (lambda x: torch.nn.GELU("tanh")(x), "tanh"),
    "tanh-formula": (_tanh_formula, "tanh"),
    "tanh-formula-x-first-pow-operator": (lambda x: x * 0.5 * (1.0 + torch.tanh(_K * (x + 0.044715 * x ** 3))), "tanh"),
    "tanh-formula-fast": (_fast_gelu, "tanh"),
    "erf-formula": (lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))), "none"),
    "erf-formula-method-halved": (lambda x: x * (1 + (x * 0.7071067811865476).erf()) / 2, "none"),
    "erf-formula-special": (lambda x: 0.5 * x * (1 + torch.special.erf(x / 1.4142135623730951)), "none"),
}


@pytest.mark.parametrize("fn,approximate", list(GELUS.values()), ids=list(GELUS))
def test_gelu_spellings(fn, approximate):
    gm = canonicalize(fn, torch.randn(3, 5) * 4, rtol=1e-5, atol=1e-6)
    (node,) = [n for n in calls(gm) if n.target is not torch._C._log_api_usage_once]
    assert node.target is gelu and node.args == (placeholders(gm)[0], approximate) and not node.kwargs


def test_gelu_formula_of_an_arithmetic_input():
    # x is itself a sum (a LoRA projection: base + adapter): the formula is still found around that node.
    def fn(a, b):
        x = a + b
        return _tanh_formula(x)

    gm = canonicalize(fn, torch.randn(3, 5), torch.randn(3, 5), rtol=1e-5, atol=1e-6)
    assert targets(gm) == [torch.add, gelu]


def test_gelu_formula_in_bf16_rounds_once():
    x = torch.randn(64, 64, dtype=torch.bfloat16) * 3
    gm = canonicalize(_tanh_formula, x, rtol=2e-2, atol=2e-2)
    assert targets(gm) == [gelu]
    exact = F.gelu(x.double(), approximate="tanh")
    assert (gm(x)[0].double() - exact).abs().mean() <= (_tanh_formula(x).double() - exact).abs().mean()


def test_sigmoid_read_elsewhere_is_kept():
    def fn(x):
        s = torch.sigmoid(x)
        return x * s + s

    gm = canonicalize(fn, torch.randn(3, 5))
    assert targets(gm) == [torch.sigmoid, F.silu, torch.add]


def test_erf_spellings():
    gm = canonicalize(lambda x: x.erf() + torch.special.erf(x), torch.randn(3, 5))
    assert targets(gm) == [torch.erf, torch.erf, torch.add]


def _tanh_read_twice(x):
    t = torch.tanh(_K * (x + 0.044715 * x ** 3))
    return 0.5 * x * (1 + t) + t


def test_silu_in_place_keeps_its_keyword():
    # A mutation of its input, not just a value: left in its own spelling, which no pattern reads.
    gm = canonicalize(lambda x: F.silu(x * 1.0, inplace=True), torch.randn(3, 5))
    (node,) = [n for n in calls(gm) if n.target is F.silu]
    assert node.kwargs == {"inplace": True}


NOT_ACTIVATIONS = {
    "swish-beta": (lambda x: x * torch.sigmoid(1.5 * x), torch.sigmoid),
    "sigmoid-of-other": (lambda x: x * torch.sigmoid(x + 1), torch.sigmoid),
    "tanh-formula-wrong-k": (lambda x: 0.5 * x * (1 + torch.tanh(0.79 * (x + 0.044715 * x ** 3))), torch.tanh),
    "tanh-formula-wrong-c": (lambda x: 0.5 * x * (1 + torch.tanh(_K * (x + 0.05 * x ** 3))), torch.tanh),
    "tanh-formula-no-half": (lambda x: x * (1 + torch.tanh(_K * (x + 0.044715 * x ** 3))), torch.tanh),
    "tanh-read-twice": (_tanh_read_twice, torch.tanh),
    "erf-formula-other-scale": (lambda x: 0.5 * x * (1 + torch.erf(x / 2)), torch.erf),
    "softcap": (lambda x: torch.tanh(x / 30.0) * 30.0, torch.tanh),
    "gelu-formula-of-int": (lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2.0))), torch.erf),
}


@pytest.mark.parametrize("fn,kept", list(NOT_ACTIVATIONS.values()), ids=list(NOT_ACTIVATIONS))
def test_near_activations_keep_their_spelling(fn, kept):
    x = torch.randint(-4, 4, (3, 5)) if fn is NOT_ACTIVATIONS["gelu-formula-of-int"][0] else torch.randn(3, 5) * 4
    gm = canonicalize(fn, x)
    assert kept in [n.target for n in calls(gm)] and gelu not in targets(gm) and F.silu not in targets(gm)


def test_activations_are_idempotent():
    def fn(x, u):
        return _fast_gelu(x) * u + x * torch.sigmoid(x) + F.gelu(u)

    gm = canonicalize(fn, torch.randn(3, 5), torch.randn(3, 5), rtol=1e-5, atol=1e-6)
    once = str(gm.graph)
    canonicalize_pass(gm, [], report=Report())
    assert str(gm.graph) == once


# ---------------------------------------------------------------------------------------------------
# transposing properties (torch >= 2.14 traces x.T as aten.numpy_T)
# ---------------------------------------------------------------------------------------------------

PROPERTIES = {"T": lambda x, y: x @ y.T, "mT": lambda x, y: x @ y.mT, "H": lambda x, y: x @ y.H,
              "mH": lambda x, y: x @ y.mH}


@pytest.mark.parametrize("name", PROPERTIES)
def test_transposing_properties_are_getattr_whichever_torch_traced(name):
    # Dynamo records getattr(y, "T") up to torch 2.13 and aten.numpy_T(y) (mT, matrix_H, mH) from 2.14: either way
    # the canonical graph holds getattr(y, name), the spelling compiler/fx_utils.py's linear_parts reads.
    gm = canonicalize(PROPERTIES[name], torch.randn(3, 5), torch.randn(4, 5))
    (prop,) = [n for n in calls(gm) if n.target is getattr]
    assert prop.args == (placeholder(gm, "y"), name)


@pytest.mark.parametrize("op, name", [("numpy_T", "T"), ("mT", "mT"), ("matrix_H", "H"), ("mH", "mH")])
def test_aten_property_ops_become_getattr(op, name):
    # The torch >= 2.14 form built by hand, so that torch 2.13 checks the rewrite too: the op as Dynamo records it
    # (the overload packet) and as its default overload.
    for target in (getattr(torch.ops.aten, op), getattr(torch.ops.aten, op).default):
        graph = fx.Graph()
        x, y = graph.placeholder("x"), graph.placeholder("y")
        y.meta["example_value"] = torch.randn(4, 5)
        prop = graph.call_function(target, (y,))
        prop.meta["example_value"] = target(y.meta["example_value"])
        out = graph.call_function(operator.matmul, (x, prop))
        graph.output(out)
        gm = canonicalize_pass(fx.GraphModule(torch.nn.Module(), graph), [], report=Report())
        assert (prop.target, prop.args) == (getattr, (y, name))
        a, b = torch.randn(3, 5), torch.randn(4, 5)
        torch.testing.assert_close(gm(a, b), a @ getattr(b, name))
