"""benchmarks/memory_peak.py: the replay of an allocator trace finds the peak and what is alive then (a synthetic
trace in the format of ``torch.cuda.memory._snapshot()``; recording itself needs CUDA)."""
from __future__ import annotations

from benchmarks import memory_peak

MiB = 1 << 20


def _alloc(addr: int, mib: int, name: str, line: int = 1) -> dict:
    return {"action": "alloc", "addr": addr, "size": mib * MiB,
            "frames": [{"filename": "/site-packages/torch/cuda/memory.py", "line": 3, "name": "inner"},
                       {"filename": f"/work/model/{name}.py", "line": line, "name": name}]}


def _free(addr: int, mib: int, action: str = "free_completed") -> dict:
    return {"action": action, "addr": addr, "size": mib * MiB}


def test_the_peak_is_the_highest_live_total_and_lists_the_blocks_alive_then() -> None:
    events = [_alloc(1, 100, "attention"), _alloc(2, 50, "mlp"), _free(2, 50, "free_requested"), _free(2, 50),
              _alloc(3, 200, "mlp", 7), _alloc(4, 10, "norm"), _free(3, 200), _alloc(5, 150, "loss")]
    peak, live = memory_peak.live_at_peak(events)
    # 100 + 200 + 10 = 310 MiB, above the end's 100 + 10 + 150 = 260: a block freed only when completed
    assert peak == 310 * MiB and set(live) == {1, 3, 4}


def test_frees_of_blocks_from_before_the_trace_lower_the_total() -> None:
    # the previous step's 300 MiB go before this step allocates 250: its peak above the start is 0, not 250
    events = [_free(9, 300), _alloc(1, 250, "mlp")]
    peak, live = memory_peak.live_at_peak(events)
    assert peak == 0 and live == {}
    assert memory_peak.live_at_peak([_alloc(1, 5, "a"), _free(9, 300), _alloc(2, 250, "b")])[0] == 5 * MiB


def test_the_report_groups_by_the_first_frame_outside_torchs_machinery() -> None:
    events = [_alloc(1, 100, "attention"), _alloc(2, 30, "attention"), _alloc(3, 64, "mlp")]
    text = memory_peak.report({"device_traces": [events]}, baseline=1 << 30)
    first, rest = text.splitlines()[0], text
    assert "allocated before the trace: 1.000 GiB" in first and "peak: 1.189 GiB" in first, first
    sites = [line for line in rest.splitlines() if "MiB" in line and "attention.py" in line]
    assert sites and "130.0 MiB" in sites[0] and "memory.py" not in rest, rest
    assert rest.index("attention.py") < rest.index("mlp.py")


def test_a_trace_without_allocations_says_so() -> None:
    assert "was the history recording?" in memory_peak.report({"device_traces": [[]]}, baseline=0)
