"""The PyTorch-reference path: on a CPU without Triton's interpreter every sloth op runs its reference.

The rest of the suite runs the ops' Triton kernels in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
so here each family's model-level path runs once more on the references (the ``reference_path`` fixture): Qwen3
on a packed batch through Inductor (its backward once crashed there: the reference's dq was contiguous where the
fake declares q's layout), a peft LoRA Llama, and GPT-OSS. Each must match eager as on the interpreter, launch no
Triton kernel, and have every reference return its fake's layout itself (lowering/registration.py copies an
output that does not into that layout, and counts the copy). Then the report's first line, which names the path,
and the warning for a TRITON_INTERPRET set too late.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from triton.runtime.interpreter import InterpretedFunction

import sloth
import sloth.lowering
from sloth.compiler import backend
from sloth.lowering import backend_choice, registration
from sloth.lowering.document_attention import document_attention, document_attention_reference
from sloth.lowering.sink_attention import sink_attention

import test_lora_pattern as lora_tests
import test_packed_attention_pattern as packed_tests
import test_sink_attention_pattern as sink_tests

ROOT = Path(__file__).resolve().parent.parent


def _launch_refused(*args, **kwargs):
    raise AssertionError("a Triton kernel was launched on the reference path")


@pytest.fixture
def reference_path(monkeypatch):
    """Run the test as in a process that imported sloth without TRITON_INTERPRET=1: sloth reads the variable once,
    at import (lowering/backend_choice.py), so that reading is set to False and the variable removed, after every
    lowering module has defined its kernels (Triton reads the variable at each definition, and this worker's
    later tests need interpreted kernels). Nothing else sloth derives from the variable at import is read on a
    path that launches no kernel, and launching one fails the test."""
    for module in pkgutil.iter_modules(sloth.lowering.__path__):
        importlib.import_module(f"sloth.lowering.{module.name}")
    monkeypatch.setattr(backend_choice, "_INTERPRETED", False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(InterpretedFunction, "run", _launch_refused)
    registration.RESTRIDED.clear()
    yield
    assert not registration.RESTRIDED, f"references that returned another layout than their fake's: " \
                                       f"{dict(registration.RESTRIDED)}"


def _packed_qwen3_through_inductor() -> sloth.Report:
    report = packed_tests.check(packed_tests.tiny("qwen3"), packed_tests.flattened_batch([7, 13, 1, 11]),
                                inner="inductor")
    joined = [s for s in report.sites if s.family == "rope" and s.op == "sloth.norm_rope"]
    assert report.counts.get("packed_attention") == 2 and len(joined) == 2, str(report)
    return report


def _gpt_oss() -> sloth.Report:
    sink_tests.test_gpt_oss_attention_is_fused(torch.float32)
    report = sloth.report()
    assert report.counts.get("moe_route") == 2 and report.counts.get("moe_router") == 2, str(report)
    return report


def _peft_llama() -> sloth.Report:
    lora_tests.test_peft_llama_every_adapted_linear_fused(torch.float32)
    return sloth.report()


# Each family's model-level path once, in about 50 s of one core (2 cores, 2026-12-08): Qwen3 (RMSNorm, norm_rope,
# GLU, the fused loss, document attention), a peft LoRA Llama (the LoRA ops, RoPE), GPT-OSS (experts, the
# top-k-then-softmax router, sink attention).
MODELS = {"qwen3-packed-inductor": _packed_qwen3_through_inductor, "peft-lora-llama": _peft_llama,
          "gpt-oss-moe-sinks": _gpt_oss}


@pytest.mark.parametrize("case", list(MODELS))
def test_model_on_the_reference_path(case, reference_path):
    report = MODELS[case]()
    assert str(report).startswith("sloth report (PyTorch references): "), str(report).splitlines()[0]


def test_references_return_their_fakes_layout(reference_path):
    """q, k and v as transformers makes them ([B, T, H, D] projections viewed [B, H, T, D]): the forward's out and
    the backward's dq in that layout, as the fakes declare, with no copy by the registration."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 8, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 9, 2, 8, generator=g).transpose(1, 2).requires_grad_() for _ in range(2))
    bounds = torch.tensor([[0, 0, 0, 3, 3, 3, 3, 7, 7], [3, 3, 3, 7, 7, 7, 7, 9, 9]], dtype=torch.int32)
    bounds = torch.stack([bounds, bounds], dim=1)
    sinks = torch.randn(4, generator=g, requires_grad=True)
    for attention in (lambda: document_attention(q, k, v, bounds), lambda: sink_attention(q, k, v, sinks, bounds)):
        out = attention()
        assert out.stride() == q.stride()
        out.sum().backward()
        assert q.grad.stride() == q.stride(), q.grad.stride()
        q.grad = None
    torch.library.opcheck(torch.ops.sloth.document_attention_backward.default,
                          (torch.randn(2, 4, 9, 8), q.detach(), k.detach(), v.detach(),
                           *document_attention_reference(q.detach(), k.detach(), v.detach(), bounds, 0.3), bounds, 0.3))


def test_a_reference_in_another_layout_is_copied_into_the_fakes(reference_path, monkeypatch):
    """The registration's guarantee, for a reference that breaks the rule (a contiguous dq): the op and its runtime
    twin still return the declared layout (Inductor asserts it), and the copy is counted (the fixture fails a test
    that made one)."""
    from sloth.lowering import document_attention as doc

    doc.register()
    original = doc.document_attention_backward_reference
    monkeypatch.setattr(doc, "document_attention_backward_reference",
                        lambda *args: tuple(t.contiguous() for t in original(*args)))
    q = torch.randn(1, 5, 2, 4).transpose(1, 2)
    k = v = torch.randn(1, 2, 5, 4)
    bounds = torch.stack([torch.zeros(1, 5, dtype=torch.int32), torch.full((1, 5), 5, dtype=torch.int32)])
    out, lse = torch.ops.sloth.document_attention(q, k, v, bounds, 0.5)
    for op in (torch.ops.sloth.document_attention_backward, torch.ops.sloth_rt.document_attention_backward):
        dq, _, _ = op(torch.ones_like(out), q, k, v, out, lse, bounds, 0.5)
        assert dq.stride() == q.stride(), dq.stride()
    assert registration.RESTRIDED == {"sloth.document_attention_backward.default": 2}
    registration.RESTRIDED.clear()


def test_first_line_names_the_path(device):
    """Elsewhere in the suite: Triton's kernels, compiled on a GPU or in the CPU interpreter."""
    expected = ("Triton kernels on the GPU" if device == "cuda" else
                "Triton's CPU interpreter" if backend_choice.triton_interpreter_on() else "PyTorch references")
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).to(device)
    torch.compile(model, backend="sloth", options={"inner": "eager"})(torch.randn(3, 8, device=device))
    assert str(sloth.report()).startswith(f"sloth report ({expected}): 1 graph(s), layer_norm: 1"), str(sloth.report())


def _sloth_warnings(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "TRITON_INTERPRET" in str(w.message)]


def test_late_interpreter_variable_warns_once(monkeypatch):
    """TRITON_INTERPRET=1 but sloth imported before it was set: one warning, then the references run."""
    monkeypatch.setattr(backend_choice, "_INTERPRETED", False)
    monkeypatch.setattr(backend, "_interpreter_warned", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    compiled = [torch.compile(f, backend="sloth", options={"inner": "eager"}) for f in (torch.sin, torch.cos)]
    first = _sloth_warnings(lambda: compiled[0](torch.randn(3)))
    assert len(first) == 1 and first[0].startswith("sloth: TRITON_INTERPRET=1 was set after sloth was imported"), first
    assert not _sloth_warnings(lambda: compiled[1](torch.randn(3)))  # once a process
    monkeypatch.setattr(backend_choice, "_INTERPRETED", True)
    monkeypatch.setattr(backend, "_interpreter_warned", False)
    # the interpreter on, as the variable asks: nothing to say
    assert not _sloth_warnings(lambda: torch.compile(torch.tan, backend="sloth", options={"inner": "eager"})(
        torch.randn(3)))


SCRIPT = r'''
import os, warnings
import torch, sloth
from sloth.lowering.backend_choice import triton_interpreter_on
assert not triton_interpreter_on()
w = torch.randn(16)
f = torch.compile(lambda x: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)), backend="sloth",
                  options={"inner": "eager"})
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    f(torch.randn(4, 16))
    os.environ["TRITON_INTERPRET"] = "1"
    torch._dynamo.reset()
    f(torch.randn(4, 16))
print(str(sloth.report()).splitlines()[0])
print([str(w.message).split(",")[0] for w in caught if "TRITON_INTERPRET" in str(w.message)])
'''


def test_a_process_without_the_interpreter():
    """A real process without TRITON_INTERPRET (the fixture above imitates one): the report says the references
    ran, and setting the variable after importing sloth warns."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    first, caught = done.stdout.strip().splitlines()[-2:]
    assert first == "sloth report (PyTorch references): 2 graph(s), rms_norm: 2", done.stdout
    assert caught == "['sloth: TRITON_INTERPRET=1 was set after sloth was imported']", done.stdout
