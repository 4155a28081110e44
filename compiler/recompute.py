"""Recompute instead of save: mark cheap sloth ops so that AOTAutograd's partitioner recomputes their output
in the backward rather than keeping it alive from the forward.

The case that pays: an RMSNorm output read by a backward. In a LoRA step the adapters' weight gradients
need their input x (da = s g^T x), and that x is the norm's output; q, k, v read one norm, gate and up
another, so each layer keeps two [tokens, hidden] tensors only for the adapters (Llama-3-8B at 2 x 2048:
2 x 32 MiB per layer, 2 GiB over 32 layers). The norm's own backward saves its input h, which the
residual stream keeps anyway, so recomputing y = rms_norm(h, w) in the backward costs one more read of
h and write of y per norm (about 20 us each on the H200 at that size) and saves all of it.

How: the FX node gets ``meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE``, the tag selective
activation checkpointing uses. AOTAutograd copies the tag onto the joint graph's nodes it traces from this
one, and the min-cut partitioner (Inductor's) then puts the op in the backward wherever a backward reads
its output. Nodes that already carry a tag (inside a checkpointed region) are left to their policy.
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .options import PassOptions
from .report import Report

# Ops whose output is cheaper to recompute than to keep: memory-bound, one read of inputs that stay alive.
RECOMPUTED_OPS = ("rms_norm",)


def _recomputed_targets() -> set[Any]:
    return {getattr(torch.ops.sloth, name).default for name in RECOMPUTED_OPS if hasattr(torch.ops.sloth, name)}


def recompute_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                   options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Tag every node of ``RECOMPUTED_OPS`` (and its ``getitem`` users) for recomputation in the backward,
    unless ``options.recompute`` is off or the node already has a checkpoint policy; the number tagged
    goes to ``report.recomputed``."""
    if not options.recompute:
        return gm
    targets = _recomputed_targets()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in targets or "recompute" in node.meta:
            continue
        for tagged in (node, *(u for u in node.users if u.target is operator.getitem)):
            tagged.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        report.recomputed[node.target.name().split("::")[-1]] += 1
    return gm
