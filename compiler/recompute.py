"""Recompute instead of save: mark cheap sloth ops so that AOTAutograd's partitioner recomputes their output
in the backward rather than keeping it alive from the forward.

The case that pays: an RMSNorm (or LayerNorm) output read by a backward. In a LoRA step the adapters' weight gradients
need their input x (da = s g^T x), and that x is the norm's output; q, k, v read one norm, gate and up
another, so each layer keeps two [tokens, hidden] tensors only for the adapters (Llama-3-8B at 2 x 2048:
2 x 32 MiB per layer, 2 GiB over 32 layers). The norm's own backward saves its input h, which the
residual stream keeps anyway, so recomputing y = rms_norm(h, w) in the backward costs one more read of
h and write of y per norm (64 MiB there, about 16 us at the H200's copy bandwidth) and saves all of it.

How: the FX node gets ``meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE``, the tag selective
activation checkpointing uses, and an ``ac_graph_id`` below any checkpointed region's (older partitioners
read it from every tagged node without checking; at a boundary with a checkpointed region the lower id
makes the partitioner save our output rather than recompute across the boundary). AOTAutograd copies both
onto the joint graph's nodes it traces from this one, and the min-cut partitioner (Inductor's) then puts
the op in the backward wherever a backward reads its output, just before that use. The pass runs on the
top-level graph only: subgraph bodies (a checkpointed layer, an autograd.Function) keep their own policy,
so norms inside them are not tagged.

Because the cache of AOTAutograd cannot see node meta, compiler/backend.py switches that cache off for a
graph with tags; the report counts the tagged outputs (a backward that never reads one recomputes nothing).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .options import PassOptions
from .report import Report

# Ops whose output is cheaper to recompute than to keep: memory-bound, one read of inputs that stay alive.
# Not norm_rope (q/k norms and RoPE; benchmarks/variants.py adds it for measuring): its inputs (q and k before their
# norms) are what its own backward keeps and its two outputs what attention's backward reads, so recomputing them saves
# two [tokens, heads, D] tensors a layer (0.4 GiB at the Qwen3-MoE row), but on an H100 that step took 55.2 ms
# with it against 53.1 without (benchmarks/results/2026-12-05_issue20_norm_rope.md): off by default. AOTAutograd
# tags every node it traces from a tagged one, the getitems of a multi-output op included
# (tests/test_norm_rope_pattern.py checks the backward recomputes the pair with it added).
RECOMPUTED_OPS: tuple[str, ...] = ("rms_norm", "layer_norm")
# Checkpointed regions number themselves from 0 or 1 up; ours sits below them (see the module docstring).
AC_GRAPH_ID = -1


def _recomputed_targets() -> set[Any]:
    return {getattr(torch.ops.sloth, name).default for name in RECOMPUTED_OPS if hasattr(torch.ops.sloth, name)}


def recompute_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                   options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Tag every node of ``RECOMPUTED_OPS`` for recomputation in the backward, unless ``options.recompute`` is
    off or the node already has a checkpoint policy; the number tagged goes to
    ``report.recomputed``."""
    if not options.recompute:
        return gm
    targets = _recomputed_targets()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in targets or "recompute" in node.meta:
            continue
        node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        node.meta["ac_graph_id"] = AC_GRAPH_ID
        report.recomputed[node.target.name().split("::")[-1]] += 1
    return gm
