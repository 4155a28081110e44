"""Three rewrites of the backward graphs Inductor compiles: less recomputed work and less memory, the same bits.

**1. A recomputed LoRA forward read only for its adapter activation is dropped.** Each LoRA op returns
``(y, h)`` with ``h = x @ a.T`` ([tokens, r], fp32), which its backward reads (``db = s * dy.T @ h``). In a
checkpointed layer AOTAutograd's partitioner recomputes in the backward whatever the backward reads, so
where nothing in the backward reads a projection's output (the MLP's down projection, whose output only
feeds the residual) it recomputes the whole op, its base GEMM included, to get h alone:

    y, h = lora_linear(x, w, ...)           y read by nothing in the backward
    dx, da, db = lora_linear_backward(dy, x, w, a, b, h, ...)
    becomes
    dx, da, db = lora_linear_backward(dy, x, w, a, b, None, ...)     h recomputed inside, one pass over x

For the fused down projection (``glu_lora_linear``) the backward already forms the GLU's output to compute
da, so h costs one rank-r product over it. The tiled MLP (``lora_mlp_tiled``, lowering/tiled_mlp.py), whose
backward recomputes gate and up block by block anyway, is not run again at all: its backward forms both of
its adapter activations in those blocks, so under checkpointing the tiled MLP does no more GEMM work than
the untiled one. o_proj's output makes the residual the post-attention norm's backward reads, so it is
recomputed anyway, unless offload's ``mid_layer`` saves that residual; the last layer's output is read by
the final norm's backward, so its down projection stays too. At Llama-3-8B's shape the dropped GEMM is
down's (14336 x 4096) in every other layer: on an H100 the 16k step took 5.2% less time
(benchmarks/results/2026-12-06_issue19_lean_backward.md). The recomputed h is the forward's bit for bit
(the same kernel on the same x; lowering/lora.py ``adapter_activation``).

**2. Backward ops write their input gradients over activations nothing reads again.** The GLU-LoRA
backward reads the MLP's two intermediate activations, ``gate`` and ``up`` (tokens x intermediate each),
and writes ``d_gate`` and ``d_up`` of the same size. Where it is their last reader they take the gradients
instead, elementwise in the same kernel pass (every element's g, u and dy are read before its dg and du
are written; lowering/glu.py):

    d_gate, d_up, da, db = glu_lora_linear_backward(dy, gate, up, ...)     two new T x I tensors
    becomes
    da, db = glu_lora_linear_backward_inplace(dy, gate, up, ...)           gate now holds d_gate, up d_up

At Llama-3-8B's 16k tokens a T x I tensor is 448 MiB; the MLP's backward, where a checkpointed step peaks
(benchmarks/results/2026-12-05_h100_2148_memory-peak-16k-offload.txt: gate, up, d_hidden, d_gate and d_up
alive together, 2.2 GiB), then holds 1.3 GiB.

It applies where gate and up are made by the same graph (not graph inputs), read by nothing after the
backward op (a recomputed forward that read them before it, as in the last layer, is fine), and share their
memory with no other value of the graph. In a backward that is the checkpointed layer, which recomputes gate
and up right there. Without checkpointing they are saved tensors, inputs of the backward graph, and stay
untouched: a saved tensor may be one the user holds, or be read by a second backward (``retain_graph=True``).

**3. A norm read on both sides of the attention backward is formed again after it.** A checkpointed layer's
backward recomputes the input norm's output y = rms_norm(x) first, for the q/k/v projections it recomputes, and
reads it again only after the attention's backward, for their adapters' and weights' gradients. So y (tokens x
hidden) is alive through the attention backward, where the layer's backward holds the most (the recomputed
attention output, dO, dQ and the kernel's fp32 dQ accumulator). The readers after the attention backward get a
second rms_norm of the same x, formed right before the first of them, and y dies at the recompute:

    y = rms_norm(x, w); q, k, v = qkv(y); ... attention backward ...; qkv_backward(..., y, ...)
    becomes
    y = rms_norm(x, w); q, k, v = qkv(y); ... attention backward ...; y2 = rms_norm(x, w); qkv_backward(..., y2, ...)

x stays alive there anyway (the norm's own backward reads it at the end), y2 is y bit for bit (the same kernel
on the same input), and the cost is one more norm pass a layer (a read of x and a write of y: at Llama-3-8B's 16k
tokens 128 MiB less at that point for ~0.1 ms on an H100, estimated, not yet measured). It applies only where y is
read before and after an attention backward and x is read at or after the later readers.

All run as one post-grad pass (compiler/late_passes.py), after the runtime twins; ``options={"disable":
["lean_backward"]}`` switches them off.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .fx_utils import is_attention_backward


def _overloads(name: str) -> list[Any]:
    """``sloth::name`` and its runtime twin, where it has one."""
    from ..lowering import registration

    op = getattr(torch.ops.sloth, name).default
    twin = registration.RUNTIME_TWINS.get(op)
    return [op] if twin is None else [op, twin]


def _registered() -> None:
    from ..lowering import glu_lora, lora, qlora, tiled_mlp

    lora.register()
    qlora.register()
    glu_lora.register()
    glu_lora.register_4bit()
    tiled_mlp.register()


def _h_readers() -> dict[Any, tuple[set, dict[int, int]]]:
    """forward op -> (the backward ops that may read its adapter activations, {the forward's output index: the
    position among the backward's arguments}); the forward's output 0 is y, and it has no outputs beyond these."""
    _registered()
    table = {}
    for forward, backward, positions in (("lora_linear", "lora_linear_backward", {1: 5}),
                                         ("qlora_linear", "qlora_linear_backward", {1: 13}),
                                         ("glu_lora_linear", "glu_lora_linear_backward", {1: 7}),
                                         ("glu_qlora_linear", "glu_qlora_linear_backward", {1: 15}),
                                         # h1 and h2; with the projections kept (more outputs) it stays
                                         ("lora_mlp_tiled", "lora_mlp_tiled_backward", {1: 11, 2: 12})):
        readers = set(_overloads(backward))
        if backward.startswith("glu"):
            readers |= set(_overloads(backward + "_inplace"))
        for op in _overloads(forward):
            table[op] = (readers, positions)
    return table


def _in_place_forms() -> dict[Any, Any]:
    """backward op -> its in-place form; both take (dy, gate, up, ...), and the in-place one returns the
    backward's outputs from the third on (the first two, d_gate and d_up, are then gate and up)."""
    _registered()
    forms = {}
    for name in ("glu_lora_linear_backward", "glu_qlora_linear_backward"):
        forms.update(zip(_overloads(name), _overloads(name + "_inplace")))
    return forms


def drop_recomputed_forwards(graph: fx.Graph) -> int:
    """Rewrite 1 of the module docstring; returns how many forward ops were dropped."""
    table = _h_readers()
    dropped = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in table]:
        readers, positions = table[node.target]
        items = list(node.users)
        if not all(u.op == "call_function" and u.target is operator.getitem for u in items):
            continue
        if any(item.args[1] == 0 and item.users for item in items):
            continue  # y is read: the op is needed
        if any(item.args[1] not in positions and item.args[1] != 0 for item in items):
            continue  # an output the backward cannot recompute (the tiled op's kept projections)
        uses = [(item.args[1], user) for item in items if item.args[1] in positions for user in item.users]
        if not uses or not all(user.target in readers and len(user.args) > positions[index]
                               and user.args[positions[index]] in items
                               and sum(arg is user.args[positions[index]] for arg in user.args) == 1
                               for index, user in uses):
            continue
        for index, user in uses:
            user.update_arg(positions[index], None)
        for item in items:
            graph.erase_node(item)
        graph.erase_node(node)
        dropped += 1
    return dropped


def _storage(node: fx.Node) -> Optional[StorageWeakRef]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (NotImplementedError, RuntimeError):  # a tensor without storage (a subclass): never rewritten
        return None


def _owned(node: Any, op_node: fx.Node, storages: dict[StorageWeakRef, int], order: dict[fx.Node, int]) -> bool:
    """Whether ``op_node`` may write over ``node``: made by this graph, read after op_node by nothing (readers
    before it are fine: Inductor orders a mutation after the reads that precede it, as for its own in-place
    rewrites), contiguous, and the only value of the graph in its memory."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if any(order.get(user, len(order)) > order[op_node] for user in node.users):  # a node added since: after
        return False
    storage = _storage(node)
    return storage is not None and storages.get(storage) == 1 and node.meta["val"].is_contiguous()


def write_gradients_in_place(graph: fx.Graph) -> int:
    """Rewrite 2 of the module docstring; returns how many backward ops were swapped."""
    forms = _in_place_forms()
    candidates = [n for n in graph.nodes if n.op == "call_function" and n.target in forms]
    if not candidates:
        return 0
    storages: dict[StorageWeakRef, int] = {}
    order: dict[fx.Node, int] = {}
    for index, node in enumerate(graph.nodes):
        order[node] = index
        storage = _storage(node)
        if storage is not None:
            storages[storage] = storages.get(storage, 0) + 1
    swapped = 0
    for node in candidates:
        gate, up = node.args[1], node.args[2]
        if not _owned(gate, node, storages, order) or not (
                up is None or (up is not gate and _owned(up, node, storages, order))):
            continue
        items = list(node.users)
        if not all(u.op == "call_function" and u.target is operator.getitem for u in items):
            continue
        # d_up of a merged gate/up (up None) is an empty placeholder tensor; nothing may read it, as nothing
        # could after the swap.
        if up is None and any(item.args[1] == 1 and item.users for item in items):
            continue
        with graph.inserting_before(node):
            in_place = graph.call_function(forms[node.target], node.args, node.kwargs)
        in_place.meta = {**node.meta, "val": tuple(node.meta["val"][2:])} if "val" in node.meta else dict(node.meta)
        for item in items:
            index = item.args[1]
            if index in (0, 1):
                if item.users:  # d_gate, d_up: now gate and up, read after the in-place op wrote them
                    item.replace_all_uses_with(gate if index == 0 else up)
            else:
                with graph.inserting_before(item):
                    new_item = graph.call_function(operator.getitem, (in_place, index - 2))
                new_item.meta = dict(item.meta)
                item.replace_all_uses_with(new_item)
            graph.erase_node(item)
        graph.erase_node(node)
        swapped += 1
    return swapped


def norm_again_after_attention(graph: fx.Graph) -> int:
    """Rewrite 3 of the module docstring; returns how many norms were formed again."""
    from ..lowering import rms_norm

    rms_norm.register()
    norms = set(_overloads("rms_norm"))
    order = {node: index for index, node in enumerate(graph.nodes)}
    attention = [order[n] for n in graph.nodes if is_attention_backward(n)]
    formed = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in norms]:
        users = sorted(node.users, key=order.__getitem__)
        after = [a for a in attention if users and a > order[users[0]]]
        late = [u for u in users if after and order[u] > after[0]]
        x = node.args[0]
        if not late or len(late) == len(users) or not isinstance(x, fx.Node) \
                or not any(order[u] >= order[late[0]] for u in x.users if u is not node):
            continue  # nothing to split, or x itself would live longer for it
        with graph.inserting_before(late[0]):
            again = graph.call_function(node.target, node.args, node.kwargs)
        again.meta = dict(node.meta)
        for user in late:
            user.replace_input_with(node, again)
        formed += 1
    return formed


def lean_backward(graph: fx.Graph) -> tuple[int, int, int]:
    """The three rewrites on ``graph``, in order (the first leaves gate and up to the backward op alone);
    (forwards dropped, backwards made in-place, norms formed again)."""
    return drop_recomputed_forwards(graph), write_gradients_in_place(graph), norm_again_after_attention(graph)
