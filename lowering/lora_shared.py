"""LoRA linears that read one input as one op: ``torch.ops.sloth.lora_linear_shared`` (q, k and v; gate and up).

The op equals, for i = 0..n-1 (``x`` [..., K]; frozen ``w_i`` [N_i, K] and ``bias_i``; adapters of one rank r
and one dtype, ``a = cat(a_0, ..., a_{n-1})`` [n r, K] and ``b_i`` [N_i, r]; one scale ``s``)::

    y_i = sloth.lora_linear(x, w_i, bias_i, a[i r:(i + 1) r], b_i, s)        (lowering/lora.py: the same math)

and returns ``[y_0, ..., y_{n-1}, h]``, h = x2 @ a.T [M, n r] (fp32, saved for backward). The graph
concatenates the a_i itself (a few hundred KB), so autograd splits da back into the adapters' gradients.

Why one op for several: on the H200 every op call from a compiled graph costs ~30 us of PyTorch's custom-op
dispatch and every Triton launch ~16 us of host time (benchmarks/results/2026-11-29_212631_launch_overhead.*),
and a LoRA step without CUDA graphs is bound by that host time. q, k and v (and an MLP's gate and up) read
the same x: as one op they make one call instead of n and share the launches that read x::

    forward   h        = x2 @ a.T                              [M, n r]   one down launch (x read once)
              y_i      = x2 @ w_i.T + bias_i + s * h_i @ b_i.T             cuBLAS, then the up kernel in place
    backward  g_i      = dy_i @ b_i,  g = [g_0 | ... | g_{n-1}]  [M, n r]
              dx       = sum_i dy_i @ w_i + s * g @ a                      cuBLAS accumulating in place (beta 1),
                                                                           then one up kernel
              da       = s * g.T @ x2                          [n r, K]   one grad problem (x read once)
              db_i     = s * dy_i.T @ h_i                                  paired two to a launch

(h_i = h[:, i r:(i + 1) r]; the derivation is lora_linear's, summed over i for dx). Launches for n = 3
(tests/test_lora_shared_op.py counts them): forward 5 (split, down, 3 up) instead of 9; backward 10 (3 splits,
3 downs, 1 up, 3 grad kernels: da, then the db two to a launch) instead of 12; and one op call each way
instead of three. x is read once by the down kernel and once for da, where three ops read it three times each. Rounding differs from n
separate ops only in dx: cuBLAS rounds the running sum of the base products to x's dtype after each
product, as eager's sum of the projections' input gradients does; the adapter term is added in fp32 and
rounded once.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .backend_choice import use_triton
from .layout import rows_2d
from .lora import _check_inputs, _down, _grads, _up_add_, lora_linear_reference
from .registration import define, fake


def _rank(ws: list[torch.Tensor], biases: list[Optional[torch.Tensor]], a: torch.Tensor,
          bs: list[torch.Tensor]) -> int:
    n = len(ws)
    if n == 0 or len(biases) != n or len(bs) != n:
        raise ValueError(f"sloth.lora_linear_shared: ws, biases and bs must have one entry per linear, got "
                         f"{len(ws)}, {len(biases)} and {len(bs)}")
    if a.dim() != 2 or a.shape[0] % n:
        raise ValueError(f"sloth.lora_linear_shared: a must be the {n} adapters' a stacked by rows ([{n} r, K]), "
                         f"got shape {tuple(a.shape)}")
    return a.shape[0] // n


def _check(x: torch.Tensor, ws: list[torch.Tensor], biases: list[Optional[torch.Tensor]], a: torch.Tensor,
           bs: list[torch.Tensor]) -> int:
    r = _rank(ws, biases, a, bs)
    for i, (w, bias, b) in enumerate(zip(ws, biases, bs)):
        _check_inputs(x, w, bias, a[i * r:(i + 1) * r], b)
    return r


def lora_shared_reference(x: torch.Tensor, ws: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
                          a: torch.Tensor, bs: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """``[y_0, ..., y_{n-1}, h]`` by the module docstring's formula, each y_i as lora_linear's reference."""
    r = _rank(ws, biases, a, bs)
    outs = [lora_linear_reference(x, w, bias, a[i * r:(i + 1) * r], b, scale)
            for i, (w, bias, b) in enumerate(zip(ws, biases, bs))]
    return [y for y, _ in outs] + [torch.cat([h for _, h in outs], 1)]


def lora_shared_forward(x: torch.Tensor, ws: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
                        a: torch.Tensor, bs: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    r = _check(x, ws, biases, a, bs)
    if not use_triton(x):
        return lora_shared_reference(x, ws, biases, a, bs, scale)
    x_MK = rows_2d(x)
    h_MR = _down(x_MK, a.t())
    ys = [_up_add_(F.linear(x_MK, w, bias), h_MR[:, i * r:(i + 1) * r], b.t(), scale).view(*x.shape[:-1], w.shape[0])
          for i, (w, bias, b) in enumerate(zip(ws, biases, bs))]
    return ys + [h_MR]


def lora_shared_backward(dys: list[torch.Tensor], x: torch.Tensor, ws: list[torch.Tensor], a: torch.Tensor,
                         bs: list[torch.Tensor], h: torch.Tensor, scale: float, need_dx: bool) -> list[torch.Tensor]:
    """``[dx, da, db_0, ..., db_{n-1}]``; dx is empty when ``need_dx`` is False."""
    n = len(ws)
    r = a.shape[0] // n
    if not use_triton(x):
        x2 = x.reshape(-1, x.shape[-1]).float()
        dy2 = [dy.reshape(-1, dy.shape[-1]).float() for dy in dys]
        g = torch.cat([d @ b.float() for d, b in zip(dy2, bs)], 1)
        dx = (sum(d @ w.float() for d, w in zip(dy2, ws)) + scale * g @ a.float()).to(x.dtype).view(x.shape) \
            if need_dx else x.new_empty(0)
        dbs = [(scale * d.t() @ h[:, i * r:(i + 1) * r]).to(b.dtype) for i, (d, b) in enumerate(zip(dy2, bs))]
        return [dx, (scale * g.t() @ x2).to(a.dtype), *dbs]
    x_MK = rows_2d(x)
    dys_MN = [rows_2d(dy) for dy in dys]
    g_MR = torch.empty((x_MK.shape[0], n * r), dtype=torch.float32, device=x.device)
    for i, (dy_MN, b) in enumerate(zip(dys_MN, bs)):
        _down(dy_MN, b, out=g_MR[:, i * r:(i + 1) * r])
    if need_dx:
        dx = dys_MN[0] @ ws[0]
        for dy_MN, w in zip(dys_MN[1:], ws[1:]):
            dx.addmm_(dy_MN, w)  # cuBLAS adds the product into dx in its epilogue (beta 1)
        dx = _up_add_(dx, g_MR, a, scale).view(x.shape)
    else:
        dx = x.new_empty(0)
    (da,) = _grads([(g_MR, x_MK, False)], scale)
    dbs: list[torch.Tensor] = []
    for i in range(0, n, 2):  # the db problems share rank r (da's is n r): two to a launch
        pair = [(h[:, j * r:(j + 1) * r], dys_MN[j], True) for j in range(i, min(i + 2, n))]
        dbs += _grads(pair, scale)
    return [dx, da.to(a.dtype), *(db.to(b.dtype) for db, b in zip(dbs, bs))]


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    x, ws, _biases, a, bs, scale = inputs
    ctx.save_for_backward(x, a, output[-1], *ws, *bs)
    ctx.mark_non_differentiable(output[-1])  # h is returned to be saved, not to be used
    ctx.n, ctx.scale = len(ws), scale
    # The gradient must mirror the input's structure as torch.library flattens it: a list of tensors only is
    # a list (one None each); a list with a None in it is one non-tensor argument (one None).
    ctx.bias_grads = [None] * len(ws) if all(b is not None for b in _biases) else None


def _per_item(flags, n: int) -> list[bool]:
    """``ctx.needs_input_grad``'s entry for a list input: a list of bools, or one bool (seen for a list of
    Optional tensors), as one bool per item."""
    return [bool(f) for f in flags] if isinstance(flags, (list, tuple)) else [bool(flags)] * n


def _backward(ctx, grads):
    x, a, h, *rest = ctx.saved_tensors
    ws, bs = rest[:ctx.n], rest[ctx.n:]
    needs_x, needs_w, needs_bias, needs_a, needs_b, _ = ctx.needs_input_grad
    needs_b = _per_item(needs_b, ctx.n)
    if any(_per_item(needs_w, ctx.n)) or any(_per_item(needs_bias, ctx.n)):
        raise RuntimeError("sloth.lora_linear_shared: the base weights and biases must be frozen "
                           "(requires_grad=False); the op computes no gradient for them")
    dx, da, *dbs = torch.ops.sloth.lora_linear_shared_backward(list(grads[:ctx.n]), x, list(ws), a, list(bs), h,
                                                               ctx.scale, needs_x)
    return (dx if needs_x else None), [None] * ctx.n, ctx.bias_grads, (da if needs_a else None), \
        [db if need else None for db, need in zip(dbs, needs_b)], None


@functools.cache
def register() -> None:
    """Define ``sloth::lora_linear_shared`` and its backward (idempotent)."""
    fwd = define("sloth::lora_linear_shared", lora_shared_forward)
    bwd = define("sloth::lora_linear_shared_backward", lora_shared_backward)

    @fake(fwd)
    def _(x, ws, biases, a, bs, scale):
        rows = math.prod(x.shape[:-1])
        return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in ws] + \
            [x.new_empty((rows, a.shape[0]), dtype=torch.float32)]

    @fake(bwd)
    def _(dys, x, ws, a, bs, h, scale, need_dx):
        return [x.new_empty(x.shape) if need_dx else x.new_empty(0), a.new_empty(a.shape),
                *(b.new_empty(b.shape) for b in bs)]

    fwd.register_autograd(_backward, setup_context=_setup_context)


def lora_linear_shared(x: torch.Tensor, ws: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
                       a_list: list[torch.Tensor], bs: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """``[lora_linear(x, w_i, bias_i, a_i, b_i, scale) for each i]`` as one op (module docstring): the
    adapters share x, one rank, one dtype and the scale."""
    register()
    *ys, _ = torch.ops.sloth.lora_linear_shared(x, list(ws), list(biases), torch.cat(list(a_list), 0), list(bs),
                                                float(scale))
    return ys
