"""Linear + cross-entropy family (``"cross_entropy"`` in the report): the pattern, its variants, its guard,
its replacement.

The meaning, as plain PyTorch (these functions are also the test oracle and the eager benchmark
baseline)::

    linear_cross_entropy_pattern(x, w, b, labels, ...)   F.linear, upcast, scale, softcap, F.cross_entropy
    causal_lm_loss_pattern(h, w, labels, ...)            transformers' ForCausalLMLoss after the lm_head

Variants matched on the canonical graph (see compiler/canonicalize.py), whatever module wrote them:

    l   = linear(x, w, b)  or  x @ w.t() / x @ w.T         x [..., H], w [V, H], b [V] or None
    z   = chain of single-user steps after l, in order:    casts to float32 (exact widenings), a logit
                                                           scale (``* s``, ``/ s``), a softcap
                                                           (``a * tanh(z / d)``, ``tanh(z * k)``, either
                                                           operand order), and views/reshapes that keep
                                                           V the last dim, anywhere, ending in [N, V]
    out = F.cross_entropy(z, labels, ignore_index=ii, reduction=r, label_smoothing=eps), or
          F.nll_loss(log_softmax(z, -1), labels, ignore_index=ii, reduction=r)  (any log_softmax spelling);
          labels int64 [N] from any producer (transformers' ``pad(labels, (0, 1), value=-100)[..., 1:]``)

The replacement is ``sloth.linear_cross_entropy(x.flatten(0, -2), w, b, labels, ...)[0]`` (lowering/
linear_cross_entropy.py), which computes the logits chunk by chunk in fp32 after the matmul, so it is at
least as accurate as every variant above (a bf16 softcap that eager rounds is exact here); a loss of another
dtype than float32 is cast back. What follows the loss (``/ num_items_in_batch``) stays in the graph.

Logits with another user (returned to the caller, as every transformers ``*ForCausalLM`` does, or logged)
still fuse: the loss becomes the sloth op and the chain nodes the other user reads stay, in the model's
dtype, so the outputs are exact ("logits also returned (kept)"). The op then reads the projection the graph
computes anyway (``logits=``) instead of recomputing it chunk by chunk, so the step pays one lm_head matmul
and one for dx, as ``return_logits=False`` does, not three; autograd adds the graph's own linear's gradient to
the op's when the returned logits are differentiated too. ``options={"return_logits": False}``
returns an empty tensor in their place when being returned is their only other use, so they are never
computed ("return_logits=False: logits not returned").

Left as it was, with the reason: logits read elsewhere after a widening cast (an fp32 copy), class weights (``weight=``), the legacy ``size_average``/``reduce``,
float64, soft (probability) targets, a cast to a narrower dtype or a second tanh in the logits' chain, a
non-constant ignore_index or smoothing, a log_softmax over another dim or with other users, and any loss
that does not read a linear's logits (every F.cross_entropy / F.nll_loss is an anchor: compiler/anchors.py).
Not matched at all (no near-miss): the manual ``-log_softmax(z).gather(-1, y)`` form (its ignore_index is a
mask written by hand).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.canonicalize import cast
from ..compiler.fx_utils import (insert_call, is_call, is_number, linear_parts, module_path, replace_and_erase,
                                 same_size, set_value, source_location, tensor_of)
from ..compiler import returned_logits
from ..compiler.options import PassOptions
from ..compiler.report import Report, Site

FAMILY = "cross_entropy"

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CROSS_ENTROPY = (F.cross_entropy,)
_NLL_LOSS = (F.nll_loss,)
_VIEW_METHODS = ("view", "reshape", "flatten")
_VIEW_FUNCTIONS = (torch.reshape, torch.flatten)
_CE_PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
_NLL_PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
_CE_DEFAULTS = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean",
                "label_smoothing": 0.0}


def _lowering():
    """The kernel module, imported on first use (see patterns/rms_norm.py for why)."""
    from ..lowering import linear_cross_entropy

    return linear_cross_entropy


def linear_cross_entropy_pattern(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], labels: torch.Tensor,
                                 ignore_index: int = -100, reduction: str = "mean", softcap: float = 0.0,
                                 logit_scale: float = 1.0, label_smoothing: float = 0.0) -> torch.Tensor:
    """The lm_head and its loss: logits in fp32, scaled, softcapped, then ``F.cross_entropy`` over rows."""
    z = F.linear(x, w, b).float() * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z.view(-1, z.shape[-1]), labels.view(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)


def causal_lm_loss_pattern(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                           num_items_in_batch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` after the lm_head: upcast, shift the labels left (padding with
    -100), ``sum / num_items_in_batch`` when given, else the mean over non-ignored tokens."""
    logits = F.linear(h, w).float()
    shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), shift_labels.view(-1), ignore_index=-100,
                           reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


@dataclasses.dataclass
class CrossEntropyMatch:
    """A matched site: ``out`` equals ``sloth.linear_cross_entropy(x.flatten(0, -2), w, bias, labels, ...)``."""
    x: fx.Node
    w: fx.Node
    bias: Optional[fx.Node]
    labels: fx.Node
    ignore_index: int
    reduction: str
    softcap: float
    logit_scale: float
    label_smoothing: float
    out: fx.Node
    linear: fx.Node  # the projection, x @ w.T + bias in the model's dtype
    shared: list[fx.Node]  # chain nodes that other users also read: they stay (see _shared_logits)
    loss_path: set[fx.Node]  # the nodes from the linear to the loss, the loss included


def _ce_params(node: fx.Node) -> Union[dict[str, Any], str, None]:
    """The loss's arguments by name, defaults filled in, as F.cross_entropy would take them.

    ``F.nll_loss(log_softmax(z, -1), y, ...)`` is read as ``F.cross_entropy(z, y, ...)``: the same value.
    None for a spelling it cannot be; str for a manual form that differs (and why).
    """
    names = _CE_PARAMS if node.target in _CROSS_ENTROPY else _NLL_PARAMS
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        return None
    params = dict(_CE_DEFAULTS, **dict(zip(names, node.args)), **node.kwargs)
    if "input" not in params or "target" not in params:
        return None
    if node.target in _NLL_LOSS:
        logits = _log_softmax_input(params["input"])
        if not isinstance(logits, fx.Node):
            return logits
        params["input"] = logits
    return params


def _log_softmax_input(node: Any) -> Union[fx.Node, str, None]:
    """z when ``node`` is ``log_softmax(z)`` over the last dim (any spelling) with no other user."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    if node.target not in (F.log_softmax, torch.log_softmax, "log_softmax"):
        return None
    params = dict(zip(("input", "dim", "_stacklevel" if node.target is F.log_softmax else "dtype"), node.args),
                  **node.kwargs)
    z, zt = params.get("input"), tensor_of(params.get("input"))
    if zt is None or set(params) - {"input", "dim", "_stacklevel", "dtype"} or _chain_to_linear(z) is None:
        return None  # not log-probabilities of a linear's logits: not this family
    if params.get("dtype") not in (None, torch.float32) or zt.dtype not in _KERNEL_DTYPES:
        return f"log_softmax computes in {params.get('dtype') or zt.dtype}, not float32/bfloat16/float16"
    if params.get("dim") not in (-1, zt.dim() - 1):
        return f"log_softmax is over dim {params.get('dim')}, not the vocabulary (last) dim"
    if len(node.users) != 1:
        return "the log-probabilities have other users, so they must be materialised"
    return z


def _is_view(node: Any) -> bool:
    return isinstance(node, fx.Node) and ((node.op == "call_method" and node.target in _VIEW_METHODS)
                                          or (node.op == "call_function" and node.target in _VIEW_FUNCTIONS))


def _chain_to_linear(start: Any) -> Union[tuple[fx.Node, tuple[Any, Any, Any], list[fx.Node]], None]:
    """(projection node, its (x, w, bias), the steps from it to ``start`` in forward order), or None when
    ``start`` does not come from a linear through casts, views, scalar multiplies/divides and tanh only."""
    steps: list[fx.Node] = []
    node = start
    while isinstance(node, fx.Node):
        projection = linear_parts(node)
        if projection is not None:
            return node, projection, steps[::-1]
        if is_call(node, cast) or _is_view(node) or is_call(node, torch.tanh):
            steps.append(node)
            node = node.args[0]
        elif is_call(node, torch.mul, torch.div):
            a, b = node.args
            steps.append(node)
            if is_number(b) and isinstance(a, fx.Node):
                node = a
            elif node.target is torch.mul and is_number(a) and isinstance(b, fx.Node):
                node = b
            else:
                return None
        else:
            return None
    return None


def _shared_logits(linear: fx.Node, steps: list[fx.Node]) -> Union[list[fx.Node], str]:
    """The nodes of the logits' chain that something besides the loss also reads (they stay in the graph),
    or why they cannot stay.

    The loss reads the chain through each node's one successor, so a node with more than one user is also
    read elsewhere (returned, as every transformers ``*ForCausalLM`` does, or logged). Such a node stays,
    computed as the graph computes it, as long as it is in the model's dtype: one after a widening cast is
    the fp32 copy of the logits (4 bytes a logit, 2x a bf16 model's) that the fused kernel exists to avoid.
    """
    chain = [linear, *steps]
    shared = [node for node in chain if len(node.users) > 1]
    if not shared:
        return []
    last = chain.index(shared[-1])
    for node in chain[:last + 1]:
        if is_call(node, cast) and (tensor_of(node.args[0]) is None
                                    or tensor_of(node.args[0]).dtype != tensor_of(node).dtype):
            return ("the logits are also returned or used elsewhere after the upcast to "
                    f"{tensor_of(node).dtype}, so that copy must be materialised; only logits in the "
                    "model's dtype can be kept beside the fused loss")
    return shared


def _scale_and_softcap(linear: fx.Node, steps: list[fx.Node], vocab: Any) -> Union[tuple[float, float], str]:
    """(softcap, logit_scale) of the steps after the linear, or why they are not a scale and a softcap.

    Before the tanh, numbers multiply the logits: ``z = k * l``; after it, ``z = a * tanh(k * l)``, which is
    ``c * tanh(s * l / c)`` with ``c = a`` and ``s = k * a``.
    """
    before, after, seen_tanh = 1.0, 1.0, False
    for step in steps:
        if is_call(step, cast):
            src, dst = tensor_of(step.args[0]), step.args[1]
            if src is None or dst != torch.float32 or src.dtype not in _KERNEL_DTYPES:
                return f"a cast to {dst} in the logits' chain (the fused kernel computes them in float32)"
        elif _is_view(step):
            out = tensor_of(step)
            if out is None or out.dim() < 1 or not same_size(out.shape[-1], vocab):
                return "a view of the logits moves the vocabulary dimension"
        elif is_call(step, torch.tanh):
            if seen_tanh:
                return "two tanh in the logits' chain"
            seen_tanh = True
        else:
            factor = float(step.args[1] if is_number(step.args[1]) else step.args[0])
            if factor == 0.0:
                return "the logits are multiplied or divided by zero"
            factor = 1.0 / factor if step.target is torch.div else factor
            if seen_tanh:
                after *= factor
            else:
                before *= factor
    if seen_tanh:
        return after, before * after
    return 0.0, before


def _match(ce: fx.Node) -> Union[CrossEntropyMatch, str, None]:
    """Match around an ``F.cross_entropy`` anchor. None: not fed by a linear; str: a near-miss and why."""
    params = _ce_params(ce)
    if not isinstance(params, dict):
        return params
    found = _chain_to_linear(params["input"])
    if found is None:
        return None  # a loss on logits that do not come from a linear: not this family
    linear, (x, w, bias), steps = found
    xt, wt, bt = tensor_of(x), tensor_of(w), tensor_of(bias)
    zt, yt = tensor_of(params["input"]), tensor_of(params["target"])
    if xt is None or wt is None or zt is None or yt is None or (bias is not None and bt is None):
        return "the shapes of the linear or the loss are unknown"
    if params["weight"] is not None:
        return "class weights (weight=) are not supported by the fused kernel"
    if params["size_average"] is not None or params["reduce"] is not None:
        return "the legacy size_average / reduce arguments are set"
    if params["reduction"] not in _lowering().REDUCTIONS:
        return f"reduction {params['reduction']!r} is not one of {_lowering().REDUCTIONS}"
    if not isinstance(params["ignore_index"], int) or isinstance(params["ignore_index"], bool):
        return "ignore_index is not a constant integer"
    if not is_number(params["label_smoothing"]):
        return "label_smoothing is not a constant number"
    if wt.dim() != 2 or zt.dim() != 2 or not same_size(zt.shape[-1], wt.shape[0]):
        return "the loss is not over [N, V] rows of the logits (a K-dimensional loss, or a vocabulary view)"
    if yt.dtype != torch.int64 or yt.dim() != 1:
        return f"the targets are {yt.dtype} of {yt.dim()} dims, not int64 class indices per row (soft targets)"
    if xt.dtype not in _KERNEL_DTYPES or wt.dtype != xt.dtype or (bt is not None and bt.dtype != xt.dtype):
        return (f"the linear computes in {xt.dtype} x {wt.dtype}; the fused kernel supports float32, bfloat16 "
                "and float16 with one dtype for input, weight and bias")
    if tensor_of(linear) is not None and tensor_of(linear).dtype != xt.dtype:
        # autocast: the projection runs in its dtype, which the fused op (no autocast casts) would not follow
        return (f"the linear's result is {tensor_of(linear).dtype} from {xt.dtype} inputs (autocast), and the fused "
                "kernel computes in its inputs' dtype")
    if tensor_of(ce) is None or tensor_of(ce).dtype not in _KERNEL_DTYPES:
        return "the loss is not float32, bfloat16 or float16"
    scaled = _scale_and_softcap(linear, steps, wt.shape[0])
    if isinstance(scaled, str):
        return scaled
    shared = _shared_logits(linear, steps)
    if isinstance(shared, str):
        return shared
    softcap, logit_scale = scaled
    return CrossEntropyMatch(x, w, bias, params["target"], params["ignore_index"], params["reduction"], softcap,
                             logit_scale, float(params["label_smoothing"]), ce, linear, shared,
                             {linear, *steps, *ce.all_input_nodes, ce})


def _drop_returned_logits(gm: fx.GraphModule, m: CrossEntropyMatch) -> bool:
    """Return an empty tensor in place of the logits when being returned is their only use besides the loss,
    so that nothing computes them (``return_logits=False``); False, changing nothing, otherwise."""
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    if any(user is not output and user not in m.loss_path for node in m.shared for user in node.users):
        return False  # also read by something other than the graph's output: the logits are computed anyway
    for node in m.shared:
        if output in node.users:
            with gm.graph.inserting_before(m.out):
                empty = gm.graph.call_method("new_empty", (m.x, (0,)), {"dtype": tensor_of(node).dtype})
            set_value(empty, tensor_of(m.x).new_empty(0, dtype=tensor_of(node).dtype))
            output.replace_input_with(node, empty)
    return True


def _detach_returned_logits(gm: fx.GraphModule, m: CrossEntropyMatch) -> bool:
    """Return the projection detached, with x as one more output, for the backend to put back into autograd on
    a node that costs nothing when the logits are not differentiated (compiler/returned_logits.py). Only where
    the projection itself is an output and read by nothing but the output and the loss, and w (and the bias)
    are graph inputs; False, changing nothing, otherwise."""
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    outs = output.args[0] if len(output.args) == 1 else None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not isinstance(outs, (tuple, list)) or m.linear not in outs or not isinstance(m.x, fx.Node):
        return False
    if any(user is not output and user not in m.loss_path for user in m.linear.users):
        return False
    if m.w not in placeholders or (m.bias is not None and m.bias not in placeholders):
        return False
    with gm.graph.inserting_after(m.linear):
        detached = gm.graph.call_method("detach", (m.linear,))
    set_value(detached, tensor_of(m.linear).detach())
    position = list(outs).index(m.linear)
    new_outs = [detached if node is m.linear else node for node in outs] + [m.x]
    output.args = (type(outs)(new_outs),)
    gm.meta.setdefault(returned_logits.META_KEY, []).append(returned_logits.ReturnedLogitsSlot(
        position, len(new_outs) - 1, placeholders.index(m.w),
        None if m.bias is None else placeholders.index(m.bias)))
    return True


def _replace(gm: fx.GraphModule, m: CrossEntropyMatch, read_logits: bool) -> set[fx.Node]:
    """Insert the fused node for ``m``; returns the nodes erased. ``read_logits``: the graph computes the
    projection anyway (its logits stay for another user), so the op reads its tiles instead of recomputing them."""
    graph = gm.graph
    xt, wt, bt = tensor_of(m.x), tensor_of(m.w), tensor_of(m.bias)
    # flatten, not reshape(-1, H): no size in the arguments, so a symbolic H needs no size node in the graph
    x2 = m.x if xt.dim() == 2 else insert_call(graph, m.out, torch.flatten, (m.x, 0, -2), meta_from=m.out)
    x2t = tensor_of(x2)
    # Gradients formed in the forward only where a backward will want them: the loss itself must require
    # grad (not so under no_grad, where a Parameter head still has requires_grad set).
    training = bool(tensor_of(m.out).requires_grad)
    compute_dx = training and bool(xt.requires_grad)
    compute_dw = training and bool(wt.requires_grad or (bt is not None and bt.requires_grad))
    grads = m.reduction != "none" and (compute_dx or compute_dw)
    empty = x2t.new_empty(0)
    value = (x2t.new_empty((x2t.shape[0],) if m.reduction == "none" else (), dtype=torch.float32),
             x2t.new_empty(x2t.shape) if grads and compute_dx else empty,
             wt.new_empty(wt.shape) if grads and compute_dw else empty,
             bt.new_empty(bt.shape) if grads and compute_dw and bt is not None else empty)
    logits = None
    if read_logits:
        logits = m.linear if tensor_of(m.linear).dim() == 2 else insert_call(
            graph, m.out, torch.flatten, (m.linear, 0, -2), meta_from=m.out)
    fused = insert_call(graph, m.out, torch.ops.sloth.linear_cross_entropy.default,
                        (x2, m.w, m.bias, m.labels, m.ignore_index, m.reduction, m.softcap, m.logit_scale,
                         m.label_smoothing, compute_dx, compute_dw, logits), meta_from=m.out, value=value)
    loss = insert_call(graph, m.out, operator.getitem, (fused, 0), meta_from=m.out)
    out_dtype = tensor_of(m.out).dtype
    if out_dtype != torch.float32:
        loss = insert_call(graph, m.out, cast, (loss, out_dtype), meta_from=m.out)
    return replace_and_erase(m.out, loss, keep=(m.x, m.w, m.bias, m.labels, m.linear))


def fuse_cross_entropy_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                            options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace every lm_head + cross-entropy in the canonical graph with ``torch.ops.sloth.linear_cross_entropy``.

    before:  l = linear(h, w, None); z = cast(l, f32).view(-1, V); loss = F.cross_entropy(z, y, ignore_index=-100)
    after:   loss = sloth.linear_cross_entropy(h.flatten(0, -2), w, None, y, -100, 'mean', 0.0, 1.0, 0.0, ...)[0]
    """
    _lowering().register()
    erased: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in erased or node.op != "call_function" or node.target not in (*_CROSS_ENTROPY, *_NLL_LOSS):
            continue
        found = _match(node)
        if found is None:  # a loss this family has no kernel for; reported all the same (compiler/anchors.py)
            found = ("the loss does not read the logits of a linear projection (x @ w.T + b, then only casts, "
                     "views, constant scales and a softcap; nll_loss over their log_softmax): nothing to fuse")
        if isinstance(found, str):
            report.reject(FAMILY, node, found)
            continue
        detail = (f"{found.reduction}, ignore_index={found.ignore_index}"
                  + (f", softcap={found.softcap:g}" if found.softcap else "")
                  + (f", logit_scale={found.logit_scale:g}" if found.logit_scale != 1.0 else "")
                  + (f", label_smoothing={found.label_smoothing:g}" if found.label_smoothing else "")
                  + ("" if found.bias is None else ", bias")
                  + f", V={tensor_of(found.w).shape[0]}, {tensor_of(found.x).dtype}".replace("torch.", ""))
        read_logits = False
        if found.shared:
            dropped = not options.return_logits and _drop_returned_logits(gm, found)
            read_logits = not dropped
            if dropped:
                detail += ", return_logits=False: logits not returned"
            elif not options.return_logits:
                detail += (", logits kept: read by more than the graph's output, so return_logits=False cannot "
                           "apply; the loss reads them")
            else:
                detail += ", logits also returned (kept); the loss reads them"
        if read_logits and options.top_level and _detach_returned_logits(gm, found):
            detail += "; their gradient only when one arrives"
        erased |= _replace(gm, found, read_logits)
        report.replaced(Site(FAMILY, "sloth.linear_cross_entropy", module_path(node), source_location(node), detail))
    gm.graph.lint()
    gm.recompile()
    return gm
