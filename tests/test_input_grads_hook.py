"""compiler/integrations/input_grads_hook.py: transformers' input-embedding ``requires_grad_`` hook under Dynamo.

What it must do: a checkpointed (non-reentrant) transformers model with peft LoRA traces in one graph, with eager's
loss and LoRA gradients (the hook split it: checked in a process with the adjustment off); under reentrant
checkpointing the hook is kept, gradients still eager's; eager runs the hook unchanged (the embedding's output
requires grad); ``may_checkpoint_reentrantly`` reads the layers' checkpoint functions.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import sloth  # noqa: F401  (importing sloth wraps the hook, before or after transformers is imported)
from sloth.compiler.integrations import input_grads_hook
from checkpointing import enable_checkpointing

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def build(reentrant: bool | None, seed: int = 0) -> torch.nn.Module:
    """A 2-layer fp32 Llama with random LoRA factors (every gradient nonzero), checkpointed unless ``reentrant``
    is None, as a user's script sets it up: ``gradient_checkpointing_enable()`` then ``get_peft_model``."""
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, vocab_size=96, max_position_embeddings=64)
    cfg._attn_implementation, cfg.use_cache = "sdpa", False
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if reentrant is not None:
        enable_checkpointing(model, use_reentrant=reentrant)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                       task_type="CAUSAL_LM", init_lora_weights=False))
    model.train()
    return model


def graphs_loss_grads(model: torch.nn.Module, ids: torch.Tensor, backend="counting", options=None):
    """(graphs Dynamo made, loss, LoRA gradients) of one compiled forward + backward; ``backend`` "counting"
    counts the graphs and runs them as traced, else the name given (e.g. "sloth", with ``options``; graphs not
    counted: None)."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting if backend == "counting" else backend, options=options)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return (len(graphs) if backend == "counting" else None), loss.detach(), grads


def eager_loss_grads(model: torch.nn.Module, ids: torch.Tensor):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_matches(loss, grads, eager_loss, eager_grads):
    # fp32 throughout, the same ops: any difference is reordering, far below this
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys() and len(grads) == 2 * 2 * len(TARGETS)
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))


def test_non_reentrant_checkpointing_traces_in_one_graph_with_eager_numbers():
    graphs, loss, grads = graphs_loss_grads(build(reentrant=False), IDS)
    assert graphs == 1
    assert_matches(loss, grads, *eager_loss_grads(build(reentrant=False), IDS))


def test_through_sloth_with_offload_the_numbers_are_eager_numbers():
    _, loss, grads = graphs_loss_grads(build(reentrant=False), IDS, backend="sloth", options={"offload": True})
    assert_matches(loss, grads, *eager_loss_grads(build(reentrant=False), IDS))


def test_reentrant_checkpointing_keeps_the_hook_and_eager_numbers():
    model = build(reentrant=True)
    assert input_grads_hook.may_checkpoint_reentrantly(model)
    _, loss, grads = graphs_loss_grads(model, IDS)
    assert_matches(loss, grads, *eager_loss_grads(build(reentrant=True), IDS))


def test_eager_runs_the_hook():
    model = build(reentrant=False)
    hooks = list(model.get_input_embeddings()._forward_hooks.values())
    assert hooks and all(hasattr(h, "sloth_needed") for h in hooks)  # one from transformers, one from peft
    assert model.get_input_embeddings()(IDS).requires_grad


def test_reentrant_checkpointing_enabled_after_the_hook_keeps_it():
    # peft's prepare_model_for_kbit_training registers the hook first and enables checkpointing after it: the
    # model's flag follows _set_gradient_checkpointing, so the hook is kept once reentrant checkpointing is on
    # (and skipped again once it is off).
    model = build(reentrant=None)
    base = model.get_base_model()
    base.enable_input_require_grads()
    (hook, *_) = [h for h in base.get_input_embeddings()._forward_hooks.values() if hasattr(h, "sloth_needed")]
    assert hook.sloth_needed == [False]
    base._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=functools.partial(
        checkpoint, use_reentrant=True))
    assert hook.sloth_needed == [True]
    _, loss, grads = graphs_loss_grads(model, IDS)
    assert_matches(loss, grads, *eager_loss_grads(build(reentrant=True), IDS))
    base._set_gradient_checkpointing(enable=False)
    assert hook.sloth_needed == [False]


def _layer(func=None, on=True):
    layer = torch.nn.Linear(2, 2)
    layer.gradient_checkpointing, layer._gradient_checkpointing_func = on, func
    return torch.nn.Sequential(layer)


@pytest.mark.parametrize("layer, reentrant", [
    (_layer(functools.partial(checkpoint, use_reentrant=False)), False),
    (_layer(functools.partial(checkpoint, use_reentrant=True)), True),
    (_layer(functools.partial(checkpoint)), True),  # unstated: torch's default may be reentrant
    (_layer(checkpoint), True),  # not a partial: unknown
    (_layer(functools.partial(checkpoint, use_reentrant=True), on=False), False),  # checkpointing off
    (_layer(None), False),
])
def test_may_checkpoint_reentrantly(layer, reentrant):
    assert input_grads_hook.may_checkpoint_reentrantly(layer) is reentrant


GRAPHS = ("import torch; from tests.test_input_grads_hook import build, graphs_loss_grads, IDS; "
          "from sloth.compiler.integrations import input_grads_hook as h; "
          "print(h._registered, graphs_loss_grads(build(reentrant=False), IDS)[0])")


def test_opt_out_leaves_the_hook_and_it_splits_the_graph():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", GRAPHS], capture_output=True, text=True, timeout=240,
                            env={**os.environ, "SLOTH_INPUT_GRADS_TRACEABLE": "0", "PYTHONPATH": os.pathsep.join(
                                [os.path.dirname(root), root, os.path.join(root, "tests"),
                                 os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr[-3000:]
    registered, graphs = result.stdout.strip().splitlines()[-1].split()
    # what the adjustment is for, so the one-graph test above can fail
    assert registered == "False" and int(graphs) > 1


def test_checkpointing_turned_off_and_on_keeps_one_hook_and_one_graph():
    # TRL runs each reference forward with checkpointing off (trl.models.utils.disable_gradient_checkpointing);
    # turned on again, transformers registered one more hook, and Dynamo recompiled the model at every step.
    model = build(reentrant=False)
    base = model.get_base_model()
    embeddings = model.get_input_embeddings()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting)
    for step in range(3):
        compiled(input_ids=IDS, labels=IDS).loss.backward()
        base.gradient_checkpointing_disable()
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert len(embeddings._forward_hooks) == 1, step
    assert len(graphs) == 1
