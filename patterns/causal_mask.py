"""Causal-mask family (``"causal_mask"`` in the report): an attention mask that is exactly causal becomes
SDPA's ``is_causal=True``.

The meaning::

    scaled_dot_product_attention(q, k, v, attn_mask=M, is_causal=False)
        == scaled_dot_product_attention(q, k, v, is_causal=True)

whenever M, broadcast to [..., L, S] (L = q's and S = k's sequence length), is torch's own causal mask:
M[..., i, j] allows j <= i and nothing else, as a bool mask (True = attend) or an additive float mask
(0 = attend, -inf or the dtype's lowest finite value = do not: both give exp(-huge - rowmax) = 0 in the
softmax, and no causal row is masked whole).

Why it pays: with a mask, SDPA's fused kernels (cuDNN, flash) compute every one of the L x S scores and
read the mask; with ``is_causal`` they skip the upper triangle, half the work and no mask traffic. On the
H200 (Llama-3-8B, batch 2 x 2048) a step's attention was 52 ms with transformers 5.17's mask against 19 ms
for the same cuDNN kernels with ``is_causal`` (benchmarks/results/2026-11-29_1932*): transformers up to
5.17 always builds the mask while Dynamo traces (``_ignore_causal_mask_sdpa`` says no under tracing), and
hand-written models often pass ``torch.tril(torch.ones(L, S))``.

How it is proven, not guessed: the mask's producers must be a closed computation: no graph input tensor
(a padding mask, a buffer, anything whose values the graph does not fix), no parameter, no submodule, no
symbolic size. Such a mask is the same tensor on every call of the compiled graph, so sloth evaluates it
once, at compile time, and compares it with the causal mask element by element. A mask that reads the
user's ``attention_mask`` (transformers when one is passed, even all ones), a sliding window, a prefix-LM
mask, a shifted diagonal, a float bias or a mask of symbolic size says no, with the reason in the report. A mask whose evaluation would hold more than
``evaluation_budget`` (a quarter of the device's free memory, 4 GiB on a CPU; at 64k tokens the mask alone is
4 GiB of bools, at 256k 64 GiB) is evaluated a block of query rows at a time instead (patterns/mask_rows.py),
when its producers are row-local, as the masks models build are; otherwise it stays, with both reasons.

A checkpointed layer (``tag_activation_checkpoint`` / ``wrap`` bodies) receives the mask as an input: the
body's SDPA is rewritten when every call site passes a proven causal mask in that position (the operand
stays passed, unused, so the body's signature does not change).

Masks that cross graphs. Where the model's graph is split (a graph break, FSDP2's per-module graphs, DDP's
bucket splits) the mask is made in one graph and read in others as a graph input, whose values no proof can fix.
So the making graph proves each mask-shaped output it returns (``PROVEN_OUTPUTS`` in its meta: the positions),
and a graph whose SDPA reads a mask input (directly or through slices that keep all of it) records the site
(``MASK_INPUT_SITES``) and leaves it as it is; the backend then compiles that graph twice, with ``is_causal``
at those sites and as written, and each call runs the first only when every such input is a tensor known causal
and unchanged since (runtime/proven_masks.py), the second otherwise. Known causal: marked by the making graph's
wrapper as proven (a host-side lookup, no sync), or, where no graph can prove it (under FSDP2 transformers' mask
is computed from position ids an eager frame made), its values compared with the causal mask on the device the
first time a reading graph gets it (the ``mask_check`` option, on by default: one sync per new mask tensor). A
reading graph whose mask, while compiling, is neither is compiled once, as written.
"""
from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.fx_utils import module_path, source_location, tensor_of
from ..compiler.writes import body_of, mutated_producer
from ..compiler.options import PassOptions
from ..compiler.families import Family
from ..compiler.report import Report, Site
from ..runtime import proven_masks
from .mask_rows import RowBlocks

FAMILY = "causal_mask"
# Graph meta keys the backend reads (compiler/backend.py): the output positions holding a mask proven causal;
# the SDPA sites reading a mask graph input, as (graph module, SDPA node, position among the top-level inputs).
PROVEN_OUTPUTS = "sloth_proven_mask_outputs"
MASK_INPUT_SITES = "sloth_mask_input_sites"

_SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
# What a compile-time evaluation may hold at once: the bytes of every value its producers make (an upper bound:
# the evaluated graph frees each value after its last use). On the CPU a fixed 4 GiB (a 46k x 46k bool mask
# and its intermediates); on a GPU a quarter of the memory free when the graph compiles (a 64k x 64k bool
# mask is 4 GiB: at Llama-3-8B the model's weights leave ~120 GiB of an H200 free, so up to ~30 GiB of
# producers). A mask beyond that stays, and attention runs masked: the report says so.
CPU_EVALUATION_BYTES = 4 << 30
DEVICE_EVALUATION_SHARE = 0.25


def causal_mask_pattern(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """The meaning, as plain PyTorch: attention with an explicit mask (equal to ``is_causal=True`` exactly when
    ``mask`` is the causal one)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal_reference(q_len: int, kv_len: int, device: Any = "cpu") -> torch.Tensor:
    """torch's causal mask for ``is_causal=True``: [L, S] bool, True where key j <= query i (top-left aligned)."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril()


def _attention_parts(node: fx.Node) -> Optional[tuple[Any, Any, Any, bool]]:
    """(q, k, mask, is_causal) of an SDPA call node, keyword or positional, or None for another node."""
    if node.op != "call_function" or node.target not in _SDPA:
        return None
    args = list(node.args) + [None] * (6 - len(node.args))
    q, k = node.kwargs.get("query", args[0]), node.kwargs.get("key", args[1])
    mask = node.kwargs.get("attn_mask", args[3])
    is_causal = node.kwargs.get("is_causal", args[5] if args[5] is not None else False)
    return q, k, mask, is_causal


def set_causal(node: fx.Node) -> None:
    """Drop ``node``'s mask and set ``is_causal=True``, wherever they were passed."""
    args = list(node.args)
    kwargs = dict(node.kwargs)
    if len(args) > 3:
        args[3] = None
    if len(args) > 5:
        args[5] = True
    else:
        kwargs["is_causal"] = True
    if "attn_mask" in kwargs or len(args) <= 3:
        kwargs["attn_mask"] = None
    node.args, node.kwargs = tuple(args), kwargs


def _is_symbolic(value: Any) -> bool:
    """Whether ``value`` (a node's example value) is or holds a symbolic size."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, torch.Tensor):
        return any(not isinstance(d, int) for d in value.shape)
    if isinstance(value, (tuple, list)):
        return any(_is_symbolic(v) for v in value)
    return False


_SYMBOLIC = "its size is symbolic (dynamic shapes), so one evaluation cannot prove it"


def mask_producers(mask: fx.Node, *, stop_at_input: bool = False, symbolic: bool = False
                   ) -> tuple[list[fx.Node], list[fx.Node], Optional[str]]:
    """(the nodes ``mask`` is computed from in graph order, the graph inputs among them, None), or ([], [], why
    the mask is not a function of the graph's inputs alone: a symbolic size, a parameter or submodule, a random
    draw, a write in place after it is made). With ``stop_at_input`` the walk ends at the first graph input,
    returned alone (the causal-mask family refuses any). With ``symbolic`` symbolic sizes are let through, and
    the size inputs (SymInt placeholders) are among the inputs: the packed-attention family, which shares this
    walk, evaluates the mask on probes of lengths it picks."""
    seen: set[fx.Node] = set()
    stack = [mask]
    inputs: list[fx.Node] = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        value = node.meta.get("example_value", node.meta.get("val"))
        if _is_symbolic(value) and not symbolic:
            return [], [], _SYMBOLIC
        if node.op == "placeholder":
            if stop_at_input:
                return [], [node], None
            inputs.append(node)
            continue
        if node.op in ("get_attr", "call_module"):
            return [], [], f"it reads {node.target!r} ({node.op}), not only values the graph fixes"
        if _is_random(node):
            return [], [], f"it draws random numbers ({node.name}), which one evaluation would freeze"
        stack.extend(node.all_input_nodes)
    mutated = mutated_producer(mask.graph, seen)
    if mutated is not None:
        return [], [], (f"{mutated.name} changes it in place after it is made, so evaluating its producers would miss "
                        "that")
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__), sorted(inputs, key=order.__getitem__), None


def _closed_producers(mask: fx.Node) -> tuple[list[fx.Node], Optional[str]]:
    """The nodes ``mask`` is computed from, in graph order, or the reason it is not a closed computation."""
    producers, inputs, why_not = mask_producers(mask, stop_at_input=True)
    if inputs:
        return [], (f"it is computed from the graph input {inputs[0].target!r} (a padding mask or another tensor "
                    "whose values the graph does not fix)")
    return producers, why_not


# Producers whose value is a random draw: evaluating them at compile time would freeze one draw and skip the
# generator's advance that eager makes on every call.
_RANDOM_FUNCTIONS = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli, torch.normal,
                     torch.multinomial, torch.poisson, torch.rand_like, torch.randn_like, torch.randint_like,
                     torch.nn.functional.dropout, torch.dropout}
_RANDOM_METHODS = {"bernoulli", "multinomial", "random_", "uniform_", "normal_", "exponential_", "geometric_",
                   "cauchy_", "log_normal_", "bernoulli_"}


def _is_random(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _RANDOM_METHODS
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in node.target.tags
    return node.target in _RANDOM_FUNCTIONS


def _evaluate(gm: fx.GraphModule, producers: list[fx.Node], mask: fx.Node) -> Any:
    """Run ``producers`` (a closed computation) once and return ``mask``'s value, outside any fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in producers:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[mask])
    with unset_fake_temporarily(), torch.no_grad():
        return fx.GraphModule(gm, graph)()


def allowed_of(mask_value: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[str]]:
    """(the bool mask of what may be attended, None) for a bool mask or an additive float mask of 0 and -inf
    (or the dtype's lowest value), else (None, why it is not a mask)."""
    if mask_value.dtype == torch.bool:
        return mask_value, None
    if mask_value.is_floating_point():
        blocked = (mask_value == float("-inf")) | (mask_value <= torch.finfo(mask_value.dtype).min)
        allowed = mask_value == 0
        if not bool((allowed | blocked).all()):
            return None, "it is an additive bias (values other than 0 and -inf), not a mask"
        return allowed, None
    return None, f"its dtype {mask_value.dtype} is neither bool nor floating point"


def causal_reason(mask_value: Any, q_len: int, kv_len: int) -> Optional[str]:
    """None when ``mask_value`` broadcast to [..., q_len, kv_len] is the causal mask, else why it is not."""
    if not isinstance(mask_value, torch.Tensor):
        return f"the mask is a {type(mask_value).__name__}, not a tensor"
    if mask_value.dim() < 2 or mask_value.shape[-2] not in (1, q_len) or mask_value.shape[-1] not in (1, kv_len):
        return f"its shape {tuple(mask_value.shape)} does not end in [{q_len}, {kv_len}]"
    allowed, why_not = allowed_of(mask_value)
    if why_not:
        return why_not
    return _rows_reason(allowed.expand(torch.broadcast_shapes(allowed.shape, (q_len, kv_len))), 0)


def _rows_reason(allowed: torch.Tensor, first_row: int) -> Optional[str]:
    """None when ``allowed`` ([..., rows, S] bool) is rows ``first_row ..`` of the causal mask, else why not
    (compared a block of rows at a time: no [L, S] reference in memory)."""
    if proven_masks.causal_values(allowed, first_row):
        return None
    return "it is not the causal mask (a window, a prefix, a shifted diagonal or padding)"


def causal_reason_by_rows(plan: RowBlocks, q_len: int, kv_len: int) -> Optional[str]:
    """``causal_reason`` for a mask evaluated a block of rows at a time (patterns/mask_rows.py)."""
    shape = plan.mask.meta.get("example_value", plan.mask.meta.get("val")).shape
    if len(shape) < 2 or shape[-2] not in (1, q_len) or shape[-1] not in (1, kv_len):
        return f"its shape {tuple(shape)} does not end in [{q_len}, {kv_len}]"
    for first_row, value in plan.blocks():
        if value.shape[-2] == 1 and shape[-2] == 1:  # broadcast along the rows: the whole mask at once
            return causal_reason(value, q_len, kv_len)
        allowed, why_not = allowed_of(value)
        if why_not:
            return why_not
        why_not = _rows_reason(allowed.expand(*allowed.shape[:-1], kv_len), first_row)
        if why_not:
            return why_not
    return None


def _value_bytes(node: fx.Node) -> int:
    value = node.meta.get("example_value", node.meta.get("val"))
    values = value if isinstance(value, (list, tuple)) else [value]
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def evaluation_budget(device: torch.device) -> int:
    """Bytes a compile-time mask evaluation on ``device`` may hold (see CPU_EVALUATION_BYTES)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEVICE_EVALUATION_SHARE)
    return CPU_EVALUATION_BYTES


class _Prover:
    """Proves masks causal once per mask node (q and k lengths part of the key), remembering the reasons and,
    for a proven mask, its producers (so each mask's graph scan runs once, however many layers read it)."""

    def __init__(self) -> None:
        self.proven: dict[tuple[fx.Node, int, int], tuple[Optional[str], list[fx.Node]]] = {}

    def check(self, gm: fx.GraphModule, mask: fx.Node, q_len: int, kv_len: int) -> tuple[Optional[str],
                                                                                          list[fx.Node]]:
        """(None, the mask's producers) when ``mask`` is causal at these lengths, else (why not, [])."""
        key = (mask, q_len, kv_len)
        if key not in self.proven:
            self.proven[key] = self._check(gm, mask, q_len, kv_len)
        return self.proven[key]

    @staticmethod
    def _check(gm: fx.GraphModule, mask: fx.Node, q_len: int, kv_len: int) -> tuple[Optional[str], list[fx.Node]]:
        producers, why_not = _closed_producers(mask)
        if why_not:
            return why_not, []
        example = tensor_of(mask)
        device = example.device if example is not None else torch.device("cpu")
        # The producers' values, and the check's two bool masks of the mask's size (allowed, blocked).
        needed = sum(_value_bytes(n) for n in producers) + 2 * (example.numel() if example is not None else 0)
        budget = evaluation_budget(device)
        plan = None
        if needed > budget:
            plan, by_rows_not = RowBlocks.build(producers, mask)
            if plan is None:
                where = ": a quarter of the free memory" if device.type == "cuda" else ""
                return (f"evaluating it at compile time would hold up to {needed / 2**30:.1f} GiB on {device}, more "
                        f"than sloth allows itself ({budget / 2**30:.1f} GiB{where}), and it cannot be evaluated "
                        f"a block of rows at a time: {by_rows_not}"), []
        value = None
        try:
            if plan is not None:
                why_not = causal_reason_by_rows(plan, q_len, kv_len)
            else:
                value = _evaluate(gm, producers, mask)
                why_not = causal_reason(value, q_len, kv_len)
        except Exception as error:  # an op that cannot run outside the graph (or out of memory): leave it as it was
            return f"evaluating it at compile time failed ({type(error).__name__}: {error})", []
        finally:
            value = None
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the evaluation's memory back to the device before training starts
        return why_not, [] if why_not else producers


def _example(placeholder: fx.Node) -> Optional[torch.Tensor]:
    """The real tensor Dynamo traced ``placeholder`` with, when it kept one (a graph it made from a frame does;
    DDP's split pieces' inputs from other pieces do not), else None."""
    grapharg = placeholder.meta.get("grapharg")
    try:
        example = grapharg.example if grapharg is not None else None
    except Exception:  # its weak reference expired
        return None
    return example if isinstance(example, torch.Tensor) else None


def _input_position(graph_module: fx.GraphModule, mask: Any,
                    call_sites: Optional[list[tuple[fx.GraphModule, list[Any]]]], placeholders: list[fx.Node],
                    inputs: list[fx.Node]) -> Optional[int]:
    """The position among the top-level graph's ``inputs`` of the one tensor ``mask`` is, else None: ``mask``
    itself in the top-level graph; in a body, the top-level input every call site passes in its place."""
    if not isinstance(mask, fx.Node) or mask.op != "placeholder":
        return None
    if not call_sites:
        return inputs.index(mask) if mask in inputs else None
    position = placeholders.index(mask)
    passed = {_whole(operands[position]) if position < len(operands) else None for _, operands in call_sites}
    if len(passed) != 1:
        return None
    (top,) = passed
    return inputs.index(top) if isinstance(top, fx.Node) and top in inputs else None


def _lengths(q: Any, k: Any) -> Optional[tuple[int, int]]:
    q_t, k_t = tensor_of(q), tensor_of(k)
    if q_t is None or k_t is None or q_t.dim() < 2 or k_t.dim() < 2:
        return None
    q_len, kv_len = q_t.shape[-2], k_t.shape[-2]
    if not isinstance(q_len, int) or not isinstance(kv_len, int):
        return None
    return q_len, kv_len


def _body_operands(gm: fx.GraphModule) -> dict[fx.GraphModule, list[tuple[fx.GraphModule, list[Any]]]]:
    """For each body of a ``BODY_CALLS`` higher-order op in ``gm``: (caller graph, operands) per call site."""
    sites: dict[fx.GraphModule, list[tuple[fx.GraphModule, list[Any]]]] = {}
    for node in gm.graph.nodes:
        body = body_of(node)
        if body is not None:
            sites.setdefault(body, []).append((gm, list(node.args[1:])))
    return sites


def erase_unused(nodes: Sequence[fx.Node]) -> None:
    """Erase those of ``nodes`` that nobody reads any more (in reverse order, so producers follow users); one
    erased already (a mask shared by several layers, erased with the last) is left alone."""
    for node in reversed(nodes):
        if node.op not in ("placeholder", "output") and not node.users and not getattr(node, "_erased", False):
            node.graph.erase_node(node)


def fuse_causal_mask_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                          options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace every provably causal SDPA mask in ``gm`` and in its checkpointed bodies by ``is_causal=True``;
    record the masks ``gm`` returns proven causal and the sites that read a mask input (module docstring)."""
    prover = _Prover()
    bodies = _body_operands(gm)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sites: list[tuple[fx.GraphModule, fx.Node, int]] = []
    for graph_module in [gm, *bodies]:
        _rewrite(graph_module, bodies.get(graph_module), prover, report, inputs, sites, options.mask_check)
    if bodies:
        gm.recompile()
    if sites:
        gm.meta[MASK_INPUT_SITES] = sites
    proven = _proven_outputs(gm, prover)
    if proven:
        gm.meta[PROVEN_OUTPUTS] = proven
    return gm


def _mask_shaped(value: Any) -> Optional[tuple[int, int]]:
    """(L, S) of a value shaped as transformers' masks are, [batch, 1, L, S] bool or float, else None."""
    if not isinstance(value, torch.Tensor) or value.dim() != 4 or not isinstance(value.shape[1], int) \
            or value.shape[1] != 1 or not (value.dtype == torch.bool or value.is_floating_point()):
        return None
    q_len, kv_len = value.shape[-2], value.shape[-1]
    return (q_len, kv_len) if isinstance(q_len, int) and isinstance(kv_len, int) else None


def _proven_outputs(gm: fx.GraphModule, prover: _Prover) -> list[int]:
    """The positions of ``gm``'s outputs that are masks proven causal at their own lengths."""
    outputs = gm.graph.output_node().args[0]
    if not isinstance(outputs, (tuple, list)):
        return []
    proven = []
    for position, node in enumerate(outputs):
        lengths = _mask_shaped(tensor_of(node)) if isinstance(node, fx.Node) else None
        if lengths is not None and node.op != "placeholder" and prover.check(gm, node, *lengths)[0] is None:
            proven.append(position)
    return proven


def _whole(mask: Any) -> Any:
    """``mask`` with the slices that keep all of it taken off (transformers' ``mask[:, :, :, :kv_len]``)."""
    while isinstance(mask, fx.Node) and mask.op == "call_function" and mask.target is operator.getitem \
            and isinstance(mask.args[1], tuple) and isinstance(mask.args[0], fx.Node) \
            and all(isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1) for i in mask.args[1]):
        inner, outer = tensor_of(mask.args[0]), tensor_of(mask)
        if inner is None or outer is None or tuple(inner.shape) != tuple(outer.shape):
            break
        mask = mask.args[0]
    return mask


def _rewrite(graph_module: fx.GraphModule, call_sites: Optional[list[tuple[fx.GraphModule, list[Any]]]],
             prover: _Prover, report: Report, inputs: list[fx.Node], sites: list[tuple[fx.GraphModule, fx.Node, int]],
             check: bool) -> None:
    """Rewrite ``graph_module``'s proven masks; append to ``sites`` the SDPA nodes reading a mask that is one of
    the top-level graph's ``inputs`` (directly or, in a body, through every call site); ``check``: whether a mask
    input nobody proved may be checked on its device (the ``mask_check`` option)."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    changed = False
    for node in list(graph_module.graph.nodes):
        parts = _attention_parts(node)
        if parts is None:
            continue
        q, k, mask, is_causal = parts
        if not isinstance(mask, fx.Node) or is_causal is not False:
            continue
        lengths = _lengths(q, k)
        if lengths is None:
            report.reject(FAMILY, node, "the query or key length is symbolic (dynamic shapes)")
            continue
        whole = _whole(mask)
        from_input = _input_position(graph_module, whole, call_sites, placeholders, inputs)
        if from_input is not None and _mask_shaped(tensor_of(whole)) == lengths:
            name = inputs[from_input].target
            example = _example(inputs[from_input])
            writer = mutated_producer(graph_module.graph, {whole}) or \
                mutated_producer(inputs[from_input].graph, {inputs[from_input]})
            if writer is not None:
                report.reject(FAMILY, node, f"attention mask kept: it is the graph input {name!r}, which "
                                            f"{writer.name} writes in place")
                continue
            if example is not None and not proven_masks.known_causal(example, check):
                why = ("the tensor it got while compiling is not the causal mask (a padding mask or a window)" if check
                       else "made where no graph proved it causal (a padding mask, a mask built eagerly, or one "
                            "computed from another graph's inputs), and mask_check is off")
                report.reject(FAMILY, node, f"attention mask kept: it is the graph input {name!r}, {why}")
                continue
            sites.append((graph_module, node, from_input))
            report.kept_on_purpose(FAMILY, node)
            seen = ("no tensor to look at while compiling" if example is None
                    else "the tensor it got now is known causal")
            how = ("another graph returned it proven or its values were checked causal on the device (once per "
                   "tensor, one sync)" if check else "another graph returned it proven")
            report.replaced(Site(FAMILY, "is_causal=True when proven", module_path(node), source_location(node),
                                 f"{lengths[0]} x {lengths[1]} mask from graph input {name!r} ({seen}): causal when "
                                 f"{how}, as written otherwise (chosen per call)"))
            continue
        if mask.op == "placeholder" and call_sites:
            position = placeholders.index(mask)
            reasons = [prover.check(caller, operands[position], *lengths)[0] if position < len(operands)
                       and isinstance(operands[position], fx.Node) else "the call site passes no mask node"
                       for caller, operands in call_sites]
            why_not = next((r for r in reasons if r), None)
            producers: list[fx.Node] = []  # the caller's: its top-level mask stays passed to the body
        else:
            why_not, producers = prover.check(graph_module, mask, *lengths)
        if why_not:
            report.reject(FAMILY, node, f"attention mask kept: {why_not}")
            continue
        set_causal(node)
        erase_unused(producers)
        changed = True
        report.replaced(Site(FAMILY, "is_causal=True", module_path(node), source_location(node),
                             f"causal {lengths[0]} x {lengths[1]} mask dropped"))
    if changed:
        graph_module.recompile()


# The family's anchor (compiler/anchors.py): where its sites are, more broadly than its matchers take them.
def anchor(node: fx.Node) -> bool:
    """The ``causal_mask`` family's anchor: scaled_dot_product_attention with an attn_mask node and is_causal False"""
    if not (node.op == "call_function" and node.target is F.scaled_dot_product_attention):
        return False
    params = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), node.args), **node.kwargs)
    return isinstance(params.get("attn_mask"), fx.Node) and params.get("is_causal", False) is False


def compile_with(gm: fx.GraphModule, compile_once: Any, options: PassOptions) -> Any:
    """The family's ``compile_with``: a graph that reads a mask input compiled twice, the version chosen per call,
    and a graph's proven mask outputs marked (patterns/mask_inputs.py, which imports this module)."""
    from .mask_inputs import compile_reading_masks

    return compile_reading_masks(gm, compile_once, check=options.mask_check)


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_causal_mask_pass, order=110, anchor=anchor, whole_module=True,
                     reads=("mask_check",), records=(MASK_INPUT_SITES, PROVEN_OUTPUTS),
                     compile_with=compile_with,
                     summary="an SDPA mask proven at compile time to be causal -> `is_causal=True`")
