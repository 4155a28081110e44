"""RoPE family, the written-out forms: each pair's rotated members stacked (interleaved RoPE), or concatenated as
two signed sums of products (the halves and de-interleaving forms).

The meaning, as plain PyTorch (also the test oracle)::

    stacked_rope_pattern(x, cos, sin)      llama2.c's ``apply_rotary_emb`` (karpathy/llama2.c and its many
                                           copies): x viewed as pairs, cos/sin [..., d/2] given separately
    stacked_table_rope_pattern(x, table)   torchtune's ``RotaryPositionalEmbeddings`` (and ChatGLM's, on the
                                           first ``rot_dim`` dims): one table [..., d/2, 2] of (cos, sin) pairs

Matched on the canonical graph (compiler/canonicalize.py), whatever module wrote it; the anchor is the stack
(compiler/anchors.py, ``is_stacked_rotation``)::

    members  x0, x1 = xs[..., 0], xs[..., 1]     xs = reshape/view of x to x.shape[:-1] + (d/2, 2) (``x.float()``
             (or xs.unbind(-1), xs.select(-1, k))  first in bf16 code: the cast stays, the site starts after it)
          or x0, x1 = x[..., ::2], x[..., 1::2]  (GPT-J's real form, any spelling of the full even/odd slices)
    out = reshape(stack([x0*c - x1*s, x1*c + x0*s], -1), x.shape)   flatten(3), flatten(-2), view or reshape;
                                                  mul operands and the add in any order, each member or table
                                                  entry written once or several times (torchtune writes
                                                  xshaped[..., 0] twice: equal members are one value)
        -> ``sloth.rope(q, k, c, s, True)`` / ``sloth.rope_single(x, c, s, True)``
    the same stacked over dim -2 then flattened: the rotated members as two halves (DeepSeek's layout)
        -> ``sloth.rope(q, k, c, s, True, True)``
    c, s: any tensors [..., d/2] that broadcast over x's leading dims (llama2.c's freqs_cos, freqs_sin), or members
          0 and 1 of one table [..., d/2, 2] (torchtune's rope_cache[..., 0], rope_cache[..., 1]): the op gets
          ``table[..., k]``, one node inserted once per table and member, so q and k still share them.
    partial rotary: x = narrow(X, -1, 0, r) and out's only user cat([out, narrow(X, -1, r, D - r)], -1) (ChatGLM)

Refused with the reason (the anchor sees them, so none is silent): a flipped sign, the members in the other
order (x1*c - x0*s), tables that do not pair up (x1*s + x0*c), a stack over another dim, a stack not reshaped
back to x's shape, each stacked term cast before the stack (genmo's ``apply_rotary_emb_qk_real``: a rounding per
member the op does not make; not fused), intermediates read elsewhere, and the rope.py operand guards (dtype,
cos/sin requiring grad, shapes).

Concatenated (``match_concatenated``; the anchors ``is_halves_rotation`` and ``is_deinterleaving_rotation``)::

    out = cat([y1, y2], -1),  y1 = ±(x1 * ±a) ± (x2 * ±b),  y2 = ±(x1 * ±b') ± (x2 * ±a')
          x1, x2 the halves of x (narrow(x, -1, 0, d/2), narrow(x, -1, d/2, d/2): chunk, split, slices) or its
          even/odd elements (x[..., ::2], x[..., 1::2]: DeepSeek-V3); every minus a ``sub`` or a ``neg`` of a term,
          a product, a half or a table (``x1 * (-sin)``); products and the sum in any order
    a rotation when a' is a, b' is b (one node each, negations aside) and, with the signs gathered into
    y1 = s1 x1 a + s2 x2 b, y2 = s4 x1 b + s3 x2 a:  s1 == s3 and s4 == -s2, i.e. y = [[c, -s], [s, c]] (x1, x2)
    with c = s1 * a, s = s4 * b. GPT-OSS (and DeepSeek): s = (+, -, +, +), c = cos, s = sin; NanoChat's rotation by
    -theta, cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos]): s = (+, +, +, -), s = -sin.
        -> the op with c and s (a table negated: ``neg(table)`` inserted once per table, so q and k still pair);
           halves: the rotate-half op with cat([c, c], -1) and cat([s, s], -1), inserted once per table
           even/odd elements: ``sloth.rope(q, k, c, s, True, True)``
    Refused with the reason: any other signs (not a rotation: [[c, s], [s, c]] is none, [[c, s], [s, -c]] a
    reflection), the second term's tables the other way round, products of two halves or of two tensors' halves,
    a cat over another dim, intermediates read elsewhere, and the operand guards.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx

from ..compiler.canonicalize import cast
from ..compiler.fx_utils import is_call, same_shape, same_size, single_user, tensor_of
from .rope import (is_halves_rotation, is_stacked_rotation, pair_member, rotated_terms_factors, RopeMatch,
                   _extend_partial, _inserted_once, _is_reshape, _operand_guard, _pair_shapes_guard,
                   _strided_half)


def stacked_rope_pattern(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """llama2.c's interleaved RoPE on one tensor: pair i is (x[2i], x[2i+1]); cos/sin [..., d/2], one entry a pair."""
    x0, x1 = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def stacked_table_rope_pattern(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """torchtune's interleaved RoPE: ``table`` [..., d/2, 2] holds (cos, sin) per pair."""
    xs = x.reshape(*x.shape[:-1], -1, 2)
    return torch.stack([xs[..., 0] * table[..., 0] - xs[..., 1] * table[..., 1],
                        xs[..., 1] * table[..., 0] + xs[..., 0] * table[..., 1]], -1).flatten(-2)


def _x_member(node: Any) -> Optional[tuple[fx.Node, int]]:
    """(x, k) when ``node`` is member k of the pairs of x's last dim: ``x[..., k::2]`` (the full even/odd slice) or
    entry k of x viewed as [..., d/2, 2]; else None (a member of a table is not one of x: its view is not of x)."""
    member = pair_member(node)
    if member is None:
        return None
    t, k, strided = member
    if strided:
        return (t, k) if _strided_half(node, t) == k else None
    if not _is_reshape(t) or not isinstance(t.args[0], fx.Node):
        return None
    x = t.args[0]
    xt, pt = tensor_of(x), tensor_of(t)
    if xt is None or pt is None or not xt.dim() or not isinstance(xt.shape[-1], int) or xt.shape[-1] % 2:
        return None
    want = (*xt.shape[:-1], xt.shape[-1] // 2, 2)
    if pt.dim() != len(want) or not all(same_size(a, b) for a, b in zip(pt.shape, want)):
        return None
    return x, k


def _same_value(a: Any, b: Any) -> bool:
    """One value: the same node, or equal pair members of one tensor (``t[..., 0]`` written twice)."""
    if a is b:
        return True
    ma, mb = pair_member(a), pair_member(b)
    return ma is not None and ma == mb


def _product_of(mul: fx.Node, a: Any, b: Any) -> bool:
    """``mul`` is a * b (either order), each operand the value of a and b."""
    p, q = mul.args
    return (_same_value(p, a) and _same_value(q, b)) or (_same_value(p, b) and _same_value(q, a))


def _member_nodes(node: fx.Node) -> list[fx.Node]:
    """The nodes that make x member ``node``: itself, the unbind it indexes and the pairs view (a strided slice:
    itself only)."""
    nodes = [node]
    source = node.args[0]
    if isinstance(source, fx.Node) and source.target in (torch.unbind, "unbind"):
        nodes.append(source)
        source = source.args[0]
    if not pair_member(node)[2]:
        nodes.append(source)
    return nodes


def _table(graph: fx.Graph, uses: list[Any]) -> fx.Node:
    """One node for a cos or sin written once or several times: for member k of a table's pairs (torchtune's
    ``rope_cache[..., k]``, written twice a tensor and again for the other tensor) ``table[..., k]`` inserted once per
    table and member, so every site reading that table shares it (q and k pair); otherwise the node itself (equal
    even/odd slices of one table: the first of them)."""
    member = pair_member(uses[0])
    if member is None or member[2]:
        return uses[0]
    t, k, _ = member
    return _inserted_once(graph, t, f"sloth_pair_member_{k}", operator.getitem, (t, (Ellipsis, k)))


def match_stacked(stack: fx.Node) -> Union[RopeMatch, str, None]:
    """``reshape(stack([x0*c - x1*s, x1*c + x0*s], -1), x.shape)`` with x0, x1 the members of x's pairs (an anchor:
    ``is_stacked_rotation``): a RopeMatch of the interleaved op (stacked over dim -2: its de-interleaving layout),
    or why not. None: not this form (GPT-J's rotate_every_two stack is rope.py's ``_match_add``)."""
    if not is_stacked_rotation(stack):
        return None
    terms = stack.args[0]
    if any(is_call(t, cast) for t in terms):
        return "each rotated pair member is cast before the stack (a rounding per member the fused op does not " \
               "make); this form is not fused"
    first, second = terms
    if not (is_call(first, torch.sub) and is_call(second, torch.add)):
        return "the stacked pair is not x0 * cos - x1 * sin, x1 * cos + x0 * sin (a difference, then a sum): the " \
               "wrong sign or order, not a rotation of each pair"
    (p1, p2), (p3, p4) = first.args, second.args
    verdict = None
    for xa, c in (p1.args, p1.args[::-1]):
        for xb, s in (p2.args, p2.args[::-1]):
            a, b = _x_member(xa), _x_member(xb)
            if a is None or b is None or a[0] is not b[0]:
                continue
            if (a[1], b[1]) == (1, 0):
                verdict = verdict or "the pair members are rotated in the other order (x1 * cos - x0 * sin): not " \
                                     "the rotation of the pairs (x[2i], x[2i+1])"
            if (a[1], b[1]) != (0, 1):
                continue
            c_uses = [c]
            s_uses = [s]
            for q, r in ((p3, p4), (p4, p3)):
                if _product_of(q, xb, c) and _product_of(r, xa, s):
                    c_uses.append(_other_of(q, xb))
                    s_uses.append(_other_of(r, xa))
                    return _guard_stacked(stack, a[0], [xa, xb, *(n for m in (p3, p4) for n in m.args)],
                                          c_uses, s_uses)
            verdict = "the second stacked term is not x1 * cos + x0 * sin with the first term's cos and sin (the " \
                      "wrong sign or tables): not a rotation of each pair"
    return verdict or "the products are not of members 0 and 1 of one tensor x's pairs (x[..., ::2] and " \
                      "x[..., 1::2], or x viewed as [..., d/2, 2] at [..., 0] and [..., 1]) and cos/sin"


def _other_of(mul: fx.Node, member: Any) -> Any:
    """The operand of ``mul`` that is not the x member ``member`` (by value)."""
    p, q = mul.args
    return q if _same_value(p, member) else p


def _guard_stacked(stack: fx.Node, x: fx.Node, operands: list[Any], c_uses: list[Any], s_uses: list[Any]
                   ) -> Union[RopeMatch, str]:
    """Layout, users, dtypes and shapes around a stacked site; the tables resolved to one node each."""
    first, second = stack.args[0]
    st, xt = tensor_of(stack), tensor_of(x)
    dim = stack.args[1] if len(stack.args) == 2 else stack.kwargs.get("dim", 0)
    if st is None or dim not in (-1, st.dim() - 1, -2, st.dim() - 2):
        return f"the rotated pair members are stacked over dim {dim}, not one of the last two: not the interleaved " \
               "or halves layout of the rotated pairs"
    out = single_user(stack)
    ot = tensor_of(out) if _is_reshape(out) and out.args[0] is stack else None
    if ot is None or not same_shape(ot, xt):
        return "the stacked pairs are not reshaped back to x's shape (one flatten, view or reshape)"
    members = [n for n in operands if _x_member(n) is not None and _x_member(n)[0] is x]
    inner = {stack, first, second, *first.args, *second.args, *(n for m in members for n in _member_nodes(m))}
    if any(len(n.users) != 1 for n in (stack, first, second, *first.args, *second.args)) \
            or any(not set(n.users) <= inner for n in inner - {stack}):
        return "an intermediate (a member of x's pairs, its products, their difference or sum) has other users, " \
               "so it cannot be fused away"
    ct, s_t = tensor_of(c_uses[0]), tensor_of(s_uses[0])
    refused = _operand_guard(xt, ct, s_t) or _pair_shapes_guard(xt, ct)
    if refused:
        return refused
    graph = stack.graph
    c, s = _table(graph, c_uses), _table(graph, s_uses)
    halves = dim in (-2, st.dim() - 2)
    return _extend_partial(RopeMatch(x, c, s, out, stack, interleaved=True, deinterleave=halves))


# ---------------------------------------------------------------------------------------------------
# Concatenated: cat([y1, y2], -1), each a signed sum of products of x's two parts with two tables
# ---------------------------------------------------------------------------------------------------

def _half_of(node: Any, x: fx.Node) -> Optional[int]:
    """0 for the first half of x's last dim (``narrow(x, -1, 0, d/2)``), 1 for the second; else None."""
    xt = tensor_of(x)
    d = xt.shape[-1] if xt is not None and xt.dim() else None
    if not is_call(node, torch.narrow) or node.args[0] is not x or not isinstance(d, int) or d % 2:
        return None
    dim, start, length = node.args[1:]
    if dim not in (-1, xt.dim() - 1) or length != d // 2 or start not in (0, d // 2):
        return None
    return 0 if start == 0 else 1


def _signed(node: Any) -> tuple[int, Any, list[fx.Node]]:
    """(sign, inner, negations): ``node`` = sign * inner through the ``neg`` nodes ``negations``."""
    sign, negations = 1, []
    while is_call(node, torch.neg) and len(node.args) == 1:
        sign, negations = -sign, negations + [node]
        node = node.args[0]
    return sign, node, negations


@dataclasses.dataclass(frozen=True)
class _Product:
    """One signed product of a concatenated term: ``sign * part(x) * table``, the negations taken off both."""
    sign: int
    part: int  # 0: x1, 1: x2
    table: Any
    nodes: tuple  # what computes it from x's part and the table: the term, the product, negations, the part


def _products(term: Any, x: fx.Node, part_of: Callable[[Any, fx.Node], Optional[int]]) -> Optional[list[_Product]]:
    """A term ``±(±(±p * ±t) ± ±(±p' * ±t'))`` as its two signed products of a part of x and a table; None when it is
    not one (a product of two parts, or of none)."""
    term_sign, inner, term_negations = _signed(term)
    products = []
    for i, operand in enumerate(inner.args):
        sign, mul, negations = _signed(operand)
        sign *= term_sign * (-1 if is_call(inner, torch.sub) and i == 1 else 1)
        found = None
        for a, b in (mul.args, mul.args[::-1]):
            part_sign, part, part_negations = _signed(a)
            table_sign, table, _ = _signed(b)
            if part_of(part, x) is not None and part_of(table, x) is None:
                found = _Product(sign * part_sign * table_sign, part_of(part, x), table,
                                 (*term_negations, inner, *negations, mul, *part_negations, part))
                break
        if found is None:
            return None
        products.append(found)
    return products if sorted(p.part for p in products) == [0, 1] else None


def _same_table(a: Any, b: Any) -> bool:
    """One value: the same node, or the same pure call on the same values (``sin.unsqueeze(1)`` written twice)."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.op == b.op and a.target == b.target
            and a.op in ("call_function", "call_method") and not a.is_impure() and a.kwargs == b.kwargs
            and len(a.args) == len(b.args)):
        return False
    return all(_same_table(x, y) if isinstance(x, fx.Node) else x == y and not isinstance(y, fx.Node)
               for x, y in zip(a.args, b.args))


def _sign_text(sign: int, first: bool = False) -> str:
    return ("-" if sign < 0 else "") if first else (" - " if sign < 0 else " + ")


def match_concatenated(cat: fx.Node) -> Union[RopeMatch, str]:
    """``cat([y1, y2], -1)``, y1 and y2 signed sums of products of x's two parts (its halves: an anchor
    ``is_halves_rotation``; its even/odd elements: ``is_deinterleaving_rotation``) with two tables, whose signs make
    a rotation (the module docstring): a RopeMatch for the rotate-half op (halves, its tables doubled) or the
    de-interleaving layout, each table negated where the signs say so; or why not."""
    halves = is_halves_rotation(cat)
    part_of = _half_of if halves else _strided_half
    parts, form = ("halves", "x1, x2 the first and second half of one tensor's last dim") if halves else \
        ("even/odd elements", "x1, x2 = x[..., ::2], x[..., 1::2] of one tensor")
    xs = {f.args[0] for f in rotated_terms_factors(cat)
          if isinstance(f, fx.Node) and f.op == "call_function" and f.args and isinstance(f.args[0], fx.Node)
          and part_of(f, f.args[0]) is not None}
    terms = [_products(term, next(iter(xs)), part_of) for term in cat.args[0]] if len(xs) == 1 else [None]
    if any(t is None for t in terms):
        return f"the concatenated terms are not each x1 * table +/- x2 * table with {form} (another split, two " \
               "tensors' parts, a product of two parts, or a partial rotary of halves)"
    x = next(iter(xs))
    (p0, p1), (q0, q1) = (sorted(t, key=lambda p: p.part) for t in terms)
    # y1 = s1 x1 a + s2 x2 b, y2 = s4 x1 b + s3 x2 a
    a, b = p0.table, p1.table
    if not (_same_table(q1.table, a) and _same_table(q0.table, b)):
        return f"the {parts} are rotated with the wrong sign or tables: the second term does not take x2 times the " \
               "table x1 takes in the first, and x1 times the one x2 takes (a rotation: x1*cos - x2*sin, " \
               "x2*cos + x1*sin)"
    s1, s2, s3, s4 = p0.sign, p1.sign, q1.sign, q0.sign
    if s1 != s3 or s4 != -s2:
        reflection = "; a reflection" if s1 != s3 and s2 == s4 else ""
        return f"the {parts} are rotated with the wrong sign: with a, b the tables x1 and x2 take in the first " \
               f"term, cat([{_sign_text(s1, True)}x1*a{_sign_text(s2)}x2*b, {_sign_text(s4, True)}x1*b" \
               f"{_sign_text(s3)}x2*a]) is [[{_sign_text(s1, True)}a, {_sign_text(s2, True)}b], " \
               f"[{_sign_text(s4, True)}b, {_sign_text(s3, True)}a]] (x1, x2), not a rotation [[c, -s], [s, c]] " \
               f"(the a terms need one sign, the b terms opposite signs){reflection}"
    ot, xt = tensor_of(cat), tensor_of(x)
    if len(cat.args) != 2 or cat.kwargs or cat.args[1] not in (-1, ot.dim() - 1) or not same_shape(ot, xt):
        return f"the rotated {parts} are concatenated over another dim than the last"
    inner = {n for t in terms for p in t for n in p.nodes}
    if any(not set(n.users) <= inner | {cat} for n in inner):
        return "an intermediate (a part of x, a product with a table, their difference or sum) has other users, " \
               "so it cannot be fused away"
    refused = _operand_guard(xt, tensor_of(a), tensor_of(b)) or _pair_shapes_guard(xt, tensor_of(a))
    if refused:
        return refused
    graph = cat.graph
    cos, sin = (t if sign > 0 else _inserted_once(graph, t, "sloth_negated_table", torch.neg, (t,))
                for t, sign in ((a, s1), (b, s4)))
    if not halves:
        return RopeMatch(x, cos, sin, cat, cat, interleaved=True, deinterleave=True)
    # the rotate-half op reads full tables: cat([c, c], -1), once per table so q and k still share them
    cos, sin = (_inserted_once(graph, t, "sloth_doubled_table", torch.cat, ([t, t], -1)) for t in (cos, sin))
    return _extend_partial(RopeMatch(x, cos, sin, cat, cat))
