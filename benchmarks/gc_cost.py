"""What one full (generation-2) garbage collection costs in a process that trains a compiled model.

    python -m benchmarks.gc_cost [--layers 32] [--steps 30]

A generation-2 collection walks every object the collector tracks. Compiling a model leaves many (FX graphs,
guards, Inductor's artifacts), so a collection that lands inside a timed window shows as one slow step: an
H200 run of 2026-11-30 had one 848 ms step among 248-267 ms ones, with the GPU idle meanwhile (its telemetry).
Here: a Llama of ``--layers`` tiny layers with peft LoRA on every linear (the 8B model's parameter and op
count at 32 layers, nothing to compute), trained for ``--steps`` steps eager or compiled, then the tracked
object count, the collections during those steps by generation, and the time of ``gc.collect()``.
Host-only: runs on a CPU. benchmarks/e2e.py collects once before its timed steps for this reason.
"""
from __future__ import annotations

import argparse
import gc
import time
import warnings

import torch

from benchmarks import common


def run(backend: str, layers: int, steps: int) -> str:
    model, ids = common.tiny_lora_llama(layers)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    call = model if backend == "eager" else torch.compile(model, backend=backend)

    def step() -> None:
        call(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    with common.GcPauses() as pauses:
        for _ in range(steps):
            step()
    start = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - start) * 1e3
    return (f"{backend:<6} {len(gc.get_objects()):>8} tracked objects; in {steps} steps: {pauses.summary()}; "
            f"gc.collect() {full_ms:.0f} ms")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backends", default="eager,sloth")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    common.import_sloth()
    print(f"torch {torch.__version__}, {args.layers} layers")
    for backend in args.backends.split(","):  # eager first: the compiled run's objects add to the process's
        print(run(backend, args.layers, args.steps), flush=True)


if __name__ == "__main__":
    main()
