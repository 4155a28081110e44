"""The ``unsloth`` variant of benchmarks/e2e.py: the same random-weight model, loaded and adapted by Unsloth.

Unsloth 2026.10.9 loads models only from a checkpoint, and applies its fast paths (fused QKV, O and MLP
LoRA, its RMSNorm/RoPE/SwiGLU kernels, chunked cross-entropy, each decoder block compiled as one region)
while it loads, so the variant (shared/BENCHMARKING.md's recipe):

1. imports ``unsloth`` before anything imports transformers (``import_first``; it patches transformers);
2. builds the seed-0 model every other variant trains and saves it with a tokenizer (a WordLevel vocabulary
   of the model's size, which Unsloth's loader insists on) to a temporary directory;
3. loads it with ``FastLanguageModel.from_pretrained(dir, dtype=bf16, load_in_4bit=--qlora,
   local_files_only=True)`` and adds LoRA r=16, alpha 16, dropout 0 on the same projections with
   ``FastLanguageModel.get_peft_model``; gradient checkpointing is Unsloth's own ("unsloth", offloaded)
   with --grad-ckpt and off otherwise (its loader turns it on by default).

The first step's loss must then agree with the other variants' (same weights, same batch; LoRA B starts at
zero). Needs the wheels of benchmarks/unsloth_wheels.sh and a GPU (Unsloth refuses to import without one).
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch


def import_first() -> None:
    """Import Unsloth now, offline: it must patch transformers before transformers is imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    import unsloth  # noqa: F401


def save_checkpoint(model: torch.nn.Module, vocab_size: int, path: Path) -> None:
    """``model`` and a tokenizer of ``vocab_size`` WordLevel tokens ("t0", "t1", ...) saved to ``path``."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")),
                                        unk_token="t0", pad_token="t0", bos_token="t1", eos_token="t2")
    tokenizer.save_pretrained(path)


def build_model(args: argparse.Namespace, device: str, targets: list[str],
                random_base_model: Callable[[argparse.Namespace, str], tuple[torch.nn.Module, Any]]
                ) -> tuple[torch.nn.Module, Any]:
    """(Unsloth's LoRA model of ``args.model``, its config): see the module docstring."""
    from unsloth import FastLanguageModel

    base, cfg = random_base_model(args, device)
    checkpoint = Path(tempfile.mkdtemp(prefix=f"sloth-e2e-{args.model}-"))
    save_checkpoint(base, cfg.vocab_size, checkpoint)
    del base
    torch.cuda.empty_cache()
    checkpointing = "unsloth" if args.grad_ckpt else False
    model, _ = FastLanguageModel.from_pretrained(str(checkpoint), max_seq_length=args.seq, dtype=torch.bfloat16,
                                                 load_in_4bit=args.qlora, local_files_only=True,
                                                 use_gradient_checkpointing=checkpointing)
    from benchmarks.e2e import expert_targets

    experts = expert_targets(args)  # LoRA on the expert weights too: peft's target_parameters, passed through
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                             target_modules=targets, use_gradient_checkpointing=checkpointing,
                                             random_state=0, **({"target_parameters": experts} if experts else {}))
    model.train()
    return model, cfg
