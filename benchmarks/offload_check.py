"""On a GPU: the offload option's gradients bit-identical to sloth's without it, and no host sync in a step.

    python -m benchmarks.offload_check            # CUDA; prints one JSON line, exits 1 on a mismatch

The CPU tests (tests/test_offload.py) check the graph rewrite and the bookkeeping with synchronous copies; this
runs the same model on the device, where the copies are asynchronous on a side stream, so a missing wait or
a buffer reused too early would show as a changed bit. Four steps each way, the model big enough (8 layers,
2 x 2048 x 1024 bf16) that copies and compute overlap.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

from benchmarks import common
from benchmarks.copy_overlap import count_syncs


class Layer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.Parameter(torch.rand(d) + 0.5)
        self.gate_up = nn.Linear(d, 6 * d, bias=False)
        self.down = nn.Linear(3 * d, d, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.norm
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, d: int = 1024, layers: int = 8):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))

    def forward(self, x):
        x = self.proj(x)
        for layer in self.layers:
            x = checkpoint.checkpoint(layer, x, use_reentrant=False)
        return x.float().square().mean()


def main() -> int:
    sloth = common.import_sloth()
    from sloth.runtime import offload

    torch.manual_seed(0)
    model = Model().cuda().to(torch.bfloat16)
    xs = [torch.randn(2, 2048, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(4)]

    def steps(run):
        out = []
        for x in xs:
            model.zero_grad(set_to_none=True)
            loss = run(x)
            loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        return out

    plain = steps(torch.compile(model, backend="sloth"))
    torch._dynamo.reset()
    sloth.reset_report()
    offload.reset_stats()
    run = torch.compile(model, backend="sloth", options={"offload": {"min_bytes": 1 << 20}})
    got = steps(run)
    torch.cuda.synchronize()
    identical = all(torch.equal(a[0], b[0]) and all(torch.equal(g, h) for g, h in zip(a[1], b[1]))
                    for a, b in zip(got, plain))

    def one_step():
        model.zero_grad(set_to_none=True)
        run(xs[0]).backward()

    syncs = count_syncs(one_step)
    report = sloth.report()
    print(json.dumps({"identical": identical, "syncs in a step": syncs, "stats": offload.stats.__dict__,
                      "offload": [r.__dict__ for r in report.offload], "pinned MiB": offload.pool.nbytes / 2**20}))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
