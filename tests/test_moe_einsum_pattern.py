"""Expert GEMMs spelt by einsum on weights gathered per route, the routes a dim of their own (gpt-fast's Mixtral,
patterns/moe_einsum.py): fused into ``sloth.moe_experts``, output and every gradient within the tolerance rule of
eager's; a function the op does not compute stays, with the reason. gpt-fast's own model file runs in
tests/test_outside_models.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.pattern_checks import seeded
from tests.test_moe_pattern import _hand_written_through_sloth


class EinsumMoe(nn.Module):
    """gpt-fast's ``MOEFeedForward`` and ``ConditionalFeedForward`` at other sizes: a softmax router renormalised in
    place, the experts' stacked weights gathered per token and route (``w1[idx]`` [T, K, I, H]) and applied by
    einsum. ``gate_second``: the activation on the second einsum (w3's), which is then the gate; ``combine``: how
    gate and up meet (``"add"`` is no GLU)."""

    def __init__(self, hidden: int = 24, inter: int = 12, experts: int = 5, top_k: int = 2,
                 gate_second: bool = False, combine: str = "mul"):
        super().__init__()
        g = seeded(3)
        self.gate = nn.Parameter(torch.randn(experts, hidden, generator=g) / hidden ** 0.5)
        self.w1 = nn.Parameter(torch.randn(experts, inter, hidden, generator=g) / hidden ** 0.5)
        self.w3 = nn.Parameter(torch.randn(experts, inter, hidden, generator=g) / hidden ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5)
        self.top_k, self.gate_second, self.combine = top_k, gate_second, combine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = F.softmax(F.linear(x, self.gate), dim=-1)
        weights, idx = torch.topk(weights, self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        x1 = torch.einsum("ti,taoi->tao", x, self.w1[idx])
        x3 = torch.einsum("ti, taoi -> tao", x, self.w3[idx])
        x1, x3 = (x1, F.silu(x3)) if self.gate_second else (F.silu(x1), x3)
        h = x1 * x3 if self.combine == "mul" else x1 + x3
        y = torch.einsum("tao,taio->tai", h, self.w2[idx])
        return torch.einsum("tai,ta->ti", y, weights) + x


@pytest.mark.parametrize("tokens,top_k,gate_second", [(13, 2, False), (7, 1, False), (11, 3, True)],
                         ids=["T13-k2", "T7-k1", "T11-k3-gate-second"])
def test_einsum_experts_are_fused(tokens: int, top_k: int, gate_second: bool) -> None:
    module = EinsumMoe(top_k=top_k, gate_second=gate_second)
    (_, grads), report = _hand_written_through_sloth(module, torch.randn(tokens, 24, generator=seeded(4)))
    assert report.counts == {"moe_route": 1, "moe_router": 1}, str(report)
    [site] = [s for s in report.sites if s.family == "moe_route"]
    assert f"5 experts, top-{top_k}, silu, gate and up joined" in site.detail, site.detail
    assert all(grads[n].abs().sum() > 0 for n in ("w1", "w2", "w3"))
    assert (grads["gate"].abs().sum() > 0) == (top_k > 1)  # one weight renormalised is 1: no router gradient


def test_einsum_experts_of_another_function_stay_with_reason() -> None:
    # silu(x W1[e]) + x W3[e] is no GLU: the probes refuse it, and the graph stays as written
    module = EinsumMoe(combine="add")
    _, report = _hand_written_through_sloth(module, torch.randn(13, 24, generator=seeded(4)))
    assert report.counts.get("moe_route", 0) == 0, str(report)
    [reason] = [r.reason for r in report.rejections if r.family == "moe_route"]
    assert "on random probes it is not sum_k w * down(act(gate x) * up x)" in reason, reason
