"""The MoE experts' dispatch (lowering/moe_routing.py): the counting sort against the PyTorch ops it replaced, host
time and GPU time a call.

    python -m benchmarks.ops.moe_routing [--smoke]

Rows per shape (tokens, top-k, experts; uniform random ids):

    counting     route(): the two Triton launches (order, sorted ids, offs, inverse, token of each row)
    sort         route_reference(): torch.sort (stable), searchsorted, an index-put for the inverse, a floor-divide
    invert       invert_order(): the backward's inverse and tokens from the saved order, one launch
    invert-ref   its PyTorch form (an index-put and a floor-divide)

"host us" is the median over 200 calls of the call's own time on the host, no sync (what a host-bound step pays);
"GPU us" is the GPU's time a call, from 20 calls captured in one CUDA graph and replayed (no host in it). With
--smoke (no CUDA) the counting sort runs in the interpreter against the sort at a small shape, values compared.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks import common

SHAPES = [  # (tokens, top-k, experts)
    (4096, 8, 128),  # Qwen3-MoE's step, 2 x 2048 tokens
    (8192, 8, 128),  # the most the counting sort takes at 128 experts (MAX_BLOCKS blocks)
    (4096, 4, 32),  # GPT-OSS-20B
    (4096, 8, 256),  # DeepSeek-V3
]


def _providers(mr, index: torch.Tensor, n_experts: int):
    order = index.reshape(-1).argsort(stable=True)
    top_k = index.shape[1]
    return {"counting": lambda: mr.route(index, n_experts), "sort": lambda: mr.route_reference(index, n_experts),
            "invert": lambda: mr.invert_order(order, top_k),
            "invert-ref": lambda: mr.invert_order_reference(order, top_k)}


def _host_us(fn, calls: int = 200) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _gpu_us(fn, calls: int = 20, replays: int = 10) -> float:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, one small shape, values only")
    args = parser.parse_args(argv)
    common.use_triton_interpreter_without_cuda()
    common.import_sloth()
    from sloth.lowering import moe_routing as mr

    if not torch.cuda.is_available():
        if not args.smoke:
            raise SystemExit("no CUDA device: use --smoke")
        index = torch.randint(0, 16, (300, 4))
        same = all(torch.equal(a, b) for a, b in zip(mr.route(index, 16), mr.route_reference(index, 16)))
        print(f"smoke: counting sort equals the stable sort: {same}")
        return 0 if same else 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| tokens | top-k | experts | provider | host us | GPU us |\n|---|---|---|---|---|---|")
    for tokens, top_k, n_experts in SHAPES:
        index = torch.randint(0, n_experts, (tokens, top_k), device="cuda")
        for name, fn in _providers(mr, index, n_experts).items():
            print(f"| {tokens} | {top_k} | {n_experts} | {name} | {_host_us(fn):.1f} | {_gpu_us(fn):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
