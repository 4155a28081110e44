"""transformers' Trainer trains a model sloth compiled, and every family is found: compiled by hand
(``model.forward = torch.compile(...)``) or by the Trainer itself with
``TrainingArguments(torch_compile_backend="sloth")``, which accelerate accepts once ``import sloth`` has
added the name to its ``DynamoBackend`` enum (compiler/integrations/accelerate_name.py); packed batches; gradient
accumulation equal to one big batch; and ``python -m sloth.launch --dynamo_backend sloth`` (accelerate's launch, launch.py).
"""
from __future__ import annotations

import pytest
import torch

import sloth
from test_models import VOCAB, build

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _train(model: torch.nn.Module, output_dir, **extra) -> float:
    """Two Trainer steps of ``model`` on a fixed batch; ``extra`` goes to TrainingArguments."""
    ids = torch.randint(3, VOCAB, (8, 11), generator=torch.Generator().manual_seed(4))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=2,
                                          report_to=[], use_cpu=True, save_strategy="no", seed=0, data_seed=0,
                                          **extra)
    return transformers.Trainer(model=model, args=args, train_dataset=data).train().training_loss


def _assert_sloth_trained_like_eager(sloth_loss: float, eager_loss: float) -> None:
    counts = sloth.report().counts
    assert counts.get("rms_norm") == 5 and counts.get("rope") == 2 and counts.get("glu") == 2, counts
    assert counts.get("cross_entropy") == 1, counts
    assert sloth_loss == pytest.approx(eager_loss, rel=1e-4), (sloth_loss, eager_loss)


def test_trainer_trains_a_sloth_compiled_model(tmp_path) -> None:
    eager_loss = _train(build("llama", torch.float32), tmp_path)
    model = build("llama", torch.float32)
    model.forward = torch.compile(model.forward, backend="sloth", options={"inner": "aot_eager"})
    _assert_sloth_trained_like_eager(_train(model, tmp_path), eager_loss)


def test_training_arguments_torch_compile_backend_sloth(tmp_path) -> None:
    from accelerate.utils.dataclasses import DynamoBackend

    assert DynamoBackend("SLOTH").value == "SLOTH"  # added by import sloth
    eager_loss = _train(build("llama", torch.float32), tmp_path / "eager")
    # The Trainer compiles with backend "sloth" itself (Inductor inside).
    sloth_loss = _train(build("llama", torch.float32), tmp_path / "sloth", torch_compile_backend="sloth")
    _assert_sloth_trained_like_eager(sloth_loss, eager_loss)


def test_trainer_with_the_flattening_collator_packs(tmp_path) -> None:
    """``DataCollatorWithFlattening`` packs each step's documents into one row (position ids restarting per
    document, no attention mask). Its rows differ in length from step to step; with automatic dynamic shapes off
    each length compiles as its own static graph, and in each every layer's attention is the packed op, with
    eager's losses under the same collator."""
    g = torch.Generator().manual_seed(5)
    data = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in (5, 9, 3, 7, 6, 4, 8, 2)]

    def train(model: torch.nn.Module, output_dir) -> float:
        model.config.use_cache = False  # transformers looks for packed positions only without a cache
        args = transformers.TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=2,
                                              report_to=[], use_cpu=True, save_strategy="no", seed=0, data_seed=0)
        collator = transformers.DataCollatorWithFlattening()
        return transformers.Trainer(model=model, args=args, train_dataset=data,
                                    data_collator=collator).train().training_loss

    eager_loss = train(build("llama", torch.float32), tmp_path / "eager")
    model = build("llama", torch.float32)
    model.forward = torch.compile(model.forward, backend="sloth", options={"inner": "aot_eager"})
    # (torch's config.patch, not pytest's monkeypatch: undoing a setattr on torch's config module deletes the
    # option, which broke every later compile in the worker)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        sloth_loss = train(model, tmp_path / "sloth")
    report = sloth.report()
    assert report.graphs == 2 and report.counts.get("packed_attention") == 4, str(report)
    assert not [r for r in report.rejections if r.family in ("packed_attention", "causal_mask")], str(report)
    assert sloth_loss == pytest.approx(eager_loss, rel=1e-4), (sloth_loss, eager_loss)


def test_gradient_accumulation_equals_one_big_batch(tmp_path) -> None:
    """Two micro-batches of 2 accumulated equal one batch of 4 (transformers' Trainer passes the step's count of
    labelled tokens, ``num_items_in_batch``, into the loss: a sum over the micro-batch divided by it). The rows here
    hold different numbers of ignored labels, so a loss that averaged each micro-batch on its own (what a fused loss
    that dropped the count would do) gives other gradients. Through sloth both ways, the fused loss takes the sum
    form, and the losses and trained weights equal one another's and eager's."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, VOCAB, (8, 11), generator=g)
    labels = ids.clone()
    for row, ignored in enumerate((0, 6, 1, 8, 3, 0, 7, 2)):  # 0-8 of a row's 11 labels ignored
        labels[row, :ignored] = -100
    data = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]

    def train(compiled: bool, batch: int, accumulate: int, output_dir) -> tuple[float, dict[str, torch.Tensor]]:
        model = build("llama", torch.float32)
        if compiled:
            model.forward = torch.compile(model.forward, backend="sloth", options={"inner": "aot_eager"})
        args = transformers.TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=batch,
                                              gradient_accumulation_steps=accumulate, max_steps=2, report_to=[],
                                              use_cpu=True, save_strategy="no", seed=0, data_seed=0,
                                              optim="sgd", learning_rate=0.1, lr_scheduler_type="constant")
        loss = transformers.Trainer(model=model, args=args, train_dataset=data).train().training_loss
        return loss, {n: p.detach().clone() for n, p in model.named_parameters()}

    eager_loss, eager_weights = train(False, 2, 2, tmp_path / "eager")
    sloth.reset_report()
    big_loss, big_weights = train(True, 4, 1, tmp_path / "big")
    sloth.reset_report()
    small_loss, small_weights = train(True, 2, 2, tmp_path / "accumulated")
    (site,) = [s for s in sloth.report().sites if s.family == "cross_entropy"]
    assert site.detail.startswith("sum"), str(sloth.report())  # the count divides outside the fused sum
    assert small_loss == pytest.approx(big_loss, rel=1e-5) and small_loss == pytest.approx(eager_loss, rel=1e-5)
    # SGD, not Adam: a weight moves by lr x its gradient, so the weights compare the gradients (Adam's first step
    # moves every weight by ~lr whatever its gradient's size, which turns rounding in a near-zero gradient into a
    # full step). Micro-batches averaged on their own would reweight them: the losses and weights differ then.
    for name, weight in small_weights.items():
        for other in (big_weights, eager_weights):
            torch.testing.assert_close(weight, other[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


_ACCELERATE_SCRIPT = """
import sys
import torch
import sloth  # before the Accelerator: it reads ACCELERATE_DYNAMO_BACKEND=SLOTH through accelerate's enum
from accelerate import Accelerator
sys.path.insert(0, {tests!r})
from test_models import VOCAB, build

accelerator = Accelerator(cpu=True)
model, optimizer = accelerator.prepare(build("llama", torch.float32), torch.optim.SGD([torch.zeros(1)], lr=0.1))
ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
loss = model(input_ids=ids, labels=ids).loss
accelerator.backward(loss)
print("BACKEND", accelerator.state.dynamo_plugin.backend.value)
print("COUNTS", sorted(sloth.report().counts.items()))
"""


def test_accelerate_launch_with_dynamo_backend_sloth(tmp_path) -> None:
    """``python -m sloth.launch --dynamo_backend sloth train.py``: accelerate's own launch command, with the name
    accepted (plain ``accelerate launch`` refuses it before the script runs: launch.py says why); the training
    process compiles the prepared model through sloth."""
    import ast
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_ACCELERATE_SCRIPT.format(tests=os.path.dirname(__file__)))
    done = subprocess.run([sys.executable, "-m", "sloth.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "sloth", str(script)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BACKEND SLOTH" in done.stdout, done.stdout[-2000:]
    counts = dict(ast.literal_eval(done.stdout.split("COUNTS", 1)[1].strip().splitlines()[0]))
    assert counts.get("rms_norm") == 5 and counts.get("cross_entropy") == 1, counts
