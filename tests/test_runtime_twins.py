"""Runtime twins (lowering/registration.py, compiler/runtime_ops.py): Inductor's compiled graphs call
``sloth_rt::*`` instead of the custom ops, with the same results; a user's own post-grad pass still runs."""
from __future__ import annotations

import uuid

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

from pattern_checks import seeded
from sloth.compiler.runtime_ops import swap_to_runtime_twins
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


def _step(model: nn.Module, x: torch.Tensor, options: dict) -> tuple[list[torch.Tensor], list[str]]:
    """[loss, dx, every parameter gradient] and the generated code's lines that name a sloth op."""
    compiled = torch.compile(model, backend="sloth", options=options)
    x = x.detach().requires_grad_(True)
    model.zero_grad()

    def run() -> torch.Tensor:
        loss = compiled(x).square().mean()
        loss.backward()
        return loss.detach()

    loss, codes = run_and_get_code(run)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return [loss, *grads], [line for code in codes for line in code.splitlines() if "torch.ops.sloth" in line]


def test_inductor_calls_the_twins_with_the_custom_ops_results() -> None:
    model, x = NormLoRA(), torch.randn(3, 5, 24, generator=seeded(1))
    with_ops, _ = _step(model, x, {"inner": "aot_eager"})  # the custom ops themselves
    torch._dynamo.reset()
    with_twins, lines = _step(model, x, {})
    calls = [line for line in lines if ".default(" in line]
    assert calls and all("torch.ops.sloth_rt." in line for line in calls), calls
    for name in ("rms_norm", "rms_norm_backward", "lora_linear", "lora_linear_backward"):
        assert any(f"sloth_rt.{name}.default(" in line for line in calls), (name, calls)
    for got, want in zip(with_twins, with_ops, strict=True):  # Inductor's glue may round its sums otherwise
        torch.testing.assert_close(got, want)


class _CountingPass(CustomGraphPass):
    def __init__(self) -> None:
        self.graphs = 0
        self.key = uuid.uuid4().hex  # a new key each run: Inductor's cache would skip a pass it has seen

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1

    def uuid(self) -> str:
        return self.key


def test_a_users_post_grad_pass_runs_after_the_swap() -> None:
    theirs = _CountingPass()
    _, lines = _step(NormLoRA(), torch.randn(2, 24, generator=seeded(2)), {"post_grad_custom_post_pass": theirs})
    assert theirs.graphs == 2  # the forward and the backward graph
    assert lines and all("torch.ops.sloth." not in line for line in lines if ".default(" in line), lines


def test_every_twin_has_its_ops_schema() -> None:
    from sloth.lowering import glu, glu_lora, lora, lora_shared, qlora, rms_norm, rope

    for module in (glu, lora, lora_shared, qlora, rms_norm, rope):
        module.register()
    glu_lora.register()
    glu_lora.register_4bit()
    assert len(registration.RUNTIME_TWINS) >= 20
    for op, twin in registration.RUNTIME_TWINS.items():
        assert str(twin._schema) == str(op._schema).replace("sloth::", "sloth_rt::", 1), (op, twin)
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(twin.name(), "CompositeImplicitAutograd")


def test_swap_leaves_other_nodes_alone() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.relu.default, (x,))
    graph.output(y)
    assert swap_to_runtime_twins(graph) == 0
    assert y.target is torch.ops.aten.relu.default
