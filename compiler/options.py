"""The options a pass may read, passed to every pass as ``options=`` (one signature for all passes)."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class PassOptions:
    """Switches that trade exact semantics for memory; the defaults keep the model's outputs as they were.

    ``return_logits``: False lets the cross-entropy pass return an empty tensor in place of the logits
    when a loss is fused and the logits' only other use is being returned, so they are never computed
    (top-level graph only: a subgraph's outputs feed its caller).

    ``recompute``: True lets cheap sloth ops (RMSNorm) be recomputed in the backward instead of keeping
    their outputs from the forward (compiler/recompute.py); False keeps them, as Inductor would decide.

    ``share_lora_input``: True makes the LoRA linears that read one input (q, k, v; gate, up) one op, dense
    or 4-bit (patterns/lora_shared.py: fewer op calls and launches, x read once); False keeps one op each.
    The values are the same math; the input gradient's sum is rounded as eager rounds it rather than once.

    ``tiled_mlp``: rows per block, or 0 (off): a LoRA MLP with more rows than that becomes one op whose GLU,
    down projection and backward run a block at a time (patterns/tiled_mlp.py), so the backward's own rows x
    intermediate tensors exist one block at a time: memory for long context. ``tiled_mlp_recompute`` (True
    unless the user says otherwise): the op also recomputes each block's gate and up in the backward instead of
    keeping them, so no such tensor outlives a block, at the price of two GEMMs a block.

    ``moe_recompute``: True makes the MoE experts op (patterns/moe.py) keep nothing of its first GEMM's output
    for the backward and recompute it there (the gather of the token rows, the gate/up grouped GEMM and its
    adapter): S x 2I elements a layer less at the peak (96 MiB a layer at Qwen3-MoE's 2 x 2048 tokens, 1.1 GiB
    over its 12 layers) for one more grouped GEMM a layer, which a host-bound step hides. False (the default)
    keeps it.

    ``mask_check``: True lets a graph that reads an attention mask another graph or eager code made, which no
    compile-time proof covers, compare that tensor's values with the causal mask on the device once (one host
    sync per new mask tensor) and run ``is_causal`` attention when it is causal (compiler/mask_inputs.py,
    runtime/proven_masks.py); False runs such masks as written, with no sync.
    """
    return_logits: bool = True
    recompute: bool = True
    share_lora_input: bool = True
    tiled_mlp: int = 0
    tiled_mlp_recompute: bool = True
    mask_check: bool = True
    moe_recompute: bool = False
    # Not a user option: whether the pass may change the graph's outputs (the top-level graph, whose outputs
    # the backend's wrapper sees; compiler/returned_logits.py), False in subgraph bodies.
    top_level: bool = True

    @classmethod
    def from_user(cls, options: dict[str, Any]) -> "PassOptions":
        """Pop sloth's pass options out of ``options`` (the backend's dict), with a clear error for bad values."""
        return_logits = options.pop("return_logits", True)
        if not isinstance(return_logits, bool):
            raise ValueError(f"sloth: return_logits must be True or False, got {return_logits!r}")
        recompute = options.pop("recompute", True)
        if not isinstance(recompute, bool):
            raise ValueError(f"sloth: recompute must be True or False, got {recompute!r}")
        share_lora_input = options.pop("share_lora_input", True)
        if not isinstance(share_lora_input, bool):
            raise ValueError(f"sloth: share_lora_input must be True or False, got {share_lora_input!r}")
        tiled_mlp, tiled_mlp_recompute = _tiled_mlp(options.pop("tiled_mlp", False))
        mask_check = options.pop("mask_check", True)
        if not isinstance(mask_check, bool):
            raise ValueError(f"sloth: mask_check must be True or False, got {mask_check!r}")
        moe_recompute = options.pop("moe_recompute", False)
        if not isinstance(moe_recompute, bool):
            raise ValueError(f"sloth: moe_recompute must be True or False, got {moe_recompute!r}")
        return cls(return_logits=return_logits, recompute=recompute, share_lora_input=share_lora_input,
                   tiled_mlp=tiled_mlp, tiled_mlp_recompute=tiled_mlp_recompute, mask_check=mask_check,
                   moe_recompute=moe_recompute)


def _tiled_mlp(value: Any) -> tuple[int, bool]:
    """(rows per block or 0, recompute) from the user's ``tiled_mlp``: False, True (blocks of
    lowering/tiled_mlp.py's DEFAULT_TILE_ROWS), a number of rows, or {"rows": N, "recompute": bool}; recompute
    unless told otherwise."""
    bad = ValueError(f"sloth: tiled_mlp must be True, False, a positive number of rows per block or "
                     f"{{'rows': N, 'recompute': True/False}}, got {value!r}")
    recompute = True  # the form measured on the H200 (benchmarks/results/2026-12-02_issue19_tiled_mlp.md)
    if isinstance(value, dict):
        if not set(value) <= {"rows", "recompute"} or not isinstance(value.get("recompute", True), bool):
            raise bad
        recompute = value.get("recompute", True)
        value = value.get("rows", True)
    if value is False:
        return 0, False
    if value is True:
        from ..lowering.tiled_mlp import DEFAULT_TILE_ROWS

        return DEFAULT_TILE_ROWS, recompute
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad
    return value, recompute
