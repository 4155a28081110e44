"""LayerNorm family (``"layer_norm"`` in the report): the pattern, its variants, its guard, its replacement.

The meaning, as plain PyTorch (these functions are also the test oracle and the eager benchmark baseline)::

    layer_norm_pattern(x, w, b, eps)           F.layer_norm over the last dim (nn.LayerNorm; w, b optional)
    upcast_layer_norm_pattern(x, w, b, eps)    written out in fp32 and cast back (Cohere-style, HF ports)

Variants matched on the canonical graph (see compiler/canonicalize.py), whatever module wrote them:

    F.layer_norm(xf, (D,), w?, b?, eps)                       xf = x or a widening cast of x
    m = mean(xf, (-1,), True); c = xf - m                     (c may be written twice, both times xf - m)
    v = mean(square(c), (-1,), True)  or  variance(xf, (-1,), 0, True)    (the biased variance only)
    n = c * rsqrt(v + eps)                                    (x / sqrt(v + eps) is canonicalised to this)
    out = chain of single-user steps after n:                 casts, at most one multiply by a [D] tensor w
                                                              (if none yet), then at most one add of a [D] b

The replacement is one ``torch.ops.sloth.layer_norm(x, weight, bias, eps, out_dtype)`` node computing in fp32
and rounding once (lowering/layer_norm.py), at least as accurate as every variant above. Anything that would
change a value says no and leaves the graph as it was: a normalised shape of more than the last dim, a mean
or variance over another dim, the unbiased variance (``x.var(-1)``'s default: not LayerNorm), eps added to the
standard deviation instead of the variance (``c / (sqrt(v) + eps)``: another function), an eps that is a
tensor, a mean, variance or rstd read by someone else, float64, a weight or bias that is not a [D] vector.

This family runs before rms_norm: ``c * rsqrt(mean(square(c)) + eps)`` is also an RMSNorm of c, and the one
LayerNorm op (no separate subtraction, no centred tensor kept for backward) is the better replacement.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.canonicalize import cast, variance
from ..compiler.fx_utils import (insert_call, is_call, is_number, replace_and_erase, same_shape, same_size,
                                 single_user, tensor_of, value_of, without_eps)
from ..compiler.options import PassOptions
from ..compiler.families import Family
from ..compiler.report import Report
from .site_loop import rewrite_sites
from .rms_norm import _dtypes_text, _eps_text, _runtime_float, _widened_root

FAMILY = "layer_norm"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _lowering():
    """The kernel module, imported on first use (see patterns/rms_norm.py: importing triton must wait until a
    script has had the chance to set TRITON_INTERPRET)."""
    from ..lowering import layer_norm

    return layer_norm


def layer_norm_pattern(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                       eps: float) -> torch.Tensor:
    """``nn.LayerNorm(D)``: normalise over the last dimension (biased variance), times w, plus b."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def upcast_layer_norm_pattern(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                              eps: float) -> torch.Tensor:
    """LayerNorm written out in fp32, cast back to x's dtype at the end (Cohere's ``CohereLayerNorm`` with a bias)."""
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        h = weight.to(torch.float32) * h
    if bias is not None:
        h = h + bias.to(torch.float32)
    return h.to(x.dtype)


@dataclasses.dataclass
class LayerNormMatch:
    """A matched site: ``out``'s value equals ``sloth.layer_norm(x, weight, bias, eps, out.dtype)``."""
    x: fx.Node
    weight: Optional[fx.Node]
    bias: Optional[fx.Node]
    eps: Union[float, fx.Node]
    out: fx.Node
    anchor: fx.Node


def _vector(node: Any, hidden: Any) -> Optional[fx.Node]:
    """The exact (widened-from) source of ``node`` when it is a float [D] tensor, else None."""
    v = _widened_root(node)
    vt = tensor_of(v)
    if vt is None or vt.dim() != 1 or not same_size(vt.shape[0], hidden) or vt.dtype not in _KERNEL_DTYPES:
        return None
    return v


def _other_operand(node: fx.Node, operand: fx.Node) -> Any:
    a, b = node.args
    return b if a is operand else a


def _extend_chain(start: fx.Node, weight: Optional[fx.Node], bias: Optional[fx.Node], hidden: Any
                  ) -> tuple[fx.Node, Optional[fx.Node], Optional[fx.Node]]:
    """Follow single-user casts, a weight multiply (only before any bias) and a bias add after the normalised
    value: ``(n * w + b)``; an add followed by a multiply, ``(n + b) * w``, is not LayerNorm's affine step."""
    cur = start
    while True:
        user = single_user(cur)
        if user is None:
            return cur, weight, bias
        if is_call(user, cast) and user.args[1] in _KERNEL_DTYPES:
            cur = user
            continue
        if weight is None and bias is None and is_call(user, torch.mul):
            found = _vector(_other_operand(user, cur), hidden)
            if found is not None:
                weight, cur = found, user
                continue
        if bias is None and is_call(user, torch.add):
            found = _vector(_other_operand(user, cur), hidden)
            if found is not None:
                bias, cur = found, user
                continue
        return cur, weight, bias


def _is_mean_last(node: Any) -> bool:
    return is_call(node, torch.mean) and len(node.args) == 3


def _centred(node: Any) -> Optional[tuple[fx.Node, fx.Node]]:
    """(xf, m) when ``node`` is ``xf - m`` with m a mean of xf over some dims, else None."""
    if not is_call(node, torch.sub):
        return None
    a, m = node.args
    if not (_is_mean_last(m) and m.args[0] is a):
        return None
    return a, m


def _variance_parts(v: Any) -> Union[tuple[fx.Node, tuple, bool, list[fx.Node]], str, None]:
    """(xf, dims, keepdim, nodes feeding only the variance) of a variance of xf about its mean; a str for a
    variance that is not LayerNorm's; None for anything else."""
    if is_call(v, variance):
        xf, dims, correction, keepdim = v.args
        if correction != 0:
            return (f"the variance has correction={correction:g} (unbiased, x.var()'s default): LayerNorm "
                    "divides by D, not D - correction")
        return xf, tuple(dims), keepdim, []
    if _is_mean_last(v) and is_call(v.args[0], torch.square):
        centred = _centred(v.args[0].args[0])
        if centred is not None:
            xf, m = centred
            if tuple(m.args[1]) != tuple(v.args[1]):
                return f"the mean is over dims {tuple(m.args[1])} but the variance over {tuple(v.args[1])}"
            return xf, tuple(v.args[1]), v.args[2] and m.args[2], [v.args[0], v.args[0].args[0], m]
    return None


def _split_eps(s: Any) -> tuple[Any, Any]:
    """(variance, eps) of ``v + eps`` (either order), or (s, 0.0) without an add."""
    if is_call(s, torch.add):
        a, b = s.args
        return (a, b) if isinstance(a, fx.Node) and _variance_parts(a) is not None else (b, a)
    return s, 0.0


def _match_decomposed(r: fx.Node) -> Union[LayerNormMatch, str, None]:
    """Match around an ``rsqrt`` anchor. None: not a LayerNorm shape; str: a near-miss and why."""
    v, eps = _split_eps(r.args[0])
    parts = _variance_parts(v)
    if parts is None or isinstance(parts, str):
        return parts
    xf, dims, keepdim, inner = parts
    if dims != (-1,):
        return f"the variance is over dims {dims}, not the last dimension only"
    if not keepdim:
        return "the mean or variance drops the reduced dimension (keepdim=False)"
    eps = _runtime_float(eps)
    if eps is None:
        return "eps is a tensor, not a float"
    if len(r.users) != 1 or not is_call(single_user(r), torch.mul):
        return "rsqrt(variance + eps) has other users or is not multiplied by the centred input"
    n = single_user(r)
    c = _other_operand(n, r)
    centred = _centred(c)
    if centred is None or _widened_root(centred[0]) is not _widened_root(xf):
        return "rsqrt(variance + eps) does not multiply x - mean(x) of the tensor whose variance it is"
    m = centred[1]
    if tuple(m.args[1]) != (-1,) or not m.args[2]:
        return "the centring mean is not over the last dimension with keepdim=True"
    # Everything between x and n is fused away: none of it may be read elsewhere.
    own = {r, n, v, r.args[0], c, m, *inner}
    for node in own - {n}:
        if any(u not in own for u in node.users):
            return "the mean, variance or rstd has other users, so it cannot be fused away"
    return _finish(_widened_root(xf), None, None, eps, n, r)


def _match_functional(node: fx.Node) -> Union[LayerNormMatch, str, None]:
    """Match ``F.layer_norm(x, normalized_shape, weight, bias, eps)`` (nn.LayerNorm)."""
    x, shape, weight, bias, eps = node.args
    xt = tensor_of(x)
    if xt is None or xt.dim() == 0:
        return "the input's shape is unknown"
    # Under dynamic shapes a size in normalized_shape is a node holding a SymInt: compare its value.
    if not isinstance(shape, (list, tuple)) or len(shape) != 1 or not same_size(value_of(shape[0]), xt.shape[-1]):
        return f"normalised over the trailing dims {tuple(shape) if isinstance(shape, (list, tuple)) else shape}, " \
               "not over the last dimension only"
    eps = _runtime_float(eps)
    if eps is None:
        return "eps is a tensor, not a float"
    for name, t in (("weight", weight), ("bias", bias)):
        # (A float64 norm's float64 weight is refused below for the norm's dtype, the clearer reason.)
        if t is not None and _vector(t, xt.shape[-1]) is None and xt.dtype in _KERNEL_DTYPES:
            return f"the {name} is not a float32/bfloat16/float16 vector of the hidden size"
    weight = None if weight is None else _vector(weight, xt.shape[-1])
    bias = None if bias is None else _vector(bias, xt.shape[-1])
    return _finish(_widened_root(x), weight, bias, eps, node, node)


def _finish(x: fx.Node, weight: Optional[fx.Node], bias: Optional[fx.Node], eps: Union[float, fx.Node],
            start: fx.Node, anchor: fx.Node) -> Union[LayerNormMatch, str]:
    """Common guard: dtypes, sizes and the chain of casts, weight and bias after the normalised value."""
    xt, st = tensor_of(x), tensor_of(start)
    if xt is None or xt.dim() == 0 or st is None:
        return "the input's shape is unknown"
    if xt.dtype not in _KERNEL_DTYPES or st.dtype not in _KERNEL_DTYPES:
        return f"computes in {st.dtype} from {xt.dtype}; the fused kernel supports float32, bfloat16 and float16"
    hidden = xt.shape[-1]
    if isinstance(hidden, int) and hidden > _lowering().MAX_HIDDEN:
        return f"hidden size {hidden} exceeds the single-pass kernel's limit {_lowering().MAX_HIDDEN}"
    out, weight, bias = _extend_chain(start, weight, bias, hidden)
    ot = tensor_of(out)
    if ot is None or not same_shape(ot, xt):
        return "the result does not have the input's shape (the weight or bias broadcasts it)"
    return LayerNormMatch(x, weight, bias, eps, out, anchor)


def _eps_outside_sqrt(node: fx.Node) -> Optional[str]:
    """A reason when ``node`` is ``sqrt`` of a variance about the mean (what the rsqrt matcher never sees)."""
    v, _ = _split_eps(node.args[0])
    parts = _variance_parts(v)
    if parts is None:
        return None
    if isinstance(parts, str):
        return parts
    user = single_user(node)
    if is_call(user, torch.add) and any(is_number(a) or (isinstance(a, fx.Node) and tensor_of(a) is None)
                                        for a in user.args):
        return ("eps is added to the standard deviation, (x - mean) / (sqrt(var) + eps), not to the variance "
                "inside the square root as LayerNorm does: another function, left as it is")
    return "the standard deviation sqrt(var + eps) is read as such (not only divided into x - mean)"


def _replace(gm: fx.GraphModule, m: LayerNormMatch) -> set[fx.Node]:
    """Insert the fused node for ``m``; returns the nodes erased."""
    out = tensor_of(m.out)
    # The value is the fake's (a fresh contiguous tensor of x's shape), written rather than computed by
    # calling the op on fakes, which would specialise a SymFloat eps into a guard.
    fused = insert_call(gm.graph, m.out, torch.ops.sloth.layer_norm.default,
                        (m.x, m.weight, m.bias, m.eps, out.dtype), meta_from=m.anchor,
                        value=tensor_of(m.x).new_empty(tensor_of(m.x).shape, dtype=out.dtype))
    return replace_and_erase(m.out, fused, keep=(m.x, m.weight, m.bias))


def fuse_layer_norm_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                         options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace every LayerNorm in the canonical graph with ``torch.ops.sloth.layer_norm``.

    before:  m = mean(xf, (-1,), True); c = xf - m; r = rsqrt(mean(square(c), (-1,), True) + eps); y = c * r * w + b
             (or y = F.layer_norm(x, (D,), w, b, eps))
    after:   y = sloth.layer_norm(x, w, b, eps, bf16)
    """
    _lowering().register()
    return rewrite_sites(gm, report, FAMILY, "sloth.layer_norm",
                         [((torch.rsqrt,), _match_decomposed), ((F.layer_norm,), _match_functional),
                          ((torch.sqrt,), _eps_outside_sqrt)], _replace,
                         lambda found: (f"eps={_eps_text(found.eps)}"
                                        + ("" if found.weight is not None else ", no weight")
                                        + ("" if found.bias is not None else ", no bias") + _dtypes_text(found)))


# The family's anchor (compiler/anchors.py): where its sites are, more broadly than its matchers take them.
def anchor(node: fx.Node) -> bool:
    """The ``layer_norm`` family's anchor: F.layer_norm, and rsqrt or sqrt of a variance about the mean [+ eps]:
    mean(square(x - mean(x))) or variance(x, ...) (any dims, any correction)"""
    if is_call(node, F.layer_norm):
        return True
    if not is_call(node, torch.rsqrt, torch.sqrt):
        return False
    v = without_eps(node.args[0])
    if is_call(v, variance):
        return True
    if not (is_call(v, torch.mean) and is_call(v.args[0], torch.square)):
        return False
    c = v.args[0].args[0]
    return is_call(c, torch.sub) and is_call(c.args[1], torch.mean) and c.args[1].args[0] is c.args[0]


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_layer_norm_pass, order=10, anchor=anchor,
                     emits=("layer_norm",),
                     summary=("LayerNorm over the last dim: `F.layer_norm`, `nn.LayerNorm`, mean-centred forms written"
                              " by hand (before `rms_norm`, which would take one as an RMSNorm of `x - mean`)"))
