"""sloth's integrations with other libraries, each installed at ``import sloth`` and each with its own kill switch:

    accelerate_name    the name "sloth" in accelerate's DynamoBackend enum (``accelerate launch --dynamo_backend``)
    peft_experts       a traceable form of peft's ParamWrapper (LoRA on stacked expert weights), one graph per MoE
                       block (SLOTH_PEFT_TRACEABLE=0 turns it off)
    hub_kernels        the ``kernels`` package's routing store made readable under Dynamo, so gradient-checkpointed
                       layers stay in one graph
    input_grads_hook   transformers' input-embedding ``requires_grad_`` hook, skipped where nothing needs it
    import_hooks       the shared mechanism: run an install when a library is imported, whichever comes first

They patch other libraries' behaviour under Dynamo only, never the numbers; the compiler core does not import them.
"""
