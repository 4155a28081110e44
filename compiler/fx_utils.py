"""Small helpers over Dynamo's FX graphs: node values, static shape facts, source locations.

Dynamo records each node's fake value under ``meta["example_value"]`` (AOT-level graphs use
``meta["val"]``); passes read dtypes and shapes from there and write it on every node they insert, so
the next pass can read them too.
"""
from __future__ import annotations

import operator
import os
import re

from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true


def value_of(node: Any) -> Any:
    """The fake value a node stands for (a FakeTensor, SymInt, ...), or the constant itself."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def tensor_of(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor behind ``node``, or None when it is not a tensor (or has no recorded value)."""
    v = value_of(node)
    return v if isinstance(v, torch.Tensor) else None


def subgraphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """Graph bodies of higher-order ops (activation checkpointing, autograd.Function, cond, ...).

    Dynamo puts e.g. each gradient-checkpointed decoder layer into such a body; the passes rewrite
    them like the top-level graph. A rewrite there is safe for the same reason as at top level: it
    keeps every value the body returns, and an intermediate the body returns (say, one saved for a
    custom backward) has a user outside the pattern, which makes the guards say no.
    """
    return [m for name, m in gm.named_modules() if m is not gm and isinstance(m, fx.GraphModule)]


def matrix_width(node: object, dim: int) -> object:
    """Size ``dim`` of ``node``'s value when it is a 2-D tensor (a weight matrix), else None (may be symbolic)."""
    t = tensor_of(node)
    return None if t is None or t.dim() != 2 else t.shape[dim]


def dtype_of(node: Any) -> Optional[torch.dtype]:
    t = tensor_of(node)
    return t.dtype if t is not None else None


def same_size(a: Any, b: Any) -> bool:
    """True when two sizes (ints or SymInts) are equal for every shape this graph can see."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # a size expression the shape environment cannot decide
        return False


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(same_size(x, y) for x, y in zip(a.shape, b.shape))


def is_number(x: Any) -> bool:
    """A Python constant number baked into the graph (not a tensor, not a symbolic value)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def set_value(node: fx.Node, value: Any) -> None:
    node.meta["example_value"] = value


def compute_value(target: Callable, args: tuple, kwargs: Optional[dict] = None) -> Any:
    """Evaluate ``target`` on the fake values of its node arguments (for the meta of a new node)."""
    fargs = fx.node.map_arg(args, value_of)
    fkwargs = fx.node.map_arg(kwargs or {}, value_of)
    try:
        return target(*fargs, **fkwargs)
    except Exception:  # a node without a recorded value; later guards then see "unknown" and say no
        return None


_UNSET = object()


def insert_call(graph: fx.Graph, before: fx.Node, target: Callable, args: tuple, kwargs: Optional[dict] = None,
                meta_from: Optional[fx.Node] = None, value: Any = _UNSET) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` before ``before``; its value is computed on fakes unless given.

    ``meta_from`` copies stack trace and module stack so the report can still point at the source.
    Pass ``value`` when running ``target`` on fakes would add a guard (a SymFloat argument to a custom
    op is specialised, which would make that float a recompile key).
    """
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs or {})
    src = meta_from or before
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in src.meta:
            node.meta[key] = src.meta[key]
    set_value(node, compute_value(target, args, kwargs) if value is _UNSET else value)
    return node


def is_grad_switch(node: fx.Node) -> bool:
    """``torch._C._set_grad_enabled(mode)``: what Dynamo writes where a ``no_grad`` or ``enable_grad`` block starts
    or ends."""
    return node.op == "call_function" and node.target is torch._C._set_grad_enabled


def grad_enabled_at(node: fx.Node) -> bool:
    """Whether autograd records the op at ``node``: the mode the nearest grad switch before it sets, else the mode
    the graph is entered in, which is the mode the backend runs in (Dynamo compiles a frame in its caller's mode,
    and guards on it)."""
    prev = node.prev
    while prev.op != "root":
        if is_grad_switch(prev):
            return bool(prev.args[0])
        prev = prev.prev
    return torch.is_grad_enabled()


def inherit_requires_grad(old: fx.Node, new: fx.Node) -> None:
    """Give ``new``'s fake value the ``requires_grad`` of ``old``'s, whose value it replaces.

    The passes make a fused node's value with ``new_empty`` (running the op on fakes could add guards),
    which drops requires_grad; a later pass reading it would then think no gradient flows here. Seen: the
    fused loss, reading its input x from the fused final RMSNorm, took x as needing no gradient and
    computed none in the forward, so the backward recomputed the N x V x H logits matmul.
    """
    old_t, new_t = tensor_of(old), tensor_of(new)
    if old_t is not None and new_t is not None and old_t.requires_grad and not new_t.requires_grad \
            and new_t.is_floating_point() and new_t.is_leaf:
        new_t.requires_grad_(True)


def replace_and_erase(old: fx.Node, new: fx.Node, keep: Iterable[Any]) -> set[fx.Node]:
    """Point ``old``'s users at ``new``, then erase what fed only ``old``, walking back from it.

    Nodes in ``keep`` (the fused op's inputs), placeholders and anything impure stay. Returns the
    erased nodes, so a pass iterating over a snapshot of the graph can skip them. ``new``'s value takes
    ``old``'s requires_grad (``inherit_requires_grad``).
    """
    inherit_requires_grad(old, new)
    old.replace_all_uses_with(new)
    return erase_unused(old, keep)


def erase_unused(node: fx.Node, keep: Iterable[Any], methods: bool = False) -> set[fx.Node]:
    """Erase ``node`` if nothing reads it, and then what fed only it, walking back (``keep``, placeholders and
    anything impure stay); the erased nodes. ``methods``: tensor method calls too (``lsm.gather(...)``), but not an
    in-place one (a name ending in ``_``)."""
    graph, keep = node.graph, set(keep)
    erased: set[fx.Node] = set()
    stack = [node]
    while stack:
        node = stack.pop()
        erasable = node.op == "call_function" or methods and node.op == "call_method" and not str(
            node.target).endswith("_")
        if node in erased or node in keep or node.users or not erasable or node.is_impure():
            continue
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)
        stack += inputs
    return erased


def single_user(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def is_call(node: Any, *targets: Callable) -> bool:
    """A ``call_function`` of one of ``targets`` in canonical form: positional arguments only.

    Canonical nodes never carry keywords, so a node that still does (``torch.add(a, b, alpha=2)``,
    ``torch.mean(x, -1, dtype=...)``) is one canonicalisation left alone on purpose, and no pattern
    may read it as the plain op.
    """
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets
            and not node.kwargs)


def is_function(node: Any, *targets: Callable) -> bool:
    """A ``call_function`` of one of ``targets``, keywords allowed (unlike ``is_call``): for patterns that read
    calls canonicalisation leaves as written (softmax, topk)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def is_method(node: Any, *names: str) -> bool:
    """A ``call_method`` of one of ``names``."""
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def is_attention_backward(node: fx.Node) -> bool:
    """An attention kernel's backward in a backward graph, by its op's name: SDPA's per-kernel ops (cuDNN, flash,
    efficient, the CPU's), FlexAttention's, or one of sloth's (sink and document attention)."""
    name = str(node.target)
    return node.op == "call_function" and "attention" in name and "backward" in name


def arg_of(node: fx.Node, position: int, name: str, default: Any = None) -> Any:
    """The argument of ``node`` at ``position``, or passed as keyword ``name``, else ``default``."""
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def is_last_dim(dim: Any, ndim: int) -> bool:
    """``dim`` names the last of ``ndim`` dims (-1 or ndim - 1)."""
    return isinstance(dim, int) and dim in (-1, ndim - 1)


_SOFTMAX = (torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax)


def softmax_input(node: Any) -> Optional[fx.Node]:
    """The input of ``node`` when it is a softmax over the last dim (function or method, any dtype argument),
    else None."""
    if not (is_function(node, *_SOFTMAX) or is_method(node, "softmax")) or not node.args:
        return None
    value = tensor_of(node.args[0])
    if value is None or not is_last_dim(arg_of(node, 1, "dim"), value.dim()):
        return None
    return node.args[0]


_TORCH_DIR = os.path.dirname(torch.__file__)


def source_location(node: fx.Node) -> str:
    """``file.py:LINE  code`` of the innermost frame outside torch that produced ``node`` ('' if unknown).

    Frames inside torch itself (``F.rms_norm``, ``nn.RMSNorm.forward``) are skipped so the report points
    at the user's model code.
    """
    trace = node.meta.get("stack_trace") or ""
    lines = trace.rstrip().splitlines()
    fallback = ""
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].strip()
        if line.startswith('File "'):
            path, _, rest = line[len('File "'):].partition('", line ')
            lineno = rest.split(",")[0]
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            where = f"{os.path.basename(path)}:{lineno}  {code}"
            if not path.startswith(_TORCH_DIR):
                return where
            fallback = fallback or where
    return fallback


def module_path(node: fx.Node) -> str:
    """The dotted path of the innermost nn.Module that produced ``node`` ('' if unknown)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # Dynamo spells the root module after forward's first argument, e.g. L['self'].model.layers[0],
    # or L['args'][0].model... when a decorator wraps forward(*args).
    path = re.sub(r"^L\['[^']+'\](\[\d+\])?\.?", "", path)
    # Modules reached through __getattr__ (peft's wrappers) are spelled through their __dict__:
    # __dict__['_modules']['base_model'].model -> base_model.model.
    path = re.sub(r"__dict__\['_modules'\]\['([^']+)'\]", r"\1", path)
    return re.sub(r"\.?_modules\['([^']+)'\]", r".\1", path).lstrip(".")


_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


def _transposed_weight(node: Any) -> Optional[fx.Node]:
    """w when ``node`` is ``w.t()``, ``torch.t(w)`` or ``w.T`` of a 2-D w (a weight written as a matmul)."""
    if not isinstance(node, fx.Node) or node.kwargs:
        return None
    is_t = ((node.op == "call_method" and node.target == "t" and len(node.args) == 1)
            or (node.op == "call_function" and node.target is torch.t and len(node.args) == 1)
            or (node.op == "call_function" and node.target is getattr and node.args[1:] == ("T",)))
    w = node.args[0] if is_t else None
    wt = tensor_of(w)
    return w if wt is not None and wt.dim() == 2 else None


def linear_parts(node: Any) -> Optional[tuple[Any, Any, Any]]:
    """(x, w, bias) when ``node`` is ``F.linear(x, w, bias)`` or ``x @ w.t()`` (bias None), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target in _LINEARS:
        largs = dict(zip(("input", "weight", "bias"), node.args), **node.kwargs)
        return largs.get("input"), largs.get("weight"), largs.get("bias")
    if node.target in (operator.matmul, torch.matmul) and len(node.args) == 2 and not node.kwargs:
        x, w = node.args[0], _transposed_weight(node.args[1])
        xt = tensor_of(x)
        if w is not None and xt is not None and xt.dim() >= 1:
            return x, w, None
    return None


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


def without_eps(node: object) -> object:
    """The operand of ``v + c`` that is a node, when the other is not (a constant or a scalar eps)."""
    if is_call(node, torch.add) and len(node.args) == 2:
        a, b = node.args
        return a if tensor_of(b) is None else b if tensor_of(a) is None else node
    return node


def ancestors(node: fx.Node, stop: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """Every node ``node`` reads, directly or through others; a node in ``stop`` is included but not walked past."""
    stop = set(stop)
    seen, stack = set(), [node]
    while stack:
        for source in stack.pop().all_input_nodes:
            if source not in seen:
                seen.add(source)
                if source not in stop:
                    stack.append(source)
    return seen


def descendants(node: fx.Node) -> set[fx.Node]:
    """Every node that reads ``node``, directly or through others (its users, their users, ...)."""
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen
