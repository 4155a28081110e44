"""DTensor values reaching sloth's ops (issue 21): refused with the reason, never a crash.

Tensor parallelism (``parallelize_module``) shards a module's weights as DTensors. With the default layouts
(``use_local_output=True``) each parallel linear hands plain local tensors on, so the norm and the GLU after it
see plain tensors and are replaced. With ``use_local_output=False`` the GLU's operands are DTensors, for which
sloth's ops have no sharding rule: the graph must run as written, every site reported with that reason
(compiler/subclass_guard.py), with eager's output and gradients. One process, a one-rank gloo group and a CPU mesh.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sloth

pytest.importorskip("torch.distributed.tensor.parallel")


class NormGatedMLP(nn.Module):
    """An RMSNorm (written out) and a SwiGLU MLP with separate gate, up and down linears."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)
        self.down = nn.Linear(24, 16, bias=False)
        self.weight = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.down(F.silu(self.gate(h)) * self.up(h))


@pytest.fixture
def mesh(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def _run(model: nn.Module, compiled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    fn = torch.compile(model, backend="sloth", options={"inner": "aot_eager"}) if compiled else model
    out = fn(x)
    (out * torch.linspace(-1, 1, 16)).sum().backward()
    grad_w = model.weight.grad.clone()
    model.weight.grad = None
    return out.detach(), x.grad, grad_w


@pytest.mark.parametrize("local_output", [True, False], ids=["local-outputs", "dtensor-outputs"])
def test_tensor_parallel_mlp(mesh, local_output: bool) -> None:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = NormGatedMLP()
    plan = {"gate": ColwiseParallel(use_local_output=local_output), "up": ColwiseParallel(use_local_output=local_output),
            "down": RowwiseParallel(input_layouts=Shard(-1))}
    parallelize_module(model, mesh, plan)
    eager = _run(model, compiled=False)
    sloth.reset_report()
    ours = _run(model, compiled=True)
    for got, want in zip(ours, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    report = sloth.report()
    assert not report.unexplained, str(report)
    if local_output:
        assert report.counts == {"rms_norm": 1, "glu": 1}, str(report)
    else:
        assert not report.counts, str(report)
        reasons = {(r.family, r.reason.split(" (")[0]) for r in report.rejections}
        assert reasons == {("rms_norm", "a DTensor value"), ("glu", "a DTensor value")}, str(report)
        assert all("no DTensor rule" in r.reason for r in report.rejections), str(report)
