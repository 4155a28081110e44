"""Anchors: the nodes each family looks for, counted independently of its matcher, so no site goes unexplained.

The rule (issue 17): every anchor a family looks for is either replaced or listed under "left as they were"
with a reason. The matchers decide whether a site fuses; this module only says where a site *is*, with
definitions deliberately broader than any pattern, on the canonical graph (compiler/canonicalize.py):

    family          anchor (one per site a user would expect to be handled)
    layer_norm      F.layer_norm, and rsqrt or sqrt of a variance about the mean [+ eps]:
                    mean(square(x - mean(x))) or variance(x, ...) (any dims, any correction)
    rms_norm        rsqrt(mean(square(x)) [+ eps]), and torch.rms_norm
    l2_norm         F.normalize, and rsqrt(sum(square(x)) [+ eps])
    rope            rotate-half: cat([neg(narrow(x)), narrow(x)]) (either half negated); an interleaved pair:
                    stack([neg(a), b]) (either member negated);
                    a complex rotation: view_as_real(view_as_complex(x) * f); even/odd slices rotated and
                    concatenated: cat([x0 * c - x1 * s, x1 * c + x0 * s]) (DeepSeek's interleaved form); the
                    same on the two halves of x (GPT-OSS's rotate-half written out; NanoChat's by -theta:
                    cat([x1 * c + x2 * s, x1 * (-s) + x2 * c])), for both with any signs; the members of x's pairs
                    rotated and stacked: stack([x0 * c - x1 * s, x1 * c + x0 * s]), x0/x1 even/odd slices or x
                    viewed as [..., d/2, 2] at [..., 0] and [..., 1] (GPT-J's real form, llama2.c, torchtune);
                    one 2x2 matrix per pair: M[..., 0] * xs[..., 0] + M[..., 1] * xs[..., 1] (Flux)
    moe_route       a matmul-like call (grouped_mm, bmm, matmul, linear) reading a 3-D float graph input (stacked
                    expert weights) through views or indexing; or a linear on a 2-D float graph input whose result
                    (within its MLP) a router weight scales: a per-token factor computed from a topk by indexing,
                    softmax or scatter (a list of expert modules)
    glu             an activation (F.silu, gelu) whose one user is a product: act(gate) * up; and the gate factor
                    of any elementwise product of two linear projections of one input, one of them through a
                    nonlinearity (whatever the activation: relu, relu^2, sigmoid, tanh, x * sigmoid(1.702 x), ...)
    cross_entropy   F.cross_entropy, F.nll_loss
    lora            a low-rank chain B(A(x)) added to something: a linear reading (through casts and
                    constant scales) a linear of rank r below both the chain's input and output widths, whose
                    value (through casts and constant scales) is an operand of an add
    causal_mask     scaled_dot_product_attention with an attn_mask node and is_causal False
    packed_attention  the same, its mask computed from an integer graph input (position ids, document ids)
    sink_attention  a softmax over the last dim of cat([x, c], -1) with c one column wide (through a subtraction
                    of anything: the row max): attention with a sink logit per row (GPT-OSS)
    gqa_attention   scaled_dot_product_attention whose key or value is a tensor with its heads repeated in place
                    (transformers' repeat_kv, repeat_interleave on dim 1)
    moe_router      torch.topk (function or method) of a float tensor of 2 or more dims: a router's choice of
                    experts, whatever scores it ranks

A replaced site no longer holds its anchor (the pass erased it, or, for the causal mask, dropped the mask),
so after the passes every anchor left must have a reason: a rejection of its family at the anchor or a few
nodes downstream of it (where that family's matcher starts). An anchor with none is reported with a generic
reason (``UNMATCHED``) and listed in ``Report.unexplained``: never silent for the user, and a failing test for
sloth (tests/conftest.py).
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .canonicalize import cast, gelu, variance
from .fx_utils import is_call, is_number, linear_parts, matrix_width, tensor_of


def _strip(node: object, *targets: object) -> object:
    """Follow single steps of ``targets`` (casts, constant scales) back to their input."""
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


def _is_rms_norm(node: fx.Node) -> bool:
    if is_call(node, torch.rms_norm):
        return True
    if not is_call(node, torch.rsqrt):
        return False
    inner = node.args[0]
    if is_call(inner, torch.add) and len(inner.args) == 2:
        a, b = inner.args
        inner = a if is_call(a, torch.mean) else b
    return is_call(inner, torch.mean) and is_call(inner.args[0], torch.square)


def _without_eps(node: object) -> object:
    """The operand of ``v + c`` that is a node, when the other is not (a constant or a scalar eps)."""
    if is_call(node, torch.add) and len(node.args) == 2:
        a, b = node.args
        return a if tensor_of(b) is None else b if tensor_of(a) is None else node
    return node


def _is_layer_norm(node: fx.Node) -> bool:
    if is_call(node, F.layer_norm):
        return True
    if not is_call(node, torch.rsqrt, torch.sqrt):
        return False
    v = _without_eps(node.args[0])
    if is_call(v, variance):
        return True
    if not (is_call(v, torch.mean) and is_call(v.args[0], torch.square)):
        return False
    c = v.args[0].args[0]
    return is_call(c, torch.sub) and is_call(c.args[1], torch.mean) and c.args[1].args[0] is c.args[0]


def _is_l2_norm(node: fx.Node) -> bool:
    if is_call(node, F.normalize):
        return True
    if not is_call(node, torch.rsqrt):
        return False
    s = _without_eps(node.args[0])
    return is_call(s, torch.sum) and len(s.args) == 3 and is_call(s.args[0], torch.square)


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


def _is_rope(node: fx.Node) -> bool:
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


def is_gate_activation(node: object) -> bool:
    """An activation that gates wherever it is multiplied (F.silu, gelu in sloth's canonical spelling): the GLU half
    compiler/cut_sites.py reports when a graph returns it. Not relu or sigmoid, which a graph returns for other
    reasons too (an ungated MLP's activation, a router's scores)."""
    return is_call(node, F.silu) or is_call(node, gelu)


def _is_glu(node: fx.Node) -> bool:
    """An activation (F.silu, gelu) whose one user is a product with a tensor of its shape, or the gate factor of a
    gated product (patterns/glu_forms.py: two linear projections of one input, one through a nonlinearity)."""
    users = [u for u in node.users if is_call(u, torch.mul) and len(u.args) == 2]
    if is_gate_activation(node) and len(node.users) == 1 and users:
        other = users[0].args[1] if users[0].args[0] is node else users[0].args[0]
        act_t, other_t = tensor_of(node), tensor_of(other)  # a gate times an up of its shape; not a scale or a mask
        if act_t is not None and other_t is not None and tuple(act_t.shape) == tuple(other_t.shape):
            return True
    if not users:
        return False
    from ..patterns.glu_forms import gated_product  # patterns import compiler modules

    return any((gated := gated_product(u)) is not None and gated.gate.factor is node for u in users)


def _is_cross_entropy(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (F.cross_entropy, F.nll_loss)



def _low_rank(node: fx.Node) -> bool:
    outer = linear_parts(node)
    if outer is None:
        return False
    inner = linear_parts(_strip(outer[0]))
    if inner is None:
        return False
    rank, width_in, width_out = matrix_width(inner[1], 0), matrix_width(inner[1], 1), matrix_width(outer[1], 0)
    if not all(isinstance(n, int) for n in (rank, width_in, width_out)):
        return False  # symbolic or unknown widths: no claim either way
    return rank < width_in and rank < width_out and matrix_width(outer[1], 1) == rank


def _is_lora(node: fx.Node) -> bool:
    """A low-rank chain whose value, through casts and constant scales, is added to something: an adapter on
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


def _is_masked_attention(node: fx.Node) -> bool:
    if not (node.op == "call_function" and node.target is F.scaled_dot_product_attention):
        return False
    params = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), node.args), **node.kwargs)
    return isinstance(params.get("attn_mask"), fx.Node) and params.get("is_causal", False) is False


def reads_integer_input(node: fx.Node) -> bool:
    """Whether ``node`` is computed from an integer graph input (position ids, document ids, a padding mask)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            value = n.meta.get("example_value", n.meta.get("val"))
            if isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() \
                    and value.dtype != torch.bool:
                return True
        stack.extend(n.all_input_nodes)
    return False


def _is_packed_attention(node: fx.Node) -> bool:
    if not _is_masked_attention(node):
        return False
    params = dict(zip(("query", "key", "value", "attn_mask"), node.args), **node.kwargs)
    return reads_integer_input(params["attn_mask"])


def _is_sink_attention(node: fx.Node) -> bool:
    is_softmax = (node.op == "call_function" and node.target in (F.softmax, torch.softmax)) or \
        (node.op == "call_method" and node.target == "softmax")
    if not is_softmax or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    x = node.args[0]
    if x.op in ("call_function", "call_method") and op_name(x) == "sub" and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    if not (x.op == "call_function" and x.target is torch.cat and x.args and isinstance(x.args[0], (list, tuple))):
        return False
    value, last = tensor_of(x), tensor_of(x.args[0][-1])
    dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
    return value is not None and last is not None and dim in (-1, value.dim() - 1) and last.shape[-1] == 1 \
        and len(x.args[0]) >= 2


def is_topk(node: fx.Node) -> bool:
    """A ``topk`` of a float tensor of 2 or more dims: the ``moe_router`` family's anchor."""
    if not ((node.op == "call_function" and node.target is torch.topk)
            or (node.op == "call_method" and node.target == "topk")) or not node.args:
        return False
    value = tensor_of(node.args[0])
    return value is not None and value.is_floating_point() and value.dim() >= 2


# MoE experts: a matmul-like call reading stacked [E, ., .] expert weights (patterns/moe.py).
_GROUPED_GEMMS = {"_grouped_mm", "grouped_mm", "grouped_mm_fallback"}
_GEMM_NAMES = _GROUPED_GEMMS | {"bmm", "matmul", "linear", "mm", "einsum"}
_VIEWS = {"transpose", "permute", "t", "view", "reshape", "contiguous", "to", "getitem", "cast", "expand",
          "unsqueeze", "squeeze", "index_select"}


def op_name(node: fx.Node) -> str:
    """A call's name: a method's, an op's without namespace and overload, a function's ``__name__``."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def expert_weight(node: Any, indexed: bool = False, depth: int = 6) -> Optional[fx.Node]:
    """The 3-D float graph input ``node`` is a view of (with ``indexed``: an indexing of, ``W[e]`` or ``W[ids]``,
    then views), or None. A sum or product on the way (``W + scale * B @ A``, ``baddbmm(W, B, A)``: peft's LoRA on
    the expert weights, ``target_parameters``) is followed to its operand that leads to such an input."""
    if depth < 0 or not isinstance(node, fx.Node):
        return None
    value = tensor_of(node)
    if node.op == "placeholder":
        return node if value is not None and value.dim() == 3 and value.is_floating_point() and not indexed else None
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    name = op_name(node)
    if name in ("add", "sub", "mul", "baddbmm"):  # baddbmm(W, B, A): W + B @ A, peft's merged expert weight
        return next((w for w in (expert_weight(a, indexed, depth - 1) for a in node.args) if w is not None), None)
    if name not in _VIEWS:
        return None
    return expert_weight(node.args[0], indexed and name not in ("getitem", "index_select"), depth - 1)


def expert_weight_arg(node: fx.Node) -> tuple[Optional[Any], Optional[fx.Node]]:
    """(the argument of a matmul-like ``node`` that carries a stacked expert weight, that weight's graph input), or
    (None, None): the weight operand of a grouped GEMM (``grouped_mm(x, W, offs)``), or an indexed one (``W[e]``,
    ``W[ids]``) of ``bmm`` / ``matmul`` / ``linear`` / ``einsum`` (a 3-D activation such as the hidden states
    [B, S, H] is no expert weight)."""
    if node.op not in ("call_function", "call_method") or op_name(node) not in _GEMM_NAMES:
        return None, None
    if op_name(node) in _GROUPED_GEMMS:
        if len(node.args) < 2:
            return None, None
        weight = expert_weight(node.args[1])
        return (node.args[1], weight) if weight is not None else (None, None)
    for arg in node.args:
        if isinstance(arg, fx.Node) and (weight := expert_weight(arg, indexed=True)) is not None:
            return arg, weight
    return None, None


def expert_operand(node: fx.Node) -> Optional[fx.Node]:
    """The stacked expert weight (a graph input) a matmul-like ``node`` reads, or None (``expert_weight_arg``)."""
    return expert_weight_arg(node)[1]


def is_expert_gemm(node: fx.Node) -> bool:
    """A matmul-like call reading stacked expert weights: one of the ``moe_route`` family's anchors."""
    return expert_operand(node) is not None


# What a router weight passes through from the top-k to the product it scales (indexing, views, casts, the
# softmax, a scatter into [T, E], a renormalisation): no GEMM, no norm, no residual add.
_ROUTING = {"getitem", "narrow", "select", "unsqueeze", "squeeze", "view", "reshape", "flatten", "to", "cast",
            "type_as", "contiguous", "expand", "softmax", "scatter", "scatter_", "gather", "index_select", "div",
            "mul", "sum", "where", "eq", "float"}


def is_router_weight(node: Any, depth: int = 6) -> bool:
    """A float per-token factor (last dim 1) computed from a ``topk`` within ``depth`` routing steps: a router's
    weight of one expert (``weights[:, e:e+1]`` of a scattered [T, E], ``w[rows, k, None]``)."""
    value = tensor_of(node)
    if value is None or not value.is_floating_point() or not value.dim() or value.shape[-1] != 1:
        return False
    frontier, seen = [node], {node}
    for _ in range(depth):
        if any(is_topk(n) for n in frontier):
            return True
        frontier = [i for n in frontier if n.op in ("call_function", "call_method") and op_name(n) in _ROUTING
                    for i in n.all_input_nodes if i not in seen]
        seen.update(frontier)
    return any(is_topk(n) for n in frontier)


def list_expert_weight(node: fx.Node) -> Optional[fx.Node]:
    """The 2-D float graph input (through casts) a ``linear`` / ``x @ W.t()`` ``node`` multiplies by, or None."""
    parts = linear_parts(node)
    weight = parts[1] if parts is not None else None
    while isinstance(weight, fx.Node) and weight.op != "placeholder" and op_name(weight) in ("to", "cast") \
            and weight.args:
        weight = weight.args[0]
    value = tensor_of(weight)
    if not isinstance(weight, fx.Node) or weight.op != "placeholder" or value is None or value.dim() != 2 \
            or not value.is_floating_point():
        return None
    return weight


def is_expert_list_gemm(node: fx.Node, depth: int = 5) -> bool:
    """A GEMM of one expert of a list of expert modules (nn.ModuleList of MLPs, patterns/moe_expert_list.py): a
    linear on a 2-D weight graph input whose result, within ``depth`` nodes (its MLP's rest), is multiplied by a
    router weight (``is_router_weight``) not computed from it."""
    if list_expert_weight(node) is None:
        return False
    frontier, walked = [node], {node}
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u not in walked and not is_topk(u)]
        walked.update(frontier)
        for user in frontier:
            if user.op in ("call_function", "call_method") and op_name(user) == "mul" and any(
                    isinstance(a, fx.Node) and a not in walked and is_router_weight(a) for a in user.args):
                return True
    return False


def _is_moe_route(node: fx.Node) -> bool:
    """The ``moe_route`` family's anchor: an expert GEMM on stacked weights, or one of a list of experts."""
    return is_expert_gemm(node) or is_expert_list_gemm(node)


def _is_repeated_kv_attention(node: fx.Node) -> bool:
    from ..patterns.gqa_attention import is_repeated_kv_attention  # patterns import compiler modules

    return is_repeated_kv_attention(node)


ANCHORS = {
    "layer_norm": _is_layer_norm,
    "rms_norm": _is_rms_norm,
    "l2_norm": _is_l2_norm,
    "rope": _is_rope,
    "moe_route": _is_moe_route,
    "moe_router": is_topk,
    "glu": _is_glu,
    "cross_entropy": _is_cross_entropy,
    "lora": _is_lora,
    "packed_attention": _is_packed_attention,
    "causal_mask": _is_masked_attention,
    "sink_attention": _is_sink_attention,
    "gqa_attention": _is_repeated_kv_attention,
}


def anchors(graph_modules: Iterable[fx.GraphModule],
            finders: Iterable[tuple[str, Callable[[fx.Node], bool]]]) -> dict[str, list[fx.Node]]:
    """The anchor nodes of each (family, predicate) of ``finders`` in the graphs, in graph order (the pipeline
    passes the enabled families' anchors: ``ANCHORS`` for the built-in ones, a user's from register_family)."""
    finders = list(finders)
    found: dict[str, list[fx.Node]] = {family: [] for family, _ in finders}
    for graph_module in graph_modules:
        for node in graph_module.graph.nodes:
            for family, is_anchor in finders:
                if is_anchor(node):
                    found[family].append(node)
    return found


UNMATCHED = ("sloth recognised this as the family's site, but none of its patterns matched this form and the pass "
             "gave no reason (a gap in sloth's matching: please report it)")

# How far upstream of a pass's rejection its anchor may lie: the rejection is recorded at the node where the
# match starts (LoRA: the add after the adapter's scale; RoPE: the add of the two products; GLU: the product).
_REACH = 4


def near(anchor: fx.Node, rejected: fx.Node) -> bool:
    """Whether ``anchor`` is ``rejected`` or at most ``_REACH`` nodes upstream of it."""
    frontier, seen = [rejected], {rejected}
    for _ in range(_REACH + 1):
        if anchor in frontier:
            return True
        frontier = [i for n in frontier for i in n.all_input_nodes if i not in seen]
        seen.update(frontier)
    return False


def unexplained(left: dict[str, list[fx.Node]], rejected: list[tuple[str, fx.Node]]) -> list[tuple[str, fx.Node]]:
    """(family, anchor) for each anchor left in the graph that no rejection of its family is at or just
    downstream of: a site the family's pass neither replaced nor explained."""
    return [(family, node) for family, nodes in left.items() for node in nodes
            if not any(f == family and near(node, r) for f, r in rejected)]
