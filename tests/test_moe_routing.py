"""lowering/moe_routing.py: the counting sort that dispatches the MoE experts' assignments, against the PyTorch ops it
replaces (a stable sort, searchsorted, an index-put), value for value."""
from __future__ import annotations

import pytest
import torch

import sloth.lowering.moe_routing as moe_routing
from sloth.lowering.moe_routing import route, route_reference
from op_checks import record_launches

KERNELS = ("_route_counts_kernel", "_route_scatter_kernel", "_invert_order_kernel")


@pytest.fixture(autouse=True)
def launches(monkeypatch):
    """The kernels ``route`` launches, as (name, grid, keywords) (the interpreter runs them here, as a GPU would)."""
    return record_launches(monkeypatch, moe_routing, *KERNELS)


def _check_equal(index: torch.Tensor, n_experts: int) -> moe_routing.Routing:
    got, want = route(index, n_experts), route_reference(index, n_experts)
    for name, g, w in zip(moe_routing.Routing._fields, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        assert torch.equal(g, w), (name, g, w)
    return got


@pytest.mark.parametrize("tokens, top_k, n_experts", [
    (1, 1, 1),  # one assignment
    (9, 2, 8),  # Mixtral's top-2 of 8, one block
    (300, 8, 128),  # Qwen3-MoE's 128 experts: 256 assignments a block, ten blocks (the last one partial)
    (257, 4, 33),  # experts not a power of two
    (70, 8, 256),  # DeepSeek-V3's 256 experts: 128 assignments a block
    (2100, 1, 5),  # top-1, blocks of 1024
])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_counting_sort_equals_the_stable_sort(tokens, top_k, n_experts, dtype, launches):
    g = torch.Generator().manual_seed(tokens)
    index = torch.randint(0, n_experts, (tokens, top_k), generator=g, dtype=dtype)
    routing = _check_equal(index, n_experts)
    # the kernels ran, not the fallback
    assert [name for name, _, _ in launches] == ["_route_counts_kernel", "_route_scatter_kernel"]
    assert routing.offs[-1] == tokens * top_k


def test_every_token_to_one_expert_and_empty_experts():
    index = torch.full((600, 2), 3, dtype=torch.int64)  # experts 0-2 and 4-7 get nothing
    routing = _check_equal(index, 8)
    assert routing.offs.tolist() == [0, 0, 0, 1200, 1200, 1200, 1200, 1200]
    assert torch.equal(routing.order, torch.arange(1200))  # stable: token order kept


def test_a_transposed_index_view():
    index = torch.randint(0, 16, (4, 300), generator=torch.Generator().manual_seed(2)).t()  # [300, 4], not contiguous
    _check_equal(index, 16)


def test_past_max_blocks_the_sort_runs(monkeypatch, launches):
    # Beyond MAX_BLOCKS the scatter kernel's sum over blocks grows too large: the PyTorch ops run instead, same values.
    monkeypatch.setattr(moe_routing, "MAX_BLOCKS", 2)
    calls = []
    monkeypatch.setattr(moe_routing, "route_reference", lambda *a: calls.append(1) or route_reference(*a))
    index = torch.randint(0, 128, (100, 8), generator=torch.Generator().manual_seed(3))  # 800 assignments: 4 blocks
    got = route(index, 128)
    assert calls and not launches and all(torch.equal(a, b) for a, b in zip(got, route_reference(index, 128)))


def test_ids_outside_the_experts_stay_a_permutation():
    # Undefined for the op (checking would need a host sync), but every output is still a permutation, and nothing is
    # written outside it: the bad ids come after every expert's rows, in index order.
    index = torch.tensor([[0, 5], [-1, 2], [9, 1]])
    routing = route(index, 4)
    assert sorted(routing.order.tolist()) == list(range(6))
    assert torch.equal(routing.inverse[routing.order], torch.arange(6))
    assert routing.offs.tolist() == [1, 2, 3, 3]
    assert routing.order.tolist() == [0, 5, 3, 1, 2, 4]


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match=r"top_k_index must be \[T, K\]"):
        route(torch.zeros(6, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="at least 1"):
        route(torch.zeros(3, 2, dtype=torch.int64), 0)


@pytest.mark.parametrize("tokens, top_k", [(1, 1), (300, 8), (1500, 3)])
def test_invert_order_gives_the_routes_inverse_and_tokens(tokens, top_k, launches):
    # The backward's one launch, from the saved order: what route gave the forward beside it.
    index = torch.randint(0, 16, (tokens, top_k), generator=torch.Generator().manual_seed(tokens))
    routing = route_reference(index, 16)
    inverse, token = moe_routing.invert_order(routing.order, top_k)
    assert [name for name, _, _ in launches] == ["_invert_order_kernel"]
    assert torch.equal(inverse, routing.inverse) and torch.equal(token, routing.token)
    with pytest.raises(ValueError, match="top_k must be at least 1"):
        moe_routing.invert_order(routing.order, 0)
