"""Reading a bitsandbytes 4-bit linear (``bnb.nn.Linear4bit``, QLoRA's frozen base) out of a Dynamo graph.

bitsandbytes 0.50 computes ``Linear4bit`` through ``MatMul4Bit``, a ``torch.autograd.Function``, which
Dynamo captures as a higher-order op (seen with torch 2.13 and bitsandbytes 0.50.2 on the CPU)::

    out = autograd_function_apply(fwd_body, bwd_body, packed, x, *quant_state_tensors, ...)[0]
    (or, when x needs no gradient, the bare gemm_4bit call below in the calling graph)
    fwd_body: gemm_4bit(x, packed.view(-1, 1), (N, K), absmax, blocksize, quant_type, bias=bias)
              or, double-quantised: gemm_4bit(x, packed, (N, K), state2.absmax, blocksize, quant_type,
              bias=bias, absmax_8bit=absmax, absmax_code=state2.code, absmax_offset=offset)

``gemm_4bit`` is ``x @ dequantize_4bit(packed, ...).T + bias`` (bitsandbytes dequantises, then a dense
matmul, for more than one row). bitsandbytes 0.49 (the release Unsloth's wheel set pins) writes that in the body
itself (seen with torch 2.13 and bitsandbytes 0.49.2 on the CPU; the op's operands are the quant state's tensors,
then ``packed.t()``, then x)::

    fwd_body: absmax = dequantize_blockwise(absmax_8bit, state2.absmax, state2.code, 256, float32)
              absmax += offset                                   (double-quantised; else absmax is an operand)
              w = dequantize_4bit(packed_t, absmax, blocksize, quant_type, (N, K), dtype)
              out = linear(x, w.t().to(x.dtype).t(), bias)

Unmatched, that form left each layer's dequantised weight saved for the backward (43.6 GiB at Llama-3-8B QLoRA 2 x
2048 on one H100, benchmarks/results/2026-12-07_issue56_h100_rows.md). This module finds either shape and maps the
body's operands back to the nodes of the calling graph; nothing here imports bitsandbytes.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx

from ..compiler.canonicalize import cast
from ..compiler.fx_utils import insert_call, tensor_of

_GEMM_4BIT = "bitsandbytes.gemm_4bit.default"  # compared by name: bitsandbytes need not be imported
_DEQUANTIZE_4BIT = "bitsandbytes.dequantize_4bit.default"
_DEQUANTIZE_BLOCKWISE = "bitsandbytes.dequantize_blockwise.default"
_VIEWS = ("view", "reshape", "t")


@dataclasses.dataclass
class Bnb4bitBase:
    """A matched 4-bit linear: its output ``out`` (the getitem) and the calling graph's nodes that feed it."""
    out: fx.Node
    hop: Optional[fx.Node]  # None for a bare gemm_4bit call (``out`` itself)
    bodies: tuple[fx.Node, ...]  # the get_attr nodes of the forward and backward bodies
    x: fx.Node
    packed: fx.Node
    absmax: fx.Node  # fp32 per-block absmax, or the uint8 codes when double-quantised
    absmax_code: Optional[fx.Node]  # double quantisation: state2.code, state2.absmax, offset
    absmax_scale: Optional[fx.Node]
    absmax_offset: Optional[fx.Node]
    bias: Optional[fx.Node]
    out_features: int
    in_features: int
    blocksize: int
    quant_type: str
    # bitsandbytes' Linear4bit.forward runs ``matmul_4bit(x.to(compute_dtype)).to(x.dtype)``: where x's dtype is not
    # the compute dtype (a bf16 activation under autocast into an fp32-compute base) the base's output is that cast
    # (``out`` its input), and this is its dtype; None when the output is the 4-bit op's own.
    result_dtype: Optional[torch.dtype] = None


def _is_hop(node: Any) -> bool:
    target = getattr(torch.ops.higher_order, "autograd_function_apply", None)
    return isinstance(node, fx.Node) and node.op == "call_function" and target is not None and node.target is target


def _outer(node: Any, operands: dict[fx.Node, Any]) -> Any:
    """The calling graph's node behind a body value: a body placeholder, or a view of one."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in _VIEWS:
        node = node.args[0]
    if isinstance(node, fx.Node):
        return operands.get(node)
    return node


def _from_gemm(gemm: fx.Node, out: fx.Node, hop: Optional[fx.Node], bodies: tuple[fx.Node, ...],
               outer: Callable[[Any], Any]) -> Union[Bnb4bitBase, str]:
    """The match for one gemm_4bit call; ``outer`` maps its arguments to nodes of the calling graph."""
    args = dict(zip(("A", "B", "shapeB", "absmax", "blocksize", "quant_type"), gemm.args), **gemm.kwargs)
    shape, blocksize, quant_type = args.get("shapeB"), args.get("blocksize"), args.get("quant_type")
    if not (isinstance(shape, (tuple, list)) and len(shape) == 2 and all(isinstance(d, int) for d in shape)
            and isinstance(blocksize, int) and isinstance(quant_type, str)):
        return "the 4-bit weight's shape, block size or quant type is not a constant"
    x, packed, absmax = (outer(args.get(k)) for k in ("A", "B", "absmax"))
    bias = outer(args.get("bias")) if args.get("bias") is not None else None
    nested = {k: outer(args.get(k)) for k in ("absmax_8bit", "absmax_code", "absmax_offset")
              if args.get(k) is not None}
    if any(v is None for v in (x, packed, absmax)) or (args.get("bias") is not None and bias is None) \
            or any(v is None for v in nested.values()):
        return "an operand of gemm_4bit is computed inside the autograd function, not passed in"
    if nested and len(nested) != 3:
        return "a partly double-quantised absmax (some of absmax_8bit, absmax_code, absmax_offset missing)"
    refused = _storage_refused(packed, shape)
    if refused:
        return refused
    if nested:
        return Bnb4bitBase(out, hop, bodies, x, packed, nested["absmax_8bit"], nested["absmax_code"], absmax,
                           nested["absmax_offset"], bias, shape[0], shape[1], blocksize, quant_type)
    return Bnb4bitBase(out, hop, bodies, x, packed, absmax, None, None, None, bias, shape[0], shape[1], blocksize,
                       quant_type)


def _storage_refused(packed: fx.Node, shape: Any) -> Optional[str]:
    """Why the packed weight cannot be read as the 4-bit op's bytes, or None. bitsandbytes stores them as uint8, or,
    with ``quant_storage`` (what FSDP needs to shard a 4-bit base), the same bytes viewed as a float dtype: the
    fused op reads those as uint8 again (``packed_bytes``)."""
    pt = tensor_of(packed)
    if pt is None or (pt.dtype != torch.uint8 and not pt.dtype.is_floating_point):
        return f"the packed 4-bit weight is stored as {pt.dtype if pt is not None else 'unknown'}, not bytes"
    if pt.dtype != torch.uint8 and not pt.is_contiguous():
        return f"the packed 4-bit weight, stored as {pt.dtype}, is not contiguous"
    if pt.numel() * pt.element_size() != (shape[0] * shape[1] + 1) // 2:
        return (f"the packed 4-bit weight holds {pt.numel() * pt.element_size()} bytes, not the "
                f"{(shape[0] * shape[1] + 1) // 2} of a {shape[0]} x {shape[1]} weight")
    return None


def packed_bytes(graph: fx.Graph, packed: fx.Node, before: fx.Node) -> fx.Node:
    """``packed`` as the fused op reads it: itself when stored as uint8, else a flat uint8 view of its bytes (a
    view, no copy), inserted before ``before``."""
    pt = tensor_of(packed)
    if pt.dtype == torch.uint8:
        return packed
    as_bytes = insert_call(graph, before, torch.Tensor.view, (packed, torch.uint8), meta_from=before,
                           value=pt.view(torch.uint8))
    return insert_call(graph, before, torch.Tensor.view, (as_bytes, -1), meta_from=before,
                       value=pt.view(torch.uint8).view(-1))


def _is_gemm_4bit(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and str(node.target) == _GEMM_4BIT


def bnb_4bit_base(gm: fx.GraphModule, node: Any) -> Union[Bnb4bitBase, str, None]:
    """The 4-bit linear whose output ``node`` is, a reason when it is one but cannot be fused, else None.

    Two forms: ``getitem(autograd_function_apply(...), 0)`` when the input needs a gradient, and a bare
    ``gemm_4bit`` call when it does not (bitsandbytes skips its autograd.Function then, e.g. for the first
    layer's q/k/v, whose input comes from a frozen embedding)."""
    if _is_gemm_4bit(node):
        return _from_gemm(node, node, None, (), lambda v: _view_root(v) if isinstance(v, fx.Node) else v)
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and node.args[1] == 0 and _is_hop(node.args[0])):
        return None
    hop = node.args[0]
    body_attr = hop.args[0]
    is_attr = isinstance(body_attr, fx.Node) and body_attr.op == "get_attr"
    body = getattr(gm, body_attr.target, None) if is_attr else None
    if not isinstance(body, fx.GraphModule):
        return None
    gemms = [n for n in body.graph.nodes if _is_gemm_4bit(n)]
    dequantized = [n for n in body.graph.nodes if _is_call(n, _DEQUANTIZE_4BIT)]
    if len(gemms) + len(dequantized) != 1:
        return None
    gemm = gemms[0] if gemms else _linear_of(dequantized[0])
    if gemm is None:
        return None
    output = next(n for n in body.graph.nodes if n.op == "output")
    returned = output.args[0]
    if not (isinstance(returned, (tuple, list)) and returned and isinstance(returned[0], (tuple, list))
            and returned[0] and returned[0][0] is gemm):
        return "the 4-bit autograd function returns something else than its gemm_4bit output"
    if len(hop.users) != 1:
        return "the 4-bit linear's other outputs are read too"
    bodies = tuple(a for a in hop.args[:2] if isinstance(a, fx.Node) and a.op == "get_attr")
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(hop.args) - 2:  # the body's inputs are the op's operands, one for one
        return "the 4-bit autograd function's body takes other inputs than the op passes"
    operands = dict(zip(placeholders, hop.args[2:]))
    if gemms:
        return _from_gemm(gemm, node, hop, bodies, lambda v: _outer(v, operands))
    return _from_dequantize(gemm, dequantized[0], node, hop, bodies, lambda v: _outer(v, operands))


def _is_call(node: Any, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and str(node.target) == name


def _step(node: fx.Node) -> Optional[str]:
    """"t" or "to" for a transpose or a cast (a method, or compiler/canonicalize.py's cast), else None."""
    if node.op == "call_method" and node.target in ("t", "to"):
        return node.target
    return "to" if node.op == "call_function" and node.target is cast else None


def _linear_of(dequantized: fx.Node) -> Optional[fx.Node]:
    """The ``linear(x, w.t().to(dtype).t(), bias)`` that reads a dequantised weight (bitsandbytes 0.49), or None."""
    steps = _chain(dequantized)
    weight = steps[-1] if steps else dequantized
    if len(weight.users) != 1 or sum(_step(n) == "t" for n in steps) % 2:
        return None
    (user,) = weight.users
    if user.op == "call_function" and user.target in (torch._C._nn.linear, torch.nn.functional.linear) \
            and len(user.args) >= 2 and user.args[1] is weight:
        return user
    return None


def _from_dequantize(linear: fx.Node, dequantized: fx.Node, out: fx.Node, hop: fx.Node, bodies: tuple[fx.Node, ...],
                     outer: Callable[[Any], Any]) -> Union[Bnb4bitBase, str]:
    """The match for bitsandbytes 0.49's body (module docstring); ``outer`` maps body values to the calling graph."""
    args = dict(zip(("A", "absmax", "blocksize", "quant_type", "shape", "dtype"), dequantized.args),
                **dequantized.kwargs)
    shape, blocksize, quant_type = args.get("shape"), args.get("blocksize"), args.get("quant_type")
    if not (isinstance(shape, (tuple, list)) and len(shape) == 2 and all(isinstance(d, int) for d in shape)
            and isinstance(blocksize, int) and isinstance(quant_type, str)):
        return "the 4-bit weight's shape, block size or quant type is not a constant"
    x_body = linear.args[0]
    bias_body = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    x, packed = outer(x_body), outer(args.get("A"))
    if isinstance(packed, fx.Node):  # the op is passed ``packed.t()``: the stored weight is its root
        packed = _view_root(packed)
    bias = outer(bias_body) if bias_body is not None else None
    xt = tensor_of(x_body)
    casts = [u for u in _chain(dequantized) if _step(u) == "to"]
    if xt is None or any(c.args[1:] != (xt.dtype,) for c in casts):
        return "the dequantised 4-bit weight is cast to another dtype than the input's"
    absmax_body = args.get("absmax")
    nested = None
    if isinstance(absmax_body, fx.Node) and absmax_body.op == "call_function" and absmax_body.target is operator.iadd:
        blockwise, offset = absmax_body.args
        if not (_is_call(blockwise, _DEQUANTIZE_BLOCKWISE) and len(blockwise.args) >= 4
                and blockwise.args[3] == 256):
            return "the 4-bit weight's absmax is double-quantised other than in blocks of 256"
        code = blockwise.args[2]
        while isinstance(code, fx.Node) and code.op == "call_method" and code.target == "to":  # .to(device)
            code = code.args[0]
        nested = (outer(blockwise.args[0]), outer(code), outer(blockwise.args[1]), outer(offset))
        absmax = nested[0]
    else:
        absmax = outer(absmax_body)
    if any(v is None for v in (x, packed, absmax)) or (bias_body is not None and bias is None) \
            or (nested is not None and any(v is None for v in nested)):
        return "an operand of the 4-bit linear is computed inside the autograd function, not passed in"
    refused = _storage_refused(packed, shape)
    if refused:
        return refused
    if nested is not None:
        codes, code, scale, offset = nested
        return Bnb4bitBase(out, hop, bodies, x, packed, codes, code, scale, offset, bias, shape[0], shape[1],
                           blocksize, quant_type)
    return Bnb4bitBase(out, hop, bodies, x, packed, absmax, None, None, None, bias, shape[0], shape[1], blocksize,
                       quant_type)


def _chain(dequantized: fx.Node) -> list[fx.Node]:
    """The single-user ``t`` / ``to`` steps after the dequantised weight."""
    steps, node = [], dequantized
    while len(node.users) == 1:
        (user,) = node.users
        if _step(user) is None:
            break
        steps.append(user)
        node = user
    return steps


def _view_root(node: fx.Node) -> fx.Node:
    """``packed.view(-1, 1)`` (and the like) in the calling graph itself: the viewed node."""
    while node.op == "call_method" and node.target in _VIEWS:
        node = node.args[0]
    return node


def erase_if_unused(gm: fx.GraphModule, base: Bnb4bitBase) -> None:
    """Drop the higher-order op and its two bodies once nothing reads them (after a fused replacement)."""
    graph = gm.graph
    for node in (base.out, base.hop, *base.bodies):
        if node is not None and node.graph is graph and node in graph.nodes and not node.users:
            graph.erase_node(node)
            if node.op == "get_attr" and hasattr(gm, node.target):
                delattr(gm, node.target)
