"""transformers' input-embedding ``requires_grad_`` hook, skipped while Dynamo traces where nothing needs it.

Why. ``PreTrainedModel.enable_input_require_grads`` registers a forward hook on the input embeddings that runs
``output.requires_grad_(True)``; transformers 5 calls it from ``gradient_checkpointing_enable()`` for every model
that reads ``input_ids``, and peft calls it again when it wraps such a model. Dynamo cannot trace
``requires_grad_`` on an intermediate ("requires_grad_() intermediate leaked as output"), and the break falls
inside peft's forward-hook context manager, so Dynamo gives up on the whole ``PeftModel`` frame: on transformers
5.25 + peft 0.21 + torch 2.13 a checkpointed 2-layer Llama reached the backend in 3 graphs with 2 breaks instead
of 1 graph (2 graphs, 5 breaks for Llama-3-8B on the H200). The embedding's output then enters the next graph as
an input, so the ``offload`` option cannot move it (T x H: 128 MiB at 16k tokens of the 8B model, 2 GiB at 256k),
and the first layer's input gradient, which nobody reads, is computed each step.

What the hook is for: reentrant checkpointing (``use_reentrant=True``) records autograd for a layer only when one
of its inputs requires grad, and with frozen embeddings none would, so the LoRA weights inside would get no
gradient. Non-reentrant checkpointing (transformers 5's default) needs no such input, nor does a model without
checkpointing; and a graph Dynamo traces is differentiated by AOTAutograd as a whole, reentrant checkpoints inside
it included (checked on torch 2.13: LoRA gradients equal to eager's either way).

What. The hooks ``enable_input_require_grads`` registers are wrapped: while Dynamo traces
(``torch.compiler.is_compiling()``) the wrapper returns without calling the hook, unless some module of the model
has a reentrant (or unstated) checkpoint function, in which case it calls the hook as before (the graph break
stays, and the gradients stay right if a checkpoint falls back to eager). Eager calls run the hook unchanged.
Whether a reentrant checkpoint is there is kept in one flag per model, read by its wrapped hooks and set again
whenever ``_set_gradient_checkpointing`` runs (checkpointing enabled or disabled, in whichever order the two are
called: peft's ``prepare_model_for_kbit_training`` registers the hook first); Dynamo guards on the flag, so a
change recompiles.

And: re-enabling no longer stacks hooks. ``enable_input_require_grads`` replaces the model's list of hook handles
without removing the hooks it held, and checkpointing re-enabled calls it again: under TRL 1.16 (which turns
checkpointing off and on around each reference forward) one more hook every step, and a recompile of the whole model
at every step under sloth, where the embedding is in the graph and Dynamo guards on the number of hooks. The wrapper
removes the earlier hooks first.

When. At ``import sloth`` if ``transformers.modeling_utils`` is loaded, else right after it is
(compiler/integrations/import_hooks.py). A transformers without ``enable_input_require_grads`` and
``_set_gradient_checkpointing`` on ``PreTrainedModel`` is left alone, and so are hooks not found where 5.x keeps
them (``model._require_grads_hooks``). ``SLOTH_INPUT_GRADS_TRACEABLE=0`` leaves it alone too.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .import_hooks import when_imported

_MODULE = "transformers.modeling_utils"
_registered = False


def may_checkpoint_reentrantly(model: torch.nn.Module) -> bool:
    """Whether a module of ``model`` has checkpointing on with a checkpoint function that may be reentrant: one
    whose ``use_reentrant`` is not stated False (transformers stores ``functools.partial(checkpoint,
    use_reentrant=...)`` as each layer's ``_gradient_checkpointing_func``; anything else counts as may be)."""
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is None or not getattr(module, "gradient_checkpointing", False):
            continue
        keywords = getattr(func, "keywords", None)
        if not isinstance(keywords, dict) or keywords.get("use_reentrant", True) is not False:
            return True
    return False


def skipped_when_traced(hook: Callable, needed: list[bool]) -> Callable:
    """``hook`` as eager runs it; while Dynamo traces, a no-op unless ``needed[0]`` (the model's flag, read at
    each call)."""

    @functools.wraps(hook)
    def make_inputs_require_grads(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        if torch.compiler.is_compiling() and not needed[0]:
            return None
        return hook(module, inputs, output)

    make_inputs_require_grads.sloth_needed = needed
    return make_inputs_require_grads


def _needed_flag(model: torch.nn.Module) -> list[bool]:
    """``model``'s flag (made on first use), set to whether it may checkpoint reentrantly now."""
    flag = model.__dict__.setdefault("_sloth_input_grads_needed", [True])
    flag[0] = may_checkpoint_reentrantly(model)
    return flag


def _wrap_registered(model: torch.nn.Module) -> None:
    """Wrap, in place, the hooks behind ``model._require_grads_hooks`` (the handles stay valid)."""
    needed = _needed_flag(model)
    for handle in getattr(model, "_require_grads_hooks", None) or ():
        hooks = handle.hooks_dict_ref() if hasattr(handle, "hooks_dict_ref") else None
        hook = hooks.get(handle.id) if hooks is not None else None
        if hook is not None and not hasattr(hook, "sloth_needed"):
            hooks[handle.id] = skipped_when_traced(hook, needed)


def register(module) -> bool:
    """Wrap ``PreTrainedModel.enable_input_require_grads`` (idempotent); whether it is wrapped."""
    global _registered
    if _registered:
        return True
    pretrained = getattr(module, "PreTrainedModel", None)
    enable = getattr(pretrained, "enable_input_require_grads", None)
    set_checkpointing = getattr(pretrained, "_set_gradient_checkpointing", None)
    if enable is None or set_checkpointing is None:
        return False

    @functools.wraps(enable)
    def enable_input_require_grads(self, *args, **kwargs):
        # transformers replaces the list of handles without removing the hooks behind it, and re-enabling
        # checkpointing calls this again (TRL turns checkpointing off and on around each reference forward), so
        # each call left one more hook on the embeddings, and Dynamo, which guards on their number, recompiled the
        # model at every step. The same hook once is all it needs.
        for handle in getattr(self, "_require_grads_hooks", None) or ():
            handle.remove()
        out = enable(self, *args, **kwargs)
        _wrap_registered(self)
        return out

    @functools.wraps(set_checkpointing)
    def _set_gradient_checkpointing(self, *args, **kwargs):
        out = set_checkpointing(self, *args, **kwargs)
        if "_sloth_input_grads_needed" in self.__dict__:  # hooks of this model wrapped earlier read it
            _needed_flag(self)
        return out

    pretrained.enable_input_require_grads = enable_input_require_grads
    pretrained._set_gradient_checkpointing = _set_gradient_checkpointing
    _registered = True
    return True


def install() -> None:
    """Register now if transformers' modeling_utils is loaded, else once it is (``SLOTH_INPUT_GRADS_TRACEABLE=0``:
    never)."""
    when_imported(_MODULE, register, package="transformers", switch="SLOTH_INPUT_GRADS_TRACEABLE")
