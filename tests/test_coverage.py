"""A fixed subset of benchmarks/coverage.py's sweep over transformers' causal LMs, in CI.

Architectures the model tests (tests/test_models.py) do not build, each for what it adds: afmoe, a MoE with
q/k norms and gated attention whose layout once broke a view after sloth's RoPE (compiler/canonicalize.py);
bloom, ALiBi attention and LayerNorm with no RoPE; biogpt, learned positions and a causal mask sloth drops.
Each must compile and step through sloth, meet the whole-model tolerance rule against eager and float64, and
leave no site unexplained (every anchor replaced or given a reason; the suite's conftest checks that too).
Three, to keep CI short: the whole sweep is `python -m benchmarks.coverage` (docs/coverage.md).
"""
from __future__ import annotations

import pytest

from benchmarks.coverage import run_one

SUBSET = ["afmoe", "bloom", "biogpt"]


@pytest.mark.parametrize("model_type", SUBSET)
def test_architecture_steps_through_sloth(model_type: str) -> None:
    row = run_one(model_type)
    assert row["status"] == "ok", row.get("traceback", row)
    assert row["parity"] == "pass", row["parity"]
    assert not any(f["unexplained"] for f in row["families"].values()), row["families"]
