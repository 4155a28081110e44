"""compiler/integrations/peft_experts.py: peft's ``ParamWrapper`` (LoRA on stacked expert weights) as Dynamo traces it.

What it must do: one graph where peft's own forward splits each MoE block; the same numbers as peft's eager
forward; every case it does not cover traced through peft's own forward (graph breaks, same numbers); registered
whichever of sloth and peft is imported first, and not at all under ``SLOTH_PEFT_TRACEABLE=0``. The fused op's side
(the factors taken, every adapter's gradient) is tests/test_moe_pattern.py's.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# importing sloth makes ParamWrapper traceable, before peft is imported here
from sloth.compiler.integrations import peft_experts
from tests.pattern_checks import seeded
from tests.test_models import VOCAB
from tests.test_moe_pattern import moe_model

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _lora_model(adapters=("default",)):
    model = get_peft_model(moe_model("qwen3_moe", "grouped_mm"), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=TARGETS), adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=seeded(5))
    return model


def _graphs_and_logits(model, ids):
    """(graphs Dynamo made, compiled logits, eager logits, a function giving the first graph break's reason) for
    one forward. One trace: ``torch._dynamo.explain`` traces again, so it runs only when a message needs it."""
    graphs: list = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting)(input_ids=ids).logits

    def why():
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(input_ids=ids)
        return explained.break_reasons[0].reason[:500] if explained.break_reasons else None

    return len(graphs), compiled, model(input_ids=ids).logits, why


@pytest.fixture(scope="module")
def base_in_one_graph():
    """The premise of every one-graph assertion here: the model without peft traces in one graph. Not so where
    transformers' grouped_mm experts take a host-synchronising fallback (transformers 5.17 with torch 2.11 on the
    CPU: a ``.item()`` per expert, so aot_eager meets ``aten._local_scalar_dense``); such a test says so and skips."""
    graphs, _, _, why = _graphs_and_logits(moe_model("qwen3_moe", "grouped_mm"),
                                           torch.randint(3, VOCAB, (2, 11), generator=seeded(1)))
    if graphs != 1:
        import transformers
        reason = why()  # None: no graph break; the backend's own compile failed and Dynamo split the frames
        cause = f"first break: {reason}" if reason else "no graph break: aot_eager failed on its graph"
        pytest.skip(f"the model without peft makes {graphs} graphs on torch {torch.__version__}, transformers "
                    f"{transformers.__version__} ({cause}): nothing for peft's tracing to keep whole")


def test_registered_and_traced_in_one_graph_with_peft_numbers(base_in_one_graph):
    assert peft_experts.register()  # peft was imported above: registered at import already, idempotent
    model = _lora_model()
    ids = torch.randint(3, VOCAB, (2, 11), generator=seeded(1))
    graphs, compiled, eager, why = _graphs_and_logits(model, ids)
    assert graphs == 1, why()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_survives_init_process_group_clearing_dynamos_rule_cache(base_in_one_graph):
    # torch.distributed.init_process_group clears Dynamo's trace-rule cache (trace_rules.clear_lru_cache), which
    # dropped a torch.compiler.substitute_in_graph registration: under torchrun the experts split again.
    torch._dynamo.trace_rules.clear_lru_cache()
    model = _lora_model()
    graphs, compiled, eager, why = _graphs_and_logits(model, torch.randint(3, VOCAB, (2, 11), generator=seeded(1)))
    assert graphs == 1, why()


@pytest.mark.parametrize("case", ["disabled", "merged", "two-adapters", "no-active-adapter-on-experts"])
def test_cases_it_does_not_cover_trace_peft_own_forward(case, base_in_one_graph):
    # Each traces peft's own forward, which with the adapter merged or disabled (or inactive on the experts) calls
    # the base module alone and needs no parametrization: the numbers stay eager's.
    model = _lora_model(("default", "other") if case == "two-adapters" else ("default",))
    ids = torch.randint(3, VOCAB, (2, 11), generator=seeded(1))
    if case == "merged":
        model.merge_adapter()
    if case == "two-adapters":
        model.base_model.set_adapter(["default", "other"])
    if case == "no-active-adapter-on-experts":
        model.add_adapter("attention_only", LoraConfig(r=2, target_modules=["q_proj"]))
        model.set_adapter("attention_only")
    if case == "disabled":
        with model.disable_adapter():
            graphs, compiled, eager, why = _graphs_and_logits(model, ids)
    else:
        graphs, compiled, eager, why = _graphs_and_logits(model, ids)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    if case == "two-adapters":
        assert graphs > 1  # peft's own forward: its graph breaks, not a silently different weight
    else:  # peft's own forward calls the base module alone (merged, disabled), or the experts have no adapter
        assert graphs == 1, why()


def _in_a_fresh_process(code: str, **env) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                            env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(
                                [os.path.dirname(root), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


CHECK = ("import sys; from sloth.compiler.integrations import peft_experts as p; "
         "print(p._registered, 'peft.tuners.lora.layer' in sys.modules)")


@pytest.mark.parametrize("order", ["sloth-first", "peft-first", "sloth-only"])
def test_registered_whichever_is_imported_first_and_peft_never_imported_for_it(order):
    imports = {"sloth-first": "import sloth; import peft; ", "peft-first": "import peft; import sloth; ",
               "sloth-only": "import sloth; "}[order]
    assert _in_a_fresh_process(imports + CHECK) == ("False False" if order == "sloth-only" else "True True")


def test_opt_out_leaves_param_wrapper_alone():
    code = ("import sloth, peft; from peft.tuners.lora.layer import ParamWrapper; "
            "from sloth.compiler.integrations import peft_experts as p; "
            "print(p._registered, ParamWrapper.forward.__code__.co_filename.endswith('lora/layer.py'))")
    assert _in_a_fresh_process(code, SLOTH_PEFT_TRACEABLE="0") == "False True"
    assert _in_a_fresh_process(code) == "True False"  # the test can fail: registered, the forward is sloth's
