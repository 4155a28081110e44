"""sloth: a torch.compile backend that fuses the math of LLM fine-tuning into Triton kernels.

    model = torch.compile(model, backend="sloth")          # found through its entry point
    print(sloth.explain(model, input_ids))                 # what it would replace, and why not
    print(sloth.report())                                  # what it replaced in everything compiled
    sloth.register_family("mine", my_pass, after="glu")    # a pattern family of your own (compiler/families.py)

See README.md. Importing sloth defines functions and registers two things: the name "sloth" with accelerate, when it
is installed, so that ``TrainingArguments(torch_compile_backend="sloth")`` passes accelerate's check
(compiler/integrations/accelerate_name.py); and, once peft is loaded, a traceable form of peft's
``ParamWrapper.forward`` (LoRA on stacked expert weights), which Dynamo traces in one graph while eager runs peft's
own code (compiler/integrations/peft_experts.py; ``SLOTH_PEFT_TRACEABLE=0`` turns it off); and, once Hugging Face's
``kernels`` package is loaded (transformers 5.25 depends on it), a routing store that Dynamo skips where it routes
nowhere, so gradient-checkpointed layers stay in one graph (compiler/integrations/hub_kernels.py;
``SLOTH_HUB_KERNELS_TRACEABLE=0`` turns it off); and, once transformers is loaded, its input-embedding
``requires_grad_`` hook (registered by ``gradient_checkpointing_enable()``) skipped while Dynamo traces a model
without reentrant checkpointing, where it split the graph and nothing needs it
(compiler/integrations/input_grads_hook.py; ``SLOTH_INPUT_GRADS_TRACEABLE=0`` turns it off); and, once TRL's trainer
utilities are loaded, TRL's fused LM head run by sloth's ``linear_token_logprobs`` where a step compiled with sloth
calls it (compiler/integrations/trl_head.py; ``SLOTH_TRL_HEAD=0`` turns it off); and, once bitsandbytes is loaded,
its 4-bit layers' quant-state recovery made traceable, so a QLoRA layer sharded by FSDP2 stays in one graph
(compiler/integrations/bnb_quant_state.py; ``SLOTH_BNB_TRACEABLE=0`` turns it off). The custom ops register the first
time a pass inserts them.
"""
from .compiler.backend import last_report, report, reset_report, sloth_backend
from .compiler.explain import explain
from .compiler.families import families, register_family, unregister_family
from .compiler.pipeline import FAMILIES
from .compiler.report import Rejection, Report, Site
from .compiler.integrations.accelerate_name import register_with_accelerate
from .compiler.integrations.peft_experts import install as _install_traceable_peft
from .compiler.integrations.hub_kernels import install as _install_traceable_hub_kernels
from .compiler.integrations.input_grads_hook import install as _install_traceable_input_grads
from .compiler.integrations.trl_head import install as _install_trl_head
from .compiler.integrations.bnb_quant_state import install as _install_traceable_bnb_quant_state

register_with_accelerate()
_install_traceable_peft()
_install_traceable_hub_kernels()
_install_traceable_input_grads()
_install_trl_head()
_install_traceable_bnb_quant_state()

__all__ = ["sloth_backend", "explain", "report", "reset_report", "last_report", "FAMILIES", "families", "register_family",
           "unregister_family", "Report", "Site", "Rejection"]
__version__ = "0.1.0"
