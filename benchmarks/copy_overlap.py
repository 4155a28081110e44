"""How much of the host<->device copies in one profiled step the GPU hid behind compute, and the host syncs.

    overlap = copy_overlap(prof)   # prof: a torch.profiler.profile that recorded CUDA activity for one step

For each direction (DtoH: the forward's offloads; HtoD: the backward's reloads), the copies' total time and the
share of it during which some kernel ran at the same time (on another stream, since one stream runs one thing at
a time): 100% is a copy fully hidden, 0% one the GPU did nothing else during. ``offload_ops`` counts the host
calls of sloth's offload ops seen in the trace (their names, as the profiler shows them).
"""
from __future__ import annotations

import os
import traceback
import warnings
from typing import Any, Callable


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _covered(start: float, end: float, busy: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy if a < end and b > start)


def copy_overlap(prof: Any) -> dict[str, Any]:
    from torch.autograd import DeviceType

    events = prof.events()
    gpu = [e for e in events if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    is_copy = lambda e: "Memcpy" in e.name or "memcpy" in e.name  # noqa: E731
    busy = _merged([(e.time_range.start, e.time_range.end) for e in gpu if not is_copy(e) and "Memset" not in e.name])
    result: dict[str, Any] = {}
    for direction in ("DtoH", "HtoD"):
        copies = [e for e in gpu if is_copy(e) and direction in e.name]
        total = sum(e.time_range.end - e.time_range.start for e in copies)
        hidden = sum(_covered(e.time_range.start, e.time_range.end, busy) for e in copies)
        result[direction] = {"copies": len(copies), "ms": total / 1e3,
                             "hidden %": 100.0 * hidden / total if total else None,
                             "kinds": sorted({e.name for e in copies})[:4]}
    result["offload_ops"] = {name: sum(1 for e in events if e.device_type == DeviceType.CPU and e.name == name)
                             for name in ("sloth::offload", "sloth::offload_prefetch", "sloth::reload")}
    return result


def sync_sites(step: Callable[[], Any]) -> list[str]:
    """Where ``step`` made the host wait for the device, one entry each: the innermost frames of the Python stack
    at the wait outside torch's and the standard library's own code (``file:line < caller:line``; CUDA's sync
    debug mode warns on each synchronisation, and a warning's own location is often a line of torch.cuda)."""
    import torch

    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if not _library_frame(f.filename)]
        sites.append(" < ".join(f"{f.filename}:{f.lineno}" for f in reversed(frames[-3:])) or f"{filename}:{lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def _library_frame(filename: str) -> bool:
    """A frame of torch's own code (its compiled graphs' generated files are not), of the standard library's, or
    of this module's."""
    return (f"{os.sep}torch{os.sep}" in filename and "torchinductor" not in filename) or \
        filename.startswith(os.path.dirname(os.__file__)) or filename == __file__


def count_syncs(step: Callable[[], Any]) -> int:
    """Host-device synchronisations during one call of ``step``."""
    return len(sync_sites(step))
