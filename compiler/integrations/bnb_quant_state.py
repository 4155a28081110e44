"""bitsandbytes' 4-bit quant-state recovery made traceable, so a QLoRA layer sharded by FSDP2 stays in one graph.

Why. ``Linear4bit.forward`` first calls ``fix_4bit_weight_quant_state_from_module(self)``: when the weight is no
longer a ``Params4bit`` carrying its ``quant_state`` (FSDP2 registers its own plain unsharded parameter before each
forward), bitsandbytes wraps it in a new ``Params4bit`` and assigns it to the module. Dynamo cannot trace that
("Failed to mutate tensor data attribute"): every 4-bit linear broke the graph, its output reached the LoRA add
from another graph, and none of the QLoRA sites was fused (0 of 14 on two gloo ranks; 24 graphs for a one-layer
Llama at world size 1, where 4 are FSDP2's own; torch 2.13, bitsandbytes 0.50.2).

What. While Dynamo traces (``torch.compiler.is_compiling()``), a weight without a ``quant_state`` gets the module's
as an attribute instead (the forward then reads ``self.weight.quant_state`` as before, and ``matmul_4bit`` takes the
state as an argument, not from the tensor's class); Dynamo replays that attribute write after the graph. Eager calls
run bitsandbytes' function unchanged. With it the layer traces in one graph and the fused QLoRA op is matched
(patterns/bnb_4bit.py reads bytes stored as a float dtype, FSDP's ``quant_storage``).

When. At ``import sloth`` if ``bitsandbytes.nn.modules`` is loaded, else right after it is
(compiler/integrations/import_hooks.py). A bitsandbytes without the function is left alone.
``SLOTH_BNB_TRACEABLE=0`` leaves it alone too.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from .import_hooks import when_imported

_MODULE = "bitsandbytes.nn.modules"
_FUNCTION = "fix_4bit_weight_quant_state_from_module"


def register(module: Any) -> bool:
    """Replace the module's recovery function with the traceable one (idempotent); whether it is replaced."""
    fix = getattr(module, _FUNCTION, None)
    if fix is None:
        return False
    if getattr(fix, "sloth_traceable", False):
        return True

    @functools.wraps(fix)
    def fix_4bit_weight_quant_state_from_module(layer: torch.nn.Module) -> None:
        if not torch.compiler.is_compiling():
            return fix(layer)
        weight = layer.weight
        if getattr(weight, "quant_state", None) is not None:
            return None
        state = getattr(layer, "quant_state", None)
        if state is None:  # bitsandbytes' own message and assertion, as eager would give them
            return fix(layer)
        weight.quant_state = state
        return None

    fix_4bit_weight_quant_state_from_module.sloth_traceable = True
    setattr(module, _FUNCTION, fix_4bit_weight_quant_state_from_module)
    return True


def install() -> None:
    """Register now if bitsandbytes' modules are loaded, else once they are (``SLOTH_BNB_TRACEABLE=0``: never)."""
    when_imported(_MODULE, register, package="bitsandbytes", switch="SLOTH_BNB_TRACEABLE")
