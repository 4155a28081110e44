"""Fused rotary position embedding (rotate-half RoPE): ``torch.ops.sloth.rope`` and its manual backward.

The op equals, in one line of PyTorch (``x`` is q or k, ``[..., D]``; ``cos``/``sin`` are ``[..., R]`` and
broadcast over x's leading dims, R even, R <= D; ``rotate_half(v) = cat((-v[..., R/2:], v[..., :R/2]), -1)``)::

    y = cat((x[..., :R] * cos + rotate_half(x[..., :R]) * sin, x[..., R:]), -1).to(result_type(x, cos, sin))

R == D is the usual full rotary (Llama, Mistral, Qwen, Gemma, Phi3); R < D is partial rotary (Phi,
StableLM, GPT-NeoX), whose last D - R dims pass through unchanged. ``sloth.rope(q, k, cos, sin)``
rotates q and k with the same cos/sin in one launch; ``sloth.rope_single(x, cos, sin)`` rotates one
tensor. Everything is computed in fp32 and rounded once, at the output; eager bf16 code rounds
``x * cos``, ``rotate_half(x) * sin`` and their sum, so the fused result is at least as accurate.

Memory traffic (the roofline): forward reads x and writes y (N*D each, N rows of every tensor), and reads
cos and sin once per row (2*N*R, mostly from cache: they broadcast over heads). Backward reads dy, cos,
sin and writes dx. Nothing is saved for backward but cos and sin (which the graph holds anyway): the
backward is the rotation by -theta and needs no activation.

Backward derivation. Per row, with halves ``x = [x1, x2]`` (R/2 each) and ``c = [c1, c2]``, ``s = [s1, s2]``
(no assumption that the halves of c or s are equal, so any cos/sin tensor is handled exactly)::

    y1 = x1*c1 - x2*s1                 y2 = x2*c2 + x1*s2
    dx1 = dy1*c1 + dy2*s2              dx2 = dy2*c2 - dy1*s1
    i.e. dx = dy*c + rotate_half^T(dy*s),   rotate_half^T(v) = cat((v2, -v1), -1) = -rotate_half(v)

which for the standard tables (c1 = c2 = cos(theta), s1 = s2 = sin(theta)) is the rotation by -theta.
The pass-through dims copy dy.

Interleaved RoPE (GPT-J, Meta's reference Llama, Cohere): ``interleaved=True`` on every op. Pair i is
``(x[2i], x[2i+1])`` and cos/sin carry one entry a pair, ``[..., P]`` with rotary dim R = 2P <= D (the layout
``freqs.cos()`` / ``freqs_cis.real`` have before anyone doubles them; dims R: pass through as above)::

    y[2i]   = x[2i]*c[i] - x[2i+1]*s[i]    y[2i+1] = x[2i+1]*c[i] + x[2i]*s[i]
    i.e. y = view_as_real(view_as_complex(x[..., :R]) * complex(c, s)), flattened back to [..., R]
    dx[2i]  = dy[2i]*c[i] + dy[2i+1]*s[i]  dx[2i+1] = dy[2i+1]*c[i] - dy[2i]*s[i]

the transpose of each pair's 2x2 matrix [[c, -s], [s, c]], the rotation by -theta on each pair (again no
assumption that c^2 + s^2 = 1). The rotate-half path is the same code as before, selected by a constexpr.

De-interleaving RoPE (DeepSeek-V3 and its kin: transformers' ``apply_rotary_pos_emb_interleave``):
``interleaved=True, deinterleave=True``. The pairs and tables are the interleaved ones, but the rotated pair is
written to the two halves of y, the layout the attention then reads::

    y[i] = x[2i]*c[i] - x[2i+1]*s[i]    y[P + i] = x[2i+1]*c[i] + x[2i]*s[i]        (P = R/2 pairs)
    dx[2i] = dy[i]*c[i] + dy[P+i]*s[i]   dx[2i+1] = dy[P+i]*c[i] - dy[i]*s[i]

the interleaved rotation with the output permuted (its backward reads dy through the same permutation).

Output layout. y is contiguous by default. ``bshd_out=True`` (the pass sets it where q and k are a projection's
output viewed as heads and transposed, ``[b, s, h, d]`` in memory) writes a 4-D y of shape ``[b, h, s, d]`` in
``[b, s, h, d]`` memory, as eager's elementwise RoPE does (it keeps a dense input's layout); the backward writes
dx likewise. cuDNN's attention lays its output out like its query, so the attention's output is then the
``[b, s, h * d]`` rows the o projection reads, a view; with a contiguous q Inductor copied it in every layer (32
MiB a layer at 2 x 2048 tokens, 32 heads of 128, kept beside the original for the backward). The layout comes
from the argument, never from the input's strides: the fake and the kernel agree whatever layout Inductor gives
the input.

cos and sin get no gradient: they come from position ids and a frozen
``inv_freq`` buffer in every model we know of; the pass refuses a site whose cos or sin requires grad,
and the op's backward raises rather than return a silently missing gradient.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .backend_choice import use_triton
from .devices import check_one_device
from .host_math import cdiv, next_power_of_2
from .layout import empty_heads, in_heads_layout
from .registration import define, fake
from .rounding import round_to

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# q/k are addressed as [n0, n1, n2, D] with arbitrary strides (a transposed projection view is read in
# place); tensors of fewer dims are padded with leading 1s.
MAX_DIMS = 4


@triton.jit
def _rope_pairs(p_x, p_cos, p_sin, p_y, o_x, o_c, o_s, o_y, o_h, m_mh, half, BACKWARD: tl.constexpr,
                DEINTERLEAVE: tl.constexpr):
    """Interleaved RoPE of one block: pair i is (x[2i], x[2i+1]), rotated by cos[i], sin[i] (module docstring).
    With DEINTERLEAVE the rotated pair is written to (y[i], y[half + i]) (DeepSeek's layout); its backward reads
    dy there and writes dx to the pair."""
    o_in_e, o_in_o, o_out_e, o_out_o = 2 * o_h, 2 * o_h + 1, 2 * o_h, 2 * o_h + 1
    if DEINTERLEAVE:
        if BACKWARD:
            o_in_e, o_in_o = o_h, half + o_h
        else:
            o_out_e, o_out_o = o_h, half + o_h
    b_xe = tl.load(p_x + o_x + o_in_e, mask=m_mh, other=0.0).to(tl.float32)
    b_xo = tl.load(p_x + o_x + o_in_o, mask=m_mh, other=0.0).to(tl.float32)
    b_c = tl.load(p_cos + o_c + o_h, mask=m_mh, other=0.0).to(tl.float32)
    b_s = tl.load(p_sin + o_s + o_h, mask=m_mh, other=0.0).to(tl.float32)
    if BACKWARD:
        b_ye = b_xe * b_c + b_xo * b_s
        b_yo = b_xo * b_c - b_xe * b_s
    else:
        b_ye = b_xe * b_c - b_xo * b_s
        b_yo = b_xo * b_c + b_xe * b_s
    tl.store(p_y + o_y + o_out_e, round_to(b_ye, p_y.dtype.element_ty), mask=m_mh)
    tl.store(p_y + o_y + o_out_o, round_to(b_yo, p_y.dtype.element_ty), mask=m_mh)


@triton.jit
def _rope_block(
    p_x, p_cos, p_sin, p_y, i_blk,
    n_rows, n1, n2, sx0, sx1, sx2, sc0, sc1, sc2, ss0, ss1, ss2, sy0, sy1, sy2,
    half, n_pass,
    BACKWARD: tl.constexpr, HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, DEINTERLEAVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Rotate BLOCK_M rows of one tensor: rows are (i0, i1, i2) of x's leading dims, and of y's (strides sy*)."""
    o_m = (i_blk * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_m = o_m < n_rows
    i2 = o_m % n2
    i1 = (o_m // n2) % n1
    i0 = o_m // (n2 * n1)
    o_x = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
    o_c = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None]
    o_s = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None]
    o_y = (i0 * sy0 + i1 * sy1 + i2 * sy2)[:, None]
    o_h = tl.arange(0, BLOCK_H)[None, :]
    m_mh = m_m[:, None] & (o_h < half)
    if INTERLEAVED:
        _rope_pairs(p_x, p_cos, p_sin, p_y, o_x, o_c, o_s, o_y, o_h, m_mh, half, BACKWARD, DEINTERLEAVE)
    else:
        b_x1 = tl.load(p_x + o_x + o_h, mask=m_mh, other=0.0).to(tl.float32)
        b_x2 = tl.load(p_x + o_x + half + o_h, mask=m_mh, other=0.0).to(tl.float32)
        b_c1 = tl.load(p_cos + o_c + o_h, mask=m_mh, other=0.0).to(tl.float32)
        b_c2 = tl.load(p_cos + o_c + half + o_h, mask=m_mh, other=0.0).to(tl.float32)
        b_s1 = tl.load(p_sin + o_s + o_h, mask=m_mh, other=0.0).to(tl.float32)
        b_s2 = tl.load(p_sin + o_s + half + o_h, mask=m_mh, other=0.0).to(tl.float32)
        if BACKWARD:
            b_y1 = b_x1 * b_c1 + b_x2 * b_s2
            b_y2 = b_x2 * b_c2 - b_x1 * b_s1
        else:
            b_y1 = b_x1 * b_c1 - b_x2 * b_s1
            b_y2 = b_x2 * b_c2 + b_x1 * b_s2
        tl.store(p_y + o_y + o_h, round_to(b_y1, p_y.dtype.element_ty), mask=m_mh)
        tl.store(p_y + o_y + half + o_h, round_to(b_y2, p_y.dtype.element_ty), mask=m_mh)
    if HAS_PASS:
        o_p = tl.arange(0, BLOCK_P)[None, :]
        m_mp = m_m[:, None] & (o_p < n_pass)
        b_p = tl.load(p_x + o_x + 2 * half + o_p, mask=m_mp, other=0.0)
        tl.store(p_y + o_y + 2 * half + o_p, round_to(b_p, p_y.dtype.element_ty), mask=m_mp)


@triton.jit
def _rope_kernel(
    p_q, p_k, p_cos, p_sin, p_qo, p_ko,
    n_rows_q, n1_q, n2_q, sx0_q, sx1_q, sx2_q, sc0_q, sc1_q, sc2_q, ss0_q, ss1_q, ss2_q, sy0_q, sy1_q, sy2_q,
    n_rows_k, n1_k, n2_k, sx0_k, sx1_k, sx2_k, sc0_k, sc1_k, sc2_k, ss0_k, ss1_k, ss2_k, sy0_k, sy1_k, sy2_k,
    half, n_pass, n_blocks_q,
    BACKWARD: tl.constexpr, HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, DEINTERLEAVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # One launch for q and k: the first n_blocks_q programs take q's rows, the rest k's. The forward
    # (BACKWARD=False) and the backward (BACKWARD=True, x := dy) differ only in the signs and in which
    # half of sin pairs with which half of x (module docstring). INTERLEAVED takes even/odd pairs instead
    # of halves, with ``half`` = the number of pairs = cos's last dim.
    i_b = tl.program_id(0)
    if i_b < n_blocks_q:
        _rope_block(p_q, p_cos, p_sin, p_qo, i_b,
                    n_rows_q, n1_q, n2_q, sx0_q, sx1_q, sx2_q, sc0_q, sc1_q, sc2_q, ss0_q, ss1_q, ss2_q,
                    sy0_q, sy1_q, sy2_q, half, n_pass,
                    BACKWARD, HAS_PASS, INTERLEAVED, DEINTERLEAVE, BLOCK_M, BLOCK_H, BLOCK_P)
    else:
        _rope_block(p_k, p_cos, p_sin, p_ko, i_b - n_blocks_q,
                    n_rows_k, n1_k, n2_k, sx0_k, sx1_k, sx2_k, sc0_k, sc1_k, sc2_k, ss0_k, ss1_k, ss2_k,
                    sy0_k, sy1_k, sy2_k, half, n_pass,
                    BACKWARD, HAS_PASS, INTERLEAVED, DEINTERLEAVE, BLOCK_M, BLOCK_H, BLOCK_P)


def _out_dtype(x_dtype: torch.dtype, cos: torch.Tensor, sin: torch.Tensor) -> torch.dtype:
    """What ``x * cos + rotate_half(x) * sin`` returns in eager PyTorch."""
    return torch.promote_types(torch.promote_types(x_dtype, cos.dtype), sin.dtype)


def _check_devices(xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_one_device("sloth.rope", ("x", xs[0]), *(("x", x) for x in xs[1:]), ("cos", cos), ("sin", sin))


def _check_inputs(xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> None:
    for t, name in [*((x, "x") for x in xs), (cos, "cos"), (sin, "sin")]:
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"sloth.rope: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    _check_devices(xs, cos, sin)
    if cos.shape != sin.shape:
        raise ValueError(f"sloth.rope: cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    rot = cos.shape[-1] if cos.dim() else 0
    if interleaved:  # one cos/sin entry a pair: the rotary dim is twice cos's last dim
        if rot == 0:
            raise ValueError("sloth.rope: interleaved cos/sin need a positive last dim (one entry a pair)")
        rot *= 2
    elif rot == 0 or rot % 2:
        raise ValueError(f"sloth.rope: the rotary dim (cos's last dim) must be even and positive, got {rot}")
    for x in xs:
        if not 1 <= x.dim() <= MAX_DIMS:
            raise ValueError(f"sloth.rope: x must have 1 to {MAX_DIMS} dims, got {x.dim()}")
        if cos.dim() > x.dim() or rot > x.shape[-1]:
            raise ValueError(f"sloth.rope: cos/sin of shape {tuple(cos.shape)} do not fit x of shape {tuple(x.shape)} "
                             "(rotary dim at most x's last dim, no more dims than x)")
        if not _broadcasts_to(cos.shape[:-1], x.shape[:-1]):
            raise ValueError(f"sloth.rope: cos/sin of shape {tuple(cos.shape)} do not broadcast to x of shape "
                             f"{tuple(x.shape)} over its leading dims")


def _broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target`` (``torch.broadcast_shapes(shape, target) == target``;
    written out because torch's costs ~30 us a call on the host, every op call)."""
    return len(shape) <= len(target) and all(s == t or s == 1 for s, t in zip(reversed(shape), reversed(target)))


def _rotate_half(v: torch.Tensor) -> torch.Tensor:
    h = v.shape[-1] // 2
    return torch.cat((-v[..., h:], v[..., :h]), -1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False,
                   out_dtype: Optional[torch.dtype] = None, interleaved: bool = False,
                   deinterleave: bool = False) -> torch.Tensor:
    """The op's math in plain PyTorch (fp32, one rounding): the fallback where Triton cannot run.

    ``backward=True`` applies the transpose (module docstring) to ``x`` := dy. Contiguous output.
    """
    rot = cos.shape[-1] * (2 if interleaved else 1)
    xf, c, s = x.float(), cos.float(), sin.float()
    xr = xf[..., :rot]
    if deinterleave:
        p = rot // 2
        if backward:  # dy's halves are the pairs' two components
            d1, d2 = xr[..., :p], xr[..., p:]
            y = torch.stack((d1 * c + d2 * s, d2 * c - d1 * s), -1).flatten(-2)
        else:
            xe, xo = xr[..., 0::2], xr[..., 1::2]
            y = torch.cat((xe * c - xo * s, xo * c + xe * s), -1)
    elif interleaved:
        xe, xo = xr[..., 0::2], xr[..., 1::2]
        sign = -1.0 if backward else 1.0  # the backward rotates each pair by -theta
        y = torch.stack((xe * c - sign * (xo * s), xo * c + sign * (xe * s)), -1).flatten(-2)
    elif backward:
        y = xr * c - _rotate_half(xr * s)
    else:
        y = xr * c + _rotate_half(xr) * s
    y = torch.cat((y, xf[..., rot:]), -1)
    return y.to(out_dtype or _out_dtype(x.dtype, cos, sin)).contiguous()


def _lead_strides(t: torch.Tensor) -> list[int]:
    """The strides of ``t``'s MAX_DIMS - 1 leading dims, ``t`` padded with leading 1s (a view of any layout)."""
    return list(t.view((1,) * (MAX_DIMS - t.dim()) + tuple(t.shape)).stride()[:3])


def _rows_meta(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[int]:
    """[n_rows, n1, n2, 3 strides of x, of cos, of sin] with cos/sin broadcast to x's leading dims."""
    lead = tuple(x.shape[:-1])
    n0, n1, n2 = ((1,) * (MAX_DIMS - x.dim()) + tuple(x.shape))[:3]
    return [n0 * n1 * n2, n1, n2, *_lead_strides(x), *_lead_strides(cos.expand(lead + cos.shape[-1:])),
            *_lead_strides(sin.expand(lead + sin.shape[-1:]))]


def _block_sizes(n_rows: int, half: int, n_pass: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_H, BLOCK_P, num_warps): about 4K elements of x a program, as in the RMSNorm kernel.

    A head of 128 dims takes 32 rows a program; warps follow the Triton tutorials, one per 256 elements.
    """
    block_h = next_power_of_2(max(half, 1))
    block_p = next_power_of_2(max(n_pass, 1))
    per_row = 2 * block_h + (block_p if n_pass else 0)
    rows = max(1, 4096 // per_row)
    block_m = min(next_power_of_2(max(n_rows, 1)), 1 << (rows.bit_length() - 1))  # a power of 2
    num_warps = min(max(block_m * (2 * block_h) // 256, 1), 8)
    return block_m, block_h, block_p, num_warps


def _launch(xs: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, out_dtypes: list[torch.dtype],
            backward: bool, interleaved: bool = False, deinterleave: bool = False, bshd_out: bool = False
            ) -> list[torch.Tensor]:
    """Rotate one or two tensors (q, k) with one cos/sin in one launch; outputs contiguous, or with ``bshd_out``
    laid out as [b, s, h, d] (lowering/layout.py's ``empty_heads``)."""
    if deinterleave and not interleaved:
        raise ValueError("sloth.rope: deinterleave=True rotates interleaved pairs; it needs interleaved=True")
    if not use_triton(xs[0]):
        return [in_heads_layout(rope_reference(x, cos, sin, backward, dt, interleaved, deinterleave), bshd_out)
                for x, dt in zip(xs, out_dtypes)]
    # The kernel reads unit-stride rows; a transposed projection view ([b, s, h, d] -> [b, h, s, d])
    # already has them, so this copies only exotic layouts.
    xs = [x if x.stride(-1) == 1 or x.numel() == 0 else x.contiguous() for x in xs]
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    ys = [empty_heads(x, x.shape, dt, bshd_out) for x, dt in zip(xs, out_dtypes)]
    rot, head = cos.shape[-1] * (2 if interleaved else 1), xs[0].shape[-1]
    metas = [_rows_meta(x, cos, sin) + _lead_strides(y) for x, y in zip(xs, ys)]
    n_rows = [m[0] for m in metas]
    block_m, block_h, block_p, num_warps = _block_sizes(max(n_rows), rot // 2, head - rot)
    n_blocks = [cdiv(n, block_m) for n in n_rows]
    if sum(n_blocks) == 0:
        return ys
    if len(xs) == 1:  # the k slot gets no programs
        xs, ys, metas, n_blocks = xs * 2, ys * 2, metas * 2, n_blocks + [0]
    _rope_kernel[(sum(n_blocks),)](
        xs[0], xs[1], cos, sin, ys[0], ys[1],
        *metas[0], *metas[1],
        rot // 2, head - rot, n_blocks[0],
        BACKWARD=backward, HAS_PASS=head > rot, INTERLEAVED=interleaved, DEINTERLEAVE=deinterleave,
        BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_P=block_p, num_warps=num_warps,
    )
    return ys[:len(out_dtypes)]


def _rope_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
              deinterleave: bool = False, bshd_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs((q, k), cos, sin, interleaved)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"sloth.rope: q and k must have one head dim, got {q.shape[-1]} and {k.shape[-1]}")
    q_rot, k_rot = _launch([q, k], cos, sin, [_out_dtype(q.dtype, cos, sin), _out_dtype(k.dtype, cos, sin)], False,
                           interleaved, deinterleave, bshd_out)
    return q_rot, k_rot


def _rope_bwd(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_dtype: torch.dtype,
              k_dtype: torch.dtype, interleaved: bool = False, deinterleave: bool = False, bshd_out: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs((dq, dk), cos, sin, interleaved)
    dq_in, dk_in = _launch([dq, dk], cos, sin, [q_dtype, k_dtype], True, interleaved, deinterleave, bshd_out)
    return dq_in, dk_in


def _rope_single_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     deinterleave: bool = False, bshd_out: bool = False) -> torch.Tensor:
    _check_inputs((x,), cos, sin, interleaved)
    return _launch([x], cos, sin, [_out_dtype(x.dtype, cos, sin)], False, interleaved, deinterleave, bshd_out)[0]


def _rope_single_bwd(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_dtype: torch.dtype,
                     interleaved: bool = False, deinterleave: bool = False, bshd_out: bool = False) -> torch.Tensor:
    _check_inputs((dy,), cos, sin, interleaved)
    return _launch([dy], cos, sin, [x_dtype], True, interleaved, deinterleave, bshd_out)[0]


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: graph citizens with fake implementations and their own backward.
# ---------------------------------------------------------------------------------------------------

def _no_cos_sin_grad(ctx, i_cos: int) -> None:
    if ctx.needs_input_grad[i_cos] or ctx.needs_input_grad[i_cos + 1]:
        raise RuntimeError("sloth.rope: cos and sin get no gradient from this op (they are position tables); "
                           "detach them, or leave this RoPE unfused")


def _setup_context(ctx, inputs, output) -> None:
    # graphs made before deinterleave and bshd_out omit them
    q, k, cos, sin, interleaved, deinterleave, bshd_out = (*inputs, False, False)[:7]
    ctx.save_for_backward(cos, sin)
    ctx.dtypes = (q.dtype, k.dtype)
    ctx.shapes = (q.shape, k.shape)
    ctx.layout = (interleaved, deinterleave, bshd_out)
    ctx.n_inputs = len(inputs)


def _backward(ctx, dq, dk):
    _no_cos_sin_grad(ctx, 2)
    cos, sin = ctx.saved_tensors
    # An output nobody used has no cotangent; its input's gradient is then the rotation of zeros.
    q_shape, k_shape = ctx.shapes
    dq = dq if dq is not None else cos.new_zeros(q_shape)
    dk = dk if dk is not None else cos.new_zeros(k_shape)
    dq_in, dk_in = torch.ops.sloth.rope_backward(dq, dk, cos, sin, *ctx.dtypes, *ctx.layout)
    return (dq_in, dk_in, None, None, None, None, None)[:ctx.n_inputs]


def _setup_context_single(ctx, inputs, output) -> None:
    x, cos, sin, interleaved, deinterleave, bshd_out = (*inputs, False, False)[:6]
    ctx.save_for_backward(cos, sin)
    ctx.dtype = x.dtype
    ctx.layout = (interleaved, deinterleave, bshd_out)
    ctx.n_inputs = len(inputs)


def _backward_single(ctx, dy):
    _no_cos_sin_grad(ctx, 1)
    cos, sin = ctx.saved_tensors
    dx = torch.ops.sloth.rope_single_backward(dy, cos, sin, ctx.dtype, *ctx.layout)
    return (dx, None, None, None, None, None)[:ctx.n_inputs]


@functools.cache
def register() -> None:
    """Define ``sloth::rope``, ``sloth::rope_single`` and their backward ops (idempotent)."""
    fwd = define("sloth::rope", _rope_fwd)
    bwd = define("sloth::rope_backward", _rope_bwd)
    fwd1 = define("sloth::rope_single", _rope_single_fwd)
    bwd1 = define("sloth::rope_single_backward", _rope_single_bwd)

    # The forward fakes check devices: a call with a meta input runs the fake, not the op (lowering/devices.py).
    @fake(fwd)
    def _(q, k, cos, sin, interleaved=False, deinterleave=False, bshd_out=False):
        _check_devices((q, k), cos, sin)
        return (empty_heads(q, q.shape, _out_dtype(q.dtype, cos, sin), bshd_out),
                empty_heads(k, k.shape, _out_dtype(k.dtype, cos, sin), bshd_out))

    @fake(bwd)
    def _(dq, dk, cos, sin, q_dtype, k_dtype, interleaved=False, deinterleave=False, bshd_out=False):
        return empty_heads(dq, dq.shape, q_dtype, bshd_out), empty_heads(dk, dk.shape, k_dtype, bshd_out)

    @fake(fwd1)
    def _(x, cos, sin, interleaved=False, deinterleave=False, bshd_out=False):
        _check_devices((x,), cos, sin)
        return empty_heads(x, x.shape, _out_dtype(x.dtype, cos, sin), bshd_out)

    @fake(bwd1)
    def _(dy, cos, sin, x_dtype, interleaved=False, deinterleave=False, bshd_out=False):
        return empty_heads(dy, dy.shape, x_dtype, bshd_out)

    fwd.register_autograd(_backward, setup_context=_setup_context)
    fwd1.register_autograd(_backward_single, setup_context=_setup_context_single)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
         deinterleave: bool = False, bshd_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the same cos/sin in one launch; see the module docstring for the exact math
    (``deinterleave``: interleaved pairs written to halves, DeepSeek's layout; needs ``interleaved``;
    ``bshd_out``: 4-D results [b, h, s, d] laid out as [b, s, h, d], the backward's input gradients too)."""
    register()
    return torch.ops.sloth.rope(q, k, cos, sin, interleaved, deinterleave, bshd_out)


def rope_single(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                deinterleave: bool = False, bshd_out: bool = False) -> torch.Tensor:
    """Rotate one tensor; see the module docstring for the exact math."""
    register()
    return torch.ops.sloth.rope_single(x, cos, sin, interleaved, deinterleave, bshd_out)
