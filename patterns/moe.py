"""MoE experts (``"moe_route"`` in the report): the routed experts of a mixture-of-experts block, whatever code
ran them, become one ``torch.ops.sloth.moe_experts`` (lowering/moe.py: sort-based dispatch with no host sync,
grouped expert GEMMs, the GLU fused, a manual backward that gives frozen experts no weight gradient).

The meaning (``moe_experts_pattern`` in lowering/moe.py, transformers' eager loop)::

    out[t] = sum_k w[t, k] * W_down[e] @ (act(W_gate[e] @ x[t]) * (W_up[e] @ x[t])),    e = idx[t, k]

with ``W_gate_up = [W_gate; W_up]`` stacked as ``[E, 2I, H]`` and ``W_down`` as ``[E, H, I]``, ``act`` silu,
gelu (tanh) or gelu (erf); or, for *ungated* experts (transformers' ``has_gate=False``: NemotronH, Ergo)::

    out[t] = sum_k w[t, k] * W_down[e] @ act(W_up[e] @ x[t])

with ``W_up`` ``[E, I, H]`` and ``act`` relu2 (relu(u)^2), silu, gelu (tanh) or gelu (erf) (the op's ``gated=False``).

How a site is found (on the canonical graph): an *expert GEMM* is a matmul-like call (``torch._grouped_mm``,
``F.grouped_mm``, transformers' ``grouped_mm_fallback``, ``bmm``, ``matmul``, ``linear``, ``einsum``) one of whose
operands is a 3-D float graph input (the stacked expert weights, through views and indexing). Two expert GEMMs in
a row, the second downstream of the first, are a candidate, and its interface is read off the shapes:

    W1 = the first GEMM's 3-D weight [E, 2I, H] (ungated [E, I, H]);   W2 = the second's [E, H, I];
    S = the first GEMM's rows (an einsum's: its output's leading dims, [T, K] in gpt-fast's; moe_einsum.py)
    out = the first value downstream of the second GEMM of shape [T, H] with S = T * K (K >= 1),
          extended through casts
    x = the nearest [T, H] float value upstream of the first GEMM's other operand
    idx = the last [T, K] integer value upstream of ``out``;   w = the last [T, K] float value upstream of ``out``

Where a stacked weight is computed from its graph input before the GEMM reads it, W1 / W2 are that computed value
(for the probes). When it is ``baddbmm(W, lhs, rhs, alpha=s)`` with W the graph input (peft's ``target_parameters``
LoRA as compiler/integrations/peft_experts.py has Dynamo trace it: ``W + s B A`` each step), the op takes W and the
factors (``lhs``, ``rhs``; for the transposed layout ``rhs^T``, ``lhs^T``) and forms the adapters' products as grouped GEMMs
at rank r, and the merged weight goes unformed (erased with what fed only it). Any other computed weight (a sum
of several adapters, a hand-written merge) is passed as it is: the computation stays in the graph, the op reads
its result, and the op's weight gradient flows back through it.

The candidate *region* is every node ``out`` is computed from, back to those five (and the in-place writes into
them, such as transformers' ``inv_perm[perm] = arange`` and its in-place bias adds). It may also read per-expert
biases: float graph inputs [E, 2I] (ungated [E, I]) or [E, H], at most one a GEMM, the gate/up bias being the one
the second GEMM's operands are computed from (GPT-OSS's). A region reading anything else (a shared expert, a
parameter of a post-expert norm, an adapter beside the GEMMs in a form not recognised) is refused with its name.

Adapters applied beside the expert GEMMs (hand-written per-expert LoRA: ``base + s * gemm(gemm(rows, A[e]), B[e])``
with stacked 3-D factors; patterns/moe_adapters.py) are found before the pairing. Their two GEMMs read stacked 3-D
inputs too, so they would pair as an expert MLP of their own or split the real pair: they are left out of it, and
each adapter goes with its base GEMM's site, its factors inputs of the region. The probes give the factors random
nonzero values and compare with the pattern on ``W + s B A``; the op then takes them as its LoRA arguments (views
in the op's [E, n, r] / [E, r, k] orientation), as it takes peft's. Recognised but not taken (a tensor scale,
active dropout, factors in another dtype than the weights or for other experts): the site stays, with the reason.

Weights stored transposed, ``[E, H, 2I]`` and ``[E, I, H]`` (GPT-OSS, ``x @ W[e]``; ungated ``[E, H, I]`` and
``[E, I, H]``, Ergo's), are read as such from the shapes; the op then gets ``.transpose(1, 2)`` views (no copy).
Whether the experts are gated is read off the shapes too (W1's rows are 2I or I); where I == H the ungated weights
are square and either layout fits: the probes try both.

How it is accepted: the region is a function of its inputs alone, so it is evaluated at compile time on two
random probes of the real shapes (random tokens of size 1 and of size 16, distinct random experts a token, random
router weights, random expert weights and biases) and compared with ``moe_experts_pattern`` for each candidate:
the activations an ``F.silu`` / ``F.gelu`` of the region names (else all three; for ungated experts also relu2,
named by a ``relu`` whose result is squared), plus GPT-OSS's clamped
``swiglu_oai`` where the region holds a ``sigmoid`` of a constant times its operand (alpha) and a clamp (its
largest upper bound: limit), and DeepSeek-V4's ``silu_clamped`` where it holds a clamp, each with gate/up in
halves and, if none matches, interleaved. One that agrees on both probes within the dtype's tolerance is taken.
This is a test of the function, as the packed-attention family's mask check is, not a proof; it tells apart the
activations, gate/up orders and layouts sloth supports from the variants it does not (another offset or clamp,
capacity limits that drop tokens, a post-expert norm), which then stay, with the reason.

Top-1 routing (K = 1) has no sum over k to find the output by: there the first TOP_1_CANDIDATES values of the
rows' shape after the second GEMM are each a candidate, the first the probes accept is taken, and x is the nearest
[T, H] value before the first GEMM, followed back through row gathers by an integer index (the tokens gathered in
expert order have x's shape too). Where a sum over k follows but the probes refuse it, the top-1 candidates are
tried too: Ergo calls its experts with one route a row and unit weights, then normalises each route with its
expert's own norm (which the op does not take) before the weighted sum; the experts' call is the site.

Gate and up in two stacked weights (torchtitan's ``w1`` / ``w3``, three expert GEMMs) are joined into W1 by one
``torch.cat`` in the graph (patterns/moe_split.py); router weights applied to the experts' input rows instead of
their output (torchtitan's ``score_before_experts``) are refused, saying so. Experts written as a list of modules
(2-D weights each) are patterns/moe_expert_list.py's, run from this pass first.

Not yet: ungated activations other than relu2, silu and the GELUs (plain relu, for one: reported, the probes find
no match), transformers' ``eager`` expert loop (split by graph breaks at its data-dependent ``nonzero``; no site
within one graph), a loop over experts on slices of constant sizes (torchtitan's ``_run_experts_for_loop`` after
its ``.tolist()``: reported per expert), two adapters summed beside one expert GEMM (reported: the region reads the
factors, which are then not recognised as one adapter's; tests/test_moe_pattern.py).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from .moe_sites import anchor, expert_operand, expert_weight_arg, is_expert_gemm
from ..compiler.fx_utils import (ancestors, descendants, erase_unused, insert_call, module_path, op_name,
                                 replace_and_erase, source_location, tensor_of, value_of)
from ..compiler.options import PassOptions
from ..compiler.families import Family
from ..compiler.report import Report, Site
from ..compiler.writes import written
from .moe_einsum import gemm_rows
from .moe_expert_list import fuse_expert_lists
from .moe_adapters import BesideAdapter, adapter_gemms, beside_adapters, merged_weight
from .moe_split import SplitGateUp, join, split_gate_ups, unjoin

FAMILY = "moe_route"
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
# Those of ungated experts (h = act(W1 x)): NemotronH's and Ergo's relu2 first, then the three above.
UNGATED_ACTIVATIONS = ("relu2", *ACTIVATIONS)
# Relative error (max |region - pattern| / max |pattern|) a probe may show, by the region's dtype: the region
# runs in the graph's dtype, the pattern in fp32 from the same inputs.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 4e-2, torch.float16: 1e-2}
# The most bytes the op's fallback GEMM (one gathered expert weight per row, where torch._grouped_mm does not
# run) may gather; beyond it the experts stay as they were.
REFERENCE_BYTES = 256 << 20
# The most bytes the probes' inputs and the region's values may hold at once (the weights are two random copies).
PROBE_BYTES = 8 << 30


def _value(node: Any) -> Optional[torch.Tensor]:
    return tensor_of(node) if isinstance(node, fx.Node) else None


def _lowering():
    """lowering/moe.py, imported on first use (it imports triton through lowering/glu.py)."""
    from ..lowering import moe

    return moe


@dataclasses.dataclass
class MoeSite:
    out: fx.Node
    x: fx.Node
    idx: fx.Node
    w: fx.Node
    w1: fx.Node
    w2: fx.Node
    region: list[fx.Node]
    b1: Optional[fx.Node] = None  # the gate/up GEMM's per-expert bias [E, 2I]
    b2: Optional[fx.Node] = None  # the down GEMM's per-expert bias [E, H]
    act: str = ""
    transposed: bool = False  # weights stored [E, H, 2I] and [E, I, H] (GPT-OSS): the op gets transposed views
    gated: bool = True  # False: W1 is an ungated expert's up projection [E, I, H] (NemotronH's), h = act(W1 x)
    interleaved: bool = False  # gate and up in alternate columns (GPT-OSS's [..., ::2], [..., 1::2])
    alpha: float = 1.702  # swiglu_oai's and silu_clamped's constants, read off the region
    limit: float = 7.0
    base1: Optional[fx.Node] = None  # the graph inputs W1 / W2 are computed from (themselves if not computed)
    base2: Optional[fx.Node] = None
    beside1: Optional[BesideAdapter] = None  # an adapter applied beside the first / second GEMM (moe_adapters.py)
    beside2: Optional[BesideAdapter] = None
    split: Optional[SplitGateUp] = None  # gate and up in two stacked weights (moe_split.py): w1 their join

    def inputs(self) -> tuple[fx.Node, ...]:
        return tuple(n for n in (self.x, self.idx, self.w, self.w1, self.w2, self.b1, self.b2) if n is not None) \
            + self.factor_inputs() + (self.split.parts() if self.split is not None else ())

    def factor_inputs(self) -> tuple[fx.Node, ...]:
        """The graph inputs of the adapters beside the GEMMs (A and B of each), inputs of the region."""
        return tuple(n for a in (self.beside1, self.beside2) if a is not None for n in a.factors())


def _shape(node: fx.Node) -> Optional[tuple]:
    value = _value(node)
    return tuple(value.shape) if value is not None else None


_MERGES = ("add", "sub", "mul", "baddbmm")


def _weight_value(gemm: fx.Node, base: fx.Node) -> fx.Node:
    """The stacked weight value ``gemm`` multiplies by: ``base`` (the graph input), or, where the weight is computed
    from it before views and indexing (peft's ``target_parameters`` LoRA: ``baddbmm(W, B, A)``, the expert stack plus
    its adapters' product, formed each step as eager does), that computed [E, ., .] value. The op then takes the
    computed weight, the computation stays in the graph, and its gradient flows to the adapters through it."""
    node, _ = expert_weight_arg(gemm)
    while isinstance(node, fx.Node) and node is not base:
        if op_name(node) in _MERGES:
            value = _value(node)
            return node if value is not None and tuple(value.shape) == tuple(_value(base).shape) else base
        if not node.args or not isinstance(node.args[0], fx.Node):
            break
        node = node.args[0]
    return base


@dataclasses.dataclass
class Adapter:
    """A stacked weight computed as ``baddbmm(W, lhs, rhs, alpha=scale)`` = W + scale lhs @ rhs, W the graph
    input [E, n, k], lhs [E, n, r], rhs [E, r, k] (peft's ``target_parameters`` fold, as
    compiler/integrations/peft_experts.py has Dynamo trace it)."""
    lhs: fx.Node
    rhs: fx.Node
    scale: float


def _adapter(weight: fx.Node, base: Optional[fx.Node]) -> Optional[Adapter]:
    """``weight``'s LoRA factors when it is ``baddbmm(base, lhs, rhs, alpha=s)`` with beta 1; else None (the op
    then takes the computed weight as it is)."""
    if base is None or weight is base or op_name(weight) != "baddbmm" or len(weight.args) != 3 \
            or weight.args[0] is not base or weight.kwargs.get("beta", 1) != 1 or set(weight.kwargs) - {"alpha", "beta"}:
        return None
    lhs, rhs = weight.args[1], weight.args[2]
    scale = weight.kwargs.get("alpha", 1)
    shapes = [_shape(n) if isinstance(n, fx.Node) else None for n in (base, lhs, rhs)]
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or None in shapes \
            or any(len(shape) != 3 for shape in shapes):
        return None
    (e, n, k), (e1, n1, r), (e2, r2, k2) = shapes
    if (e1, n1, e2, r2, k2) != (e, n, e, r, k) or len({_value(n).dtype for n in (base, lhs, rhs)}) != 1:
        return None  # (factors in another dtype than W: the merged weight, as computed, is what the op can take)
    return Adapter(lhs, rhs, float(scale))


# Top-1 routing (S = T): how many [T, H] values after the second GEMM are tried as the experts' output, first to
# last, each by the probes (with K > 1 the sum over k tells the output apart and one is tried).
TOP_1_CANDIDATES = 4


def _interface(gemm1: fx.Node, gemm2: fx.Node, only_top_1: bool = False,
               beside: tuple[Optional[BesideAdapter], Optional[BesideAdapter]] = (None, None),
               split: Optional[SplitGateUp] = None) -> tuple[list[MoeSite], Optional[str], bool]:
    """Read (x, idx, w, W1, W2, out) off two expert GEMMs: the candidate sites (one, or with top-1 routing up to
    TOP_1_CANDIDATES, for the probes to choose from), or say why none; and whether they are the sum over k (else
    top-1 candidates). ``only_top_1``: the top-1 candidates even where a sum over k follows (tried when that sum is
    refused: Ergo runs its experts with one route a row and unit weights, and sums the routes after a per-route
    norm the op does not take). ``beside``: the adapters applied beside the two GEMMs, whose factors the region
    reads as inputs. ``split``: gemm1 is the gate GEMM of a gate/up pair, whose joined weight is W1."""
    base1, base2 = expert_operand(gemm1), expert_operand(gemm2)
    w1, w2 = join(split) if split is not None else _weight_value(gemm1, base1), _weight_value(gemm2, base2)
    e1, e2 = _shape(w1), _shape(w2)
    if e1[0] != e2[0]:
        return [], f"its two expert weights hold {e1[0]} and {e2[0]} experts", False
    rows = gemm_rows(gemm1)[0]
    if not rows:  # (no tokens to tell the experts' output by: a zero-row slice of an expert loop)
        return [], "its first expert GEMM has no rows in this graph (a zero-row slice): no tokens to read it by", False
    order = {n: i for i, n in enumerate(gemm2.graph.nodes)}
    below = sorted(descendants(gemm2), key=order.__getitem__)
    weights = {w1, *(split.parts() if split is not None else ())}
    data = [a for a in gemm1.all_input_nodes if a not in weights and not weights & ancestors(a)]
    why_not = "no [tokens, hidden] value follows the second expert GEMM (the experts' sum over k)"
    for hidden in dict.fromkeys((e2[1], e2[2])):  # [E, H, I], or transposed [E, I, H]
        outs = [] if only_top_1 else [n for n in below if (shape := _shape(n)) is not None and len(shape) == 2
                                      and shape[1] == hidden and 0 < shape[0] < rows and rows % shape[0] == 0][:1]
        top_1 = not outs
        if top_1:  # the experts' output has the rows' count; which of those values it is, the probes say
            outs = [n for n in below if _shape(n) == (rows, hidden)][:TOP_1_CANDIDATES]
        if not outs:
            continue
        x = _nearest(data, (_shape(outs[0])[0], hidden))
        while top_1 and x is not None and _gathered_from(x) is not None:
            x = _gathered_from(x)  # the tokens gathered in expert order have x's shape too: x is their source
        if x is not None:
            break
        why_not = f"no [{_shape(outs[0])[0]}, {hidden}] input found upstream of the first expert GEMM"
    else:
        return [], why_not, False
    sites, reasons = [], []
    for out in dict.fromkeys(_through_casts(o) for o in outs):
        site, why_not = _site(out, x, w1, w2, gemm1, gemm2, rows, order, beside, split)
        if site is not None:
            site.base1, site.base2 = base1, base2
            sites.append(site)
        else:
            reasons.append(why_not)
    return sites, (reasons[0] if not sites else None), not top_1


def _through_casts(out: fx.Node) -> fx.Node:
    """``out`` extended through the same-shape casts its only user makes."""
    while len(out.users) == 1 and op_name(next(iter(out.users))) in ("to", "cast", "type_as") \
            and _shape(next(iter(out.users))) == _shape(out):
        out = next(iter(out.users))
    return out


def _site(out: fx.Node, x: fx.Node, w1: fx.Node, w2: fx.Node, gemm1: fx.Node, gemm2: fx.Node, rows: int,
          order: dict[fx.Node, int], beside: tuple[Optional[BesideAdapter], Optional[BesideAdapter]] = (None, None),
          split: Optional[SplitGateUp] = None) -> tuple[Optional[MoeSite], Optional[str]]:
    """The site whose output is ``out``: its router ids and weights, biases and region, or why not."""
    e1 = _shape(w1)
    tokens, top_k = _shape(out)[0], rows // _shape(out)[0]
    upstream = sorted(ancestors(out, {x, w1, w2}), key=order.__getitem__)
    ints = [n for n in upstream if _shape(n) == (tokens, top_k) and not _value(n).is_floating_point()]
    floats = [n for n in upstream if _shape(n) == (tokens, top_k) and _value(n).is_floating_point()]
    if not ints or not floats:
        return None, f"no [{tokens}, {top_k}] expert ids and router weights found upstream of the experts"
    idx, w = ints[-1], floats[-1]
    if top_k == 1:  # the router weights gathered in expert order are [T, 1] too: prefer those not computed from idx
        w = next((f for f in reversed(floats) if idx not in ancestors(f)), w)
    if w in ancestors(gemm1, {x}):  # torchtitan's score_before_experts: w scales the rows the experts read
        return None, ("the router weights scale the experts' input rows (score before the experts, torchtitan's "
                      "score_before_experts=True), not their output: the op weights the experts' outputs")
    factors = {n for a in beside if a is not None for n in a.factors()}
    inputs = {x, idx, w, w1, w2, *factors, *(split.parts() if split is not None else ())}
    n_experts, widths = e1[0], {gemm_rows(gemm1)[1], _shape(x)[1]}

    def bias_shaped(node: fx.Node) -> bool:  # [E, 2I] or [E, H], float: a per-expert bias of one of the GEMMs
        value = _value(node)
        return value is not None and value.is_floating_point() and value.dim() == 2 \
            and value.shape[0] == n_experts and value.shape[1] in widths

    biases: list[fx.Node] = []
    region, why_not = _region(out, inputs, bias_shaped, biases)
    if why_not:
        return None, why_not
    # told apart by whether the second GEMM's operands are computed from them (the gate/up bias, added in place or
    # not; transformers adds the down bias in place into the second GEMM's output, so not the GEMM's own region),
    # not by width, which is the same for both where 2I = H
    upstream_of_down: list[fx.Node] = []
    for operand in gemm2.all_input_nodes:
        _region(operand, inputs, bias_shaped, upstream_of_down)
    b1 = [b for b in biases if b in upstream_of_down]
    b2 = [b for b in biases if b not in upstream_of_down]
    if len(b1) > 1 or len(b2) > 1:
        return None, (f"the experts read {len(biases)} per-expert [E, n] inputs "
                      f"({', '.join(repr(str(b.target)) for b in biases)}): more than one bias a GEMM")
    return MoeSite(out, x, idx, w, w1, w2, region, b1[0] if b1 else None, b2[0] if b2 else None,
                   beside1=beside[0], beside2=beside[1], split=split), None


def _gathered_from(node: fx.Node) -> Optional[fx.Node]:
    """The value ``node`` gathers its rows from by an integer index (``x[perm]``, ``index_select``), when that value
    has ``node``'s shape; else None."""
    if node.op not in ("call_function", "call_method") or op_name(node) not in ("getitem", "index", "index_select") \
            or not node.args or not isinstance(node.args[0], fx.Node) or _shape(node.args[0]) != _shape(node):
        return None
    index = node.args[2] if op_name(node) == "index_select" and len(node.args) > 2 else node.args[1] \
        if len(node.args) > 1 else None
    indices = index if isinstance(index, (list, tuple)) else [index]
    if any(isinstance(i, fx.Node) and _value(i) is not None and not _value(i).is_floating_point()
           and _value(i).dtype != torch.bool for i in indices):
        return node.args[0]
    return None


def _nearest(starts: list[fx.Node], shape: tuple) -> Optional[fx.Node]:
    """Breadth-first back from ``starts``: the nearest float value of ``shape`` (the tokens the experts read)."""
    stack, seen = list(starts), set()
    while stack:
        node = stack.pop(0)
        if node in seen:
            continue
        seen.add(node)
        value = _value(node)
        if value is not None and value.is_floating_point() and tuple(value.shape) == shape:
            return node
        stack.extend(node.all_input_nodes)
    return None


def _region(out: fx.Node, inputs: set[fx.Node], extra: Optional[Callable[[fx.Node], bool]] = None,
            found: Optional[list[fx.Node]] = None) -> tuple[list[fx.Node], Optional[str]]:
    """The nodes ``out`` is computed from back to ``inputs``, with the writes into them, in graph order. A graph
    input for which ``extra`` holds is another input of the region, appended to ``found``; any other is refused."""
    region: set[fx.Node] = set()
    stack = [out]
    while stack:
        node = stack.pop()
        if node in region or node in inputs:
            continue
        if node.op == "placeholder" and extra is not None and extra(node):
            if node not in found:
                found.append(node)
            continue
        if node.op == "placeholder":
            what = ("an adapter in a form sloth does not recognise (neither merged into the expert weights, as "
                    "peft's target_parameters does, nor base + s * B[e] A[e] rows beside each expert GEMM, "
                    "patterns/moe_adapters.py): not fused, the experts run as written"
                    if any(k in str(node.target).lower() for k in ("lora", "parametriz"))
                    else "a bias, an adapter, a shared expert or a norm the fused op does not take")
            return [], f"the experts also read the graph input {node.target!r}: {what}"
        if node.op in ("get_attr", "call_module"):
            return [], f"the experts read {node.target!r} ({node.op})"
        region.add(node)
        stack.extend(node.all_input_nodes)
        for user in node.users:  # a write into a value of the region is part of it
            if user not in region and node in written(user):
                stack.append(user)
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    return sorted(region, key=order.__getitem__), None


def _evaluate(site: MoeSite, probe: dict[fx.Node, torch.Tensor]) -> torch.Tensor:
    """The region's value of ``out`` on ``probe`` (real tensors for the five inputs), outside any fake mode."""
    env: dict[fx.Node, Any] = dict(probe)

    def read(n: fx.Node) -> Any:
        return env[n]

    for node in site.region:
        args = fx.node.map_arg(node.args, read)
        kwargs = fx.node.map_arg(node.kwargs, read)
        if node.op == "call_method":
            env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            env[node] = node.target(*args, **kwargs)
    return env[site.out]


def _probe(site: MoeSite, seed: int, scale: float) -> dict[fx.Node, torch.Tensor]:
    """Random inputs of the site's shapes: tokens of size ``scale``, distinct random experts a token, router
    weights in [0, 1), expert weights that keep the pre-activations of the tokens' size."""
    x, idx, w, w1, w2 = (_value(n) for n in (site.x, site.idx, site.w, site.w1, site.w2))
    g = torch.Generator(device=x.device).manual_seed(seed)
    n_experts = w1.shape[0]
    tokens, top_k = idx.shape
    choice = torch.rand(tokens, n_experts, generator=g, device=x.device).argsort(-1)[:, :top_k]
    fan_in = (w1.shape[1], w2.shape[1]) if site.transposed else (w1.shape[2], w2.shape[2])
    probe = {site.x: (scale * torch.randn(x.shape, generator=g, device=x.device)).to(x.dtype),
             site.idx: choice.to(idx.dtype).contiguous(),  # (as topk's: the region may view it)
             site.w: torch.rand(w.shape, generator=g, device=x.device).to(w.dtype),
             site.w1: (torch.randn(w1.shape, generator=g, device=x.device) / fan_in[0] ** 0.5).to(w1.dtype),
             site.w2: (torch.randn(w2.shape, generator=g, device=x.device) / fan_in[1] ** 0.5).to(w2.dtype)}
    if site.split is not None:  # the region reads the gate's and the up's weights: slices of the joined probe
        probe.update(zip(site.split.parts(), site.split.slices(probe[site.w1])))
    for bias in (site.b1, site.b2):
        if bias is not None:
            value = _value(bias)
            probe[bias] = torch.randn(value.shape, generator=g, device=x.device).to(value.dtype)
    for adapter in (site.beside1, site.beside2):
        # A of the fan-in's size and B nonzero, sized so that s B A is as large as W: a probe where the adapter
        # adds nothing (peft's B = 0 at init) could not tell a wrong scale or orientation apart
        if adapter is not None:
            a, b = _value(adapter.a), _value(adapter.b)
            fan_in, b_size = max(a.shape[1:]) ** 0.5, adapter.rank ** 0.5 * (abs(adapter.scale) or 1.0)
            probe[adapter.a] = (torch.randn(a.shape, generator=g, device=x.device) / fan_in).to(a.dtype)
            probe[adapter.b] = (torch.randn(b.shape, generator=g, device=x.device) / b_size).to(b.dtype)
    return probe


def _layouts(w1: torch.Tensor, w2: torch.Tensor, hidden: int) -> list[tuple[bool, bool]]:
    """The (gated, transposed) layouts the two stacked weights' shapes allow for hidden size H: gated [E, 2I, H] and
    [E, H, I] (transposed: [E, H, 2I] and [E, I, H], GPT-OSS's), ungated [E, I, H] and [E, H, I] (transposed: [E, H,
    I] and [E, I, H], Ergo's). At most one gated layout fits any shapes; where I == H both ungated ones fit (square
    weights), and the probes tell them apart."""
    (_, n1, k1), (_, n2, k2) = w1.shape, w2.shape
    fits = {(True, False): k1 == hidden and n2 == hidden and n1 == 2 * k2,
            (True, True): n1 == hidden and k2 == hidden and k1 == 2 * n2,
            (False, False): k1 == hidden and n2 == hidden and n1 == k2,
            (False, True): n1 == hidden and k2 == hidden and k1 == n2}
    return [layout for layout, fit in fits.items() if fit]


def _accept(site: MoeSite) -> Optional[str]:
    """Set ``site.act`` (and its layout: gated, transposed, interleaved) to the activation whose pattern the region
    equals on every probe, or say why none."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    x, w1, w2, out = (_value(n) for n in (site.x, site.w1, site.w2, site.out))
    hidden = x.shape[1]
    layouts = _layouts(w1, w2, hidden)
    if not layouts:
        return (f"its expert weights {tuple(w1.shape)} and {tuple(w2.shape)} are neither gated ([E, 2I, H] and "
                f"[E, H, I], or [E, H, 2I] and [E, I, H]) nor ungated ([E, I, H] and [E, H, I], or transposed) for "
                f"hidden size {hidden}")
    site.gated, site.transposed = layouts[0]  # the probes' fan-ins read it (the same for every layout that fits)
    if out.dtype not in PROBE_TOLERANCE or x.dtype not in PROBE_TOLERANCE:
        return f"its dtype {out.dtype} is not one the fused op supports"
    for adapter in (site.beside1, site.beside2):
        dtypes = {_value(n).dtype for n in adapter.factors()} if adapter is not None else {x.dtype}
        if dtypes != {x.dtype}:  # (moe_adapters.py compares them with the weights'; the op wants the tokens')
            return (f"an adapter beside its GEMMs has factors in {', '.join(str(d) for d in dtypes)}, its tokens are "
                    f"{x.dtype}: the op takes the factors in the tokens' dtype")
    needed = 2 * (w1.numel() + w2.numel()) * w1.element_size() + 8 * _value(site.idx).numel() * w1.shape[1] * 4
    if needed > PROBE_BYTES:
        return f"probing it would hold about {needed / 2**30:.1f} GiB, more than sloth allows itself"
    moe = _lowering()
    rows, inter = _value(site.idx).numel(), w2.shape[1 if site.transposed else 2]
    reference_bytes = rows * w1.shape[1] * w1.shape[2] * x.element_size()  # one gathered W1[e] a row
    if not moe.gemm_runs(x.device, x.dtype, x.shape[1], inter) and reference_bytes > REFERENCE_BYTES:
        return (f"neither torch._grouped_mm nor sloth's Triton grouped GEMM runs {str(x.dtype).replace('torch.', '')} "
                f"experts of width {inter} on {x.device.type} here, and the op's fallback would gather "
                f"{reference_bytes / 2**30:.1f} GiB of expert weights (on a GPU the op takes bfloat16 and float16; on "
                "the CPU, torch >= 2.9's _grouped_mm needs H and I multiples of 16 bytes)")
    tolerance = PROBE_TOLERANCE[out.dtype]
    with unset_fake_temporarily(), torch.no_grad():
        try:
            # tokens of size 1 and 16: pre-activations past a clamp (GPT-OSS's at 7) show on the second
            probes = [_probe(site, 0, 1.0), _probe(site, 1, 16.0)]
            values = [_evaluate(site, p).float() for p in probes]
        except Exception as error:  # an op that cannot run outside the graph: leave the site as it was
            return f"evaluating it on a probe failed ({type(error).__name__}: {error})"
        limit = _clamp_limit(site.region)
        alpha = _sigmoid_scale(site.region)
        acts = _candidate_activations(site.region, ACTIVATIONS)
        if limit is not None:  # a clamp in the region: the clamped GLUs, GPT-OSS's where a sigmoid is scaled
            acts = acts + (("swiglu_oai",) if alpha is not None else ()) + ("silu_clamped",)
        alpha, limit = alpha if alpha is not None else site.alpha, limit if limit is not None else site.limit
        # (act, interleaved, gated, transposed) -> the worst relative error over the probes
        errors: dict[tuple[str, bool, bool, bool], float] = {}
        for gated, transposed in layouts:
            # gate/up in halves first; alternate columns only if no halves match; ungated experts have neither
            for interleaved in ((False, True) if gated else (False,)):
                for act in acts if gated else _candidate_activations(site.region, UNGATED_ACTIVATIONS):
                    worst = 0.0
                    for probe, value in zip(probes, values):
                        w1p, w2p = (probe[n].float() for n in (site.w1, site.w2))
                        if transposed:
                            w1p, w2p = w1p.transpose(1, 2), w2p.transpose(1, 2)
                        # adapters beside the GEMMs: the pattern's weights are W + s B A (the op's layout)
                        w1p, w2p = (merged_weight(wp, a, *(probe[n] for n in a.factors())) if a is not None else wp
                                    for wp, a in ((w1p, site.beside1), (w2p, site.beside2)))
                        b1, b2 = (probe[b].float() if b is not None else None for b in (site.b1, site.b2))
                        ref = moe.moe_experts_pattern(probe[site.x].float(), probe[site.idx], probe[site.w].float(),
                                                      w1p, w2p, act, b1, b2, interleaved, alpha, limit, gated=gated)
                        worst = max(worst, float((value - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
                    errors[act, interleaved, gated, transposed] = worst
                if min(errors.values()) <= tolerance:
                    break
            if min(errors.values()) <= tolerance:
                break
    closest = min(errors, key=errors.get)
    if errors[closest] <= tolerance:
        site.act, site.interleaved, site.gated, site.transposed = closest
        site.alpha, site.limit = alpha, limit
        return None
    act, interleaved, gated, _ = closest
    if gated:
        return (f"on random probes it is not sum_k w * down(act(gate x) * up x) for any supported activation and "
                f"gate/up layout (closest: {act}{', interleaved' if interleaved else ''}, relative error "
                f"{errors[closest]:.2g}): an offset or clamped GLU other than GPT-OSS's, token dropping or a "
                "post-expert norm")
    return (f"on random probes it is not sum_k w * down(act(up x)) for any activation of ungated experts the op "
            f"has ({', '.join(UNGATED_ACTIVATIONS)}; closest: {act}, relative error {errors[closest]:.2g}): another "
            "activation, an offset, token dropping or a post-expert norm")


def _sigmoid_scale(region: list[fx.Node]) -> Optional[float]:
    """The constant a ``sigmoid``'s operand is scaled by in the region (GPT-OSS's alpha in ``g * sigmoid(alpha *
    g)``), or None. It, like ``_clamp_limit``, only says which constants the probes check a clamped GLU with."""
    alphas = set()
    for node in region:
        if op_name(node) == "sigmoid" and isinstance(node.args[0], fx.Node) and op_name(node.args[0]) == "mul":
            alphas |= {float(a) for a in node.args[0].args if isinstance(a, (int, float)) and not isinstance(a, bool)}
    return alphas.pop() if len(alphas) == 1 else None


def _clamp_limit(region: list[fx.Node]) -> Optional[float]:
    """The largest upper bound of a clamp in the region (``clamp``, ``clip``, ``clamp_max``), or None."""
    limits = []
    for node in region:
        name = op_name(node)
        if name in ("clamp", "clip", "clamp_max"):
            bound = node.kwargs.get("max", node.args[1] if name == "clamp_max" and len(node.args) > 1 else
                                    node.args[2] if len(node.args) > 2 else None)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound > 0:
                limits.append(float(bound))
    return max(limits) if limits else None


def _candidate_activations(region: list[fx.Node], supported: tuple[str, ...]) -> tuple[str, ...]:
    """The activations of ``supported`` to probe: the one the region names, else all of them (a GELU written out by
    hand). Named: an ``F.silu`` / ``F.gelu`` node (its ``approximate``), and ``relu2`` for a ``relu`` whose result is
    squared (``square``, the canonical form of ``** 2`` and ``r * r``). In bf16 the probes alone cannot tell erf
    GELU from its tanh approximation."""
    named = set()
    for node in region:
        name = op_name(node)
        if name == "silu":
            named.add("silu")
        elif name == "gelu":
            approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
            named.add("gelu_tanh" if approximate == "tanh" else "gelu")
        elif name == "relu" and any(op_name(user) == "square" for user in node.users):
            named.add("relu2")
    named &= set(supported)
    return tuple(a for a in supported if a in named) if len(named) == 1 else supported


@dataclasses.dataclass
class Candidate:
    """A pair of expert GEMMs (``second`` None: a lone one), the sites read off them (the probes choose), why none,
    whether they are the sum over k, the adapters beside the two GEMMs, and the adapters' own GEMMs (explained by
    the pair's replacement or reason)."""
    first: fx.Node
    second: Optional[fx.Node]
    sites: list[MoeSite]
    why_not: Optional[str]
    summed: bool
    beside: tuple[Optional[BesideAdapter], Optional[BesideAdapter]] = (None, None)
    adapter_gemms: tuple[fx.Node, ...] = ()
    split: Optional[SplitGateUp] = None  # the up GEMM beside ``first`` (the gate), their weights joined


def _sites(gm: fx.GraphModule) -> list[Candidate]:
    """The candidates, one per pair of expert GEMMs, in graph order. The GEMMs of adapters applied beside expert
    GEMMs (moe_adapters.py) are no experts' GEMMs: they are left out of the pairing (else each adapter's two would
    pair as an expert MLP, or split the real pair), and their adapter goes with its base GEMM's pair."""
    gemms = [n for n in gm.graph.nodes if is_expert_gemm(n)]
    adapters = beside_adapters(gemms)
    helpers = adapter_gemms(adapters)
    gemms = [g for g in gemms if g not in helpers]
    # gate and up in two stacked weights (moe_split.py): the up GEMM goes with its gate's site
    splits = split_gate_ups(gemms)
    gemms = [g for g in gemms if g not in {s.up for s in splits.values()}]
    used: set[fx.Node] = set()
    found = []
    for i, first in enumerate(gemms):
        if first in used:
            continue
        below = descendants(first)
        second = next((g for g in gemms[i + 1:] if g in below and g not in used), None)
        beside = (adapters.get(first), adapters.get(second) if second is not None else None)
        theirs = tuple(g for a in beside if a is not None for g in (a.ga, a.gb, *a.others))
        split = splits.get(first)
        theirs += (split.up,) if split is not None else ()
        if second is None:
            found.append(Candidate(first, None, [], "an expert GEMM without a second one after it in this graph: not "
                                   "an expert MLP (up, act, down), or a loop over experts split by graph breaks "
                                   "(transformers' 'eager' experts: set config._experts_implementation = "
                                   "'grouped_mm')", False, beside, theirs))
            used.add(first)
            continue
        used |= {first, second}
        experts = {_constant_expert(first), _constant_expert(second)}
        if len(experts) == 1 and None not in experts:
            found.append(Candidate(first, second, [], (
                f"a loop over experts: expert {experts.pop()}'s GEMMs alone, on a slice of {_shape(first)[0]} rows "
                "whose size is a constant of this graph (token counts read on the host, e.g. by .tolist(), before "
                "it); the op routes every expert's tokens at once (torchtitan: use_grouped_mm=True)"),
                False, beside, theirs))
            continue
        refused = next((a.why_not for a in beside if a is not None and a.why_not), None)
        if refused:  # recognised, but not an adapter the op takes: the site stays, with the adapter's reason
            found.append(Candidate(first, second, [], f"an adapter applied beside the expert GEMMs: {refused}",
                                   False, beside, theirs))
            continue
        found.append(Candidate(first, second, *_interface(first, second, beside=beside, split=split), beside, theirs,
                               split))
    return found


def _constant_expert(gemm: fx.Node) -> Optional[int]:
    """The expert ``e`` when ``gemm`` reads one expert's weight ``W[e]`` by a constant index (a loop over
    experts), else None."""
    node, _ = expert_weight_arg(gemm)
    while isinstance(node, fx.Node) and node.op != "placeholder" and node.args:
        if op_name(node) in ("getitem", "select") and isinstance(node.args[-1], int) \
                and not isinstance(node.args[-1], bool):
            return node.args[-1]
        node = node.args[0]
    return None


def fuse_moe_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                  options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace each routed-experts region with ``torch.ops.sloth.moe_experts`` (see the module docstring).

    before:  sort, gather, grouped_mm(x_g, W1), act(gate) * up, grouped_mm(h, W2), * w, un-permute, sum over k
    after:   out = sloth.moe_experts(x, idx, w, W1, W2, act)[0]
    """
    changed = fuse_expert_lists(gm, report, options)  # experts as a list of modules (moe_expert_list.py)
    candidates = _sites(gm)
    if not candidates:
        if changed:
            gm.graph.lint()
            gm.recompile()
        return gm
    moe = _lowering()
    moe.register()
    for candidate in candidates:
        anchor, second = candidate.first, candidate.second
        site, why_not = _first_accepted(candidate.sites, candidate.why_not)
        if site is None and candidate.summed:  # the sum over k refused: the experts may run one route a row inside
            site, _ = _first_accepted(_interface(anchor, second, only_top_1=True, beside=candidate.beside,
                                                 split=candidate.split)[0], None)
        if site is None:
            if candidate.split is not None:
                unjoin(candidate.split)
            report.reject(FAMILY, anchor, why_not)
            # one site, one reason: the second GEMM's anchor and the adapters' GEMMs are explained by it too
            report.rejected_nodes.extend((FAMILY, n) for n in (second, *candidate.adapter_gemms) if n is not None)
            continue
        out = _value(site.out)
        besides = (site.beside1, site.beside2)
        # (a GEMM with an adapter beside it takes that one; a peft merge into its weight then stays computed)
        adapters = [_adapter(w, base) if beside is None else None
                    for w, base, beside in ((site.w1, site.base1, site.beside1), (site.w2, site.base2, site.beside2))]
        # an adapted weight: the op takes its graph input and the factors, and the merged weight goes unformed
        w1, w2 = (base if adapter is not None else w
                  for w, base, adapter in zip((site.w1, site.w2), (site.base1, site.base2), adapters))
        factors: list[Any] = []
        for adapter, beside in zip(adapters, besides):
            lhs, rhs = (adapter.lhs, adapter.rhs) if adapter is not None else (None, None)
            if adapter is not None and site.transposed:  # (W + s L R)^T = W^T + s R^T L^T: B = R^T, A = L^T
                lhs, rhs = (insert_call(gm.graph, site.out, torch.transpose, (n, 1, 2), meta_from=site.out)
                            for n in (adapter.rhs, adapter.lhs))
            if beside is not None:  # B [E, n, r], A [E, r, k] whatever W's layout: views of the stored factors
                lhs, rhs = (insert_call(gm.graph, site.out, torch.transpose, (n, 1, 2), meta_from=site.out)
                            if flip else n for n, flip in ((beside.b, beside.b_transposed),
                                                           (beside.a, beside.a_transposed)))
            factors += [lhs, rhs]
        scales = [adapter.scale if adapter is not None else beside.scale if beside is not None else 1.0
                  for adapter, beside in zip(adapters, besides)]
        if site.transposed:  # the op's [E, 2I, H] / [E, H, I] as views of [E, H, 2I] / [E, I, H]: no copy
            w1, w2 = (insert_call(gm.graph, site.out, torch.transpose, (w, 1, 2), meta_from=site.out)
                      for w in (w1, w2))
        fused = insert_call(gm.graph, site.out, torch.ops.sloth.moe_experts.default,
                            (site.x, site.idx, site.w, w1, w2, site.act, site.b1, site.b2, site.interleaved,
                             site.alpha, site.limit, *factors, *scales, site.gated,
                             *((True,) if options.moe_recompute else ())), meta_from=site.out)
        if value_of(fused) is None:  # (a tuple of four tensors when it ran)
            # The op did not run on the graph's fakes (seen when the op's function was its own fake and the values of
            # a Dynamo graph came from more than one fake mode): the graph as it was.
            inserted = [fused, *(n for n in (*factors, w1, w2) if isinstance(n, fx.Node) and not n.users
                                 and n.target is torch.transpose)]
            for node in inserted:
                gm.graph.erase_node(node)
            if candidate.split is not None:
                unjoin(candidate.split)
            report.reject(FAMILY, anchor, "the fused op could not be evaluated on this graph's fake values: "
                                          "the experts run as written")
            report.rejected_nodes.extend((FAMILY, n) for n in (second, *candidate.adapter_gemms) if n is not None)
            continue
        y = insert_call(gm.graph, site.out, operator.getitem, (fused, 0), meta_from=site.out)
        if _value(y).dtype != out.dtype:
            y = insert_call(gm.graph, site.out, torch.Tensor.to, (y, out.dtype), meta_from=site.out)
        merged = {w for w, adapter in zip((site.w1, site.w2), adapters) if adapter is not None}
        keep = {*site.inputs(), *(n for n in factors if n is not None), site.base1, site.base2} - merged
        erased = replace_and_erase(site.out, y, keep=keep)
        _erase_dead(site.region, erased)
        for weight in merged - erased:  # what fed only the merged weights (peft's factor views) goes too
            erased |= erase_unused(weight, keep)
        x, w1_value = _value(site.x), _value(site.w1)
        computed = [n for n, a in zip((site.w1, site.w2), adapters) if n.op != "placeholder" and a is None
                    and (site.split is None or n is not site.split.joined)]
        adapted = [name for name, a in zip(("gate_up" if site.gated else "up", "down"), adapters) if a is not None]
        rank = next((_shape(a.lhs)[2] for a in adapters if a is not None), None)
        beside_names = [name for name, a in zip(("gate_up" if site.gated else "up", "down"), besides) if a is not None]
        beside_rank = "/".join(dict.fromkeys(str(a.rank) for a in besides if a is not None))
        variant = "".join((", ungated" if not site.gated else "",
                           ", gate and up joined from two stacked weights each step" if site.split else "",
                           f" (alpha {site.alpha:g}, limit {site.limit:g})" if site.act == "swiglu_oai" else
                           f" (limit {site.limit:g})" if site.act == "silu_clamped" else "",
                           ", interleaved gate/up" if site.interleaved else "",
                           ", biases" if site.b1 is not None or site.b2 is not None else "",
                           ", transposed weights" if site.transposed else "",
                           f", LoRA r={rank} on {' and '.join(adapted)} (its products inside the op, no merged "
                           "weight)" if adapted else "",
                           f", LoRA r={beside_rank} on {' and '.join(beside_names)} (beside the expert GEMMs, its "
                           "products inside the op)" if beside_names else "",
                           ", its first GEMM recomputed in backward (moe_recompute)" if options.moe_recompute
                           else ""))
        report.replaced(Site(FAMILY, "sloth.moe_experts", module_path(anchor), source_location(anchor),
                             f"{w1_value.shape[0]} experts, top-{_value(site.idx).shape[1]}, {site.act}{variant}, "
                             f"{str(x.dtype).replace('torch.', '')}"
                             + (f"; {len(computed)} of its expert weights computed in the graph (an adapter's "
                                "merged weight, as peft's target_parameters forms it)" if computed else "")))
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _first_accepted(sites: list[MoeSite], why_not: Optional[str]) -> tuple[Optional[MoeSite], Optional[str]]:
    """The first of ``sites`` the probes accept (top-1: up to TOP_1_CANDIDATES), or None and ``why_not`` (else the
    first candidate's reason)."""
    for candidate in sites:
        reason = _accept(candidate)
        if reason is None:
            return candidate, None
        why_not = why_not or reason
    return None, why_not


def _erase_dead(region: list[fx.Node], erased: set[fx.Node]) -> None:
    """Erase what is left of the region with no users, last first; a write into a value (``inv_perm[perm] = ..``)
    goes only once nothing but writes reads that value any more."""
    for node in reversed(region):
        if node in erased or node.users:
            continue
        targets = written(node)
        if targets and any(set(t.users) - {node} - erased for t in targets):
            continue
        node.graph.erase_node(node)
        erased.add(node)


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_moe_pass, order=50, anchor=anchor,
                     emits=("moe_experts",),
                     reads=("moe_recompute",),
                     summary=("routed experts, whatever code ran them (stacked weights under grouped_mm / bmm / "
                              "einsum, expert lists), with LoRA on the experts"))
