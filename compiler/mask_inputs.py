"""Graphs that read an attention mask another graph made: compiled twice, the version chosen per call.

patterns/causal_mask.py records, in a graph's meta, the SDPA sites that read a mask graph input
(``MASK_INPUT_SITES``) and the outputs the graph returns that are masks proven causal (``PROVEN_OUTPUTS``). This
module turns both into what runs:

    a graph with mask-input sites    compiled with ``is_causal=True`` at them, and as written; each call runs the
                                     first when every such input is a tensor runtime/proven_masks.py has marked
                                     (unchanged since), the second otherwise
    a graph with proven mask outputs each call marks those outputs (the tensors it returns) as proven

Both checks are on the host, per call, a dictionary lookup each: no device work, no sync. The choice is sound
because the mark says where the tensor came from: a graph whose proof covered every value it can return (the
proof is of a closed computation, the same tensor on every call), and nothing has written into it since (its
version counter). A mask from anywhere else (a padding mask, a window, a tensor the user built) runs as written.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from ..patterns.causal_mask import MASK_INPUT_SITES, PROVEN_OUTPUTS, set_causal
from ..runtime import proven_masks


def compile_reading_masks(gm: fx.GraphModule, compile_once: Callable[[bool], Callable]) -> Callable:
    """``gm`` compiled by ``compile_once(first)`` (once, or twice when it reads mask inputs: the ``is_causal``
    version first), with the per-call choice and the marking of proven outputs around it (module docstring)."""
    sites = gm.meta.get(MASK_INPUT_SITES)
    if not sites:
        compiled = compile_once(True)
    else:
        originals = [(node, node.args, dict(node.kwargs)) for _, node, _ in sites]
        modules = list({id(m): m for m, _, _ in sites}.values())
        for _, node, _ in sites:
            set_causal(node)
        _recompile(gm, modules)
        causal = compile_once(True)
        for node, args, kwargs in originals:
            node.args, node.kwargs = args, kwargs
        _recompile(gm, modules)
        masked = compile_once(False)
        compiled = _choose(causal, masked, sorted({position for _, _, position in sites}))
    proven = gm.meta.get(PROVEN_OUTPUTS)
    return _marking(compiled, proven) if proven else compiled


def _recompile(gm: fx.GraphModule, modules: list[fx.GraphModule]) -> None:
    for module in modules:
        module.graph.lint()
        module.recompile()
    if not any(module is gm for module in modules):
        gm.recompile()


def _choose(causal: Callable, masked: Callable, positions: list[int]) -> Callable:
    def run(*args: Any) -> Any:
        proven = all(proven_masks.is_proven(args[i]) for i in positions)
        proven_masks.count(proven)
        return (causal if proven else masked)(*args)

    return run


def _marking(compiled: Callable, positions: list[int]) -> Callable:
    def run(*args: Any) -> Any:
        outputs = compiled(*args)
        for i in positions:
            proven_masks.mark(outputs[i])
        return outputs

    return run
