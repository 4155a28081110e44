"""A long sequence's attention backward run in chunks of heads: the same gradients in less memory.

An SDPA kernel's backward holds, beside its outputs dQ, dK and dV, a workspace that grows with the query heads
(fp32 accumulators; with grouped heads, dK and dV at the query heads' count before the group sum). At
Llama-3-8B's shape (32 query heads, 8 key heads, head dim 128) and 16k tokens, cuDNN's grouped backward held
706 MiB, a 514 MiB block besides its 192 MiB of outputs, at the top of a checkpointed step's memory (H100,
benchmarks/results/2026-12-06_h100_0530_memory-peak-16k-offload-mid-tiled-gqa.txt). Each query head's
gradients depend only on that head's q, out, dO and logsumexp and on its key head's k and v, and a key head's
dK and dV only on the query heads of its group, so the backward splits over groups of key heads with no change
to the math:

    dq, dk, dv = sdpa_backward(dO, q, k, v, out, lse, ...)                       q: [B, Hq, S, D], k: [B, Hk, S, D]
    becomes, for c = 0 .. n-1 (Hk / n key heads kc and their Hq / n query heads qc each)
    dq_c, dk_c, dv_c = sdpa_backward(dO[:, qc], q[:, qc], k[:, kc], v[:, kc], out[:, qc], lse[:, qc], ...)
    dq = cat(dq_0 .. dq_n-1, heads), laid out as dq was; likewise dk, dv

A chunk's workspace is 1/n of the whole; the price is one copy of the outputs into their concatenation (for that
copy the chunks and the whole are alive together: 2 x 192 MiB at that shape, less than the kernel's 706). n is the
smallest divisor of Hk that brings a chunk's query under ``CHUNK_BYTES`` (32 MiB: 4 chunks at 16k tokens, 8 at
64k); sequences whose query is under ``MIN_BYTES`` (64 MiB: 8k tokens at that shape) are left whole, where the
workspace is small and the extra launches would cost more than the memory is worth.

It applies to SDPA's cuDNN and flash backwards (and flash's CPU kernel, which the CPU tests use), with no
dropout (its random stream is drawn over all heads), no mask or bias, no nested (variable-length) batch, and head
counts fixed at compile time (the slices are cut at them). Each chunk's logsumexp is copied to a contiguous
tensor ([B, Hq/n, S] fp32, 512 KiB a chunk at 16k tokens): flash's CUDA backward indexes it as if it were
contiguous, which a slice across heads is not once B > 1 (cuDNN and the CPU kernel read its strides).
A post-grad pass (compiler/late_passes.py) after compiler/lean_backward.py's rewrites; ``options={"disable":
["attention_chunks"]}`` switches it off.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

MIN_BYTES = 64 * 2**20  # a query this large or larger (bytes) has its attention backward chunked
CHUNK_BYTES = 32 * 2**20  # each chunk's query at most this large, where the key heads divide that finely

aten = torch.ops.aten


@functools.cache
def _arguments() -> dict[Any, dict[str, Any]]:
    """Per backward op: the positions of its per-head tensors (those of the query heads, those of the key heads,
    the logsumexp among the former), and of what must be absent or zero for a split by heads to keep the math
    (dropout, mask or bias, nested batches' offsets). Built once: the pass asks it of every node of a graph."""
    return {
        aten._scaled_dot_product_cudnn_attention_backward.default:
            dict(query_heads=(0, 1, 4, 5), key_heads=(2, 3), logsumexp=5, dropout=13, absent=(8,), empty=(9, 10)),
        aten._scaled_dot_product_flash_attention_backward.default:
            dict(query_heads=(0, 1, 4, 5), key_heads=(2, 3), logsumexp=5, dropout=10, absent=(), empty=(6, 7)),
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
            dict(query_heads=(0, 1, 4, 5), key_heads=(2, 3), logsumexp=5, dropout=6, absent=(), empty=(),
                 mask="attn_mask"),
    }


def _val(node: Any) -> Optional[torch.Tensor]:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is_empty(arg: Any) -> bool:
    """An absent tensor argument (None, or a node whose value is None: an undefined tensor, as the offsets of a
    dense batch's cuDNN and flash forwards are) or one with no elements."""
    if arg is None or (isinstance(arg, fx.Node) and "val" in arg.meta and arg.meta["val"] is None):
        return True
    value = _val(arg)
    return value is not None and value.numel() == 0


def _hint(n: Any) -> Optional[int]:
    """An int from a size that may be symbolic (its hint), else None."""
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def chunk_count(node: fx.Node) -> int:
    """How many head chunks ``node``'s backward is split into (1: left whole), by the module docstring's rules."""
    spec = _arguments().get(node.target)
    if spec is None:
        return 1
    args = node.args
    if any(len(args) <= i for i in (*spec["query_heads"], *spec["key_heads"], spec["dropout"])):
        return 1
    dropout = args[spec["dropout"]]
    if not isinstance(dropout, (int, float)) or dropout != 0:
        return 1
    if any(i < len(args) and args[i] is not None for i in spec["absent"]) \
            or not all(_is_empty(args[i]) for i in spec["empty"] if i < len(args)) \
            or ("mask" in spec and node.kwargs.get(spec["mask"]) is not None):
        return 1
    values = [_val(args[i]) for i in (*spec["query_heads"], *spec["key_heads"])]
    if any(v is None for v in values):
        return 1
    d_out, query, out, lse, key, value = values
    if not all(isinstance(v.shape[1], int) for v in values):
        return 1  # a symbolic head count: slices cut at today's count would be wrong for another
    shapes = [tuple(_hint(s) for s in v.shape) for v in (d_out, query, out, key, value)]
    if any(len(s) != 4 or None in s for s in shapes) or lse.dim() < 3:
        return 1
    q_heads, k_heads = shapes[1][1], shapes[3][1]
    if not (q_heads and k_heads) or q_heads % k_heads or shapes[4][1] != k_heads \
            or shapes[0][1] != q_heads or shapes[2][1] != q_heads or _hint(lse.shape[1]) != q_heads:
        return 1
    query_bytes = _hint(query.numel()) * query.element_size()
    if query_bytes < MIN_BYTES:
        return 1
    for n in range(2, k_heads + 1):
        if k_heads % n == 0 and query_bytes // n <= CHUNK_BYTES:
            return n
    return k_heads


def _layout_permutation(value: torch.Tensor) -> Optional[list[int]]:
    """The dims of ``value`` from outermost to innermost in memory, if it is dense in that order (so a
    contiguous tensor permuted by it and back has ``value``'s strides), else None."""
    sizes = [_hint(s) for s in value.shape]
    strides = [_hint(s) for s in value.stride()]
    if None in sizes or None in strides:
        return None
    order = sorted(range(value.dim()), key=lambda d: (-strides[d], d))
    expected = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return order


def _call(graph: fx.Graph, target: Any, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
    """A new node calling ``target``, its ``val`` formed by running the target on the arguments' fake values."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    fake = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a  # noqa: E731
    fake_args = fx.node.map_aggregate(args, fake)
    fake_kwargs = fx.node.map_aggregate(kwargs, fake)
    values = [v for v in torch.utils._pytree.tree_leaves((fake_args, fake_kwargs)) if isinstance(v, torch.Tensor)]
    mode = getattr(values[0], "fake_mode", None) if values else None
    if target is operator.getitem:
        node.meta["val"] = fake_args[0][fake_args[1]]
    elif mode is not None:
        with mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
    else:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def split_attention_backward(graph: fx.Graph, node: fx.Node, n: int) -> bool:
    """Replace ``node`` by ``n`` head-chunked calls and the concatenation of their outputs (module docstring);
    False, the graph untouched, where an output's layout cannot be rebuilt."""
    spec = _arguments()[node.target]
    items = list(node.users)
    if not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] in (0, 1, 2) for u in items):
        return False
    outputs = node.meta.get("val")
    if not isinstance(outputs, (tuple, list)) or len(outputs) < 3:
        return False
    layouts = [_layout_permutation(outputs[i]) if isinstance(outputs[i], torch.Tensor) else None for i in range(3)]
    if None in layouts:
        return False
    q_heads = _hint(_val(node.args[1]).shape[1])
    k_heads = _hint(_val(node.args[2]).shape[1])
    q_step, k_step = q_heads // n, k_heads // n
    read = sorted({item.args[1] for item in items if item.users})  # not a gradient nothing asked for
    chunk_outputs: dict[int, list[fx.Node]] = {i: [] for i in read}
    with graph.inserting_before(node):
        for c in range(n):
            args = list(node.args)
            for positions, step in ((spec["query_heads"], q_step), (spec["key_heads"], k_step)):
                for i in positions:
                    args[i] = _call(graph, aten.slice.Tensor, (node.args[i], 1, c * step, (c + 1) * step))
            lse = spec["logsumexp"]
            args[lse] = _call(graph, aten.clone.default, (args[lse],), {"memory_format": torch.contiguous_format})
            chunk = _call(graph, node.target, tuple(args), dict(node.kwargs))
            for i in read:
                chunk_outputs[i].append(_call(graph, operator.getitem, (chunk, i)))
        whole = {}
        for i in read:
            order = layouts[i]
            inverse = [order.index(d) for d in range(len(order))]
            permuted = [_call(graph, aten.permute.default, (part, order)) for part in chunk_outputs[i]]
            joined = _call(graph, aten.cat.default, (permuted, order.index(1)))
            whole[i] = _call(graph, aten.permute.default, (joined, inverse))
    for item in items:
        if item.users:
            item.replace_all_uses_with(whole[item.args[1]])
        graph.erase_node(item)
    graph.erase_node(node)
    return True


def chunk_attention_backwards(graph: fx.Graph) -> int:
    """Split every attention backward of ``graph`` that the module docstring's rules allow; returns how many."""
    split = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _arguments()]:
        n = chunk_count(node)
        if n > 1 and split_attention_backward(graph, node, n):
            split += 1
    return split
