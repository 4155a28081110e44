"""The plan (compiler/planner.py): the memory savers chosen for a step under each ``memory`` goal, the options a user
gives pinned over it, the facts read from the graph, equal numerics under every plan and the report's plan line.

On the CPU the "auto" goal turns nothing on (its saver set is measured on a GPU at 16k checkpointed tokens), so the
branches are exercised through ``plan`` with the facts given, and through ``memory="min"`` on tiny models."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import sloth
import sloth.compiler.backend as backend
from sloth.compiler import planner
from sloth.compiler.options import OffloadOptions, TiledMlpOptions, parse_options
from sloth.compiler.planner import LONG_CONTEXT, TILE_ROWS, StepFacts, plan, step_facts
from test_offload import Checkpointed, _step

LONG_GPU = StepFacts(tokens=LONG_CONTEXT, checkpointed=True, cuda=True)


@pytest.mark.parametrize("facts, expect", [
    (LONG_GPU, (OffloadOptions(mid_layer=True), TiledMlpOptions(TILE_ROWS, True))),
    (StepFacts(LONG_CONTEXT - 1, True, True), (None, None)),  # below the measured crossover
    (StepFacts(LONG_CONTEXT, False, True), (None, None)),  # nothing checkpointed: not measured
    (StepFacts(LONG_CONTEXT, True, False), (None, None)),  # the CPU
])
def test_auto_turns_on_what_was_measured_free_and_nothing_else(facts, expect):
    chosen = plan("auto", facts)
    assert (chosen.offload, chosen.tiled_mlp, chosen.moe_recompute) == (*expect, False)


@pytest.mark.parametrize("facts", [LONG_GPU, StepFacts(4096, True, False), StepFacts(100, False, False)])
def test_min_turns_on_every_saver_that_applies_and_off_none(facts):
    leanest = plan("min", facts)
    assert leanest.moe_recompute
    assert (leanest.offload is not None) == facts.checkpointed
    assert (leanest.tiled_mlp is not None) == (facts.tokens > TILE_ROWS)
    none = plan("off", facts)
    assert (none.offload, none.tiled_mlp, none.moe_recompute) == (None, None, False)


def test_no_offload_where_nothing_partitions_the_graph():
    assert plan("min", LONG_GPU, inner="eager").offload is None
    assert plan("min", LONG_GPU, inner="aot_eager").offload is not None


def test_an_option_the_user_gives_is_pinned_over_the_plan():
    chosen = plan("min", LONG_GPU)
    options = chosen.apply(parse_options({"memory": "min", "tiled_mlp": False, "offload": {"min_bytes": 0}})[0])
    assert options.tiled_mlp is None  # the user said no
    assert options.offload == OffloadOptions(min_bytes=0)  # the user's, not the plan's mid_layer
    assert options.moe_recompute  # not given: the plan's
    line = chosen.describe(options)
    assert "pinned by options: offload, tiled_mlp" in line and "moe_recompute" in line


@pytest.mark.parametrize("value", ["fast", 20, None, True])
def test_a_bad_memory_goal_is_refused(value):
    with pytest.raises(ValueError, match=r"memory must be one of \['auto', 'min', 'off'\]"):
        parse_options({"memory": value})


def test_the_defaults_and_what_was_given():
    options = parse_options(None)[0]
    assert options.memory == "auto" and options.given == frozenset()
    assert parse_options({"memory": "off", "report": True})[0].given == {"memory", "report"}


def _facts_of(model, *args):
    seen = []

    def capture(gm, example_inputs):
        seen.append(step_facts(gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=capture)(*args)
    return seen


def test_the_facts_come_from_the_graph():
    # tokens: the rows of the widest linear's input (2 x 7 here); checkpointed: a tag_activation_checkpoint body
    [facts] = _facts_of(Checkpointed(), torch.randn(2, 7, 24))
    assert facts == StepFacts(tokens=14, checkpointed=True, cuda=False)
    [plain] = _facts_of(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(3, 5, 8))
    assert plain == StepFacts(tokens=15, checkpointed=False, cuda=False)


def test_the_leanest_plan_gives_the_same_loss_and_gradients():
    """The savers move and recompute tensors; none changes a value (offload copies, mid_layer saves what would be
    recomputed; the tiled MLP and moe_recompute find no site in this model). "auto" is "off" on the CPU (above)."""
    model = Checkpointed(layers=2)
    x = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(3))
    results = {}
    for memory in ("off", "min"):
        torch._dynamo.reset()
        sloth.reset_report()
        results[memory] = _step(model, torch.compile(model, backend="sloth", options={"memory": memory,
                                                                                         "inner": "aot_eager"}), x)
        lines = sloth.report().plan
        assert lines and all(line.startswith(f"memory={memory!r}") for line in lines), lines
    assert "offload (mid_layer)" in sloth.report().plan[0] and "plan: memory='min'" in str(sloth.report())
    torch.testing.assert_close(results["min"][0], results["off"][0], rtol=0, atol=0)
    for got, want in zip(results["min"][1], results["off"][1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_planner_that_raises_chooses_nothing_and_says_why(monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("no facts today")

    monkeypatch.setattr(backend, "step_facts", broken)
    model = Checkpointed(layers=2)
    x = torch.randn(2, 7, 24)
    loss, _ = _step(model, torch.compile(model, backend="sloth", options={"inner": "aot_eager"}), x)
    torch.testing.assert_close(loss, model(x).detach())
    [line] = sloth.report().plan
    assert "the planner raised (RuntimeError: no facts today), so no saver was chosen" in line, line


def test_offload_switched_off_by_name_is_off_in_the_plan_line():
    model = Checkpointed(layers=2)
    run = torch.compile(model, backend="sloth", options={"memory": "min", "inner": "aot_eager", "disable": "offload"})
    _step(model, run, torch.randn(2, 7, 24))
    [line] = sloth.report().plan
    assert "offload (mid_layer)" not in line and "moe_recompute" in line, line
    assert "offload switched off by the disable option" in line, line
    assert sloth.report().offload == []


def test_no_offload_where_the_user_gave_inductor_a_partitioner():
    # offload replaces Inductor's partitioner: a plan that chose it beside the user's custom_partitioner_fn would
    # refuse the compile the user asked for (found in review)
    assert plan("min", LONG_GPU, partitioner_taken=True).offload is None
    assert plan("auto", LONG_GPU, partitioner_taken=True).tiled_mlp is not None


def test_the_line_of_a_planner_that_raised_keeps_the_users_goal():
    line = planner.Plan("min", StepFacts(0, False, False, known=False), reason="it raised").describe(
        parse_options({"memory": "min"})[0])
    assert line.startswith("memory='min' (facts unknown): no memory saver; it raised"), line
