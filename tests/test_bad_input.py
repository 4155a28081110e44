"""Bad and unusual input: what each public op, and the backend, does with it (issue 17, section 5).

One table, ``CASES``: a case is an op and an input kind (id ``<op>-<input>``) and the outcome the op must give:

  EAGER          eager PyTorch's answer: the op's pattern function (patterns/*.py; for the 4-bit dequantisation
                 and the MoE routers, which have none, their plain-PyTorch reference) on the same inputs,
                 forward and the gradient of every differentiable input, by the tolerance rule
                 (tests/tolerance.py) against the pattern in float64; bit for bit for the dequantisation, which
                 is exact. NaN where eager has NaN.
  Raises(...)    a TypeError or ValueError whose message names the problem.
  NAN            where eager raises but checking would need a host sync: no error and no crash, a NaN
                 value (never a finite one) and gradients of the inputs' shapes with NaN in them; eager is
                 checked to raise.

Anything else fails the case: an error from inside a kernel (Triton's interpreter, a compile error), an
unclear error, an uninitialised or silently different value. docs/bad_input.md is this table in
words.

The input kinds (tiny shapes: 3 rows, every kernel interpreted on the CPU):

  float64         every float input in float64 (no kernel takes it)
  fp16            every float input in float16 (the dequantisation: an fp16 output)
  non-contiguous  every tensor a view: rows farther apart than their length (``x[:, :D]`` of a wider
                  tensor) and 1-D tensors with stride 2
  transposed      every tensor of 2 or more dims stored with its last two dims swapped (``w.t()``)
  zero-stride     every tensor an ``expand`` of one slice along its first dim of size > 1 (a row, or one
                  element of a 1-D weight, broadcast without a copy), and the cotangents expanded scalars
  empty           0 rows (tokens); the weights keep their sizes
  two-devices     one input on the meta device, the others on the CPU: the one mix a CPU-only machine can
                  make, and one that never reaches the op's own checks (lowering/devices.py says why)

"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sloth
import sloth.lowering.linear_cross_entropy as lce_lowering
from sloth.lowering.glu import glu
from sloth.lowering.glu_lora import glu_lora_linear, register_4bit as register_glu_qlora
from sloth.lowering.linear_cross_entropy import linear_cross_entropy
from sloth.lowering.token_logprobs import linear_token_logprobs
from sloth.lowering.lora import lora_linear
from sloth.lowering.lora_shared import lora_linear_shared, register as register_lora_shared
from sloth.lowering.nf4 import dequantize_4bit, dequantize_4bit_reference
from sloth.lowering.qlora import qlora_linear
from sloth.lowering.l2_norm import l2_norm
from sloth.lowering.layer_norm import layer_norm
from sloth.lowering.rms_norm import rms_norm
from sloth.lowering.norm_rope import norm_rope
from sloth.lowering.rope import rope, rope_single
from sloth.lowering.moe_router import moe_router, moe_router_reference
from sloth.lowering.moe_router_biased import moe_router_biased, moe_router_biased_reference
from sloth.lowering.sink_attention import sink_attention, window_bounds
from sloth.lowering.tiled_mlp import lora_mlp_tiled
from sloth.patterns.cross_entropy import linear_cross_entropy_pattern
from sloth.patterns.token_logprobs import token_logprobs_pattern
from sloth.patterns.glu import swiglu_pattern
from sloth.patterns.lora import lora_pattern
from sloth.patterns.l2_norm import normalize_pattern
from sloth.patterns.layer_norm import layer_norm_pattern
from sloth.patterns.norm_rope import qk_norm_rope_pattern
from sloth.patterns.rms_norm import rms_norm_pattern
from sloth.patterns.rope import rope_rotate_half_pattern, rope_single_pattern
from sloth.patterns.sink_attention import sink_attention_pattern
from op_checks import StayFloat64, force_fallback
from tolerance import ATOL, assert_close, rms

ROWS = 3
EAGER = "eager"
NAN = "nan"


@dataclasses.dataclass(frozen=True)
class Raises:
    error: type
    message: str  # a regex the message must contain


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------
# The ops: how to make their inputs, call them, and call their eager twin
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Op:
    """A public op as the table calls it: ``make(rows, dtype)`` gives its inputs by name (fp32 masters from a
    fixed seed, rounded to ``dtype``); ``fused`` and ``eager`` take them as keywords; ``grads`` names the
    inputs that get a gradient."""
    name: str
    make: Callable[[int, torch.dtype], dict[str, Any]]
    fused: Callable[..., Any]
    eager: Callable[..., Any]
    grads: tuple[str, ...]
    exact: bool = False  # compared bit for bit: the op promises eager's bits


def _rms_norm_inputs(rows, dtype):
    g = seeded(0)
    return dict(x=torch.randn(rows, 8, generator=g).to(dtype), w=(1 + 0.5 * torch.randn(8, generator=g)).to(dtype))


def _layer_norm_inputs(rows, dtype):
    g = seeded(10)
    return dict(x=(torch.randn(rows, 8, generator=g) + 0.5).to(dtype),
                w=(1 + 0.5 * torch.randn(8, generator=g)).to(dtype), b=(0.1 * torch.randn(8, generator=g)).to(dtype))


def _l2_norm_inputs(rows, dtype):
    return dict(x=torch.randn(rows, 8, generator=seeded(11)).to(dtype))


def _rope_tables(rows, dtype, g, shape=()):
    theta = torch.rand(*shape, rows, 4, generator=g) * 3
    return torch.cat([theta, theta], -1).cos().to(dtype), torch.cat([theta, theta], -1).sin().to(dtype)


def _rope_inputs(rows, dtype):
    # [b, h, s, d] q and k (2 and 1 heads), cos/sin [b, s, d] as transformers passes them; rows are positions.
    g = seeded(1)
    q, k = torch.randn(1, 2, rows, 8, generator=g).to(dtype), torch.randn(1, 1, rows, 8, generator=g).to(dtype)
    cos, sin = _rope_tables(rows, dtype, g, (1,))
    return dict(q=q, k=k, cos=cos, sin=sin)


def _rope_single_inputs(rows, dtype):
    g = seeded(2)
    cos, sin = _rope_tables(rows, dtype, g)
    return dict(x=torch.randn(rows, 8, generator=g).to(dtype), cos=cos, sin=sin)


def _norm_rope_inputs(rows, dtype):
    # as _rope_inputs, q and k before their per-head norms, with the norms' weights
    g = seeded(12)
    q, k = torch.randn(1, 2, rows, 8, generator=g).to(dtype), torch.randn(1, 1, rows, 8, generator=g).to(dtype)
    wq, wk = ((1 + 0.5 * torch.randn(8, generator=g)).to(dtype) for _ in range(2))
    cos, sin = _rope_tables(rows, dtype, g, (1,))
    return dict(q=q, k=k, wq=wq, wk=wk, cos=cos, sin=sin)


def _glu_inputs(rows, dtype):
    g = seeded(3)
    return dict(gate=torch.randn(rows, 8, generator=g).to(dtype), up=torch.randn(rows, 8, generator=g).to(dtype))


def _lce_inputs(rows, dtype, vocab=5):
    g = seeded(4)
    return dict(x=torch.randn(rows, 8, generator=g).to(dtype),
                w=(torch.randn(vocab, 8, generator=g) / math.sqrt(8) * 2).to(dtype),
                labels=torch.randint(0, vocab, (rows,), generator=g))


def _lora_inputs(rows, dtype):
    g = seeded(5)
    return dict(x=torch.randn(rows, 16, generator=g).to(dtype), w=(torch.randn(5, 16, generator=g) / 4).to(dtype),
                bias=torch.randn(5, generator=g).to(dtype), a=(torch.randn(2, 16, generator=g) / 4).to(dtype),
                b=(torch.randn(5, 2, generator=g) / 2).to(dtype))


def _lora_shared_inputs(rows, dtype):
    g = seeded(6)
    t = {"x": torch.randn(rows, 16, generator=g)}
    for i, n in enumerate((5, 4)):  # two members of 5 and 4 output features, rank 2
        t[f"w{i}"], t[f"a{i}"] = torch.randn(n, 16, generator=g) / 4, torch.randn(2, 16, generator=g) / 4
        t[f"b{i}"] = torch.randn(n, 2, generator=g) / 2
    return {k: v.to(dtype) for k, v in t.items()}


def _glu_lora_inputs(rows, dtype):
    g = seeded(7)
    t = dict(gate=torch.randn(rows, 8, generator=g), up=torch.randn(rows, 8, generator=g),
             w=torch.randn(5, 8, generator=g) / 3, a=torch.randn(2, 8, generator=g) / 3,
             b=torch.randn(5, 2, generator=g) / 2)
    return {k: v.to(dtype) for k, v in t.items()}


# A 4-bit weight [5, 64] in blocks of 64: random codes and absmax are as valid as bitsandbytes' own
# (tests/test_nf4_op.py checks the reference against bitsandbytes bit for bit).
NF4_SHAPE, NF4_BLOCK = (5, 64), 64


def _nf4_weight(g, n_out: int):
    numel = n_out * NF4_SHAPE[1]
    return (torch.randint(0, 256, (numel // 2,), generator=g, dtype=torch.uint8),
            torch.rand(numel // NF4_BLOCK, generator=g) + 0.5)


def _nf4_inputs(rows, dtype):
    # rows: output rows of the weight (the 4-bit op's "batch")
    packed, absmax = _nf4_weight(seeded(8), rows)
    return dict(packed=packed, absmax=absmax, shape=(rows, NF4_SHAPE[1]), dtype=dtype)


def _qlora_inputs(rows, dtype):
    g = seeded(9)
    packed, absmax = _nf4_weight(g, NF4_SHAPE[0])
    return dict(x=torch.randn(rows, 64, generator=g).to(dtype), packed=packed, absmax=absmax,
                a=(torch.randn(2, 64, generator=g) / 8).to(dtype), b=(torch.randn(5, 2, generator=g) / 2).to(dtype))


def _tiled_mlp_inputs(rows, dtype):
    # a LoRA MLP: gate and up [8, 16], down [5, 8], rank 2 each
    g = seeded(18)
    t = {"x": torch.randn(rows, 16, generator=g)}
    for name, (n, k) in (("g", (8, 16)), ("u", (8, 16)), ("d", (5, 8))):
        t[f"w{name}"], t[f"a{name}"] = torch.randn(n, k, generator=g) / 4, torch.randn(2, k, generator=g) / 4
        t[f"b{name}"] = torch.randn(n, 2, generator=g) / 2
    return {k: v.to(dtype) for k, v in t.items()}


def _qlora_weight(packed, absmax, dtype, n_out: int = NF4_SHAPE[0]):
    return dequantize_4bit_reference(packed, absmax, NF4_BLOCK, "nf4", (n_out, NF4_SHAPE[1]), dtype)


def _qlora_shared_inputs(rows, dtype):
    # as _lora_shared_inputs over 4-bit bases: two members of 5 and 4 output features, rank 2
    g = seeded(16)
    t = {"x": torch.randn(rows, 64, generator=g).to(dtype)}
    for i, n in enumerate((5, 4)):
        t[f"packed{i}"], t[f"absmax{i}"] = _nf4_weight(g, n)
        t[f"a{i}"] = (torch.randn(2, 64, generator=g) / 8).to(dtype)
        t[f"b{i}"] = (torch.randn(n, 2, generator=g) / 2).to(dtype)
    return t


def _qlora_shared(x, packed0, absmax0, a0, b0, packed1, absmax1, a1, b1):
    """``torch.ops.sloth.qlora_linear_shared`` (no Python wrapper: the pass calls the op) without double
    quantisation, as its two members' outputs."""
    register_lora_shared()
    *ys, _ = torch.ops.sloth.qlora_linear_shared(x, [packed0, packed1], [absmax0, absmax1], [], [], [], [5, 4],
                                                 NF4_SHAPE[1], NF4_BLOCK, "nf4", [None, None], torch.cat([a0, a1]),
                                                 [b0, b1], 2.0)
    return tuple(ys)


def _glu_qlora_inputs(rows, dtype):
    # as _glu_lora_inputs over a 4-bit base [5, 64]
    g = seeded(17)
    packed, absmax = _nf4_weight(g, NF4_SHAPE[0])
    t = dict(gate=torch.randn(rows, 64, generator=g), up=torch.randn(rows, 64, generator=g),
             a=torch.randn(2, 64, generator=g) / 8, b=torch.randn(5, 2, generator=g) / 2)
    return {**{k: v.to(dtype) for k, v in t.items()}, "packed": packed, "absmax": absmax}


def _glu_qlora(gate, up, packed, absmax, a, b):
    """``torch.ops.sloth.glu_qlora_linear`` (no Python wrapper: the pass calls the op) without double
    quantisation."""
    register_glu_qlora()
    y, _ = torch.ops.sloth.glu_qlora_linear(gate, up, "silu", packed, absmax, None, None, None, *NF4_SHAPE,
                                            NF4_BLOCK, "nf4", None, a, b, 2.0)
    return y


SINK_WINDOW = 2  # narrower than the 3 tokens: the window's start moves


def _sink_attention_inputs(rows, dtype):
    # [b, h, s, d] q (2 heads), k and v (1 head: grouped), one sink logit per query head; rows are tokens.
    g = seeded(13)
    t = dict(q=torch.randn(1, 2, rows, 8, generator=g), k=torch.randn(1, 1, rows, 8, generator=g),
             v=torch.randn(1, 1, rows, 8, generator=g), sinks=torch.randn(2, generator=g))
    return {k: v.to(dtype) for k, v in t.items()}


def _window_mask(tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive [T, T] mask of the causal window the op is given: 0 where i - W < j <= i, -inf elsewhere."""
    i = torch.arange(tokens)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - SINK_WINDOW)
    return torch.zeros(tokens, tokens, dtype=dtype).masked_fill(~allowed, float("-inf"))


def _router_inputs(rows, dtype):
    # 8 experts; no two logits of a row tie, in fp16 either (the chosen experts do not depend on rounding)
    return dict(logits=torch.randn(rows, 8, generator=seeded(14)).to(dtype))


def _router_biased_inputs(rows, dtype):
    g = seeded(15)
    return dict(logits=torch.randn(rows, 8, generator=g).to(dtype), bias=(0.5 * torch.randn(8, generator=g)).to(dtype))


def _routed(w: torch.Tensor, idx: torch.Tensor, experts: int = 8) -> torch.Tensor:
    """The routing as one dense [T, E] tensor (w at the chosen experts, 0 elsewhere): a wrong index is a wrong
    value, and the weights keep their gradient."""
    return torch.zeros(w.shape[0], experts, dtype=w.dtype, device=w.device).scatter(1, idx, w)


RMS_NORM = Op("rms_norm", _rms_norm_inputs, lambda x, w: rms_norm(x, w, 1e-6),
              lambda x, w: rms_norm_pattern(x, w, 1e-6), grads=("x", "w"))
LAYER_NORM = Op("layer_norm", _layer_norm_inputs, lambda x, w, b: layer_norm(x, w, b, 1e-5),
                lambda x, w, b: layer_norm_pattern(x, w, b, 1e-5), grads=("x", "w", "b"))
L2_NORM = Op("l2_norm", _l2_norm_inputs, lambda x: l2_norm(x, 1e-6, True), lambda x: normalize_pattern(x, 1e-6),
             grads=("x",))
ROPE = Op("rope", _rope_inputs, lambda q, k, cos, sin: rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1)),
          rope_rotate_half_pattern, grads=("q", "k"))  # cos/sin get no gradient from the op (it refuses)
ROPE_SINGLE = Op("rope_single", _rope_single_inputs, rope_single, rope_single_pattern, grads=("x",))
NORM_ROPE = Op("norm_rope", _norm_rope_inputs,
               lambda q, k, wq, wk, cos, sin: norm_rope(q, k, wq, wk, cos.unsqueeze(1), sin.unsqueeze(1)),
               lambda q, k, wq, wk, cos, sin: qk_norm_rope_pattern(q, k, wq, wk, cos, sin),
               grads=("q", "k", "wq", "wk"))
GLU = Op("glu", _glu_inputs, lambda gate, up: glu(gate, up, "silu"), swiglu_pattern, grads=("gate", "up"))
LCE = Op("linear_cross_entropy", _lce_inputs, lambda x, w, labels: linear_cross_entropy(x, w, None, labels),
         lambda x, w, labels: linear_cross_entropy_pattern(x, w, None, labels), grads=("x", "w"))
TOKEN_LOGPROBS = Op("linear_token_logprobs", _lce_inputs,
                    lambda x, w, labels: linear_token_logprobs(x, w, None, labels, entropy=True),
                    lambda x, w, labels: token_logprobs_pattern(x, w, None, labels, entropy=True), grads=("x", "w"))
LORA = Op("lora_linear", _lora_inputs, lambda x, w, bias, a, b: lora_linear(x, w, bias, a, b, 2.0),
          lambda x, w, bias, a, b: lora_pattern(x, w, bias, a, b, 2.0), grads=("x", "a", "b"))
LORA_SHARED = Op(
    "lora_linear_shared", _lora_shared_inputs,
    lambda x, w0, a0, b0, w1, a1, b1: tuple(lora_linear_shared(x, [w0, w1], [None, None], [a0, a1], [b0, b1], 2.0)),
    lambda x, w0, a0, b0, w1, a1, b1: (lora_pattern(x, w0, None, a0, b0, 2.0), lora_pattern(x, w1, None, a1, b1, 2.0)),
    grads=("x", "a0", "b0", "a1", "b1"))
GLU_LORA = Op("glu_lora_linear", _glu_lora_inputs,
              lambda gate, up, w, a, b: glu_lora_linear(gate, up, "silu", w, None, a, b, 2.0),
              lambda gate, up, w, a, b: lora_pattern(swiglu_pattern(gate, up), w, None, a, b, 2.0),
              grads=("gate", "up", "a", "b"))
QLORA = Op("qlora_linear", _qlora_inputs,
           lambda x, packed, absmax, a, b: qlora_linear(x, packed, absmax, *NF4_SHAPE, NF4_BLOCK, "nf4", None, a, b,
                                                        2.0),
           lambda x, packed, absmax, a, b: lora_pattern(x, _qlora_weight(packed, absmax, x.dtype), None, a, b, 2.0),
           grads=("x", "a", "b"))
SINK_ATTENTION = Op(
    "sink_attention", _sink_attention_inputs,
    lambda q, k, v, sinks: sink_attention(q, k, v, sinks, window_bounds(q, SINK_WINDOW), 8 ** -0.5),
    lambda q, k, v, sinks: sink_attention_pattern(q, k, v, sinks, _window_mask(q.shape[2], q.dtype), 8 ** -0.5),
    grads=("q", "k", "v", "sinks"))
# softmax over the 8 experts, top 2, renormalised (Mixtral); the routers have no pattern function: their eager twin
# is the lowering's plain-PyTorch reference (fp32 inside, as transformers' routers)
MOE_ROUTER = Op("moe_router", _router_inputs,
                lambda logits: _routed(*moe_router(logits, 2, True, True)),
                lambda logits: _routed(*moe_router_reference(logits, 2, True, True, torch.float32)),
                grads=("logits",))
# sigmoid scores plus the bias choose 2 experts within the best 1 of 2 groups (DeepSeek-V3's router, small)
_BIASED = dict(k=2, score="sigmoid", choose_logits=False, n_group=2, topk_group=1, group_top2=True,
               fill=float("-inf"), renorm=1, eps=1e-20)
MOE_ROUTER_BIASED = Op(
    "moe_router_biased", _router_biased_inputs,
    lambda logits, bias: _routed(*moe_router_biased(logits, bias, **_BIASED)),
    lambda logits, bias: _routed(*moe_router_biased_reference(logits, bias, **_BIASED, out_dtype=torch.float32)),
    grads=("logits",))  # the bias only chooses: no gradient, as in eager
QLORA_SHARED = Op(
    "qlora_linear_shared", _qlora_shared_inputs, _qlora_shared,
    lambda x, packed0, absmax0, a0, b0, packed1, absmax1, a1, b1: (
        lora_pattern(x, _qlora_weight(packed0, absmax0, x.dtype, 5), None, a0, b0, 2.0),
        lora_pattern(x, _qlora_weight(packed1, absmax1, x.dtype, 4), None, a1, b1, 2.0)),
    grads=("x", "a0", "b0", "a1", "b1"))
GLU_QLORA = Op("glu_qlora_linear", _glu_qlora_inputs, _glu_qlora,
               lambda gate, up, packed, absmax, a, b: lora_pattern(swiglu_pattern(gate, up),
                                                                   _qlora_weight(packed, absmax, gate.dtype), None, a,
                                                                   b, 2.0),
               grads=("gate", "up", "a", "b"))
# two rows a block: 3 rows make a full block and a partial one
TILED_MLP = Op(
    "lora_mlp_tiled", _tiled_mlp_inputs,
    lambda x, wg, ag, bg, wu, au, bu, wd, ad, bd: lora_mlp_tiled(x, [wg, wu], [None, None], [ag, au], [bg, bu], 2.0,
                                                                 "silu", wd, None, ad, bd, 2.0, tile_rows=2),
    lambda x, wg, ag, bg, wu, au, bu, wd, ad, bd: lora_pattern(
        swiglu_pattern(lora_pattern(x, wg, None, ag, bg, 2.0), lora_pattern(x, wu, None, au, bu, 2.0)), wd, None, ad,
        bd, 2.0),
    grads=("x", "ag", "bg", "au", "bu", "ad", "bd"))
NF4 = Op("dequantize_4bit", _nf4_inputs,
         lambda packed, absmax, shape, dtype: dequantize_4bit(packed, absmax, NF4_BLOCK, "nf4", shape, dtype),
         lambda packed, absmax, shape, dtype: dequantize_4bit_reference(packed, absmax, NF4_BLOCK, "nf4", shape, dtype),
         grads=(), exact=True)


# ---------------------------------------------------------------------------------------------------
# The input kinds
# ---------------------------------------------------------------------------------------------------

def _tensors(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def _row_padded(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view: rows 3 elements farther apart than their length (2+ dims), stride 2 (1-D)."""
    if t.dim() == 1:
        return torch.stack([t, torch.zeros_like(t)], -1)[:, 0]
    return F.pad(t, (0, 3))[..., :t.shape[-1]]


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values stored with the last two dims swapped (a 1-D tensor as it is)."""
    return t if t.dim() < 2 else t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _zero_stride(t: torch.Tensor) -> torch.Tensor:
    """One slice expanded (stride 0) along the first dim of size > 1."""
    d = next((i for i, s in enumerate(t.shape) if s > 1), None)
    return t if d is None else t.narrow(d, 0, 1).expand(t.shape)


def _relaid(op: Op, relay: Callable[[torch.Tensor], torch.Tensor], changed: Callable[[torch.Tensor], bool]):
    """fp32 inputs with every tensor passed through ``relay``; ``changed`` tells a relaid tensor (one must be)."""
    inputs = op.make(ROWS, torch.float32)
    inputs.update({k: relay(v) for k, v in _tensors(inputs).items()})
    assert any(changed(t) for t in _tensors(inputs).values()), f"{op.name}: the layout changed no input"
    return inputs


def _on_meta(op: Op, name: str):
    inputs = op.make(ROWS, torch.float32)
    inputs[name] = inputs[name].to("meta")
    return inputs


INPUTS: dict[str, Callable[..., dict[str, Any]]] = {
    "float64": lambda op: op.make(ROWS, torch.float64),
    "fp16": lambda op: op.make(ROWS, torch.float16),
    "non-contiguous": lambda op: _relaid(op, _row_padded, lambda t: not t.is_contiguous()),
    "transposed": lambda op: _relaid(op, _transposed, lambda t: not t.is_contiguous()),
    "zero-stride": lambda op: _relaid(op, _zero_stride, lambda t: 0 in t.stride()),
    "empty": lambda op: op.make(0, torch.float32),
    "two-devices": _on_meta,  # with the name of the input put on "meta"
}


def _lce_with(**changes):
    """linear_cross_entropy's fp32 inputs with some replaced: ``labels`` as a function of the vocabulary,
    ``vocab`` the vocabulary size."""
    def make(op):
        vocab = changes.get("vocab", 5)
        inputs = _lce_inputs(ROWS, torch.float32, vocab)
        if "labels" in changes:
            inputs["labels"] = changes["labels"](vocab)
        return inputs
    return make


EXTRA_INPUTS = {
    "all-ignored": _lce_with(labels=lambda v: torch.full((ROWS,), -100)),
    "vocab-1": _lce_with(vocab=1, labels=lambda v: torch.zeros(ROWS, dtype=torch.long)),
    "labels-out-of-range": _lce_with(labels=lambda v: torch.tensor([0, v, -1])),  # -1 is not the ignore_index
    "labels-int32": _lce_with(labels=lambda v: torch.tensor([0, 1, 2], dtype=torch.int32)),
}


# ---------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------

def case(op: Op, kind: str, expect, *args):
    """One row: ``op`` on input ``kind`` (with ``args`` for the kind, e.g. which input goes to meta)."""
    return pytest.param(op, kind, args, expect, id=f"{op.name}-{kind}")


F64 = r"must be float32, bfloat16 or float16, got torch\.float64"
F64_SHARED = r"must share one of float32, bfloat16, float16, got torch\.float64"


def _device(name: str, first: str) -> str:
    return rf"{name} is on meta but {first} is on cpu"


CASES = [
    case(RMS_NORM, "float64", Raises(TypeError, "sloth.rms_norm: x " + F64)),
    case(RMS_NORM, "fp16", EAGER),
    case(RMS_NORM, "non-contiguous", EAGER),  # the kernels read a strided weight as contiguous before issue 17
    case(RMS_NORM, "transposed", EAGER),
    case(RMS_NORM, "zero-stride", EAGER),  # and an expanded one
    case(RMS_NORM, "empty", EAGER),
    case(RMS_NORM, "two-devices", Raises(ValueError, "sloth.rms_norm: " + _device("weight", "x")), "w"),

    case(LAYER_NORM, "float64", Raises(TypeError, "sloth.layer_norm: x " + F64)),
    case(LAYER_NORM, "fp16", EAGER),
    case(LAYER_NORM, "non-contiguous", EAGER),
    case(LAYER_NORM, "transposed", EAGER),
    case(LAYER_NORM, "zero-stride", EAGER),
    case(LAYER_NORM, "empty", EAGER),
    case(LAYER_NORM, "two-devices", Raises(ValueError, "sloth.layer_norm: " + _device("weight", "x")), "w"),

    case(L2_NORM, "float64", Raises(TypeError, "sloth.l2_norm: x " + F64)),
    case(L2_NORM, "fp16", EAGER),
    case(L2_NORM, "non-contiguous", EAGER),
    case(L2_NORM, "transposed", EAGER),
    case(L2_NORM, "zero-stride", EAGER),
    case(L2_NORM, "empty", EAGER),

    case(ROPE, "float64", Raises(TypeError, "sloth.rope: x " + F64)),
    case(ROPE, "fp16", EAGER),
    case(ROPE, "non-contiguous", EAGER),
    case(ROPE, "transposed", EAGER),
    case(ROPE, "zero-stride", EAGER),
    case(ROPE, "empty", EAGER),
    case(ROPE, "two-devices", Raises(ValueError, "sloth.rope: " + _device("cos", "x")), "cos"),

    case(ROPE_SINGLE, "float64", Raises(TypeError, "sloth.rope: x " + F64)),
    case(ROPE_SINGLE, "fp16", EAGER),
    case(ROPE_SINGLE, "non-contiguous", EAGER),
    case(ROPE_SINGLE, "transposed", EAGER),
    case(ROPE_SINGLE, "zero-stride", EAGER),
    case(ROPE_SINGLE, "empty", EAGER),
    case(ROPE_SINGLE, "two-devices", Raises(ValueError, "sloth.rope: " + _device("sin", "x")), "sin"),

    case(NORM_ROPE, "float64", Raises(TypeError, "sloth.norm_rope: x " + F64)),
    case(NORM_ROPE, "fp16", EAGER),
    case(NORM_ROPE, "non-contiguous", EAGER),
    case(NORM_ROPE, "transposed", EAGER),
    case(NORM_ROPE, "zero-stride", EAGER),
    case(NORM_ROPE, "empty", EAGER),
    case(NORM_ROPE, "two-devices", Raises(ValueError, "sloth.norm_rope: " + _device("k_weight", "q")), "wk"),

    case(GLU, "float64", Raises(TypeError, "sloth.glu: gate " + F64)),
    case(GLU, "fp16", EAGER),
    case(GLU, "non-contiguous", EAGER),
    case(GLU, "transposed", EAGER),
    case(GLU, "zero-stride", EAGER),
    case(GLU, "empty", EAGER),
    case(GLU, "two-devices", Raises(ValueError, "sloth.glu: " + _device("up", "gate")), "up"),

    case(LCE, "float64", Raises(TypeError, "sloth.linear_cross_entropy: x and w " + F64_SHARED)),
    case(LCE, "fp16", EAGER),
    case(LCE, "non-contiguous", EAGER),
    case(LCE, "transposed", EAGER),
    case(LCE, "zero-stride", EAGER),
    case(LCE, "empty", EAGER),  # the mean over no tokens: nan, as eager
    case(LCE, "all-ignored", EAGER),  # the mean over no counted tokens: nan, and zero gradients, as eager
    case(LCE, "vocab-1", EAGER),
    # Eager raises (IndexError); the kernel's loss and the offending rows' gradients are NaN, as checking would
    # need a host sync (lowering/linear_cross_entropy.py's docstring).
    case(LCE, "labels-out-of-range", NAN),
    case(LCE, "two-devices", Raises(ValueError, "sloth.linear_cross_entropy: " + _device("w", "x")), "w"),
    case(LCE, "labels-int32", Raises(ValueError, r"sloth.linear_cross_entropy: labels must be int64 .*torch\.int32")),

    case(TOKEN_LOGPROBS, "float64", Raises(TypeError, "sloth.linear_token_logprobs: x and w " + F64_SHARED)),
    case(TOKEN_LOGPROBS, "fp16", EAGER),
    case(TOKEN_LOGPROBS, "non-contiguous", EAGER),
    case(TOKEN_LOGPROBS, "transposed", EAGER),
    case(TOKEN_LOGPROBS, "zero-stride", EAGER),
    case(TOKEN_LOGPROBS, "empty", EAGER),
    case(TOKEN_LOGPROBS, "vocab-1", EAGER),
    # Eager's gather raises; the kernel makes the offending rows NaN (lowering/token_logprobs.py's docstring).
    case(TOKEN_LOGPROBS, "labels-out-of-range", NAN),
    case(TOKEN_LOGPROBS, "two-devices", Raises(ValueError, "sloth.linear_token_logprobs: " + _device("w", "x")), "w"),
    case(TOKEN_LOGPROBS, "labels-int32",
         Raises(ValueError, r"sloth.linear_token_logprobs: labels must be int64 .*torch\.int32")),

    case(LORA, "float64", Raises(TypeError, r"sloth.lora_linear: x, w \(and bias\) " + F64_SHARED)),
    case(LORA, "fp16", EAGER),
    case(LORA, "non-contiguous", EAGER),
    case(LORA, "transposed", EAGER),
    case(LORA, "zero-stride", EAGER),
    case(LORA, "empty", EAGER),
    case(LORA, "two-devices", Raises(ValueError, "sloth.lora_linear: " + _device("a", "x")), "a"),

    # The shared op checks each member as lora_linear does, under that name.
    case(LORA_SHARED, "float64", Raises(TypeError, r"sloth.lora_linear: x, w \(and bias\) " + F64_SHARED)),
    case(LORA_SHARED, "fp16", EAGER),
    case(LORA_SHARED, "non-contiguous", EAGER),
    case(LORA_SHARED, "transposed", EAGER),
    case(LORA_SHARED, "zero-stride", EAGER),
    case(LORA_SHARED, "empty", EAGER),
    case(LORA_SHARED, "two-devices", Raises(ValueError, r"sloth.lora_linear_shared: " + _device(r"ws\[1\]", "x")),
         "w1"),

    case(GLU_LORA, "float64", Raises(TypeError, "sloth.glu: gate " + F64)),
    case(GLU_LORA, "fp16", EAGER),
    case(GLU_LORA, "non-contiguous", EAGER),
    case(GLU_LORA, "transposed", EAGER),
    case(GLU_LORA, "zero-stride", EAGER),
    case(GLU_LORA, "empty", EAGER),
    case(GLU_LORA, "two-devices", Raises(ValueError, "sloth.glu_lora_linear: " + _device("up", "gate")), "up"),

    case(QLORA, "float64", Raises(TypeError, "sloth.qlora_linear: x " + F64)),
    case(QLORA, "fp16", EAGER),
    case(QLORA, "non-contiguous", EAGER),
    case(QLORA, "transposed", EAGER),
    case(QLORA, "zero-stride", EAGER),
    case(QLORA, "empty", EAGER),
    case(QLORA, "two-devices", Raises(ValueError, "sloth.qlora_linear: " + _device("a", "x")), "a"),

    # The op checks q, k, v and the bounds as document attention does, under that name.
    case(SINK_ATTENTION, "float64", Raises(ValueError, r"sloth.document_attention: q has dtype torch\.float64")),
    case(SINK_ATTENTION, "fp16", EAGER),
    case(SINK_ATTENTION, "non-contiguous", EAGER),
    case(SINK_ATTENTION, "transposed", EAGER),
    case(SINK_ATTENTION, "zero-stride", EAGER),
    case(SINK_ATTENTION, "empty", EAGER),
    case(SINK_ATTENTION, "two-devices", Raises(ValueError, "sloth.sink_attention: " + _device("sinks", "q")), "sinks"),

    case(MOE_ROUTER, "float64", Raises(ValueError, r"sloth.moe_router: logits must be a float32/bfloat16/float16 "
                                                   r"\[tokens, experts\] tensor, got torch\.float64")),
    case(MOE_ROUTER, "fp16", EAGER),
    case(MOE_ROUTER, "non-contiguous", EAGER),
    case(MOE_ROUTER, "transposed", EAGER),
    case(MOE_ROUTER, "zero-stride", EAGER),
    case(MOE_ROUTER, "empty", EAGER),

    case(MOE_ROUTER_BIASED, "float64", Raises(ValueError, r"sloth.moe_router_biased: logits must be a "
                                                          r"float32/bfloat16/float16 \[tokens, experts\] tensor, got "
                                                          r"torch\.float64")),
    case(MOE_ROUTER_BIASED, "fp16", EAGER),
    case(MOE_ROUTER_BIASED, "non-contiguous", EAGER),
    case(MOE_ROUTER_BIASED, "transposed", EAGER),
    case(MOE_ROUTER_BIASED, "zero-stride", EAGER),
    case(MOE_ROUTER_BIASED, "empty", EAGER),
    # Found by this row: the op checked no devices and returned uninitialised weights and indices.
    case(MOE_ROUTER_BIASED, "two-devices", Raises(ValueError, "sloth.moe_router_biased: " + _device("bias", "logits")),
         "bias"),

    # The 4-bit ops dequantise their bases first: a float64 input asks the dequantisation for a float64 weight.
    # The two-devices rows found that their fakes checked no devices: a meta input beside CPU ones returned
    # uninitialised outputs.
    case(QLORA_SHARED, "float64", Raises(TypeError, "sloth.nf4: dtype " + F64)),
    case(QLORA_SHARED, "fp16", EAGER),
    case(QLORA_SHARED, "non-contiguous", EAGER),
    case(QLORA_SHARED, "transposed", EAGER),
    case(QLORA_SHARED, "zero-stride", EAGER),
    case(QLORA_SHARED, "empty", EAGER),
    case(QLORA_SHARED, "two-devices", Raises(ValueError, r"sloth.qlora_linear_shared: " + _device(r"bs\[1\]", "x")),
         "b1"),

    case(GLU_QLORA, "float64", Raises(TypeError, "sloth.nf4: dtype " + F64)),
    case(GLU_QLORA, "fp16", EAGER),
    case(GLU_QLORA, "non-contiguous", EAGER),
    case(GLU_QLORA, "transposed", EAGER),
    case(GLU_QLORA, "zero-stride", EAGER),
    case(GLU_QLORA, "empty", EAGER),
    case(GLU_QLORA, "two-devices", Raises(ValueError, "sloth.glu_qlora_linear: " + _device("a", "gate")), "a"),

    # The tiled MLP checks its projections as lora_linear does, under that name.
    case(TILED_MLP, "float64", Raises(TypeError, r"sloth.lora_linear: x, w \(and bias\) " + F64_SHARED)),
    case(TILED_MLP, "fp16", EAGER),
    case(TILED_MLP, "non-contiguous", EAGER),
    case(TILED_MLP, "transposed", EAGER),
    case(TILED_MLP, "zero-stride", EAGER),
    case(TILED_MLP, "empty", EAGER),
    case(TILED_MLP, "two-devices", Raises(ValueError, "sloth.lora_mlp_tiled: " + _device("a_d", "x")), "ad"),

    case(NF4, "float64", Raises(TypeError, "sloth.nf4: dtype " + F64)),
    case(NF4, "fp16", EAGER),
    case(NF4, "non-contiguous", EAGER),  # packed and absmax are 1-D: "transposed" changes nothing
    case(NF4, "zero-stride", EAGER),
    case(NF4, "empty", EAGER),
    case(NF4, "two-devices", Raises(ValueError, "sloth.nf4: " + _device("absmax", "packed")), "absmax"),
]


# ---------------------------------------------------------------------------------------------------
# Running a case
# ---------------------------------------------------------------------------------------------------

def forward_backward(fn: Callable[..., Any], inputs: dict[str, Any], grads: tuple[str, ...],
                     expanded_cotangents: bool = False) -> dict[str, torch.Tensor]:
    """``fn``'s outputs (``y0``, ``y1``, ...) and, for seeded cotangents, the gradients ``d<name>`` of ``grads``;
    ``expanded_cotangents``: each cotangent one value expanded (stride 0), as ``y.sum().backward()`` hands it."""
    # detach, not clone: a leaf keeps its view's layout (and an expand its zero stride)
    leaves = {k: v.detach().requires_grad_(True) if k in grads else v for k, v in inputs.items()}
    out = fn(**leaves)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    result = {f"y{i}": o.detach() for i, o in enumerate(outs)}
    if grads:
        g = seeded(10)
        cotangents = [torch.randn(() if expanded_cotangents else o.shape, generator=g).to(o.dtype).expand(o.shape)
                      for o in outs]
        result.update(zip((f"d{k}" for k in grads), torch.autograd.grad(outs, [leaves[k] for k in grads], cotangents)))
    return result


def _in_float64(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def _assert_matches_eager(name: str, ours: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor,
                          operand_scale: float = 0.0) -> None:
    """The tolerance rule, with NaN required exactly where eager has it (and the rest compared). ``operand_scale``
    (the largest RMS of the op's float inputs) is tests/tolerance.py's: units of roundoff at the operands' size. These
    inputs make results that cancel (a head of identical rows gives dx = sum_v (p_v - y_v) w_v = 0 exactly, so any
    error is roundoff of the terms, not of the result) or sum many equal rows in another order (a zero-stride x's
    db)."""
    nan = torch.isnan(eager)
    assert torch.equal(torch.isnan(ours), nan), f"{name}: NaN at other places than eager's"
    if nan.any():
        ours, eager, reference = ours[~nan], eager[~nan], reference[~nan]
    # A scalar cannot carry the 2x rule (eager's fp32 sum can land within 1e-9 of fp64 by luck, as in
    # tests/test_linear_cross_entropy_op.py): scalars get two units of roundoff of their size on top.
    atol = None
    if eager.dim() == 0 and eager.numel():
        atol = ATOL[eager.dtype] + 2 * torch.finfo(eager.dtype).eps * reference.abs().item()
    assert_close(name, ours, eager, reference, atol=atol, operand_scale=operand_scale)


@pytest.mark.parametrize("op,kind,args,expect", CASES)
def test_bad_input(op: Op, kind: str, args: tuple, expect):
    make = EXTRA_INPUTS.get(kind) or INPUTS[kind]
    inputs = make(op, *args)
    run = functools.partial(forward_backward, grads=op.grads, expanded_cotangents=kind == "zero-stride")
    if isinstance(expect, Raises):
        with pytest.raises(expect.error, match=expect.message):
            run(op.fused, inputs)
        return
    ours = run(op.fused, inputs)
    if expect == NAN:
        with pytest.raises((IndexError, RuntimeError), match="out of bounds"):  # cross_entropy's, gather's
            op.eager(**inputs)  # eager refuses the input: it is bad, not merely unusual
        for name, t in ours.items():
            assert t.isnan().any(), f"{name}: no NaN"
            if name.startswith("d"):
                source = inputs[name[1:]]
                assert (t.shape, t.dtype) == (source.shape, source.dtype), f"{name}: not the input's shape and dtype"
        return
    assert expect == EAGER
    eager = run(op.eager, inputs)
    assert ours.keys() == eager.keys()
    if op.exact:
        for name in eager:
            assert ours[name].dtype == eager[name].dtype and torch.equal(ours[name], eager[name]), \
                f"{name}: not eager's bits"
        return
    with StayFloat64():
        reference = run(op.eager, _in_float64(inputs))
    for name in eager:
        assert reference[name].dtype == torch.float64, f"{name}: the reference is not float64"
        _assert_matches_eager(name, ours[name], eager[name], reference[name], operand_scale=max(
            (rms(v) for v in inputs.values() if isinstance(v, torch.Tensor) and v.is_floating_point()), default=0.0))


def test_out_of_range_labels_raise_on_the_pytorch_fallback(monkeypatch):
    # Where Triton cannot run on CPU tensors, the op's PyTorch path checks the labels (host memory, no sync) and
    # raises IndexError, as eager does; the kernel (the table's case) makes the loss NaN instead.
    force_fallback(monkeypatch, lce_lowering, "_lce_rows_kernel")
    with pytest.raises(IndexError, match="out of bounds"):
        LCE.fused(**EXTRA_INPUTS["labels-out-of-range"](LCE))


# ---------------------------------------------------------------------------------------------------
# The backend on a graph with nothing to replace
# ---------------------------------------------------------------------------------------------------

def test_backend_on_a_graph_with_no_sites_runs_as_eager_and_replaces_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(ROWS, 8)
    compiled = torch.compile(model, backend="sloth")
    results = []
    for fn in (compiled, model):
        model.zero_grad()
        y = fn(x)
        y.sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in model.parameters()])
    for name, ours, eager in zip(["y"] + [n for n, _ in model.named_parameters()], *results):
        torch.testing.assert_close(ours, eager, msg=lambda m: f"{name}: {m}")
    report = sloth.report()
    assert report.graphs >= 1, "sloth never saw the graph"
    assert report.sites == [] and "nothing replaced" in str(report), str(report)
