"""Graphs that read an attention mask another graph made: compiled twice, the version chosen per call.

patterns/causal_mask.py records, in a graph's meta, the SDPA sites that read a mask graph input
(``MASK_INPUT_SITES``) and the outputs the graph returns that are masks proven causal (``PROVEN_OUTPUTS``). This
module turns both into what runs:

    a graph with mask-input sites    compiled with ``is_causal=True`` at them (and the key / value heads the
                                     gqa_attention family recorded read unrepeated: ``GQA_WHEN_CAUSAL``), and as
                                     written; each call runs the first when every such input is a tensor
                                     runtime/proven_masks.py knows causal (unchanged since), the second otherwise
    a graph with proven mask outputs each call marks those outputs (the tensors it returns) as proven

A tensor is known causal when the graph that made it proved it (a closed computation, the same values on every
call: a dictionary lookup per call, no device work) or, with the ``mask_check`` option (on by default), when its
values were compared with the causal mask on the device the first time a reading graph received it (one host
sync per new mask tensor, whatever the number of layers reading it; the verdict, causal or not, is kept for that
tensor until it is written). Either way the choice is sound: it rests on the values of that very tensor, unchanged
since. A mask that is not causal (a padding mask, a window) runs as written.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from .causal_mask import MASK_INPUT_SITES, PROVEN_OUTPUTS, set_causal
from .gqa_attention import GQA_WHEN_CAUSAL, set_grouped
from ..runtime import proven_masks


def compile_reading_masks(gm: fx.GraphModule, compile_once: Callable[[bool], Callable], *, check: bool) -> Callable:
    """``gm`` compiled by ``compile_once(first)`` (once, or twice when it reads mask inputs: the ``is_causal``
    version first), with the per-call choice and the marking of proven outputs around it (module docstring);
    ``check``: whether a mask input nobody proved is checked on the device."""
    sites = gm.meta.get(MASK_INPUT_SITES)
    if not sites:
        compiled = compile_once(True)
    else:
        grouped = gm.meta.get(GQA_WHEN_CAUSAL, ())
        originals = [(node, node.args, dict(node.kwargs)) for _, node, _ in sites]
        modules = list({id(m): m for m, _, _ in sites}.values())
        for _, node, _ in sites:
            set_causal(node)
        for _, node, key, value in grouped:  # sites of the list above: restored with it
            set_grouped(node, key, value)
        _recompile(gm, modules)
        causal = compile_once(True)
        for node, args, kwargs in originals:
            node.args, node.kwargs = args, kwargs
        _recompile(gm, modules)
        masked = compile_once(False)
        compiled = _choose(causal, masked, sorted({position for _, _, position in sites}), check)
    proven = gm.meta.get(PROVEN_OUTPUTS)
    return _marking(compiled, proven) if proven else compiled


def _recompile(gm: fx.GraphModule, modules: list[fx.GraphModule]) -> None:
    for module in modules:
        module.graph.lint()
        module.recompile()
    if not any(module is gm for module in modules):
        gm.recompile()


def _choose(causal: Callable, masked: Callable, positions: list[int], check: bool) -> Callable:
    def run(*args: Any) -> Any:
        proven = all(proven_masks.known_causal(args[i], check) for i in positions)
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
