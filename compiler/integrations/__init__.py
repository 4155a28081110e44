"""sloth's integrations with other libraries, each installed at ``import sloth`` and each with its own kill switch:

    accelerate_name    the name "sloth" in accelerate's DynamoBackend enum (``accelerate launch --dynamo_backend``)
    peft_experts       a traceable form of peft's ParamWrapper (LoRA on stacked expert weights), one graph per MoE
                       block (SLOTH_PEFT_TRACEABLE=0 turns it off)
    hub_kernels        the ``kernels`` package's routing store made readable under Dynamo, so gradient-checkpointed
                       layers stay in one graph
    input_grads_hook   transformers' input-embedding ``requires_grad_`` hook, skipped where nothing needs it
    trl_head           TRL's fused LM head run by sloth's token_logprobs op in a step compiled with sloth
                       (SLOTH_TRL_HEAD=0 turns it off)
    bnb_quant_state    bitsandbytes' 4-bit quant-state recovery made traceable, so a QLoRA layer under FSDP2 stays in
                       one graph (SLOTH_BNB_TRACEABLE=0 turns it off)
    import_hooks       the shared mechanism: run an install when a library is imported, whichever comes first

They patch other libraries' behaviour under Dynamo only; trl_head alone changes numbers (sloth's rounding in place of
TRL's, inside a compile with sloth's backend only). The compiler core does not import them.
"""
