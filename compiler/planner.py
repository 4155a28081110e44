"""The plan: which memory savers a compile turns on, chosen from what the step is, so that a user needs no options.

The ``memory`` option (compiler/options.py) sets the goal:

    "auto" (default)  each saver on where it was measured to cost no time at this size (``LONG_CONTEXT`` below)
    "min"             every saver that applies: the leanest plan, whatever it costs in time
    "off"             no saver: the step as sloth ran it before the planner

An option the user gives (``offload``, ``tiled_mlp``, ``moe_recompute``) pins that choice whatever the plan
(``Options.given``); the plan fills in the rest. The savers:

    offload        each checkpointed layer's saved input (and, ``mid_layer``, its residual between attention and
                   MLP) to pinned host memory and back (compiler/offload_partition.py); only where layers are
                   checkpointed, whose saved tensors are what it moves
    tiled_mlp      a LoRA MLP of more rows than ``TILE_ROWS`` run a block of rows at a time (patterns/tiled_mlp.py)
    moe_recompute  the MoE experts op forms its first grouped GEMM again in the backward (patterns/moe.py)

The plan does not touch ``return_logits``: returning an empty tensor in place of the logits changes what the model
returns, which only the user may decide.

What the plan reads (``StepFacts``, from the graph Dynamo hands over, before any pass): the tokens a step runs (the
most rows any linear layer's input has), whether it holds checkpointed layers (``tag_activation_checkpoint``
bodies), and whether it runs on a GPU. The plan line lists the savers turned on, whether or not the graph has a site
for each (``moe_recompute`` under "min" in a model without experts changes nothing).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.fx as fx

from .fx_utils import linear_parts, subgraphs, tensor_of
from .options import MEMORY_GOALS, OffloadOptions, Options, TiledMlpOptions

# Rows per block of the tiled MLP when the plan turns it on: the block measured at 16k tokens (below).
TILE_ROWS = 2048
# "auto" turns on offload (with mid_layer) and the tiled MLP for checkpointed steps of at least this many tokens on a
# GPU. Measured on one H100 at Llama-3-8B, LoRA r=16, 1 x 16384 tokens, checkpointing: the default 1856 ms a step at
# 25.93 GiB; with offload's mid_layer and the tiled MLP (and return_logits=False, whose 4 GiB of logits neither saver
# touches) 1842.7-1857.0 ms at 17.2-17.5 GiB (benchmarks/results/2026-12-06_issue19_issue20_h100_rows.md,
# 2026-12-06_issue19_issue20_h100_morning2.md): leaner at no cost in time. Below it (2 x 2048) nothing was measured
# to be free: the savers stay off.
LONG_CONTEXT = 16384


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """What the plan knows of a step at compile time (module docstring)."""
    tokens: int
    checkpointed: bool
    cuda: bool
    known: bool = True  # False: the facts could not be read (the planner raised)

    def describe(self) -> str:
        if not self.known:
            return "facts unknown"
        return (f"{self.tokens} tokens, {'checkpointed layers' if self.checkpointed else 'no checkpointed layer'}, "
                f"{'GPU' if self.cuda else 'CPU'}")


def _rows(x: Any) -> int:
    t = tensor_of(x)
    if t is None or t.dim() < 2:
        return 0
    rows = math.prod(t.shape[:-1])
    return rows if isinstance(rows, int) else 0  # a symbolic size: no known count


def step_facts(gm: fx.GraphModule, example_inputs: Any) -> StepFacts:
    """The facts of the step ``gm`` computes (module docstring)."""
    modules = [gm, *subgraphs(gm)]
    tokens = max((_rows(parts[0]) for m in modules for n in m.graph.nodes
                  if (parts := linear_parts(n)) is not None), default=0)
    checkpointed = any(n.op == "call_function" and getattr(n.target, "__name__", "") == "tag_activation_checkpoint"
                       for m in modules for n in m.graph.nodes)
    cuda = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    return StepFacts(tokens=tokens, checkpointed=checkpointed, cuda=cuda)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The savers chosen, and why; ``apply`` writes them into the options the user did not give."""
    memory: str
    facts: StepFacts
    offload: Optional[OffloadOptions] = None
    tiled_mlp: Optional[TiledMlpOptions] = None
    moe_recompute: bool = False
    reason: str = ""

    def apply(self, options: Options) -> Options:
        chosen = {"offload": self.offload, "tiled_mlp": self.tiled_mlp, "moe_recompute": self.moe_recompute}
        return dataclasses.replace(options, **{k: v for k, v in chosen.items() if k not in options.given})

    def describe(self, options: Options) -> str:
        """One line for the report: the goal, the facts, what is on (pinned by the user or chosen) and why."""
        on = []
        if options.offload is not None:
            on.append("offload" + (" (mid_layer)" if options.offload.mid_layer else ""))
        if options.tiled_mlp is not None:
            on.append(f"tiled_mlp ({options.tiled_mlp.rows}-row blocks)")
        if options.moe_recompute:
            on.append("moe_recompute")
        pinned = sorted(options.given & {"offload", "tiled_mlp", "moe_recompute"})
        return (f"memory={self.memory!r} ({self.facts.describe()}): {', '.join(on) or 'no memory saver'}"
                + (f"; {self.reason}" if self.reason else "")
                + ("; offload switched off by the disable option" if "offload" in options.disable else "")
                + (f"; pinned by options: {', '.join(pinned)}" if pinned else ""))


def plan(memory: str, facts: StepFacts, inner: str = "inductor", partitioner_taken: bool = False) -> Plan:
    """The savers for goal ``memory`` on a step with ``facts`` compiled by ``inner`` (module docstring); offload only
    where AOTAutograd partitions the graph (not ``inner="eager"``) and the user gave Inductor no partitioner of their
    own (``partitioner_taken``: ``custom_partitioner_fn``, which offload would replace)."""
    if memory not in MEMORY_GOALS:
        raise ValueError(f"sloth: memory must be one of {list(MEMORY_GOALS)}, got {memory!r}")
    tiled = TiledMlpOptions(TILE_ROWS, True) if facts.tokens > TILE_ROWS else None
    offload = (OffloadOptions(mid_layer=True) if facts.checkpointed and inner != "eager" and not partitioner_taken
               else None)
    if memory == "off":
        return Plan(memory, facts, reason="memory='off'")
    if memory == "min":
        return Plan(memory, facts, offload=offload, tiled_mlp=tiled, moe_recompute=True,
                    reason="every saver that applies")
    if facts.cuda and facts.checkpointed and facts.tokens >= LONG_CONTEXT:
        return Plan(memory, facts, offload=offload, tiled_mlp=tiled,
                    reason=f"checkpointed, at least {LONG_CONTEXT} tokens on a GPU: measured leaner at no cost in time")
    return Plan(memory, facts,
                reason=f"none measured to cost no time below {LONG_CONTEXT} checkpointed tokens on a GPU")
