"""transformers' Trainer trains a model whose forward sloth compiled, and every family is found.

``TrainingArguments(torch_compile_backend="sloth")`` itself does not work: the Trainer hands the name
to accelerate, whose ``DynamoBackend`` enum accepts only the backends it lists ("'SLOTH' is not a valid
DynamoBackend", accelerate 1.15). Compiling ``model.forward`` before building the Trainer does, and is
what the README shows.
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
