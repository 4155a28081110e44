"""Attention with sinks under a causal or sliding-window mask: ``torch.ops.sloth.sink_attention`` and its backward.

GPT-OSS gives each query head h one learned logit ``sink[h]`` that joins every row's softmax and is then
dropped: it takes probability mass without contributing a value. With the row's allowed keys
``start[b, i] <= j <= i`` (``bounds [2, B, T]`` as in lowering/document_attention.py: a sliding window of W
tokens is start = max(0, i - W + 1), full causal attention start = 0)::

    s[j]   = scale * q[b, h, i] . k[b, h // G, j]                       (fp32)
    lse    = log(sum_{allowed j} exp(s[j]) + exp(sink[h]))
    out    = sum_{allowed j} exp(s[j] - lse) v[b, h // G, j]

Forward: the document-attention kernel's online softmax with the sink folded into the running max and sum
once all keys are seen (``HAS_SINK``). lse is kept in base 2 for the backward, which is the document-attention
backward unchanged: with p = exp(s - lse) the real probabilities and delta = rowsum(out * dout) (the sink's
column has no value, so its dp is 0 and it adds nothing to delta), ds = p * (dp - delta) is the softmax
backward over the keys. The sink's own gradient is its column's ds, summed over batch rows and tokens::

    d sink[h] = -sum_{b, i} exp(sink[h] - lse[b, h, i]) * delta[b, h, i]

Why an op: transformers runs GPT-OSS's attention eagerly (no SDPA path takes sinks): the [B, H, T, T + 1]
scores, their softmax and its backward were 61 ms of a 157 ms step on the H200
(benchmarks/results/2026-12-03_issue20_lora_experts.md), and the scores are most of its memory.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from . import document_attention as doc
from .backend_choice import use_triton
from .devices import check_one_device
from .registration import define, fake

_LOG2E = 1.4426950408889634


def _window_bounds(like: torch.Tensor, window: int) -> torch.Tensor:
    if window < 1:
        raise ValueError(f"sloth.window_bounds: the window must hold at least 1 token, got {window}")
    b, t = like.shape[0], like.shape[2]
    i = torch.arange(t, device=like.device, dtype=torch.int32)
    start = (i - (window - 1)).clamp_min(0)
    end = (i + window).clamp_max(t)
    return torch.stack([start, end]).view(2, 1, t).expand(2, b, t).contiguous()


def window_bounds(like: torch.Tensor, window: int) -> torch.Tensor:
    """The bounds [2, B, T] int32 of a causal sliding window of ``window`` tokens (the token itself and the
    window - 1 before it; ``window >= T`` is plain causal attention), for ``like``'s batch and length
    ([B, heads, T, D]): start = max(0, i - window + 1), end = min(T, i + window), the one past the last query row
    that sees key i.

    An op of its own (``sloth::window_bounds``), opaque to Inductor: on torch 2.11 with CUDA, Inductor failed to
    compile the clamped arange inside GPT-OSS's step (``ValueError: The argument '-127 + ((0))' is not
    comparable``, sympy, while ordering strides; window 128 at 2048 tokens, H200, 2026-12-04), and the [2, B, T]
    ints cost one tiny kernel either way."""
    register()
    return torch.ops.sloth.window_bounds(like, int(window))


def sink_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                             bounds: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse2) in plain PyTorch, fp32 inside: O(T^2) memory, for CPUs without the interpreter."""
    heads = q.shape[1]
    s = (q.float() @ doc._repeat_kv(k, heads).float().transpose(-1, -2)) * scale
    s = s.masked_fill(~doc.allowed_from_bounds(bounds), float("-inf"))
    sink = sinks.float().view(1, heads, 1, 1).expand(*s.shape[:-1], 1)
    lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
    out = torch.exp(s - lse[..., None]) @ doc._repeat_kv(v, heads).float()
    return doc._output_like(q, out.to(q.dtype)), lse * _LOG2E


def _check_sinks(q: torch.Tensor, sinks: torch.Tensor) -> None:
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1] or not sinks.is_floating_point():
        raise ValueError(f"sloth.sink_attention: sinks must be a float [{q.shape[1]}] tensor (one logit per query "
                         f"head), got {sinks.dtype} {tuple(sinks.shape)}")
    check_one_device("sloth.sink_attention", ("q", q), ("sinks", sinks))


def _sink_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                        bounds: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    doc._check_inputs(q, k, v, bounds)
    _check_sinks(q, sinks)
    if not use_triton(q):
        return sink_attention_reference(q, k, v, sinks, bounds, scale)
    return doc.forward_kernel(q, k, v, bounds, scale, (sinks.float() * _LOG2E).contiguous())


def _sink_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, bounds: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    doc._check_inputs(q, k, v, bounds)
    delta = doc.row_delta(out, dout)
    if use_triton(q):
        dq, dk, dv = doc.backward_kernels(dout, q, k, v, lse, delta, bounds, scale)
    else:
        dq, dk, dv = doc.document_attention_backward_reference(dout, q, k, v, out, lse, bounds, scale)
    p_sink = torch.exp2(sinks.float().view(1, -1, 1) * _LOG2E - lse)  # [B, H, T]: the sink's probability
    dsinks = -(p_sink * delta).sum(dim=(0, 2))
    return dq, dk, dv, dsinks.to(sinks.dtype)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, sinks, bounds, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, out, lse, bounds)
    ctx.scale = scale


def _backward(ctx, dout, _dlse):
    q, k, v, sinks, out, lse, bounds = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.sloth.sink_attention_backward(dout, q, k, v, sinks, out, lse, bounds, ctx.scale)
    return dq, dk, dv, dsinks, None, None


@functools.cache
def register() -> None:
    """Define ``sloth::window_bounds``, ``sloth::sink_attention`` and its ``_backward`` (idempotent)."""
    bounds = define("sloth::window_bounds", _window_bounds)

    @fake(bounds)
    def _(like, window):
        if window < 1:
            raise ValueError(f"sloth.window_bounds: the window must hold at least 1 token, got {window}")
        return like.new_empty((2, like.shape[0], like.shape[2]), dtype=torch.int32)

    fwd = define("sloth::sink_attention", _sink_attention_fwd)
    bwd = define("sloth::sink_attention_backward", _sink_attention_bwd)

    @fake(fwd)
    def _(q, k, v, sinks, bounds, scale):
        check_one_device("sloth.sink_attention", ("q", q), ("k", k), ("v", v), ("sinks", sinks), ("bounds", bounds))
        b, heads, t, _ = q.shape
        return doc._empty_output(q, q.dtype), q.new_empty((b, heads, t), dtype=torch.float32)

    @fake(bwd)
    def _(dout, q, k, v, sinks, out, lse, bounds, scale):
        return torch.empty_like(q), k.new_empty(k.shape), v.new_empty(v.shape), sinks.new_empty(sinks.shape)

    fwd.register_autograd(_backward, setup_context=_setup_context)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, bounds: torch.Tensor,
                   scale: Optional[float] = None) -> torch.Tensor:
    """Attention with one sink logit per query head (module docstring); ``scale`` defaults to 1/sqrt(head_dim)."""
    register()
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.sloth.sink_attention(q, k, v, sinks, bounds, float(scale))[0]
