"""RMSNorm family (``"rms_norm"`` in the report): the pattern, its variants, its guard, its replacement.

The meaning, as plain PyTorch (these functions are also the test oracle and the eager benchmark
baseline)::

    rms_norm_pattern(x, w, eps)        Llama/Mistral/Qwen: upcast, normalise, cast back, times w
    gemma_rms_norm_pattern(x, w, eps)  Gemma: times (1 + w) in fp32, then cast back

Variants matched on the canonical graph (see compiler/canonicalize.py), whatever module wrote them:

    r   = rsqrt(mean(square(xf), (-1,), True) + eps)      xf = x or a widening cast of x
    n   = xf * r                                          (either operand order; the other may be x itself)
    out = chain of single-user steps after n:             casts, and at most one multiply by a
                                                          weight-like [D] tensor w or (w + c)
    and torch.rms_norm(x, (D,), w, eps) (F.rms_norm, nn.RMSNorm), followed by the same chain of casts.

The replacement is one ``torch.ops.sloth.rms_norm(x, w, eps, offset, out_dtype)`` node that computes in
fp32 and rounds once (lowering/rms_norm.py), so it is at least as accurate as every variant above.
Anything that would change a value says no and leaves the graph as it was: a mean over another dim,
an eps that is a tensor, a variance or rstd read by someone else, float64, a weight of another shape.
Only exact (widening) casts are looked through: after a narrowing cast (fp64 -> fp32) the cast stays
in the graph and the norm runs on its result, which is the value eager normalises.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx

from ..compiler.canonicalize import cast
from ..compiler.fx_utils import (insert_call, is_call, is_number, replace_and_erase, same_shape, same_size,
                                 single_user, tensor_of, value_of)
from ..compiler.options import PassOptions
from ..compiler.families import Family
from ..compiler.report import Report
from .site_loop import rewrite_sites

FAMILY = "rms_norm"


def _lowering():
    """The kernel module, imported on first use: importing it imports triton, whose kernels decide
    at definition whether they run natively or through the CPU interpreter (TRITON_INTERPRET), so
    ``import sloth`` must not do it before a script has had the chance to set that variable."""
    from ..lowering import rms_norm

    return rms_norm

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_pattern(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm: upcast to fp32, normalise, cast back to x's dtype, multiply by the weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def gemma_rms_norm_pattern(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma-style RMSNorm: normalise in fp32, multiply by ``1 + weight`` in fp32, cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def weightless_rms_norm_pattern(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (OLMo-style norms, some q/k-norms)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclasses.dataclass
class RmsNormMatch:
    """A matched site: ``out``'s value equals ``sloth.rms_norm(x, weight, eps, offset, out.dtype)``.

    ``eps`` is a constant, or a node holding a SymFloat when Dynamo made the float dynamic (it does so
    after seeing several values for one code object); either way it reaches the kernel as a runtime
    argument, never a recompile key.
    """
    x: fx.Node
    weight: Optional[fx.Node]
    eps: Union[float, fx.Node]
    offset: float
    out: fx.Node
    anchor: fx.Node


def _widened_root(node: Any) -> Any:
    """Strip casts that are exact (bf16/fp16 -> fp32, or to the same dtype): the value is unchanged."""
    while is_call(node, cast):
        src, dst = tensor_of(node.args[0]), node.args[1]
        if src is None or not (dst == src.dtype or (dst == torch.float32 and src.dtype in _KERNEL_DTYPES)):
            break
        node = node.args[0]
    return node


def _other_operand(mul: fx.Node, node: fx.Node) -> Any:
    a, b = mul.args
    return b if a is node else a


def _weight_like(node: Any, hidden: Any) -> Union[tuple[fx.Node, float], None]:
    """(w, offset) when ``node`` is a [D] float tensor w, or ``w + c`` / ``c + w`` with c a constant."""
    offset = 0.0
    if is_call(node, torch.add):
        a, b = node.args
        if is_number(b) and isinstance(a, fx.Node):
            node, offset = a, float(b)
        elif is_number(a) and isinstance(b, fx.Node):
            node, offset = b, float(a)
        else:
            return None
    w = _widened_root(node)
    wt = tensor_of(w)
    if wt is None or wt.dim() != 1 or not same_size(wt.shape[0], hidden) or wt.dtype not in _KERNEL_DTYPES:
        return None
    return w, offset


def _extend_chain(start: fx.Node, weight: Optional[fx.Node], offset: float, hidden: Any
                  ) -> tuple[fx.Node, Optional[fx.Node], float]:
    """Follow single-user casts and at most one weight multiply after the normalised value."""
    cur = start
    while True:
        user = single_user(cur)
        if user is None:
            return cur, weight, offset
        if is_call(user, cast) and user.args[1] in _KERNEL_DTYPES:
            cur = user
            continue
        if weight is None and is_call(user, torch.mul):
            found = _weight_like(_other_operand(user, cur), hidden)
            if found is not None:
                weight, offset = found
                cur = user
                continue
        return cur, weight, offset


def _runtime_float(eps: Any) -> Union[float, fx.Node, None]:
    """eps as the op takes it: a Python float, or a node whose value is a SymFloat; None otherwise."""
    if is_number(eps):
        return float(eps)
    if isinstance(eps, fx.Node) and isinstance(value_of(eps), torch.SymFloat):
        return eps
    return None


def _match_decomposed(r: fx.Node) -> Union[RmsNormMatch, str, None]:
    """Match around an ``rsqrt`` anchor. None: not an RMSNorm shape; str: a near-miss and why."""
    s = r.args[0]
    eps: Any = 0.0
    if is_call(s, torch.add):
        a, b = s.args
        ms, eps = (a, b) if is_call(a, torch.mean) else (b, a)
    else:
        ms = s
    if not is_call(ms, torch.mean) or len(ms.args) != 3 or not is_call(ms.args[0], torch.square):
        return None  # not a mean over dims of a square (a full mean keeps its one-argument form)
    sq = ms.args[0]
    xf, dims, keepdim = sq.args[0], ms.args[1], ms.args[2]
    if tuple(dims) != (-1,):
        return f"the mean square is over dims {tuple(dims)}, not the last dimension only"
    if not keepdim:
        return "the mean square drops the reduced dimension (keepdim=False)"
    eps = _runtime_float(eps)
    if eps is None:
        return "eps is a tensor, not a float"
    if len(sq.users) != 1 or len(ms.users) != 1 or (s is not ms and len(s.users) != 1):
        return "the mean square / variance has other users, so it cannot be fused away"
    x = _widened_root(xf)
    if len(r.users) != 1 or not is_call(single_user(r), torch.mul):
        return "rsqrt(variance + eps) has other users or is not multiplied by the input"
    n = single_user(r)
    if _widened_root(_other_operand(n, r)) is not x:
        return "rsqrt(variance + eps) multiplies a different tensor than the one normalised"
    return _finish(x, None, eps, 0.0, n, r)


def _match_functional(node: fx.Node) -> Union[RmsNormMatch, str, None]:
    """Match ``torch.rms_norm(x, normalized_shape, weight, eps)`` (F.rms_norm, nn.RMSNorm)."""
    x, shape, weight, eps = node.args
    xt = tensor_of(x)
    if xt is None:
        return "the input's shape is unknown"
    if not isinstance(shape, (list, tuple)) or len(shape) != 1 or not same_size(shape[0], xt.shape[-1]):
        return f"normalised over the trailing dims {shape}, not over the last dimension only"
    if eps is None:
        eps = torch.finfo(torch.float32).eps  # what torch.rms_norm uses for fp32/bf16/fp16 inputs
    eps = _runtime_float(eps)
    if eps is None:
        return "eps is a tensor, not a float"
    if weight is not None and _weight_like(weight, xt.shape[-1]) is None:
        return "the weight is not a float32/bfloat16/float16 vector of the hidden size"
    return _finish(x, weight, eps, 0.0, node, node)


def _finish(x: fx.Node, weight: Optional[fx.Node], eps: Union[float, fx.Node], offset: float, start: fx.Node,
            anchor: fx.Node) -> Union[RmsNormMatch, str]:
    """Common guard: dtypes, sizes and the chain of casts and weight after the normalised value."""
    xt = tensor_of(x)
    if xt is None or xt.dim() == 0:
        return "the input's shape is unknown"
    if xt.dtype not in _KERNEL_DTYPES or tensor_of(start) is None or tensor_of(start).dtype not in _KERNEL_DTYPES:
        return f"computes in {tensor_of(start).dtype if tensor_of(start) is not None else '?'} from {xt.dtype}; " \
               "the fused kernel supports float32, bfloat16 and float16"
    hidden = xt.shape[-1]
    # A symbolic hidden size (dynamic=True) is fine: the launcher reads the real size at run time and
    # refuses one past MAX_HIDDEN there with a clear error.
    if isinstance(hidden, int) and hidden > _lowering().MAX_HIDDEN:
        return f"hidden size {hidden} exceeds the single-pass kernel's limit {_lowering().MAX_HIDDEN}"
    out, weight, offset = _extend_chain(start, weight, offset, hidden)
    ot = tensor_of(out)
    if ot is None or not same_shape(ot, xt):
        return "the result does not have the input's shape (the weight broadcasts it)"
    return RmsNormMatch(x, weight, eps, offset, out, anchor)


def _replace(gm: fx.GraphModule, m: RmsNormMatch) -> set[fx.Node]:
    """Insert the fused node for ``m``; returns the nodes erased."""
    out = tensor_of(m.out)
    # The value is the fake's (a fresh contiguous tensor of x's shape), written here rather than
    # computed by calling the op on fakes: that call would specialise a SymFloat eps into a guard.
    fused = insert_call(gm.graph, m.out, torch.ops.sloth.rms_norm.default,
                        (m.x, m.weight, m.eps, m.offset, out.dtype), meta_from=m.anchor,
                        value=tensor_of(m.x).new_empty(tensor_of(m.x).shape, dtype=out.dtype))
    return replace_and_erase(m.out, fused, keep=(m.x, m.weight))


def fuse_rms_norm_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                       options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace every RMSNorm in the canonical graph with ``torch.ops.sloth.rms_norm``.

    before:  xf = cast(x, f32); r = rsqrt(mean(square(xf), (-1,), True) + eps); y = w * cast(xf * r, bf16)
    after:   y = sloth.rms_norm(x, w, eps, 0.0, bf16)
    """
    _lowering().register()
    return rewrite_sites(gm, report, FAMILY, "sloth.rms_norm",
                         [((torch.rsqrt,), _match_decomposed), ((torch.rms_norm,), _match_functional)], _replace,
                         lambda found: (f"eps={_eps_text(found.eps)}"
                                        + (f", weight+{found.offset:g}" if found.offset else "")
                                        + ("" if found.weight is not None else ", no weight") + _dtypes_text(found)))


def _eps_text(eps: Any) -> str:
    return str(eps) if isinstance(eps, fx.Node) else format(eps, "g")


def _dtypes_text(found: Any) -> str:
    """", bfloat16 -> bfloat16": the site's input and output dtypes, for the report."""
    return f", {tensor_of(found.x).dtype} -> {tensor_of(found.out).dtype}".replace("torch.", "")


# The family's anchor (compiler/anchors.py): where its sites are, more broadly than its matchers take them.
def anchor(node: fx.Node) -> bool:
    """The ``rms_norm`` family's anchor: rsqrt(mean(square(x)) [+ eps]), and torch.rms_norm"""
    if is_call(node, torch.rms_norm):
        return True
    if not is_call(node, torch.rsqrt):
        return False
    inner = node.args[0]
    if is_call(inner, torch.add) and len(inner.args) == 2:
        a, b = inner.args
        inner = a if is_call(a, torch.mean) else b
    return is_call(inner, torch.mean) and is_call(inner.args[0], torch.square)


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_rms_norm_pass, order=20, anchor=anchor,
                     emits=("rms_norm",),
                     summary=("RMSNorm: Llama's fp32 upcast, Gemma's `1 + w`, weightless, q/k norms on heads, "
                              "`F.rms_norm`, `nn.RMSNorm`"))
