"""The sloth demo: compile a real-architecture model with ``backend="sloth"`` and train it beside eager.

    python -m sloth.demo [--model qwen3] [--steps 5]

Builds a small random-weight model from a transformers config (Qwen3 by default: RMSNorm on the
residual stream and on q/k heads) with peft LoRA adapters on every linear layer (``--full`` trains all
weights instead), prints what sloth replaced, then trains two identical copies for a few AdamW steps,
one eager and one compiled, and prints both losses side by side. On a GPU it runs the Triton kernels
natively in bf16; without one, through Triton's CPU interpreter in fp32.
"""
from __future__ import annotations

import argparse
import copy
import os
import time

import torch

if not torch.cuda.is_available():
    # Must happen before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import sloth  # noqa: E402


def build_model(model_type: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    big = device == "cuda"
    cfg = AutoConfig.for_model(
        model_type, hidden_size=1024 if big else 64, intermediate_size=2816 if big else 128,
        num_hidden_layers=4 if big else 2, num_attention_heads=16 if big else 4, num_key_value_heads=4 if big else 2,
        vocab_size=32000 if big else 256, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    if getattr(cfg, "head_dim", None) is not None:
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg).to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3", help="a transformers model_type (llama, qwen3, gemma3_text, ...)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch, seq = (4, 512) if device == "cuda" else (2, 32)
    eager_model = build_model(args.model, device, dtype)
    if not args.full:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise SystemExit("the LoRA demo needs peft (pip install peft, or the '.[interpreter]' extra); "
                             "--full trains without it")

        eager_model = get_peft_model(eager_model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    sloth_model = copy.deepcopy(eager_model)
    vocab = eager_model.config.vocab_size
    trainable = sum(p.numel() for p in eager_model.parameters() if p.requires_grad)
    print(f"{args.model}: {sum(p.numel() for p in eager_model.parameters()) / 1e6:.1f}M parameters "
          f"({trainable / 1e6:.2f}M trained{'' if args.full else ', LoRA r=8'}), {dtype}, "
          f"batch {batch} x {seq} on {device}"
          + ("" if device == "cuda" else " (Triton through its CPU interpreter)"))

    compiled = torch.compile(sloth_model, backend="sloth")
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
                  for m in (eager_model, sloth_model)]
    generator = torch.Generator(device=device).manual_seed(0)
    print(f"{'step':>4}  {'eager loss':>10}  {'sloth loss':>10}  {'sloth ms':>8}")
    for step in range(args.steps):
        ids = torch.randint(3, vocab, (batch, seq), device=device, generator=generator)
        losses = []
        for run, opt in zip((eager_model, compiled), optimizers):
            start = time.perf_counter()
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            elapsed = (time.perf_counter() - start) * 1e3
        if step == 0:
            print(sloth.report())
        print(f"{step:>4}  {losses[0]:>10.4f}  {losses[1]:>10.4f}  {elapsed:>8.1f}"
              + ("  (includes compiling)" if step == 0 else ""))


if __name__ == "__main__":
    main()
