"""Runtime twins (lowering/registration.py, compiler/late_passes.py): Inductor's compiled graphs call
``sloth_rt::*`` instead of the custom ops, with the same results; a user's own post-grad pass still runs."""
from __future__ import annotations

import uuid

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

from pattern_checks import seeded
from sloth.compiler.late_passes import swap_to_runtime_twins
from sloth.lowering import registration


class NormLoRA(nn.Module):
    """An RMSNorm and a LoRA linear, hand-written: two families, each op with a forward and a backward."""

    def __init__(self) -> None:
        super().__init__()
        g = seeded(0)
        self.w_norm = nn.Parameter(torch.randn(24, generator=g))
        self.register_buffer("w", torch.randn(20, 24, generator=g))
        self.a = nn.Parameter(torch.randn(4, 24, generator=g) * 0.2)
        self.b = nn.Parameter(torch.randn(20, 4, generator=g) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w_norm
        return F.linear(h, self.w) + 0.5 * (h @ self.a.t()) @ self.b.t()


def _sloth_calls(codes: list[str]) -> list[str]:
    """The lines of Inductor's generated code that call a sloth op (custom op or twin)."""
    return [line for code in codes for line in code.splitlines() if "torch.ops.sloth" in line and ".default(" in line]


def _only_twins(calls: list[str]) -> bool:
    return bool(calls) and all("torch.ops.sloth_rt." in line for line in calls)


def _step(model: nn.Module, x: torch.Tensor, options: dict) -> tuple[list[torch.Tensor], list[str]]:
    """[loss, dx, every parameter gradient] and the generated code's calls of sloth ops."""
    compiled = torch.compile(model, backend="sloth", options=options)
    x = x.detach().requires_grad_(True)
    model.zero_grad()

    def run() -> torch.Tensor:
        loss = compiled(x).square().mean()
        loss.backward()
        return loss.detach()

    loss, codes = run_and_get_code(run)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return [loss, *grads], _sloth_calls(codes)


def test_inductor_calls_the_twins_with_the_custom_ops_results() -> None:
    model, x = NormLoRA(), torch.randn(3, 5, 24, generator=seeded(1))
    with_ops, _ = _step(model, x, {"inner": "aot_eager"})  # the custom ops themselves
    torch._dynamo.reset()
    with_twins, calls = _step(model, x, {})
    assert _only_twins(calls), calls
    for name in ("rms_norm", "rms_norm_backward", "lora_linear", "lora_linear_backward"):
        assert any(f"sloth_rt.{name}.default(" in line for line in calls), (name, calls)
    for got, want in zip(with_twins, with_ops, strict=True):  # Inductor's glue may round its sums otherwise
        torch.testing.assert_close(got, want)


class _CountingPass(CustomGraphPass):
    """A user's post-grad pass: counts the graphs it sees and records any ``sloth::`` node still in them (the
    swap must have run first)."""

    def __init__(self) -> None:
        self.graphs = 0
        self.unswapped: list[str] = []
        self.key = uuid.uuid4().hex  # a new key each run: Inductor's cache would skip a pass it has seen

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1
        self.unswapped += [str(n.target) for n in graph.nodes
                           if n.op == "call_function" and str(n.target).startswith("sloth.")]

    def uuid(self) -> str:
        return self.key


def test_a_users_post_grad_pass_runs_after_the_swap() -> None:
    theirs = _CountingPass()
    _, calls = _step(NormLoRA(), torch.randn(2, 24, generator=seeded(2)), {"post_grad_custom_post_pass": theirs})
    assert theirs.graphs == 2 and not theirs.unswapped, (theirs.graphs, theirs.unswapped)  # forward, backward
    assert _only_twins(calls), calls


def test_a_list_of_user_passes_runs_where_inductor_takes_lists() -> None:
    from torch._inductor import custom_graph_pass

    if not hasattr(custom_graph_pass, "get_custom_graph_passes"):
        pytest.skip("this torch takes one post-grad pass, not a list")
    first, second = _CountingPass(), _CountingPass()
    _, calls = _step(NormLoRA(), torch.randn(2, 24, generator=seeded(3)),
                     {"post_grad_custom_post_pass": [first, second]})
    assert first.graphs == second.graphs == 2 and not first.unswapped and not second.unswapped
    assert _only_twins(calls), calls


def test_inference_graphs_call_the_twins_too() -> None:
    model, x = NormLoRA(), torch.randn(2, 5, 24, generator=seeded(4))
    want = model(x)
    with torch.no_grad():
        got, codes = run_and_get_code(torch.compile(model, backend="sloth"), x)
    calls = _sloth_calls(codes)
    assert _only_twins(calls), calls
    torch.testing.assert_close(got, want.detach())


def test_switched_off_the_custom_ops_stay() -> None:
    _, calls = _step(NormLoRA(), torch.randn(2, 24, generator=seeded(5)), {"disable": ["runtime_twins"]})
    assert calls and not any("sloth_rt" in line for line in calls), calls


def test_every_twin_has_its_ops_schema_tags_kernel_and_no_autograd() -> None:
    from sloth.lowering import glu, glu_lora, linear_cross_entropy, lora, lora_shared, qlora, rms_norm, rope

    for module in (glu, linear_cross_entropy, lora, lora_shared, qlora, rms_norm, rope):
        module.register()
    glu_lora.register()
    glu_lora.register_4bit()
    names = {op.name() for op in registration.RUNTIME_TWINS}
    assert {"sloth::linear_cross_entropy", "sloth::lora_linear_shared_backward", "sloth::rope"} <= names
    assert len(names) >= 22
    for op, twin in registration.RUNTIME_TWINS.items():
        assert str(twin._schema) == str(op._schema).replace("sloth::", "sloth_rt::", 1), (op, twin)
        assert set(twin.tags) == set(op.tags), (op, twin.tags)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(twin.name(), "CompositeExplicitAutograd"), twin
        assert torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(twin.name(), "Autograd"), twin


def test_swap_leaves_other_nodes_alone() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.relu.default, (x,))
    graph.output(y)
    assert swap_to_runtime_twins(graph) == 0
    assert y.target is torch.ops.aten.relu.default


@pytest.mark.parametrize("inner, disabled, expected", [
    ("aot_eager", (), dict.fromkeys(("runtime_twins", "lean_backward", "attention_chunks"),
                                    "inner='aot_eager': an Inductor post-grad pass")),
    ("inductor", ("runtime_twins",), {"runtime_twins": "switched off by the disable option"}),
    ("inductor", ("lean_backward", "rms_norm"), {"lean_backward": "switched off by the disable option"}),
    ("aot_eager", ("attention_chunks",), {**dict.fromkeys(("runtime_twins", "lean_backward"),
                                                          "inner='aot_eager': an Inductor post-grad pass"),
                                          "attention_chunks": "switched off by the disable option"}),
    ("inductor", ("offload",), {}),
    ("inductor", (), {}),
])
def test_passes_off_name_each_switch(inner, disabled, expected):
    # A partition / post-grad pass that will not run (switched off by name, or an inner compiler that runs none) is
    # named with the reason (issue 55: they vanished without a word); one off by default (offload) is not listed.
    from sloth.compiler.late_passes import passes_off

    assert passes_off(inner, disabled) == expected


def test_the_report_names_the_post_grad_passes_that_did_not_run():
    import sloth

    sloth.reset_report()
    torch._dynamo.reset()
    torch.compile(NormLoRA(), backend="sloth", options={"inner": "aot_eager"})(torch.randn(3, 24))
    assert ("partition / post-grad passes off: runtime_twins, lean_backward, attention_chunks (inner='aot_eager': an "
            "Inductor post-grad pass)") in str(sloth.report()), str(sloth.report())


def test_each_post_grad_pass_is_timed_and_one_switched_off_is_named_and_skipped():
    import sloth

    sloth.reset_report()
    torch._dynamo.reset()
    # Inductor's FX graph cache off: on a hit no post-grad pass runs, so none would be timed.
    model, x = NormLoRA(), torch.randn(3, 24, generator=seeded(6), requires_grad=True)
    run = torch.compile(model, backend="sloth", options={"disable": ["attention_chunks"], "fx_graph_cache": False})
    run(x).sum().backward()
    report = sloth.report()
    assert "attention_chunks (switched off by the disable option)" in str(report), str(report)
    assert {"runtime_twins", "lean_backward"} <= set(report.pass_seconds), report.pass_seconds
    assert "attention_chunks" not in report.pass_seconds, report.pass_seconds


def test_a_family_switched_off_by_name_does_not_run():
    import sloth

    sloth.reset_report()
    torch._dynamo.reset()
    torch.compile(NormLoRA(), backend="sloth", options={"inner": "aot_eager", "disable": ["rms_norm"]})(
        torch.randn(3, 24))
    report = sloth.report()
    assert "rms_norm" in report.disabled and not report.counts.get("rms_norm"), str(report)
    assert report.counts.get("lora"), str(report)


def test_the_cache_key_changes_with_an_ops_source(monkeypatch, tmp_path) -> None:
    # AOTAutograd's and Inductor's caches key a graph by its code and Inductor's config, where the post-grad pass's
    # uuid is: a graph names sloth::op, so a change of the op (its schema, kernel or backward) must change the uuid.
    import sloth.compiler.late_passes as late_passes
    from torch._inductor.custom_graph_pass import get_hash_for_files

    sources = late_passes.op_sources()
    assert any(path.endswith("lowering/token_logprobs.py") for path in sources)
    assert any("/runtime/" in path for path in sources)
    edited = tmp_path / "op.py"
    edited.write_text("# an op\n")
    monkeypatch.setattr(late_passes, "op_sources", lambda: sources | {str(edited)})
    before = late_passes.PostGradPasses().uuid()
    edited.write_text("# the op, changed\n")
    get_hash_for_files.cache_clear()
    assert late_passes.PostGradPasses().uuid() != before
