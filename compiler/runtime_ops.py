"""Swap sloth's custom ops for their runtime twins in the graphs Inductor compiles (and, in the same post-grad
pass, the backward rewrites of compiler/lean_backward.py and compiler/attention_chunks.py).

AOTAutograd traces each ``torch.ops.sloth.*`` op through its registered autograd into a forward and a
backward graph; from then on nothing calls that autograd: the compiled forward runs inside AOTAutograd's own
``autograd.Function`` (grad mode off) and the compiled backward calls the op's ``_backward`` op directly. Yet
every call of a ``custom_op`` still runs its Python autograd and backend wrappers. This pass, an Inductor
post-grad pass, replaces each op node's target with its twin from ``lowering.registration.RUNTIME_TWINS``:
the same schema, function and fake, without those wrappers (lowering/registration.py has the numbers).

The twin is a pure rename of the node's target: arguments, outputs and node meta stay as they are, so the
graph computes the same thing. Graphs compiled by ``inner="aot_eager"`` keep the custom ops (the pass is
Inductor's), as do all graphs when ``SLOTH_RUNTIME_TWINS=0`` is set (for measuring what the twins save).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch.fx as fx
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..lowering import registration
from . import attention_chunks, fx_utils, lean_backward


def swap_to_runtime_twins(graph: fx.Graph) -> int:
    """Retarget every call of a sloth custom op in ``graph`` to its runtime twin; returns how many."""
    swapped = 0
    for node in graph.nodes:
        if node.op == "call_function":
            twin = registration.RUNTIME_TWINS.get(node.target)
            if twin is not None:
                node.target = twin
                swapped += 1
    return swapped


class RuntimeTwinsPass(CustomGraphPass):
    """``swap_to_runtime_twins`` as an Inductor post-grad pass, then ``lean_backward``
    (compiler/lean_backward.py), then ``chunk_attention_backwards`` (compiler/attention_chunks.py), then ``then``
    (a user's own pass), if any."""

    def __init__(self, then: Optional[Any] = None):
        self.then = then

    def __call__(self, graph: fx.Graph) -> None:
        swap_to_runtime_twins(graph)
        lean_backward.lean_backward(graph)
        attention_chunks.chunk_attention_backwards(graph)
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> Optional[Any]:
        # Inductor's cache keys compiled graphs by this: the source of this pass and of the op -> twin mapping,
        # and the user's pass's uuid (none, or a falsy one, makes Inductor bypass its cache, as theirs alone
        # would).
        mine = (get_hash_for_files((__file__, registration.__file__, lean_backward.__file__, fx_utils.__file__,
                                    attention_chunks.__file__)),
                lean_backward.ENABLED, attention_chunks.ENABLED, attention_chunks.MIN_BYTES,
                attention_chunks.CHUNK_BYTES)
        if self.then is None:
            return mine
        theirs = self.then.uuid() if hasattr(self.then, "uuid") else None
        return (mine, theirs) if theirs else None


# The post-grad passes RuntimeTwinsPass carries, in the order it runs them (the names the report uses).
POST_GRAD_PASSES = ("runtime_twins", "lean_backward", "attention_chunks")


def post_grad_passes_off(inner: str) -> dict[str, str]:
    """Each of sloth's post-grad passes that will not run on a graph compiled by ``inner``, with the reason (the
    report lists them: a pass switched off must not vanish without a word)."""
    if inner != "inductor":
        return {name: f"inner={inner!r}: they are Inductor post-grad passes" for name in POST_GRAD_PASSES}
    if registration.TRITON_OP:
        return {name: "SLOTH_TRITON_OP=1: sloth's ops are triton_ops, whose kernels Inductor launches itself"
                for name in POST_GRAD_PASSES}
    if os.environ.get("SLOTH_RUNTIME_TWINS", "1") == "0":
        return {name: "SLOTH_RUNTIME_TWINS=0 removes the post-grad pass that carries it" for name in POST_GRAD_PASSES}
    off = {}
    if not lean_backward.ENABLED:
        off["lean_backward"] = "SLOTH_LEAN_BACKWARD=0"
    if not attention_chunks.ENABLED:
        off["attention_chunks"] = "SLOTH_ATTENTION_CHUNKS=0"
    return off


def with_runtime_twins(patches: dict[str, Any]) -> dict[str, Any]:
    """Inductor config ``patches`` plus the twin-swapping post-grad pass, which runs before a user's own
    post-grad passes (they see ``sloth_rt::*`` nodes, not ``sloth::*``); as they are when sloth's ops are
    triton_ops (Inductor launches their kernels itself) or the twins are switched off
    (``SLOTH_RUNTIME_TWINS=0``). Where Inductor takes a list of passes (torch 2.13; its own handling of
    inference-aware passes and cache keys then applies to the user's), the user's passes follow ours in the
    list; before that, ours calls theirs."""
    if "runtime_twins" in post_grad_passes_off("inductor"):
        return patches
    import torch._inductor.config as inductor_config

    theirs = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
    if hasattr(custom_graph_pass, "get_custom_graph_passes"):
        passes = [RuntimeTwinsPass(), *custom_graph_pass.get_custom_graph_passes(theirs)]
    else:
        passes = RuntimeTwinsPass(theirs)
    return {**patches, "post_grad_custom_post_pass": passes}
