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

from benchmarks import common


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    model, ids = common.tiny_lora_llama(args.layers)
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
