"""Convergence, the CI-sized run of ``benchmarks/convergence.py``: a small Llama trained on the standard library's
bytes for eight steps, eagerly and through sloth with every family, from the same seed and batches.

Measured (CPU, torch 2.13, kernels in the Triton interpreter, 2026-12-01): over 40 steps of batch 8 x 64 the
smoothed curves of the two runs differ by at most 4e-8 relative, the final losses by 3e-8 (5.61 -> 3.02), so the
bound here, 1e-4, leaves rounding three orders of magnitude while a wrong gradient (a 1% error in one op's
backward) moves the loss far more than that within a few AdamW steps. The longer run, its plot and its record:
``python -m benchmarks.convergence``.
"""
from __future__ import annotations

from benchmarks.convergence import run_both

FAMILIES = ("rms_norm", "rope", "glu", "cross_entropy")


def test_loss_curve_matches_eager_over_a_run() -> None:
    eager, ours, summary, report, _ = run_both(8, batch=2, seq=24, window=3, options={"inner": "aot_eager"})
    assert all(report.counts.get(f) for f in FAMILIES), str(report)  # every family in the loop
    assert len(eager) == len(ours) == 8
    assert summary["eager final"] < summary["first loss"] - 0.5, summary  # it learns (5.6 at the start)
    assert summary["max smoothed gap"] <= 1e-4 and summary["final gap"] <= 1e-4, summary
