"""MoE experts the model writes itself (``moe_route``): a list of expert modules (patterns/moe_expert_list.py), gate
and up in two stacked weights over tokens the model permutes (torchtitan, patterns/moe_split.py), and the loops over
experts, which stay with the reason (a zero-row slice among them). Output, x's, the router's and every expert
weight's gradient against the float64 module by the tolerance rule."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sloth
from tests.pattern_checks import seeded
from tests.test_moe_pattern import _adapters_through_sloth, _stays_with_reason


class ExpertMlp(nn.Module):
    """One expert: SwiGLU (``w1`` gate, ``w3`` up, ``w2`` down: Mixtral's reference names), or, ``gated=False``, a
    GELU MLP (``fc1``, ``fc2``: nanoGPT-style MoE forks)."""

    def __init__(self, hidden: int, inter: int, gated: bool, bias: bool = False):
        super().__init__()
        self.gated = gated
        if gated:
            self.w1, self.w3 = nn.Linear(hidden, inter, bias=bias), nn.Linear(hidden, inter, bias=bias)
            self.w2 = nn.Linear(inter, hidden, bias=bias)
        else:
            self.fc1, self.fc2 = nn.Linear(hidden, inter, bias=bias), nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class ExpertListMoe(nn.Module):
    """An ``nn.ModuleList`` of experts behind a top-k router (softmax over the k, Mixtral's). ``combine``:
    ``"sum"``, every expert on every token weighted by ``zeros(T, E).scatter(1, idx, w)[:, e:e+1]`` and summed;
    ``"stack"``, the same with the experts' outputs stacked [T, E, H]; ``"loop"``, Mixtral's reference loop over the
    experts on the tokens routed to each (``torch.where(idx == e)``)."""

    def __init__(self, hidden: int = 24, inter: int = 16, experts: int = 5, top_k: int = 2, combine: str = "sum",
                 gated: bool = True, bias: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(ExpertMlp(hidden, inter, gated, bias) for _ in range(experts))
        self.top_k, self.combine = top_k, combine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        w, idx = torch.topk(logits, self.top_k, dim=-1)
        w = F.softmax(w, dim=-1, dtype=torch.float).to(x.dtype)
        if self.combine == "loop":
            y = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                rows, k = torch.where(idx == e)
                y[rows] += w[rows, k, None] * expert(x[rows])
            return y
        weights = torch.zeros_like(logits).scatter(1, idx, w)
        if self.combine == "stack":
            return (weights.unsqueeze(-1) * torch.stack([expert(x) for expert in self.experts], dim=1)).sum(1)
        out = 0
        for e, expert in enumerate(self.experts):
            out = out + weights[:, e:e + 1] * expert(x)
        return out


def _every_expert_trains(grads: dict, experts: int) -> None:
    expert_grads = [n for n in grads if n.startswith("experts.")]
    assert len({n.split(".")[1] for n in expert_grads}) == experts, expert_grads
    assert all(grads[n].abs().max() > 0 for n in expert_grads) and grads["gate.weight"].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("combine, gated", [("sum", True), ("stack", True), ("sum", False)],
                         ids=["sum-swiglu", "stack-swiglu", "sum-gelu-ungated"])
def test_dense_expert_list_is_fused(combine, gated, dtype) -> None:
    # Every expert on every token, weighted by the scattered top-k: one site, K experts a token instead of E; the
    # router's gradient (through the scatter) and every expert's equal the dense form's.
    module = ExpertListMoe(combine=combine, gated=gated)
    ours, eager, report = _adapters_through_sloth(module, torch.randn(13, 24, generator=seeded(61)), dtype)
    assert report.counts.get("moe_route") == 1, str(report)
    assert not [r for r in report.rejections if r.family == "moe_route"], str(report)
    detail = next(s.detail for s in report.sites if s.family == "moe_route")
    kind, act = ("gate, up and down", "silu") if gated else ("ungated up and down", "gelu_tanh")
    assert detail == (f"5 experts, top-2, {act}, a list of expert modules ({kind} linears, stacked each step), "
                      f"{str(dtype).replace('torch.', '')}"), detail
    _every_expert_trains(ours[1], 5)


def test_biased_expert_list_stays_with_reason() -> None:
    reason = _stays_with_reason(ExpertListMoe(bias=True), torch.randn(13, 24, generator=seeded(62)))
    assert "the experts also read the graph input" in reason and "bias" in reason, reason


def test_expert_loop_is_skipped_by_dynamo_and_leaves_no_site() -> None:
    # Mixtral's reference loop: torch.where is nonzero (a data-dependent shape), a graph break inside the loop, so
    # Dynamo runs the block eagerly and compiles each expert's MLP alone: a dense MLP, no router, no moe site.
    module, x = ExpertListMoe(combine="loop"), torch.randn(13, 24, generator=seeded(63))
    sloth.reset_report()
    torch.testing.assert_close(torch.compile(module, backend="sloth", options={"inner": "aot_eager"})(x), module(x))
    report = sloth.report()
    assert not report.counts.get("moe_route") and not report.counts.get("moe_router"), str(report)
    assert not [r for r in report.rejections if r.family == "moe_route"], str(report)
    assert report.counts.get("glu") == report.graphs, str(report)  # each graph one expert's SwiGLU alone


def test_captured_expert_loop_stays_with_reason() -> None:
    # With capture_dynamic_output_shape_ops the loop is one graph (unbacked row counts, index writes into y).
    import torch._dynamo

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        reason = _stays_with_reason(ExpertListMoe(combine="loop"), torch.randn(13, 24, generator=seeded(64)))
    assert reason.startswith("a loop over experts on the tokens routed to each (torch.where / nonzero"), reason


class GroupedExpertsMoe(nn.Module):
    """torchtitan's MoE (``GroupedExperts`` + ``TokenReorderer``): gate ``w1`` and up ``w3`` apart [E, I, H], ``w2``
    [E, H, I], sigmoid scores, tokens sorted by expert (argsort, histc counts, cumsum offsets), gathered with
    ``torch.gather``, three ``torch._grouped_mm`` (bf16, its only dtype under compile; else ``einsum`` on each row's
    gathered weights, the float64 reference too), scores after the experts in fp32 (``score_before_experts``: on
    the experts' input rows), ``scatter_add`` back."""

    def __init__(self, hidden: int = 32, inter: int = 16, experts: int = 4, top_k: int = 2,
                 score_before: bool = False):
        super().__init__()
        g = seeded(65)
        self.router = nn.Parameter(torch.randn(experts, hidden, generator=g) / hidden ** 0.5)
        self.w1 = nn.Parameter(torch.randn(experts, inter, hidden, generator=g) / hidden ** 0.5)
        self.w3 = nn.Parameter(torch.randn(experts, inter, hidden, generator=g) / hidden ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5)
        self.experts, self.top_k, self.score_before = experts, top_k, score_before

    @staticmethod
    def _gemm(rows: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if rows.dtype == torch.bfloat16:
            return torch._grouped_mm(rows, w.transpose(-2, -1), offs=offs)
        return torch.einsum("sk,snk->sn", rows, w[ids])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(F.linear(x, self.router).float())
        top, chosen = torch.topk(scores, self.top_k, dim=1)
        counts = torch.histc(chosen.view(-1).float(), bins=self.experts, min=0, max=self.experts)
        order = torch.argsort(chosen.view(-1), stable=True)
        ids, top_sorted = chosen.view(-1)[order], top.view(-1)[order]
        token = (order // self.top_k).reshape(-1, 1).expand(-1, x.shape[1])
        rows = torch.gather(x, 0, token)
        if self.score_before:
            rows = (rows.float() * top_sorted.reshape(-1, 1)).to(x.dtype)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = F.silu(self._gemm(rows, self.w1, offs, ids)) * self._gemm(rows, self.w3, offs, ids)
        out = self._gemm(h, self.w2, offs, ids)
        if not self.score_before:
            out = (out.float() * top_sorted.reshape(-1, 1)).to(x.dtype)
        return torch.zeros_like(x).scatter_add(0, token, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-einsum", "bf16-grouped_mm"])
def test_gate_and_up_apart_are_fused(dtype) -> None:
    # Before: the gate/down pair refused for reading w3, and the up GEMM for graph breaks this graph does not have.
    module = GroupedExpertsMoe()
    ours, eager, report = _adapters_through_sloth(module, torch.randn(13, 32, generator=seeded(66)), dtype)
    assert report.counts.get("moe_route") == 1, str(report)
    assert not [r for r in report.rejections if r.family == "moe_route"], str(report)
    detail = next(s.detail for s in report.sites if s.family == "moe_route")
    assert detail == ("4 experts, top-2, silu, gate and up joined from two stacked weights each step, "
                      f"{str(dtype).replace('torch.', '')}"), detail
    assert {"x", "router", "w1", "w2", "w3"} == set(ours[1])


def test_scores_before_the_experts_stay_with_reason() -> None:
    module = GroupedExpertsMoe(score_before=True)
    reason = _stays_with_reason(module, torch.randn(13, 32, generator=seeded(67)))
    assert reason.startswith("the router weights scale the experts' input rows"), reason


class ExpertLoopMoe(GroupedExpertsMoe):
    """torchtitan's ``_run_experts_for_loop``: the counts read on the host (``.tolist()``, a graph break), each
    expert's GEMMs on its slice of the sorted rows (``w1[e]``), and ``vstack`` of a zero-row padding tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = F.linear(x, self.router).softmax(-1)
        top, chosen = torch.topk(scores, self.top_k, dim=1)
        counts = torch.histc(chosen.view(-1).float(), bins=self.experts, min=0, max=self.experts).long().tolist()
        order = torch.argsort(chosen.view(-1), stable=True)
        token, rows = order // self.top_k, x[order // self.top_k]
        outs = []
        for e, rows_e in enumerate(torch.split(rows[:sum(counts)], counts, dim=0)):
            h = F.silu(rows_e @ self.w1[e].transpose(-2, -1)) * (rows_e @ self.w3[e].transpose(-2, -1))
            outs.append(h @ self.w2[e].transpose(-2, -1))
        padding = outs[0].new_zeros((rows.shape[0] - sum(counts), x.shape[1]))  # zero rows here
        out = torch.vstack((torch.cat(outs), padding)) * top.view(-1)[order, None]
        return torch.zeros_like(x).index_add(0, token, out)


def test_expert_loop_with_a_zero_row_tensor_compiles_with_reason() -> None:
    # Was: ZeroDivisionError in the pass (rows % 0 on the [0, H] padding). Now each expert's pair is reported as
    # one step of a loop over experts, and the output is eager's.
    module, x = ExpertLoopMoe(), torch.randn(13, 32, generator=seeded(68))
    sloth.reset_report()
    compiled = torch.compile(module, backend="sloth", options={"inner": "aot_eager", "patterns": ["moe_route"]})
    torch.testing.assert_close(compiled(x), module(x))
    report = sloth.report()
    reasons = [r.reason for r in report.rejections if r.family == "moe_route"]
    assert not report.counts.get("moe_route") and not report.unexplained.get("moe_route"), str(report)
    assert len(reasons) == 4 and all(r.startswith(f"a loop over experts: expert {e}'s GEMMs alone")
                                     for e, r in enumerate(reasons)), reasons
