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

Symbolic lengths (dynamic shapes: TRL's packed rows change length every step, so Dynamo's second graph has a
symbolic T). The op takes any T, and the mask is then a function of the ids and of the sizes the graph receives
(SymInt inputs), each an expression in the ids' sizes. It is probed as above at the length the graph was traced
with, the size inputs given the values those probes imply, and once more with its single-document probes at
``LONG_PROBE`` tokens (fewer where that would not fit the evaluation budget), so that a window of up to that
many tokens shows although the length it was traced at is shorter. A mask that reads a size no ids' size fixes,
or too large to evaluate whole at the traced length, stays, with the reason.

A checkpointed layer receives the mask as an input: the caller then passes the bounds in its place, when
every call site passes a document-causal mask there and the body reads it only in the SDPA calls rewritten.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from ..compiler.canonicalize import cast
from ..compiler.fx_utils import (insert_call, module_path, same_size, set_value, source_location, tensor_of,
                                 value_of)
from ..compiler.options import PassOptions
from ..compiler.families import Family
from ..compiler.report import Report, Site
from ..compiler.writes import body_of
from ..lowering import document_attention as document_attention_op
from ..runtime.packing import RULES, document_bounds
from .causal_mask import (anchor as is_masked_attention, _SDPA, _is_symbolic, allowed_of, erase_unused,
                          evaluation_budget,
                          mask_producers)
from .mask_rows import RowBlocks

FAMILY = "packed_attention"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Probes per kind of random packing (each row drawn separately, one fixed seed).
_RANDOM_PACKINGS = 4
# The tokens of a symbolic-length mask's long probe (module docstring): Mistral's and Gemma 2's sliding windows
# are 4096 tokens, so a mask with such a window differs from the document-causal one on it. A [1, 1, T, T] bool
# mask at 4096 tokens is 16 MiB.
LONG_PROBE = 4096
# How many of probe_ids' first probes are one document per row (all of T, and positions continued by 5).
_SINGLE_DOCUMENT_PROBES = 2


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


def _evaluator(gm: fx.GraphModule, producers: list[fx.Node], inputs: list[fx.Node], mask: fx.Node
               ) -> fx.GraphModule:
    """A graph module computing ``mask`` with ``producers`` from ``inputs`` (the ids, then any size inputs), passed
    in that order."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {node: graph.placeholder(f"input_{i}") for i, node in enumerate(inputs)}
    for node in producers:
        if node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[mask])
    return fx.GraphModule(gm, graph)


class _Lengths:
    """The concrete shapes a mask is probed at, and the values its size inputs take at each (module docstring).
    For a static mask one shape, the ids' own, and no sizes."""

    def __init__(self, ids_shape: Sequence[Any], sizes: list[fx.Node]) -> None:
        self.ids_shape, self.sizes = tuple(ids_shape), sizes
        self.symbols = {d.node.expr: i for i, d in enumerate(ids_shape) if not isinstance(d, int)}
        self.traced = tuple(d if isinstance(d, int) else d.node.hint for d in ids_shape)

    def why_not(self) -> Optional[str]:
        import sympy

        if any(not isinstance(d, int) and (not isinstance(d.node.expr, sympy.Symbol) or d.node.hint is None)
               for d in self.ids_shape):
            return f"the ids' shape {tuple(self.ids_shape)} has a size that is not one symbol with a traced value"
        for node in self.sizes:
            extra = value_of(node).node.expr.free_symbols - set(self.symbols)
            if extra:
                return (f"it reads the size input {node.target!r} = {value_of(node)}, which the ids' sizes "
                        f"{tuple(self.ids_shape)} do not fix")
        return None

    def concrete(self, size: Any, shape: tuple[int, ...]) -> int:
        """``size`` (an int or a SymInt in the ids' sizes) for ids of ``shape``."""
        if isinstance(size, int):
            return size
        return int(size.node.expr.xreplace({symbol: shape[i] for symbol, i in self.symbols.items()}))

    def long(self, producers: list[fx.Node], mask: fx.Node, budget: int) -> Optional[tuple[int, ...]]:
        """The shape of the long probe: ``LONG_PROBE`` tokens (halved until its evaluation fits ``budget``), or
        None when no length beyond the traced one fits or the length is static."""
        position = self.symbols.get(self.ids_shape[-1].node.expr) if not isinstance(self.ids_shape[-1], int) \
            else None
        tokens = LONG_PROBE
        while position is not None and tokens > self.traced[-1]:
            shape = self.traced[:position] + (tokens,) + self.traced[position + 1:]
            if self.bytes(producers, mask, shape) <= budget:
                return shape
            tokens //= 2
        return None

    def bytes(self, producers: list[fx.Node], mask: fx.Node, shape: tuple[int, ...]) -> int:
        """What evaluating ``producers`` holds for ids of ``shape`` (as _Checker counts it), and the mask's copy."""
        total = 0
        for node in [*producers, mask, mask, mask, mask]:  # the mask's bytes as _Checker's 4 * numel
            value = value_of(node)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, torch.Tensor):
                    total += math.prod(self.concrete(d, shape) for d in v.shape) * v.element_size()
        return total

    def probes(self, ids_value: torch.Tensor, long: Optional[tuple[int, ...]]
               ) -> list[tuple[torch.Tensor, list[int]]]:
        """(probe ids, the size inputs' values) for every probe: all of probe_ids at the traced shape, and the
        single-document ones at the ``long`` shape."""
        out = []
        for shape, count in ((self.traced, None), *(((long, _SINGLE_DOCUMENT_PROBES),) if long else ())):
            sizes = [self.concrete(value_of(node), shape) for node in self.sizes]
            out += [(p, sizes) for p in probe_ids(shape, ids_value.dtype, ids_value.device)[:count]]
        return out


def _rule_of(gm: fx.GraphModule, producers: list[fx.Node], ids: fx.Node, mask: fx.Node, lengths: _Lengths,
             long: Optional[tuple[int, ...]] = None, plan: Optional[RowBlocks] = None
             ) -> tuple[Optional[str], Optional[str]]:
    """(the rule the mask follows on every probe, None) or (None, why none does).

    Each probe's mask is evaluated whole, or with ``plan`` a block of query rows at a time (a mask too large to
    hold: a packed batch of 128k tokens is 16 GiB of bools; patterns/mask_rows.py), and each block compared with
    the same rows of every rule's mask, start[b, i] <= j <= i. A symbolic mask is evaluated at ``lengths``'
    shapes (its size inputs given their values there), the single-document probes also at ``long``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    ids_value = tensor_of(ids)
    evaluate = _evaluator(gm, producers, [ids, *lengths.sizes], mask) if plan is None else None
    candidates = list(RULES)
    failed: dict[str, tuple[int, int]] = {}
    with unset_fake_temporarily(), torch.no_grad():
        for index, (probe, sizes) in enumerate(lengths.probes(ids_value, long)):
            q_len = probe.shape[-1]
            bounds = {rule: document_bounds(probe.reshape(-1, q_len), rule) for rule in candidates}
            for first_row, value in (plan.blocks({ids: probe}) if plan is not None
                                     else [(0, evaluate(probe, *sizes))]):
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
                        failed[rule] = (index, q_len)
                if not candidates:
                    return None, ("it is not document-causal under any rule (" + ", ".join(
                        f"{rule}: differs on probe {i}" + (f" ({t} tokens)" if long else "")
                        for rule, (i, t) in failed.items()) + "; a window, a prefix, padding or another mask)")
    return candidates[0], None


class _Checker:
    """Finds, once per mask node, the ids it is built from and the rule it follows (or why not)."""

    def __init__(self) -> None:
        self.found: dict[tuple[fx.Node, str], tuple[Optional[fx.Node], Optional[str], Optional[str], list]] = {}

    def check(self, gm: fx.GraphModule, mask: Any, q_len: int) -> tuple[Optional[fx.Node], Optional[str],
                                                                         Optional[str], list[fx.Node]]:
        """(ids node, rule, None, producers) for a document-causal mask, else (None, None, why not, [])."""
        if not isinstance(mask, fx.Node):
            return None, None, "the call site passes no mask node", []
        key = (mask, str(q_len))  # a SymInt does not hash; its expression names it
        if key not in self.found:
            self.found[key] = self._check(gm, mask, q_len)
        return self.found[key]

    @staticmethod
    def _check(gm: fx.GraphModule, mask: fx.Node, q_len: Any):
        producers, inputs, why_not = mask_producers(mask, symbolic=True)
        if why_not:
            return None, None, why_not, []
        tensors = [n for n in inputs if tensor_of(n) is not None]
        sizes = [n for n in inputs if isinstance(value_of(n), torch.SymInt)]
        others = [n for n in inputs if n not in tensors and n not in sizes]
        if others:
            return None, None, f"it reads the graph input {others[0].target!r}, neither a tensor nor a size", []
        if not tensors:
            return None, None, "it reads no graph input (a fixed mask: the causal-mask family's case)", []
        if len(tensors) > 1:
            return None, None, ("it reads more than one graph input (" + ", ".join(str(n.target) for n in tensors)
                                + "): a padding mask with the positions, or another mask"), []
        ids = tensors[0]
        value = tensor_of(ids)
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool \
                or value.dim() not in (1, 2) or not same_size(value.shape[-1], q_len):
            return None, None, (f"it is computed from {ids.target!r} ({value.dtype} {tuple(value.shape)}), "
                                f"not from [batch, {q_len}] integer ids"), []
        lengths = _Lengths(value.shape, sizes)
        why_not = lengths.why_not()
        if why_not:
            return None, None, why_not, []
        budget = evaluation_budget(value.device)
        needed = lengths.bytes(producers, mask, lengths.traced)
        plan, long = None, None
        if _is_symbolic(value_of(mask)) or sizes:
            if needed > budget:
                return None, None, (f"checking its symbolic length at the traced {lengths.traced[-1]} tokens would "
                                    f"hold {needed / 2**30:.1f} GiB on {value.device}, more than sloth allows itself "
                                    f"({budget / 2**30:.1f} GiB)"), []
            long = lengths.long(producers, mask, budget)
        elif needed > budget:
            plan, by_rows_not = RowBlocks.build(producers, mask)
            if plan is None:
                return None, None, (f"checking it at compile time would hold up to {needed / 2**30:.1f} GiB on "
                                    f"{value.device}, more than sloth allows itself ({budget / 2**30:.1f} GiB), and "
                                    f"it cannot be checked a block of rows at a time: {by_rows_not}"), []
        try:
            rule, why_not = _rule_of(gm, producers, ids, mask, lengths, long, plan)
        except Exception as error:  # an op that cannot run outside the graph: leave it as it was
            return None, None, f"evaluating it on probe ids failed ({type(error).__name__}: {error})", []
        finally:
            if value.device.type == "cuda":
                torch.cuda.empty_cache()
        if why_not:
            return None, None, why_not, []
        return ids, rule, None, [n for n in producers if n is not ids and n not in sizes]


def _refusal(node: fx.Node, args: dict[str, Any]) -> Optional[str]:
    """Why this SDPA call cannot become the op whatever its mask, or None."""
    q, k, v = (tensor_of(args[name]) for name in ("query", "key", "value"))
    if q is None or k is None or v is None or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k and v are not all [batch, heads, tokens, head_dim] tensors"
    # Sizes compared without guards: a symbolic length (dynamic shapes) is taken (module docstring), and the heads
    # and head_dim, which the op's kernels need as numbers, must be static.
    if not same_size(q.shape[2], k.shape[2]):
        return f"queries ({q.shape[2]}) and keys ({k.shape[2]}) differ in length (a KV cache or cross-attention)"
    if not all(same_size(i, j) for i, j in zip(k.shape, v.shape)) or not same_size(k.shape[-1], q.shape[-1]) \
            or not same_size(q.shape[0], k.shape[0]):
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} do not pair with q {tuple(q.shape)}"
    if any(not isinstance(t.shape[d], int) for t in (q, k) for d in (1, 3)):
        return f"the heads or head_dim are symbolic (q {tuple(q.shape)}, k {tuple(k.shape)})"
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
        self.nodes: dict[tuple[fx.Graph, fx.Node, str, str], fx.Node] = {}

    def get(self, graph: fx.Graph, ids: fx.Node, rule: str, batch: Any, before: fx.Node) -> fx.Node:
        key = (graph, ids, rule, str(batch))  # a symbolic batch does not hash; its expression names it
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


def _length(q_len: Any) -> str:
    """The mask's length for the report: ``24-token``, or ``symbolic-length (s27)``."""
    return f"{q_len}-token" if isinstance(q_len, int) else f"symbolic-length ({q_len})"


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
                                         f"document-causal {_length(q_len)} mask ({rule} of {ids.target!r}) "
                                         "dropped"))
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
                             f"document-causal {_length(q_len)} mask ({rule}) dropped in a checkpointed layer"))
    return None


# The family's anchor (compiler/anchors.py): where its sites are, more broadly than its matchers take them.
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


def anchor(node: fx.Node) -> bool:
    """The ``packed_attention`` family's anchor: scaled_dot_product_attention with an attn_mask node and is_causal
    False, its mask computed from an integer graph input (position ids, document ids)"""
    if not is_masked_attention(node):
        return False
    params = dict(zip(("query", "key", "value", "attn_mask"), node.args), **node.kwargs)
    return reads_integer_input(params["attn_mask"])


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_packed_attention_pass, order=100, anchor=anchor, whole_module=True,
                     emits=("document_attention",),
                     summary=("SDPA under a packed-document causal mask built from position or document ids -> "
                              "attention over each document's triangle"))
