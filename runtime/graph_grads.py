"""Gradients moved out of CUDA graphs' memory pool, so that a step the plan captured in CUDA graphs accumulates them.

Under Inductor's cudagraph trees a backward graph's outputs live in the graphs' private pool, and the next replay
writes over them. The first backward after ``zero_grad(set_to_none=True)`` makes such an output the parameter's
``.grad`` (AccumulateGrad takes the tensor as it is); a second backward before the optimizer's step (gradient
accumulation) would then find that ``.grad`` overwritten, and cudagraph trees raise ("accessing gradient tensor
output of CUDAGraphs that has been overwritten"). A hook run after each accumulation (``own_gradients``) copies a
``.grad`` it did not make into a tensor of its own, once, and later backwards add into that copy in place:

    backward 1:  .grad = g1 (pool)      hook: .grad = copy of g1 (its own)
    backward 2:  .grad += g2            hook: .grad is its own copy: nothing to do

Each step costs one copy of each trainable parameter's gradient, which is why the plan captures only steps whose
trainable parameters are adapters (compiler/planner.py, ``ADAPTER_SHARE``). The hooks stay for the parameter's life:
a later step without CUDA graphs pays the same copy.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Iterable, Optional

import torch

# id(parameter) -> (a weak reference to it, a weak reference to the .grad the hook made, or None): the parameters
# whose hook is registered. Keyed by id, as tensors compare elementwise; the first reference tells a live parameter
# from a new one that took a dead one's id.
_owned: dict[int, tuple[weakref.ref, Optional[weakref.ref]]] = {}


def _own(param: torch.Tensor) -> None:
    grad = param.grad
    if grad is None:
        return
    _, made = _owned.get(id(param), (None, None))
    if made is not None and made() is grad:  # accumulated in place into the copy made earlier
        return
    with torch.no_grad():  # under create_graph the copy is no step of the graph
        param.grad = grad.clone()
    _owned[id(param)] = (_owned[id(param)][0], weakref.ref(param.grad))


def _forget(key: int, ref: weakref.ref) -> None:
    """A parameter died: drop its entry, unless a new parameter took its id already."""
    if key in _owned and _owned[key][0] is ref:
        del _owned[key]


def _registered(param: torch.Tensor) -> bool:
    ref = _owned.get(id(param))
    return ref is not None and ref[0]() is param


def own_gradients(params: Iterable[Any]) -> int:
    """Register the hook on each trainable parameter of ``params`` that lacks it; returns how many were new."""
    new = 0
    for p in params:
        if isinstance(p, torch.nn.Parameter) and p.requires_grad and not _registered(p):
            p.register_post_accumulate_grad_hook(_own)
            _owned[id(p)] = (weakref.ref(p, functools.partial(_forget, id(p))), None)
            new += 1
    return new
