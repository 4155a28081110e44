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

    ``tiled_mlp``: rows per block, or 0 (off): a LoRA MLP with more rows than that becomes one op that runs a
    block at a time and recomputes each block's gate and up in the backward (patterns/tiled_mlp.py), so no
    rows x intermediate tensor outlives a block: memory for long context, at the price of two GEMMs a block.
    """
    return_logits: bool = True
    recompute: bool = True
    share_lora_input: bool = True
    tiled_mlp: int = 0
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
        tiled_mlp = options.pop("tiled_mlp", False)
        if tiled_mlp is True:
            from ..lowering.tiled_mlp import DEFAULT_TILE_ROWS

            tiled_mlp = DEFAULT_TILE_ROWS
        elif tiled_mlp is False:
            tiled_mlp = 0
        elif not isinstance(tiled_mlp, int) or tiled_mlp < 1:
            raise ValueError(f"sloth: tiled_mlp must be True, False or a positive number of rows per block, got "
                             f"{tiled_mlp!r}")
        return cls(return_logits=return_logits, recompute=recompute, share_lora_input=share_lora_input,
                   tiled_mlp=tiled_mlp)
