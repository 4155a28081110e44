"""Canonicalisation: one spelling per operation, so each pattern family needs few patterns.

Dynamo's graph keeps the user's spelling: ``x.pow(2)``, ``x ** 2``, ``torch.pow(x, 2)`` and ``x * x`` are
four different nodes for one value. This pass rewrites them into one form, in place, without changing
any value the graph computes:

    before                                          after
    call_method pow(x, 2) / operator.pow(x, 2)      torch.square(x)
    operator.mul(x, x)                              torch.square(x)
    call_method mean(x, -1, keepdim=True)           torch.mean(x, (-1,), True)     (dims negative)
    torch.sum(x, -1, True) / D                      torch.mean(x, (-1,), True)     (D the reduced size)
    1 / torch.sqrt(v), torch.pow(v, -0.5)           torch.rsqrt(v)
    x / torch.sqrt(v)                               torch.mul(x, torch.rsqrt(v))
    operator.mul / call_method mul / torch.mul      torch.mul                      (add, sub, div alike)
    x.float(), .to(torch.float32), .type_as(y)      cast(x, torch.float32)         (dtype from the graph)
    a cast, view, reshape or .contiguous() that     removed (a .contiguous() read by a .view stays: a
    changes nothing                                 later pass may change its input's layout)
    F.rms_norm(x, s, weight=w, eps=e)               torch.rms_norm(x, s, w, e)
    F.layer_norm(x, s, bias=b, eps=e)               F.layer_norm(x, s, w, b, e)    (defaults filled in)
    F.normalize(x, dim=d, eps=e)                    F.normalize(x, p, d, e)        (defaults filled in)
    x.var(d, unbiased=False, keepdim=k),            variance(x, negative_dims_tuple, correction, k)
    torch.var(x, d, correction=c, keepdim=k)
    x[..., a:b], x[:, :, a:b], x.narrow(d, a, n)    torch.narrow(x, d, a, n)       (d negative; unit step,
    getitem(x.chunk(n, d) / x.split(s, d), i)       torch.narrow(x, d, a_i, n_i)    static bounds, one dim)
    a slice or narrow that takes the whole dim      removed
    torch.cat/concat/concatenate(ts, dim=d)         torch.cat([ts], d)             (d negative)
    x * -1, -1 * x                                  torch.neg(x)
    F.silu(x, inplace=False), nn.SiLU, _C._nn.silu  F.silu(x)
    x * torch.sigmoid(x), torch.sigmoid(x) * x      F.silu(x)                      (also F.sigmoid, and x on
                                                                                     one side, an exact upcast
                                                                                     of it on the other)
    F.relu(x, inplace=False), nn.ReLU, x.relu()     torch.relu(x)
    F.gelu(x, approximate=a), nn.GELU(a)            gelu(x, a)                     (a: "none" or "tanh")
    0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x**3)))    gelu(x, "tanh")                (any arrangement of the
    0.5*x*(1+erf(x/sqrt(2)))                        gelu(x, "none")                 same polynomials)
    x.erf(), torch.special.erf(x)                   torch.erf(x)
    aten.numpy_T(x), aten.mT, aten.matrix_H,        getattr(x, "T"), "mT", "H", "mH"  (torch >= 2.14's
    aten.mH                                         Dynamo traces the properties as these ops)

Canonical nodes carry no keyword arguments; a node that keeps one (``torch.add(a, b, alpha=2)``, a
reduction with ``dtype=``) is left in its own spelling and no pattern reads it. Values are unchanged
except for one rounding: a floating ``sum / N`` rounds twice where ``mean`` rounds once.
Likewise ``x * sigmoid(x)`` and the written-out GELUs round at every step where ``F.silu`` / ``gelu`` round once.
Dtypes and shapes come from the fake values Dynamo recorded on each node, never from module classes.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch._prims_common as prims_common

from .fx_utils import insert_call, is_call, is_number, same_shape, tensor_of
from .options import PassOptions
from .report import Report

_is_contiguous = getattr(prims_common, "is_contiguous_or_false", lambda t: t.is_contiguous())


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The one canonical dtype conversion (``x.to(dtype)``); every cast spelling becomes this."""
    return x.to(dtype)


_BINARY = {
    operator.mul: torch.mul, "mul": torch.mul, torch.mul: torch.mul,
    operator.add: torch.add, "add": torch.add, torch.add: torch.add,
    operator.sub: torch.sub, "sub": torch.sub, torch.sub: torch.sub,
    operator.truediv: torch.div, "div": torch.div, "true_divide": torch.div, torch.div: torch.div,
    torch.true_divide: torch.div,
    operator.pow: torch.pow, "pow": torch.pow, torch.pow: torch.pow,
}
_UNARY_METHODS = ("rsqrt", "sqrt", "reciprocal", "square", "neg", "exp", "tanh", "sigmoid", "abs")
_UNARY = {**{name: getattr(torch, name) for name in _UNARY_METHODS},
          **{getattr(torch, name): getattr(torch, name) for name in _UNARY_METHODS},
          operator.neg: torch.neg}
_REDUCTIONS = {"mean": torch.mean, torch.mean: torch.mean, "sum": torch.sum, torch.sum: torch.sum}
_CAST_METHODS = ("to", "float", "half", "bfloat16", "double", "type_as", "type")
_VIEW_METHODS = ("view", "reshape", "flatten")
_VIEW_FUNCTIONS = (torch.reshape, torch.flatten)
_PURE = tuple({*_BINARY.values(), *_UNARY.values(), torch.mean, torch.sum, cast})


def variance(x: torch.Tensor, dims: tuple, correction: float, keepdim: bool) -> torch.Tensor:
    """The one canonical variance, ``torch.var(x, dims, correction=correction, keepdim=keepdim)``:
    correction 0 is the biased (population) variance LayerNorm uses, 1 the default unbiased one."""
    return torch.var(x, dims, correction=correction, keepdim=keepdim)


# Functions whose canonical node carries every parameter positionally, defaults filled in:
# (parameter names, defaults of the trailing ones).
_FULL_SIGNATURES = {
    torch.nn.functional.layer_norm: (("input", "normalized_shape", "weight", "bias", "eps"), (None, None, 1e-5)),
    torch.nn.functional.normalize: (("input", "p", "dim", "eps"), (2.0, 1, 1e-12)),
}


# torch >= 2.14's Dynamo records a tensor's transposing properties as aten ops (``x.T`` as ``aten.numpy_T(x)``);
# 2.13 and earlier record ``getattr(x, "T")``, the spelling the patterns read (compiler/fx_utils.py's
# ``_transposed_weight``): each op, as packet or overload, -> the property's name.
_PROPERTY_OPS = {op: name for op_name, name in (("numpy_T", "T"), ("mT", "mT"), ("matrix_H", "H"), ("mH", "mH"))
                 if (packet := getattr(torch.ops.aten, op_name, None)) is not None
                 for op in (packet, getattr(packet, "default", packet))}


def _property_spelling(node: fx.Node) -> bool:
    """``aten.numpy_T(x)`` (and ``mT``, ``matrix_H``, ``mH``) -> ``getattr(x, "T")``: one spelling whichever torch
    traced the graph. True if rewritten."""
    if node.op != "call_function" or node.kwargs or len(node.args) != 1:
        return False
    name = _PROPERTY_OPS.get(node.target)
    if name is None:
        return False
    _rewrite(node, getattr, (node.args[0], name))
    return True


def _key(node: fx.Node) -> Any:
    return node.target if node.op in ("call_function", "call_method") else None


def _rewrite(node: fx.Node, target: Any, args: tuple) -> None:
    """Turn ``node`` into ``target(*args)`` in place; its value is unchanged, so its meta stays."""
    node.op, node.target, node.args, node.kwargs = "call_function", target, args, {}


def _spelling(node: fx.Node) -> bool:
    """Method, operator and keyword spellings -> canonical ``torch.*`` calls. True if rewritten."""
    if _slice_spelling(node) or _cat_spelling(node):  # slices and concatenation (section below)
        return True
    if _activation_spelling(node):  # SiLU, GELU, erf (section below)
        return True
    if _property_spelling(node):  # x.T traced as aten.numpy_T (torch >= 2.14)
        return True
    key = _key(node)
    out = tensor_of(node)
    if key is None or out is None:  # only tensor-valued ops; shape arithmetic on SymInts stays
        return False
    args, kwargs = node.args, node.kwargs
    if key in _BINARY and len(args) == 2 and not kwargs:
        if node.target is not _BINARY[key] or node.op != "call_function":
            _rewrite(node, _BINARY[key], tuple(args))
            return True
        return False
    if key in _UNARY and len(args) == 1 and not kwargs:
        if node.target is not _UNARY[key] or node.op != "call_function":
            _rewrite(node, _UNARY[key], tuple(args))
            return True
        return False
    if key in _REDUCTIONS:
        return _reduction(node, _REDUCTIONS[key])
    if key in ("var", torch.var):
        return _variance(node)
    if node.op == "call_function" and key in _FULL_SIGNATURES:
        return _full_positional(node, *_FULL_SIGNATURES[key])
    if node.op == "call_method" and key in _CAST_METHODS:
        return _cast(node)
    if key in (torch.rms_norm,) and node.op == "call_function":
        names = ("input", "normalized_shape", "weight", "eps")
        full = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
        if set(kwargs) - set(names[len(args):]) or len(full) != len(args) + len(kwargs):
            return False
        full += [None] * (4 - len(full))
        if (node.args, node.kwargs) != (tuple(full), {}):
            _rewrite(node, torch.rms_norm, tuple(full))
            return True
    return False


def _reduction(node: fx.Node, fn: Any) -> bool:
    """``mean``/``sum`` with a dim -> ``fn(x, negative_dims_tuple, keepdim)``; no dtype argument."""
    x = node.args[0]
    xt = tensor_of(x)
    params = dict(zip(("dim", "keepdim"), node.args[1:]))
    if len(node.args) > 3 or set(node.kwargs) - {"dim", "keepdim"} or xt is None:
        return False
    params.update(node.kwargs)
    dim = params.get("dim")
    if dim is None:
        return False
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not all(isinstance(d, int) for d in dims):
        return False
    dims = tuple(d - xt.dim() if d >= 0 else d for d in dims)
    new_args = (x, dims, bool(params.get("keepdim", False)))
    if (node.op, node.target, node.args, dict(node.kwargs)) == ("call_function", fn, new_args, {}):
        return False
    _rewrite(node, fn, new_args)
    return True


def _variance(node: fx.Node) -> bool:
    """``x.var(...)`` / ``torch.var(...)`` over given dims -> ``variance(x, negative_dims_tuple, correction,
    keepdim)``. A full variance (no dim) and ``var(x, unbiased)`` keep their spelling."""
    xt = tensor_of(node.args[0]) if node.args else None
    if xt is None or len(node.args) > 4 or set(node.kwargs) - {"dim", "unbiased", "correction", "keepdim"}:
        return False
    params = dict(zip(("dim", "unbiased", "keepdim"), node.args[1:]))
    if set(params) & set(node.kwargs):
        return False
    params.update(node.kwargs)
    dim = params.get("dim")
    if not isinstance(dim, (int, list, tuple)) or isinstance(dim, bool) or {"unbiased", "correction"} <= set(params):
        return False
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not all(isinstance(d, int) for d in dims):
        return False
    correction = params.get("correction", 1 if params.get("unbiased", True) else 0)
    if not is_number(correction):
        return False
    _rewrite(node, variance, (node.args[0], tuple(d - xt.dim() if d >= 0 else d for d in dims), correction,
                              bool(params.get("keepdim", False))))
    return True


def _full_positional(node: fx.Node, names: tuple, defaults: tuple) -> bool:
    """``node`` with every parameter of ``names`` positional, the missing trailing ones at their
    ``defaults``. A keyword outside ``names`` (or given twice) keeps the node's spelling."""
    if len(node.args) > len(names) or set(node.kwargs) - set(names[len(node.args):]):
        return False
    full = dict(zip(names[len(names) - len(defaults):], defaults))
    full.update(zip(names, node.args))
    full.update(node.kwargs)
    if set(names) - set(full):
        return False  # a required parameter missing: not a call we understand
    args = tuple(full[n] for n in names)
    if (node.args, dict(node.kwargs)) == (args, {}):
        return False
    _rewrite(node, node.target, args)
    return True


def _cast(node: fx.Node) -> bool:
    """Every dtype-only conversion -> ``cast(x, dtype)``, or nothing when the dtype is unchanged."""
    x = node.args[0]
    xt, out = tensor_of(x), tensor_of(node)
    if xt is None or out is None or xt.device != out.device:
        return False
    if node.target == "to" and set(node.kwargs) - {"dtype", "non_blocking"}:
        return False  # copy=True, memory_format=...: more than a dtype change
    if node.target == "type" and (len(node.args) != 2 or node.kwargs):
        return False  # x.type() with no dtype returns a string
    if out.dtype == xt.dtype:
        node.replace_all_uses_with(x)
        node.graph.erase_node(node)
        return True
    _rewrite(node, cast, (x, out.dtype))
    return True


def _reads_layout(node: fx.Node) -> bool:
    """Whether ``node`` is a view whose success depends on its input's strides."""
    return (node.op == "call_method" and node.target == "view") or is_call(node, torch.Tensor.view)


def _no_op_removed(node: fx.Node) -> bool:
    """Drop views and ``.contiguous()`` that return their input's shape and layout unchanged."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    x = node.args[0]
    xt, out = tensor_of(x), tensor_of(node)
    if xt is None or out is None:
        return False
    if node.op == "call_method" and node.target == "contiguous":
        # Kept before a view, which needs the layout: a family pass may change the layout of what it reads
        # (afmoe: sloth.rope's contiguous q changes SDPA's output layout, and its transpose(1, 2) is then no
        # longer contiguous when .view(B, L, -1) reads it). Anywhere else a no-op .contiguous() is layout only.
        ok = not node.kwargs and _is_contiguous(xt) and not any(_reads_layout(u) for u in node.users)
    elif (node.op == "call_method" and node.target in _VIEW_METHODS) or is_call(node, *_VIEW_FUNCTIONS):
        ok = same_shape(xt, out) and xt.dtype == out.dtype  # x.view(torch.int32) reinterprets
    else:
        return False
    if ok:
        node.replace_all_uses_with(x)
        node.graph.erase_node(node)
    return ok


def _erase_if_dead(node: Any) -> None:
    if isinstance(node, fx.Node) and not node.users and is_call(node, *_PURE):
        node.graph.erase_node(node)


def _same_dtype(x: Any, node: fx.Node) -> bool:
    """True when ``node`` keeps its input's dtype (``int ** 2.0`` is float; ``square(int)`` is int)."""
    xt, out = tensor_of(x), tensor_of(node)
    return xt is not None and out is not None and xt.dtype == out.dtype


def _algebra(node: fx.Node) -> bool:
    """Equal-value rewrites between canonical ops (square, rsqrt, mean). True if rewritten."""
    if _neg_algebra(node):
        return True
    if _silu_algebra(node) or _gelu_formula(node):  # activations (section below)
        return True
    a = node.args
    if is_call(node, torch.pow) and is_number(a[1]) and _same_dtype(a[0], node):
        new = {2: torch.square, 0.5: torch.sqrt, -0.5: torch.rsqrt}.get(a[1])
        if new is not None:
            _rewrite(node, new, (a[0],))
            return True
    if is_call(node, torch.mul) and isinstance(a[0], fx.Node) and a[0] is a[1]:
        _rewrite(node, torch.square, (a[0],))
        return True
    if is_call(node, torch.reciprocal) and is_call(a[0], torch.sqrt):
        sqrt = a[0]
        _rewrite(node, torch.rsqrt, (sqrt.args[0],))
        _erase_if_dead(sqrt)
        return True
    if is_call(node, torch.div) and is_number(a[0]) and a[0] == 1 and isinstance(a[1], fx.Node):
        _rewrite(node, torch.reciprocal, (a[1],))
        return True
    if is_call(node, torch.div) and isinstance(a[0], fx.Node) and is_call(a[1], torch.sqrt):
        sqrt = a[1]
        rsqrt = insert_call(node.graph, node, torch.rsqrt, (sqrt.args[0],), meta_from=sqrt)
        _rewrite(node, torch.mul, (a[0], rsqrt))
        _erase_if_dead(sqrt)
        return True
    if is_call(node, torch.div, torch.mul) and is_number(a[1]) and is_call(a[0], torch.sum):
        return _sum_to_mean(node)
    return False


def _sum_to_mean(node: fx.Node) -> bool:
    """``sum(x, dims, k) / N`` or ``* (1/N)`` with N the number of reduced elements -> ``mean``."""
    total = node.args[0]
    if len(total.args) != 3 or not isinstance(total.args[1], tuple):
        return False  # a full sum, or one with dtype=: not the canonical sum over dims
    x, dims, keepdim = total.args
    xt = tensor_of(x)
    if xt is None or not xt.is_floating_point() or len(total.users) != 1:
        return False
    count = 1
    for d in dims:
        size = xt.shape[d]
        if not isinstance(size, int):
            return False
        count *= size
    factor = node.args[1]
    if (node.target is torch.div and factor == count) or (node.target is torch.mul and factor == 1.0 / count):
        _rewrite(node, torch.mean, (x, dims, keepdim))
        node.graph.erase_node(total)
        return True
    return False


# ---------------------------------------------------------------------------------------------------
# Slices along one dim and concatenation (RoPE's rotate_half; any pattern that splits a dim)
# ---------------------------------------------------------------------------------------------------

_SPLITS = {"chunk": "chunk", torch.chunk: "chunk", "split": "split", torch.split: "split"}
_CATS = (torch.cat, torch.concat, torch.concatenate)


def _neg_dim(dim: Any, ndim: int) -> Any:
    """``dim`` as a negative int, or None when it is not a static int in range."""
    if not isinstance(dim, int) or isinstance(dim, bool) or not -ndim <= dim < ndim:
        return None
    return dim - ndim if dim >= 0 else dim


def _narrow_or_removed(node: fx.Node, x: fx.Node, dim: int, start: int, length: int) -> bool:
    """Make ``node`` the canonical ``torch.narrow(x, dim, start, length)``, or drop it if it takes everything."""
    if start == 0 and length == tensor_of(x).shape[dim]:
        node.replace_all_uses_with(x)
        node.graph.erase_node(node)
        return True
    if (node.op, node.target, node.args, dict(node.kwargs)) == ("call_function", torch.narrow,
                                                                 (x, dim, start, length), {}):
        return False
    _rewrite(node, torch.narrow, (x, dim, start, length))
    return True


def _slice_spelling(node: fx.Node) -> bool:
    """``x[..., a:b]``, ``x[:, :, a:b]``, ``x.narrow(d, a, n)``, ``x.chunk(n, d)[i]``, ``x.split(s, d)[i]``
    -> ``torch.narrow(x, negative d, start, length)``: the same view. True if rewritten.

    Only unit-step slices of static bounds along a single dim; anything else keeps its spelling. A slice
    that takes the whole dim is the tensor itself and is removed, like the no-op views above.
    """
    key = _key(node)
    if key is None or getattr(node, "_erased", False):
        return False
    if key in _SPLITS:
        return _split_to_narrows(node, _SPLITS[key])
    xt = tensor_of(node.args[0]) if node.args else None
    if xt is None or tensor_of(node) is None:
        return False
    x = node.args[0]
    if key in ("narrow", torch.narrow) and len(node.args) + len(node.kwargs) == 4:
        params = dict(zip(("input", "dim", "start", "length"), node.args), **node.kwargs)
        dim, start, length = _neg_dim(params.get("dim"), xt.dim()), params.get("start"), params.get("length")
        if dim is None or not all(isinstance(v, int) for v in (start, length)) or not isinstance(xt.shape[dim], int):
            return False
        if start < 0:
            start += xt.shape[dim]
        return _narrow_or_removed(node, x, dim, start, length)
    if key is not operator.getitem or node.kwargs or not (isinstance(node.args[1], (slice, tuple))
                                                          or node.args[1] is Ellipsis):
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if index.count(Ellipsis) > 1 or not all(isinstance(i, slice) or i is Ellipsis for i in index):
        return False  # ints, None (new axes), tensors: not a plain slice
    slices = [i for i in index if i is not Ellipsis]
    if len(slices) > xt.dim():
        return False
    if Ellipsis in index:
        at = index.index(Ellipsis)
        full = index[:at] + (slice(None),) * (xt.dim() - len(slices)) + index[at + 1:]
    else:
        full = index + (slice(None),) * (xt.dim() - len(index))
    picked = [(d, s) for d, s in enumerate(full) if s != slice(None)]
    if len(picked) > 1:
        return False
    if not picked:  # x[...], x[:, :]: the tensor itself
        node.replace_all_uses_with(x)
        node.graph.erase_node(node)
        return True
    d, s = picked[0]
    size = xt.shape[d]
    if not isinstance(size, int) or not all(v is None or isinstance(v, int) for v in (s.start, s.stop, s.step)):
        return False
    start, stop, step = s.indices(size)
    if step != 1:
        return False
    return _narrow_or_removed(node, x, d - xt.dim(), start, max(0, stop - start))


def _split_to_narrows(node: fx.Node, kind: str) -> bool:
    """Each ``getitem(chunk/split(x, ...), i)`` user -> ``torch.narrow`` of x; the split goes once unused."""
    names = ("input", "chunks" if kind == "chunk" else "split_size_or_sections", "dim")
    params = dict(zip(names, node.args), **node.kwargs)
    x = params.get("input")
    xt = tensor_of(x)
    if xt is None or set(params) - set(names) or names[1] not in params:
        return False
    dim = _neg_dim(params.get("dim", 0), xt.dim())
    if dim is None or not isinstance(xt.shape[dim], int):
        return False
    size, arg = xt.shape[dim], params[names[1]]
    if kind == "chunk":
        if not isinstance(arg, int) or arg < 1:
            return False
        step = -(-size // arg) if size else 0
        lengths = [min(step, size - i) for i in range(0, size, step)] if step else [0]
    elif isinstance(arg, int) and arg > 0:
        lengths = [min(arg, size - i) for i in range(0, size, arg)] or [0]
    elif isinstance(arg, (list, tuple)) and all(isinstance(v, int) for v in arg) and sum(arg) == size:
        lengths = list(arg)
    else:
        return False
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    changed = False
    for user in list(node.users):
        if (user.op == "call_function" and user.target is operator.getitem and not user.kwargs
                and isinstance(user.args[1], int) and -len(lengths) <= user.args[1] < len(lengths)):
            i = user.args[1] % len(lengths)
            changed |= _narrow_or_removed(user, x, dim, starts[i], lengths[i])
    if not node.users:
        node.graph.erase_node(node)
        changed = True
    return changed


def _cat_spelling(node: fx.Node) -> bool:
    """``torch.cat/concat/concatenate(tensors, dim=d)`` -> ``torch.cat([tensors], negative d)``."""
    if node.op != "call_function" or node.target not in _CATS or tensor_of(node) is None:
        return False
    params = dict(zip(("tensors", "dim"), node.args), **node.kwargs)
    if set(params) - {"tensors", "dim", "axis"} or not isinstance(params.get("tensors"), (list, tuple)):
        return False
    dim = _neg_dim(params.get("dim", params.get("axis", 0)), tensor_of(node).dim())
    if dim is None:
        return False
    new_args = (list(params["tensors"]), dim)
    if (node.target, node.args, dict(node.kwargs)) == (torch.cat, new_args, {}):
        return False
    _rewrite(node, torch.cat, new_args)
    return True


def _neg_algebra(node: fx.Node) -> bool:
    """``x * -1`` / ``-1 * x`` -> ``torch.neg(x)`` (exact in floating point, dtype kept)."""
    if not is_call(node, torch.mul):
        return False
    a, b = node.args
    x = a if (is_number(b) and b == -1) else b if (is_number(a) and a == -1) else None
    if not isinstance(x, fx.Node) or not _same_dtype(x, node) or not same_shape(tensor_of(x), tensor_of(node)):
        return False
    _rewrite(node, torch.neg, (x,))
    return True


# ---------------------------------------------------------------------------------------------------
# Activations: SiLU and GELU, however they are spelled (gated MLPs)
# ---------------------------------------------------------------------------------------------------

def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """The one canonical GELU; ``approximate`` is "none" (erf) or "tanh", always given positionally.

    ``F.gelu`` takes ``approximate`` only as a keyword, and canonical nodes carry no keywords.
    """
    return torch.nn.functional.gelu(x, approximate=approximate)


_SILUS = (torch.nn.functional.silu, torch._C._nn.silu)
_RELUS = (torch.nn.functional.relu, torch.relu, "relu")
_SIGMOIDS = (torch.sigmoid, torch.nn.functional.sigmoid, torch.special.expit)
_GELUS = (torch.nn.functional.gelu,)  # F.gelu is torch._C._nn.gelu itself
_ERFS = ("erf", torch.erf, torch.special.erf)
_GELU_TANH_INNER = {1: math.sqrt(2 / math.pi), 3: math.sqrt(2 / math.pi) * 0.044715}  # z = k * (x + c * x^3)
_GELU_ERF_INNER = {1: math.sqrt(0.5)}                                                 # z = x / sqrt(2)
_GELU_OUTER = {(1, 0): 0.5, (1, 1): 0.5}                                              # 0.5 * x * (1 + t)


def _activation_spelling(node: fx.Node) -> bool:
    """``F.silu(x, inplace=False)``, ``nn.SiLU``, ``torch._C._nn.silu`` -> ``F.silu(x)``; ``F.gelu(x,
    approximate=a)``, ``nn.GELU`` -> ``gelu(x, a)``; ``x.erf()``, ``torch.special.erf`` -> ``torch.erf``;
    ``F.relu(x, inplace=False)``, ``nn.ReLU``, ``x.relu()`` -> ``torch.relu(x)``."""
    key = _key(node)
    if key is None or tensor_of(node) is None or not node.args:
        return False
    if key in _RELUS:
        params = dict(zip(("input", "inplace"), node.args), **node.kwargs)
        if set(params) - {"input", "inplace"} or params.get("inplace"):
            return False  # in place: a mutation of the input, not just a value
        canonical = ("call_function", torch.relu, (params["input"],), {})
        if (node.op, node.target, node.args, dict(node.kwargs)) == canonical:
            return False
        _rewrite(node, torch.relu, (params["input"],))
        return True
    if node.op == "call_function" and key in _SILUS:
        params = dict(zip(("input", "inplace"), node.args), **node.kwargs)
        if set(params) - {"input", "inplace"} or params.get("inplace"):
            return False  # in place: a mutation of the input, not just a value
        if (node.target, node.args, dict(node.kwargs)) == (torch.nn.functional.silu, (params["input"],), {}):
            return False
        _rewrite(node, torch.nn.functional.silu, (params["input"],))
        return True
    if node.op == "call_function" and key in _GELUS:
        approximate = node.kwargs.get("approximate", "none")
        if len(node.args) != 1 or set(node.kwargs) - {"approximate"} or approximate not in ("none", "tanh"):
            return False
        _rewrite(node, gelu, (node.args[0], approximate))
        return True
    if key in _ERFS and len(node.args) == 1 and not node.kwargs:
        if (node.op, node.target) == ("call_function", torch.erf):
            return False
        _rewrite(node, torch.erf, (node.args[0],))
        return True
    return False


def _exact_source(node: Any) -> Any:
    """``node`` with its exact casts stripped (a float widened, bf16/fp16 -> fp32 -> fp64): the node whose value,
    as a real number, it holds."""
    while is_call(node, cast):
        src, dst = tensor_of(node.args[0]), tensor_of(node)
        if src is None or dst is None or not src.dtype.is_floating_point or not dst.dtype.is_floating_point \
                or torch.promote_types(src.dtype, dst.dtype) != dst.dtype:
            return node
        node = node.args[0]
    return node


def _silu_algebra(node: fx.Node) -> bool:
    """``x * sigmoid(x)`` / ``sigmoid(x) * x`` -> ``F.silu(x)`` (one rounding where the product had two).

    The two x may be casts of one value, as ``g * torch.sigmoid(g.float())`` or ``g.float() * g.float().sigmoid()``
    (two cast nodes) write it: exact widenings, so the silu reads the one in the product's dtype. Where only the
    product is wide (``g.float() * torch.sigmoid(g)``) the bf16 rounding of the sigmoid is one rounding fewer."""
    if not is_call(node, torch.mul):
        return False
    a, b = node.args
    out = tensor_of(node)
    for x, s in ((a, b), (b, a)):
        if not (isinstance(x, fx.Node) and is_call(s, *_SIGMOIDS) and len(s.args) == 1 and out is not None):
            continue
        y = s.args[0]
        if not (isinstance(y, fx.Node) and _exact_source(x) is _exact_source(y)):
            continue
        arg = next((t for t in (x, y) if _same_dtype(t, node) and same_shape(tensor_of(t), out)), None)
        if arg is None:
            continue
        _rewrite(node, torch.nn.functional.silu, (arg,))
        if not s.users:  # any of _SIGMOIDS (only torch.sigmoid is in _PURE)
            node.graph.erase_node(s)
        _erase_if_dead(y)
        return True
    return False


def _poly(e: Any, x: fx.Node, t: Any, depth: int = 0) -> Any:
    """``e`` as a polynomial in the nodes x and t, ``{(power of x, power of t): coefficient}``, or None
    when e reads anything else (or is deeper than any GELU formula)."""
    if is_number(e):
        return {(0, 0): float(e)} if e else {}
    if e is x:
        return {(1, 0): 1.0}
    if e is t:
        return {(0, 1): 1.0}
    if depth > 12 or not isinstance(e, fx.Node) or tensor_of(e) is None:
        return None
    a = e.args
    if is_call(e, torch.add, torch.sub, torch.mul) or (is_call(e, torch.div) and is_number(a[1]) and a[1]):
        p, q = _poly(a[0], x, t, depth + 1), _poly(a[1], x, t, depth + 1)
        if p is None or q is None:
            return None
        if e.target is torch.mul:
            return _poly_mul(p, q)
        if e.target is torch.div:
            return {k: v / a[1] for k, v in p.items()}
        sign = 1.0 if e.target is torch.add else -1.0
        out = dict(p)
        for k, v in q.items():
            out[k] = out.get(k, 0.0) + sign * v
        return {k: v for k, v in out.items() if v}
    if is_call(e, torch.neg, torch.square) or (is_call(e, torch.pow) and a[1] in (1, 2, 3)):
        p = _poly(a[0], x, t, depth + 1)
        if p is None:
            return None
        if e.target is torch.neg:
            return {k: -v for k, v in p.items()}
        out = p
        for _ in range((2 if e.target is torch.square else int(a[1])) - 1):
            out = _poly_mul(out, p)
        return out
    return None


def _poly_mul(p: dict, q: dict) -> dict:
    out: dict = {}
    for (i, j), v in p.items():
        for (k, m), w in q.items():
            out[(i + k, j + m)] = out.get((i + k, j + m), 0.0) + v * w
    return {k: v for k, v in out.items() if v}


def _poly_equals(p: Any, want: dict) -> bool:
    """Same terms, coefficients within fp32's rounding (1e-7): HF's FastGELU writes k as 0.7978845608."""
    return p is not None and p.keys() == want.keys() and all(abs(p[k] - w) <= 1e-7 * abs(w) for k, w in want.items())


def _gelu_formula(node: fx.Node) -> bool:
    """A GELU written out, ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))`` or ``0.5 * x *
    (1 + erf(x / sqrt(2)))``, in any arrangement of the same polynomials -> ``gelu(x, "tanh" / "none")``.

    Anchored at the tanh (erf): its argument must be k*x + k*c*x^3 (x/sqrt(2)) in one node x, and a chain
    of single-user arithmetic above it must reach 0.5*x + 0.5*x*t. That node becomes the gelu; the rest
    goes once unused. One rounding where the formula rounded at every step.
    """
    if is_call(node, torch.tanh):
        inner, approximate = _GELU_TANH_INNER, "tanh"
    elif is_call(node, torch.erf):
        inner, approximate = _GELU_ERF_INNER, "none"
    else:
        return False
    # x is some node inside the argument (itself possibly arithmetic, e.g. a LoRA sum): try each.
    seen, stack, x = set(), [node.args[0]], None
    while stack and x is None:
        cand = stack.pop()
        if not isinstance(cand, fx.Node) or cand in seen or len(seen) > 16:
            continue
        seen.add(cand)
        p = _poly(node.args[0], cand, node)  # node (t) cannot occur in its own argument
        if p is not None and all(j == 0 for _, j in p) and _poly_equals({i: v for (i, _), v in p.items()}, inner):
            x = cand
        stack += cand.all_input_nodes
    xt = tensor_of(x)
    if xt is None or not xt.is_floating_point():
        return False
    root, cur = None, node
    for _ in range(8):
        cur = next(iter(cur.users)) if len(cur.users) == 1 else None
        p = _poly(cur, x, node) if cur is not None else None
        if p is None:
            return False
        if _poly_equals(p, _GELU_OUTER):
            root = cur
            break
    rt = tensor_of(root)
    if root is None or rt is None or rt.dtype != xt.dtype or not same_shape(rt, xt):
        return False
    inputs = root.all_input_nodes
    _rewrite(root, gelu, (x, approximate))
    _erase_dead_arithmetic(inputs)
    return True


def _erase_dead_arithmetic(nodes: list) -> None:
    """Erase nodes left without users, and what only they read, as long as they are pure arithmetic."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if isinstance(n, fx.Node) and not n.users and is_call(n, *_PURE, torch.erf):
            stack += n.all_input_nodes
            n.graph.erase_node(n)


def canonicalize_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                      options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Rewrite every node into its canonical spelling (see the module docstring). Values unchanged."""
    graph = gm.graph
    for node in list(graph.nodes):
        if not _no_op_removed(node):
            _spelling(node)
    # Algebra runs to a fixed point: one rewrite can enable another (pow -> square -> mean of square).
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node.op == "call_function":
                changed |= _algebra(node)
    graph.lint()
    gm.recompile()
    return gm

