"""Expert GEMMs spelt by ``einsum`` on weights gathered per route (part of ``moe_route``, patterns/moe.py).

pytorch-labs/gpt-fast's Mixtral (``ConditionalFeedForward``) keeps the routes as a dim of their own, [T, K], and
never flattens them to rows::

    x1  = silu(einsum('ti,taoi->tao', x, W_gate[idx]))         W_gate[idx]  [T, K, I, H]
    x3  = einsum('ti,taoi->tao', x, W_up[idx])
    y   = einsum('tao,taio->tai', x1 * x3, W_down[idx])        W_down[idx]  [T, K, H, I]
    out = einsum('tai,ta->ti', y, w)

which is ``moe_experts_pattern`` on ``W1 = cat([W_gate, W_up], 1)`` with S = T * K routes. The family reads an
expert GEMM's routes as its output's leading dim (``bmm`` on ``W[e]`` [S, n, k] gives [S, n, 1], ``einsum('sh,shn->
sn')`` gives [S, n]); an einsum's output is [..., n] whatever its leading dims, so its routes are the product of
those dims and its width the last. Nothing else is trusted from the spelling: the probes compare the region with
the op's pattern (a wrong gate/up order, a transposed output, another contraction are refused there).
"""
from __future__ import annotations

import math
from typing import Optional

import torch.fx as fx

from ..compiler.fx_utils import op_name, tensor_of


def gemm_rows(gemm: fx.Node) -> tuple[Optional[int], Optional[int]]:
    """(routes, width) of an expert GEMM's output: an einsum's [..., n] as prod(...) routes of width n; any other
    GEMM's [S, n, ...] as S routes of width n (``bmm(W[e], x[:, :, None])`` is [S, n, 1])."""
    value = tensor_of(gemm)
    if value is None or value.dim() < 2:
        return None, None
    shape = tuple(value.shape)
    if op_name(gemm) == "einsum":
        return math.prod(shape[:-1]), shape[-1]
    return shape[0], shape[1]
