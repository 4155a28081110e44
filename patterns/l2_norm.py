"""L2-norm family (``"l2_norm"`` in the report): the pattern, its variants, its guard, its replacement.

The meaning, as plain PyTorch (these functions are also the test oracle and the eager benchmark baseline)::

    normalize_pattern(x, eps)       F.normalize(x, dim=-1, eps=eps) = x / max(||x||, eps)   (eps clamps the norm)
    l2_norm_pattern(x, eps)         x * rsqrt(sum(x^2, -1, keepdim=True) + eps)            (eps adds to the sum)

Variants matched on the canonical graph (see compiler/canonicalize.py), whatever module wrote them:

    F.normalize(xf, 2, d, eps)                        d the last dim; xf = x or a widening cast of x
    xf * rsqrt(sum(square(xf), (-1,), True) + eps)    also x / sqrt(sum(x^2) + eps) (canonicalised to this),
                                                      and eps = 0 (no add)
    followed by a chain of single-user casts.

Both become one ``torch.ops.sloth.l2_norm(x, eps, clamp, out_dtype)`` node (lowering/l2_norm.py), ``clamp``
saying which of the two eps semantics the site had: they differ, so a site keeps its own. A *mean* of squares
in place of the sum is an RMSNorm without weight (transformers' Llama 4 ``L2Norm``); the rms_norm family takes
it, this one never sees it (canonicalisation turns ``sum / D`` into that mean too). Refused, with the reason:
a norm that is not p=2, over another dim, keepdim=False, a tensor eps, a sum of squares or rsqrt read by
someone else, float64.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.canonicalize import cast
from ..compiler.fx_utils import (insert_call, is_call, replace_and_erase, same_shape, single_user, tensor_of,
                                 without_eps)
from ..compiler.options import PassOptions
from ..compiler.families import Family
from ..compiler.report import Report
from .site_loop import rewrite_sites
from .rms_norm import _dtypes_text, _eps_text, _runtime_float, _widened_root

FAMILY = "l2_norm"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _lowering():
    """The kernel module, imported on first use (see patterns/rms_norm.py)."""
    from ..lowering import l2_norm

    return l2_norm


def normalize_pattern(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.normalize`` over the last dimension: x / max(||x||_2, eps)."""
    return F.normalize(x, p=2.0, dim=-1, eps=eps)


def l2_norm_pattern(x: torch.Tensor, eps: float) -> torch.Tensor:
    """A q/k L2-norm written out: x * rsqrt(sum(x^2) + eps), in fp32, cast back."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


@dataclasses.dataclass
class L2NormMatch:
    """A matched site: ``out``'s value equals ``sloth.l2_norm(x, eps, clamp, out.dtype)``."""
    x: fx.Node
    eps: Union[float, fx.Node]
    clamp: bool
    out: fx.Node
    anchor: fx.Node


def _match_decomposed(r: fx.Node) -> Union[L2NormMatch, str, None]:
    """Match around an ``rsqrt`` anchor. None: not an L2-norm shape; str: a near-miss and why."""
    s = r.args[0]
    eps: Any = 0.0
    if is_call(s, torch.add):
        a, b = s.args
        ss, eps = (a, b) if is_call(a, torch.sum) else (b, a)
    else:
        ss = s
    if not is_call(ss, torch.sum) or len(ss.args) != 3 or not is_call(ss.args[0], torch.square):
        return None
    sq = ss.args[0]
    xf, dims, keepdim = sq.args[0], ss.args[1], ss.args[2]
    if tuple(dims) != (-1,):
        return f"the sum of squares is over dims {tuple(dims)}, not the last dimension only"
    if not keepdim:
        return "the sum of squares drops the reduced dimension (keepdim=False)"
    eps = _runtime_float(eps)
    if eps is None:
        return "eps is a tensor, not a float"
    if len(sq.users) != 1 or len(ss.users) != 1 or (s is not ss and len(s.users) != 1):
        return "the sum of squares has other users, so it cannot be fused away"
    if len(r.users) != 1 or not is_call(single_user(r), torch.mul):
        return "rsqrt(sum of squares + eps) has other users or is not multiplied by the input"
    n = single_user(r)
    a, b = n.args
    if _widened_root(b if a is r else a) is not _widened_root(xf):
        return "rsqrt(sum of squares + eps) multiplies a different tensor than the one normalised"
    return _finish(_widened_root(xf), eps, False, n, r)


def _match_normalize(node: fx.Node) -> Union[L2NormMatch, str, None]:
    """Match ``F.normalize(x, p, dim, eps)`` (canonical: all four positional)."""
    x, p, dim, eps = node.args
    xt = tensor_of(x)
    if xt is None or xt.dim() == 0:
        return "the input's shape is unknown"
    if p != 2:
        return f"a p={p} norm, not the Euclidean (p=2) one"
    if not isinstance(dim, int) or dim not in (-1, xt.dim() - 1):
        return f"normalised over dim {dim}, not the last dimension"
    eps = _runtime_float(eps)
    if eps is None:
        return "eps is a tensor, not a float"
    return _finish(_widened_root(x), eps, True, node, node)


def _finish(x: fx.Node, eps: Union[float, fx.Node], clamp: bool, start: fx.Node, anchor: fx.Node
            ) -> Union[L2NormMatch, str]:
    """Common guard: dtypes, sizes, and the single-user casts after the normalised value."""
    xt, st = tensor_of(x), tensor_of(start)
    if xt is None or xt.dim() == 0 or st is None:
        return "the input's shape is unknown"
    if xt.dtype not in _KERNEL_DTYPES or st.dtype not in _KERNEL_DTYPES:
        return f"computes in {st.dtype} from {xt.dtype}; the fused kernel supports float32, bfloat16 and float16"
    hidden = xt.shape[-1]
    if isinstance(hidden, int) and hidden > _lowering().MAX_HIDDEN:
        return f"hidden size {hidden} exceeds the single-pass kernel's limit {_lowering().MAX_HIDDEN}"
    out = start
    while is_call(single_user(out), cast) and single_user(out).args[1] in _KERNEL_DTYPES:
        out = single_user(out)
    if tensor_of(out) is None or not same_shape(tensor_of(out), xt):
        return "the result does not have the input's shape"
    return L2NormMatch(x, eps, clamp, out, anchor)


def _replace(gm: fx.GraphModule, m: L2NormMatch) -> set[fx.Node]:
    """Insert the fused node for ``m``; returns the nodes erased."""
    out = tensor_of(m.out)
    # The value is written, not computed on fakes (that would specialise a SymFloat eps into a guard).
    fused = insert_call(gm.graph, m.out, torch.ops.sloth.l2_norm.default, (m.x, m.eps, m.clamp, out.dtype),
                        meta_from=m.anchor, value=tensor_of(m.x).new_empty(tensor_of(m.x).shape, dtype=out.dtype))
    return replace_and_erase(m.out, fused, keep=(m.x,))


def fuse_l2_norm_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                      options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace every L2 normalisation over the last dim with ``torch.ops.sloth.l2_norm``.

    before:  y = cast(xf * rsqrt(sum(square(xf), (-1,), True) + eps), bf16)
    after:   y = sloth.l2_norm(x, eps, False, bf16)
    before:  y = F.normalize(x, 2, -1, eps)
    after:   y = sloth.l2_norm(x, eps, True, f32)
    """
    _lowering().register()
    return rewrite_sites(gm, report, FAMILY, "sloth.l2_norm",
                         [((torch.rsqrt,), _match_decomposed), ((F.normalize,), _match_normalize)], _replace,
                         lambda found: (f"eps={_eps_text(found.eps)} "
                                        + ("clamps the norm" if found.clamp else "added to the sum of squares")
                                        + _dtypes_text(found)))


# The family's anchor (compiler/anchors.py): where its sites are, more broadly than its matchers take them.
def anchor(node: fx.Node) -> bool:
    """The ``l2_norm`` family's anchor: F.normalize, and rsqrt(sum(square(x)) [+ eps])"""
    if is_call(node, F.normalize):
        return True
    if not is_call(node, torch.rsqrt):
        return False
    s = without_eps(node.args[0])
    return is_call(s, torch.sum) and len(s.args) == 3 and is_call(s.args[0], torch.square)


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_l2_norm_pass, order=30, anchor=anchor,
                     emits=("l2_norm",),
                     summary=("L2 normalisation over the last dim: `F.normalize` and `x * rsqrt(sum(x^2) + eps)`, each"
                              " with its own eps"))
