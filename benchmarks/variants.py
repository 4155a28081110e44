"""Measurement variants: sloth with one choice made another way, set from benchmarks and never from product code.

    python -m benchmarks.e2e --all --variants sloth --sloth-variant moe_route_sort

Each variant sets module constants that sloth reads when a graph is compiled or an op runs (not at import), so
it applies to everything compiled after ``apply`` in that process. The product's choices stay plain constants
beside the measurement that chose them; the variants below are the other forms those measurements compared. A pass
that can be switched off by name needs no variant here: ``--sloth-options '{"disable": ["lean_backward"]}'``.
"""
from __future__ import annotations

import importlib
from typing import Callable, Sequence


def _set(module: str, name: str, value: object) -> Callable[[], None]:
    def apply() -> None:
        target = importlib.import_module(module)
        if not hasattr(target, name):
            raise AttributeError(f"benchmarks/variants.py: {module}.{name} no longer exists; drop the variant")
        setattr(target, name, value)
    return apply


def _recompute_norm_rope() -> None:
    from sloth.compiler import recompute

    recompute.RECOMPUTED_OPS = (*recompute.RECOMPUTED_OPS, "norm_rope")


VARIANTS: dict[str, tuple[Callable[[], None], str]] = {
    "moe_route_sort": (_set("sloth.lowering.moe_routing", "ROUTE_CHOICE", "sort"),
                       "MoE dispatch by PyTorch's sort instead of the counting-sort kernels"),
    "moe_gemm_triton": (_set("sloth.lowering.moe", "GEMM_CHOICE", "triton"),
                        "every expert GEMM in sloth's Triton grouped GEMM"),
    "moe_gemm_grouped_mm": (_set("sloth.lowering.moe", "GEMM_CHOICE", "grouped_mm"),
                            "every expert GEMM by torch._grouped_mm"),
    "moe_gemm_mixed": (_set("sloth.lowering.moe", "GEMM_CHOICE", "mixed"),
                       "torch._grouped_mm wherever it runs on a GPU"),
    "lora_down_tf32x3": (_set("sloth.lowering.lora", "DOWN_SPLIT_LAUNCH", False),
                         "LoRA down products in tf32x3 instead of the factor split launch"),
    "glu_lora_recompute_hidden": (_set("sloth.lowering.glu_lora", "FUSED_HIDDEN", False),
                                  "the LoRA MLP's backward recomputes the GLU output in a pass of its own"),
    "norm_rope_apart": (_set("sloth.patterns.norm_rope", "JOIN", False),
                        "q/k norms and RoPE left as two ops"),
    "norm_rope_recompute": (_recompute_norm_rope, "the rotated q/k recomputed in the backward"),
}


def apply(names: Sequence[str]) -> None:
    """Apply the variants ``names`` (before anything is compiled); a clear error for an unknown one."""
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown sloth variant(s) {unknown}; known: {sorted(VARIANTS)}")
    for name in names:
        VARIANTS[name][0]()
