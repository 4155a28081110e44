"""The partition and post-grad passes: one registry like the families', each named, ordered, timed, reported and
switched off by name.

After the pre-grad pipeline (compiler/pipeline.py) the inner compiler takes the graph: AOTAutograd traces the
forward and backward, its partitioner splits them, and Inductor runs its post-grad passes on each graph. sloth's
passes at those stages, in the order they run:

    stage      name              what it does
    partition  offload           saved activations to pinned host memory and back (compiler/offload_partition.py;
                                 on only with the ``offload`` option)
    post_grad  runtime_twins     each sloth op called through its runtime twin, without custom_op's per-call
                                 Python wrappers (lowering/registration.py has the numbers)
    post_grad  lean_backward     the backward rewrites of compiler/lean_backward.py
    post_grad  attention_chunks  a long sequence's attention backward split over key heads
                                 (compiler/attention_chunks.py)

The post-grad ones run inside one Inductor custom post-grad pass (``PostGradPasses``), in that order and before a
user's own post-grad passes, each timed into the report's ``pass_seconds`` under its name. Any of them is switched
off by name with ``options={"disable": [...]}`` (compiler/options.py); ``passes_off`` gives, for the report, each
pass that is on by default and will not run, with the reason (an inner compiler other than Inductor runs none of
them). Each is a rewrite of a graph that computes the same values: switching one off changes speed or memory,
never a result.

The runtime twin swap is a pure rename of a node's target (arguments, outputs and node meta stay): AOTAutograd
has already traced each ``torch.ops.sloth.*`` op through its registered autograd, and from then on nothing calls
that autograd (the compiled forward runs inside AOTAutograd's own ``autograd.Function`` with grad mode off, the
compiled backward calls each op's ``_backward`` op directly), yet every call of a ``custom_op`` would still run its
Python autograd and backend wrappers.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

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


@dataclasses.dataclass(frozen=True)
class LatePass:
    """One partition or post-grad pass. ``run(graph)`` rewrites an Inductor post-grad graph in place (None for the
    partition pass, which the backend installs as the partitioner); ``default_on`` False for a pass an option turns
    on; ``source`` the modules whose code decides what it does (Inductor's cache key)."""
    name: str
    stage: str
    summary: str
    run: Optional[Callable[[fx.Graph], Any]] = None
    default_on: bool = True
    source: tuple[Any, ...] = ()


# In the order they run.
LATE_PASSES: tuple[LatePass, ...] = (
    LatePass("offload", "partition", "saved activations to pinned host memory and back (the offload option)",
             default_on=False),
    LatePass("runtime_twins", "post_grad", "sloth ops called without custom_op's per-call wrappers",
             run=swap_to_runtime_twins, source=(registration,)),
    LatePass("lean_backward", "post_grad", "recomputed forwards dropped, gradients written in place",
             run=lean_backward.lean_backward, source=(lean_backward, fx_utils)),
    LatePass("attention_chunks", "post_grad", "a long attention backward split over key heads",
             run=attention_chunks.chunk_attention_backwards, source=(attention_chunks, fx_utils)),
)
LATE_PASS_NAMES = tuple(p.name for p in LATE_PASSES)


def passes_off(inner: str, disabled: Sequence[str] = ()) -> dict[str, str]:
    """Each pass on by default that will not run on graphs compiled by ``inner`` with ``disabled`` switched off,
    with the reason (the report lists them: a pass switched off must not vanish without a word)."""
    off = {}
    for late in LATE_PASSES:
        if not late.default_on:
            continue
        if late.name in disabled:
            off[late.name] = "switched off by the disable option"
        elif late.stage == "post_grad" and inner != "inductor":
            off[late.name] = f"inner={inner!r}: an Inductor post-grad pass"
    return off


def op_sources() -> set[str]:
    """The files that define sloth's ops, their schemas, fake kernels, kernels and backwards (lowering/, runtime/).

    Part of the cache key below, and through it of AOTAutograd's, whose key is the graph's code and Inductor's
    config: a graph calls ``sloth::op`` by name, so after an upgrade that changes an op (one more output row,
    another backward) a warm cache would hand back a graph compiled against the old op (seen: "expected size
    3==2" when the token op's statistics went from two rows to three)."""
    root = Path(__file__).resolve().parent.parent
    return {str(path) for folder in ("lowering", "runtime") for path in (root / folder).rglob("*.py")}


class PostGradPasses(CustomGraphPass):
    """The post-grad passes of ``LATE_PASSES`` not in ``off``, in order, each timed into ``report.pass_seconds``
    (when given), then ``then`` (a user's own pass), if any."""

    def __init__(self, off: Sequence[str] = (), report: Any = None, then: Optional[Any] = None):
        self.passes = tuple(p for p in LATE_PASSES if p.stage == "post_grad" and p.name not in off)
        self.report = report
        self.then = then

    def __call__(self, graph: fx.Graph) -> None:
        for late in self.passes:
            start = time.perf_counter()
            late.run(graph)
            if self.report is not None:
                self.report.pass_seconds[late.name] += time.perf_counter() - start
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> Optional[Any]:
        # Inductor's cache keys compiled graphs by this: the passes that run, the source of each and of this module,
        # the attention chunks' thresholds, and the user's pass's uuid (none, or a falsy one, makes Inductor bypass
        # its cache, as theirs alone would).
        files = {__file__} | {module.__file__ for late in self.passes for module in late.source} | op_sources()
        mine = (tuple(p.name for p in self.passes), get_hash_for_files(tuple(sorted(files))),
                attention_chunks.MIN_BYTES, attention_chunks.CHUNK_BYTES)
        if self.then is None:
            return mine
        theirs = self.then.uuid() if hasattr(self.then, "uuid") else None
        return (mine, theirs) if theirs else None


def with_post_grad_passes(patches: dict[str, Any], off: Sequence[str] = (), report: Any = None) -> dict[str, Any]:
    """Inductor config ``patches`` plus sloth's post-grad passes not in ``off``, which run before a user's own
    post-grad passes (they see ``sloth_rt::*`` nodes, not ``sloth::*``). Where Inductor takes a list of passes
    (torch 2.13; its own handling of inference-aware passes and cache keys then applies to the user's), the user's
    passes follow ours in the list; before that, ours calls theirs."""
    if all(p.name in off for p in LATE_PASSES if p.stage == "post_grad"):
        return patches
    import torch._inductor.config as inductor_config

    theirs = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
    if hasattr(custom_graph_pass, "get_custom_graph_passes"):
        passes = [PostGradPasses(off, report), *custom_graph_pass.get_custom_graph_passes(theirs)]
    else:
        passes = PostGradPasses(off, report, theirs)
    return {**patches, "post_grad_custom_post_pass": passes}
