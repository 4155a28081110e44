"""Sink-attention family (``"sink_attention"`` in the report): attention whose softmax has one extra learned logit
per head (GPT-OSS's sinks), written out as matmuls and a softmax, becomes ``sloth.sink_attention``.

The meaning (``sink_attention_pattern``, GPT-OSS's ``eager_attention_forward``)::

    s      = (q @ repeat_kv(k).transpose(-2, -1)) * scale + M
    logits = cat([s, sinks.reshape(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    p      = softmax(logits - max(logits, -1), dim=-1)[..., :-1]
    out    = dropout(p, 0) @ repeat_kv(v)
        == sink_attention(q, k, v, sinks, window_bounds(q, W), scale)

whenever M (bool, or additive 0 / -inf / the dtype's lowest value) allows exactly the causal sliding window
``i - W < j <= i`` for some W (W >= T: plain causal). Subtracting the row max changes no softmax; the op
computes in fp32 whatever the dtype (eager's bf16 softmax is less exact than the op, not more).

Why: no SDPA backend takes sinks, so transformers runs this attention eagerly, [B, H, T, T + 1] scores and all
(61 of the 157 ms of sloth's GPT-OSS-20B step on the H200 before this family, and most of its memory).

How the mask is proven: as the causal-mask family proves its masks (patterns/causal_mask.py): its producers must
be a closed computation (no graph input, parameter, random draw or symbolic size), evaluated once at compile
time (a block of query rows at a time when it is too large: patterns/mask_rows.py); each row must allow one
interval of keys ending at the diagonal, its start max(0, i - W + 1) for one W. The bounds are then computed
in the graph from q's shape (``window_bounds``): the op never reads the mask. A mask that reads the user's
``attention_mask`` (padding), any other shape, no mask at all (bidirectional attention: the kernel's rows are
causal) or a key length other than the query's (a KV cache) stays, with the reason. In a checkpointed layer the
mask is the layer's input: every call site must pass a mask proven to the same window (it stays passed).
"""
from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.canonicalize import cast
from ..compiler.fx_utils import (op_name, arg_of, insert_call, is_function, is_last_dim, is_method, is_number,
                                 module_path,
                                 replace_and_erase, softmax_input, source_location, tensor_of)
from ..compiler.options import PassOptions
from ..compiler.families import Family
from ..compiler.report import Report, Site
from ..lowering import document_attention as document_attention_op
from ..lowering import sink_attention as sink_attention_op
from .causal_mask import (_closed_producers, _evaluate, _is_symbolic, _value_bytes, _body_operands, allowed_of,
                          erase_unused, evaluation_budget)
from .gqa_attention import repeated_heads
from .mask_rows import RowBlocks

FAMILY = "sink_attention"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MATMUL = (torch.matmul, operator.matmul)


def sink_attention_pattern(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                           mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The meaning, as plain PyTorch: GPT-OSS's eager attention with sinks (k, v with H / G heads each)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = torch.matmul(q, k.transpose(2, 3)) * scale + mask
    logits = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.matmul(F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(v.dtype), v)


# ---------------------------------------------------------------------------------------------------
# Reading the chain.
# ---------------------------------------------------------------------------------------------------

def _unstabilised(x: fx.Node) -> fx.Node:
    """``x`` with a subtraction of its own row max taken off (``x - x.max(-1, keepdim=True).values``, ``amax``)."""
    if not is_function(x, torch.sub, operator.sub) or len(x.args) != 2 or x.kwargs:
        return x
    base, peak = x.args
    if is_function(peak, operator.getitem) and peak.args[1] == 0 and (is_method(peak.args[0], "max")
                                                                 or is_function(peak.args[0], torch.max)):
        peak = peak.args[0]
    elif not (is_method(peak, "amax") or is_function(peak, torch.amax)):
        return x
    if not peak.args or peak.args[0] is not base:
        return x
    value = tensor_of(base)
    dim = arg_of(peak, 1, "dim")
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    if value is None or not is_last_dim(dim, value.dim()) or not arg_of(peak, 2, "keepdim", False):
        return x
    return base


def sink_cat(node: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    """(scores, sink column) of the softmax ``node`` whose input (less its row max) is cat([scores, column], -1)
    with a column of width 1, else None: the family's anchor."""
    x = softmax_input(node)
    if x is None:
        return None
    x = _unstabilised(x)
    if not is_function(x, torch.cat) or len(x.args) < 1 or not isinstance(x.args[0], (list, tuple)) \
            or len(x.args[0]) != 2:
        return None
    value = tensor_of(x)
    if value is None or not is_last_dim(arg_of(x, 1, "dim", 0), value.dim()):
        return None
    scores, column = x.args[0]
    column_value = tensor_of(column)
    if column_value is None or column_value.shape[-1] != 1:
        return None
    return scores, column


def is_sink_attention(node: fx.Node) -> bool:
    """Where the matcher starts: a softmax over cat([scores, one column]) along the last dim, less its row max."""
    return sink_cat(node) is not None


def _repeated_from(node: Any) -> Any:
    """The key / value heads ``node`` repeats in place to every query head (transformers' ``repeat_kv``,
    ``repeat_interleave(x, G, 1)`` and the other spellings ``repeated_heads`` checks by shape), else ``node``."""
    repeated = repeated_heads(node)
    return node if repeated is None else repeated[0]


def _transposed(node: Any) -> Optional[Any]:
    """x for x.transpose(-2, -1) of a 4-D x (any spelling of the two last dims), else None."""
    if not (is_method(node, "transpose") or is_function(node, torch.transpose)) or len(node.args) != 3:
        return None
    value = tensor_of(node.args[0])
    if value is None or value.dim() != 4 or {d % 4 for d in node.args[1:] if isinstance(d, int)} != {2, 3}:
        return None
    return node.args[0]


def _scaled_scores(node: Any) -> Optional[tuple[fx.Node, Any, float, list[fx.Node]]]:
    """(q, k before repeat_kv, scale, the chain's nodes) of ``(q @ k.T) * scale`` (or ``/ d``, or no scale)."""
    chain = []
    scale = 1.0
    if is_function(node, torch.mul, operator.mul) and len(node.args) == 2:
        a, b = node.args
        if is_number(b):
            chain, scale, node = [node], float(b), a
        elif is_number(a):
            chain, scale, node = [node], float(a), b
    elif is_function(node, torch.div, operator.truediv) and len(node.args) == 2 and is_number(node.args[1]) \
            and not node.kwargs:
        chain, scale, node = [node], 1.0 / float(node.args[1]), node.args[0]
    if not is_function(node, *_MATMUL) or len(node.args) != 2:
        return None
    k_t = _transposed(node.args[1])
    if k_t is None:
        return None
    chain.append(node)
    return node.args[0], _repeated_from(k_t), scale, chain


def _blocking(value: Any) -> bool:
    """Whether a fill value blocks attention: -inf, or a float at or below fp16's lowest (no score gets there)."""
    return is_number(value) and float(value) <= torch.finfo(torch.float16).min


def _masked_scores(node: Any) -> Optional[tuple[Any, fx.Node, str]]:
    """(the scores, the mask, how it reads) of a masked score node: ``s + M`` ("additive": 0 / -inf),
    ``s.masked_fill(M, -inf)`` ("blocked": True where not attended), ``where(M, s, -inf)`` ("allowed"); else
    None."""
    if is_function(node, torch.add, operator.add) and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        return (a, b, "additive") if _scaled_scores(a) is not None else (b, a, "additive")
    if (is_method(node, "masked_fill") or is_function(node, torch.masked_fill)) and len(node.args) == 3 \
            and isinstance(node.args[1], fx.Node) and _blocking(node.args[2]):
        return node.args[0], node.args[1], "blocked"
    if is_function(node, torch.where) and len(node.args) == 3 and isinstance(node.args[0], fx.Node) \
            and _blocking(node.args[2]):
        return node.args[1], node.args[0], "allowed"
    return None


class _Site:
    """One match: the nodes read and replaced, and what the op needs."""

    def __init__(self) -> None:
        self.q = self.k = self.v = self.sink_source = self.mask = None
        self.polarity = "additive"  # how the mask reads (``_masked_scores``)
        self.scale = 1.0
        self.chain: list[fx.Node] = []  # the nodes the op replaces, each read only inside the chain
        self.out: Optional[fx.Node] = None


def _match(softmax: fx.Node) -> tuple[Optional[_Site], Optional[str]]:
    """(the site, None) for GPT-OSS's chain around ``softmax`` (an anchor), else (None, why not)."""
    site = _Site()
    scores, column = sink_cat(softmax)
    stabilised = softmax.args[0]
    concatenated = _unstabilised(stabilised)
    site.chain = [concatenated, softmax]
    if stabilised is not concatenated:
        peak = stabilised.args[1]
        site.chain += [stabilised, peak]
        if is_function(peak, operator.getitem):  # max's (values, indices): the indices unread (Dynamo keeps them in bodies)
            site.chain += [peak.args[0], *(u for u in peak.args[0].users if u is not peak and not u.users)]
    # After the softmax: drop the sink's column, an optional dropout of 0 and cast, then @ v.
    users = list(softmax.users)
    after = users[0] if len(users) == 1 else None
    value = tensor_of(scores)
    t_keys = value.shape[-1]
    if not (is_function(after, torch.narrow) and after.args[1:] in ((-1, 0, t_keys), (value.dim() - 1, 0, t_keys))):
        return None, "the softmax's output is read other than by dropping the sink's column ([..., :-1])"
    site.chain.append(after)
    node = after
    while True:
        users = list(node.users)
        if len(users) != 1:
            return None, ("the attention probabilities are read outside the attention (output_attentions, or "
                          "another use)")
        user = users[0]
        if is_function(user, F.dropout, torch.dropout):
            p, training = arg_of(user, 1, "p", 0.5), arg_of(user, 2, "training", True)
            if not (is_number(p) and p == 0) and training is not False:
                return None, f"attention dropout ({p}) is on"
        elif not (is_function(user, cast) or is_method(user, "to", "type_as")):
            break
        site.chain.append(user)
        node = user
    if not is_function(user, *_MATMUL) or len(user.args) != 2 or user.args[0] is not node:
        return None, "the probabilities are not multiplied by the values (p @ v)"
    site.out = user
    site.v = _repeated_from(user.args[1])
    # Before the cat: the scores, with or without a mask (added, or filled in with -inf).
    masked = _masked_scores(scores)
    if masked is not None:
        inner, site.mask, site.polarity = masked
        parts = _scaled_scores(inner)
        site.chain.append(scores)
    else:
        parts = _scaled_scores(scores)
    if parts is None:
        return None, "the scores are not (q @ k.transpose(-2, -1)) * scale [+ mask]"
    site.q, site.k, site.scale, chain = parts
    site.chain += chain
    # The sink column: one value per head, broadcast over the batch and the tokens.
    source = column
    while is_method(source, "expand") or is_function(source, torch.broadcast_to):
        source = source.args[0]
    heads = tensor_of(site.q).shape[1]
    sink_value = tensor_of(source)
    if sink_value is None or sink_value.numel() != heads or sink_value.dim() > 4 \
            or (sink_value.dim() >= 3 and sink_value.shape[-3] != heads):
        return None, (f"the extra logit column is not one value per query head broadcast over the batch and the "
                      f"tokens (it comes from a {tuple(sink_value.shape) if sink_value is not None else '?'} value)")
    site.sink_source = source
    for node in site.chain:
        if node is not site.out and any(u not in site.chain and u is not site.out for u in node.users):
            return None, f"{node.name} is read outside the attention"
    return site, None


def _refusal(site: _Site) -> Optional[str]:
    """Why the matched site cannot become the op whatever its mask, or None."""
    q, k, v = (tensor_of(n) for n in (site.q, site.k, site.v))
    if q is None or k is None or v is None or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k and v are not all [batch, heads, tokens, head_dim] tensors"
    if any(_is_symbolic(t) for t in (q, k, v)):
        return "a length is symbolic (dynamic shapes)"
    if q.shape[2] != k.shape[2]:
        return f"queries ({q.shape[2]}) and keys ({k.shape[2]}) differ in length (a KV cache or cross-attention)"
    if k.shape != v.shape or k.shape[-1] != q.shape[-1] or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} do not pair with q {tuple(q.shape)}"
    out = tensor_of(site.out)
    if out is None or out.dtype not in _DTYPES or any(t.dtype not in _DTYPES for t in (q, k, v)):
        return "dtypes other than fp32, bf16 and fp16"
    if q.shape[-1] > document_attention_op.MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} is above the kernel's {document_attention_op.MAX_HEAD_DIM}"
    if site.mask is None:
        return "no mask: bidirectional attention (the kernel's rows are causal)"
    if not isinstance(site.mask, fx.Node):
        return "the mask is not a tensor"
    return None


# ---------------------------------------------------------------------------------------------------
# Proving the mask a causal sliding window.
# ---------------------------------------------------------------------------------------------------

def _row_starts(allowed: torch.Tensor, first_row: int, q_len: int) -> tuple[Optional[torch.Tensor], Optional[str]]:
    """(start [R] of rows first_row.. when each allows exactly [start, i], the same in every batch row and head,
    None), else (None, why not)."""
    if allowed.dim() < 2 or allowed.shape[-1] != q_len:
        return None, f"its shape {tuple(allowed.shape)} does not end in [{q_len}, {q_len}]"
    rows = allowed.shape[-2]
    flat = allowed.reshape(-1, rows, q_len)
    if not bool((flat == flat[:1]).all()):
        return None, "it differs between batch rows or heads (padding, or per-example masks)"
    block = flat[0]
    i = torch.arange(first_row, first_row + rows, device=block.device)
    if rows == 1 and q_len > 1 and allowed.shape[-2] == 1:
        return None, "it is the same for every query row (not causal)"
    start = block.int().argmax(-1)
    j = torch.arange(q_len, device=block.device)
    expected = (j[None, :] >= start[:, None]) & (j[None, :] <= i[:, None])
    if not torch.equal(block, expected):
        return None, "its rows are not one interval of keys ending at the query (not a causal or sliding window)"
    return start, None


def window_reason(starts: torch.Tensor, q_len: int) -> tuple[Optional[int], Optional[str]]:
    """(W, None) when the row starts are max(0, i - W + 1) (W = q_len: plain causal), else (None, why not)."""
    window = q_len if int(starts[-1]) == 0 else q_len - int(starts[-1])
    i = torch.arange(q_len, device=starts.device)
    if not torch.equal(starts.long(), (i - window + 1).clamp_min(0)):
        return None, "its rows start where no single sliding window puts them (a prefix, chunks or another mask)"
    return window, None


class _Prover:
    """The window each mask node allows (or why none), once per mask node and length."""

    def __init__(self) -> None:
        self.found: dict[tuple[fx.Node, int, str], tuple[Optional[int], Optional[str], list[fx.Node]]] = {}

    def check(self, gm: fx.GraphModule, mask: Any, q_len: int,
              polarity: str) -> tuple[Optional[int], Optional[str], list[fx.Node]]:
        """(W, None, the mask's producers), or (None, why not, []); ``polarity`` as ``_masked_scores`` says."""
        if not isinstance(mask, fx.Node):
            return None, "the call site passes no mask node", []
        key = (mask, q_len, polarity)
        if key not in self.found:
            self.found[key] = self._check(gm, mask, q_len, polarity)
        return self.found[key]

    @staticmethod
    def _check(gm: fx.GraphModule, mask: fx.Node, q_len: int,
               polarity: str) -> tuple[Optional[int], Optional[str], list[fx.Node]]:
        producers, why_not = _closed_producers(mask)
        if why_not:
            return None, why_not, []
        example = tensor_of(mask)
        if example is None or example.dim() < 2 or example.shape[-1] != q_len or example.shape[-2] not in (1, q_len):
            return None, f"its shape does not end in [{q_len}, {q_len}]", []
        device = example.device
        needed = sum(_value_bytes(n) for n in producers) + 3 * example.numel()
        plan = None
        if needed > evaluation_budget(device):
            plan, by_rows_not = RowBlocks.build(producers, mask)
            if plan is None:
                return None, (f"evaluating it at compile time would hold {needed / 2**30:.1f} GiB, over sloth's "
                              f"budget, and it cannot be evaluated by rows: {by_rows_not}"), []
        try:
            starts = []
            for first_row, value in (plan.blocks() if plan is not None else [(0, _evaluate(gm, producers, mask))]):
                if not isinstance(value, torch.Tensor):
                    return None, f"the mask is a {type(value).__name__}, not a tensor", []
                if polarity == "additive":
                    allowed, why_not = allowed_of(value)
                    if why_not:
                        return None, why_not, []
                elif value.dtype != torch.bool:
                    return None, f"the mask selecting the filled scores is {value.dtype}, not bool", []
                else:
                    allowed = value if polarity == "allowed" else ~value
                start, why_not = _row_starts(allowed, first_row, q_len)
                if why_not:
                    return None, why_not, []
                starts.append(start)
            window, why_not = window_reason(torch.cat(starts), q_len)
        except Exception as error:  # an op that cannot run outside the graph: leave it as it was
            return None, f"evaluating it at compile time failed ({type(error).__name__}: {error})", []
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return (window, None, producers) if why_not is None else (None, why_not, [])


# ---------------------------------------------------------------------------------------------------
# The pass.
# ---------------------------------------------------------------------------------------------------

def _replace(site: _Site, window: int) -> fx.Node:
    """Insert the op for ``site`` before its output and erase the chain; returns the op's output node."""
    graph = site.out.graph
    before = site.out
    dtype = tensor_of(site.out).dtype
    qkv = [n if tensor_of(n).dtype == dtype else insert_call(graph, before, cast, (n, dtype), meta_from=before)
           for n in (site.q, site.k, site.v)]
    heads = tensor_of(site.q).shape[1]
    sinks = insert_call(graph, before, torch.reshape, (site.sink_source, (heads,)), meta_from=before)
    bounds = insert_call(graph, before, torch.ops.sloth.window_bounds.default, (qkv[0], window), meta_from=before)
    pair = insert_call(graph, before, torch.ops.sloth.sink_attention.default,
                       (*qkv, sinks, bounds, float(site.scale)), meta_from=before)
    out = insert_call(graph, before, operator.getitem, (pair, 0), meta_from=before)
    replace_and_erase(site.out, out, keep=[site.q, site.k, site.v, site.sink_source, site.mask])
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted((n for n in site.chain if not getattr(n, "_erased", False)), key=order.__getitem__,
                       reverse=True):  # the chain's method calls (``x.softmax(-1)``), which that walk leaves
        if not node.users:
            graph.erase_node(node)
    return out


def fuse_sink_attention_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                             options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace every attention with sinks whose mask is a proven causal window, in ``gm`` and its checkpointed
    bodies (module docstring)."""
    prover = _Prover()
    bodies = _body_operands(gm)
    for graph_module in [gm, *bodies]:
        call_sites = bodies.get(graph_module)
        placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        changed = False
        for node in list(graph_module.graph.nodes):
            if getattr(node, "_erased", False) or not is_sink_attention(node):
                continue
            site, why_not = _match(node)
            why_not = why_not or _refusal(site)
            window, producers = None, []
            if why_not is None:
                q_len = tensor_of(site.q).shape[2]
                if site.mask.op == "placeholder" and call_sites:
                    position = placeholders.index(site.mask)
                    found = [prover.check(caller, operands[position] if position < len(operands) else None, q_len,
                                          site.polarity) for caller, operands in call_sites]
                    why_not = next((why for _, why, _ in found if why), None)
                    windows = {w for w, _, _ in found}
                    if why_not is None and len(windows) != 1:
                        why_not = "its call sites pass masks of different windows"
                    window = next(iter(windows)) if why_not is None else None
                else:
                    window, why_not, producers = prover.check(graph_module, site.mask, q_len, site.polarity)
            if why_not:
                report.reject(FAMILY, node, f"attention with sinks left as it was: {why_not}")
                continue
            sink_attention_op.register()
            out = _replace(site, window)
            erase_unused(producers)
            changed = True
            q = tensor_of(site.q)
            kind = "causal" if window >= q.shape[2] else f"sliding window of {window}"
            report.replaced(Site(FAMILY, "sloth.sink_attention", module_path(out), source_location(out),
                                 f"{q.shape[1]} heads over {tensor_of(site.k).shape[1]}, {kind}, {q.shape[2]} tokens, "
                                 "scores never materialised"))
        if changed:
            graph_module.graph.lint()
            graph_module.recompile()
    return gm


# The family's anchor (compiler/anchors.py): where its sites are, more broadly than its matchers take them.
def anchor(node: fx.Node) -> bool:
    """The ``sink_attention`` family's anchor: a softmax over the last dim of cat([x, c], -1) with c one column wide
    (through a subtraction of anything: the row max): attention with a sink logit per row (GPT-OSS)"""
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


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_sink_attention_pass, order=120, anchor=anchor, whole_module=True,
                     emits=("sink_attention", "window_bounds"),
                     summary=("attention with a learned sink logit per head (GPT-OSS) under a causal sliding-window "
                              "mask"))
