"""The plan: which memory savers a compile turns on, chosen from what the step is, so that a user needs no options.

The ``memory`` option (compiler/options.py) sets the goal:

    "auto" (default)  each saver on where it was measured to cost no time at this size (``LONG_CONTEXT`` below),
                      then, on one GPU, offload, the tiled MLP and lazy logits while the estimated peak of a
                      training step exceeds the device's memory (free and held by PyTorch's allocator, less
                      ``AUTO_MARGIN`` of the total)
    a number          the same with that many GiB as the budget, on any device, moe_recompute too
    "min"             every saver that applies: the leanest plan, whatever it costs in time
    "off"             no saver: the step as sloth ran it before the planner

Over the budget, savers are added in the order of memory saved per millisecond lost, as measured: offload (1.4 GiB
at no cost in time at 8B, 16k tokens, checkpointed), the tiled MLP with offload's mid_layer (0.9 GiB more, no cost;
both benchmarks/results/2026-12-06_issue19_issue20_h100_rows.md), then lazy logits (the logits' bytes: free at 8B
2 x 2048, 10-16 ms at the host-bound Qwen3-MoE step, 2026-12-07_issue56_h100_rows.md), then, under a number only,
moe_recompute (1.1 GiB for about 5.6 ms a step at Qwen3-MoE 2 x 2048: 19.27 to 18.15 GiB,
2026-12-06_h100_163002_e2e-qwen3-moe-b2-s2048.md), until the
estimated peak (compiler/peak_estimate.py) fits; a saver estimated to free nothing here (no checkpointed layer to
offload, no gated MLP to tile) is skipped, moe_recompute, whose saving is not estimated, is not. Under a budget
the tiled MLP's block is ``TILE_ROWS`` rows, or half the tokens of a shorter step.

An option the user gives (``offload``, ``tiled_mlp``, ``moe_recompute``, ``return_logits``) pins that choice
whatever the plan (``Options.given``); the plan fills in the rest. The savers:

    offload        each checkpointed layer's saved input (and, ``mid_layer``, its residual between attention and
                   MLP) to pinned host memory and back (compiler/offload_partition.py); only where layers are
                   checkpointed, whose saved tensors are what it moves
    tiled_mlp      a LoRA MLP of more rows than ``TILE_ROWS`` run a block of rows at a time (patterns/tiled_mlp.py)
    moe_recompute  the MoE experts op forms its first grouped GEMM again in the backward (patterns/moe.py)

    return_logits  "lazy": logits returned beside a fused loss computed only when read, where the head is frozen
                   (patterns/returned_logits.py); the plan never chooses False (an empty tensor changes what the
                   model returns: the user's call)

Beside the savers, "auto" and a budget capture a training step in CUDA graphs (Inductor's cudagraph trees, its
``triton.cudagraphs``) where the step is bound by the host: where its matrix products are too small to keep the GPU
busy while Python launches the next kernel, so that replaying the recorded kernels removes the host's share of the
step. Measured on one H100 at Qwen3-MoE 2 x 2048 (LoRA on attention): 50.5 ms a step under CUDA graphs against
68.7-89.1 ms without, on one machine (benchmarks/results/2026-12-06_issue20_grouped_gemm_h100.md). The measure is the
matrix products' FLOPs (linear layers, matmuls, attention) per operation of the graph Dynamo hands over: about 6.4e9
there (its experts' grouped GEMMs not counted), about 3.3e10 at Llama-3-8B 2 x 2048 (bound by its GPU: 261 ms a step);
``HOST_BOUND_FLOPS_PER_OP`` lies between. The graphs are captured only where that is safe (``cuda_graphs_choice``): a
training graph on one GPU, in one process, with static shapes, unquantised weights (a 4-bit base's product is not a
linear the count sees), no offload (its copies run on a side stream into pinned buffers), no lazy logits (they hold
the graph's output x, which the next replay overwrites), and trainable parameters that are adapters
(``ADAPTER_SHARE``), with room in the budget (``GRAPHS_ROOM``); each adapter's gradient is moved out of the graphs'
memory pool once a step (runtime/graph_grads.py), so that gradient accumulation adds into it and the next replay
cannot overwrite it. The user's ``triton.cudagraphs`` or ``mode`` pins the choice.

What the plan reads (``StepFacts``, from the graph Dynamo hands over, before any pass): the tokens a step runs (the
most rows any linear layer's input has), whether it holds checkpointed layers (``tag_activation_checkpoint``
bodies), whether it runs on a GPU, the estimated peak, and on a GPU the memory the step may use. The plan line
lists the savers turned on, whether or not the graph has a site for each (``moe_recompute`` under "min" in a model
without experts changes nothing).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .fx_utils import linear_parts, subgraphs, tensor_of
from .options import OffloadOptions, Options, TiledMlpOptions, check_memory
from .peak_estimate import GiB, PeakEstimate, estimate_peak, is_checkpoint, is_view_or_cast

# Rows per block of the tiled MLP when the plan turns it on: the block measured at 16k tokens (below).
TILE_ROWS = 2048
# "auto" turns on offload (with mid_layer) and the tiled MLP for checkpointed steps of at least this many tokens on a
# GPU. Measured on one H100 at Llama-3-8B, LoRA r=16, 1 x 16384 tokens, checkpointing: the default 1856 ms a step at
# 25.93 GiB; with offload's mid_layer and the tiled MLP (and return_logits=False, whose 4 GiB of logits neither saver
# touches) 1842.7-1857.0 ms at 17.2-17.5 GiB (benchmarks/results/2026-12-06_issue19_issue20_h100_rows.md,
# 2026-12-06_issue19_issue20_h100_morning2.md): leaner at no cost in time. Below it (2 x 2048) nothing was measured
# to be free: the savers stay off.
LONG_CONTEXT = 16384
# "auto" captures a step in CUDA graphs where its matrix products' FLOPs per graph operation are below this (module
# docstring: about 6.4e9 at Qwen3-MoE 2 x 2048, host-bound; about 3.3e10 at Llama-3-8B 2 x 2048, GPU-bound).
HOST_BOUND_FLOPS_PER_OP = 1.2e10
# ... and only where the trainable parameters hold at most this share of the parameters' bytes (adapters: 8B LoRA
# r=16 on every linear holds about 1%), whose gradients are cheap to move out of the graphs' pool each step.
ADAPTER_SHARE = 1 / 16
# ... and only where the estimated peak is at most this share of the budget: the graphs' memory pool serves only
# the graphs, and their inputs are copied into it.
GRAPHS_ROOM = 0.8
# "auto" on a GPU leaves this share of the device's total memory unplanned: fragmentation, the optimiser's state
# (which the graph does not show), and what other processes take.
AUTO_MARGIN = 0.10


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """What the plan knows of a step at compile time (module docstring)."""
    tokens: int
    checkpointed: bool
    cuda: bool
    known: bool = True  # False: the facts could not be read (the planner raised)
    estimate: Optional[PeakEstimate] = None
    device_budget: Optional[int] = None  # bytes "auto" plans for on a GPU (module docstring); None elsewhere
    flops_per_op: float = math.inf  # matrix products' FLOPs per graph operation (inf: none counted)
    static_shapes: bool = False  # no symbolic size among the graph's inputs
    adapters_only: bool = False  # trainable parameters among the inputs, holding at most ADAPTER_SHARE of the bytes
    distributed: bool = False  # a torch.distributed process group of more than one process
    quantized: bool = False  # a parameter among the inputs stored quantised (bitsandbytes' 4-bit packing)

    def describe(self) -> str:
        if not self.known:
            return "facts unknown"
        return (f"{self.tokens} tokens, {'checkpointed layers' if self.checkpointed else 'no checkpointed layer'}, "
                f"{'GPU' if self.cuda else 'CPU'}")


def _device_budget(example_inputs: Any) -> Optional[int]:
    devices = {x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.device.type == "cuda"}
    if len(devices) != 1:  # the CPU, or a model spread over GPUs (device_map): the estimate is not per device
        return None
    (device,) = devices
    free, total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - AUTO_MARGIN * total)


def _rows(x: Any) -> int:
    t = tensor_of(x)
    if t is None or t.dim() < 2:
        return 0
    rows = math.prod(t.shape[:-1])
    return rows if isinstance(rows, int) else 0  # a symbolic size: no known count


_PRODUCTS = {torch.matmul, operator.matmul, torch.bmm, torch.mm, torch.baddbmm, torch.addmm}


def _product_flops(node: fx.Node) -> int:
    """The FLOPs of a linear layer (``2 rows K N``), a matrix product (``2 |out| K``) or attention
    (``4 B H S L D``); 0 for anything else, or a symbolic size."""
    parts = linear_parts(node)
    if parts is not None:
        x, w = tensor_of(parts[0]), tensor_of(parts[1])
        flops = 2 * math.prod(x.shape[:-1]) * w.shape[0] * w.shape[1] if x is not None and w is not None \
            and w.dim() == 2 else 0
    elif node.op == "call_function" and node.target is F.scaled_dot_product_attention and len(node.args) >= 2:
        q, k = tensor_of(node.args[0]), tensor_of(node.args[1])
        flops = 4 * math.prod(q.shape) * k.shape[-2] if q is not None and k is not None else 0
    elif node.op == "call_function" and node.target in _PRODUCTS or node.op == "call_method" and node.target in (
            "matmul", "bmm", "mm", "__matmul__"):
        a = tensor_of(node.args[1] if node.target in (torch.baddbmm, torch.addmm) else node.args[0])  # [.., K]
        out = tensor_of(node)
        flops = 2 * math.prod(out.shape) * a.shape[-1] if a is not None and out is not None and a.dim() else 0
    else:
        flops = 0
    return flops if isinstance(flops, int) else 0


def _flops_per_op(modules: list[fx.GraphModule]) -> float:
    """The matrix products' FLOPs (linear layers, matmuls, attention; not the ops of other libraries, such as a
    grouped GEMM) per operation that launches work (views, casts and ``getitem`` not counted)."""
    ops = flops = 0
    for m in modules:
        for n in m.graph.nodes:
            if n.op in ("call_function", "call_method", "call_module") and not is_view_or_cast(n) \
                    and n.target not in ("size", "dim", "stride"):
                ops += 1
                flops += _product_flops(n)
    return flops / ops if flops else math.inf


def _static(x: Any) -> bool:
    if isinstance(x, torch.SymInt):
        return False
    return not isinstance(x, torch.Tensor) or all(isinstance(d, int) for d in x.shape)


def _adapters_only(example_inputs: Any) -> bool:
    """Trainable parameters holding at most ``ADAPTER_SHARE`` of the parameters' bytes, and no other leaf that
    gathers a gradient (a plain tensor with requires_grad: runtime/graph_grads.py hooks parameters only)."""
    if any(isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) and x.requires_grad and x.is_leaf
           for x in example_inputs):
        return False
    params = [x for x in example_inputs if isinstance(x, torch.nn.Parameter)]
    trainable = sum(p.nbytes for p in params if p.requires_grad)
    return 0 < trainable <= ADAPTER_SHARE * sum(p.nbytes for p in params)


def _quantized(example_inputs: Any) -> bool:
    return any(isinstance(x, torch.nn.Parameter) and (not x.dtype.is_floating_point or hasattr(x, "quant_state"))
               for x in example_inputs)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def step_facts(gm: fx.GraphModule, example_inputs: Any) -> StepFacts:
    """The facts of the step ``gm`` computes (module docstring)."""
    modules = [gm, *subgraphs(gm)]
    tokens = max((_rows(parts[0]) for m in modules for n in m.graph.nodes
                  if (parts := linear_parts(n)) is not None), default=0)
    checkpointed = any(is_checkpoint(n) for m in modules for n in m.graph.nodes)
    cuda = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    try:
        estimate = estimate_peak(gm, example_inputs, tokens)
    except Exception:  # a graph the estimate cannot read: planned without one, and the plan line says so
        estimate = None
    return StepFacts(tokens=tokens, checkpointed=checkpointed, cuda=cuda, estimate=estimate,
                     device_budget=_device_budget(example_inputs), flops_per_op=_flops_per_op(modules),
                     # where Dynamo would not turn a second length into a symbolic one (dynamic=False), each
                     # length would be captured anew: counted as not static
                     static_shapes=all(_static(x) for x in example_inputs)
                     and torch._dynamo.config.automatic_dynamic_shapes,
                     adapters_only=_adapters_only(example_inputs), distributed=_distributed(),
                     quantized=_quantized(example_inputs))


@dataclasses.dataclass(frozen=True)
class Plan:
    """The savers chosen, and why; ``apply`` writes them into the options the user did not give."""
    memory: Any  # a goal or a budget in GiB
    facts: StepFacts
    offload: Optional[OffloadOptions] = None
    tiled_mlp: Optional[TiledMlpOptions] = None
    moe_recompute: bool = False
    return_logits: Any = True
    reason: str = ""
    cuda_graphs: bool = False  # the step captured in CUDA graphs (Inductor's triton.cudagraphs)
    graphs_reason: str = ""  # why or why not, for the plan line; empty where there is nothing to say (no GPU)

    def apply(self, options: Options) -> Options:
        chosen = {"offload": self.offload, "tiled_mlp": self.tiled_mlp, "moe_recompute": self.moe_recompute,
                  "return_logits": self.return_logits}
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
        if options.return_logits == "lazy":
            on.append("lazy logits")
        pinned = sorted(options.given & {"offload", "tiled_mlp", "moe_recompute", "return_logits"})
        estimate = self.facts.estimate
        return (f"memory={self.memory!r} ({self.facts.describe()}): {', '.join(on) or 'no memory saver'}"
                + (f"; {self.reason}" if self.reason else "")
                + (f"; {estimate.describe(savers_on(options))}" if estimate is not None else
                   "; peak not estimated" if self.facts.known else "")
                + (f"; CUDA graphs {self.graphs_reason}" if self.graphs_reason else "")
                + ("; offload switched off by the disable option" if "offload" in options.disable else "")
                + (f"; pinned by options: {', '.join(pinned)}" if pinned else ""))


def _weighed(on: dict[str, Any]) -> list[tuple[str, int]]:
    """The savers set in ``on`` (name: value, as the options hold them) that the estimate weighs, as (name, rows)."""
    return ([("offload", 0)] if on.get("offload") else []) + \
        ([("tiled_mlp", on["tiled_mlp"].rows)] if on.get("tiled_mlp") else []) + \
        ([("return_logits", 0)] if on.get("return_logits", True) in ("lazy", False) else [])


def savers_on(options: Options) -> list[tuple[str, int]]:
    """The savers ``options`` turn on that the estimate weighs, as (name, rows) pairs."""
    return _weighed({"offload": options.offload, "tiled_mlp": options.tiled_mlp,
                     "return_logits": options.return_logits})


def _tile_rows(tokens: int) -> int:
    return TILE_ROWS if tokens > TILE_ROWS else max(1, tokens // 2)


def plan(memory: Any, facts: StepFacts, inner: str = "inductor", partitioner_taken: bool = False,
         pinned: Optional[dict[str, Any]] = None, graphs_pinned: bool = False) -> Plan:
    """The savers for goal ``memory`` on a step with ``facts`` compiled by ``inner`` (module docstring); offload only
    where AOTAutograd partitions the graph (not ``inner="eager"``) and the user gave Inductor no partitioner of their
    own (``partitioner_taken``: ``custom_partitioner_fn``, which offload would replace). ``pinned``: the savers the
    user set (or the disable option switched off), by name, with their values (None or False: off); the budget
    counts them as they are and adds none of them. Then whether CUDA graphs capture the step
    (``cuda_graphs_choice``; ``graphs_pinned``: the user set ``triton.cudagraphs`` or a ``mode``)."""
    chosen = _savers(memory, facts, inner, partitioner_taken, pinned or {})
    on = {"offload": chosen.offload, "tiled_mlp": chosen.tiled_mlp, "return_logits": chosen.return_logits,
          **(pinned or {})}
    budget = facts.device_budget if memory == "auto" else int(memory * GiB) if memory not in ("off", "min") else None
    crowded = budget is not None and facts.estimate is not None and \
        facts.estimate.peak(_weighed(on)) > GRAPHS_ROOM * budget
    graphs, why = cuda_graphs_choice(memory, facts, inner, graphs_pinned, bool(on["offload"]),
                                     on["return_logits"] == "lazy", crowded)
    return dataclasses.replace(chosen, cuda_graphs=graphs, graphs_reason=why)


def cuda_graphs_choice(memory: Any, facts: StepFacts, inner: str, pinned: bool, offload: bool,
                       lazy_logits: bool, crowded: bool = False) -> tuple[bool, str]:
    """Whether the plan captures the step in CUDA graphs, and the plan line's words for why (module docstring);
    ("", no words) off a GPU, where there is no choice to report. ``crowded``: the estimated peak is above
    ``GRAPHS_ROOM`` of the budget."""
    if not facts.cuda or not facts.known:
        return False, ""
    refusal = ("pinned by the user's triton.cudagraphs or mode" if pinned else
               f"off under memory={memory!r}" if memory in ("off", "min") else
               f"off: inner={inner!r}, not Inductor" if inner != "inductor" else
               "off: not a training graph" if facts.estimate is None or not facts.estimate.training else
               "off: symbolic shapes, or each length compiled on its own (dynamic=False)"
               if not facts.static_shapes else
               "off: more than one process" if facts.distributed else
               "off: a model on more than one device" if facts.device_budget is None else
               "off: offload's copies" if offload else
               "off: lazy logits hold the graph's output" if lazy_logits else
               "off: trainable parameters beyond adapters" if not facts.adapters_only else
               "off: quantised weights, whose products the FLOPs do not count" if facts.quantized else
               f"off: the estimated peak is above {GRAPHS_ROOM:.0%} of the budget" if crowded else None)
    if refusal is not None:
        return False, refusal
    if facts.flops_per_op >= HOST_BOUND_FLOPS_PER_OP:
        return False, f"off: bound by the GPU ({facts.flops_per_op:.2g} matrix-product FLOPs a graph op)"
    return True, f"on: bound by the host ({facts.flops_per_op:.2g} matrix-product FLOPs a graph op)"


def _savers(memory: Any, facts: StepFacts, inner: str, partitioner_taken: bool, pinned: dict[str, Any]) -> Plan:
    """``plan``'s memory savers."""
    check_memory(memory)
    tiled = TiledMlpOptions(TILE_ROWS, True) if facts.tokens > TILE_ROWS else None
    can_offload = facts.checkpointed and inner != "eager" and not partitioner_taken
    offload = OffloadOptions(mid_layer=True) if can_offload else None
    if memory == "off":
        return Plan(memory, facts, reason="memory='off'")
    if memory == "min":
        return Plan(memory, facts, offload=offload, tiled_mlp=tiled, moe_recompute=True, return_logits="lazy",
                    reason="every saver that applies")
    chosen: dict[str, Any] = {}
    if facts.cuda and facts.checkpointed and facts.tokens >= LONG_CONTEXT:
        chosen = {"offload": offload, "tiled_mlp": tiled, "return_logits": "lazy"}
        reason = f"checkpointed, at least {LONG_CONTEXT} tokens on a GPU: measured leaner at no cost in time"
    else:
        reason = f"none measured to cost no time below {LONG_CONTEXT} checkpointed tokens on a GPU"
    chosen = {name: value for name, value in chosen.items() if name not in pinned}
    budget = facts.device_budget if memory == "auto" else int(memory * GiB)
    estimate = facts.estimate
    if budget is None or estimate is None or not estimate.training:
        return Plan(memory, facts, reason=reason, **chosen)

    def peak() -> int:
        return estimate.peak(_weighed({**chosen, **pinned}))

    added = []
    candidates = [("offload", offload), ("tiled_mlp", TiledMlpOptions(_tile_rows(facts.tokens), True)),
                  ("return_logits", "lazy")]
    if memory != "auto":  # its time was measured (5.6 ms a step at Qwen3-MoE): a budget's choice, not the default's
        candidates.append(("moe_recompute", True))
    for name, value in candidates:
        if peak() <= budget:
            break
        if name in pinned or chosen.get(name) is not None or value is None:
            continue
        if name == "moe_recompute" or estimate.saving(name, value.rows if name == "tiled_mlp" else 0) > 0:
            chosen[name] = value
            added.append(name)
    where = "the device's memory" if memory == "auto" else "the budget"
    if added:
        reason += f"; over {where} ({budget / GiB:.2f} GiB) without them: added {', '.join(added)}"
    if peak() > budget:
        reason += f"; still over {where} ({budget / GiB:.2f} GiB) with every saver it may add"
    return Plan(memory, facts, reason=reason, **chosen)


def measured_peak_line(estimated: int, measured: int) -> str:
    """The report's line for the peak measured once the first step ran, against the estimate. The measure is the
    process's peak on the graph's device (``torch.cuda.max_memory_allocated``, not reset by sloth: a user's own
    reset counts), so a graph that is one piece of a step compares its own estimate with the whole step's peak."""
    off = (estimated - measured) / measured if measured else 0.0
    return (f"measured peak {measured / GiB:.2f} GiB when the graph ran a second time (the process's "
            f"max_memory_allocated), estimated {estimated / GiB:.2f} GiB: "
            + ("within 10%" if abs(off) <= 0.10 else f"the estimate is off by {100 * off:+.0f}%"))
