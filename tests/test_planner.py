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
from sloth.compiler.peak_estimate import PeakEstimate
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
    assert chosen.return_logits == ("lazy" if expect[0] is not None else True)


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


@pytest.mark.parametrize("value", ["fast", "20", None, True, 0, -3, float("nan"), float("inf"), [20]])
def test_a_bad_memory_goal_is_refused(value):
    with pytest.raises(ValueError, match=r"memory must be one of \['auto', 'min', 'off'\] or a number of GiB above 0"):
        parse_options({"memory": value})


def test_a_budget_in_gib_is_taken():
    assert parse_options({"memory": 20})[0].memory == 20.0
    assert parse_options({"memory": 0.5})[0].memory == 0.5


GiB = 1024 ** 3
# weights 10 GiB, activations 6 GiB: offload frees 3 GiB, the tiled MLP (2048-row blocks of 8192 tokens) 1.5 GiB
ESTIMATE = PeakEstimate(weights=10 * GiB, gradients=0, activations=6 * GiB, offload_frees=3 * GiB,
                        glu_bytes=2 * GiB, tokens=8192)


@pytest.mark.parametrize("budget, expect, still_over", [
    (17, (), False),  # 16 GiB fits
    (15, ("offload",), False),  # 13 GiB with offload
    (12, ("offload", "tiled_mlp"), False),  # 11.5 GiB with both
    (11, ("offload", "tiled_mlp", "moe_recompute"), True),  # nothing estimated brings it under 11
])
def test_a_budget_adds_savers_in_order_until_the_estimate_fits(budget, expect, still_over):
    facts = StepFacts(tokens=8192, checkpointed=True, cuda=False, estimate=ESTIMATE)
    chosen = plan(budget, facts)
    on = tuple(name for name, value in (("offload", chosen.offload), ("tiled_mlp", chosen.tiled_mlp),
                                        ("moe_recompute", chosen.moe_recompute)) if value)
    assert on == expect
    assert chosen.tiled_mlp is None or chosen.tiled_mlp.rows == TILE_ROWS
    assert ("still over the budget" in chosen.reason) == still_over, chosen.reason
    line = chosen.describe(chosen.apply(parse_options({"memory": budget})[0]))
    assert f"estimated peak {ESTIMATE.peak(planner.savers_on(chosen.apply(parse_options(None)[0]))) / GiB:.2f} GiB" \
        in line, line


def test_a_budget_skips_a_saver_that_frees_nothing_here():
    # nothing checkpointed: offload has nothing to move, so the tiled MLP comes first
    estimate = PeakEstimate(weights=10 * GiB, gradients=0, activations=6 * GiB, offload_frees=0,
                            glu_bytes=2 * GiB, tokens=8192)
    chosen = plan(14, StepFacts(tokens=8192, checkpointed=False, cuda=False, estimate=estimate))
    assert chosen.offload is None and chosen.tiled_mlp is not None and chosen.moe_recompute


def test_auto_plans_for_the_devices_memory_on_a_gpu_only():
    on_gpu = plan("auto", StepFacts(tokens=8192, checkpointed=True, cuda=True, estimate=ESTIMATE,
                                    device_budget=14 * GiB))
    assert on_gpu.offload is not None and on_gpu.tiled_mlp is None, on_gpu.reason
    assert "over the device's memory (14.00 GiB) without them: added offload" in on_gpu.reason
    # under "auto" moe_recompute, which costs time, is never added: a budget's choice
    tight = plan("auto", StepFacts(tokens=8192, checkpointed=True, cuda=True, estimate=ESTIMATE,
                                   device_budget=11 * GiB))
    assert tight.offload is not None and tight.tiled_mlp is not None and not tight.moe_recompute
    on_cpu = plan("auto", StepFacts(tokens=8192, checkpointed=True, cuda=False, estimate=ESTIMATE))
    assert (on_cpu.offload, on_cpu.tiled_mlp, on_cpu.moe_recompute) == (None, None, False)


def test_a_short_step_under_a_budget_tiles_half_its_rows():
    estimate = PeakEstimate(weights=0, gradients=0, activations=100, offload_frees=0, glu_bytes=80, tokens=14)
    chosen = plan(1e-9, StepFacts(tokens=14, checkpointed=False, cuda=False, estimate=estimate))
    assert chosen.tiled_mlp == TiledMlpOptions(7, True)


def test_the_measured_peak_line():
    assert planner.measured_peak_line(105, 100).endswith("within 10%")
    assert planner.measured_peak_line(150, 100).endswith("the estimate is off by +50%")


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
    assert (facts.tokens, facts.checkpointed, facts.cuda) == (14, True, False)
    [plain] = _facts_of(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(3, 5, 8))
    assert (plain.tokens, plain.checkpointed, plain.cuda, plain.device_budget) == (15, False, False, None)
    # the estimate by hand: weight and bias (72 floats), their gradients, and the linear's input, which its
    # backward reads for the weight's gradient (15 x 8 floats)
    assert plain.estimate == PeakEstimate(weights=288, gradients=288, activations=480, offload_frees=0,
                                          glu_bytes=0, tokens=15)


class GatedLayers(nn.Module):
    """Checkpointed layers with a SiLU-gated MLP: what offload and the tiled MLP's estimates count."""

    def __init__(self, width: int = 16, hidden: int = 40, layers: int = 3):
        super().__init__()
        self.gates = nn.ModuleList(nn.Linear(width, hidden, bias=False) for _ in range(layers))
        self.ups = nn.ModuleList(nn.Linear(width, hidden, bias=False) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(hidden, width, bias=False) for _ in range(layers))

    def layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x + self.downs[i](torch.nn.functional.silu(self.gates[i](x)) * self.ups[i](x))

    def forward(self, x):
        for i in range(len(self.gates)):
            x = torch.utils.checkpoint.checkpoint(self.layer, i, x, use_reentrant=False)
        return x.square().mean()


def test_the_estimate_counts_checkpointed_inputs_and_one_layer_recomputed():
    [facts] = _facts_of(GatedLayers(), torch.randn(2, 5, 16))
    estimate, floats = facts.estimate, 4
    assert estimate.weights == estimate.gradients == 3 * 3 * 16 * 40 * floats
    # each layer's input (10 x 16), the last one kept on the GPU; the layer's gate, silu, up and product (10 x 40)
    assert estimate.offload_frees == 2 * 10 * 16 * floats
    assert estimate.glu_bytes == 4 * 10 * 40 * floats
    # the three layers' inputs, and one layer recomputed: its input (read by gate and up), gate, up and the product
    # (read by down)
    assert estimate.activations == 3 * 10 * 16 * floats + (10 * 16 + 3 * 10 * 40) * floats


def test_the_leanest_plan_gives_the_same_loss_and_gradients():
    """The savers move and recompute tensors; none changes a value (offload copies, mid_layer saves what would be
    recomputed; the tiled MLP and moe_recompute find no site in this model). "auto" is "off" on the CPU (above)."""
    model = Checkpointed(layers=2)
    x = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(3))
    results = {}
    for memory in ("off", "min", 1e-6):
        torch._dynamo.reset()
        sloth.reset_report()
        results[memory] = _step(model, torch.compile(model, backend="sloth", options={"memory": memory,
                                                                                         "inner": "aot_eager"}), x)
        lines = sloth.report().plan
        assert lines and all(line.startswith(f"memory={memory!r}") for line in lines), lines
        if memory != "off":
            assert "offload (mid_layer)" in lines[0], lines
    assert "still over the budget" in sloth.report().plan[0], sloth.report().plan
    for memory in ("min", 1e-6):
        torch.testing.assert_close(results[memory][0], results["off"][0], rtol=0, atol=0)
        for got, want in zip(results[memory][1], results["off"][1]):
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


def test_the_measured_peak_joins_the_plan_lines_when_the_graph_runs_again(monkeypatch):
    # on a GPU the backend wraps the compiled graph so (compiler/backend.py _measuring_peak); faked on the CPU
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 2 * GiB)
    sloth.reset_report()
    graph_report = sloth.compiler.report.Report()
    run = backend._measuring_peak(lambda *args: sum(args), int(2.5 * GiB), graph_report)
    assert run(1, 2) == 3 and graph_report.plan == []
    assert run(3, 4) == 7
    want = ("measured peak 2.00 GiB when the graph ran a second time (the process's max_memory_allocated), "
            "estimated 2.50 GiB: the estimate is off by +25%")
    assert graph_report.plan == [want] and sloth.report().plan == [want]
    run(5, 6)
    assert graph_report.plan == [want]


def test_a_budget_counts_what_the_user_pinned_and_adds_none_of_it():
    # offload pinned off (given False, or switched off by disable): the budget does not count on it, nor add it
    chosen = plan(15, StepFacts(tokens=8192, checkpointed=True, cuda=False, estimate=ESTIMATE),
                  pinned={"offload": None})
    assert chosen.offload is None and chosen.tiled_mlp is not None and not chosen.moe_recompute, chosen.reason
    # offload pinned on by the user: counted, so the budget of 15 GiB is met without more
    chosen = plan(15, StepFacts(tokens=8192, checkpointed=True, cuda=False, estimate=ESTIMATE),
                  pinned={"offload": OffloadOptions()})
    assert (chosen.offload, chosen.tiled_mlp, chosen.moe_recompute) == (None, None, False), chosen.reason


def test_a_step_without_a_backward_gets_no_saver_under_a_budget():
    """Evaluation or generation: no gradients, nothing saved, so only the weights count and no saver applies."""
    layers = GatedLayers()
    with torch.no_grad():
        [facts] = _facts_of(layers, torch.randn(2, 5, 16))
    assert not facts.estimate.training and facts.estimate.gradients == 0 and facts.estimate.activations == 0
    chosen = plan(1e-9, facts)
    assert (chosen.offload, chosen.tiled_mlp, chosen.moe_recompute) == (None, None, False), chosen.reason


def test_numpy_numbers_are_budgets():
    np = pytest.importorskip("numpy")
    assert parse_options({"memory": np.int64(40)})[0].memory == 40.0


def test_a_budget_makes_the_logits_lazy_after_the_layer_savers():
    estimate = PeakEstimate(weights=10 * GiB, gradients=0, activations=6 * GiB, offload_frees=3 * GiB,
                            glu_bytes=2 * GiB, tokens=8192, logits=2 * GiB)
    facts = StepFacts(tokens=8192, checkpointed=True, cuda=False, estimate=estimate)
    # 18 GiB: offload 15, the tiled MLP 13.5, lazy logits 11.5
    assert plan(14, facts).return_logits is True and plan(14, facts).tiled_mlp is not None
    lean = plan(12, facts)
    assert lean.return_logits == "lazy" and not lean.moe_recompute, lean.reason
    line = lean.describe(lean.apply(parse_options({"memory": 12})[0]))
    assert "lazy logits" in line and "estimated peak 11.50 GiB" in line, line
    # the user's return_logits stands: False counts as the logits gone, True keeps them formed
    assert plan(12, facts, pinned={"return_logits": False}).moe_recompute is False
    assert plan(12, facts, pinned={"return_logits": True}).moe_recompute is True


def test_the_estimate_counts_the_returned_logits():
    model = nn.Linear(8, 32, bias=False)

    def loss_and_logits(x, y):
        logits = model(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, 32), y.view(-1)), logits

    [facts] = _facts_of(loss_and_logits, torch.randn(2, 5, 8), torch.randint(0, 32, (2, 5)))
    assert facts.estimate.logits == 2 * 5 * 32 * 4
