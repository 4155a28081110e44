"""What is alive on the GPU at a training step's peak, and who allocated it.

    with memory_peak.recording():        # torch.cuda.memory._record_memory_history, python stacks
        step()
    text = memory_peak.report(torch.cuda.memory._snapshot(), baseline)

The caching allocator's trace (one event per ``alloc`` and ``free_completed``, each with its size and the Python
frames that asked) is replayed from ``baseline`` (``torch.cuda.memory_allocated()`` when recording began: the
weights, optimizer state and whatever else the step finds allocated, which the trace does not list). The moment
the replayed total is highest is the step's peak, what ``max_memory_allocated`` reports; the blocks alive then are
grouped by the frame that allocated them (the innermost one outside torch's own machinery, with its source line:
for Inductor's generated code, the ``buf = empty_strided_cuda(...)`` line, which names the kernel's buffer) and
listed largest first. A block freed on another stream after use (``free_requested`` then ``free_completed``)
counts until it is completed, as the allocator counts it.

Used by ``benchmarks/e2e.py --memory-peak`` (issue 19: where the 16k step's 2.5 GiB above its weights go).
"""
from __future__ import annotations

import contextlib
import linecache
from collections import defaultdict
from typing import Any, Iterator, Optional

GiB = 1 << 30
MiB = 1 << 20
# Frames that say nothing about who wanted the memory: the allocator's and dispatch's own.
_MACHINERY = ("torch/cuda/memory.py", "torch/utils/_python_dispatch.py", "torch/_ops.py", "torch/_tensor.py",
              "torch/_library/", "torch/overrides.py", "contextlib.py", "torch/utils/_contextlib.py")


@contextlib.contextmanager
def recording(max_entries: int = 1_000_000) -> Iterator[None]:
    """Record the CUDA allocator's events with Python stacks for the body, then stop recording."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _site(frames: list[dict[str, Any]]) -> str:
    """``file:line function`` of the innermost frame outside the machinery, with its source line where the file
    can be read (also Inductor's generated modules, on the machine that ran them)."""
    for frame in frames:
        filename = frame.get("filename", "?")
        if any(part in filename for part in _MACHINERY):
            continue
        line = frame.get("line", 0)
        source = linecache.getline(filename, line).strip() if filename != "?" else ""
        short = "/".join(filename.split("/")[-2:])
        return f"{short}:{line} {frame.get('name', '?')}" + (f"  | {source[:90]}" if source else "")
    return "(no Python frame)"


def live_at_peak(events: list[dict[str, Any]]) -> tuple[int, dict[int, dict[str, Any]]]:
    """Replay ``events`` (one device's trace): (the highest total of live bytes above the starting point, the
    alloc events alive at that moment by address). Frees of blocks allocated before the trace lower the total
    too, so it can fall below zero."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: dict[int, dict[str, Any]] = {}
    for event in events:
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed":
            # a block from before the trace lowers the total too (the previous step's leftovers)
            live.pop(event["addr"], None)
            total -= event["size"]
    return peak, at_peak


def report(snapshot: dict[str, Any], baseline: int, device: int = 0, top: int = 30) -> str:
    """The peak (``baseline`` plus the trace's highest live total) and the blocks alive then, by allocating site
    and one by one, largest first."""
    traces = snapshot.get("device_traces", [])
    events = traces[device] if device < len(traces) else []
    peak, at_peak = live_at_peak(events)
    no_allocs = not any(e.get("action") == "alloc" for e in events)
    by_site: dict[str, list[int]] = defaultdict(list)
    for event in at_peak.values():
        by_site[_site(event.get("frames", []))].append(event["size"])
    lines = [f"allocated before the trace: {baseline / GiB:.3f} GiB; peak above it: {peak / GiB:.3f} GiB; "
             f"peak: {(baseline + peak) / GiB:.3f} GiB ({len(at_peak)} blocks alive then, {len(events)} events"
             + (", none an alloc: was the history recording?" if no_allocs else "") + ")", "",
             "by allocating site (MiB, blocks):"]
    for site, sizes in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {sum(sizes) / MiB:9.1f} MiB  {len(sizes):4d}  {site}")
    lines += ["", "largest blocks (MiB):"]
    for event in sorted(at_peak.values(), key=lambda e: -e["size"])[:top]:
        lines.append(f"  {event['size'] / MiB:9.1f}  {_site(event.get('frames', []))}")
    return "\n".join(lines) + "\n"


def measure(step: Any, path: Optional[Any] = None) -> str:
    """One call of ``step`` under recording (CUDA): its report, also written to ``path`` if given."""
    import torch

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    with recording():
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    text = report(snapshot, baseline, torch.cuda.current_device())
    if path is not None:
        path.write_text(text)
    return text
