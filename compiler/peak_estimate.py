"""The step's peak memory, estimated from the graph Dynamo hands over, before any pass: what the plan weighs its
memory savers with (compiler/planner.py).

    peak = weights + gradients + activations + returned logits - (what the chosen savers move or free)

``weights``: the bytes of the parameters and buffers the graph reads (each storage once: tied weights count once).
``gradients``: the bytes of those that require grad (the gradients a backward leaves). ``activations``: the bytes a
backward reads (none, nor gradients, in a graph whose outputs need no gradient), by a rule over the forward graph
that follows what sloth's fused ops and Inductor's partitioner keep, not what eager autograd keeps (eager also keeps
every pointwise step of a norm, a RoPE or a LoRA scale, which sloth's ops recompute or never form): the activation
inputs of every matrix product whose output requires grad (``linear``, ``matmul``, ``bmm``, attention: its q, k and
v, and its output, which the output projection reads) and the gate and up of each gated MLP (``act(gate) * up``),
each tensor once (a view counts as the tensor it views or casts). Inside a checkpointed layer (a
``tag_activation_checkpoint`` body) only the layer's inputs are kept, and the largest layer's own activations exist
once, while it is recomputed in the backward. Measured against it: Llama-3-8B LoRA 2 x 2048 holds about 54k bf16
values a token a layer (28.3 GiB on one H100, benchmarks/results/2026-12-07_issue55_lora8b_before_after_h100.md),
the rule counts 10 x 4096 + 3 x 14336 = 84k (hidden size 4096, MLP 14336): an upper bound. The report sets the
estimate beside the peak measured after the first step.

What each saver is estimated to free:

    offload        the checkpointed layers' inputs, but the last layer's (``keep_last``), go to host memory
    tiled_mlp      a gated MLP's gate, up, activation and product (``act(gate) * up``) exist one block of
                   ``rows`` at a time: their bytes times ``1 - rows / tokens``, for every such MLP outside
                   checkpointed layers, and the largest one inside them
    return_logits  "lazy": the logits a fused loss's graph returns (the output of a matrix product a cross-entropy
                   reads, and a float32 copy of it the graph returns), alive at the forward's end, not formed
    moe_recompute  not estimated (0): the plan adds it last, when nothing else brings the peak under the budget
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from .fx_utils import tensor_of
from .writes import flat_nodes

GiB = 1024 ** 3

# Matrix products: their activation inputs are what their backward reads.
_MATMULS = {F.linear, torch.matmul, operator.matmul, torch.bmm, torch.baddbmm, torch.mm, torch.einsum,
            F.scaled_dot_product_attention}
_MATMUL_METHODS = {"matmul", "bmm", "mm", "__matmul__"}
# Views, and casts: a value read through one is counted as the tensor it views or casts (sloth's ops read a
# LoRA's input in the model's dtype where peft casts it to the adapter's float32).
_VIEW_METHODS = {"view", "reshape", "flatten", "transpose", "permute", "contiguous", "expand", "unsqueeze",
                 "squeeze", "narrow", "t", "unflatten", "view_as", "expand_as", "to", "float", "bfloat16", "half",
                 "type_as"}
_VIEW_FUNCTIONS = {torch.reshape, torch.flatten, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze,
                   torch.narrow, operator.getitem}
_ACTIVATIONS = {F.silu, F.gelu, F.relu, torch.sigmoid, torch.tanh, F.mish}


def _bytes(value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    count = math.prod(value.shape)
    return count * value.element_size() if isinstance(count, int) else 0  # a symbolic size: not counted


def is_view_or_cast(node: fx.Node) -> bool:
    """A view or cast of another value (``_VIEW_METHODS``, ``_VIEW_FUNCTIONS``): no memory of its own here."""
    return (node.op == "call_method" and node.target in _VIEW_METHODS
            or node.op == "call_function" and node.target in _VIEW_FUNCTIONS)


def _viewed(node: Any) -> Any:
    """The node whose tensor ``node`` views or casts (itself when it is neither)."""
    while isinstance(node, fx.Node) and node.args and is_view_or_cast(node) \
            and tensor_of(node.args[0]) is not None:  # not into split's or chunk's tuple: its pieces are the tensors
        node = node.args[0]
    return node


def _is_matmul(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _MATMULS
            or node.op == "call_method" and node.target in _MATMUL_METHODS)


def is_checkpoint(node: fx.Node) -> bool:
    """A checkpointed layer's call (``tag_activation_checkpoint``)."""
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "tag_activation_checkpoint"


def _activation(node: Any) -> bool:
    return isinstance(node, fx.Node) and (node.op == "call_function" and node.target in _ACTIVATIONS
                                          or node.op == "call_method" and node.target in ("silu", "gelu", "relu",
                                                                                          "sigmoid"))


def _glu_parts(node: fx.Node) -> tuple:
    """(gate, act(gate), up) when ``node`` is ``act(gate) * up``, else ()."""
    if not (node.op == "call_function" and node.target in (operator.mul, torch.mul) and len(node.args) == 2):
        return ()
    a, b = node.args
    act = a if _activation(a) else b if _activation(b) else None
    if act is None or not act.args:
        return ()
    return act.args[0], act, (b if act is a else a)


@dataclasses.dataclass(frozen=True)
class GraphMemory:
    """One graph's (or one layer body's) activations and what the tiled MLP would free in it."""
    activations: int = 0
    checkpoint_inputs: tuple[int, ...] = ()  # bytes of each checkpointed layer's inputs, in order
    layer_peak: int = 0  # the largest checkpointed layer's own activations (recomputed in the backward)
    glu: tuple[int, ...] = ()  # bytes of each gated MLP outside checkpointed layers
    layer_glu: int = 0  # the largest gated MLP inside a checkpointed layer


def _graph_memory(gm: fx.GraphModule, weights: frozenset = frozenset()) -> GraphMemory:
    """``weights``: the nodes that are parameters or buffers (a checkpointed layer's inputs besides them are what
    it keeps)."""
    activations, inputs, layer_peak, glu, layer_glu = 0, [], 0, [], 0
    counted: set = set()
    for node in gm.graph.nodes:
        if is_checkpoint(node):
            body = getattr(gm, node.args[0].target, None) if isinstance(node.args[0], fx.Node) else None
            inputs.append(sum(_bytes(tensor_of(a)) for a in node.args[1:]
                              if isinstance(a, fx.Node) and a not in weights))
            if isinstance(body, fx.GraphModule):
                # the body's placeholders stand for the call's arguments, in order: weights where those are
                body_inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
                inner = _graph_memory(body, frozenset(p for p, a in zip(body_inputs, node.args[1:]) if a in weights))
                layer_peak = max(layer_peak, inner.activations + inner.layer_peak)
                layer_glu = max(layer_glu, *inner.glu, inner.layer_glu, 0)
            continue
        if node.op not in ("call_function", "call_method"):
            continue
        saved = []
        out = tensor_of(node)
        if _is_matmul(node) and out is not None and out.requires_grad:
            saved = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
            if node.target is F.scaled_dot_product_attention:
                saved.append(node)  # its output, which its backward reads
        glu_parts = _glu_parts(node) if out is not None and out.requires_grad else ()
        if glu_parts:
            gate, act, up = glu_parts
            saved += [gate, up]
            glu.append(sum(_bytes(tensor_of(n)) for n in (gate, act, up, node)))
        for value in saved:
            source = _viewed(value)
            if source not in weights and source not in counted:
                counted.add(source)
                activations += _bytes(tensor_of(source))
    return GraphMemory(activations, tuple(inputs), layer_peak, tuple(glu), layer_glu)


@dataclasses.dataclass(frozen=True)
class PeakEstimate:
    """The estimate (module docstring), in bytes."""
    weights: int
    gradients: int
    activations: int  # with no saver, checkpointed layers' inputs and the largest layer's recomputation included
    offload_frees: int
    glu_bytes: int  # of the gated MLPs the tiled MLP would run in blocks (before the ``1 - rows / tokens``)
    tokens: int
    training: bool = True  # False: no output requires grad, so no backward follows and no saver applies
    logits: int = 0  # the returned logits a fused loss reads (module docstring), in the peak until made lazy

    def saving(self, saver: str, rows: int = 0) -> int:
        """The bytes ``saver`` is estimated to free (``rows``: the tiled MLP's block)."""
        if saver == "offload":
            return self.offload_frees
        if saver == "return_logits":
            return self.logits
        if saver == "tiled_mlp" and 0 < rows < self.tokens:
            return int(self.glu_bytes * (1 - rows / self.tokens))
        return 0

    def peak(self, savers: Iterable[tuple[str, int]] = ()) -> int:
        """The estimated peak with ``savers`` ((name, rows) pairs) on."""
        freed = sum(self.saving(name, rows) for name, rows in savers)
        return self.weights + self.gradients + max(0, self.activations + self.logits - freed)

    def describe(self, savers: Iterable[tuple[str, int]] = ()) -> str:
        savers = list(savers)
        return (f"estimated peak {self.peak(savers) / GiB:.2f} GiB (weights {self.weights / GiB:.2f}, gradients "
                f"{self.gradients / GiB:.2f}, activations and logits at most "
                f"{max(0, self.activations + self.logits - sum(self.saving(n, r) for n, r in savers)) / GiB:.2f})")


def _parameter_bytes(example_inputs: Sequence[Any], trainable: bool) -> int:
    seen, total = set(), 0
    for x in example_inputs:
        if not isinstance(x, torch.nn.Parameter) or (trainable and not x.requires_grad):
            continue
        try:
            key = (x.device, x.untyped_storage().data_ptr())
        except Exception:  # a tensor without storage (a subclass): counted by its size
            key = id(x)
        if key in seen:
            continue
        seen.add(key)
        total += _bytes(x)
    return total


_LOSSES = {F.cross_entropy, F.nll_loss, F.log_softmax, torch.log_softmax}


def _returned_logits_bytes(gm: fx.GraphModule, returned: set) -> int:
    """The bytes of returned logits a loss reads: each matrix product whose value (through views and casts) a
    cross-entropy or log-softmax reads and the graph returns, with a returned cast of it."""
    total, seen = 0, set()
    for node in gm.graph.nodes:
        if not (node.op == "call_function" and node.target in _LOSSES and node.args):
            continue
        source = _viewed(node.args[0])
        if not (isinstance(source, fx.Node) and _is_matmul(source)) or source in seen:
            continue
        seen.add(source)
        casts = [u for u in source.users if u in returned and u.op == "call_method" and u.target in ("float", "to")]
        if source in returned or casts:
            total += _bytes(tensor_of(source)) + sum(_bytes(tensor_of(c)) for c in casts)
    return total


def estimate_peak(gm: fx.GraphModule, example_inputs: Sequence[Any], tokens: int) -> PeakEstimate:
    """The peak of the step ``gm`` computes, before any pass (module docstring)."""
    # buffers are graph inputs too, not Parameters: known by their placeholders' names
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    buffers = [(n, x) for n, x in zip(placeholders, example_inputs) if "_buffers_" in n.name
               and isinstance(x, torch.Tensor)]
    weights = frozenset(n for n, x in zip(placeholders, example_inputs) if isinstance(x, torch.nn.Parameter)) | \
        frozenset(n for n, _ in buffers)
    returned = set(flat_nodes([n.args for n in gm.graph.nodes if n.op == "output"]))
    weight_bytes = _parameter_bytes(example_inputs, False) + sum(_bytes(x) for _, x in buffers)
    if not any(getattr(tensor_of(n), "requires_grad", False) for n in returned):  # no backward: the weights alone
        return PeakEstimate(weights=weight_bytes, gradients=0, activations=0, offload_frees=0, glu_bytes=0,
                            tokens=tokens, training=False)
    memory = _graph_memory(gm, weights)
    checkpointed = sum(memory.checkpoint_inputs)
    offload_frees = checkpointed - (memory.checkpoint_inputs[-1] if memory.checkpoint_inputs else 0)
    return PeakEstimate(weights=weight_bytes, gradients=_parameter_bytes(example_inputs, True),
                        activations=memory.activations + checkpointed + memory.layer_peak,
                        offload_frees=offload_frees, glu_bytes=sum(memory.glu) + memory.layer_glu, tokens=tokens,
                        logits=_returned_logits_bytes(gm, returned))
