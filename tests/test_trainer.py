"""transformers' Trainer trains a model sloth compiled, and every family is found: compiled by hand
(``model.forward = torch.compile(...)``) or by the Trainer itself with
``TrainingArguments(torch_compile_backend="sloth")``, which accelerate accepts once ``import sloth`` has
added the name to its ``DynamoBackend`` enum (compiler/accelerate_name.py).
"""
from __future__ import annotations

import pytest
import torch

import sloth
from test_models import VOCAB, build

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_trainer_trains_a_sloth_compiled_model(tmp_path) -> None:
    model = build("llama", torch.float32)
    reference = build("llama", torch.float32)
    ids = torch.randint(3, VOCAB, (8, 11), generator=torch.Generator().manual_seed(4))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                          report_to=[], use_cpu=True, save_strategy="no", seed=0, data_seed=0)
    losses = []
    for m, compile_it in ((reference, False), (model, True)):
        if compile_it:
            m.forward = torch.compile(m.forward, backend="sloth", options={"inner": "aot_eager"})
        losses.append(transformers.Trainer(model=m, args=args, train_dataset=data).train().training_loss)
    counts = sloth.report().counts
    assert counts.get("rms_norm") == 5 and counts.get("rope") == 2 and counts.get("glu") == 2, counts
    assert counts.get("cross_entropy") == 1, counts
    assert losses[1] == pytest.approx(losses[0], rel=1e-4), losses


def test_training_arguments_torch_compile_backend_sloth(tmp_path) -> None:
    from accelerate.utils.dataclasses import DynamoBackend

    assert DynamoBackend("SLOTH").value == "SLOTH"  # added by import sloth
    model, reference = build("llama", torch.float32), build("llama", torch.float32)
    ids = torch.randint(3, VOCAB, (8, 11), generator=torch.Generator().manual_seed(4))
    data = [{"input_ids": row, "labels": row} for row in ids]
    common = dict(per_device_train_batch_size=4, max_steps=2, report_to=[], use_cpu=True, save_strategy="no",
                  seed=0, data_seed=0)
    sloth.reset_report()
    losses = []
    for m, backend in ((reference, None), (model, "sloth")):
        extra = {"torch_compile_backend": backend} if backend else {}
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(backend)), **common, **extra)
        losses.append(transformers.Trainer(model=m, args=args, train_dataset=data).train().training_loss)
    counts = sloth.report().counts  # the Trainer compiled with backend "sloth" (Inductor inside)
    assert counts.get("rms_norm") == 5 and counts.get("rope") == 2 and counts.get("glu") == 2, counts
    assert counts.get("cross_entropy") == 1, counts
    assert losses[1] == pytest.approx(losses[0], rel=1e-4), losses
