"""Gradient-checkpointed transformers layers in one graph again, with the ``kernels`` package installed.

Why. transformers 5.25 depends on Hugging Face's ``kernels`` package, and with it installed every attention class
decorated ``@use_kernelized_func(apply_rotary_pos_emb)`` (Llama, Qwen, Mistral, ... in 5.25) wraps its forward
in a routing step: it builds a dict {id(function): (its per-model wrapper, that wrapper's forward)} and stores it
in a module-level ``CompileableContextVar`` for the call (``set``, then ``reset``), so that a model
``kernels.kernelize``-d with hub kernels calls its own kernel. Under Dynamo that store is an attribute write on a
global object, and Dynamo allows no such side effect inside a higher-order-op body: inside each gradient-
checkpointed layer (a ``checkpoint`` body) tracing fails, Dynamo falls back, and a 2-layer Llama reaches the
backend in 5 graphs instead of 1, its layers not rewritten (measured on transformers 5.25.0, kernels 0.19.1,
torch 2.13). Inductor gets the same split.

What. When Dynamo traces ``set`` with a dict in which no entry routes anywhere (every wrapper's forward is its
class's own, i.e. the model was never kernelized: then the wrapper runs the plain function, routed or not), the
store is skipped and a token returned that ``reset`` recognises and ignores. The numbers cannot change: the
routed call and the plain call run the same function. A dict that routes to a kernelized forward, and every
eager call, take the package's own ``set`` / ``reset``.

When. At ``import sloth`` if the package's module is loaded, else right after it is
(compiler/integrations/import_hooks.py); a ``kernels`` without ``CompileableContextVar`` in that module (other releases) is left alone.
``SLOTH_HUB_KERNELS_TRACEABLE=0`` leaves it alone too.
"""
from __future__ import annotations

import functools

import torch

from .import_hooks import when_imported

_MODULE = "kernels._internals.layer.layer"
_SKIPPED = object()  # the token ``set`` returns when it stored nothing
_registered = False


def _routes_nothing(value) -> bool:
    """Whether ``value`` (the routing dict ``use_kernelized_func`` stores) sends no call anywhere but the plain
    function: every entry's forward is its wrapper class's own."""
    if not isinstance(value, dict):
        return False
    for entry in value.values():
        if not (isinstance(entry, tuple) and len(entry) == 2):
            return False
        wrapper, forward = entry
        if forward is not type(wrapper).forward:
            return False
    return True


def register(module) -> bool:
    """Make ``module.CompileableContextVar``'s store skippable under Dynamo (idempotent); whether it is."""
    global _registered
    if _registered:
        return True
    context_var = getattr(module, "CompileableContextVar", None)
    kernels_set, kernels_reset = getattr(context_var, "set", None), getattr(context_var, "reset", None)
    if not (callable(kernels_set) and callable(kernels_reset)):
        return False

    @functools.wraps(kernels_set)
    def set(self, value):
        if torch.compiler.is_compiling() and _routes_nothing(value):
            return _SKIPPED
        return kernels_set(self, value)

    @functools.wraps(kernels_reset)
    def reset(self, token):
        if token is _SKIPPED:
            return None
        return kernels_reset(self, token)

    context_var.set, context_var.reset = set, reset
    _registered = True
    return True


def install() -> None:
    """Register now if the ``kernels`` layer module is loaded, else once it is (``SLOTH_HUB_KERNELS_TRACEABLE=0``:
    never)."""
    when_imported(_MODULE, register, package="kernels", switch="SLOTH_HUB_KERNELS_TRACEABLE")
