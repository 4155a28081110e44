"""LoRA linears that read one input as one op: ``torch.ops.sloth.lora_linear_shared`` (q, k and v; gate and up),
and ``sloth.qlora_linear_shared`` over bitsandbytes 4-bit bases.

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

(h_i = h[:, i r:(i + 1) r]; the derivation is lora_linear's, summed over i for dx). The adapter kernels that
run once per member (the forward's up kernel, the backward's split of b_i and its down kernel for g_i) run
as one launch for up to three members (lowering/lora_members.py: the same tile functions, each program
choosing its member). The 4-bit op takes each member's quantised weight and statistics as lists (the
absmax_* lists empty without double quantisation) and dequantises every member's weight in one launch into
one buffer, forward and backward (lowering/nf4.py, ``dequantize_4bit_members``); the buffer lives for the
call, which at gate/up holds both weights at once (2 x 112 MiB at Llama-3-8B in bf16) where one at a time
held one.

Launches for n = 3 (tests/test_lora_shared_op.py counts them): forward 3 (split, down, one up for the
members) instead of 9 for three ops; backward 6 (one split and one down for the g_i, 1 up, 3 grad kernels:
da, then the db two to a launch; the grad kernels add their row splits themselves) instead of 12; one op
call each way instead of three; over 4-bit bases one dequantisation launch each way instead of three. x is
read once by the down kernel and once for da, where three ops read it three times each.

Numerics: in exact arithmetic the op equals n separate ops. In floating point two things differ: the down
and grad kernels tile n r adapter columns instead of r (other summation blocks: a few ulps in y, da, db),
and dx's sum over the members is rounded to x's dtype by cuBLAS after each base product (beta 1), as eager's
sum of the projections' input gradients is, where n separate ops let Inductor add their dx in fp32; the
adapter term is added in fp32 and rounded once. The pass that joins members (patterns/lora_shared.py) caps
n r at 128 columns, which keeps the up and grad kernels' tiles within the H200's shared memory.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import nf4
from .backend_choice import use_triton
from .devices import check_one_device
from .layout import rows_2d
from .lora import _check_inputs, _down, _grads, _up_add_, grad_counters, lora_linear_reference
from .lora_members import down_members, up_add_members_
from .qlora import check_quant_type
from .registration import define, fake

Weight = Callable[[int], torch.Tensor]  # member i's base weight [N_i, K] in x's dtype (dense, or dequantised)


def _rank(n: int, biases: list[Optional[torch.Tensor]], a: torch.Tensor, bs: list[torch.Tensor]) -> int:
    if n == 0 or len(biases) != n or len(bs) != n:
        raise ValueError(f"sloth.lora_linear_shared: the weights, biases and bs must have one entry per linear, "
                         f"got {n}, {len(biases)} and {len(bs)}")
    if a.dim() != 2 or a.shape[0] % n:
        raise ValueError(f"sloth.lora_linear_shared: a must be the {n} adapters' a stacked by rows ([{n} r, K]), "
                         f"got shape {tuple(a.shape)}")
    return a.shape[0] // n


def _forward(x: torch.Tensor, weight: Weight, n: int, biases: list[Optional[torch.Tensor]], a: torch.Tensor,
             bs: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """``[y_0, ..., y_{n-1}, h]`` (module docstring); each weight is asked for once, in member order."""
    r = _rank(n, biases, a, bs)
    triton_path = use_triton(x)
    x_MK = rows_2d(x)
    w = weight(0)
    _check_inputs(x, w, biases[0], a[:r], bs[0])  # before any launch; a[:r]: every member's slice looks alike
    if not triton_path:
        ys, hs = [], []
        for i in range(n):
            if i:
                w = weight(i)
                _check_inputs(x, w, biases[i], a[:r], bs[i])
            y, h = lora_linear_reference(x, w, biases[i], a[i * r:(i + 1) * r], bs[i], scale)
            ys.append(y)
            hs.append(h)
        return ys + [torch.cat(hs, 1)]
    h_MR = _down(x_MK, a.t())
    ys = []
    for i in range(n):
        if i:
            w = weight(i)
            _check_inputs(x, w, biases[i], a[:r], bs[i])
        ys.append(F.linear(x_MK, w, biases[i]))  # cuBLAS writes each base; one launch adds every adapter term
    up_add_members_(ys, h_MR, [b.t() for b in bs], scale)
    return [y.view(*x.shape[:-1], y.shape[1]) for y in ys] + [h_MR]


def _backward_impl(dys: list[torch.Tensor], x: torch.Tensor, weight: Weight, a: torch.Tensor, bs: list[torch.Tensor],
                   h: torch.Tensor, scale: float, need_dx: bool, grad_dtype: Optional[torch.dtype] = None
                   ) -> list[torch.Tensor]:
    """``[dx, da, db_0, ..., db_{n-1}]``; dx is empty when ``need_dx`` is False (no weight is then asked for); da
    and the db_i in ``grad_dtype`` when given (lowering/tiled_mlp.py sums them over row blocks in fp32)."""
    n = len(bs)
    r = a.shape[0] // n
    if not use_triton(x):
        x2 = x.reshape(-1, x.shape[-1]).float()
        dy2 = [dy.reshape(-1, dy.shape[-1]).float() for dy in dys]
        g = torch.cat([d @ b.float() for d, b in zip(dy2, bs)], 1)
        dx = (sum(d @ weight(i).float() for i, d in enumerate(dy2)) + scale * g @ a.float()).to(x.dtype) \
            .view(x.shape) if need_dx else x.new_empty(0)
        dbs = [(scale * d.t() @ h[:, i * r:(i + 1) * r]).to(grad_dtype or b.dtype)
               for i, (d, b) in enumerate(zip(dy2, bs))]
        return [dx, (scale * g.t() @ x2).to(grad_dtype or a.dtype), *dbs]
    x_MK = rows_2d(x)
    dys_MN = [rows_2d(dy) for dy in dys]
    g_MR = down_members(dys_MN, bs, torch.empty((x_MK.shape[0], n * r), dtype=torch.float32, device=x.device))
    if need_dx:
        dx = dys_MN[0] @ weight(0)
        for i in range(1, n):
            dx.addmm_(dys_MN[i], weight(i))  # cuBLAS adds the product into dx in its epilogue (beta 1)
        dx = _up_add_(dx, g_MR, a, scale).view(x.shape)
    else:
        dx = x.new_empty(0)
    pairs = [[(h[:, j * r:(j + 1) * r], dys_MN[j], True) for j in range(i, min(i + 2, n))]
             for i in range(0, n, 2)]  # the db problems share rank r (da's is n r): two to a launch
    counters = grad_counters([[x_MK.shape[1]]] + [[d.shape[1] for _, d, _ in pair] for pair in pairs],
                             x_MK.shape[0], x.device)
    (da,) = _grads([(g_MR, x_MK, False)], scale, counters)
    dbs: list[torch.Tensor] = []
    for pair in pairs:
        dbs += _grads(pair, scale, counters)
    return [dx, da.to(grad_dtype or a.dtype), *(db.to(grad_dtype or b.dtype) for db, b in zip(dbs, bs))]


def lora_shared_forward(x: torch.Tensor, ws: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
                        a: torch.Tensor, bs: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    return _forward(x, ws.__getitem__, len(ws), biases, a, bs, scale)


def lora_shared_backward(dys: list[torch.Tensor], x: torch.Tensor, ws: list[torch.Tensor], a: torch.Tensor,
                         bs: list[torch.Tensor], h: torch.Tensor, scale: float, need_dx: bool,
                         grad_dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    return _backward_impl(dys, x, ws.__getitem__, a, bs, h, scale, need_dx, grad_dtype)


def _quantized(packed: list[torch.Tensor], absmax: list[torch.Tensor], absmax_code: list[torch.Tensor],
               absmax_scale: list[torch.Tensor], absmax_offset: list[torch.Tensor], out_features: list[int],
               in_features: int, blocksize: int, quant_type: str, dtype: torch.dtype) -> Weight:
    """Member i's 4-bit base dequantised (lowering/qlora.py); the three absmax lists are empty without double
    quantisation."""
    n = len(packed)
    nested = len(absmax_code) > 0
    if len(absmax) != n or len(out_features) != n or \
            (nested and not len(absmax_code) == len(absmax_scale) == len(absmax_offset) == n) or \
            (not nested and (absmax_scale or absmax_offset)):
        raise ValueError(f"sloth.qlora_linear_shared: one packed weight, absmax and out_features per linear, and "
                         f"absmax_code, absmax_scale, absmax_offset all empty or one per linear, got {n}, "
                         f"{len(absmax)}, {len(out_features)} and {len(absmax_code)}, {len(absmax_scale)}, "
                         f"{len(absmax_offset)}")
    check_quant_type(quant_type, "sloth.qlora_linear_shared")
    rows = [0]
    for n_i in out_features:
        rows.append(rows[-1] + n_i)
    weights: list[torch.Tensor] = []

    def weight(i: int) -> torch.Tensor:
        if not weights:  # every member's weight in one launch (lowering/nf4.py), on the first request
            states = [(absmax_scale[j], absmax_code[j], absmax_offset[j], 256) for j in range(n)] if nested else None
            weights.append(nf4.dequantize_4bit_members(packed, absmax, states, blocksize, quant_type,
                                                       [(n_j, in_features) for n_j in out_features], dtype))
        return weights[0][rows[i]:rows[i + 1]]

    return weight


def qlora_shared_forward(x: torch.Tensor, packed: list[torch.Tensor], absmax: list[torch.Tensor],
                         absmax_code: list[torch.Tensor], absmax_scale: list[torch.Tensor],
                         absmax_offset: list[torch.Tensor], out_features: list[int], in_features: int,
                         blocksize: int, quant_type: str, biases: list[Optional[torch.Tensor]], a: torch.Tensor,
                         bs: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    weight = _quantized(packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features, in_features,
                        blocksize, quant_type, x.dtype)
    return _forward(x, weight, len(packed), biases, a, bs, scale)


def qlora_shared_backward(dys: list[torch.Tensor], x: torch.Tensor, packed: list[torch.Tensor],
                          absmax: list[torch.Tensor], absmax_code: list[torch.Tensor],
                          absmax_scale: list[torch.Tensor], absmax_offset: list[torch.Tensor],
                          out_features: list[int], in_features: int, blocksize: int, quant_type: str, a: torch.Tensor,
                          bs: list[torch.Tensor], h: torch.Tensor, scale: float, need_dx: bool) -> list[torch.Tensor]:
    weight = _quantized(packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features, in_features,
                        blocksize, quant_type, x.dtype)
    return _backward_impl(dys, x, weight, a, bs, h, scale, need_dx)


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: graph citizens with fake implementations and their own backward.
# ---------------------------------------------------------------------------------------------------

def _grad_structure(inputs) -> list[Optional[list]]:
    """Per input, what its gradient slot must look like as torch.library flattens the inputs: a list of
    tensors only is a list (one None per item); anything else, a list with a None in it too, is one slot."""
    return [[None] * len(v) if isinstance(v, list) and all(isinstance(t, torch.Tensor) for t in v) else None
            for v in inputs]


def _per_item(flags, n: int) -> list[bool]:
    """``ctx.needs_input_grad``'s entry for a list input: a list of bools, or one bool (a list of Optional
    tensors), as one bool per item."""
    return [bool(f) for f in flags] if isinstance(flags, (list, tuple)) else [bool(flags)] * n


def _save(ctx, inputs, output, x, a, bs, bases: list[torch.Tensor], scale) -> None:
    ctx.save_for_backward(x, a, output[-1], *bs, *bases)
    ctx.mark_non_differentiable(output[-1])  # h is returned to be saved, not to be used
    ctx.n, ctx.scale, ctx.structure = len(bs), scale, _grad_structure(inputs)


def _check_frozen(ctx, base_index: int, bias_index: int) -> None:
    """Raise, before any backward work, when a base weight or bias wants a gradient the op does not compute."""
    needs = ctx.needs_input_grad
    if any(_per_item(needs[base_index], ctx.n)) or any(_per_item(needs[bias_index], ctx.n)):
        raise RuntimeError("sloth.lora_linear_shared: the base weights and biases must be frozen "
                           "(requires_grad=False); the op computes no gradient for them")


def _grads_to_return(ctx, dx, da, dbs, x_index: int, a_index: int, b_index: int):
    needs = ctx.needs_input_grad
    out = [None if slot is None else list(slot) for slot in ctx.structure]
    out[x_index] = dx if needs[x_index] else None
    out[a_index] = da if needs[a_index] else None
    out[b_index] = [db if need else None for db, need in zip(dbs, _per_item(needs[b_index], ctx.n))]
    return tuple(out)


def _setup_dense(ctx, inputs, output) -> None:
    x, ws, _, a, bs, scale = inputs
    _save(ctx, inputs, output, x, a, bs, ws, scale)


def _backward_dense(ctx, grads):
    _check_frozen(ctx, base_index=1, bias_index=2)
    x, a, h, *rest = ctx.saved_tensors
    bs, ws = rest[:ctx.n], rest[ctx.n:]
    dx, da, *dbs = torch.ops.sloth.lora_linear_shared_backward(list(grads[:ctx.n]), x, list(ws), a, list(bs), h,
                                                               ctx.scale, bool(ctx.needs_input_grad[0]))
    return _grads_to_return(ctx, dx, da, dbs, x_index=0, a_index=3, b_index=4)


_Q_ARGS = ("x", "packed", "absmax", "absmax_code", "absmax_scale", "absmax_offset", "out_features", "in_features",
           "blocksize", "quant_type", "biases", "a", "bs", "scale")


def _setup_4bit(ctx, inputs, output) -> None:
    args = dict(zip(_Q_ARGS, inputs))
    tensors = [*args["packed"], *args["absmax"], *args["absmax_code"], *args["absmax_scale"], *args["absmax_offset"]]
    _save(ctx, inputs, output, args["x"], args["a"], args["bs"], tensors, args["scale"])
    ctx.static = tuple(args[k] for k in ("out_features", "in_features", "blocksize", "quant_type"))


def _backward_4bit(ctx, grads):
    _check_frozen(ctx, base_index=1, bias_index=10)
    x, a, h, *rest = ctx.saved_tensors
    n = ctx.n
    bs, q = rest[:n], rest[n:]
    # q holds packed and absmax per member, then code, scale and offset per member when double-quantised.
    packed, absmax, code, absmax_scale, offset = (list(q[i * n:(i + 1) * n]) for i in range(5))
    out_features, in_features, blocksize, quant_type = ctx.static
    dx, da, *dbs = torch.ops.sloth.qlora_linear_shared_backward(
        list(grads[:n]), x, packed, absmax, code, absmax_scale, offset, list(out_features), in_features, blocksize,
        quant_type, a, list(bs), h, ctx.scale, bool(ctx.needs_input_grad[0]))
    return _grads_to_return(ctx, dx, da, dbs, x_index=0, a_index=11, b_index=12)


@functools.cache
def register() -> None:
    """Define ``sloth::lora_linear_shared``, ``sloth::qlora_linear_shared`` and their backwards (idempotent)."""
    fwd = define("sloth::lora_linear_shared", lora_shared_forward)
    bwd = define("sloth::lora_linear_shared_backward", lora_shared_backward)
    qfwd = define("sloth::qlora_linear_shared", qlora_shared_forward)
    qbwd = define("sloth::qlora_linear_shared_backward", qlora_shared_backward)

    def _outputs(x, out_features, a):
        rows = math.prod(x.shape[:-1])
        return [x.new_empty((*x.shape[:-1], n)) for n in out_features] + \
            [x.new_empty((rows, a.shape[0]), dtype=torch.float32)]

    def _grad_values(x, a, bs, need_dx):
        return [x.new_empty(x.shape) if need_dx else x.new_empty(0), a.new_empty(a.shape),
                *(b.new_empty(b.shape) for b in bs)]

    @fake(fwd)
    def _(x, ws, biases, a, bs, scale):
        # A call with a meta input runs this, not the op and its checks (lowering/devices.py).
        check_one_device("sloth.lora_linear_shared", ("x", x), ("a", a),
                         *((f"ws[{i}]", w) for i, w in enumerate(ws)),
                         *((f"biases[{i}]", t) for i, t in enumerate(biases)),
                         *((f"bs[{i}]", b) for i, b in enumerate(bs)))
        return _outputs(x, [w.shape[0] for w in ws], a)

    @fake(bwd)
    def _(dys, x, ws, a, bs, h, scale, need_dx):
        return _grad_values(x, a, bs, need_dx)

    @fake(qfwd)
    def _(x, packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features, in_features, blocksize,
          quant_type, biases, a, bs, scale):
        # A call with a meta input runs this, not the op and its checks (lowering/devices.py).
        check_one_device("sloth.qlora_linear_shared", ("x", x), ("a", a),
                         *((f"{name}[{i}]", t) for name, ts in (("packed", packed), ("absmax", absmax),
                                                                 ("absmax_code", absmax_code),
                                                                 ("absmax_scale", absmax_scale),
                                                                 ("absmax_offset", absmax_offset),
                                                                 ("biases", biases), ("bs", bs))
                           for i, t in enumerate(ts)))
        return _outputs(x, out_features, a)

    @fake(qbwd)
    def _(dys, x, packed, absmax, absmax_code, absmax_scale, absmax_offset, out_features, in_features, blocksize,
          quant_type, a, bs, h, scale, need_dx):
        return _grad_values(x, a, bs, need_dx)

    fwd.register_autograd(_backward_dense, setup_context=_setup_dense)
    qfwd.register_autograd(_backward_4bit, setup_context=_setup_4bit)


def lora_linear_shared(x: torch.Tensor, ws: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
                       a_list: list[torch.Tensor], bs: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """``[lora_linear(x, w_i, bias_i, a_i, b_i, scale) for each i]`` as one op (module docstring): the
    adapters share x, one rank, one dtype and the scale."""
    register()
    *ys, _ = torch.ops.sloth.lora_linear_shared(x, list(ws), list(biases), torch.cat(list(a_list), 0), list(bs),
                                                float(scale))
    return ys
