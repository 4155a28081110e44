"""peft's LoRA on parameters (``LoraConfig(target_parameters=...)``, the way peft puts adapters on transformers 5.x's
stacked expert weights) as Dynamo traces it: one graph, where peft's own forward splits every MoE block in pieces.

Why. ``peft.tuners.lora.layer.ParamWrapper.forward`` applies its adapter by registering a parametrization on the
wrapped module for the length of the call (``nn.utils.parametrize``: the module's class is swapped and the
parameter ``set_``), which Dynamo cannot trace. On transformers' Qwen3-MoE that is 7 graph breaks a layer, the
pieces recompile per layer past Dynamo's recompile limit and then run eagerly (2026-12-01: 27 graphs, 8 of 12 MoE
blocks fused, 153 ms and 40 GiB for a step; benchmarks/results/2026-12-01_issue20_moe.md).

What. ``ParamWrapper.forward`` becomes a two-way function: in eager (``torch.compiler.is_compiling()`` False) it runs
peft's own forward unchanged (one frame more); when Dynamo traces it, it traces ``_traceable_forward`` instead, which
forms the weight peft's parametrization forms for one adapter on a stacked (3-D) parameter::

    W_eff = baddbmm(W, lhs, rhs, alpha=scaling)      (lhs, rhs, scaling) = ParamWrapper.get_delta_factors(adapter)

(autocast off, in W's dtype, as peft's ``_LoraFactorsProxy``), one per wrapper of a nested chain (one wrapper a
targeted parameter), and calls the innermost module with them through ``torch.func.functional_call``. The MoE
family then finds ``baddbmm(W, B, A)`` feeding the expert GEMMs and gives the op the factors
(patterns/moe.py), so the merged weight is not formed at all.

Every other case traces peft's own forward, graph breaks and all, so it stays correct: adapters disabled or
merged, several active adapters on one parameter, ``adapter_names`` in the call, a 2-D target, a parameter not
in float32 / bfloat16 / float16 (peft upcasts float8 weights); a peft whose ``ParamWrapper`` has no
``get_delta_factors`` (older releases; 0.21.0 has it) is left alone. ``SLOTH_PEFT_TRACEABLE=0`` leaves ``ParamWrapper``
alone too.

When. At ``import sloth`` (which ``torch.compile(backend="sloth")`` causes through the entry point, before Dynamo
traces anything): at once if peft's LoRA layer module is loaded, else right after it is
(compiler/integrations/import_hooks.py), so peft is never imported on sloth's account.
"""
from __future__ import annotations

import functools
import sys

import torch

from .import_hooks import when_imported

_MODULE = "peft.tuners.lora.layer"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_registered = False


def _factors(wrapper) -> tuple | None:
    """(parameter name, W, lhs, rhs, scaling) for peft's one-adapter fold of ``wrapper``, () where no adapter of
    it is active (peft then leaves the parameter as it is), None where only peft's own forward will do."""
    if wrapper.disable_adapters or wrapper.merged:
        return None
    adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if not adapters:
        return ()
    param = wrapper.get_param()
    if len(adapters) != 1 or wrapper.num_experts <= 1 or param.dtype not in _DTYPES:
        return None
    lhs, rhs, scaling = wrapper.get_delta_factors(adapters[0])
    return wrapper.parameter_name, param, lhs, rhs, scaling


def _make_traceable_forward(param_wrapper: type, peft_forward):
    """The function Dynamo traces for ``param_wrapper.forward``; ``peft_forward`` is peft's own, for the cases it
    does not cover."""

    def _traceable_forward(self, x, *args, **kwargs):
        if "adapter_names" in kwargs:
            return peft_forward(self, x, *args, **kwargs)
        folds, module = [], self
        while isinstance(module, param_wrapper):
            fold = _factors(module)
            if fold is None:
                return peft_forward(self, x, *args, **kwargs)
            if fold:
                folds.append(fold)
            module = module.base_layer
        names = [name for name, *_ in folds]
        if module is not self.get_base_layer() or len(set(names)) != len(names):
            return peft_forward(self, x, *args, **kwargs)
        weights = {}
        for name, param, lhs, rhs, scaling in folds:
            with torch.autocast(device_type=param.device.type, enabled=False):
                weights[name] = torch.baddbmm(param, lhs, rhs, alpha=scaling)
        return torch.func.functional_call(module, weights, (x, *args), kwargs)

    return _traceable_forward


def register() -> bool:
    """Make ``ParamWrapper.forward`` traceable (idempotent); whether it is. Needs peft's LoRA layer module loaded."""
    global _registered
    if _registered:
        return True
    param_wrapper = getattr(sys.modules.get(_MODULE), "ParamWrapper", None)
    if param_wrapper is None or not hasattr(param_wrapper, "get_delta_factors"):
        return False
    peft_forward = param_wrapper.forward
    traceable_forward = _make_traceable_forward(param_wrapper, peft_forward)

    @functools.wraps(peft_forward)
    def forward(self, x, *args, **kwargs):
        # Dynamo reads is_compiling() as True and traces the first branch only; eager takes peft's own. (Not
        # torch.compiler.substitute_in_graph: its entry in Dynamo's rule map is dropped when
        # torch.distributed.init_process_group clears that map's cache, so under torchrun it was lost.)
        if torch.compiler.is_compiling():
            return traceable_forward(self, x, *args, **kwargs)
        return peft_forward(self, x, *args, **kwargs)

    param_wrapper.forward = forward
    _registered = True
    return True


def install() -> None:
    """Register now if peft's LoRA layers are loaded, else once they are (``SLOTH_PEFT_TRACEABLE=0``: never)."""
    when_imported(_MODULE, lambda module: register(), package="peft", switch="SLOTH_PEFT_TRACEABLE")
