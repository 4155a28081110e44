"""Per-token log-probabilities family (``"token_logprobs"`` in the report): a linear head's log-softmax read at
labels, and its entropy, as preference and RL losses (DPO, KTO, GRPO, RLOO) write them.

The meaning, as plain PyTorch (the test oracle)::

    token_logprobs_pattern(x, w, b, labels)
        lsm = F.log_softmax(F.linear(x, w, b).float(), dim=-1)
        logp = torch.gather(lsm, -1, labels.unsqueeze(-1)).squeeze(-1)     # TRL's selective_log_softmax
        entropy = -(lsm.exp() * lsm).sum(-1)                                 # the entropy term of a GRPO loss

Matched on the canonical graph: ``log_softmax(z, -1)`` (any spelling) of logits ``z`` that come from a linear
through casts, views, scalar multiplies and divides (a logit scale, a temperature) and a softcap's tanh, whose
users are one ``gather`` along the last dim (the log-probabilities at the labels, with or without the squeeze)
and, optionally, the entropy's ``sum(exp(lsm) * lsm, -1)`` (or the entropy alone: TRL's ``entropy_from_logits``).
Also ``gather(z, -1, i) - logsumexp(z, -1, keepdim=True)`` (the log-softmax
written out; TRL's ``selective_log_softmax`` for float32 logits, its logsumexp a loop over batch rows). Each becomes
one ``torch.ops.sloth.linear_token_logprobs`` (lowering/token_logprobs.py) on the linear's x, w and bias: no [N, V]
logits, log-softmax or probabilities in the forward or the backward. The logits' chain stays where something else
reads it (a model that returns its logits). Refused, with the reason: a log-softmax read by anything else (the
cross-entropy family takes ``nll_loss``), two gathers of one log-softmax, classes sliced before it, a dtype the kernel
does not take. Rows of the logits selected before it (``logits[:, :-1]``, a split) are the same rows of x, as in the
cross-entropy family.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.canonicalize import cast
from ..compiler.families import Family
from ..compiler.fx_utils import erase_unused, grad_enabled_at, insert_call, inherit_requires_grad, is_call, \
    is_grad_switch, module_path, source_location, tensor_of
from ..compiler.options import PassOptions
from ..compiler.report import Report, Site
from ..compiler.writes import mutated_producer
from .cross_entropy import (_chain_to_linear, _class_selection, _is_row_step, _is_view, _row_selection,
                            _scale_and_softcap, _select_rows)

FAMILY = "token_logprobs"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG_SOFTMAX = (F.log_softmax, torch.log_softmax, "log_softmax")
# The op's ignore_index where the graph selects no rows: an index no gather can take (eager's gather raises on a
# negative index), so every row is computed.
NO_IGNORED_ROWS = -(2 ** 63)


def _lowering():
    """The kernel module, imported on first use (see patterns/rms_norm.py)."""
    from ..lowering import token_logprobs

    return token_logprobs


def token_logprobs_pattern(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], labels: torch.Tensor,
                           entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The family's meaning (module docstring)."""
    lsm = F.log_softmax(F.linear(x, w, b).float(), dim=-1)
    logp = torch.gather(lsm, -1, labels.unsqueeze(-1)).squeeze(-1)
    return logp, (-(lsm.exp() * lsm).sum(-1) if entropy else None)


@dataclasses.dataclass
class TokenLogprobsMatch:
    """A site: ``gather`` reads ``log_softmax`` of ``linear``'s logits at ``index``; ``entropy_sum``, when found,
    is ``sum(exp(lsm) * lsm, -1)`` (the negative entropy). One of the two at least."""
    log_softmax: fx.Node
    linear: fx.Node
    parts: tuple[Any, Any, Any]
    gather: Optional[fx.Node]  # None: the entropy alone; the subtraction in the logsumexp form
    index: Optional[fx.Node]
    entropy_sum: Optional[fx.Node]
    softcap: float
    logit_scale: float
    selection: list[fx.Node]  # the steps that select rows of the logits (``_row_selection``), replayed on x


def _args(node: fx.Node, names: tuple[str, ...]) -> dict[str, Any]:
    return dict(zip(names, node.args), **node.kwargs)


def _is_log_softmax(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.target in _LOG_SOFTMAX


def _gather_index(node: fx.Node, lsm: fx.Node) -> Union[fx.Node, str, None]:
    """The index of ``torch.gather(lsm, -1, index)`` (any spelling), or why it is not one the op takes."""
    if not (node.op in ("call_function", "call_method") and node.target in (torch.gather, "gather")):
        return None
    params = _args(node, ("input", "dim", "index", "sparse_grad"))
    index, it, lt = params.get("index"), tensor_of(params.get("index")), tensor_of(lsm)
    if params.get("input") is not lsm or it is None or lt is None:
        return None
    if params.get("dim") not in (-1, lt.dim() - 1):
        return f"the log-probabilities are gathered along dim {params.get('dim')}, not the vocabulary (last) dim"
    if it.dtype != torch.int64 or it.dim() != lt.dim() or it.shape[-1] != 1 or tuple(it.shape[:-1]) != tuple(
            lt.shape[:-1]):
        return "the gather reads more or other than one label per row"
    return index


def _twin(node: Any, lsm: fx.Node) -> bool:
    """``node`` is the log-softmax ``lsm`` written again on the same logits, read once (by the entropy's product):
    ``z.log_softmax(-1).exp() * z.log_softmax(-1)``, or the log-probabilities' one and a logged entropy's. The same
    value unless the logits are written in place (``_match`` refuses any write to them)."""
    return (_is_log_softmax(node) and node is not lsm and len(node.users) == 1 and node.target == lsm.target
            and node.args == lsm.args and node.kwargs == lsm.kwargs)


def _entropy_sum(node: fx.Node, lsm: fx.Node) -> Optional[fx.Node]:
    """``sum(exp(lsm) * lsm, (-1,), keepdim)`` from ``node``, a user of ``lsm``, else None: ``node`` is the
    ``exp(lsm)`` (the product's other factor ``lsm`` or its twin), or the product itself with ``exp(twin)``."""
    if is_call(node, torch.mul) and len(node.args) == 2 and lsm in node.args:
        exp = node.args[1] if node.args[0] is lsm else node.args[0]
        if not (is_call(exp, torch.exp) and len(exp.users) == 1 and _twin(exp.args[0], lsm)):
            return None
        node = exp
    if not is_call(node, torch.exp) or len(node.users) != 1:
        return None
    mul = next(iter(node.users))
    if not is_call(mul, torch.mul) or len(mul.args) != 2 or node not in mul.args or len(mul.users) != 1:
        return None
    other = mul.args[1] if mul.args[0] is node else mul.args[0]
    if node.args[0] is lsm:
        if other is not lsm and not _twin(other, lsm):
            return None
    elif other is not lsm:  # exp(twin) * lsm
        return None
    total = next(iter(mul.users))
    lt = tensor_of(lsm)
    if not is_call(total, torch.sum) or len(total.args) != 3 or tuple(total.args[1]) not in ((-1,), (lt.dim() - 1,)):
        return None
    return total


def _match(lsm: fx.Node) -> Union[TokenLogprobsMatch, str, None]:
    params = _args(lsm, ("input", "dim", "_stacklevel" if lsm.target is F.log_softmax else "dtype"))
    z, zt = params.get("input"), tensor_of(params.get("input"))
    chain = _chain_to_linear(z) if zt is not None else None
    if chain is None:
        return None  # not the log-probabilities of a linear's logits
    linear, parts, steps = chain
    users = list(lsm.users)
    gathers = [(u, _gather_index(u, lsm)) for u in users]
    gathers = [(u, i) for u, i in gathers if i is not None]
    entropy = next((e for u in users if (e := _entropy_sum(u, lsm)) is not None), None)
    if not gathers and entropy is None:
        return None  # neither labels read nor the entropy: not this family (nll_loss is cross_entropy's)
    reason = next((i for _, i in gathers if isinstance(i, str)), None)
    if reason:
        return reason
    if len(gathers) > 1:
        return "one log-softmax gathered at two sets of labels"
    gather, index = gathers[0] if gathers else (None, None)  # the entropy alone (TRL's entropy_from_logits)
    read = {gather}
    if entropy is not None:  # exp(lsm) and exp(lsm) * lsm both read lsm
        mul = entropy.args[0]
        read |= {mul, *(a for a in mul.args if a is not lsm)}
    if any(u not in read for u in users):
        return "the log-probabilities have other users than the gather at the labels and the entropy"
    if params.get("dim") not in (-1, zt.dim() - 1):
        return f"log_softmax is over dim {params.get('dim')}, not the vocabulary (last) dim"
    if params.get("dtype") not in (None, torch.float32) or zt.dtype not in _KERNEL_DTYPES:
        return f"log_softmax computes in {params.get('dtype') or zt.dtype}, not float32/bfloat16/float16"
    head = _head(linear, parts, steps)
    if isinstance(head, str):
        return head
    if gather is None and _reshaped_after_selection(steps):
        return ("the log-softmax of reshaped logits, read for its entropy alone: no labels give the entropy's shape "
                "(not fused yet)")
    if gather is not None and entropy is not None and _position(index) > _position(entropy) and any(
            _position(u) < _position(gather) for u in entropy.users):
        return "the entropy is read before the labels are computed"
    products = entropy.args[0].args if entropy is not None else ()  # (exp(lsm or twin), lsm or twin)
    softmaxes = [a.args[0] if is_call(a, torch.exp) else a for a in products]
    written = _written_in_place(linear, parts, [*steps, lsm, *softmaxes], [n for n in (gather, entropy) if n])
    if written:
        return written
    return TokenLogprobsMatch(lsm, linear, parts, gather, index, entropy, *head)


def _written_in_place(linear: fx.Node, parts: tuple[Any, Any, Any], chain: list[fx.Node],
                      readers: list[fx.Node]) -> Optional[str]:
    """Why the op would read other values than the graph did: the head's x, w or bias, the logits (or a view of
    them) or their log-softmax written in place between the linear and the last reader; else None."""
    last = max(readers, key=_position)
    between, node = [], linear.next
    while node is not last and node.op != "output":
        between.append(node)
        node = node.next
    tensors = {n for n in (*parts, linear, *chain) if isinstance(n, fx.Node)}
    writer = mutated_producer(linear.graph, tensors, between)
    return None if writer is None else (f"the head's inputs, its logits or their log-softmax are written in place "
                                        f"({writer.name}) before the last read")


def _position(node: fx.Node) -> int:
    return list(node.graph.nodes).index(node)


def _reshaped_after_selection(steps: list[fx.Node]) -> bool:
    """A view of the logits after their last row selection (or with none): x's rows, which the op's outputs are
    shaped from, no longer have the logits' leading shape (a selection after a view is replayed as a flatten)."""
    last_selection = max((i for i, step in enumerate(steps) if _is_row_step(step)), default=-1)
    return any(_is_view(step) for step in steps[last_selection + 1:])


def _head(linear: fx.Node, parts: tuple[Any, Any, Any], steps: list[fx.Node]
          ) -> Union[tuple[float, float, list[fx.Node]], str]:
    """(softcap, logit scale, row selection) of the logits' chain from ``linear``, or why the op cannot take it."""
    selection = _row_selection(steps)  # logits[:, :-1] and the like: the same rows of x (patterns/cross_entropy.py)
    if isinstance(selection, str):
        return selection
    xt, wt = tensor_of(parts[0]), tensor_of(parts[1])
    if xt is None or wt is None or wt.dim() != 2 or xt.dim() < 2:
        return "the head's input is not rows of hidden states, or its weight not a [V, H] matrix"
    if xt.dtype not in _KERNEL_DTYPES or wt.dtype != xt.dtype:
        return "the head's input and weight are not one float32/bfloat16/float16 dtype"
    scale = _scale_and_softcap(linear, steps)
    if isinstance(scale, str):
        return scale
    if _class_selection(steps, wt.shape[0]) is not None:
        return "the logits' classes are sliced before the log-softmax"
    return scale[0], scale[1], selection


def _logsumexp_of(node: Any, z: fx.Node) -> bool:
    """``node`` is ``logsumexp(z, -1)`` over the last dim, the dim kept (``keep``) or not."""
    if not (isinstance(node, fx.Node) and node.op in ("call_function", "call_method")
            and node.target in (torch.logsumexp, "logsumexp")):
        return False
    params = _args(node, ("input", "dim", "keepdim"))
    dim = params.get("dim")
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    return params.get("input") is z and dim in (-1, tensor_of(z).dim() - 1)


def _row_logsumexps(node: Any, z: fx.Node) -> bool:
    """``node`` is ``stack([logsumexp(z[0], -1), ..., logsumexp(z[B-1], -1)])``: TRL's loop over batch rows."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.stack):
        return False
    params = _args(node, ("tensors", "dim"))
    rows, zt = params.get("tensors"), tensor_of(z)
    if params.get("dim", 0) != 0 or not isinstance(rows, (list, tuple)) or len(rows) != zt.shape[0]:
        return False
    for i, lse in enumerate(rows):
        row = lse.args[0] if isinstance(lse, fx.Node) and lse.args else None
        if not (is_call(row, operator.getitem) and row.args == (z, i)) or not _logsumexp_of(lse, row):
            return False
        if _args(lse, ("input", "dim", "keepdim")).get("keepdim"):
            return False
    return True


def _match_logsumexp(sub: fx.Node) -> Union[TokenLogprobsMatch, str, None]:
    """``gather(z, -1, i) - logsumexp(z, -1, keepdim=True)`` (or its row loop, TRL's selective_log_softmax for
    float32 logits: ``stack([logsumexp(row, -1) for row in z]).unsqueeze(-1)``) for a linear's logits z."""
    if len(sub.args) != 2 or sub.kwargs:
        return None
    gather, lse = sub.args
    if not (isinstance(gather, fx.Node) and gather.op in ("call_function", "call_method")
            and gather.target in (torch.gather, "gather")):
        return None
    z = _args(gather, ("input",)).get("input")
    zt = tensor_of(z)
    chain = _chain_to_linear(z) if zt is not None else None
    index = _gather_index(gather, z) if chain is not None else None
    if index is None:
        return None
    kept = _logsumexp_of(lse, z) and _args(lse, ("input", "dim", "keepdim")).get("keepdim")
    unsqueezed = isinstance(lse, fx.Node) and lse.op in ("call_function", "call_method") and lse.target in (
        torch.unsqueeze, "unsqueeze") and len(lse.args) == 2 and lse.args[1] in (-1, zt.dim() - 1)
    inner = lse.args[0] if unsqueezed else None
    if not (kept or unsqueezed and (_logsumexp_of(inner, z) and not _args(inner, ("input", "dim", "keepdim")).get(
            "keepdim") or _row_logsumexps(inner, z))):
        return None  # a gather of logits minus something else
    if isinstance(index, str):
        return index
    if zt.dtype not in _KERNEL_DTYPES:
        return f"the logits are {zt.dtype}, not float32/bfloat16/float16"
    linear, parts, steps = chain
    head = _head(linear, parts, steps)
    if isinstance(head, str):
        return head
    written = _written_in_place(linear, parts, [*steps, z], [sub])
    if written:
        return written
    return TokenLogprobsMatch(sub, linear, parts, sub, index, None, *head)


def _records_gradient(reader: Optional[fx.Node]) -> bool:
    """Whether the graph's value at ``reader`` (a gather, an entropy's sum) has a gradient: Dynamo's example value
    says, which knows the grad mode of each line and what was computed under it (the log-softmax or the linear
    under ``no_grad``, read outside)."""
    return reader is not None and bool(getattr(tensor_of(reader), "requires_grad", False))


def _placement(m: TokenLogprobsMatch) -> Union[fx.Node, str]:
    """The node the op goes before: the first of the two readers, after the labels (``_match`` checked the
    entropy's readers then). Where that reader is under ``no_grad`` (an entropy logged) and the other one records
    a gradient, autograd must record the op: it goes before the ``no_grad`` block, if its inputs are made there."""
    readers = [n for n in (m.gather, m.entropy_sum) if n is not None]
    first = min((n for n in readers if m.index is None or _position(m.index) < _position(n)), key=_position)
    if grad_enabled_at(first) or not any(_records_gradient(n) for n in readers):
        return first
    inputs = [n for n in (*m.parts, m.index, *m.selection) if isinstance(n, fx.Node)]
    last_input = max(inputs, key=_position)
    node = first.prev
    while node is not last_input and node.op != "root":
        if is_grad_switch(node) and grad_enabled_at(node):
            return node
        node = node.prev
    return "the log-probabilities record a gradient, but their first reader is under no_grad with the labels"


def _dx_in_forward(m: TokenLogprobsMatch, place: fx.Node) -> int:
    """The op's ``dx_in_forward`` (lowering/token_logprobs.py): the log-probabilities' row gradients of x computed in
    the forward when they record a gradient, x gets one and the head none (LoRA's frozen head), and the entropy
    records none (logged under ``no_grad``, or not asked for); else 0, everything recomputed in the backward.

    Why not the entropy's part in the forward too: its second fp32 tile halves the rows a program holds, and on one
    H100 that forward alone took 22.3 ms against 18.8 ms for TRL's whole forward and backward (three matmuls, as
    recomputing is) at 4096 x 4096 x 128256 (benchmarks/results/2026-12-08_issue59_token_logprobs_h100.md); with
    the log-probabilities' part alone the forward took 13.2 ms and the step 14.4 (two matmuls)."""
    lowering = _lowering()
    x, w, b = (tensor_of(p) for p in m.parts)
    if not (grad_enabled_at(place) and x is not None and x.requires_grad) or any(
            t is not None and t.requires_grad for t in (w, b)):
        return 0
    if _records_gradient(m.entropy_sum):
        return 0
    return lowering.LOGP_GRAD if _records_gradient(m.gather) else 0


def _replace(gm: fx.GraphModule, m: TokenLogprobsMatch, first: fx.Node) -> set[fx.Node]:
    """The op on x's rows (the logits' row selection replayed on x, then flattened) and the labels flattened,
    before ``first`` (``_placement``); its log-probabilities in the gather's shape and its negative entropy in the
    sum's, each cast to the dtype the graph had there, and detached where the graph's value had no gradient.
    Shapes come from views of the graph's own tensors (``view_as``), so symbolic sizes stay symbolic."""
    g = gm.graph
    x, w, b = m.parts
    rows_of_x = _select_rows(g, first, x, m.selection, {}) if m.selection else x
    x2 = insert_call(g, first, torch.flatten, (rows_of_x, 0, -2), meta_from=m.linear)  # [N, H]
    if m.index is not None:
        labels = insert_call(g, first, torch.reshape, (m.index, (-1,)), meta_from=m.gather)
    else:  # the entropy alone: any label in range, its log-probability unused
        labels = insert_call(g, first, torch.zeros_like, (insert_call(g, first, torch.select, (x2, 1, 0)),),
                             {"dtype": torch.long}, meta_from=m.entropy_sum)
    entropy = m.entropy_sum is not None
    fused = insert_call(g, first, torch.ops.sloth.linear_token_logprobs.default,
                        (x2, w, b, labels, NO_IGNORED_ROWS, m.softcap, m.logit_scale, 1.0, entropy,
                         _dx_in_forward(m, first)), meta_from=m.log_softmax)
    recording = grad_enabled_at(first)
    if m.gather is not None:
        logp = insert_call(g, first, operator.getitem, (fused, 0), meta_from=m.gather)
        if recording and not _records_gradient(m.gather):
            logp = insert_call(g, first, torch.detach, (logp,), meta_from=m.gather)
        logp = _in_place_of(g, first, logp, m.gather, like=m.index)
        m.gather.replace_all_uses_with(logp)
    if entropy:
        ent = insert_call(g, first, operator.getitem, (fused, 1), meta_from=m.entropy_sum)
        if recording and not _records_gradient(m.entropy_sum):
            ent = insert_call(g, first, torch.detach, (ent,), meta_from=m.entropy_sum)
        neg = insert_call(g, first, torch.neg, (ent,), meta_from=m.entropy_sum)
        # the entropy's shape: the labels' rows where there are labels (any view of the logits keeps them in
        # step), else x's selected rows (``_match`` refused a view after the selection)
        rows_shape = insert_call(g, first, torch.select, (rows_of_x if m.index is None else m.index, -1, 0),
                                 meta_from=m.entropy_sum)
        if m.entropy_sum.args[2]:  # keepdim
            rows_shape = insert_call(g, first, torch.unsqueeze, (rows_shape, -1), meta_from=m.entropy_sum)
        neg = _in_place_of(g, first, neg, m.entropy_sum, like=rows_shape)
        m.entropy_sum.replace_all_uses_with(neg)
    erased: set[fx.Node] = set()
    for read in (m.gather, m.entropy_sum):  # and the log-softmax and the logits' chain, once neither reads them
        if read is not None and read not in erased:
            erased |= erase_unused(read, keep=(x, w, b, m.index), methods=True)
    return erased


def _in_place_of(g: fx.Graph, before: fx.Node, value: fx.Node, old: fx.Node, like: fx.Node) -> fx.Node:
    """``value`` (fp32, flat) viewed as ``like`` and cast to ``old``'s dtype, to stand in for ``old``."""
    node = insert_call(g, before, torch.Tensor.view_as, (value, like), meta_from=old)
    if tensor_of(old).dtype != torch.float32:
        node = insert_call(g, before, cast, (node, tensor_of(old).dtype), meta_from=old)
    inherit_requires_grad(old, node)
    return node


def fuse_token_logprobs_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                             options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace each linear head's log-softmax gathered at labels (and its entropy) with
    ``torch.ops.sloth.linear_token_logprobs``.

    before:  lsm = log_softmax(linear(x, w, b), -1); lp = gather(lsm, -1, i).squeeze(-1); s = sum(exp(lsm) * lsm, -1)
    after:   logp, ent, _ = sloth.linear_token_logprobs(x.reshape(-1, H), w, b, i.reshape(-1), ...);
             lp = logp.reshape(...); s = -ent.reshape(...)
    """
    _lowering().register()
    erased: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in erased:
            continue
        found = _match(node) if _is_log_softmax(node) else _match_logsumexp(node) if is_call(node, torch.sub) \
            else None
        if found is None:
            continue
        place = _placement(found) if not isinstance(found, str) else found
        if isinstance(place, str):
            report.reject(FAMILY, node, place)
            continue
        detail = ({(True, False): "log-probabilities", (True, True): "log-probabilities and entropy",
                   (False, True): "entropy"}[found.gather is not None, found.entropy_sum is not None]
                  + (f", softcap {found.softcap:g}" if found.softcap else "")
                  + (f", logit scale {found.logit_scale:g}" if found.logit_scale != 1.0 else ""))
        erased |= _replace(gm, found, place)
        report.replaced(Site(FAMILY, "sloth.linear_token_logprobs", module_path(node), source_location(node), detail))
    gm.graph.lint()
    gm.recompile()
    return gm


def anchor(node: fx.Node) -> bool:
    """The ``token_logprobs`` family's anchor: a log_softmax of a linear's logits, read by a gather or an exp."""
    return _is_log_softmax(node) and bool(node.args) and _chain_to_linear(node.args[0]) is not None and any(
        u.op in ("call_function", "call_method") and u.target in (torch.gather, "gather", torch.exp, "exp")
        for u in node.users)


DECLARATION = Family(FAMILY, fuse_token_logprobs_pass, order=85, anchor=anchor,
                     emits=("linear_token_logprobs",),
                     summary=("a linear head's log-softmax gathered at labels, with or without its entropy "
                              "(DPO, GRPO and RLOO losses): per-token values without the [N, V] logits"))
