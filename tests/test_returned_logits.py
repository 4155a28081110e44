"""Returned logits computed only when read (patterns/returned_logits.py; ``return_logits="lazy"``, which the plan
chooses at long context): a training step with a frozen head (LoRA) that never reads them never forms them; one that
reads them, in any way, gets eager's values, and eager's gradient through them; under accelerate's mixed precision
(``logits.float()`` returned) and autocast too. A trainable head's logits are computed in the graph (an optimizer
step would change the head before a late read).
"""
from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import sloth
from sloth.patterns.returned_logits import LazyLogits, ReturnedLogits
from test_models import VOCAB, assert_model_close, build

H, V = 12, 40
LAZY = {"inner": "aot_eager", "return_logits": "lazy"}  # the plan's choice at long context (compiler/planner.py)


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, H, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype).requires_grad_(True)
    b = torch.randn(V, generator=g).to(dtype).requires_grad_(True)
    return x, w, b


def test_lazy_logits_read_in_every_way_equal_the_linear():
    """Every way of reading gives F.linear's value; nothing is computed before the first read; an in-place op
    writes into the value that later reads see."""
    x, w, b = _inputs()
    want = F.linear(x, w, b).detach()
    lazy = LazyLogits(x, w, b, torch.float32)
    assert lazy.shape == want.shape and lazy.dtype == want.dtype and lazy.device == want.device
    assert lazy._value is None  # shape, dtype and device read nothing
    torch.testing.assert_close(lazy[:, :-1].argmax(-1), want[:, :-1].argmax(-1), rtol=0, atol=0)
    assert lazy._value is not None
    assert lazy.tolist() == want.tolist()
    assert np.array_equal(lazy.numpy(), want.numpy()) and np.array_equal(np.asarray(lazy), want.numpy())
    assert repr(lazy) == repr(want)
    assert torch.equal(pickle.loads(pickle.dumps(lazy)), want)
    buffer = io.BytesIO()
    torch.save(lazy, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer), want)
    lazy.div_(2.0)
    assert torch.equal(lazy.float(), want / 2.0)


def test_a_dtype_conversion_stays_lazy():
    """accelerate's forward wrapper calls ``.float()`` on every bf16 output: lazy float32 logits, not formed."""
    x, w, b = _inputs(torch.bfloat16)
    lazy = LazyLogits(x, w, b, torch.bfloat16)
    wide = lazy.float()
    assert isinstance(wide, LazyLogits) and wide.dtype == torch.float32 and wide._value is None
    assert lazy._value is None
    assert torch.equal(wide + 0, F.linear(x, w, b).detach().float())


def test_logits_read_after_the_head_changed_raise():
    """A head changed in place (an optimizer step) before the first read would give the new head's logits: a
    clear error instead."""
    x, w, b = _inputs()
    lazy = LazyLogits(x, w, b, torch.float32)
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="read after the lm_head's weight changed in place"):
        lazy.sum()


def test_lazy_logits_ignore_an_ambient_autocast():
    """Read inside an autocast region, the logits keep the graph's dtypes (float32 here), not autocast's."""
    x, w, b = _inputs()
    lazy = LazyLogits(x, w, b, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lazy + 0
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b).detach(), rtol=0, atol=0)


def test_lazy_logits_read_by_a_compiled_function():
    x, w, b = _inputs()
    lazy = LazyLogits(x, w, b, torch.float32)
    got = torch.compile(lambda t: t.softmax(-1).sum(-1), backend="eager")(lazy)
    torch.testing.assert_close(got, F.linear(x, w, b).detach().softmax(-1).sum(-1))


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["plain", "autocast"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_returned_logits_gradient_is_eagers(compute_dtype, out_dtype):
    """The node's gradient is eager's linear backward, with the casts eager's autograd makes: the returned
    logits cast to ``out_dtype`` after a projection computed in ``compute_dtype`` (autocast's) or x's own."""
    x, w, b = _inputs()
    g = torch.randn(2, 7, V, generator=torch.Generator().manual_seed(1)).to(out_dtype)

    def eager(x, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype is not None):
            return F.linear(x, w, b).to(out_dtype)

    want = torch.autograd.grad(eager(x, w, b), (x, w, b), g)
    logits = ReturnedLogits.apply(x, w, b, out_dtype, compute_dtype, [None])
    assert isinstance(logits, LazyLogits) and logits.dtype == out_dtype and logits.requires_grad
    torch.testing.assert_close(logits.detach(), eager(x, w, b).detach(), rtol=0, atol=0)
    got = torch.autograd.grad(logits, (x, w, b), g)
    for name, a, e in zip("xwb", got, want):
        assert a.dtype == e.dtype, name
        torch.testing.assert_close(a, e, msg=name)


def _frozen_head_model(dtype):
    """The test Llama with its lm_head frozen, as in a LoRA step."""
    model = build("llama", dtype)
    model.lm_head.weight.requires_grad_(False)
    return model


def _loss_grads(model, ids, run=None, autocast=False, read_logits=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = (model if run is None else run)(input_ids=ids, labels=ids)
    total = out.loss + (0.01 * out.logits.float().square().mean() if read_logits else 0.0)
    total.backward()
    return total.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-model", "fp32-model-under-autocast"])
def test_model_step_that_never_reads_the_logits_never_forms_them(autocast):
    """A transformers causal LM's training step reading the loss alone: the returned logits are never
    computed, and the loss and gradients are eager's."""
    dtype = torch.float32 if autocast else torch.bfloat16
    model = _frozen_head_model(dtype)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    reference = _loss_grads(copy.deepcopy(model).double(), ids)
    eager = _loss_grads(model, ids, autocast=autocast)
    compiled = torch.compile(model, backend="sloth", options=LAZY)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = compiled(input_ids=ids, labels=ids)
    assert isinstance(out.logits, LazyLogits) and out.logits.dtype == torch.bfloat16, type(out.logits)
    out.loss.backward()
    assert out.logits._value is None  # nothing read them: never computed
    actual = (out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                  if p.grad is not None})
    assert_model_close(actual, eager, reference, torch.bfloat16)


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-model", "fp32-model-under-autocast"])
def test_model_step_that_reads_and_differentiates_the_logits(autocast):
    """A step whose loss also reads the logits (a z-loss on them): their values and the gradients through
    them and the fused loss together equal eager's."""
    dtype = torch.float32 if autocast else torch.bfloat16
    model = _frozen_head_model(dtype)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    reference = _loss_grads(copy.deepcopy(model).double(), ids, read_logits=True)
    eager = _loss_grads(model, ids, autocast=autocast, read_logits=True)
    actual = _loss_grads(model, ids, torch.compile(model, backend="sloth", options=LAZY),
                         autocast=autocast, read_logits=True)
    (site,) = [s for s in sloth.report().sites if s.family == "cross_entropy"]
    assert "computed only when read" in site.detail, str(sloth.report())
    assert_model_close(actual, eager, reference, torch.bfloat16)


def test_a_returned_float32_copy_of_the_logits_stays_lazy():
    """accelerate's mixed precision returns ``logits.float()`` from the forward; compiled with it (as the Trainer's
    torch_compile does), the float32 copy leaves the graph too: lazy float32 logits, eager's loss and values."""
    model = _frozen_head_model(torch.bfloat16)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))

    def forward(ids):
        out = model(input_ids=ids, labels=ids)
        return out.loss, out.logits.float()

    loss, logits = torch.compile(forward, backend="sloth", options=LAZY)(ids)
    (site,) = [s for s in sloth.report().sites if s.family == "cross_entropy"]
    assert "computed only when read" in site.detail, str(sloth.report())
    assert isinstance(logits, LazyLogits) and logits.dtype == torch.float32 and logits._value is None
    want_loss, want_logits = forward(ids)
    torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(logits + 0, want_logits.detach(), rtol=2e-2, atol=1e-2)  # x is sloth's, in bf16


def test_trainer_in_bf16_mixed_precision_with_lazy_logits(tmp_path):
    """transformers' Trainer, ``bf16=True``, the forward compiled by hand with lazy logits: accelerate's
    ``.float()`` of the returned logits keeps them lazy, and the loss is eager's."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ids = torch.randint(3, VOCAB, (8, 11), generator=torch.Generator().manual_seed(4))
    data = [{"input_ids": row, "labels": row} for row in ids]
    losses = []
    for compiled in (False, True):
        model = _frozen_head_model(torch.bfloat16)
        if compiled:
            model.forward = torch.compile(model.forward, backend="sloth", options=LAZY)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[], use_cpu=True,
            save_strategy="no", seed=0, data_seed=0, bf16=True)
        losses.append(transformers.Trainer(model=model, args=args, train_dataset=data).train().training_loss)
    (site,) = [s for s in sloth.report().sites if s.family == "cross_entropy"]
    assert "computed only when read" in site.detail, str(sloth.report())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2), losses


def test_a_trainable_heads_logits_are_computed_in_the_graph():
    """Full fine-tuning: the head changes at each optimizer step, so its logits are formed in the graph and
    returned as a plain tensor, still with a gradient only when one arrives."""
    model = build("llama", torch.float32)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    out = torch.compile(model, backend="sloth", options={"inner": "aot_eager"})(input_ids=ids, labels=ids)
    assert type(out.logits) is torch.Tensor
    (site,) = [s for s in sloth.report().sites if s.family == "cross_entropy"]
    assert "logits also returned (kept); the loss reads them; their gradient only when one arrives" in site.detail
    want = model(input_ids=ids).logits.detach()
    torch.testing.assert_close(out.logits.detach(), want)
    # written in place as eager's logits can be (a temperature, a mask), found in review
    out.logits.div_(2.0)
    out.logits[..., 0] = 0.0
    torch.testing.assert_close(out.logits[..., 1:].detach(), want[..., 1:] / 2.0)


def test_lazy_logits_written_through_out_and_freed_after_the_read():
    x, w, b = _inputs()
    lazy = LazyLogits(x, w, b, torch.float32)
    got = torch.add(torch.zeros(2, 7, V), 1.0, out=lazy)
    assert got is lazy and torch.equal(lazy + 0, torch.ones(2, 7, V))
    assert lazy._parts[:3] == (None, None, None)  # x and the head are dropped once the value exists


def test_logits_of_a_freed_head_raise():
    x, w, b = _inputs()
    lazy = LazyLogits(x, w, b, torch.float32)
    w.detach().untyped_storage().resize_(0)  # as FSDP frees a gathered parameter
    with pytest.raises(RuntimeError, match="or was freed"):
        lazy.sum()
