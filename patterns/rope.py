"""RoPE family (``"rope"`` in the report): the pattern, its variants, its guard, its replacement.

The meaning, as plain PyTorch (these functions are also the test oracle and the eager benchmark
baseline)::

    rope_rotate_half_pattern(q, k, cos, sin)   transformers' apply_rotary_pos_emb (Llama, Mistral, Qwen,
                                               Gemma, Phi3): cos/sin [b, s, d] unsqueezed over heads
    rope_single_pattern(x, cos, sin)           one tensor: x * cos + rotate_half(x) * sin
    partial_rope_pattern(q, k, cos, sin)       Phi/StableLM/GPT-NeoX: rotate the first r = cos.shape[-1]
                                               dims, pass the rest through

Variants matched on the canonical graph (see compiler/canonicalize.py), whatever module wrote them:

    rh  = cat([neg(narrow(x, -1, d/2, d/2)), narrow(x, -1, 0, d/2)], -1)   x[..., :d/2] slices, chunk,
                                                                         split and narrow all end here
          (or cat([x2, neg(x1)]), NanoChat's -rotate_half: the rotation by -theta, fused with sin negated,
          one ``neg`` node inserted per sin table so q and k still share it)
    out = add(mul(x, cos), mul(rh, sin))          any operand order; cos/sin any tensors that broadcast
                                                  over x's leading dims ([b, h, s, d], [b, s, h, d], a
                                                  [s, d] table, ...) with last dim d
    partial rotary: x = narrow(X, -1, 0, r) (or X itself), and out's only user is
                    cat([out, narrow(X, -1, r, D - r)], -1): the site becomes X -> that cat
    interleaved (GPT-J real form, ``interleaved_rope_pattern``), cos/sin [..., d/2], one entry a pair:
        x1 = x[..., ::2]; x2 = x[..., 1::2]          any spelling of the full even/odd last-dim slices
        out = flatten(stack((x1*c - x2*s, x2*c + x1*s), -1), -2)   mul operands and the add in any order;
                                                  flatten, view or reshape back to x's shape
        -> ``sloth.rope(q, k, c, s, True)`` / ``sloth.rope_single(x, c, s, True)``
        the same with x viewed as pairs (llama2.c, torchtune, ChatGLM: x0, x1 = x.reshape(..., d/2, 2)[..., 0], [..., 1]
        or .unbind(-1)), with a (cos, sin) table [..., d/2, 2], or stacked over dim -2 (the halves layout):
        patterns/rope_forms.py
    interleaved, GPT-J's rotate_every_two (transformers' GPT-J, CodeGen), cos/sin repeated per pair:
        out = add(mul(x, repeat_interleave(c, 2, -1)), mul(flatten(stack((neg(x[..., 1::2]), x[..., ::2]), -1), -2),
                                                           repeat_interleave(s, 2, -1)))
        -> the same op with c and s [..., d/2] (the repeated tables are left to whoever else reads them);
        tables repeated by pairs further up (Cohere: repeat_interleave(freqs, 2, -1).cos() * scaling, cast,
        unsqueezed: only elementwise ops and leading unsqueezes after the repeat) give c = table[..., ::2], a
        node inserted once per table (so q and k still share it)
    de-interleaving (DeepSeek-V3's ``apply_rotary_pos_emb_interleave``, ``deinterleaving_rope_pattern``), cos/sin
    [..., d/2], pairs (x[2i], x[2i+1]) written as halves:
        out = cat([x1*c - x2*s, x2*c + x1*s], -1) with x1, x2 = x[..., ::2], x[..., 1::2]
        -> ``sloth.rope(q, k, c, s, True, True)``
    halves (GPT-OSS's ``_apply_rotary_emb``, ``halves_rope_pattern``), cos/sin [..., d/2], one entry per pair
    (x[i], x[i + d/2]):
        x1, x2 = narrow(x, -1, 0, d/2), narrow(x, -1, d/2, d/2)      chunk, split or slices
        out = cat([x1*c - x2*s, x2*c + x1*s], -1)      mul operands and the add in any order
        -> the rotate-half op with cat([c, c], -1) and cat([s, s], -1), one graph node inserted once per
           table (so q and k still share them)
    both with any signs that make a rotation (NanoChat's by -theta, ``negated_halves_rope_pattern``:
    cat([x1*c + x2*s, x1*(-s) + x2*c]), written with sub, neg of a product, of a half or of a table): the op with
    the table negated where the sign says so, one ``neg`` inserted once per table (patterns/rope_forms.py)
    complex (Meta's reference Llama, ``complex_rope_pattern``), freqs_cis complex64 [..., d/2], x float32
    (``x.float()`` in bf16 code: the cast stays, and the site starts after it):
        out = flatten(view_as_real(view_as_complex(reshape(x, ..., d/2, 2)) * freqs_cis), -2)
        -> the interleaved op with cos = torch.real(freqs_cis), sin = torch.imag(freqs_cis), two graph
           nodes inserted once per freqs_cis node (so q and k still share them)

Two sites rotated by the same cos and sin nodes (q and k of one attention) become one
``torch.ops.sloth.rope(q, k, cos, sin)`` launch (joined with the two RMSNorms of their heads where those come
right before: patterns/norm_rope.py); a site without a partner becomes
``torch.ops.sloth.rope_single(x, cos, sin)`` (lowering/rope.py). The op computes in fp32 and rounds once,
and handles any cos/sin values exactly (it never assumes their halves are equal), so it is at least as
accurate as every variant above. Anything else says no and leaves the graph as it was: a rotation with
the wrong sign or swapped halves, a rotate_half over another dim, cos/sin that do not broadcast to x or
that require grad, float64, intermediates read by someone else.

Partial rotary is absorbed for the rotate-half and both real interleaved forms (GPT-J rotates the first
``rotary_dim`` dims of each head in pairs). Knowingly left unmatched (no rejection, no wrong match):
complex RoPE in complex128 or with a division. Refused with the reason: Flux's rotation matrices per pair
(compiler/anchors.py ``is_matrix_rotation``). A flipped sign, swapped parities or a stack over another dim in a
stacked interleaved form is refused with the reason (patterns/rope_forms.py). In bf16 Meta code k.float() is
defined after q's site: it moves up to q's, so q and k still pair (``_hoistable``).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx

from ..compiler.canonicalize import cast
from ..compiler.fx_utils import (inherit_requires_grad, insert_call, is_call, is_method, module_path,
                                 replace_and_erase, same_shape, same_size, single_user, source_location, tensor_of)
from ..compiler.options import PassOptions
from ..compiler.families import Family
from ..compiler.report import Report, Site
from ..lowering.layout import empty_heads, is_bshd
from .norm_rope import join_qk_norms

FAMILY = "rope"


def _lowering():
    """The kernel module, imported on first use (see patterns/rms_norm.py: importing triton must wait
    until a script has had the chance to set TRITON_INTERPRET)."""
    from ..lowering import rope

    return rope


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of the input (transformers' spelling)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_single_pattern(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of one tensor; cos/sin broadcast to x."""
    return (x * cos) + (rotate_half(x) * sin)


def rope_rotate_half_pattern(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb: cos/sin [b, s, d] unsqueezed over the heads dim of q and k."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return rope_single_pattern(q, cos, sin), rope_single_pattern(k, cos, sin)


def partial_rope_pattern(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi/StableLM/GPT-NeoX partial rotary: the first ``cos.shape[-1]`` dims rotate, the rest pass."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    q_rot, q_pass = q[..., :r], q[..., r:]
    k_rot, k_pass = k[..., :r], k[..., r:]
    return (torch.cat([rope_single_pattern(q_rot, cos, sin), q_pass], dim=-1),
            torch.cat([rope_single_pattern(k_rot, cos, sin), k_pass], dim=-1))


@dataclasses.dataclass
class RopeMatch:
    """A matched site: ``out``'s value equals ``sloth.rope_single(x, cos, sin)``; ``anchor`` is the add."""
    x: fx.Node
    cos: fx.Node
    sin: fx.Node
    out: fx.Node
    anchor: fx.Node
    interleaved: bool = False
    deinterleave: bool = False  # interleaved pairs written as halves (DeepSeek): ``interleaved`` too


def interleaved_rope_pattern(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J interleaved RoPE, real form: pair i is (x[2i], x[2i+1]); cos/sin are [..., d/2], one entry a pair."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)


def deinterleaving_rope_pattern(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's ``apply_rotary_pos_emb_interleave`` (transformers 5.25) on one tensor: interleaved pairs
    (x[2i], x[2i+1]) rotated by the per-pair cos/sin [..., d/2], the results concatenated as halves."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _strided_half(node: Any, x: fx.Node) -> Optional[int]:
    """0 for ``x[..., ::2]``, 1 for ``x[..., 1::2]`` (any spelling of the full even/odd last-dim slice); else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and not node.kwargs and node.args[0] is x and isinstance(node.args[1], tuple)):
        return None
    xt = tensor_of(x)
    d = xt.shape[-1] if xt is not None and xt.dim() else None
    index = node.args[1]
    if not isinstance(d, int) or d % 2 or not index or not isinstance(index[-1], slice):
        return None
    lead = index[:-1]
    if not all(i is Ellipsis or i == slice(None) for i in lead) or lead.count(Ellipsis) > 1:
        return None
    if Ellipsis not in lead and len(index) != xt.dim():
        return None
    s = index[-1]
    if not all(v is None or isinstance(v, int) for v in (s.start, s.stop, s.step)):
        return None
    picked = range(*s.indices(d))
    for parity in (0, 1):
        if picked == range(parity, d, 2):
            return parity
    return None


def halves_rope_pattern(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the two halves (GPT-OSS): pair i is (x[i], x[i + d/2]); cos/sin are [..., d/2]."""
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def negated_halves_rope_pattern(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """karpathy/nanochat's ``apply_rotary_emb``: the halves rotated by -theta, ``halves_rope_pattern`` with -sin."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], -1)


def _operand_guard(xt: Optional[torch.Tensor], ct: Optional[torch.Tensor], st: Optional[torch.Tensor]) -> Optional[str]:
    """Why x, cos and sin cannot go to the kernel (dtypes, grads, rank, cos/sin shapes), or None."""
    if xt is None or ct is None or st is None:
        return "x, cos or sin is not a tensor"
    dtypes = {xt.dtype, ct.dtype, st.dtype}
    if not dtypes <= set(_KERNEL_DTYPES):
        return f"computes in {sorted(str(d)[6:] for d in dtypes - set(_KERNEL_DTYPES))}; " \
               "the fused kernel supports float32, bfloat16 and float16"
    if ct.requires_grad or st.requires_grad:
        return "cos or sin requires grad; the fused op gives them no gradient"
    if not 1 <= xt.dim() <= _lowering().MAX_DIMS:
        return f"x has {xt.dim()} dims; the fused op takes 1 to {_lowering().MAX_DIMS}"
    if not same_shape(ct, st):
        return f"cos and sin have different shapes {tuple(ct.shape)} and {tuple(st.shape)}"
    return None


def _pair_shapes_guard(xt: torch.Tensor, ct: torch.Tensor) -> Optional[str]:
    """Why per-pair cos/sin [..., d/2] do not fit x [..., d] (one entry a pair, broadcasting over x's leading
    dims), or None."""
    if ct.dim() > xt.dim() or not same_size(2 * ct.shape[-1], xt.shape[-1]):
        return f"interleaved cos/sin of shape {tuple(ct.shape)} do not give one entry per pair of x {tuple(xt.shape)}"
    try:
        lead = torch.broadcast_shapes(tuple(xt.shape[:-1]), tuple(ct.shape[:-1]))
    except RuntimeError:
        lead = None
    if lead is None or tuple(lead) != tuple(xt.shape[:-1]):
        return f"cos/sin of shape {tuple(ct.shape)} broadcast x {tuple(xt.shape)} to a larger shape"
    return None


def complex_rope_pattern(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Meta's reference Llama: x [..., d] float32 times a complex64 freqs_cis [..., d/2] (torch.polar)."""
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(-2)


def _is_reshape(node: Any) -> bool:
    return isinstance(node, fx.Node) and not node.kwargs and node.args and (
        (node.op == "call_method" and node.target in ("flatten", "view", "reshape"))
        or (node.op == "call_function" and node.target in (torch.flatten, torch.reshape)))


def _match_complex(vr: fx.Node) -> Union[tuple[fx.Node, fx.Node, fx.Node], str, None]:
    """``flatten(view_as_real(view_as_complex(reshape(x, ..., d/2, 2)) * F), -2)``: (x, F, flatten) or None."""
    mul = vr.args[0] if len(vr.args) == 1 and not vr.kwargs else None
    if not is_call(mul, torch.mul) or len(mul.args) != 2:
        return None
    for xc, f in (mul.args, mul.args[::-1]):
        if not is_call(xc, torch.view_as_complex) or len(xc.args) != 1 or not _is_reshape(xc.args[0]):
            continue
        r = xc.args[0]
        x = r.args[0]
        xt, rt, ft = tensor_of(x), tensor_of(r), tensor_of(f)
        if xt is None or rt is None or ft is None or not isinstance(f, fx.Node) or xt.dim() == 0:
            continue
        d = xt.shape[-1]
        if not isinstance(d, int) or d % 2 \
                or tuple(rt.shape) != tuple(xt.shape[:-1]) + (d // 2, 2):
            continue
        user = single_user(vr)
        ut = tensor_of(user) if _is_reshape(user) and user.args[0] is vr else None
        if ut is None or not same_shape(ut, xt):
            continue
        if ft.dtype != torch.complex64 or xt.dtype != torch.float32:
            return f"complex RoPE in {xt.dtype} x {ft.dtype}; the fused kernel takes float32 x complex64"
        if ft.requires_grad:
            return "freqs_cis requires grad; the fused op gives cos and sin no gradient"
        if any(len(n.users) != 1 for n in (r, xc, mul, vr)):
            return "an intermediate (view_as_complex(x), its product with freqs_cis) has other users"
        if ft.dim() > xt.dim() or not same_size(2 * ft.shape[-1], d):
            return f"freqs_cis of shape {tuple(ft.shape)} does not give one entry per pair of x {tuple(xt.shape)}"
        try:
            lead = torch.broadcast_shapes(tuple(xt.shape[:-1]), tuple(ft.shape[:-1]))
        except RuntimeError:
            lead = None
        if lead is None or tuple(lead) != tuple(xt.shape[:-1]):
            return f"freqs_cis of shape {tuple(ft.shape)} broadcasts x {tuple(xt.shape)} to a larger shape"
        if not 1 <= xt.dim() <= _lowering().MAX_DIMS:
            return f"x has {xt.dim()} dims; the fused op takes 1 to {_lowering().MAX_DIMS}"
        return x, f, user
    return None


def _narrow_part(node: Any) -> Optional[tuple[bool, fx.Node, int, int, int]]:
    """(negated, x, dim, start, length) for ``narrow(x, ...)`` or ``neg(narrow(x, ...))``; else None."""
    negated = is_call(node, torch.neg)
    if negated:
        node = node.args[0]
    if not is_call(node, torch.narrow):
        return None
    x, dim, start, length = node.args
    return negated, x, dim, start, length


def _same_view(a: Any, b: Any) -> bool:
    """True when a and b are one node, or equal ``narrow`` views of one tensor (``q[..., :r]`` written twice)."""
    if a is b:
        return True
    return is_call(a, torch.narrow) and is_call(b, torch.narrow) and a.args[1:] == b.args[1:] \
        and _same_view(a.args[0], b.args[0])


def _rotation_of(rh: Any, x: fx.Node) -> Union[bool, str]:
    """True when ``rh`` is rotate_half(x), NEGATED when it is -rotate_half(x) = cat((x2, -x1)) (NanoChat's: the
    rotation by -theta, the op's with sin negated); a reason when it is a cat of two slices of x that is neither;
    False when it has nothing to do with x."""
    if not is_call(rh, torch.cat) or len(rh.args[0]) != 2:
        return False
    parts = [_narrow_part(p) for p in rh.args[0]]
    if any(p is None or not _same_view(p[1], x) for p in parts):
        return False
    d = tensor_of(x).shape[-1]
    dims = {rh.args[1], *(p[2] for p in parts)}
    if dims != {-1}:
        return f"the rotation concatenates slices over dim {sorted(dims)[0]}, not the last (head) dim"
    if not isinstance(d, int) or d % 2:
        return f"the head dim {d} is not a static even size"
    h = d // 2
    if [p[3:] for p in parts] == [(h, h), (0, h)] and [p[0] for p in parts] in ([True, False], [False, True]):
        return True if parts[0][0] else NEGATED
    text = ", ".join(f"{'-' if p[0] else ''}x[..., {p[3]}:{p[3] + p[4]}]" for p in parts)
    return f"cat(({text})) is not rotate_half(x) = cat((-x[..., {h}:{d}], x[..., 0:{h}])) (wrong sign or halves)"


# _rotation_of's verdict for cat((x2, -x1)), the rotate-half of the rotation by -theta
NEGATED = "negated"


def _inserted_once(graph: fx.Graph, table: fx.Node, key: str, target: Any, args: tuple) -> fx.Node:
    """``target(*args)``, derived from ``table``, inserted right after it once per graph (kept in its meta under
    ``key``), so q's and k's sites share the node and still pair into one launch."""
    derived = table.meta.get(key)
    if derived is None or derived.graph is not graph or getattr(derived, "_erased", False):
        after = table.next
        while after.op == "placeholder":  # a table that is a graph input: the graph's inputs stay first
            after = after.next
        derived = insert_call(graph, after, target, args, meta_from=table)
        table.meta[key] = derived
    return derived


def _other(mul: fx.Node, node: Any) -> Any:
    a, b = mul.args
    return b if a is node else a


def _every_two_rotation_of(rh: Any, x: fx.Node) -> Optional[list[fx.Node]]:
    """The nodes of ``flatten(stack((-x[..., 1::2], x[..., ::2]), -1), -2)`` (GPT-J's rotate_every_two) when
    ``rh`` is that of x, else None."""
    if not (_is_reshape(rh) and isinstance(rh.args[0], fx.Node) and rh.args[0].op == "call_function"
            and rh.args[0].target is torch.stack):
        return None
    stack = rh.args[0]
    if set(stack.kwargs) - {"dim"} or len(stack.args[0]) != 2:
        return None
    dim = stack.args[1] if len(stack.args) == 2 else stack.kwargs.get("dim", 0)
    neg, x1 = stack.args[0]
    st, rt, xt = tensor_of(stack), tensor_of(rh), tensor_of(x)
    if st is None or rt is None or xt is None or dim not in (-1, st.dim() - 1) or not same_shape(rt, xt):
        return None
    if not (is_call(neg, torch.neg) and _strided_half(neg.args[0], x) == 1 and _strided_half(x1, x) == 0):
        return None
    return [rh, stack, neg, neg.args[0], x1]


def _every_two_near_miss(rh: Any, x: fx.Node) -> Optional[str]:
    """Why a reshaped stack of x's even and odd elements, one of them negated (an anchor), is not
    rotate_every_two(x); None when ``rh`` is no such stack."""
    stack = rh.args[0] if _is_reshape(rh) else None
    if not (isinstance(stack, fx.Node) and stack.op == "call_function" and stack.target is torch.stack
            and isinstance(stack.args[0], (list, tuple)) and len(stack.args[0]) == 2):
        return None
    negated = [is_call(p, torch.neg) for p in stack.args[0]]
    parts = [p.args[0] if n else p for p, n in zip(stack.args[0], negated)]
    if sum(negated) != 1 or any(_strided_half(p, x) is None for p in parts):
        return None
    return "the stack of x's even/odd elements is not rotate_every_two(x) = flatten(stack((-x[..., 1::2], " \
           "x[..., ::2]), -1), -2) (another sign, order or stack dim)"


def _per_pair_table(node: Any) -> Optional[fx.Node]:
    """t when ``node`` is ``torch.repeat_interleave(t, 2, dim)`` (or the method) over t's last dim: each entry
    of t given to both members of a pair, the table GPT-J builds for rotate_every_two."""
    if not isinstance(node, fx.Node) or not (
            (node.op == "call_function" and node.target is torch.repeat_interleave)
            or (node.op == "call_method" and node.target == "repeat_interleave")):
        return None
    args = dict(zip(("input", "repeats", "dim"), node.args), **node.kwargs)
    t, tt = args.get("input"), tensor_of(args.get("input"))
    if tt is None or args.get("repeats") != 2 or set(args) - {"input", "repeats", "dim"}:
        return None
    return t if args.get("dim") in (-1, tt.dim() - 1) else None


# Ops that give equal outputs for equal inputs element by element and keep the last dim where it is: between a
# repeat_interleave(t, 2, -1) and a table's use, they keep every pair of entries equal (``_repeated_pairs``).
_ELEMENTWISE = (torch.cos, torch.sin, cast)
_BY_A_NUMBER = (torch.mul, torch.div)


def _repeated_pairs(node: Any) -> bool:
    """Whether every pair (2i, 2i+1) of ``node``'s last dim holds equal entries by construction: a
    ``repeat_interleave(t, 2, -1)`` followed only by elementwise functions (cos, sin, a cast, a product or quotient
    by a number) and unsqueezes of leading dims, as Cohere's rotary embedding builds its tables
    (``repeat_interleave(freqs, 2, -1).cos() * scaling``, cast, unsqueezed over heads)."""
    while isinstance(node, fx.Node):
        if _per_pair_table(node) is not None:
            return True
        value, source = tensor_of(node), node.args[0] if node.args else None
        before = tensor_of(source)
        if value is None or before is None or value.dim() == 0 or before.dim() == 0 \
                or not same_size(value.shape[-1], before.shape[-1]):
            return False
        if is_call(node, *_ELEMENTWISE) or is_method(node, "cos", "sin"):
            pass
        elif is_call(node, *_BY_A_NUMBER) and len(node.args) == 2 and isinstance(node.args[1], (int, float)) \
                and not node.kwargs:
            pass
        elif (is_call(node, torch.unsqueeze) or is_method(node, "unsqueeze")) and len(node.args) == 2 \
                and isinstance(node.args[1], int) and node.args[1] not in (-1, value.dim() - 1):
            pass
        else:
            return False
        node = source
    return False


def _match_every_two(add: fx.Node, plain: fx.Node, rotated: fx.Node, x: fx.Node, rh: Any
                     ) -> Union[RopeMatch, str, None]:
    """``x * repeat_interleave(c, 2, -1) + rotate_every_two(x) * repeat_interleave(s, 2, -1)`` (GPT-J):
    out[2i] = x[2i] c_i - x[2i+1] s_i, out[2i+1] = x[2i+1] c_i + x[2i] s_i, the interleaved op with c, s. Tables
    repeated by pairs further up (Cohere: ``repeat_interleave(freqs, 2, -1).cos()``) give c = table[..., ::2]."""
    inner = _every_two_rotation_of(rh, x)
    if inner is None:
        return _every_two_near_miss(rh, x)
    full_c, full_s = _other(plain, x), _other(rotated, rh)
    c, s = _per_pair_table(full_c), _per_pair_table(full_s)
    derive = (c is None or s is None) and _repeated_pairs(full_c) and _repeated_pairs(full_s)
    if (c is None or s is None) and not derive:
        return "rotate_every_two(x) with cos/sin that are not repeat_interleave(table, 2) over the last dim"
    if len(plain.users) != 1 or len(rotated.users) != 1 or any(len(n.users) != 1 for n in inner):
        return "an intermediate (x * cos, rotate_every_two(x), its halves) has other users, so it cannot be fused away"
    xt = tensor_of(x)
    if derive:
        ct, st = tensor_of(full_c)[..., ::2], tensor_of(full_s)[..., ::2]
    else:
        ct, st = tensor_of(c), tensor_of(s)
    refused = _operand_guard(xt, ct, st) or _pair_shapes_guard(xt, ct)
    ot = tensor_of(add)
    if not refused and (ot is None or not same_shape(ot, xt)):
        refused = f"cos/sin of shape {tuple(ct.shape)} broadcast x {tuple(xt.shape)} to a larger shape"
    if refused:
        return refused
    if derive:
        # table[..., ::2]: the per-pair table of a pairwise-repeated one
        every_other = (Ellipsis, slice(None, None, 2))
        c, s = (_inserted_once(add.graph, t, "sloth_pair_table", operator.getitem, (t, every_other))
                for t in (full_c, full_s))
    return _extend_partial(RopeMatch(x, c, s, add, add, interleaved=True))


def _match_add(add: fx.Node) -> Union[RopeMatch, str, None]:
    """Match ``x * cos + rotate_half(x) * sin`` (or GPT-J's rotate_every_two form) at an add. None: not
    RoPE-shaped; str: a near-miss."""
    a, b = add.args
    if not (is_call(a, torch.mul) and is_call(b, torch.mul)):
        return None
    found: Union[RopeMatch, str, None] = None
    for plain, rotated in ((a, b), (b, a)):
        for x in plain.args:
            if tensor_of(x) is None or not isinstance(x, fx.Node) or tensor_of(x).dim() == 0:
                continue
            for rh in rotated.args:
                every_two = _match_every_two(add, plain, rotated, x, rh)
                if isinstance(every_two, RopeMatch):
                    return every_two
                if isinstance(every_two, str):
                    found = every_two
                    continue
                verdict = _rotation_of(rh, x)
                if verdict is True or verdict is NEGATED:
                    sin = _other(rotated, rh)
                    m = _guard(RopeMatch(x, _other(plain, x), sin, add, add), plain, rotated, rh)
                    if isinstance(m, RopeMatch) and verdict is NEGATED:  # x*c + (-rotate_half(x))*s: sin -> -s
                        m = dataclasses.replace(m, sin=_inserted_once(add.graph, sin, "sloth_negated_table",
                                                                      torch.neg, (sin,)))
                    return m
                if isinstance(verdict, str) and verdict is not NEGATED:
                    found = verdict
    return found


def _guard(m: RopeMatch, plain: fx.Node, rotated: fx.Node, rh: fx.Node) -> Union[RopeMatch, str]:
    """Dtypes, shapes and users around a RoPE-shaped site; extends it over a partial-rotary cat."""
    xt, ct, st = tensor_of(m.x), tensor_of(m.cos), tensor_of(m.sin)
    if ct is None or st is None:
        return "cos or sin is not a tensor"
    parts = [p.args[0] if is_call(p, torch.neg) else None for p in rh.args[0]]
    inner = [rh, *rh.args[0], *(p for p in parts if p is not None)]
    if len(plain.users) != 1 or len(rotated.users) != 1 or any(len(n.users) != 1 for n in inner):
        return "an intermediate (x * cos, rotate_half(x), its halves) has other users, so it cannot be fused away"
    refused = _operand_guard(xt, ct, st)
    if refused:
        return refused
    if ct.dim() > xt.dim() or not same_size(ct.shape[-1], xt.shape[-1]):
        return f"cos/sin of shape {tuple(ct.shape)} do not match the head dim of x {tuple(xt.shape)}"
    ot = tensor_of(m.out)
    if ot is None or not same_shape(ot, xt):
        return f"cos/sin of shape {tuple(ct.shape)} broadcast x {tuple(xt.shape)} to a larger shape"
    return _extend_partial(m)


def _extend_partial(m: RopeMatch) -> RopeMatch:
    """``cat([rope(X[..., :r]), X[..., r:]], -1)`` -> the site X -> cat (the kernel passes dims r: through)."""
    user = single_user(m.out)
    if not (is_call(user, torch.cat) and user.args[1] == -1 and len(user.args[0]) == 2 and user.args[0][0] is m.out):
        return m
    rest = _narrow_part(user.args[0][1])
    if rest is None or rest[0]:
        return m
    _, big, dim, start, length = rest
    r = tensor_of(m.x).shape[-1]
    if is_call(m.x, torch.narrow):
        if m.x.args[:3] != (big, -1, 0):
            return m
    elif m.x is not big:
        return m
    bt, ut = tensor_of(big), tensor_of(user)
    if (dim, start) != (-1, r) or not same_size(r + length, bt.shape[-1]) or not same_shape(ut, bt) \
            or len(user.args[0][1].users) != 1:
        return m
    return RopeMatch(big, m.cos, m.sin, user, m.anchor, interleaved=m.interleaved, deinterleave=m.deinterleave)


def _out_value(m: RopeMatch, bshd: bool) -> torch.Tensor:
    """The fake of the op's result: a fresh tensor of x's shape in the result dtype, laid out as the op lays it."""
    xt = tensor_of(m.x)
    return empty_heads(xt, xt.shape, tensor_of(m.out).dtype, bshd)


def _bshd(ms: Sequence[RopeMatch]) -> bool:
    """Whether every x is a projection's output viewed as heads ([b, s, h, d] memory): the op then writes its
    result in that layout (lowering/rope.py, "Output layout")."""
    return all(is_bshd(tensor_of(m.x)) for m in ms)


def _flag(m: RopeMatch, bshd: bool = False) -> tuple:
    """The op's ``interleaved``, ``deinterleave`` and ``bshd_out`` arguments, given up to the last True one: a
    contiguous rotate-half site keeps its graph as it was."""
    flags = (m.interleaved, m.deinterleave, bshd)
    last = max((i + 1 for i, f in enumerate(flags) if f), default=0)
    return tuple(bool(f) for f in flags[:last])


def _replace_out(m: RopeMatch, new: fx.Node, keep: Sequence[fx.Node]) -> None:
    """Point m.out's users at ``new`` and erase the site. An interleaved site ends in a ``flatten`` method
    call, which ``replace_and_erase`` leaves in place (it walks call_function nodes only): erase it here."""
    if m.interleaved:
        # Also walk call_method nodes (flatten, the reshape before view_as_complex), all pure views.
        graph, keep = m.out.graph, set(keep)
        inherit_requires_grad(m.out, new)
        m.out.replace_all_uses_with(new)
        stack = [m.out]
        while stack:
            node = stack.pop()
            if node.graph is not graph or node in keep or node.users \
                    or node.op not in ("call_function", "call_method") or node.is_impure():
                continue
            inputs = list(node.all_input_nodes)
            graph.erase_node(node)
            stack += inputs
    else:
        replace_and_erase(m.out, new, keep=keep)


def _replace_single(gm: fx.GraphModule, m: RopeMatch) -> None:
    bshd = _bshd([m])
    fused = insert_call(gm.graph, m.out, torch.ops.sloth.rope_single.default, (m.x, m.cos, m.sin) + _flag(m, bshd),
                        meta_from=m.anchor, value=_out_value(m, bshd))
    _replace_out(m, fused, keep=(m.x, m.cos, m.sin))


def _replace_pair(gm: fx.GraphModule, q: RopeMatch, k: RopeMatch, before: fx.Node) -> fx.Node:
    graph = gm.graph
    bshd = _bshd([q, k])
    values = (_out_value(q, bshd), _out_value(k, bshd))
    fused = insert_call(graph, before, torch.ops.sloth.rope.default, (q.x, k.x, q.cos, q.sin) + _flag(q, bshd),
                        meta_from=q.anchor, value=values)
    # Both getitems go in before either old result is erased: ``before`` may be one of them.
    items = [insert_call(graph, before, operator.getitem, (fused, i), meta_from=m.anchor, value=values[i])
             for i, m in enumerate((q, k))]
    for m, item in zip((q, k), items):
        _replace_out(m, item, keep=(q.x, k.x, q.cos, q.sin))
    return fused


def _detail(ms: Sequence[RopeMatch]) -> str:
    xt, ct = tensor_of(ms[0].x), tensor_of(ms[0].cos)
    r = 2 * ct.shape[-1] if ms[0].interleaved else ct.shape[-1]
    rot = f", rotary {r} of {xt.shape[-1]}" if not same_size(r, xt.shape[-1]) else ""
    layout = "interleaved pairs to halves " if ms[0].deinterleave else "interleaved " if ms[0].interleaved else ""
    which = layout + ("q+k" if len(ms) == 2 else "one tensor")
    return f"{which}, head_dim {xt.shape[-1]}{rot}, {xt.dtype} -> {tensor_of(ms[0].out).dtype}".replace("torch.", "")


def _hoistable(x: fx.Node, before: fx.Node, order: dict[fx.Node, float]) -> bool:
    """Whether ``x`` (a site's input defined after ``before``) can move to just before it: a pure call whose inputs
    are all defined before ``before`` (``x.float()`` of a k view made earlier), so the move changes no value."""
    return x.op in ("call_function", "call_method") and not x.is_impure() \
        and all(order.get(i, order[before]) < order[before] for i in x.all_input_nodes)


def fuse_rope_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                   options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace every rotate-half RoPE in the canonical graph with ``torch.ops.sloth.rope`` (q and k together).

    before:  rh_q = cat([neg(narrow(q, -1, 8, 8)), narrow(q, -1, 0, 8)], -1); q_out = q * cos + rh_q * sin
             (the same for k with the same cos and sin)
    after:   qk = sloth.rope(q, k, cos, sin); q_out = qk[0]; k_out = qk[1]
    """
    from .rope_forms import match_concatenated, match_stacked  # built on this module's matches and guards

    _lowering().register()
    matches: list[RopeMatch] = []
    parts: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}  # freqs_cis -> (real, imag), shared by q and k
    for node in list(gm.graph.nodes):
        if is_call(node, torch.view_as_real):
            found = _match_complex(node)
            if isinstance(found, tuple):
                x, f, out = found
                if f not in parts:
                    after = f.next
                    parts[f] = tuple(insert_call(gm.graph, after, fn, (f,), meta_from=node)
                                     for fn in (torch.real, torch.imag))
                found = RopeMatch(x, *parts[f], out, node, interleaved=True)
        elif isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.stack:
            found = match_stacked(node)
        elif is_call(node, torch.add):
            found = _match_add(node)
            if found is None and is_matrix_rotation(node):
                found = "RoPE written with one 2x2 matrix per pair (Flux's apply_rope: M[..., 0] * x[..., 0] + " \
                        "M[..., 1] * x[..., 1]) is not a form the pass fuses (the op takes cos and sin; the pass does " \
                        "not prove each M is [[cos, -sin], [sin, cos]])"
        elif is_halves_rotation(node) or is_deinterleaving_rotation(node):
            found = match_concatenated(node)
        else:
            continue
        if found is None:
            continue
        if isinstance(found, str):
            report.reject(FAMILY, node, found)
            continue
        matches.append(found)

    # q and k of one attention share their cos and sin nodes; pair them in graph order. The pair's node
    # goes where the earlier result was, which needs every input of both to be defined before it (a later x
    # made there of earlier nodes, bf16 code's k.float() after q's site, moves up: _hoistable), and
    # one launch needs one head dim (partial rotary passes the same number of dims through).
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[tuple[fx.Node, fx.Node, bool, bool], list[RopeMatch]] = {}
    for m in matches:
        groups.setdefault((m.cos, m.sin, m.interleaved, m.deinterleave), []).append(m)
    for group in groups.values():
        while group:
            first = group.pop(0)
            partner = None
            if group and same_size(tensor_of(first.x).shape[-1], tensor_of(group[0].x).shape[-1]):
                before = min(first.out, group[0].out, key=order.__getitem__)
                late = [m.x for m in (first, group[0]) if order[m.x] > order[before]]
                if all(order[n] < order[before] for n in (first.cos, first.sin)) \
                        and all(_hoistable(x, before, order) for x in late):
                    for x in late:
                        before.prepend(x)
                        order[x] = order[before] - 0.5
                    partner = group.pop(0)
            if partner is not None:
                fused = _replace_pair(gm, first, partner, before)
                # q and k normalised by sloth.rms_norm just before: the three ops become one (patterns/norm_rope.py)
                joined = join_qk_norms(gm, fused, report) is not None
                report.replaced(Site(FAMILY, "sloth.norm_rope" if joined else "sloth.rope", module_path(first.anchor),
                                     source_location(first.anchor),
                                     _detail([first, partner]) + (", q and k RMSNorms joined" if joined else "")))
            else:
                _replace_single(gm, first)
                report.replaced(Site(FAMILY, "sloth.rope_single", module_path(first.anchor),
                                     source_location(first.anchor), _detail([first])))
    gm.graph.lint()
    gm.recompile()
    return gm


# The family's anchor (compiler/anchors.py): where its sites are, more broadly than its matchers take them.
def _is_even_odd_slice(node: object, start: int) -> bool:
    """``x[..., start::2]``: the even (0) or odd (1) elements of the last dimension (an explicit stop at or past its
    size too: ``x[..., 0:d:2]``)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return False
    index = node.args[1]
    last = index[-1] if isinstance(index, tuple) and index else index
    if not (isinstance(last, slice) and last.step == 2 and (last.start or 0) == start):
        return False
    if last.stop is None:
        return True
    x = node.args[0]
    value = x.meta.get("example_value", x.meta.get("val")) if isinstance(x, fx.Node) else None
    size = value.shape[-1] if isinstance(value, torch.Tensor) and value.dim() else None
    return isinstance(last.stop, int) and isinstance(size, int) and last.stop >= size


def _without_negations(node: object) -> object:
    """``node`` with every ``neg`` around it taken off (``-(-x)`` is x; the signs are the matcher's business)."""
    while is_call(node, torch.neg) and len(node.args) == 1:
        node = node.args[0]
    return node


def rotated_terms_factors(node: object) -> Optional[list[object]]:
    """The eight factors, negations taken off, of ``cat([a * b ± c * d, e * f ± g * h])``: two concatenated terms,
    each a sum or difference of two products, any term, product or factor negated (``x1 * (-sin)``, ``-x2 * sin``,
    ``-(x2 * sin)``); else None."""
    if not (is_call(node, torch.cat) and node.args and isinstance(node.args[0], (list, tuple))
            and len(node.args[0]) == 2):
        return None
    factors: list[object] = []
    for term in node.args[0]:
        term = _without_negations(term)
        if not (is_call(term, torch.add, torch.sub) and len(term.args) == 2):
            return None
        for product in term.args:
            product = _without_negations(product)
            if not (is_call(product, torch.mul) and len(product.args) == 2):
                return None
            factors += [_without_negations(f) for f in product.args]
    return factors


def is_deinterleaving_rotation(node: fx.Node) -> bool:
    """RoPE on interleaved pairs written on even/odd slices, its output de-interleaved (DeepSeek's
    ``apply_rotary_pos_emb_interleave``): cat([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1), x0 = x[..., 0::2],
    x1 = x[..., 1::2]. Deliberately broad: any signs (``rotated_terms_factors``), products in any order; the
    matcher (patterns/rope_forms.py) says which sign arrangements are rotations."""
    operands = rotated_terms_factors(node)
    return (operands is not None and any(_is_even_odd_slice(a, 0) for a in operands)
            and any(_is_even_odd_slice(a, 1) for a in operands))


def is_halves_rotation(node: fx.Node) -> bool:
    """Rotate-half RoPE written out on the two halves (GPT-OSS's ``_apply_rotary_emb``, NanoChat's rotation by
    -theta): cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1), x1 and x2 the first and second half of x's last
    dim (a ``chunk``, ``split`` or slices: ``narrow`` in the canonical graph). Deliberately broad: any signs
    (``rotated_terms_factors``: ``cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos])``), products and factors in
    any order; the matcher (patterns/rope_forms.py) says which are rotations."""
    operands = rotated_terms_factors(node)
    if operands is None or len(node.args) != 2:
        return False
    halves = {(a.args[0], a.args[2]) for a in operands if is_call(a, torch.narrow) and a.args[1] == -1}
    return len(halves) == 2 and len({x for x, _ in halves}) == 1


def pair_member(node: object) -> Optional[tuple[fx.Node, int, bool]]:
    """(t, k, strided) when ``node`` is member k (0 or 1) of the pairs of t's last dim: ``t[..., k::2]`` (strided
    True: the even or odd elements, pairs (t[2i], t[2i+1])), or entry k of a last dim of size 2 (strided False:
    ``t[..., k]``, ``t.unbind(-1)[k]``, ``t.select(-1, k)``, t being x viewed as [..., d/2, 2] or a table of
    (cos, sin) pairs); else None."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    for parity in (0, 1):
        if _is_even_odd_slice(node, parity):
            return node.args[0], parity, True
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2 and not node.kwargs:
        t, index = node.args
        if isinstance(t, fx.Node) and t.target in (torch.unbind, "unbind") and isinstance(index, int):
            dims = [*t.args[1:], *t.kwargs.values()]
            source, dim = t.args[0], dims[0] if dims else 0
            return _last_of_two(source, dim, index)
        index = index if isinstance(index, tuple) else (index,)
        if index and isinstance(index[-1], int) and all(i is Ellipsis or i == slice(None) for i in index[:-1]):
            tt = tensor_of(t)
            if tt is not None and (Ellipsis in index or len(index) == tt.dim()):
                return _last_of_two(t, -1, index[-1])
        return None
    if node.target in (torch.select, "select") and len(node.args) == 3 and not node.kwargs:
        return _last_of_two(*node.args)
    return None


def _last_of_two(t: Any, dim: Any, index: Any) -> Optional[tuple[fx.Node, int, bool]]:
    """(t, index) as a pair member when ``dim`` is t's last dim and of size 2, else None."""
    tt = tensor_of(t)
    if tt is None or not tt.dim() or not isinstance(index, int) or dim not in (-1, tt.dim() - 1) \
            or tt.shape[-1] != 2 or not -2 <= index < 2:
        return None
    return t, index % 2, False


def is_stacked_rotation(node: fx.Node) -> bool:
    """Interleaved RoPE written as a stack of each pair's rotated members: stack([x0 * c - x1 * s, x1 * c + x0 * s]),
    x0, x1 members 0 and 1 of pairs (``pair_member``: even/odd slices, GPT-J's real form; x viewed as [..., d/2, 2]
    at [..., 0] and [..., 1], llama2.c and torchtune). Deliberately broad: any signs, order, stack dim, casts of the
    two stacked terms; the matcher (patterns/rope_forms.py) says which of those it fuses."""
    if not (node.op == "call_function" and node.target is torch.stack and node.args
            and isinstance(node.args[0], (list, tuple)) and len(node.args[0]) == 2):
        return False
    terms = [t.args[0] if is_call(t, cast) else t for t in node.args[0]]
    if not all(is_call(t, torch.add, torch.sub) for t in terms):
        return False
    operands = [a for t in terms for m in t.args if is_call(m, torch.mul) for a in m.args]
    members = [pair_member(a) for a in operands]
    return len(operands) == 8 and {m[1] for m in members if m is not None} == {0, 1}


def is_matrix_rotation(node: fx.Node) -> bool:
    """RoPE with one 2x2 matrix per pair (Flux's ``apply_rope``): M[..., 0] * xs[..., 0] + M[..., 1] * xs[..., 1],
    xs = x viewed as [..., d/2, 1, 2] and M [..., d/2, 2, 2]: each product pairs member k of both (any order)."""
    if not (is_call(node, torch.add) and len(node.args) == 2 and all(is_call(m, torch.mul) for m in node.args)):
        return False
    members = [[pair_member(a) for a in m.args] for m in node.args]
    if any(p is None or p[2] for ps in members for p in ps) or [{p[1] for p in ps} for ps in members] != [{0}, {1}]:
        return False
    tails = {tuple(tensor_of(p[0]).shape[-2:]) for ps in members for p in ps}
    return tails == {(1, 2), (2, 2)}


def anchor(node: fx.Node) -> bool:
    """The ``rope`` family's anchor: rotate-half: cat([neg(narrow(x)), narrow(x)]) (either half negated); an
    interleaved pair: stack([neg(a), b]) (either member negated); a complex rotation:
    view_as_real(view_as_complex(x) * f); even/odd slices rotated and concatenated: cat([x0 * c - x1 * s, x1 * c +
    x0 * s]) (DeepSeek's interleaved form); the same on the two halves of x (GPT-OSS's rotate-half written out;
    NanoChat's by -theta: cat([x1 * c + x2 * s, x1 * (-s) + x2 * c])), for both with any signs; the members of x's
    pairs rotated and stacked: stack([x0 * c - x1 * s, x1 * c + x0 * s]), x0/x1 even/odd slices or x viewed as [...,
    d/2, 2] at [..., 0] and [..., 1] (GPT-J's real form, llama2.c, torchtune); one 2x2 matrix per pair: M[..., 0] *
    xs[..., 0] + M[..., 1] * xs[..., 1] (Flux)"""
    if is_deinterleaving_rotation(node) or is_halves_rotation(node) or is_stacked_rotation(node) \
            or is_matrix_rotation(node):
        return True
    if is_call(node, torch.cat) and node.args and isinstance(node.args[0], (list, tuple)) and len(node.args[0]) == 2:
        # rotate_half: the negated half first (transformers) or second (NanoChat's cat((x2, -x1)), -rotate_half)
        parts = [p.args[0] if is_call(p, torch.neg) else p for p in node.args[0]]
        return (sum(is_call(p, torch.neg) for p in node.args[0]) == 1 and all(is_call(p, torch.narrow) for p in parts)
                and parts[0].args[0] is parts[1].args[0])
    # rotate_every_two (GPT-J, Cohere): stack((-x[..., 1::2], x[..., ::2]), dim=-1), the dim often a keyword
    if node.op == "call_function" and node.target is torch.stack and node.args \
            and isinstance(node.args[0], (list, tuple)) and len(node.args[0]) == 2:
        return any(is_call(p, torch.neg) for p in node.args[0])
    if is_call(node, torch.view_as_real):
        product = node.args[0]
        return is_call(product, torch.mul) and any(is_call(a, torch.view_as_complex) for a in product.args)
    return False


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_rope_pass, order=40, anchor=anchor,
                     emits=("rope", "rope_single", "norm_rope"),
                     summary=("rotary embeddings: rotate-half, interleaved pairs, complex, stacked products, halves "
                              "written out; q and k in one launch, with their q/k norms when just before"))
