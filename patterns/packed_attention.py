"""Packed-attention family (``"packed_attention"`` in the report): SDPA with a document-causal mask built from
position ids (or document ids) becomes ``sloth.document_attention``, reading document bounds built once per
batch.

The meaning::

    scaled_dot_product_attention(q, k, v, attn_mask=M(ids))
        == document_attention(q, k, v, document_bounds(ids, rule), scale)

whenever M(ids)[b, :, i, j] allows exactly ``start(ids)[b, i] <= j <= i`` for every ids, ``start`` being the
first token of i's document under one of runtime/packing.py's rules ("position_reset" is transformers'
packed-sequence mask: documents start where ``diff(position_ids) != 1``; "position_zero" where the position
is 0; "id_change" where a document id changes). transformers builds such a mask for every packed batch
(``DataCollatorWithFlattening``, TRL's ``padding_free`` / ``packing``: position ids, no attention mask): under
Dynamo it always builds it, since ``find_packed_sequence_indices`` cannot look at the values while tracing.
The dense mask is [B, 1, T, T] (256 MiB of bools at 16k tokens) and SDPA computes every score under it;
the op visits only each document's causal triangle, and the graph builds no mask at all.

How it is checked. The mask cannot be evaluated once, as the causal-mask family does: it depends on the
ids, which change every batch. sloth requires that the mask be a function of one integer graph input (the
ids: no other input, no parameter, buffer, submodule, random draw or symbolic size), evaluates that function
at compile time on a fixed set of probe ids (below), and compares each result with the rule's mask on the
same ids, element by element. A rule that matches on every probe is taken; none matching leaves the mask as
it was with the reason. The probes are chosen to tell the rules and their usual variants apart: one
document per row (a sliding window or a prefix shows), continued positions (``arange + 5``), all zeros
(length-1 documents, TRL's padding), random packings with and without a padded tail, positions that jump
without resetting to 0, decreasing positions, random small ids with repeats, nondecreasing ids. The first
probe is one document of all T tokens, so a window narrower than T shows there (one of T or more changes
nothing). This is a test of the mask's function, not a proof: a mask that follows a rule on these inputs and
not on some other (one that treats a position value no probe holds specially, say) would be taken. A mask too
large to evaluate whole within the causal-mask family's budget (a 128k-token packed batch: 16 GiB of bools a
probe) is evaluated a block of query rows at a time (patterns/mask_rows.py) and each block compared with the
same rows of the rule's mask; one that cannot be made by rows stays, with both reasons.

A checkpointed layer receives the mask as an input: the caller then passes the bounds in its place, when
every call site passes a document-causal mask there and the body reads it only in the SDPA calls rewritten.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from ..compiler.anchors import reads_integer_input
from ..compiler.canonicalize import cast
from ..compiler.fx_utils import insert_call, module_path, set_value, source_location, tensor_of, value_of
from ..compiler.options import PassOptions
from ..compiler.report import Report, Site
from ..compiler.writes import body_of
from ..lowering import document_attention as document_attention_op
from ..runtime.packing import RULES, document_bounds
from .causal_mask import (_SDPA, _is_symbolic, _value_bytes, allowed_of, erase_unused, evaluation_budget,
                          mask_producers)
from .mask_rows import RowBlocks

FAMILY = "packed_attention"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Probes per kind of random packing (each row drawn separately, one fixed seed).
_RANDOM_PACKINGS = 4


def packed_attention_pattern(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                             scale: Optional[float] = None) -> torch.Tensor:
    """The meaning, as plain PyTorch: SDPA under the dense document-causal mask."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _sdpa_arguments(node: fx.Node) -> Optional[dict[str, Any]]:
    """SDPA's arguments by name (defaults filled in), or None for another node."""
    if node.op != "call_function" or node.target not in _SDPA:
        return None
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    values: dict[str, Any] = dict(zip(names, node.args))
    values.update(node.kwargs)
    for name, default in (("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None),
                          ("enable_gqa", False)):
        values.setdefault(name, default)
    return values


def probe_ids(shape: Sequence[int], dtype: torch.dtype, device: Any) -> list[torch.Tensor]:
    """The probe ids of the module docstring, each of ``shape`` (its last dimension the tokens)."""
    t = shape[-1]
    rows = max(1, math.prod(shape) // t)
    generator = torch.Generator().manual_seed(0)

    def packing(pad_tail: bool) -> torch.Tensor:
        out = []
        for _ in range(rows):
            row: list[torch.Tensor] = []
            filled = t - (int(torch.randint(1, max(2, t // 3), (1,), generator=generator)) if pad_tail else 0)
            while sum(len(r) for r in row) < filled:
                length = int(torch.randint(1, max(2, t // 2), (1,), generator=generator))
                row.append(torch.arange(min(length, filled - sum(len(r) for r in row))))
            row.append(torch.zeros(t - filled, dtype=torch.long))  # TRL's pads: position 0 each
            out.append(torch.cat(row))
        return torch.stack(out)

    def jumps() -> torch.Tensor:
        out = []
        for _ in range(rows):
            row, start = [], 3
            while sum(len(r) for r in row) < t:
                length = int(torch.randint(1, max(2, t // 2), (1,), generator=generator))
                row.append(torch.arange(start, start + length))
                start += length + int(torch.randint(2, 9, (1,), generator=generator))
            out.append(torch.cat(row)[:t])
        return torch.stack(out)

    arange = torch.arange(t).expand(rows, t)
    probes = [arange, arange + 5, torch.zeros(rows, t, dtype=torch.long), arange.flip(-1), jumps(),
              torch.randint(0, 4, (rows, t), generator=generator),
              (torch.rand(rows, t, generator=generator) < 0.2).long().cumsum(-1)]
    probes += [packing(pad_tail=False) for _ in range(_RANDOM_PACKINGS)]
    probes += [packing(pad_tail=True) for _ in range(_RANDOM_PACKINGS)]
    return [p.reshape(shape).to(dtype=dtype, device=device) for p in probes]


def _evaluator(gm: fx.GraphModule, producers: list[fx.Node], ids: fx.Node, mask: fx.Node) -> fx.GraphModule:
    """A graph module computing ``mask`` from ``ids`` with ``producers``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in producers:
        env[node] = graph.placeholder("ids") if node is ids else graph.node_copy(node, env.__getitem__)
    graph.output(env[mask])
    return fx.GraphModule(gm, graph)


def _rule_of(gm: fx.GraphModule, producers: list[fx.Node], ids: fx.Node, mask: fx.Node, q_len: int,
             plan: Optional[RowBlocks] = None) -> tuple[Optional[str], Optional[str]]:
    """(the rule the mask follows on every probe, None) or (None, why none does).

    Each probe's mask is evaluated whole, or with ``plan`` a block of query rows at a time (a mask too large to
    hold: a packed batch of 128k tokens is 16 GiB of bools; patterns/mask_rows.py), and each block compared with
    the same rows of every rule's mask, start[b, i] <= j <= i."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    ids_value = tensor_of(ids)
    evaluate = _evaluator(gm, producers, ids, mask) if plan is None else None
    candidates = list(RULES)
    failed: dict[str, int] = {}
    with unset_fake_temporarily(), torch.no_grad():
        for index, probe in enumerate(probe_ids(tuple(ids_value.shape), ids_value.dtype, ids_value.device)):
            bounds = {rule: document_bounds(probe.reshape(-1, q_len), rule) for rule in candidates}
            for first_row, value in (plan.blocks({ids: probe}) if plan is not None else [(0, evaluate(probe))]):
                if not isinstance(value, torch.Tensor):
                    return None, f"the mask is a {type(value).__name__}, not a tensor"
                allowed, why_not = allowed_of(value)
                if why_not:
                    return None, why_not
                rows_ok = plan is not None or (allowed.dim() >= 2 and allowed.shape[-2] == q_len)
                if allowed.dim() < 2 or allowed.shape[-1] != q_len or not rows_ok:
                    return None, f"its shape {tuple(allowed.shape)} does not end in [{q_len}, {q_len}]"
                for rule in list(candidates):
                    reference = document_attention_op.allowed_from_bounds(bounds[rule], first_row, allowed.shape[-2])
                    shape = torch.broadcast_shapes(allowed.shape, reference.shape)
                    if not torch.equal(allowed.expand(shape), reference.expand(shape)):
                        candidates.remove(rule)
                        failed[rule] = index
                if not candidates:
                    return None, ("it is not document-causal under any rule (" + ", ".join(
                        f"{rule}: differs on probe {i}" for rule, i in failed.items())
                        + "; a window, a prefix, padding or another mask)")
    return candidates[0], None


class _Checker:
    """Finds, once per mask node, the ids it is built from and the rule it follows (or why not)."""

    def __init__(self) -> None:
        self.found: dict[tuple[fx.Node, int], tuple[Optional[fx.Node], Optional[str], Optional[str], list]] = {}

    def check(self, gm: fx.GraphModule, mask: Any, q_len: int) -> tuple[Optional[fx.Node], Optional[str],
                                                                         Optional[str], list[fx.Node]]:
        """(ids node, rule, None, producers) for a document-causal mask, else (None, None, why not, [])."""
        if not isinstance(mask, fx.Node):
            return None, None, "the call site passes no mask node", []
        key = (mask, q_len)
        if key not in self.found:
            self.found[key] = self._check(gm, mask, q_len)
        return self.found[key]

    @staticmethod
    def _check(gm: fx.GraphModule, mask: fx.Node, q_len: int):
        producers, inputs, why_not = mask_producers(mask)
        if why_not:
            return None, None, why_not, []
        tensors = [n for n in inputs if tensor_of(n) is not None]
        if not tensors:
            return None, None, "it reads no graph input (a fixed mask: the causal-mask family's case)", []
        if len(tensors) > 1:
            return None, None, ("it reads more than one graph input (" + ", ".join(str(n.target) for n in tensors)
                                + "): a padding mask with the positions, or another mask"), []
        ids = tensors[0]
        value = tensor_of(ids)
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool \
                or value.dim() not in (1, 2) or value.shape[-1] != q_len:
            return None, None, (f"it is computed from {ids.target!r} ({value.dtype} {tuple(value.shape)}), "
                                f"not from [batch, {q_len}] integer ids"), []
        example = tensor_of(mask)
        numel = example.numel() if example is not None else 0
        needed = sum(_value_bytes(n) for n in producers) + 4 * numel
        budget = evaluation_budget(value.device)
        plan = None
        if needed > budget:
            plan, by_rows_not = RowBlocks.build(producers, mask)
            if plan is None:
                return None, None, (f"checking it at compile time would hold up to {needed / 2**30:.1f} GiB on "
                                    f"{value.device}, more than sloth allows itself ({budget / 2**30:.1f} GiB), and "
                                    f"it cannot be checked a block of rows at a time: {by_rows_not}"), []
        try:
            rule, why_not = _rule_of(gm, producers, ids, mask, q_len, plan)
        except Exception as error:  # an op that cannot run outside the graph: leave it as it was
            return None, None, f"evaluating it on probe ids failed ({type(error).__name__}: {error})", []
        finally:
            if value.device.type == "cuda":
                torch.cuda.empty_cache()
        if why_not:
            return None, None, why_not, []
        return ids, rule, None, [n for n in producers if n is not ids]


def _refusal(node: fx.Node, args: dict[str, Any]) -> Optional[str]:
    """Why this SDPA call cannot become the op whatever its mask, or None."""
    q, k, v = (tensor_of(args[name]) for name in ("query", "key", "value"))
    if q is None or k is None or v is None or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k and v are not all [batch, heads, tokens, head_dim] tensors"
    if any(_is_symbolic(t) for t in (q, k, v)):
        return "the query or key length is symbolic (dynamic shapes)"
    if q.shape[2] != k.shape[2]:
        return f"queries ({q.shape[2]}) and keys ({k.shape[2]}) differ in length (a KV cache or cross-attention)"
    if k.shape != v.shape or k.shape[-1] != q.shape[-1] or q.shape[0] != k.shape[0]:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} do not pair with q {tuple(q.shape)}"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key heads"
    # The op computes in the dtype SDPA's result has: the inputs' one, or autocast's (which casts all three to it;
    # the replacement casts them explicitly, as custom ops get no autocast casts).
    out = tensor_of(node)
    if out is None or out.dtype not in _DTYPES or any(t.dtype not in _DTYPES for t in (q, k, v)):
        return (f"dtypes {q.dtype}, {k.dtype}, {v.dtype} -> {out.dtype if out is not None else '?'} (the op takes "
                "fp32, bf16 and fp16)")
    if q.shape[-1] > document_attention_op.MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} is above the kernel's {document_attention_op.MAX_HEAD_DIM}"
    if not (isinstance(args["dropout_p"], (int, float)) and args["dropout_p"] == 0):
        return f"attention dropout ({args['dropout_p']}) is on"
    if args["is_causal"] is not False:
        return "is_causal is set as well as a mask"
    if args["scale"] is not None and not isinstance(args["scale"], (int, float)):
        return "the scale is not a constant"
    return None


def _body_sites(gm: fx.GraphModule) -> dict[fx.GraphModule, list[tuple[fx.GraphModule, fx.Node]]]:
    """For each checkpointed body in ``gm``: (caller, call node) per call site."""
    sites: dict[fx.GraphModule, list[tuple[fx.GraphModule, fx.Node]]] = {}
    for node in gm.graph.nodes:
        body = body_of(node)
        if body is not None:
            sites.setdefault(body, []).append((gm, node))
    return sites


class _Bounds:
    """One ``document_bounds`` node per (graph, ids, rule, batch), inserted before its first reader."""

    def __init__(self) -> None:
        self.nodes: dict[tuple[fx.Graph, fx.Node, str, int], fx.Node] = {}

    def get(self, graph: fx.Graph, ids: fx.Node, rule: str, batch: int, before: fx.Node) -> fx.Node:
        key = (graph, ids, rule, batch)
        if key not in self.nodes:
            self.nodes[key] = insert_call(graph, before, document_bounds, (ids, rule, batch), meta_from=before)
        return self.nodes[key]


def _replace(node: fx.Node, args: dict[str, Any], bounds: fx.Node) -> fx.Node:
    q = tensor_of(args["query"])
    scale = float(args["scale"]) if args["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    op = torch.ops.sloth.document_attention.default
    graph = node.graph
    dtype = tensor_of(node).dtype
    qkv = [a if tensor_of(a).dtype == dtype else insert_call(graph, node, cast, (a, dtype), meta_from=node)
           for a in (args["query"], args["key"], args["value"])]
    pair = insert_call(graph, node, op, (*qkv, bounds, scale), meta_from=node)
    out = insert_call(graph, node, operator.getitem, (pair, 0), meta_from=node)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return out


def _reads_inputs(mask: Any) -> bool:
    """Whether ``mask`` is computed from an integer graph input (position ids, document ids, or a padding mask,
    which the check then refuses): this family's sites, its anchors (compiler/anchors.py). A fixed mask is the
    causal-mask family's; a bool or float mask passed in whole, or one that reads a buffer, neither takes."""
    return isinstance(mask, fx.Node) and reads_integer_input(mask)


def fuse_packed_attention_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                               options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace every SDPA whose mask is document-causal in ``ids`` (in ``gm`` and in its checkpointed bodies)."""
    checker, bounds = _Checker(), _Bounds()
    bodies = _body_sites(gm)
    changed: set[fx.GraphModule] = set()
    for graph_module in [gm, *bodies]:
        call_sites = bodies.get(graph_module)
        placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        for node in list(graph_module.graph.nodes):
            args = None if getattr(node, "_erased", False) else _sdpa_arguments(node)  # a reader rewritten already
            if args is None or not isinstance(args["attn_mask"], fx.Node):
                continue
            mask = args["attn_mask"]
            in_body = mask.op == "placeholder" and bool(call_sites)
            if in_body:
                position = placeholders.index(mask)
                if not any(_reads_inputs(call.args[1 + position]) for _, call in call_sites
                           if position + 1 < len(call.args)):
                    continue
            elif not _reads_inputs(mask):
                continue
            why_not = _refusal(node, args)
            q_len = tensor_of(args["query"]).shape[2] if why_not is None else 0
            if why_not is None and in_body:
                why_not = _rewrite_body_input(graph_module, node, args, mask, position, call_sites,
                                              checker, bounds, q_len, report)
                if why_not is None:
                    changed |= {graph_module, *(caller for caller, _ in call_sites)}
                    continue
            elif why_not is None:
                ids, rule, why_not, producers = checker.check(graph_module, mask, q_len)
                if why_not is None:
                    document_attention_op.register()
                    batch = tensor_of(args["query"]).shape[0]
                    bound = bounds.get(graph_module.graph, ids, rule, batch, before=mask)
                    out = _replace(node, args, bound)
                    erase_unused(producers)
                    changed.add(graph_module)
                    report.replaced(Site(FAMILY, "sloth.document_attention", module_path(out), source_location(out),
                                         f"document-causal {q_len}-token mask ({rule} of {ids.target!r}) dropped"))
                    continue
            report.reject(FAMILY, node, f"attention mask kept: {why_not}")
    for graph_module in changed:
        graph_module.graph.lint()
        graph_module.recompile()
    return gm


def _rewrite_body_input(body: fx.GraphModule, node: fx.Node, args: dict[str, Any], mask: fx.Node, position: int,
                        call_sites: list[tuple[fx.GraphModule, fx.Node]], checker: _Checker, bounds: _Bounds,
                        q_len: int, report: Report) -> Optional[str]:
    """Rewrite a body's SDPA whose mask is the body's input ``position``: every call site must pass a
    document-causal mask there (the same rule), and the body must read that input only in SDPA calls this
    family can take. The call sites then pass the bounds instead. Returns why not, or None when done."""
    readers = list(mask.users)
    for reader in readers:
        reader_args = _sdpa_arguments(reader)
        if reader_args is None or reader_args["attn_mask"] is not mask:
            return f"the checkpointed layer reads its mask in {reader.name}, not only in attention"
        refusal = _refusal(reader, reader_args)
        if refusal:
            return refusal
    found = []
    for caller, call in call_sites:
        operands = list(call.args[1:])
        if position >= len(operands):
            return "a call site passes fewer operands than the layer has inputs"
        ids, rule, why_not, producers = checker.check(caller, operands[position], q_len)
        if why_not:
            return why_not
        found.append((caller, call, ids, rule, producers))
    if len({rule for *_, rule, _ in found}) != 1:
        return "its call sites build masks under different rules"
    document_attention_op.register()
    batch = tensor_of(args["query"]).shape[0]
    for caller, call, ids, rule, producers in found:
        bound = bounds.get(caller.graph, ids, rule, batch, before=call)
        call.args = tuple(bound if i == 1 + position else a for i, a in enumerate(call.args))
        erase_unused(producers)
    set_value(mask, value_of(bound))  # the body's input now receives the bounds
    rule = found[0][3]
    for reader in readers:
        reader_args = _sdpa_arguments(reader)
        out = _replace(reader, reader_args, mask)
        report.replaced(Site(FAMILY, "sloth.document_attention", module_path(out), source_location(out),
                             f"document-causal {q_len}-token mask ({rule}) dropped in a checkpointed layer"))
    return None
