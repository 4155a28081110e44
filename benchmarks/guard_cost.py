"""Host time of Dynamo's guards per call of a compiled model, with and without a guard filter.

    python -m benchmarks.guard_cost [--layers 32]

A compiled model's every call first checks Dynamo's guards, several per parameter tensor; a Llama-3-8B
LoRA model has 739 parameter tensors, and the H200 profiles show 3.2-3.9 ms of "TorchDynamo Cache Lookup"
a LoRA step and 7.6 ms a QLoRA step (benchmarks/results/2026-11-30_0206_*, _0342_*). Here: a Llama of
``--layers`` tiny layers with peft LoRA on every linear (as many parameter tensors as the 8B model at 32
layers; nothing to compute), compiled with backend="eager" so that the call is guards plus the model's
Python, timed with the default guards and with ``torch.compiler``'s guard filters passed as
``options={"guard_filter_fn": ...}`` (``torch.compile`` takes that key for Dynamo, beside any backend's
options). Host-only: runs on a CPU.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=args.layers, num_attention_heads=2,
                                            num_key_value_heads=1, vocab_size=64, max_position_embeddings=64)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(transformers.AutoModelForCausalLM.from_config(cfg), LoraConfig(r=4, target_modules=targets))
    ids = torch.randint(0, 64, (1, 8))
    print(f"torch {torch.__version__}, {args.layers} layers, {sum(1 for _ in model.parameters())} parameter tensors")
    filters = {"default guards": None,
               "skip_guard_on_all_nn_modules_unsafe": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
               "keep_tensor_guards_unsafe": torch.compiler.keep_tensor_guards_unsafe}
    for label, guard_filter in filters.items():
        torch._dynamo.reset()
        options = {} if guard_filter is None else {"options": {"guard_filter_fn": guard_filter}}
        run = torch.compile(model, backend="eager", **options)
        with torch.no_grad():
            for _ in range(3):
                run(input_ids=ids)
            start, calls = time.perf_counter(), 30
            for _ in range(calls):
                run(input_ids=ids)
            per_call = (time.perf_counter() - start) / calls
            with torch.autograd.profiler.profile() as prof:
                for _ in range(5):
                    run(input_ids=ids)
        lookups = [e for e in prof.function_events if "Cache Lookup" in e.name]
        lookup_ms = sum(e.cpu_time_total for e in lookups) / max(1, len(lookups)) / 1e3
        print(f"{label:<38} call {per_call * 1e3:7.2f} ms, of it the guards (cache lookup) {lookup_ms:6.3f} ms")


if __name__ == "__main__":
    main()
