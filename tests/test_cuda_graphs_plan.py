"""The plan's CUDA graphs (compiler/planner.py ``cuda_graphs_choice``) and the gradients moved out of the graphs' pool
(runtime/graph_grads.py).

The choice is made from facts; on the CPU they are given (a GPU's facts, faked) so that every branch runs, and the
backend's wiring runs end to end with Inductor, which skips CUDA graphs for a CPU graph by itself. The hook is
checked with a backward whose output is kept, as a graph's pool keeps it: the parameter's .grad must be a copy, and
a second backward must add into that copy, with eager's sums."""
from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
import torch.nn as nn

import sloth
import sloth.compiler.backend as backend
from sloth.compiler import planner
from sloth.compiler.options import OffloadOptions
from sloth.compiler.peak_estimate import PeakEstimate
from sloth.compiler.planner import HOST_BOUND_FLOPS_PER_OP, StepFacts, cuda_graphs_choice, plan, step_facts
from sloth.runtime import graph_grads

GiB = 1 << 30
TRAINING = PeakEstimate(weights=GiB, gradients=GiB // 64, activations=GiB, offload_frees=0, glu_bytes=0,
                        tokens=4096)
# A host-bound training step on one GPU, with adapters as its trainable parameters: the step the plan captures.
HOST_BOUND = StepFacts(tokens=4096, checkpointed=False, cuda=True, estimate=TRAINING, device_budget=60 * GiB,
                       flops_per_op=HOST_BOUND_FLOPS_PER_OP / 3, static_shapes=True, adapters_only=True)


def test_a_host_bound_adapter_step_on_one_gpu_is_captured():
    chosen = plan("auto", HOST_BOUND)
    assert chosen.cuda_graphs, chosen.graphs_reason
    assert chosen.graphs_reason.startswith("on: bound by the host (4e+09 matrix-product FLOPs"), chosen.graphs_reason
    assert plan(40, HOST_BOUND).cuda_graphs  # a budget in GiB plans the same way
    line = chosen.describe(sloth.compiler.options.parse_options(None)[0])
    assert "; CUDA graphs on: bound by the host" in line, line


@pytest.mark.parametrize("change, words", [
    (dict(flops_per_op=HOST_BOUND_FLOPS_PER_OP), "off: bound by the GPU (1.2e+10 matrix-product FLOPs a graph op)"),
    (dict(flops_per_op=math.inf), "off: bound by the GPU"),  # no linear layer counted
    (dict(estimate=dataclasses.replace(TRAINING, training=False)), "off: not a training graph"),
    (dict(estimate=None), "off: not a training graph"),  # no estimate: nothing known of the backward
    (dict(static_shapes=False), "off: symbolic shapes"),
    (dict(distributed=True), "off: more than one process"),
    (dict(device_budget=None), "off: a model on more than one device"),
    (dict(adapters_only=False), "off: trainable parameters beyond adapters"),
    (dict(quantized=True), "off: quantised weights"),
])
def test_each_unsafe_or_gpu_bound_step_is_not_captured_and_the_line_says_why(change, words):
    chosen = plan("auto", dataclasses.replace(HOST_BOUND, **change))
    assert not chosen.cuda_graphs and chosen.graphs_reason.startswith(words), chosen.graphs_reason


def test_what_the_plan_or_the_user_turned_on_keeps_the_graphs_off():
    assert plan("off", HOST_BOUND).graphs_reason == "off under memory='off'"
    assert plan("min", HOST_BOUND).graphs_reason == "off under memory='min'"  # lazy logits and all: the leanest
    assert plan("auto", HOST_BOUND, inner="aot_eager").graphs_reason == "off: inner='aot_eager', not Inductor"
    assert plan("auto", HOST_BOUND, graphs_pinned=True).graphs_reason.startswith("pinned by the user's")
    offload = plan("auto", HOST_BOUND, pinned={"offload": OffloadOptions()})
    assert offload.graphs_reason == "off: offload's copies"
    lazy = plan("auto", HOST_BOUND, pinned={"return_logits": "lazy"})
    assert lazy.graphs_reason == "off: lazy logits hold the graph's output"
    # a peak near the budget: the graphs' pool serves the graphs alone
    crowded = plan("auto", dataclasses.replace(HOST_BOUND, device_budget=int(2.2 * GiB)))
    assert crowded.graphs_reason == "off: the estimated peak is above 80% of the budget", crowded.graphs_reason
    assert plan("auto", dataclasses.replace(HOST_BOUND, device_budget=int(2.6 * GiB))).cuda_graphs
    # a tight budget adds offload and lazy logits: the graphs go with them
    tight = plan(1.5, dataclasses.replace(HOST_BOUND, checkpointed=True,
                                          estimate=dataclasses.replace(TRAINING, offload_frees=GiB // 2)))
    assert tight.offload is not None and not tight.cuda_graphs


def test_nothing_to_say_off_a_gpu():
    assert cuda_graphs_choice("auto", dataclasses.replace(HOST_BOUND, cuda=False), "inductor", False, False,
                              False) == (False, "")
    assert "CUDA graphs" not in plan("auto", dataclasses.replace(HOST_BOUND, cuda=False)).describe(
        sloth.compiler.options.parse_options(None)[0])


class Adapted(nn.Module):
    """A frozen 64 x 64 base with a rank-2 adapter beside it: adapters are 1/8 of the parameters' bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(64, 64, bias=False).requires_grad_(False)
        self.a = nn.Linear(64, 2, bias=False)
        self.b = nn.Linear(2, 64, bias=False)
        self.big = nn.Linear(64, 64 * 8, bias=False).requires_grad_(False)

    def forward(self, x):
        h = self.base(x) + self.b(self.a(x))
        return self.big(h).square().mean()


def test_a_plain_leaf_with_a_gradient_is_no_adapter_step():
    # its .grad would come from the pool with no hook to copy it out (runtime/graph_grads.py hooks parameters)
    w = torch.randn(64, 64, requires_grad=True)
    [facts] = _facts_of(lambda x: (Adapted()(x) + (x @ w).sum()), torch.randn(3, 5, 64))
    assert not facts.adapters_only


@pytest.mark.parametrize("how", [dict(mode="max-autotune-no-cudagraphs"), dict(options={"triton.cudagraphs": False}),
                                  "global"])
def test_the_users_word_on_cuda_graphs_pins_them(monkeypatch, how):
    seen = {}

    def spy(gm, inputs, inner, mode=None, inductor_options=None, **kwargs):
        seen["cudagraphs"] = (inductor_options or {}).get("triton.cudagraphs")
        return gm.forward

    monkeypatch.setattr(backend, "step_facts", lambda gm, inputs: dataclasses.replace(
        step_facts(gm, inputs), cuda=True, device_budget=60 * GiB))
    monkeypatch.setattr(backend, "compile_inner", spy)
    model = Adapted()
    torch._dynamo.reset()
    sloth.reset_report()
    with torch._inductor.config.patch({"triton.cudagraphs": True}) if how == "global" else contextlib.nullcontext():
        torch.compile(model, backend="sloth", **({} if how == "global" else how))(torch.randn(3, 5, 64)).backward()
    assert seen["cudagraphs"] in (None, False)
    assert "CUDA graphs pinned by the user's" in sloth.report().plan[0], sloth.report().plan


def test_the_facts_of_a_small_adapter_step():
    torch.manual_seed(0)
    [facts] = _facts_of(Adapted(), torch.randn(3, 5, 64))
    assert facts.static_shapes and facts.adapters_only and not facts.distributed and not facts.quantized
    # four linears on 15 rows (2 * 15 * (64*64 + 64*2 + 2*64 + 64*512) FLOPs) over the graph's operations
    assert 0 < facts.flops_per_op < HOST_BOUND_FLOPS_PER_OP
    full = Adapted().requires_grad_(True)
    [facts] = _facts_of(full, torch.randn(3, 5, 64))
    assert not facts.adapters_only


def _facts_of(model, *args):
    seen = []

    def capture(gm, example_inputs):
        seen.append(step_facts(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(*args)
    return seen


def test_the_backend_compiles_a_captured_plan_with_cudagraphs_and_owns_the_gradients(monkeypatch):
    # The wiring, with the GPU's facts on the CPU: the backend asks Inductor for triton.cudagraphs (which Inductor
    # skips for a CPU graph, so no pool is involved: the hook itself is tested below) and hooks the adapters;
    # gradient accumulation then gives eager's sums.
    seen = {}
    real = backend.compile_inner

    def spy(gm, example_inputs, inner, mode=None, inductor_options=None, **kwargs):
        seen["options"] = dict(inductor_options or {})
        return real(gm, example_inputs, inner, mode, inductor_options, **kwargs)

    monkeypatch.setattr(backend, "step_facts", lambda gm, inputs: dataclasses.replace(
        step_facts(gm, inputs), cuda=True, device_budget=60 * GiB))
    monkeypatch.setattr(backend, "compile_inner", spy)
    torch.manual_seed(0)
    model = Adapted()
    xs = [torch.randn(3, 5, 64) for _ in range(2)]
    for x in xs:
        model(x).backward()
    want = [p.grad.clone() for p in (model.a.weight, model.b.weight)]
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    run = torch.compile(model, backend="sloth")
    for x in xs:
        run(x).backward()
    assert seen["options"].get("triton.cudagraphs") is True
    assert "; CUDA graphs on: bound by the host" in sloth.report().plan[0], sloth.report().plan
    assert graph_grads._registered(model.a.weight) and graph_grads._registered(model.b.weight)
    assert not graph_grads._registered(model.base.weight)  # frozen: no gradient, no hook
    for p, g in zip((model.a.weight, model.b.weight), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


class KeptOutput(torch.autograd.Function):
    """y = x * w whose backward returns, for w, a tensor it also keeps: as a CUDA graph's pool keeps its outputs,
    which the next replay overwrites (here: ``kept[-1].fill_(nan)`` before the next backward)."""
    kept: list = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if KeptOutput.kept:
            KeptOutput.kept[-1].fill_(float("nan"))  # the next replay writes over the previous output
        dw = (grad * x).sum(0)
        KeptOutput.kept.append(dw.detach())  # the same memory, as the pool's, without a second reference to dw
        return None, dw


def test_a_gradient_kept_by_the_pool_is_copied_once_and_accumulated_into():
    KeptOutput.kept.clear()
    w = nn.Parameter(torch.randn(7))
    assert graph_grads.own_gradients([w, torch.randn(3), nn.Parameter(torch.ones(2), requires_grad=False)]) == 1
    assert graph_grads.own_gradients([w]) == 0  # once per parameter
    xs = [torch.randn(4, 7) for _ in range(3)]
    KeptOutput.apply(xs[0], w).sum().backward()
    first = w.grad
    assert first is not KeptOutput.kept[-1] and first.data_ptr() != KeptOutput.kept[-1].data_ptr()
    KeptOutput.apply(xs[1], w).sum().backward()  # accumulation: adds into the copy, in place
    assert w.grad is first
    torch.testing.assert_close(w.grad, xs[0].sum(0) + xs[1].sum(0))
    w.grad = None  # zero_grad(set_to_none=True): the next backward's output is copied again
    KeptOutput.apply(xs[2], w).sum().backward()
    assert w.grad is not first and w.grad is not KeptOutput.kept[-1]
    torch.testing.assert_close(w.grad, xs[2].sum(0))


def test_a_dead_parameters_entry_goes():
    w = nn.Parameter(torch.randn(3))
    graph_grads.own_gradients([w])
    key = id(w)
    del w
    assert key not in graph_grads._owned


def test_a_qlora_step_is_seen_as_quantised():
    pytest.importorskip("bitsandbytes")
    from test_qlora import qlora_model

    model = qlora_model(torch.float32)
    ids = torch.randint(0, 128, (2, 16))
    facts = _facts_of(lambda ids: model(input_ids=ids, labels=ids).loss, ids)
    assert facts and any(f.quantized for f in facts)
