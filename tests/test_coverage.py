"""A fixed subset of benchmarks/coverage.py's sweep over transformers' causal LMs, in CI: 22 architectures.

Each for what it adds beside the model tests (tests/test_models.py): afmoe, a MoE with q/k norms and gated
attention whose layout once broke a view after sloth's RoPE (compiler/canonicalize.py); bloom, ALiBi attention
and LayerNorm with no RoPE; biogpt, learned positions and a causal mask sloth drops; mistral, Llama's sibling;
cohere, a LayerNorm model whose interleaved RoPE is reported; gpt_neox, phi, stablelm, starcoder2, falcon, partial
rotary with LayerNorm (and parallel attention); olmo2, its norm after the projections; granite, logit scaling;
gemma2, logit softcap and `1 + w` norms; bitnet, extra norms and a relu^2 MLP (no family for it yet); lfm2,
convolutions beside attention; mamba, no attention at all; opt, learned positions and ReLU; llama4_text, complex
RoPE; qwen3_moe, deepseek_v3 (MLA, sigmoid routing, shared experts), gpt_oss (clamped GLU, biases:
reported) and qwen3_next (L2 norms, gated delta net) for the MoE and norm families. Each must compile and step
through sloth, meet the whole-model tolerance rule against eager and float64, and leave no site unexplained
(every anchor replaced or given a reason; the suite's conftest checks that too). The whole sweep is
`python -m benchmarks.coverage` (docs/coverage.md).
"""
from __future__ import annotations

import pytest

from benchmarks.coverage import run_one

SUBSET = ["afmoe", "bloom", "biogpt", "mistral", "cohere", "gpt_neox", "phi", "stablelm", "starcoder2", "falcon",
          "olmo2", "granite", "gemma2", "bitnet", "lfm2", "mamba", "opt", "llama4_text", "qwen3_moe", "deepseek_v3",
          "gpt_oss", "qwen3_next"]


@pytest.mark.parametrize("model_type", SUBSET)
def test_architecture_steps_through_sloth(model_type: str) -> None:
    row = run_one(model_type)
    assert row["status"] == "ok", row.get("traceback", row)
    assert row["parity"] == "pass", row["parity"]
    assert not any(f["unexplained"] for f in row["families"].values()), row["families"]
