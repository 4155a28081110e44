"""Gated products: where a gated MLP is, whatever its activation (the ``glu`` family's anchor and its pass's sites).

A gated product is an elementwise product ``f(P) * h(Q)`` of two tensors of the product's shape, where

    P, Q   two linear projections of one input x: F.linear / ``x @ W.T`` / a matmul-like call (bmm, grouped_mm, a
           bitsandbytes 4-bit linear, sloth's LoRA ops) reading x, a sum with such a term (peft's base + adapter, a
           bias added apart), or two different slices of one such projection (a merged gate_up: chunk, split,
           ``m[..., :n]``, ``m[..., ::2]``); x compared through casts and dropout
    f, h   elementwise functions of P and of Q (casts, constants, clamps, activations, arithmetic on P alone), at
           least one of them not affine: a nonlinearity gates

Not gated products: attention's ``q * k`` or a gated attention's ``attn_out * sigmoid(g)`` (one factor is no
projection of the layer's input), a norm's ``x * w`` and RoPE's ``x * cos`` (a weight or a table), a router's
weights times an expert's output (another shape), ``x * sigmoid(1.7 * x)`` with one projection on both sides (an
activation, not a gate), and a bilinear ``P * Q`` with no nonlinearity.

``activation_of`` reads the activations the glu op computes (lowering/glu.py) off a factor in the canonical
spelling (compiler/canonicalize.py); ``describe`` writes any other factor as a formula in x for the report.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.canonicalize import cast, gelu
from ..compiler.fx_utils import op_name, is_call, linear_parts, same_shape, tensor_of, value_of

# Elementwise calls of one tensor (their other arguments constants): affine ones, and the rest.
_AFFINE = {"cast", "neg", "positive"}
_UNARY = {"square", "pow", "sqrt", "rsqrt", "exp", "exp2", "expm1", "log", "log1p", "log2", "tanh", "sigmoid", "erf",
          "erfc", "abs", "reciprocal", "sin", "cos", "sign", "silu", "gelu", "relu", "relu6", "softplus", "elu", "selu",
          "celu", "leaky_relu", "hardtanh", "mish", "hardswish", "hardsigmoid", "logsigmoid", "softsign", "tanhshrink",
          "special_expit", "expit", "clamp", "clamp_min", "clamp_max", "clip"}
_BOUNDS = {"clamp", "clamp_min", "clamp_max", "clip", "abs", "sign"}  # nonlinear, but no activation by themselves
_ARITHMETIC = {"mul", "div", "add", "sub"}
# Matmul-like calls whose first floating tensor argument is the input they project, and ops returning a tuple whose
# members are projections of their first floating tensor argument (sloth's LoRA ops, a bitsandbytes autograd.Function).
_PROJECTIONS = {"linear", "matmul", "mm", "bmm", "addmm", "einsum", "_grouped_mm", "grouped_mm", "grouped_mm_fallback",
                "gemm_4bit", "lora_linear", "qlora_linear"}
_TUPLE_PROJECTIONS = {"lora_linear", "qlora_linear", "lora_linear_shared", "qlora_linear_shared",
                      "autograd_function_apply"}
_VIEWS = {"view", "reshape", "contiguous", "flatten", "unflatten"}
_MAX_NODES = 32  # the longest elementwise formula followed (the written-out GELUs take about 15 nodes)

# The glu op's activations (lowering/glu.py), in the order the report names them.
ACTIVATION_NAMES = ("silu", "gelu_tanh", "gelu_erf", "relu", "relu2", "sigmoid")


def _is_constant(arg: Any) -> bool:
    """A number, a non-tensor argument (a symbolic size too), or a one-element tensor (a scale kept in a buffer)."""
    if not isinstance(arg, fx.Node):
        return True
    value = value_of(arg)
    if value is None:
        return False  # nothing recorded: no claim that it is constant
    if not isinstance(value, torch.Tensor):
        return True
    return value.dim() == 0 or (value.dim() == 1 and isinstance(value.shape[0], int) and value.shape[0] == 1)


def _elementwise_inputs(node: fx.Node) -> Optional[list[fx.Node]]:
    """The tensor inputs of ``node`` when it is an elementwise call of the kinds above, else None."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = op_name(node)
    args = [*node.args, *node.kwargs.values()]
    tensors = [a for a in args if isinstance(a, fx.Node) and not _is_constant(a)]
    if any(isinstance(a, (list, tuple)) for a in args):
        return None
    if name in _AFFINE or name in _UNARY:
        return tensors if len(tensors) == 1 else None
    if name in _ARITHMETIC and len(node.args) == 2 and tensors:
        return tensors
    return None


def _is_nonlinear(node: fx.Node) -> bool:
    name = op_name(node)
    if name in _AFFINE:
        return False
    if name in _ARITHMETIC:  # affine with a constant operand, and x + y of two affine terms
        tensors = [a for a in node.args if isinstance(a, fx.Node) and not _is_constant(a)]
        return name in ("mul", "div") and len(tensors) == 2
    return True


@dataclasses.dataclass
class Formula:
    """A factor as an elementwise function of one tensor: ``factor = f(root)``."""
    factor: fx.Node
    root: fx.Node
    ops: frozenset  # the names of the calls between factor and root
    nonlinear: bool

    @property
    def activates(self) -> bool:
        """Whether ``f`` holds a nonlinearity other than clamps and sign changes (an activation, not a bound)."""
        return bool(self.ops & (_UNARY - _BOUNDS)) or ("mul" in self.ops and self.nonlinear)


def formula(factor: Any) -> Optional[Formula]:
    """``factor`` as an elementwise function of exactly one non-constant node (its root), or None."""
    if not isinstance(factor, fx.Node):
        return None
    roots: set[fx.Node] = set()
    ops: set[str] = set()
    nonlinear, seen, stack = False, set(), [factor]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > _MAX_NODES:
            return None
        # A projection is a root even where it is a sum (peft's base + adapter): the formula stops there.
        inputs = None if projection_input(node) is not None else _elementwise_inputs(node)
        if inputs is None:
            roots.add(node)
            continue
        ops.add(op_name(node))
        nonlinear = nonlinear or _is_nonlinear(node)
        stack.extend(inputs)
    if len(roots) != 1:
        return None
    return Formula(factor, next(iter(roots)), frozenset(ops), nonlinear)


def _strip(node: Any, names: set[str]) -> Any:
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.args \
            and op_name(node) in names:
        node = node.args[0]
    return node


def _first_float_input(node: fx.Node) -> Optional[fx.Node]:
    for arg in node.args:
        value = tensor_of(arg)
        if isinstance(arg, fx.Node) and value is not None and value.is_floating_point():
            return arg
    return None


def _input_of(x: Any) -> Any:
    """The tensor a projection reads, through casts, views and dropout (peft's adapters read dropout(x))."""
    return _strip(x, {"cast", "dropout", "to", "float", "half", "bfloat16", *_VIEWS})


def projection_input(node: Any, depth: int = 4) -> Optional[fx.Node]:
    """The input x of which ``node`` is a linear projection (module docstring), or None."""
    node = _strip(node, {"cast", *_VIEWS})
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method") or depth < 0:
        return None
    parts = linear_parts(node)
    if parts is not None:
        return _input_of(parts[0])
    name = op_name(node)
    if name in _PROJECTIONS and node.op == "call_function":
        x = _first_float_input(node)
        return _input_of(x) if x is not None else None
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and op_name(node.args[0]) in _TUPLE_PROJECTIONS:
        x = _first_float_input(node.args[0])
        return _input_of(x) if x is not None else None
    if name == "add" and len(node.args) == 2:  # base + adapter: either term a projection of x, the other no function
        for term, other in (node.args, node.args[::-1]):  # of it (g + sigmoid(g) is an activation of g)
            x = projection_input(term, depth - 1)
            if x is not None and not _elementwise_of(other, term):
                return x
    return None


def _elementwise_of(node: Any, target: fx.Node) -> bool:
    """Whether ``node`` is computed from ``target`` through elementwise calls alone."""
    seen, stack = set(), [node]
    while stack and len(seen) <= _MAX_NODES:
        n = stack.pop()
        if n is target:
            return True
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        stack.extend(_elementwise_inputs(n) or [])
    return False


def _slice_of(node: fx.Node) -> Optional[tuple[fx.Node, Any]]:
    """(m, which part) when ``node`` is a slice of m's last dim: a canonical narrow, or a strided ``m[..., a::s]``."""
    if is_call(node, torch.narrow) and node.args[1] == -1:
        return node.args[0], ("narrow", node.args[2], node.args[3])
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        index = node.args[1]
        last = index[-1] if isinstance(index, tuple) and index else index
        if isinstance(last, slice):
            return node.args[0], ("slice", last.start, last.stop, last.step)
    return None


def _projected(root: fx.Node) -> Optional[tuple[fx.Node, Any]]:
    """(x, identity) when ``root`` is a projection of x or a slice of one; two roots with one x and different
    identities are the two projections of a gated product."""
    sliced = _slice_of(root)
    if sliced is not None:
        m, part = sliced
        x = projection_input(m)
        if x is not None:
            return x, (m, part)
    x = projection_input(root)
    return (x, root) if x is not None else None


@dataclasses.dataclass
class GatedProduct:
    """A gated product (module docstring): ``product = gate * up``, ``gate`` the factor that activates."""
    product: fx.Node
    gate: Formula
    up: Formula


def gated_product(product: Any) -> Optional[GatedProduct]:
    """The gated product ``product`` is, or None (module docstring)."""
    if not (is_call(product, torch.mul) and len(product.args) == 2):
        return None
    out = tensor_of(product)
    a, b = product.args
    values = [tensor_of(a), tensor_of(b)]
    if out is None or any(v is None or not same_shape(v, out) for v in values) or a is b:
        return None
    fa, fb = formula(a), formula(b)
    if fa is None or fb is None or not (fa.nonlinear or fb.nonlinear):
        return None
    pa, pb = _projected(fa.root), _projected(fb.root)
    if pa is None or pb is None or pa[0] is not pb[0] or pa[1] == pb[1]:
        return None
    order = sorted((fa, fb), key=lambda f: (activation_of(f.factor) is None, not f.activates, not f.nonlinear))
    return GatedProduct(product, order[0], order[1])


# ---------------------------------------------------------------------------------------------------
# The glu op's activations, read off a factor
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Activation:
    """``factor = casts(act(gate))``: the op's activation name, its input, the nodes from the factor down to the
    activation's first node (each must be read by nothing but the next for the site to fuse), and how many of
    them are casts after the activation."""
    name: str
    gate: Any
    chain: list[fx.Node]
    casts: int


def activation_of(factor: Any) -> Optional[Activation]:
    """The glu op's activation that ``factor`` applies, through casts after it, or None."""
    chain: list[fx.Node] = []
    node = factor
    while is_call(node, cast):
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return None
    casts = len(chain)
    chain.append(node)
    if is_call(node, F.silu) and len(node.args) == 1:
        return Activation("silu", node.args[0], chain, casts)
    if is_call(node, gelu) and len(node.args) == 2 and node.args[1] in ("tanh", "none"):
        return Activation("gelu_tanh" if node.args[1] == "tanh" else "gelu_erf", node.args[0], chain, casts)
    if is_call(node, torch.relu) and len(node.args) == 1:
        return Activation("relu", node.args[0], chain, casts)
    if is_call(node, torch.square) and is_call(node.args[0], torch.relu) and len(node.args[0].args) == 1:
        return Activation("relu2", node.args[0].args[0], [*chain, node.args[0]], casts)
    if is_call(node, torch.sigmoid, F.sigmoid) and len(node.args) == 1:
        return Activation("sigmoid", node.args[0], chain, casts)
    return None


# ---------------------------------------------------------------------------------------------------
# A factor as a formula, for the report
# ---------------------------------------------------------------------------------------------------

_INFIX = {"mul": "*", "div": "/", "add": "+", "sub": "-"}
_MAX_CHARS = 160


def _constant_text(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        value = tensor_of(arg)
        return arg.name if value is None else f"<{arg.name}: a one-element tensor>"
    return f"{arg:g}" if isinstance(arg, float) else repr(arg)


def describe(f: Formula) -> str:
    """``f``'s factor written as a formula in x (its root), e.g. ``x * sigmoid(x * 1.702)``."""
    def text(node: Any, depth: int = 0) -> str:
        if node is f.root:
            return "x"
        if not isinstance(node, fx.Node) or _is_constant(node) or depth > 12:
            return _constant_text(node)
        name = op_name(node)
        if name == "cast":
            return f"{text(node.args[0], depth + 1)}.to({str(node.args[1]).replace('torch.', '')})"
        if name in _INFIX and len(node.args) == 2:
            return f"({text(node.args[0], depth + 1)} {_INFIX[name]} {text(node.args[1], depth + 1)})"
        args = [_bare(text(node.args[0], depth + 1)), *(_constant_text(a) for a in node.args[1:])]
        args += [f"{k}={_constant_text(v)}" for k, v in node.kwargs.items()]
        return f"{name}({', '.join(args)})"

    out = _bare(text(f.factor))
    return out if len(out) <= _MAX_CHARS else out[:_MAX_CHARS - 3] + "..."


def _bare(text: str) -> str:
    """``text`` without the parentheses around all of it (an infix term written alone or as an argument)."""
    if not (text.startswith("(") and text.endswith(")")):
        return text
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and i < len(text) - 1:
            return text  # "(a) * (b)": the first parenthesis closes before the end
    return text[1:-1]
