"""Fused gated activation (SwiGLU, GeGLU, ReGLU, ...): ``torch.ops.sloth.glu`` and its manual backward.

The op equals, in one line of PyTorch (``gate`` and ``up`` of one shape ``[..., n]``)::

    y = (act(gate.float()) * up.float()).to(gate.dtype)

with ``act`` one of ``"silu"`` (SwiGLU: ``F.silu``), ``"gelu_tanh"`` (GeGLU: ``F.gelu(approximate="tanh")``),
``"gelu_erf"`` (GeGLU: ``F.gelu``), ``"relu"`` (ReGLU: ``F.relu``), ``"relu2"`` (BitNet's ``F.relu(g) ** 2``,
transformers' ``ACT2FN["relu2"]``) or ``"sigmoid"`` (the original GLU: ``torch.sigmoid``). With ``up=None`` the
first argument is the merged projection ``[..., 2n]`` with the gate in its first half and up in its second
(``gate, up = x.chunk(2, -1)``), which the op reads in place; its gradient is then written as one ``[..., 2n]``
tensor, so no split or concatenation is left around the op in either direction. Everything is computed in
fp32 and rounded once, at the output; eager bf16 code rounds ``act(gate)`` and then the product, so the fused
result is at least as accurate.

Memory traffic (the roofline): forward reads gate and up and writes y (3*N*n elements for N rows);
backward reads dy, gate and up and writes d_gate and d_up (5*N*n). Only gate and up are saved for
backward (the activation is recomputed from gate in registers); eager autograd also saves ``act(gate)``,
one more N*n tensor per MLP layer.

Backward derivation. With ``y = a(g) * u`` elementwise::

    d_gate = dy * u * a'(g)          d_up = dy * a(g)

and, with ``s(v) = 1 / (1 + exp(-v))`` the logistic sigmoid,

    silu        a(g)  = g * s(g)
                a'(g) = s(g) + g * s(g) * (1 - s(g)) = s(g) * (1 + g * (1 - s(g)))

    gelu_tanh   a(g)  = 0.5 * g * (1 + tanh(z)),  z = k * (g + c * g^3),  k = sqrt(2/pi), c = 0.044715
                      = g * s(2z)                           (0.5 * (1 + tanh(z)) = s(2z))
                a'(g) = s(2z) + g * s(2z) * (1 - s(2z)) * 2 * dz/dg,   dz/dg = k * (1 + 3 * c * g^2)

    gelu_erf    a(g)  = g * P(g),  P(g) = 0.5 * (1 + erf(g / sqrt(2)))     (the normal CDF)
                a'(g) = P(g) + g * p(g),  p(g) = exp(-g^2 / 2) / sqrt(2 * pi)  (the normal density)

    relu        a(g)  = max(g, 0)
                a'(g) = 1 where g > 0, else 0                  (0 at the kink g = 0, as autograd's relu)

    relu2       a(g)  = r^2,  r = max(g, 0)
                a'(g) = 2 * r                                  (0 at g = 0 from either side: no kink)

    sigmoid     a(g)  = s(g)
                a'(g) = s(g) * (1 - s(g))

The relus are written ``where(g <= 0, 0, g)`` and ``where(g <= 0, 0, 1)``, not ``max``: a NaN gate then gives
a NaN output and passes its gradient, as ``torch.relu`` and its backward (``threshold_backward``) do.

The tanh form is evaluated as ``g * s(2z)``: Triton has no tanh, and the sigmoid form has no
cancellation in ``1 + tanh(z)`` for negative z. ``1 - s`` is evaluated as ``s(-v)`` for the same reason.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend_choice import use_triton
from .devices import check_one_device
from .host_math import cdiv, next_power_of_2
from .layout import rows_2d
from .registration import define, fake
from .rounding import round_to

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The activation is a string in the op's schema (readable in graphs and profiles) and a constexpr in
# the kernels: one Triton compile per activation kind, never one per call site.
# Codes 3 and 4 are lowering/moe_kernels.py's clamped expert GLUs, which extend this table; 5 is relu2 there too.
_SILU = tl.constexpr(0)
_GELU_TANH = tl.constexpr(1)
_GELU_ERF = tl.constexpr(2)
_RELU2 = tl.constexpr(5)
_RELU = tl.constexpr(6)
_SIGMOID = tl.constexpr(7)
ACTIVATIONS = {"silu": _SILU.value, "gelu_tanh": _GELU_TANH.value, "gelu_erf": _GELU_ERF.value,
               "relu": _RELU.value, "relu2": _RELU2.value, "sigmoid": _SIGMOID.value}

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_TANH_C = tl.constexpr(0.044715)
_SQRT_HALF = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _sigmoid_pair(b_v):
    """(s(v), 1 - s(v)), each to full relative precision.

    ``exp(-|v|)`` never overflows, and ``1 - s`` is never formed by cancellation: where s is near 1 it is
    ``e / (1 + e)``. Computing it as ``1 - s`` doubled the fp32 error of the gelu_tanh gradient against
    PyTorch's (2.2x eager's, measured on tests/test_glu_op.py's inputs); this way it is 0.6x.
    """
    b_e = tl.exp(-tl.abs(b_v))
    b_r = 1.0 / (1.0 + b_e)
    b_er = b_e * b_r
    return tl.where(b_v >= 0, b_r, b_er), tl.where(b_v >= 0, b_er, b_r)


@triton.jit
def _activation(b_g, ACTIVATION: tl.constexpr):
    """a(g) in fp32 (module docstring)."""
    if ACTIVATION == _SILU:
        b_s, _ = _sigmoid_pair(b_g)
        b_a = b_g * b_s
    elif ACTIVATION == _GELU_TANH:
        # 2z bound to a name before the call: Triton 3.9's interpreter fails to convert a call argument
        # computed from a module-level constexpr ("cannot convert ... tensor to tensor"); 3.6 accepts both.
        b_2z = 2.0 * _SQRT_2_OVER_PI * b_g * (1.0 + _GELU_TANH_C * b_g * b_g)
        b_s, _ = _sigmoid_pair(b_2z)
        b_a = b_g * b_s
    elif ACTIVATION == _RELU:
        b_a = tl.where(b_g <= 0.0, 0.0, b_g)
    elif ACTIVATION == _RELU2:
        b_r = tl.where(b_g <= 0.0, 0.0, b_g)
        b_a = b_r * b_r
    elif ACTIVATION == _SIGMOID:
        b_a, _ = _sigmoid_pair(b_g)
    else:
        b_a = b_g * 0.5 * (1.0 + tl.math.erf(b_g * _SQRT_HALF))
    return b_a


@triton.jit
def _activation_and_derivative(b_g, ACTIVATION: tl.constexpr):
    """(a(g), a'(g)) in fp32 (module docstring)."""
    if ACTIVATION == _SILU:
        b_s, b_1ms = _sigmoid_pair(b_g)
        b_a = b_g * b_s
        b_da = b_s * (1.0 + b_g * b_1ms)
    elif ACTIVATION == _GELU_TANH:
        b_g2 = b_g * b_g
        b_2z = 2.0 * _SQRT_2_OVER_PI * b_g * (1.0 + _GELU_TANH_C * b_g2)  # named: see _activation
        b_s, b_1ms = _sigmoid_pair(b_2z)
        b_a = b_g * b_s
        b_da = b_s + b_a * b_1ms * (2.0 * _SQRT_2_OVER_PI) * (1.0 + 3.0 * _GELU_TANH_C * b_g2)
    elif ACTIVATION == _RELU:
        b_a = tl.where(b_g <= 0.0, 0.0, b_g)
        b_da = tl.where(b_g <= 0.0, 0.0, 1.0)
    elif ACTIVATION == _RELU2:
        b_r = tl.where(b_g <= 0.0, 0.0, b_g)
        b_a = b_r * b_r
        b_da = 2.0 * b_r
    elif ACTIVATION == _SIGMOID:
        b_s, b_1ms = _sigmoid_pair(b_g)
        b_a = b_s
        b_da = b_s * b_1ms
    else:
        b_cdf = 0.5 * (1.0 + tl.math.erf(b_g * _SQRT_HALF))
        b_a = b_g * b_cdf
        b_da = b_cdf + b_g * _INV_SQRT_2PI * tl.exp(-0.5 * b_g * b_g)
    return b_a, b_da


@triton.jit
def _glu_fwd_kernel(
    p_g, p_u, p_y,
    n_rows, n_cols, stride_g, stride_u, stride_y,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mn = (o_m < n_rows)[:, None] & (o_n < n_cols)[None, :]
    b_g = tl.load(p_g + o_m[:, None] * stride_g + o_n[None, :], mask=m_mn, other=0.0).to(tl.float32)
    b_u = tl.load(p_u + o_m[:, None] * stride_u + o_n[None, :], mask=m_mn, other=0.0).to(tl.float32)
    b_y = _activation(b_g, ACTIVATION) * b_u
    tl.store(p_y + o_m[:, None] * stride_y + o_n[None, :], round_to(b_y, p_y.dtype.element_ty), mask=m_mn)


@triton.jit
def _glu_bwd_kernel(
    p_dy, p_g, p_u, p_dg, p_du,
    n_rows, n_cols, stride_dy, stride_g, stride_u, stride_dg, stride_du,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STORE_Y: tl.constexpr = False,
    IN_PLACE: tl.constexpr = False,
):
    """dg, du; with STORE_Y also the forward's y = a(g) * u, bit for bit _glu_fwd_kernel's, written over dy.
    IN_PLACE: p_dg is p_g and p_du is p_u (the gradients written over the activations).

    Programs own disjoint tiles, but within one the thread that stores an element need not be the one that
    loaded it: where the strides' alignment differs (dy's stride n with n % 16 == 8 against a merged gate/up's
    2n, seen compiled for sm_90), Triton gives the load and the store different layouts. So a barrier stands
    before the first store over an input (every thread's loads are then done): before the dg and du stores
    when they go over g and u, else before the y stores over dy (by then the dy values are consumed)."""
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mn = (o_m < n_rows)[:, None] & (o_n < n_cols)[None, :]
    b_dy = tl.load(p_dy + o_m[:, None] * stride_dy + o_n[None, :], mask=m_mn, other=0.0).to(tl.float32)
    b_g = tl.load(p_g + o_m[:, None] * stride_g + o_n[None, :], mask=m_mn, other=0.0).to(tl.float32)
    b_u = tl.load(p_u + o_m[:, None] * stride_u + o_n[None, :], mask=m_mn, other=0.0).to(tl.float32)
    b_a, b_da = _activation_and_derivative(b_g, ACTIVATION)
    if IN_PLACE:
        tl.debug_barrier()
    tl.store(p_dg + o_m[:, None] * stride_dg + o_n[None, :], round_to(b_dy * b_u * b_da, p_dg.dtype.element_ty),
             mask=m_mn)
    tl.store(p_du + o_m[:, None] * stride_du + o_n[None, :], round_to(b_dy * b_a, p_du.dtype.element_ty), mask=m_mn)
    if STORE_Y:
        if not IN_PLACE:
            tl.debug_barrier()
        tl.store(p_dy + o_m[:, None] * stride_dy + o_n[None, :],
                 round_to(_activation(b_g, ACTIVATION) * b_u, p_dy.dtype.element_ty), mask=m_mn)


def _block_sizes(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): tiles of about 4K elements, at most 1024 columns wide.

    Not yet swept on the H200: the starting point is the RMSNorm forward's ~4K elements a program (the
    Triton tutorials' vector-add uses 1024), rows stacked when the inner size is small, and one warp
    per 256 elements, 1 to 8.
    """
    block_n = min(next_power_of_2(max(n_cols, 1)), 1024)
    block_m = max(1, min(next_power_of_2(max(n_rows, 1)), 4096 // block_n))
    num_warps = min(max(block_m * block_n // 256, 1), 8)
    return block_m, block_n, num_warps


def _check_inputs(x: torch.Tensor, up: Optional[torch.Tensor], activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"sloth.glu: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"sloth.glu: gate must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("sloth.glu: gate must have at least one dimension")
    if up is None:
        if x.shape[-1] % 2:
            raise ValueError(f"sloth.glu: a merged gate_up tensor needs an even last dimension, got {x.shape[-1]}")
        return
    if up.dtype != x.dtype:
        raise TypeError(f"sloth.glu: up must have gate's dtype {x.dtype}, got {up.dtype}")
    if up.shape != x.shape:
        raise ValueError(f"sloth.glu: up must have gate's shape {tuple(x.shape)}, got {tuple(up.shape)}")
    check_one_device("sloth.glu", ("gate", x), ("up", up))


def _split(x: torch.Tensor, up: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up): the two operands, halves of x when up is None (views, no copy)."""
    if up is not None:
        return x, up
    n = x.shape[-1] // 2
    return x[..., :n], x[..., n:]


def _activation_reference(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(g)
    if activation == "relu":
        return F.relu(g)
    if activation == "relu2":
        return torch.square(F.relu(g))
    if activation == "sigmoid":
        return torch.sigmoid(g)
    return F.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none")


def glu_reference(x: torch.Tensor, up: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    """The op's math in plain PyTorch (fp32, one rounding): the fallback where Triton cannot run.

    Contiguous output whatever the inputs' layout, as the fake implementation promises.
    """
    gate, up = _split(x, up)
    return (_activation_reference(gate.float(), activation) * up.float()).to(x.dtype).contiguous()


def glu_backward_reference(dy: torch.Tensor, x: torch.Tensor, up: Optional[torch.Tensor], activation: str
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The derivation in the module docstring, in plain PyTorch (fp32)."""
    gate, upv = _split(x, up)
    g, u, dyf = gate.float(), upv.float(), dy.float()
    if activation == "silu":
        s, one_minus_s = torch.sigmoid(g), torch.sigmoid(-g)  # 1 - s without cancellation, as the kernel
        a, da = g * s, s * (1 + g * one_minus_s)
    elif activation == "gelu_tanh":
        v = 2 * 0.7978845608028654 * g * (1 + 0.044715 * g * g)
        s, one_minus_s = torch.sigmoid(v), torch.sigmoid(-v)
        a = g * s
        da = s + a * one_minus_s * (2 * 0.7978845608028654) * (1 + 3 * 0.044715 * g * g)
    elif activation in ("relu", "relu2"):
        r = torch.where(g <= 0, 0.0, g)  # a NaN gate stays NaN, as in the kernel
        a, da = (r, torch.where(g <= 0, 0.0, 1.0)) if activation == "relu" else (r * r, 2 * r)
    elif activation == "sigmoid":
        a = torch.sigmoid(g)
        da = a * torch.sigmoid(-g)
    else:
        cdf = 0.5 * (1 + torch.erf(g * 0.7071067811865476))
        a, da = g * cdf, cdf + g * 0.3989422804014327 * torch.exp(-0.5 * g * g)
    d_gate, d_up = (dyf * u * da).to(x.dtype), (dyf * a).to(x.dtype)
    if up is None:
        return torch.cat([d_gate, d_up], -1).contiguous(), x.new_empty(0)
    return d_gate.contiguous(), d_up.contiguous()


def glu_forward(x: torch.Tensor, up: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    _check_inputs(x, up, activation)
    if not use_triton(x):
        return glu_reference(x, up, activation)
    x_2d = rows_2d(x)
    g_Nn, u_Nn = _split(x_2d, rows_2d(up) if up is not None else None)
    n_rows, n_cols = g_Nn.shape
    y_Nn = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if y_Nn.numel():
        block_m, block_n, num_warps = _block_sizes(n_rows, n_cols)
        _glu_fwd_kernel[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
            g_Nn, u_Nn, y_Nn,
            n_rows, n_cols, g_Nn.stride(0), u_Nn.stride(0), y_Nn.stride(0),
            ACTIVATION=ACTIVATIONS[activation], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    return y_Nn.view(*x.shape[:-1], n_cols)


def glu_backward_impl(dy: torch.Tensor, x: torch.Tensor, up: Optional[torch.Tensor], activation: str,
                      y_over_dy: bool = False, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dup). With ``y_over_dy`` the forward's output ``glu(x, up)`` is written over ``dy`` too (which must
    then be a contiguous tensor the caller owns, in x's dtype): one pass gives the backward both, where a
    caller that needs the output again (glu_lora.py) would otherwise recompute it by a pass of its own.
    With ``in_place`` dx is written over ``x`` and dup over ``up`` (the caller owns both and never reads their
    values again) and those two are returned: no new tensor of their size (compiler/lean_backward.py)."""
    _check_inputs(x, up, activation)
    if y_over_dy and (dy.dtype != x.dtype or dy.shape[:-1] != x.shape[:-1] or not dy.is_contiguous()):
        raise ValueError(f"sloth.glu_backward: y_over_dy needs dy contiguous in x's dtype and rows, got "
                         f"{dy.dtype} {tuple(dy.shape)} against {x.dtype} {tuple(x.shape)}")
    if in_place and (not use_triton(x) or not (x.is_contiguous() and (up is None or up.is_contiguous()))):
        # The reference path writes new tensors, and a kernel writing through a copy (rows_2d's) would lose the
        # gradients: computed apart, then copied over.
        dx, dup = glu_backward_impl(dy, x, up, activation, y_over_dy)
        x.copy_(dx)
        if up is not None:
            up.copy_(dup)
        return x, (up if up is not None else dup)
    if not use_triton(x):
        dx, dup = glu_backward_reference(dy, x, up, activation)
        if y_over_dy:
            dy.copy_(glu_reference(x, up, activation))
        return dx, dup
    x_2d = rows_2d(x)
    g_Nn, u_Nn = _split(x_2d, rows_2d(up) if up is not None else None)
    dy_Nn = rows_2d(dy)
    n_rows, n_cols = g_Nn.shape
    # Merged: one [N, 2n] gradient, its halves written by the same kernel through two views.
    dx_2d = x_2d if in_place else torch.empty(x_2d.shape, dtype=x.dtype, device=x.device)
    du_Nn = (u_Nn if in_place else torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)) \
        if up is not None else None
    dg_Nn, du_Nn = _split(dx_2d, du_Nn)
    if dg_Nn.numel():
        block_m, block_n, num_warps = _block_sizes(n_rows, n_cols)
        _glu_bwd_kernel[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
            dy_Nn, g_Nn, u_Nn, dg_Nn, du_Nn,
            n_rows, n_cols, dy_Nn.stride(0), g_Nn.stride(0), u_Nn.stride(0), dg_Nn.stride(0), du_Nn.stride(0),
            ACTIVATION=ACTIVATIONS[activation], BLOCK_M=block_m, BLOCK_N=block_n, STORE_Y=y_over_dy,
            IN_PLACE=in_place, num_warps=num_warps,
        )
    if in_place:
        return x, (up if up is not None else x.new_empty(0))
    if up is None:
        return dx_2d.view(x.shape), x.new_empty(0)
    return dx_2d.view(x.shape), du_Nn.view(up.shape)


def glu_backward(dy: torch.Tensor, x: torch.Tensor, up: Optional[torch.Tensor], activation: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's function: glu_backward_impl without ``y_over_dy``, which mutates dy (the op is functional)."""
    return glu_backward_impl(dy, x, up, activation)


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    x, up, activation = inputs
    ctx.save_for_backward(x, up)
    ctx.activation = activation


def _backward(ctx, dy):
    # Both gradients are always computed: gate and up are activations of the layer's input, so in
    # training both need one, and one kernel writes both for the cost of reading gate and up once.
    x, up = ctx.saved_tensors
    dx, dup = torch.ops.sloth.glu_backward(dy, x, up, ctx.activation)
    return dx, (dup if up is not None else None), None


@functools.cache
def register() -> None:
    """Define ``sloth::glu`` and ``sloth::glu_backward`` (idempotent)."""
    fwd = define("sloth::glu", glu_forward)
    bwd = define("sloth::glu_backward", glu_backward)

    @fake(fwd)
    def _(x, up, activation):
        check_one_device("sloth.glu", ("gate", x), ("up", up))  # meta inputs land here (lowering/devices.py)
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2) if up is None else x.shape)

    @fake(bwd)
    def _(dy, x, up, activation):
        return x.new_empty(x.shape), (up.new_empty(up.shape) if up is not None else x.new_empty(0))

    fwd.register_autograd(_backward, setup_context=_setup_context)


def glu(gate: torch.Tensor, up: Optional[torch.Tensor] = None, activation: str = "silu") -> torch.Tensor:
    """Fused ``act(gate) * up``; see the module docstring for the exact math.

    With ``up=None``, ``gate`` is the merged ``[..., 2n]`` projection, gate half first.
    """
    register()
    return torch.ops.sloth.glu(gate, up, activation)
