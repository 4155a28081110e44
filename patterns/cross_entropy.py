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
                                                           operand order), views/reshapes that keep
                                                           V the last dim, anywhere, ending in [N, V],
                                                           selections of rows: ``z[:, :-1]``,
                                                           ``z[..., :-1, :].contiguous()``, ``z[:, -1]``,
                                                           ``z.narrow(1, 0, T - 1)``, ``z.split(n)[i]``, and
                                                           contiguous ranges of classes: ``z[..., :V']``,
                                                           ``z[..., a:b]``, ``z.narrow(-1, a, n)``
    out = F.cross_entropy(z, labels, ignore_index=ii, reduction=r, label_smoothing=eps), or
          F.nll_loss(log_softmax(z, -1), labels, ignore_index=ii, reduction=r)  (any log_softmax spelling);
          labels int64 [N] from any producer (transformers' ``pad(labels, (0, 1), value=-100)[..., 1:]``)

The replacement is ``sloth.linear_cross_entropy(x.flatten(0, -2), w, b, labels, ...)[0]`` (lowering/
linear_cross_entropy.py), which computes the logits chunk by chunk in fp32 after the matmul, so it is at
least as accurate as every variant above (a bf16 softcap that eager rounds is exact here); a loss of another
dtype than float32 is cast back. What follows the loss (``/ num_items_in_batch``) stays in the graph.

Rows selected from the logits (a hand-written causal-LM loss shifts the logits instead of the labels:
``F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))``) are the same rows of x, since
row i of ``x @ w.T`` is ``x[i] @ w.T``: the op reads ``x[:, :-1]`` ("rows of the logits selected"), so the
shifted logits are never formed either. A loss per chunk of the logits (litgpt's ``chunked_cross_entropy``:
``logits.split(n)``, one ``reduction='none'`` loss per piece) becomes one op per chunk, each reading its rows of
x, and the whole logits are not computed at all (no site reads them any more).

A contiguous range of the classes (nanochat pads its head to a multiple of 64 rows and slices the logits back:
``logits[..., :vocab_size]``) is a range of rows of the head: ``(x @ w.T + b)[..., a:b] = x @ w[a:b].T + b[a:b]``,
so the op reads ``w.narrow(0, a, b - a)`` (a view; autograd gives the other rows a zero gradient, as eager does)
and the sliced logits are not formed either ("classes a:b of the head's V rows").

Under autocast (``torch.autocast(dtype=d)`` around a float32 model, TRL's and transformers' ``bf16=True``) the
graph holds no casts: the projection's value is in d from float32 x and w. The op gets x (its selected rows), w
and b cast to d, as autocast's ``F.linear`` did, and computes the loss in float32 from those d logits, as
autocast's cross-entropy does (on its fp32 list, or log_softmax's); compiler/autocast.py says how the dtype is
read ("under autocast: in bfloat16").

With ``return_logits="lazy"`` (which the plan chooses for long context, compiler/planner.py), logits returned beside
the loss of a training graph whose head is frozen (LoRA, QLoRA), as every transformers ``*ForCausalLM`` returns them
(directly, or through one cast the output alone reads: accelerate's mixed precision returns ``logits.float()``),
leave the graph: the op computes its own tiles, the graph returns x in their place,
and the caller gets logits computed only when something reads them, with a gradient only when one arrives
(patterns/returned_logits.py; "logits also returned, computed only when read"). A step that never reads them never
holds them. A trainable head's logits are computed in the graph and returned detached, with x, on a node of their
own ("their gradient only when one arrives").

Logits with another user in the graph (logged, softcapped before being returned, or in an evaluation graph)
still fuse: the loss becomes the sloth op and the chain nodes the other user reads stay, in the model's
dtype, so the outputs are exact ("logits also returned (kept)"). The op then reads the projection the graph
computes anyway (``logits=``) instead of recomputing it chunk by chunk, so the step pays one lm_head matmul
and one for dx, as ``return_logits=False`` does, not three; autograd adds the graph's own linear's gradient to
the op's when the returned logits are differentiated too. ``options={"return_logits": False}``
returns an empty tensor in their place when being returned is their only other use, so they are never
computed ("return_logits=False: logits not returned").

Left as it was, with the reason: logits read elsewhere after a widening cast (an fp32 copy), class weights
(``weight=``), the legacy ``size_average``/``reduce``, float64, soft (probability) targets, a cast to a narrower
dtype or a second tanh in the logits' chain, a non-constant ignore_index or smoothing, a log_softmax over
another dim or with other users, a strided slice of the vocabulary dim or one whose bounds are not constants,
rows or classes gathered by a tensor index, a view that reshapes the rows before they are sliced (other than to
[N, V]), and any loss that does not read a linear's logits (every F.cross_entropy / F.nll_loss is an anchor:
compiler/anchors.py).
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

from ..compiler.autocast import autocast_dtype, cast_to
from ..compiler.canonicalize import cast
from ..compiler.fx_utils import (arg_of, insert_call, is_call, is_function, is_method, is_number, linear_parts,
                                 module_path, replace_and_erase, same_size, set_value, source_location, tensor_of,
                                 value_of)
from . import returned_logits
from ..compiler.options import PassOptions
from ..compiler.families import Family
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
    loss_paths: set[fx.Node]  # the nodes from the linear to the loss, the loss included, and other sites' alike
    selection: list[fx.Node]  # the steps selecting rows of the logits, replayed on x (see _row_selection)
    classes: Optional[tuple[int, int]]  # (start, length): the head's rows the loss reads (_class_selection); None: all
    autocast: Optional[torch.dtype]  # the dtype autocast ran the projection in, not its inputs' (compiler/autocast.py)


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


def _split_of(node: Any) -> Optional[fx.Node]:
    """The ``split`` / ``chunk`` node when ``node`` is ``x.split(s, d)[i]`` or ``x.chunk(n, d)[i]`` of a tensor x
    (canonicalisation makes these narrows where the bounds are static; they stay where they are symbolic)."""
    if not is_call(node, operator.getitem) or not isinstance(node.args[1], int):
        return None
    split = node.args[0]
    if not (is_method(split, "split", "chunk") or is_function(split, torch.split, torch.chunk)):
        return None
    return split if split.args and tensor_of(split.args[0]) is not None else None


def _is_row_step(node: Any) -> bool:
    """A step that selects part of a tensor without changing its values: ``torch.narrow`` (canonical, or the
    method where canonicalisation kept it: symbolic bounds), ``x[index]`` of a tensor (kept where bounds are
    symbolic or several dims are sliced), one piece of a split or chunk (``_split_of``) and a plain
    ``.contiguous()``. Which of them select rows only (and so can be read from the hidden states) is
    ``_row_selection``'s to say."""
    if _split_of(node) is not None:
        return True
    if not isinstance(node, fx.Node) or not node.args or tensor_of(node.args[0]) is None:
        return False
    if is_call(node, torch.narrow) or is_method(node, "narrow"):
        return len(node.args) == 4 and not node.kwargs
    if is_call(node, operator.getitem):
        return True
    return is_method(node, "contiguous") and len(node.args) == 1 and not node.kwargs


def _row_step_input(step: fx.Node) -> fx.Node:
    """The tensor a row step (``_is_row_step``) selects from."""
    split = _split_of(step)
    return step.args[0] if split is None else split.args[0]


def _index_of_dims(index: Any, ndim: int) -> Union[tuple[Union[slice, int], ...], str]:
    """``x[index]`` of an ``ndim``-dim x as one entry (a slice, or an int that picks one position) per dim, or
    what else the index holds."""
    index = index if isinstance(index, tuple) else (index,)
    if index.count(Ellipsis) > 1:
        return "two Ellipses"
    others = [i for i in index if isinstance(i, bool) or not (
        isinstance(i, (slice, int)) or i is Ellipsis or isinstance(value_of(i), torch.SymInt))]
    picks = [i for i in index if i is not Ellipsis]
    if others:
        tensors = [i for i in others if tensor_of(i) is not None]
        # Ellipsis or one entry per dim before it: the index's last entry is the vocabulary dim's
        on_classes = bool(tensors) and index[-1] is tensors[-1] and (Ellipsis in index or len(picks) == ndim)
        kind = ("a tensor over the vocabulary (last) dim (a gather of classes)" if on_classes
                else "a tensor (a gather of rows)" if tensors
                else "None (a new axis)" if any(i is None for i in others) else repr(others[0]))
        return f"{kind}, not only slices and integers"
    if len(picks) > ndim:
        return "more entries than dims"
    if Ellipsis in index:
        at = index.index(Ellipsis)
        return index[:at] + (slice(None),) * (ndim - len(picks)) + index[at + 1:]
    return index + (slice(None),) * (ndim - len(index))


def _takes_whole_dim(s: Union[slice, int], size: Any) -> bool:
    if not isinstance(s, slice) or s.step not in (None, 1) or s.start not in (None, 0):
        return False
    return s.stop is None or (isinstance(s.stop, int) and isinstance(size, int) and s.stop >= size)


def _step_dim(step: fx.Node) -> Any:
    """The dim a split, chunk or narrow step (``_is_row_step``) selects along, as written."""
    split = _split_of(step)
    return arg_of(split, 2, "dim", 0) if split is not None else step.args[1]


def _row_step_reason(step: fx.Node) -> Optional[str]:
    """Why a row step (``_is_row_step``) selects something other than rows of its input and a range of its
    classes (``_class_range`` says which), or None when it does not."""
    if is_method(step, "contiguous"):
        return None
    ndim = tensor_of(_row_step_input(step)).dim()
    if not is_call(step, operator.getitem) or _split_of(step) is not None:
        dim = _step_dim(step)
        if not isinstance(dim, int) or not -ndim <= dim < ndim:
            return "the logits are split or narrowed along a dim that is not a constant"
        return None
    dims = _index_of_dims(step.args[1], ndim)
    if isinstance(dims, str):
        return (f"the logits are indexed with {dims}; only slices and picks of their rows and a slice of their "
                "classes are read from the hidden states and the head")
    return None


def _selects_rows(step: fx.Node) -> bool:
    """Whether a row step that ``_row_step_reason`` accepts selects along a dim before the vocabulary one."""
    if is_method(step, "contiguous"):
        return False
    source = tensor_of(_row_step_input(step))
    if not is_call(step, operator.getitem) or _split_of(step) is not None:
        return _step_dim(step) not in (-1, source.dim() - 1)
    dims = _index_of_dims(step.args[1], source.dim())
    return not all(_takes_whole_dim(s, size) for s, size in zip(dims[:-1], source.shape[:-1]))


_CLASSES_NOT_CONSTANT = ("the logits are sliced along the vocabulary (last) dim with bounds that are not constants, "
                         "so the head's rows to read are not known")


def _class_range(step: fx.Node) -> Union[tuple[int, int], str, None]:
    """(start, length) of the classes (the last dim) a row step that ``_row_step_reason`` accepts keeps of its
    input, None when it keeps them all; or why they are not a contiguous range known here. The length is the
    step's own last size (a constant bound of a symbolic V, whose weight is a graph input under dynamic shapes,
    gives one); a negative start needs V itself."""
    if is_method(step, "contiguous"):
        return None
    source, out = tensor_of(_row_step_input(step)), tensor_of(step)
    size = source.shape[-1]
    if not is_call(step, operator.getitem) or _split_of(step) is not None:
        if _step_dim(step) not in (-1, source.dim() - 1):
            return None
        if _split_of(step) is not None:  # canonicalisation made every split of constant sizes narrows
            return _CLASSES_NOT_CONSTANT
        start = step.args[2]
    else:
        s = _index_of_dims(step.args[1], source.dim())[-1]
        if not isinstance(s, slice):
            return "an integer index picks one class of the logits, so the loss is not over their classes"
        if _takes_whole_dim(s, size):
            return None
        if s.step not in (None, 1):
            if not _is_int(s.step):
                return _CLASSES_NOT_CONSTANT
            return (f"the logits are sliced along the vocabulary (last) dim with step {s.step}, so the classes read "
                    "are not a contiguous range of the head's rows")
        start = 0 if s.start is None else s.start
    length = out.shape[-1] if out is not None else None
    if not _is_int(start) or not _is_int(length) or (start < 0 and not _is_int(size)):
        return _CLASSES_NOT_CONSTANT
    if start < 0:
        start = max(0, start + size)
    return start, length


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _class_selection(steps: list[fx.Node], vocab: int) -> Union[tuple[int, int], str, None]:
    """(start, length) of the head's rows whose logits the loss reads, when the steps slice the vocabulary dim
    (nanochat drops a head padded to a multiple of 64: ``logits[..., :vocab_size]``), None when it reads all V;
    or why not. ``(x @ w.T + b)[..., a:a + n] = x @ w[a:a + n].T + b[a:a + n]``, and casts, scales and the softcap
    work element by element, so the op reads ``w.narrow(0, a, n)`` (a view) and the sliced logits are never
    formed. Successive slices compose; a strided slice, an integer pick or a tensor index over the classes does
    not select a range of rows of w."""
    start, length = 0, vocab
    for step in steps:
        if not _is_row_step(step):
            continue
        kept = _class_range(step)
        if isinstance(kept, str):
            return kept
        if kept is not None:
            start, length = start + kept[0], kept[1]
    if length == 0:
        return "the logits are sliced along the vocabulary (last) dim to no class at all"
    return None if length == vocab else (start, length)


def _row_selection(steps: list[fx.Node]) -> Union[list[fx.Node], str]:
    """The steps that select rows of the logits, in forward order, as ``_select_rows`` replays them on the hidden
    states; or why a step selects something the hidden states cannot give.

    A causal LM's hand-written loss drops the last position's logits (``logits[:, :-1]``, ``logits[..., :-1, :]``
    then ``.contiguous()``, ``.narrow(1, 0, T - 1)``) or chunks them (``logits.split(n)``, litgpt). Row i of
    ``x @ w.T`` is ``x[i] @ w.T``, and casts, scales and the softcap work element by element, so any selection of
    whole rows of the logits is the loss over the same selection of rows of x: a narrow, a split or chunk, or
    ``x[slices or integers]`` over the dims before the vocabulary. Views of the logits before a selection reshape
    the rows it indexes; one that makes them ``[N, V]`` is ``flatten(0, -2)`` of x (views keep the rows' order),
    any other has no counterpart here (its sizes would have to be rewritten with H for V). ``.contiguous()``
    selects nothing, nor does a slice of the classes alone (``_class_selection``); one index that slices both
    (``logits[:, :-1, :V]``) is replayed on x without its last entry (``_rows_index``).
    """
    selection: list[fx.Node] = []
    reshaped = None  # the last view since the last selection: it shapes the rows the next one indexes
    for step in steps:
        if _is_view(step):
            reshaped = step
            continue
        if not _is_row_step(step):
            continue
        reason = _row_step_reason(step)
        if reason is not None:
            return reason
        if not _selects_rows(step):
            continue
        if reshaped is not None:
            if tensor_of(reshaped) is None or tensor_of(reshaped).dim() != 2:
                return ("a view reshapes the logits' rows before they are sliced, to a shape other than [N, V]: "
                        "that slice has no counterpart in the hidden states")
            selection.append(reshaped)
            reshaped = None
        selection.append(step)
    return selection


def _rows_index(step: fx.Node) -> Optional[tuple[Any, ...]]:
    """The index that replays a getitem row step on x, whose last dim is H, when the step also slices the classes:
    its entries for the rows, the last dim whole; None when the step's own index does (it takes every class)."""
    if not is_call(step, operator.getitem) or _split_of(step) is not None:
        return None
    source = tensor_of(_row_step_input(step))
    dims = _index_of_dims(step.args[1], source.dim())
    return None if _takes_whole_dim(dims[-1], source.shape[-1]) else (*dims[:-1], slice(None))


def _copy_call(graph: fx.Graph, before: fx.Node, like: fx.Node, source: fx.Node,
               args: Optional[tuple[Any, ...]] = None) -> fx.Node:
    """``like``'s call (function or method, the same other arguments unless ``args`` says) on ``source`` instead,
    inserted before ``before``."""
    args = tuple(like.args[1:]) if args is None else args
    with graph.inserting_before(before):
        node = graph.create_node(like.op, like.target, (source, *args), dict(like.kwargs))
    node.meta.update({k: v for k, v in before.meta.items() if k in ("stack_trace", "nn_module_stack")})
    args, kwargs = fx.node.map_arg((args, dict(like.kwargs)), value_of)
    value = tensor_of(source)
    set_value(node, getattr(value, like.target)(*args, **kwargs) if like.op == "call_method"
              else like.target(value, *args, **kwargs))
    return node


def _select_rows(graph: fx.Graph, before: fx.Node, source: fx.Node, selection: list[fx.Node],
                 replayed: dict[tuple[fx.Node, Any], fx.Node]) -> fx.Node:
    """``source`` (x, or the projection) with the rows ``selection`` (``_row_selection``) takes from the logits;
    inserted before ``before``. A view is replayed as ``flatten(0, -2)``, a selection as itself on the new
    input (a split or chunk whole, then its piece). ``replayed`` maps (input, step) to a replay made for an
    earlier site of the pass: the losses over chunks of one shifted projection share one shifted copy of x."""
    node = source
    for step in selection:
        split = _split_of(step)
        key = (node, split if split is not None else step)
        if key not in replayed:
            if _is_view(step):
                replayed[key] = insert_call(graph, before, torch.flatten, (node, 0, -2), meta_from=before)
            elif split is not None:
                replayed[key] = _copy_call(graph, before, split, node)
            else:
                index = _rows_index(step)
                replayed[key] = _copy_call(graph, before, step, node, None if index is None else (index,))
        node = replayed[key]
        if split is not None:
            node = insert_call(graph, before, operator.getitem, (node, step.args[1]), meta_from=before)
    return node


def _chain_to_linear(start: Any) -> Union[tuple[fx.Node, tuple[Any, Any, Any], list[fx.Node]], None]:
    """(projection node, its (x, w, bias), the steps from it to ``start`` in forward order), or None when
    ``start`` does not come from a linear through casts, views, selections (``_is_row_step``), scalar
    multiplies/divides and tanh only."""
    steps: list[fx.Node] = []
    node = start
    while isinstance(node, fx.Node):
        projection = linear_parts(node)
        if projection is not None:
            return node, projection, steps[::-1]
        if is_call(node, cast) or _is_view(node) or is_call(node, torch.tanh) or _is_row_step(node):
            steps.append(node)
            node = _row_step_input(node) if _is_row_step(node) else node.args[0]
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


def _shared_logits(linear: fx.Node, steps: list[fx.Node], loss_paths: set[fx.Node]) -> Union[list[fx.Node], str]:
    """The nodes of the logits' chain that something besides the losses also reads (they stay in the graph),
    or why they cannot stay.

    ``loss_paths``: the nodes from a linear to a loss of every site that matched, this one's included. A chain
    node read by a node outside them is read elsewhere (returned, as every transformers ``*ForCausalLM`` does,
    or logged); one read by the paths of several losses only (a loss per chunk of the logits) is not, since
    each fused loss reads its own rows of x. A node read elsewhere stays, computed as the graph computes it, as
    long as it is in the model's dtype: one after a widening cast is the fp32 copy of the logits (4 bytes a
    logit, 2x a bf16 model's) that the fused kernel exists to avoid.
    """
    chain = [linear, *steps]
    shared = [node for node in chain if any(user not in loss_paths for user in node.users)]
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


def _scale_and_softcap(linear: fx.Node, steps: list[fx.Node]) -> Union[tuple[float, float], str]:
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
            # the last dim's size kept: its rows of classes stay whole and in order (a vocabulary slice before the
            # view changed that size, so it is compared with the view's input, not with w)
            out, source = tensor_of(step), tensor_of(step.args[0])
            if out is None or source is None or out.dim() < 1 or source.dim() < 1 \
                    or not same_size(out.shape[-1], source.shape[-1]):
                return "a view of the logits moves the vocabulary dimension"
        elif is_call(step, torch.tanh):
            if seen_tanh:
                return "two tanh in the logits' chain"
            seen_tanh = True
        elif _is_row_step(step):
            continue  # a selection of the logits, element-wise steps commute with it (_row_selection)
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


def _match(ce: fx.Node, other_losses: Optional[frozenset[fx.Node]] = frozenset()
           ) -> Union[CrossEntropyMatch, str, None]:
    """Match around an ``F.cross_entropy`` anchor. None: not fed by a linear; str: a near-miss and why.
    ``other_losses``: the loss paths of the other sites that match (``_shared_logits`` says why); None to
    match the site's own structure only, leaving out whether its logits are read elsewhere."""
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
    selection = _row_selection(steps)
    if isinstance(selection, str):
        return selection
    if wt.dim() != 2:
        return "the head weight is not a [V, H] matrix"
    classes = _class_selection(steps, wt.shape[0])
    if isinstance(classes, str):
        return classes
    vocab = wt.shape[0] if classes is None else classes[1]
    if zt.dim() != 2 or not same_size(zt.shape[-1], vocab):
        return "the loss is not over [N, V] rows of the logits (a K-dimensional loss, or a vocabulary view)"
    if yt.dtype != torch.int64 or yt.dim() != 1:
        return f"the targets are {yt.dtype} of {yt.dim()} dims, not int64 class indices per row (soft targets)"
    autocast = autocast_dtype(linear, {"x": x, "the head weight": w, "the bias": bias}, _KERNEL_DTYPES)
    if isinstance(autocast, str):
        return autocast
    if autocast is None and xt.dtype not in _KERNEL_DTYPES:
        return (f"the linear computes in {xt.dtype}; the fused kernel supports float32, bfloat16 and float16 with "
                "one dtype for input, weight and bias")
    if tensor_of(ce) is None or tensor_of(ce).dtype not in _KERNEL_DTYPES:
        return "the loss is not float32, bfloat16 or float16"
    scaled = _scale_and_softcap(linear, steps)
    if isinstance(scaled, str):
        return scaled
    splits = [_split_of(step) for step in steps if _split_of(step) is not None]
    loss_paths = {linear, *steps, *splits, *ce.all_input_nodes, ce} | (other_losses or frozenset())
    shared = [] if other_losses is None else _shared_logits(linear, steps, loss_paths)
    if isinstance(shared, str):
        return shared
    softcap, logit_scale = scaled
    return CrossEntropyMatch(x, w, bias, params["target"], params["ignore_index"], params["reduction"], softcap,
                             logit_scale, float(params["label_smoothing"]), ce, linear, shared, loss_paths,
                             selection, classes, autocast)


def _drop_returned_logits(gm: fx.GraphModule, m: CrossEntropyMatch) -> bool:
    """Return an empty tensor in place of the logits when being returned is their only use besides the loss,
    so that nothing computes them (``return_logits=False``); False, changing nothing, otherwise."""
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    if any(user is not output and user not in m.loss_paths for node in m.shared for user in node.users):
        return False  # also read by something other than the graph's output: the logits are computed anyway
    for node in m.shared:
        if output in node.users:
            with gm.graph.inserting_before(m.out):
                empty = gm.graph.call_method("new_empty", (m.x, (0,)), {"dtype": tensor_of(node).dtype})
            set_value(empty, tensor_of(m.x).new_empty(0, dtype=tensor_of(node).dtype))
            output.replace_input_with(node, empty)
    return True


def _returned_logits_slot(gm: fx.GraphModule, m: CrossEntropyMatch, may_be_lazy: bool) -> Optional[str]:
    """Return the logits through a slot the backend fills (patterns/returned_logits.py): "lazy" (``may_be_lazy``:
    ``return_logits="lazy"``, which the plan chooses) in a training graph whose head is frozen (w and the bias need
    no gradient: a LoRA or QLoRA step): x is returned in their place and they are computed only when read;
    "computed" otherwise: the graph still computes them, returned detached with x
    as one more output, put back into autograd on a node of their own. Only where the projection is the one chain
    node other users read, those users are the graph's output (directly, or through one cast only the output reads:
    accelerate's ``logits.float()``) at one position, and w (and the bias) are graph inputs; None, changing nothing,
    otherwise."""
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    outs = output.args[0] if len(output.args) == 1 else None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not isinstance(outs, (tuple, list)) or not isinstance(m.x, fx.Node) or m.shared != [m.linear]:
        return None
    if m.w not in placeholders or (m.bias is not None and m.bias not in placeholders):
        return None
    others = [user for user in m.linear.users if user not in m.loss_paths]
    if len(others) != 1:
        return None
    (reader,) = others
    returned, cast_node = m.linear, None
    if reader is not output:
        if not (is_function(reader, cast) and list(reader.users) == [output]):
            return None
        returned = cast_node = reader
    if sum(1 for node in outs if node is returned) != 1:
        return None
    # Lazy only where nothing can change w before the logits are read (a trainable head changes at the optimizer's
    # step, and logits read after it would be the new head's) and where a backward follows (an evaluation reads them).
    # Nor under torch.distributed: FSDP (and DeepSpeed's ZeRO-3) free the gathered head after the forward.
    frozen = not any(getattr(tensor_of(n), "requires_grad", False) for n in (m.w, m.bias) if n is not None)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    lazy = may_be_lazy and frozen and bool(tensor_of(m.out).requires_grad) and not distributed
    position = list(outs).index(returned)
    new_outs = list(outs)
    if lazy:
        new_outs[position] = m.x
        x_output = None
    else:
        with gm.graph.inserting_after(returned):
            detached = gm.graph.call_method("detach", (returned,))
        set_value(detached, tensor_of(returned).detach())
        new_outs[position] = detached
        new_outs.append(m.x)
        x_output = len(new_outs) - 1
    output.args = (type(outs)(new_outs),)
    if lazy and cast_node is not None:  # the returned float32 copy is formed on read, by the caller's LazyLogits
        gm.graph.erase_node(cast_node)
    gm.meta.setdefault(returned_logits.META_KEY, []).append(returned_logits.ReturnedLogitsSlot(
        position, placeholders.index(m.w), None if m.bias is None else placeholders.index(m.bias),
        tensor_of(returned).dtype, m.autocast, x_output))
    return "lazy" if lazy else "computed"


def _replace(gm: fx.GraphModule, m: CrossEntropyMatch, read_logits: bool,
             replayed: dict[tuple[fx.Node, Any], fx.Node]) -> set[fx.Node]:
    """Insert the fused node for ``m``; returns the nodes erased. ``read_logits``: the graph computes the
    projection anyway (its logits stay for another user), so the op reads its tiles instead of recomputing them."""
    graph = gm.graph
    xt, wt, bt = tensor_of(m.x), tensor_of(m.w), tensor_of(m.bias)
    rows = _select_rows(graph, m.out, m.x, m.selection, replayed)
    if m.autocast is not None:  # autocast's cast of x, of the selected rows only; shared by sites reading them
        key = (rows, m.autocast)
        replayed[key] = replayed.get(key) or cast_to(m.out, rows, m.autocast)
        rows = replayed[key]
    # flatten, not reshape(-1, H): no size in the arguments, so a symbolic H needs no size node in the graph
    x2 = rows if tensor_of(rows).dim() == 2 else insert_call(graph, m.out, torch.flatten, (rows, 0, -2),
                                                               meta_from=m.out)
    x2t = tensor_of(x2)
    w, bias = m.w, m.bias
    if m.classes is not None:  # the head's rows the loss reads: a view of them (_class_selection)
        w, bias = (None if node is None else insert_call(graph, m.out, torch.narrow, (node, 0, *m.classes),
                                                         meta_from=m.out) for node in (w, bias))
    w, bias = cast_to(m.out, w, m.autocast), cast_to(m.out, bias, m.autocast)
    # Gradients formed in the forward only where a backward will want them: the loss itself must require
    # grad (not so under no_grad, where a Parameter head still has requires_grad set).
    training = bool(tensor_of(m.out).requires_grad)
    compute_dx = training and bool(xt.requires_grad)
    compute_dw = training and bool(wt.requires_grad or (bt is not None and bt.requires_grad))
    grads = m.reduction != "none" and (compute_dx or compute_dw)
    empty = x2t.new_empty(0)
    w_t, b_t = tensor_of(w), tensor_of(bias)
    value = (x2t.new_empty((x2t.shape[0],) if m.reduction == "none" else (), dtype=torch.float32),
             x2t.new_empty(x2t.shape) if grads and compute_dx else empty,
             w_t.new_empty(w_t.shape) if grads and compute_dw else empty,
             b_t.new_empty(b_t.shape) if grads and compute_dw and b_t is not None else empty)
    logits = None
    if read_logits:
        # Selected rows of the projection are a copy when they are not a view of whole rows (logits[:, :-1] of
        # B > 1 sequences): the copy the user's own .contiguous() / reshape made in eager, in the model's dtype.
        logits = _select_rows(graph, m.out, m.linear, m.selection, replayed)
        if m.classes is not None:
            logits = insert_call(graph, m.out, torch.narrow, (logits, -1, *m.classes), meta_from=m.out)
        if tensor_of(logits).dim() != 2:
            logits = insert_call(graph, m.out, torch.flatten, (logits, 0, -2), meta_from=m.out)
    fused = insert_call(graph, m.out, torch.ops.sloth.linear_cross_entropy.default,
                        (x2, w, bias, m.labels, m.ignore_index, m.reduction, m.softcap, m.logit_scale,
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
    anchors = [node for node in gm.graph.nodes
               if node.op == "call_function" and node.target in (*_CROSS_ENTROPY, *_NLL_LOSS)]
    matched = [m for m in (_match(node, None) for node in anchors) if isinstance(m, CrossEntropyMatch)]
    all_losses = frozenset().union(*(m.loss_paths for m in matched))
    replayed: dict[tuple[fx.Node, Any], fx.Node] = {}  # row selections made on x (_select_rows), autocast casts
    for node in anchors:
        if node in erased:
            continue
        found = _match(node, all_losses)
        if found is None:  # a loss this family has no kernel for; reported all the same (compiler/anchors.py)
            found = ("the loss does not read the logits of a linear projection (x @ w.T + b, then only casts, "
                     "views, selections of rows, constant scales and a softcap; nll_loss over their log_softmax): "
                     "nothing to fuse")
        if isinstance(found, str):
            report.reject(FAMILY, node, found)
            continue
        detail = (f"{found.reduction}, ignore_index={found.ignore_index}"
                  + (f", softcap={found.softcap:g}" if found.softcap else "")
                  + (f", logit_scale={found.logit_scale:g}" if found.logit_scale != 1.0 else "")
                  + (f", label_smoothing={found.label_smoothing:g}" if found.label_smoothing else "")
                  + ("" if found.bias is None else ", bias")
                  + (", rows of the logits selected: the same rows of x are read" if found.selection else "")
                  + ("" if found.classes is None else
                     f", classes {found.classes[0]}:{sum(found.classes)} of the head's {tensor_of(found.w).shape[0]} "
                     "rows: those rows of w are read")
                  + f", V={found.classes[1] if found.classes else tensor_of(found.w).shape[0]}"
                  + f", {tensor_of(found.x).dtype}".replace("torch.", "")
                  + ("" if found.autocast is None else f", under autocast: in {found.autocast}".replace("torch.", "")))
        read_logits = lazy = False
        if found.shared:
            dropped = not options.return_logits and _drop_returned_logits(gm, found)
            slot = None if dropped or not options.top_level else _returned_logits_slot(
                gm, found, may_be_lazy=options.return_logits == "lazy")
            lazy = slot == "lazy"
            read_logits = not dropped and not lazy
            if dropped:
                detail += ", return_logits=False: logits not returned"
            elif not options.return_logits:
                detail += (", logits kept: read by more than the graph's output, so return_logits=False cannot "
                           "apply; the loss reads them")
            elif lazy:
                detail += ", logits also returned, computed only when read, their gradient only when one arrives"
            else:
                detail += (", logits also returned (kept); the loss reads them"
                           + ("; their gradient only when one arrives" if slot == "computed" else ""))
        erased |= _replace(gm, found, read_logits, replayed)
        if lazy and not found.linear.users:  # the loss computes its own tiles: nothing reads the projection now
            gm.graph.erase_node(found.linear)
            erased.add(found.linear)
        report.replaced(Site(FAMILY, "sloth.linear_cross_entropy", module_path(node), source_location(node), detail))
    gm.graph.lint()
    gm.recompile()
    return gm


# The family's anchor (compiler/anchors.py): where its sites are, more broadly than its matchers take them.
def anchor(node: fx.Node) -> bool:
    """The ``cross_entropy`` family's anchor: F.cross_entropy, F.nll_loss"""
    return node.op == "call_function" and node.target in (F.cross_entropy, F.nll_loss)


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_cross_entropy_pass, order=80, anchor=anchor,
                     emits=("linear_cross_entropy",),
                     reads=("return_logits",), records=(returned_logits.META_KEY,),
                     after_compile=returned_logits.reattach_returned,
                     summary=("the LM head's linear and the loss in one chunked op, no `[N, V]` logits: shifted, "
                              "sliced, soft-capped, under autocast"))
