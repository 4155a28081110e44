"""The ``sloth`` torch.compile backend (found by Dynamo through the ``torch_dynamo_backends`` entry point).

    torch.compile(model, backend="sloth", options={"inner": "inductor", "patterns": [...], "report": True})

Dynamo hands over its FX graph (torch-level ops, parameters as inputs); sloth canonicalises it,
replaces the pattern families it recognises with ``torch.ops.sloth.*`` custom ops, and hands the
rewritten graph to the inner compiler. AOTAutograd traces through each custom op's registered
autograd, so the backward graph holds sloth's backward kernels and Inductor fuses the glue around them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch._dynamo.exc  # RestartAnalysis: a compile Dynamo discards
import torch._functorch.config  # enable_autograd_cache, patched per compile
import torch._inductor.config  # triton.cudagraphs: a global setting pins the plan's CUDA graphs
import torch.fx as fx

from . import subclass_guard
from .offload_partition import OffloadPartitioner
from ..lowering.backend_choice import triton_interpreter_on
from .late_passes import passes_off, with_post_grad_passes
from .options import INNER_COMPILERS, OFFLOAD_NEEDS_PARTITION, check_attention, parse_options
from .families import compile_with_families, families, family_passes, pass_records
from .fx_utils import module_path, source_location
from .pipeline import run_passes
from ..runtime.graph_grads import own_gradients
from .planner import Plan, StepFacts, measured_peak_line, plan, savers_on, step_facts
from .report import Report, Site

log = logging.getLogger("sloth")

_last_report: Optional[Report] = None
_interpreter_warned = False
_session_report = Report()


def last_report() -> Optional[Report]:
    """The report of the most recent graph sloth compiled in this process (None before the first)."""
    return _last_report


def report() -> Report:
    """Every graph sloth compiled since the process started or ``reset_report()``, merged.

    One model often compiles to several graphs (a graph break, the loss in its own frame), so this,
    not ``last_report()``, is the one to read after a training step.
    """
    merged = Report()
    merged.merge(_session_report)
    return merged


def reset_report() -> None:
    """Start ``report()`` afresh (for example before compiling the next model)."""
    global _last_report, _session_report
    _last_report, _session_report = None, Report()


def note_site(family: str, op: str, detail: str) -> None:
    """Record in ``report()`` a site an integration replaced outside any graph, once until ``reset_report()``."""
    site = Site(family, op, "", "", detail)
    if site not in _session_report.sites:
        _session_report.replaced(site)


def _sites_given(gm: fx.GraphModule) -> list[Site]:
    """The sloth ops already in the graph Dynamo traced (an integration put them there, or the user's code calls
    them), each reported as a site of the family that emits the op."""
    emitted_by = {op: f.name for f in family_passes() for op in f.emits}
    sites = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "sloth":
            name = target._opname
            sites.append(Site(emitted_by.get(name, "integration"), f"sloth.{name}", module_path(node),
                              source_location(node), "in the graph as traced (put there by an integration: "
                              "compiler/integrations/, or called by the model)"))
    return sites


def _publish(graph_report: Report) -> None:
    global _last_report
    _last_report = graph_report
    _session_report.merge(graph_report)


def _measuring_peak(compiled: Callable, estimated: int, graph_report: Report, device: Any = None) -> Callable:
    """``compiled``, which writes the process's peak GPU memory into the plan's lines of the report when it runs a
    second time (for a whole-step graph: once the first step's forward and backward ran), beside the estimate."""
    calls = [0]

    def run(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            line = measured_peak_line(estimated, torch.cuda.max_memory_allocated(device))
            for target in (graph_report, _session_report):
                if line not in target.plan:
                    target.plan.append(line)
        return compiled(*args)

    return run


def _warn_if_interpreter_unused() -> None:
    """Warn, once a process, where TRITON_INTERPRET=1 is set but sloth's kernels were defined without it: Triton
    reads the variable when a kernel is defined (``triton.jit``), and sloth defines its kernels and reads it
    (lowering/backend_choice.py) when it is imported, so a variable set after ``import sloth`` is not seen, and
    sloth's ops on CPU tensors run their PyTorch references."""
    global _interpreter_warned
    if _interpreter_warned or triton_interpreter_on() or os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    _interpreter_warned = True
    warnings.warn("sloth: TRITON_INTERPRET=1 was set after sloth was imported, so sloth's Triton kernels do not run in "
                  "the interpreter: on the CPU its ops run their PyTorch references. Set it before importing triton, "
                  "peft or sloth (or in the shell) to run the kernels.", stacklevel=2)


def _inductor_config(mode: Optional[str], extra: dict[str, Any]) -> dict[str, Any]:
    """Inductor config patches from ``mode`` and from the options that are Inductor config keys (``parse_options``
    checked their names)."""
    patches = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    patches.update(extra)
    return patches


def compile_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str, mode: Optional[str] = None,
                  inductor_options: Optional[dict[str, Any]] = None,
                  partitioner: Optional[OffloadPartitioner] = None, off: Sequence[str] = (),
                  report: Optional[Report] = None) -> Callable:
    """Compile the rewritten graph with ``inner``: Inductor, AOTAutograd without codegen, or plain eager.

    ``partitioner`` (the offload option) replaces the partitioner of Inductor or of AOTAutograd; Inductor runs
    sloth's post-grad passes (compiler/late_passes.py) but those named in ``off``, timed into ``report``."""
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = with_post_grad_passes(_inductor_config(mode, inductor_options or {}), off, report)
        if partitioner is not None:
            if patches.get("custom_partitioner_fn") is not None:
                raise ValueError("sloth: offload replaces Inductor's partitioner; it cannot be combined with "
                                 "custom_partitioner_fn")
            patches["custom_partitioner_fn"] = partitioner
        return compile_fx(gm, list(example_inputs), config_patches=patches or None)
    if inductor_options:
        raise ValueError(f"sloth: options {list(inductor_options)} are Inductor settings, but inner={inner!r}")
    if inner == "aot_eager":
        if partitioner is not None:
            from torch._dynamo.backends.common import aot_autograd
            from torch._functorch.aot_autograd import make_boxed_compiler

            nop = make_boxed_compiler(lambda graph, _inputs: graph)
            return aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partitioner)(gm, list(example_inputs))
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, list(example_inputs))
    if inner == "eager":
        if partitioner is not None:
            raise ValueError(OFFLOAD_NEEDS_PARTITION)
        return gm.forward
    raise ValueError(f"sloth: inner must be one of {list(INNER_COMPILERS)}, got {inner!r}")


def sdpa_priority(names: Optional[Sequence[str]]) -> contextlib.AbstractContextManager:
    """A context in which ``F.scaled_dot_product_attention`` tries the SDPA backends ``names`` in that order
    (the rest disabled), or no change for None. Compiling inside it fixes the choice in the traced graph:
    AOTAutograd decomposes SDPA into the chosen backend's forward and backward ops while it traces. The
    settings are process-wide while the context is open (as ``sdpa_kernel``'s are)."""
    if check_attention(names) is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enum = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([enum[n] for n in names], set_priority=True)


def sloth_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: Optional[dict[str, Any]] = None,
                  mode: Optional[str] = None) -> Callable:
    """torch.compile backend: rewrite ``gm`` with sloth's passes, then compile it with the inner compiler.

    ``options``: sloth's own (compiler/options.py's ``Options`` documents each) and Inductor config keys.
    """
    _warn_if_interpreter_unused()
    opts, inductor_options = parse_options(options)  # every bad option fails here, before any work
    # The memory savers the plan chooses for this step, where the user pinned none (compiler/planner.py). A planner
    # that raises chooses nothing and says why: never a crash of the user's step.
    try:
        pinned = {name: getattr(opts, name) for name in ("offload", "tiled_mlp", "moe_recompute", "return_logits")
                  if name in opts.given}
        if "offload" in opts.disable:
            pinned["offload"] = None
        # CUDA graphs are the user's choice where they name them, give a mode (max-autotune-no-cudagraphs says no),
        # or turn Inductor's global config on (a global False cannot be told from the default: every config.patch
        # of the key leaves it "set" on the way out)
        graphs_pinned = "triton.cudagraphs" in inductor_options or mode is not None or \
            bool(torch._inductor.config.triton.cudagraphs)
        step_plan = plan(opts.memory, step_facts(gm, example_inputs), opts.inner,
                         partitioner_taken=inductor_options.get("custom_partitioner_fn") is not None, pinned=pinned,
                         graphs_pinned=graphs_pinned)
    except Exception as error:
        step_plan = Plan(opts.memory, StepFacts(0, False, False, known=False),
                         reason=f"the planner raised ({type(error).__name__}: {error}), so no saver was chosen")
    opts = step_plan.apply(opts)
    if step_plan.cuda_graphs:
        inductor_options = {**inductor_options, "triton.cudagraphs": True}
    if "offload" in opts.disable:
        opts = dataclasses.replace(opts, offload=None)
    inner, attention, offload = opts.inner, opts.attention, opts.offload
    chosen = [f for f in (families() if opts.patterns is None else opts.patterns) if f not in opts.disable]
    pass_options = opts.pass_options()

    # The graph's own meta dict, without what sloth's passes record there: Dynamo's DDP optimizer gives every
    # piece of a split graph the whole graph's meta dict (torch/_dynamo/backends/distributed.py,
    # propagate_metadata), so one piece's records (the returned logits' slots, the masks it proved) would
    # otherwise be read when the next piece compiles.
    records = pass_records()
    gm.meta = {k: v for k, v in gm.meta.items() if k not in records}
    fallback = subclass_guard.snapshot(gm)  # a copy to fall back to, when the graph holds DTensor values
    late_off = passes_off(inner, opts.disable)
    plan_line = step_plan.describe(opts)

    try:
        given = _sites_given(gm)
    except Exception as error:  # the report's count of traced-in ops, never a crash of the user's step
        log.warning("sloth: could not list the sloth ops already in the graph (%s: %s)", type(error).__name__, error)
        given = []

    def new_report() -> Report:
        return Report(passes_off=dict(late_off), plan=[plan_line], sites=list(given))

    graph_report = new_report()
    rewritten = run_passes(gm, example_inputs, chosen, graph_report, pass_options, opts.dump)
    refused = subclass_guard.sloth_op_on_subclass(rewritten) if fallback is not None else None
    if refused:  # a sloth op would read a DTensor: the graph as it was, every site reported with the reason
        graph_report = new_report()
        rewritten = run_passes(fallback, example_inputs, chosen, graph_report, pass_options, opts.dump,
                               refuse=refused)
    gm = rewritten
    log.debug("sloth: rewritten graph\n%s", gm.graph)
    # AOTAutograd's cache keys a compiled graph by the graph's code, which shows neither the recompute tags
    # (node meta) nor the SDPA priority (global state): a graph compiled earlier with other settings, in this
    # process or an earlier one, would be returned as is. Seen on the H200: a run asking for flash attention
    # got the previous run's cuDNN graph. Inductor's own cache, keyed on the partitioned graphs, still works.
    uncacheable = attention is not None or bool(graph_report.recomputed) or offload is not None
    partitioner = OffloadPartitioner(offload, graph_report.offload) if offload is not None else None
    # The report is published (and printed) once the inner compiler is done: the offload partitioner writes
    # into it while AOTAutograd partitions the graph. A compile that fails publishes what the passes did.
    def compile_once(first: bool) -> Callable:
        # A graph that reads a mask input is compiled twice (patterns/mask_inputs.py); the second compile's
        # partition goes to a report of its own, so the offload counts are the first version's alone.
        second = OffloadPartitioner(offload, Report().offload) if offload is not None and not first else None
        return compile_inner(gm, example_inputs, inner, mode, inductor_options,
                             partitioner=partitioner if first else second, off=tuple(late_off), report=graph_report)

    try:
        with sdpa_priority(attention), torch._functorch.config.patch(
                enable_autograd_cache=torch._functorch.config.enable_autograd_cache and not uncacheable):
            # Each family's compile_with and after_compile (compiler/families.py): the causal mask's two versions,
            # the cross-entropy family's returned logits back into autograd.
            compiled = compile_with_families(gm, compile_once, pass_options)
    except torch._dynamo.exc.RestartAnalysis:
        # Dynamo traces the frame again and calls sloth anew (seen under dynamic=True: AOTAutograd cannot make a
        # tensor of a symbolic float such as an RMSNorm's eps and asks Dynamo to specialise it): this compile is
        # discarded, so its report is not published (the report counted every graph and site twice).
        raise
    except BaseException:
        _publish(graph_report)
        raise
    _publish(graph_report)
    if step_plan.cuda_graphs:  # each gradient out of the graphs' pool after it accumulates (runtime/graph_grads.py)
        own_gradients(example_inputs)
    if opts.report:
        print(graph_report)
    cuda = next((x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.device.type == "cuda"), None)
    if cuda is not None and step_plan.facts.estimate is not None and step_plan.facts.estimate.training:
        compiled = _measuring_peak(compiled, step_plan.facts.estimate.peak(savers_on(opts)), graph_report, cuda)
    if inner != "eager" or attention is None:
        return compiled

    def run_with_priority(*args: Any) -> Any:
        # Uncompiled, SDPA picks its backend when the graph runs: keep the priority then too (a checkpointed
        # region's recomputation in the backward runs outside it, so it may pick another kernel).
        with sdpa_priority(attention):
            return compiled(*args)

    return run_with_priority
