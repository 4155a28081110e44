"""LoRA family (``"lora"`` in the report): a frozen linear plus low-rank adapters on the same input.

The meaning, as plain PyTorch (also the test oracle and the eager benchmark baseline)::

    lora_pattern(x, w, bias, a, b, s)   peft's LoRA Linear, dropout 0:
        (F.linear(x, w, bias) + F.linear(F.linear(x.to(a.dtype), a), b) * s).to(x.dtype)

Variants matched on the canonical graph, whatever module wrote them::

    base = F.linear(x, w, bias) | x @ w.t()                     w frozen, bias frozen or None
         | a bitsandbytes Linear4bit (NF4/FP4, double-quantised or not; patterns/bnb_4bit.py)
    low  = chain from x to the adapter's output made of, in any order and number:
           casts, multiplies/divides by a constant, and the two projections F.linear(., a) and
           F.linear(., b) (or ``. @ a.T``, ``. @ b.T``), both without bias; an inactive dropout
           (p = 0 or training off) counts as nothing
    out  = base + low_1 + ... + low_n (nested adds, either operand order), then a cast back to x's dtype
           when the sum is in another one
    -> sloth.lora_linear(x, w, bias, a, b, s)       s the product of the constants (divides inverted);
       sloth.qlora_linear(x, <4-bit weight>, ...)   for a 4-bit base; several adapters as one, their
       factors stacked: a = [a_1; a_2], b = [b_1, (s_2 / s_1) b_2], s = s_1

peft's graph (``result = base_layer(x); x = x.to(lora_A.weight.dtype); result = result + lora_B(lora_A(
dropout(x))) * scaling`` for each active adapter, then ``result.to(torch_result_dtype)``), hand-written
``F.linear(x, W) + s * (x @ A.T) @ B.T`` and the scale applied to x or between the factors all reach this
form. The replacement computes the adapter in fp32 and rounds the sum once (lowering/lora.py), so it is at
least as accurate as each variant; roundings inside the adapter chain (a cast of x to a bf16 adapter, or a
lossy round trip such as ``x.bfloat16().float()``) are not reproduced: the op reads x as the base does.

Under autocast (``torch.autocast(dtype=d)``, which TRL's and transformers' ``bf16=True`` put around the
forward) the graph holds no casts: each projection's result is simply in d while its inputs may be float32
(an fp32 model's x and weights; peft's ``x.to(lora_A.weight.dtype)``), and the sum is in d. Without autocast
``F.linear`` needs one dtype, so a base whose result differs from its inputs' dtype ran under autocast, which
computed ``F.linear(x.to(d), w.to(d), bias.to(d))`` and each adapter projection likewise. The site is fused
when every projection of it ran in that d: the op gets x, w, bias, a and b cast to d (one cast of x for all
the sites that read it) and returns the sum in d, as autocast's did (custom ops get no autocast casts).

Anything else says no, with the reason in the report, and leaves the graph as it was: a trainable base
weight or bias when gradients are on (only the frozen case is implemented), an active dropout (its mask
is not fused), an adapter factor or the base output read by another node too, a sum kept in another dtype
than x's, adapters of different dtypes on one base, float64, shapes that do not chain, x (or the adapter's
cast of it) written in place between the base's and the adapter's reads or, when gradients flow, after
them, a grad-mode or autocast change between the reads, and an adapter multiplied by a tensor of one
factor per output feature instead of a constant (DoRA's magnitude / ||W + s B A|| rescaling, a scale kept
in a tensor): DoRA is not this sum and is not fused.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.anchors import cut_by_graph_boundary, near, returned_only
from ..compiler.canonicalize import cast
from ..compiler.fx_utils import (matrix_width, dtype_of, insert_call, is_call, is_number, linear_parts, module_path,
                                 replace_and_erase, source_location, tensor_of, value_of)
from ..compiler.options import PassOptions
from ..compiler.families import Family
from ..compiler.report import Report, Site
from ..compiler.writes import mutated_producer, written
from .bnb_4bit import Bnb4bitBase, bnb_4bit_base, erase_if_unused, packed_bytes
from .lora_shared import share_lora_inputs
from .tiled_mlp import tile_lora_mlps

FAMILY = "lora"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _lowering():
    """The kernel module, imported on first use (see patterns/rms_norm.py for why)."""
    from ..lowering import lora

    return lora


def _lowering_glu_lora():
    """lowering/glu_lora.py, imported on first use (as _lowering)."""
    from ..lowering import glu_lora

    return glu_lora


def _lowering_nf4():
    """lowering/nf4.py, imported on first use (as _lowering)."""
    from ..lowering import nf4

    return nf4


def _lowering_qlora():
    """lowering/qlora.py, imported on first use (as _lowering)."""
    from ..lowering import qlora

    return qlora


def lora_pattern(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor,
                 s: float) -> torch.Tensor:
    """peft's LoRA linear with dropout 0: base output plus the scaled adapter, cast back to x's dtype."""
    return (F.linear(x, w, bias) + F.linear(F.linear(x.to(a.dtype), a), b) * s).to(x.dtype)


@dataclasses.dataclass
class Adapter:
    a: fx.Node
    b: fx.Node
    scale: float
    reads: tuple[fx.Node, ...] = ()  # the casts and constant multiplies of x the down projection reads through
    x_reader: Optional[fx.Node] = None  # the adapter's node that reads x (the first of reads, or the down)


@dataclasses.dataclass
class LoraMatch:
    x: fx.Node
    w: Optional[fx.Node]  # the dense base weight, or None for a 4-bit base (``quantized``)
    quantized: Optional[Bnb4bitBase]
    bias: Optional[fx.Node]
    adapters: list[Adapter]  # one, or several summed onto the same base (peft with several active adapters)
    out: fx.Node
    detail: str
    op: str = ""  # the sloth op the site became, set by _replace
    base: Optional[fx.Node] = None  # the base projection (the node that reads x for it)
    autocast: Optional[torch.dtype] = None  # the dtype autocast ran the projections in, when not the inputs'


def _dropout_inactive(node: fx.Node) -> Union[bool, str]:
    """True for a dropout that does nothing (p = 0 or training off), a reason string for one that acts."""
    args = dict(zip(("input", "p", "training", "inplace"), node.args), **node.kwargs)
    p, training = args.get("p", 0.5), args.get("training", True)
    if not is_number(p) or not isinstance(training, bool):
        return "the adapter's dropout has a runtime p or training flag"
    if p == 0 or not training:
        return True
    return f"the adapter's input goes through dropout p={p} in training; its mask is not fused"


def _dropout_input(node: fx.Node) -> Any:
    """The tensor an F.dropout call reads, passed by position or as ``input=``."""
    return node.args[0] if node.args else node.kwargs.get("input")


def _strip_scalars(node: Any, scale: float, steps: list[fx.Node], stop: Any = None
                   ) -> tuple[Any, float, Optional[str]]:
    """Walk up through casts, constant multiplies/divides and inactive dropouts, never past ``stop``;
    (node reached, scale, why not)."""
    while isinstance(node, fx.Node) and node is not stop:
        if is_call(node, cast):
            nxt = node.args[0]
        elif is_call(node, torch.mul) and is_number(node.args[1]) and isinstance(node.args[0], fx.Node):
            scale, nxt = scale * node.args[1], node.args[0]
        elif is_call(node, torch.mul) and is_number(node.args[0]) and isinstance(node.args[1], fx.Node):
            scale, nxt = scale * node.args[0], node.args[1]
        elif is_call(node, torch.div) and is_number(node.args[1]) and node.args[1] != 0:
            scale, nxt = scale / node.args[1], node.args[0]
        elif node.op == "call_function" and node.target is F.dropout:
            inactive = _dropout_inactive(node)
            if inactive is not True:
                return node, scale, inactive
            nxt = _dropout_input(node)
        else:
            return node, scale, None
        steps.append(node)
        node = nxt
    return node, scale, None


def _adapter(low: Any, x_base: Any) -> Union[tuple[Any, fx.Node, fx.Node, float, list[fx.Node],
                                                   tuple[tuple[fx.Node, ...], fx.Node]], str, None]:
    """(x, a, b, scale, chain nodes, (the nodes between x and the down projection, the node that reads x))
    when ``low`` is ``s * F.linear(F.linear(x, a), b)`` up to casts and constants, walking back from the
    adapter's input no further than the base's input ``x_base``; a reason for a near-miss (the two
    projections on x_base, but something else is wrong); None."""
    steps: list[fx.Node] = []
    node, scale, why = _strip_scalars(low, 1.0, steps)
    up = linear_parts(node)
    if why or up is None or up[2] is not None:
        return None
    steps.append(node)
    node, scale, why = _strip_scalars(up[0], scale, steps)
    down = linear_parts(node)
    if down is None or down[2] is not None:
        return None
    if why:
        return why
    steps.append(node)
    # The casts and constant multiplies between x and the down projection are not chain nodes: the fused op
    # reads x itself, so other readers of them (q, k and v sharing one cast of x to the adapters' dtype) keep
    # them, and they are erased with the last reader.
    reads: list[fx.Node] = []
    x, scale, why = _strip_scalars(down[0], scale, reads, stop=x_base)
    if why:
        # Only a LoRA of this base is a near-miss: the active dropout must read the base's input.
        reaches_base = _strip_scalars(_dropout_input(x), 1.0, [], stop=x_base)[0] is x_base
        return why if reaches_base else None
    return x, down[1], up[1], scale, steps, (tuple(reads), reads[-1] if reads else node)


def _tensor_scaled_adapter(node: fx.Node) -> Optional[str]:
    """Why ``node`` is left alone when it is ``t * adapter``, a low-rank chain of two bias-free projections of
    trainable factors (``s * F.linear(F.linear(x, a), b)``) multiplied by a tensor ``t`` of one factor per
    output feature or one number, rather than a constant: DoRA's magnitude / ||W + s B A|| rescaling has this
    form, and so does a scale kept in a tensor; or by a symbolic number (a SymFloat: ``dynamic=True`` makes
    peft's float scaling a graph input). None for anything else (the low-rank check keeps ordinary
    two-layer MLPs out of the report, the shape check masks and per-token factors)."""
    if not (is_call(node, torch.mul) and len(node.args) == 2
            and all(isinstance(arg, fx.Node) for arg in node.args)):
        return None
    for low, other in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        up = linear_parts(_strip_scalars(low, 1.0, [])[0])
        if up is None or up[2] is not None:
            continue
        down = linear_parts(_strip_scalars(up[0], 1.0, [])[0])
        if down is None or down[2] is not None:
            continue
        at, bt, ot = tensor_of(down[1]), tensor_of(up[1]), tensor_of(other)
        if at is None or bt is None or at.dim() != 2 or bt.dim() != 2:
            continue
        rank = at.shape[0]
        low_rank = at.requires_grad and bt.requires_grad and bt.shape[1] == rank \
            and 2 * rank <= min(at.shape[1], bt.shape[0])
        if ot is None and isinstance(value_of(other), (torch.SymFloat, torch.SymInt)) and low_rank:
            return (f"the adapter's output (rank {rank}) is multiplied by a symbolic number, not a constant "
                    "(torch.compile(dynamic=True) makes Python floats such as peft's scaling graph inputs); only "
                    "base + constant * adapter is fused")
        if ot is None:
            continue
        # A factor per output feature ([N], [1, N], ...; DoRA's is [1, N]) or one number in a tensor: a mask or
        # a per-token factor ([b, s, 1]; a norm's rsqrt) multiplies many other things too.
        per_feature = ot.numel() == 1 or (ot.dim() >= 1 and ot.shape[-1] == bt.shape[0]
                                          and all(size == 1 for size in ot.shape[:-1]))
        if per_feature and low_rank:
            return (f"the adapter's output (rank {rank}) is multiplied by a tensor of shape {tuple(ot.shape)}, not a "
                    "constant (DoRA's magnitude / ||W + s B A|| rescaling has this form); only base + constant * "
                    "adapter is fused")
    return None


def _base(gm: fx.GraphModule, node: Any) -> Union[tuple[Any, Any, Any, Optional[Bnb4bitBase]], str, None]:
    """(x, w, bias, None) for a dense linear, (x, None, bias, 4-bit base) for a bitsandbytes 4-bit one."""
    parts = linear_parts(node)
    if parts is not None:
        return (*parts, None)
    quantized = bnb_4bit_base(gm, node)
    if quantized is None and is_call(node, cast) and isinstance(node.args[0], fx.Node) \
            and len(node.args[0].users) == 1:
        # Linear4bit's result cast back to its input's dtype (patterns/bnb_4bit.py, Bnb4bitBase.result_dtype)
        inner = bnb_4bit_base(gm, node.args[0])
        if isinstance(inner, Bnb4bitBase):
            quantized = dataclasses.replace(inner, result_dtype=node.args[1])
    if quantized is None or isinstance(quantized, str):
        return quantized
    return quantized.x, None, quantized.bias, quantized


def _cast_of(node: Any, x: Any) -> bool:
    """Whether ``node`` is ``x`` cast (once or more): bitsandbytes' Linear4bit reads ``x.to(compute_dtype)``
    where the adapter reads x."""
    while is_call(node, cast):
        node = node.args[0]
        if node is x:
            return True
    return False


_MAX_ADAPTERS = 8


def _sum_onto_base(gm: fx.GraphModule, node: Any, depth: int = 0
                   ) -> Union[tuple[tuple, fx.Node, list[Adapter], list[fx.Node]], str, None]:
    """(base parts, base node, adapters, chain nodes) when ``node`` is ``base + adapter_1 + ... + adapter_n``
    (nested adds, each adding one adapter of the base's input, in either operand order); a reason for a
    near-miss; None. At depth 0 ``node`` is the outermost add."""
    parts = _base(gm, node) if depth else None
    if parts is not None:
        return parts if isinstance(parts, str) else (parts, node, [], [])
    if not (is_call(node, torch.add) and len(node.args) == 2) or depth > _MAX_ADAPTERS:
        return None
    for inner, low in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        below = _sum_onto_base(gm, inner, depth + 1)
        if below is None:
            continue
        x_base = below[0][0] if not isinstance(below, str) else None
        found = _adapter(low, x_base)
        if found is None:
            continue
        if isinstance(found, str) or isinstance(below, str):
            return found if isinstance(found, str) else below
        x, a, b, scale, steps, (reads, x_reader) = found
        if x is not x_base and not _cast_of(x_base, x):
            continue  # the adapter reads another tensor than the base: not a LoRA of this linear
        if x is not x_base:  # the base reads a cast of the adapter's x: the op reads x as the base does
            reads = (*reads, x)
        parts, base, adapters, chain = below
        return (parts, base, adapters + [Adapter(a, b, scale, reads, x_reader)],
                chain + steps + ([node] if depth else []))
    return None


def _unmatched_adapter(chain: fx.Node) -> tuple[fx.Node, str]:
    """(the add, why) for a low-rank chain ``B(A(x))`` added to something that is not a LoRA sum onto a base."""
    node = chain
    while not is_call(node, torch.add):
        node = next(iter(node.users))
    other = node.args[1] if _strip_scalars(node.args[0], 1.0, [])[0] is chain else node.args[0]
    x_adapter = _strip_scalars(linear_parts(_strip_scalars(linear_parts(chain)[0], 1.0, [])[0])[0], 1.0, [])[0]
    base = linear_parts(_strip_scalars(other, 1.0, [])[0])
    if base is not None and base[0] is not x_adapter:
        return node, ("the low-rank product B(A(.)) reads another input than the linear it is added to (base(x) + "
                      "B(A(y))): not a LoRA of that linear")
    if base is not None:
        return node, "base(x) + B(A(x)) in a form none of the LoRA patterns matched (please report it)"
    stripped = _strip_scalars(other, 1.0, [])[0]
    if isinstance(stripped, fx.Node) and stripped.op == "placeholder":
        return node, ("the tensor B(A(x)) is added to is an input of this graph: the site was cut apart by a graph "
                      "boundary (a graph break, or DDP's split at a gradient bucket: torch._dynamo.config."
                      "optimize_ddp = False keeps one graph), so its base linear was compiled in another graph")
    if is_call(other, torch.add) and any((parts := linear_parts(_strip_scalars(a, 1.0, [])[0])) is not None
                                         and parts[0] is x_adapter for a in other.args):
        return node, ("the adapter is added to a sum that holds its base, (r + base(x)) + s * B(A(x)), not to base(x) "
                      "itself; write base(x) + s * B(A(x)) first (the fused op returns that sum)")
    return node, ("the low-rank product B(A(x)) is added to a tensor that is not a linear of x (a residual or "
                  "bottleneck adapter, not LoRA): nothing to fuse it with")


def _match(gm: fx.GraphModule, add: fx.Node) -> Union[LoraMatch, str, None]:
    """Match around an add node, the outermost of a base plus its adapters. None: not a LoRA sum; str: a
    near-miss and why."""
    found = _sum_onto_base(gm, add)
    if found is None or isinstance(found, str):
        return found
    parts, base, adapters, chain = found
    return _check(add, base, parts, parts[0], adapters, chain)


def _window_guard(m: LoraMatch, writers: list[fx.Node], contexts: list[fx.Node],
                  position: dict[fx.Node, int]) -> Union[LoraMatch, str]:
    """``m``, or why not, from what happens around the site's reads of x. The fused op, placed at the output,
    reads x once and runs in one grad mode and autocast state, where the base and each adapter read x and
    ran separately:
    - a grad-mode or autocast change (``contexts``) between the first read and the output would be crossed;
    - a node writing in place into x or into what an adapter reads of it (a cast, a constant multiple)
      between the first read and the output would be seen by both reads or neither;
    - when gradients flow, a write after the output too: the fused op keeps x itself for its backward, where
      eager may have kept a copy (the adapter's cast), so a later write would fail autograd's version check.
    A write before the first read changes nothing."""
    # The base's own cast of x (a 4-bit base's x.to(compute_dtype)) reads x first.
    own_cast = [m.x] if any(m.x is not r and _cast_of(m.x, r) for ad in m.adapters for r in ad.reads) else []
    first = min(position[n] for n in (m.base, *own_cast, *(adapter.x_reader for adapter in m.adapters)))
    out = position[m.out]
    crossed = next((c for c in contexts if first < position[c] < out), None)
    if crossed is not None:
        return (f"a grad-mode or autocast change ({crossed.name}) lies between the base's and the adapter's reads "
                "of x; the fused op runs as one call")
    out_t = tensor_of(m.out)
    last = float("inf") if out_t is not None and out_t.requires_grad else out
    inside = [w for w in writers if first < position[w] < last]
    if not inside:
        return m
    reads = {m.x, *(node for adapter in m.adapters for node in adapter.reads)}
    writer = mutated_producer(m.x.graph, reads, inside)
    if writer is None:
        return m
    where = "between the base's and the adapter's reads" if position[writer] < out else \
        "after the site, while the fused op keeps x for its backward"
    return f"the input x (or its cast for the adapter) is written in place by {writer.name} {where}"


def _check_quantized(q: Bnb4bitBase, xt: torch.Tensor, at: torch.Tensor, bt: torch.Tensor) -> Optional[str]:
    if q.quant_type not in _lowering_qlora().QUANT_TYPES:
        return f"4-bit quant type {q.quant_type!r}; the fused op supports {_lowering_qlora().QUANT_TYPES}"
    if xt.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the 4-bit linear computes in {xt.dtype}".replace("torch.", "")
    if at.shape[1] != q.in_features or bt.shape[0] != q.out_features or at.shape[0] != bt.shape[1]:
        return (f"shapes do not chain as a [r, K], b [N, r] with the 4-bit weight's (N, K) = "
                f"{(q.out_features, q.in_features)}: a {tuple(at.shape)}, b {tuple(bt.shape)}")
    return None


def _check_adapter(adapter: Adapter, xt: torch.Tensor, wt: Optional[torch.Tensor],
                   quantized: Optional[Bnb4bitBase]) -> Optional[str]:
    """Why one adapter's factors cannot go with this base and input (dtypes, shapes), or None."""
    at, bt = tensor_of(adapter.a), tensor_of(adapter.b)
    if at is None or bt is None:
        return "the shapes of the adapter factors are unknown"
    if at.dtype == torch.float64:
        return "computes in float64; the fused kernels support float32, bfloat16 and float16"
    if at.dtype not in _KERNEL_DTYPES or bt.dtype != at.dtype:
        return (f"adapter {at.dtype}/{bt.dtype}: the fused op needs both adapter factors in one of float32, "
                "bfloat16, float16").replace("torch.", "")
    if quantized is not None:
        return _check_quantized(quantized, xt, at, bt)
    if at.dim() != 2 or bt.dim() != 2 or wt.shape[0] != bt.shape[0] or wt.shape[1] != at.shape[1] \
            or at.shape[0] != bt.shape[1]:
        return (f"shapes do not chain as w [N, K], a [r, K], b [N, r]: w {tuple(wt.shape)}, a {tuple(at.shape)}, "
                f"b {tuple(bt.shape)}")
    return None


def _check(add: fx.Node, base: fx.Node, parts: tuple[Any, Any, Any, Optional[Bnb4bitBase]], x: fx.Node,
           adapters: list[Adapter], steps: list[fx.Node]) -> Union[LoraMatch, str]:
    """The site's guards (input, base, users, output dtype) and each adapter's; the match when all pass."""
    _, w, bias, quantized = parts
    xt, addt = tensor_of(x), tensor_of(add)
    wt = tensor_of(w) if quantized is None else None
    biast = tensor_of(bias) if bias is not None else None
    if xt is None or addt is None or (quantized is None and wt is None) or (bias is not None and biast is None):
        return "the shapes of x or the base weight are unknown"
    if xt.dtype == torch.float64 or (wt is not None and wt.dtype == torch.float64):
        return "computes in float64; the fused kernels support float32, bfloat16 and float16"
    autocast = _autocast_dtype(base, xt, wt, biast, steps) if quantized is None else None
    if isinstance(autocast, str):
        return autocast
    if autocast is None and (xt.dtype not in _KERNEL_DTYPES or (wt is not None and wt.dtype != xt.dtype)
                             or (biast is not None and biast.dtype != xt.dtype)):
        return (f"x {xt.dtype}, base weight {wt.dtype if wt is not None else '4-bit'}: the fused op needs x and the "
                "base in one of float32, bfloat16, float16").replace("torch.", "")
    if wt is not None and wt.dim() != 2:
        return f"the base weight has shape {tuple(wt.shape)}, not [N, K]"
    for adapter in adapters:
        why = _check_adapter(adapter, xt, wt, quantized)
        if why:
            return why
    if len(adapters) > 1:
        dtypes = {dtype_of(ad.a) for ad in adapters}
        if len(dtypes) != 1:
            return f"the adapters summed onto one base have several dtypes {sorted(map(str, dtypes))}"
        if adapters[0].scale == 0:
            return "the first of several adapters has scale 0 (the stacked form scales the others relative to it)"
    # Under no_grad (addt.requires_grad False) nothing is differentiated: a trainable base is fine.
    if addt.requires_grad and ((wt is not None and wt.requires_grad) or (biast is not None and biast.requires_grad)):
        return "the base weight or bias is trainable; only a frozen base is fused (its gradient is not computed)"
    if len(base.users) != 1:
        return "the base projection's output is read by another node too"
    # Each intermediate is read only inside the site (several adapters share peft's one cast of x).
    inside = set(steps) | {add}
    if any(not set(n.users) <= inside for n in steps):
        return "an intermediate of the adapter is read by another node too"
    out, result_dtype = add, autocast or (quantized.result_dtype if quantized is not None else None) or xt.dtype
    if addt.dtype != result_dtype:
        users = list(add.users)
        if len(users) != 1 or not is_call(users[0], cast) or users[0].args[1] != result_dtype:
            return (f"the sum stays in {addt.dtype} (no cast back to the input's {result_dtype}); the fused op returns "
                    "the input's dtype").replace("torch.", "")
        out = users[0]
    detail = _detail(xt, wt, bias, quantized, adapters)
    if autocast is not None:
        detail += f", under autocast: in {autocast}".replace("torch.", "")
    return LoraMatch(x, w, quantized, bias, adapters, out, detail, base=base, autocast=autocast)


def _autocast_dtype(base: fx.Node, xt: torch.Tensor, wt: torch.Tensor, biast: Optional[torch.Tensor],
                    steps: list[fx.Node]) -> Union[torch.dtype, str, None]:
    """The dtype autocast ran the site's projections in, when the base's result is not in its inputs' dtype
    (module docstring); None when it is (no autocast, or inputs already in its dtype); why not when a projection
    of the adapter ran in another dtype (autocast changed between them) or an input is not a kernel dtype."""
    d = dtype_of(base)
    if d is None or (xt.dtype == d and wt.dtype == d and (biast is None or biast.dtype == d)):
        return None
    inputs = [("x", xt.dtype), ("the base weight", wt.dtype), *([("the bias", biast.dtype)] if biast is not None
                                                                  else [])]
    odd = next(((name, dtype) for name, dtype in [("the result", d), *inputs] if dtype not in _KERNEL_DTYPES), None)
    if odd is not None:
        return (f"the base linear runs under autocast with {odd[0]} in {odd[1]}; the fused op takes float32, "
                "bfloat16 and float16").replace("torch.", "")
    for node in steps:
        if linear_parts(node) is not None and dtype_of(node) != d:
            return (f"the base linear ran in {d} (autocast) and the adapter projection {node.name} in "
                    f"{dtype_of(node)}: autocast changed between them").replace("torch.", "")
    return d


def _detail(xt: torch.Tensor, wt: Optional[torch.Tensor], bias: Any, quantized: Optional[Bnb4bitBase],
            adapters: list[Adapter]) -> str:
    ranks = "+".join(str(tensor_of(ad.a).shape[0]) for ad in adapters)
    scales = ", ".join(f"{ad.scale:g}" for ad in adapters)
    weight = (f"{quantized.quant_type} {(quantized.out_features, quantized.in_features)} blocksize "
              f"{quantized.blocksize}{', double-quantised' if quantized.absmax_code is not None else ''}"
              if quantized is not None else str(tuple(wt.shape)))
    adapter_dtype = str(dtype_of(adapters[0].a)).replace("torch.", "")
    return (f"{f'{len(adapters)} adapters, ' if len(adapters) > 1 else ''}r={ranks}, {weight} "
            f"{str(xt.dtype).replace('torch.', '')}, adapter {adapter_dtype}{', bias' if bias is not None else ''}, "
            f"scale {scales}")


def _stacked_adapter(gm: fx.GraphModule, m: LoraMatch) -> tuple[Any, Any, float, tuple[Any, ...]]:
    """(a, b, scale, new nodes) of one adapter equal to the sum of ``m``'s: ``s_1 x a_1^T b_1^T + ... =
    s_1 x [a_1; a_2; ...]^T [b_1, (s_2 / s_1) b_2, ...]^T``, the rows of a and columns of b stacked."""
    first = m.adapters[0]
    if len(m.adapters) == 1:
        return first.a, first.b, first.scale, ()
    graph, new = gm.graph, []
    a = insert_call(graph, m.out, torch.cat, ([ad.a for ad in m.adapters], 0), meta_from=m.out)
    bs = []
    for ad in m.adapters:
        if ad.scale == first.scale:
            bs.append(ad.b)
        else:  # the ratio of scales goes into this adapter's b (peft gives each adapter its own alpha / r)
            bs.append(insert_call(graph, m.out, torch.mul, (ad.b, ad.scale / first.scale), meta_from=m.out))
            new.append(bs[-1])
    b = insert_call(graph, m.out, torch.cat, (bs, 1), meta_from=m.out)
    return a, b, first.scale, (a, b, *new)


def _absorb_glu_input(gm: fx.GraphModule, fused: fx.Node) -> bool:
    """When the fused LoRA's input is a ``sloth.glu`` read by nothing else (an MLP's down projection), make
    the pair one ``sloth.glu_lora_linear`` (``glu_qlora_linear`` over a 4-bit base), which saves gate and up
    instead of also the GLU's output."""
    glu = fused.args[0]
    # Compared by name: sloth::glu exists only once the glu pass has registered it.
    if not (isinstance(glu, fx.Node) and glu.op == "call_function" and str(glu.target) == "sloth.glu.default"
            and not glu.kwargs and len(glu.users) == 1):
        return False
    gate, up, activation = glu.args
    fused.target = (torch.ops.sloth.glu_lora_linear.default if fused.target is torch.ops.sloth.lora_linear.default
                    else torch.ops.sloth.glu_qlora_linear.default)
    fused.args = (gate, up, activation, *fused.args[1:])
    gm.graph.erase_node(glu)
    return True


class _AutocastInputs:
    """The casts that give a fused op under autocast its inputs in autocast's dtype (module docstring). x gets one
    cast per dtype shared by every site that reads it (so the sites stay joinable, patterns/lora_shared.py),
    placed before the first read of x among them; the weights and factors one each, before the fused op."""

    def __init__(self, position: dict[fx.Node, int], writers: list[fx.Node]) -> None:
        self.position, self.writers = position, writers
        self.x_casts: dict[tuple[fx.Node, torch.dtype], tuple[fx.Node, int]] = {}  # (cast, where it stands)

    def x(self, m: LoraMatch) -> fx.Node:
        """x cast to ``m.autocast``, shared with the other sites that read x when no write into x lies between
        their reads (the sites come last first, so a shared cast moves up to the earliest)."""
        x, dtype = m.x, m.autocast
        if dtype_of(x) == dtype:
            return x
        first_read = min((m.base, *(adapter.x_reader for adapter in m.adapters)), key=self.position.__getitem__)
        here = self.position[first_read]
        known = self.x_casts.get((x, dtype))
        if known is not None:
            node, there = known
            between = [w for w in self.writers if min(here, there) < self.position[w] < max(here, there)]
            if mutated_producer(x.graph, {x}, between) is None:
                if here < there:
                    first_read.prepend(node)
                    self.x_casts[(x, dtype)] = (node, here)
                return node
        node = insert_call(x.graph, first_read, cast, (x, dtype), meta_from=first_read)
        self.x_casts[(x, dtype)] = (node, here)
        return node

    @staticmethod
    def operand(node: Any, dtype: torch.dtype, before: fx.Node) -> Any:
        """``node`` cast to ``dtype`` before ``before`` (None and tensors already in it as they are)."""
        if node is None or dtype_of(node) == dtype:
            return node
        return insert_call(before.graph, before, cast, (node, dtype), meta_from=before)


def _replace(gm: fx.GraphModule, m: LoraMatch, casts: _AutocastInputs) -> tuple[set[fx.Node], fx.Node]:
    """Insert the fused node for ``m``; returns the nodes erased and the fused node."""
    a, b, scale, stacked = _stacked_adapter(gm, m)
    x, w, bias = m.x, m.w, m.bias
    if m.autocast is not None:  # autocast's casts, made explicit (module docstring)
        x = casts.x(m)
        w, bias, a, b = (casts.operand(node, m.autocast, m.out) for node in (w, bias, a, b))
    xt, at, out = tensor_of(x), tensor_of(a), tensor_of(m.out)
    rows = 1
    for size in xt.shape[:-1]:
        rows = rows * size
    # A 4-bit base whose result bitsandbytes casts back (Bnb4bitBase.result_dtype): the op computes in the base's
    # compute dtype, x's, and its result gets that cast.
    recast = m.quantized is not None and m.quantized.result_dtype is not None and out.dtype != xt.dtype
    y_value = out.new_empty(out.shape, dtype=xt.dtype if recast else out.dtype)
    value = (y_value, xt.new_empty((rows, at.shape[0]), dtype=torch.float32))
    factors = (*[ad.a for ad in m.adapters], *[ad.b for ad in m.adapters], *stacked)
    q = m.quantized
    if q is None:
        target, args = torch.ops.sloth.lora_linear.default, (x, w, bias, a, b, scale)
        keep: tuple[Any, ...] = (m.x, m.w, m.bias, *factors)
    else:
        target = torch.ops.sloth.qlora_linear.default
        args = (m.x, packed_bytes(gm.graph, q.packed, m.out), q.absmax, q.absmax_code, q.absmax_scale, q.absmax_offset, q.out_features,
                q.in_features, q.blocksize, q.quant_type, m.bias, a, b, scale)
        keep = (m.x, q.packed, q.absmax, q.absmax_code, q.absmax_scale, q.absmax_offset, m.bias, *factors)
        _lowering_nf4().code_table(q.quant_type, tensor_of(q.packed).device)  # now, not on the first run
    _lowering().make_counter_buffer(xt.device)  # now, not on the first run (lowering/lora.py says why)
    fused = insert_call(gm.graph, m.out, target, args, meta_from=m.out, value=value)
    y = insert_call(gm.graph, m.out, operator.getitem, (fused, 0), meta_from=m.out, value=y_value)
    if recast:
        y = insert_call(gm.graph, m.out, cast, (y, out.dtype), meta_from=m.out, value=out.new_empty(out.shape))
    erased = replace_and_erase(m.out, y, keep=keep)
    absorbed = _absorb_glu_input(gm, fused)
    if absorbed:
        erased.add(m.x)
        m.detail += ", its GLU input recomputed in backward"
    m.op = ("sloth.glu_" if absorbed else "sloth.") + ("qlora_linear" if q is not None else "lora_linear")
    if q is not None:
        erased |= {n for n in (q.out, q.hop, *q.bodies) if n is not None}
        erase_if_unused(gm, q)
    return erased, fused


def fuse_lora_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                   options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace every frozen-base LoRA linear in the canonical graph with ``torch.ops.sloth.lora_linear``.

    before:  r = F.linear(x, w); u = F.linear(F.linear(x.float(), a), b) * s; y = (r + u).to(x.dtype)
    after:   y = sloth.lora_linear(x, w, None, a, b, s)

    Then, unless ``options.share_lora_input`` is False, the fused linears that read one input become one op
    (patterns/lora_shared.py).
    """
    _lowering().register()
    _lowering_qlora().register()
    _lowering_glu_lora().register()
    _lowering_glu_lora().register_4bit()
    erased: set[fx.Node] = set()
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    # Nodes that write in place, and grad-mode / autocast changes (impure, writing nothing); fusing adds none.
    writers, contexts = [], []
    for node in gm.graph.nodes:
        if written(node):
            writers.append(node)
        elif node.op == "call_function" and node.is_impure(impure_random=False):
            contexts.append(node)
    outcomes: list[tuple[int, Union[Site, tuple[fx.Node, str]]]] = []
    fused: list[tuple[fx.Node, int]] = []  # each fused node and its outcome's index
    casts = _AutocastInputs(position, writers)
    # Last node first: with several adapters summed onto one base, the outermost add is the site (an
    # inner add alone would be a LoRA whose sum is not yet cast back, a false near-miss). The report
    # still lists the sites in graph order.
    for node in reversed(list(gm.graph.nodes)):
        if node in erased or not is_call(node, torch.add) or len(node.args) != 2:
            continue
        found = _match(gm, node)
        if found is None:
            continue
        if not isinstance(found, str):
            found = _window_guard(found, writers, contexts, position)
        if isinstance(found, str):
            outcomes.append((position[node], (node, found)))
            continue
        erased_here, fused_node = _replace(gm, found, casts)
        erased |= erased_here
        fused.append((fused_node, len(outcomes)))
        outcomes.append((position[node], Site(FAMILY, found.op, module_path(node), source_location(node),
                                              found.detail)))
    # An adapter scaled by a tensor is no base + constant * adapter sum, so the loop above never saw it.
    for node in gm.graph.nodes:
        why = _tensor_scaled_adapter(node)
        if why:
            outcomes.append((position[node], (node, why)))
    # Every low-rank chain added to something is an adapter site (compiler/anchors.py): one the loops above
    # neither fused nor explained gets the reason its add shows.
    explained = [outcome[0] for _, outcome in outcomes if not isinstance(outcome, Site)]
    for node in list(gm.graph.nodes):
        if node not in erased and anchor(node) and not any(near(node, r) for r in explained):
            add, why = _unmatched_adapter(node)
            outcomes.append((position.get(add, len(position)), (add, why)))
    joined: dict[fx.Node, list[fx.Node]] = {}
    if options.share_lora_input:
        notes = share_lora_inputs(gm, [f for f, _ in fused], joined)
        for node, index in fused:
            if node in notes:
                (place, site), (op, note) = outcomes[index], notes[node]
                outcomes[index] = (place, dataclasses.replace(site, op=op, detail=f"{site.detail}, {note}"))
    if options.tiled_mlp:
        index_of = dict(fused)
        downs = [node for node, _ in fused if node.target in (torch.ops.sloth.glu_lora_linear.default,
                                                               torch.ops.sloth.glu_qlora_linear.default)]
        for down, (op, note, producer) in tile_lora_mlps(gm, downs, options.tiled_mlp,
                                                         options.tiled_mlp_recompute).items():
            # A tiled MLP's projection sites (the joined op's members, or the merged projection) become it too.
            sites = [down, *(joined.get(producer, [producer]) if op is not None else [])]
            for node in sites:
                if node in index_of:
                    place, site = outcomes[index_of[node]]
                    outcomes[index_of[node]] = (place, dataclasses.replace(site, op=op or site.op,
                                                                           detail=f"{site.detail}, {note}"))
    for _, outcome in sorted(outcomes, key=lambda item: item[0]):
        if isinstance(outcome, Site):
            report.replaced(outcome)
        else:
            report.reject(FAMILY, *outcome)
    gm.graph.lint()
    gm.recompile()
    return gm


# The family's anchor (compiler/anchors.py): where its sites are, more broadly than its matchers take them.
def _strip_casts_and_scales(node: object) -> object:
    """Follow single steps of casts and constant scales back to their input."""
    while isinstance(node, fx.Node):
        if is_call(node, cast):
            node = node.args[0]
        elif is_call(node, torch.mul, torch.div) and len(node.args) == 2 and is_number(node.args[1]):
            node = node.args[0]
        elif is_call(node, torch.mul) and len(node.args) == 2 and is_number(node.args[0]):
            node = node.args[1]
        else:
            return node
    return node


def _low_rank(node: fx.Node) -> bool:
    outer = linear_parts(node)
    if outer is None:
        return False
    inner = linear_parts(_strip_casts_and_scales(outer[0]))
    if inner is None:
        return False
    rank, width_in, width_out = matrix_width(inner[1], 0), matrix_width(inner[1], 1), matrix_width(outer[1], 0)
    if not all(isinstance(n, int) for n in (rank, width_in, width_out)):
        return False  # symbolic or unknown widths: no claim either way
    return rank < width_in and rank < width_out and matrix_width(outer[1], 1) == rank


def anchor(node: fx.Node) -> bool:
    """The ``lora`` family's anchor: a low-rank chain B(A(x)) added to something: a linear reading (through casts and
    constant scales) a linear of rank r below both the chain's input and output widths, whose value (through casts
    and constant scales) is an operand of an add

    A low-rank chain whose value, through casts and constant scales, is added to something: an adapter on
    whatever it is added to (a bare factorised projection, or one times a mask, is no adapter)."""
    if not _low_rank(node):
        return False
    while len(node.users) == 1:
        user = next(iter(node.users))
        if is_call(user, torch.add):
            return True
        if not (is_call(user, cast) or (is_call(user, torch.mul, torch.div) and len(user.args) == 2
                                         and any(is_number(a) for a in user.args))):
            return False
        node = user
    return False


LORA_CUT = cut_by_graph_boundary("the adapter's down-projection A(x) is returned to another graph that applies B and "
                                  "adds it to the base")


def _trained(weight: object) -> bool:
    t = tensor_of(weight)
    return t is not None and t.requires_grad


def _is_adapter_down_projection(node: fx.Node, linears: list[tuple[fx.Node, tuple]]) -> bool:
    """A linear with a trained weight of rank r below its input width, whose input a wider linear with a frozen
    weight also reads (the base); a frozen router's logits are no adapter."""
    parts = linear_parts(node)
    if parts is None:
        return False
    x, w, _ = parts
    rank, width_in = matrix_width(w, 0), matrix_width(w, 1)
    if not (isinstance(rank, int) and isinstance(width_in, int) and rank < width_in and _trained(w)):
        return False
    source = x.args[0] if is_call(x, F.dropout) else x  # peft reads dropout(x) (identity when p = 0)
    for other, (ox, ow, _) in linears:
        if other is not node and (ox is source or ox is x) and not _trained(ow):
            out = matrix_width(ow, 0)
            if isinstance(out, int) and out > rank:
                return True
    return False


def cut_sites(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, str]]:
    """The family's ``cut_sites``: an adapter's down-projection A(x) ``gm`` returns, to which another graph applies B
    and adds the base (a cut between an adapter and its base linear is the pass's own rejection)."""
    linears = [(n, parts) for n in gm.graph.nodes if (parts := linear_parts(n)) is not None]
    for node in gm.graph.nodes:
        if returned_only(node) and _is_adapter_down_projection(node, linears):
            yield node, LORA_CUT


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_lora_pass, order=90, anchor=anchor, cut_sites=cut_sites,
                     emits=("lora_linear", "qlora_linear", "glu_lora_linear", "glu_qlora_linear",
                            "lora_linear_shared", "qlora_linear_shared", "lora_mlp_tiled"),
                     reads=("share_lora_input", "tiled_mlp", "tiled_mlp_recompute"),
                     summary=("a frozen linear (dense or bitsandbytes 4-bit) plus its LoRA adapters; q/k/v and gate/up"
                              " sharing one input as one op"))
