"""benchmarks/copy_overlap.py's ``sync_sites``: where a step's host syncs are, by the frames outside torch's own
code (CUDA's sync debug mode itself needs a GPU: here a warning of its wording stands for it)."""
from __future__ import annotations

import warnings

import torch

from benchmarks import copy_overlap


def _waits_for_the_device() -> None:
    # as torch.cuda.synchronize would: the warning's own location is a torch line, the caller is this function
    warnings.warn("called a synchronizing CUDA operation", UserWarning)


def _step() -> None:
    _waits_for_the_device()
    warnings.warn("an unrelated warning")  # not a sync: not listed


def test_each_sync_is_listed_by_its_callers_outside_torch(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    (site,) = copy_overlap.sync_sites(_step)
    innermost, caller = site.split(" < ")[:2]
    assert innermost.startswith(f"{__file__}:") and caller.startswith(f"{__file__}:")
    assert int(innermost.rsplit(":", 1)[1]) == _waits_for_the_device.__code__.co_firstlineno + 2
    assert copy_overlap.count_syncs(_step) == 1
