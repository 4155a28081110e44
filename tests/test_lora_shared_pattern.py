"""LoRA linears reading one input become one ``sloth.lora_linear_shared`` (patterns/lora_shared.py).

Hand-written modules (no peft, no transformers): three adapted projections of one x, each written in a
different but equivalent style, and the near misses the join must leave apart (another scale, another
rank, another adapter dtype, the option off). Each compiles with the sloth backend through AOT autograd;
the output and the gradients of x and every factor are compared with eager under the tolerance rule, and
the graph is read for what became one op. peft models are covered in tests/test_models.py (q, k, v and
gate, up joined in Llama, Qwen3 and Gemma3; Phi3's merged projections have nothing to join).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sloth
from sloth.compiler.backend import sloth_backend
from pattern_checks import forward_backward, graph_of, seeded
from tolerance import assert_close

K = 40


class ThreeProjections(nn.Module):
    """q, k and v of one x: frozen bases [N_i, K] and adapters (A_i [r_i, K], B_i [N_i, r_i]) written three
    ways: ``F.linear + s * (x @ A.T) @ B.T``, ``x @ W.T + linear(linear(x, A), B) * s`` and the scale on x."""

    def __init__(self, ranks=(4, 4, 4), scales=(2.0, 2.0, 2.0), adapter_dtypes=(None, None, None)):
        super().__init__()
        g = seeded(0)
        self.scales = scales
        for name, n, r, dt in zip("qkv", (24, 8, 8), ranks, adapter_dtypes):
            setattr(self, f"w{name}", nn.Parameter(torch.randn(n, K, generator=g) / math.sqrt(K), requires_grad=False))
            a = nn.Parameter(torch.randn(r, K, generator=g) / math.sqrt(K))
            b = nn.Parameter(torch.randn(n, r, generator=g) / math.sqrt(r))
            setattr(self, f"a{name}", a)
            setattr(self, f"b{name}", b)
            self._adapter_dtypes = adapter_dtypes
        self.bias_q = nn.Parameter(torch.randn(24, generator=g), requires_grad=False)

    def to(self, dtype):  # the frozen bases in dtype; an adapter given its own dtype keeps it (peft's fp32 adapter)
        super().to(dtype)
        for name, dt in zip("qkv", self._adapter_dtypes):
            if dt is not None:
                for f in "ab":
                    setattr(self, f"{f}{name}", nn.Parameter(getattr(self, f"{f}{name}").detach().to(dt)))
        return self

    def forward(self, x):
        sq, sk, sv = self.scales
        q = F.linear(x, self.wq, self.bias_q) + sq * (x.to(self.aq.dtype) @ self.aq.t()) @ self.bq.t()
        k = x @ self.wk.t() + F.linear(F.linear(x.to(self.ak.dtype), self.ak), self.bk) * sk
        v = F.linear(x, self.wv) + F.linear(F.linear(x.to(self.av.dtype) * sv, self.av), self.bv)
        return torch.cat([q.to(x.dtype), k.to(x.dtype), v.to(x.dtype)], -1)


def _trainable(m):
    return [p for p in m.parameters() if p.requires_grad]


def check(make, dtype, shared: int, options=None):
    """Compile ``make()`` with sloth, compare with eager and float64, and count the joined sites."""
    x = torch.randn(3, 5, K, generator=seeded(1))
    module = make().to(dtype)
    eager = forward_backward(module, [x.to(dtype)], _trainable(module))
    ref_module = make().double()
    reference = forward_backward(ref_module, [x.double()], _trainable(ref_module), dy_dtype=eager[0].dtype)
    module = make().to(dtype)
    compiled = torch.compile(module, backend="sloth", options={"inner": "aot_eager", **(options or {})},
                             fullgraph=True)
    actual = forward_backward(compiled, [x.to(dtype)], _trainable(module))
    report = sloth.last_report()
    sites = [s for s in report.sites if s.family == "lora"]
    assert len(sites) == 3, str(report)
    assert sum(s.op == "sloth.lora_linear_shared" for s in sites) == shared, str(report)
    names = ["out", "dx"] + [n for n, p in module.named_parameters() if p.requires_grad]
    for name, a, e, r in zip(names, actual, eager, reference):
        assert_close(f"{name}", a, e, r)
    return report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_three_projections_become_one_op(dtype):
    report = check(ThreeProjections, dtype, shared=3)
    details = [s.detail for s in report.sites if s.family == "lora"]
    assert all("one op with" in d and "(x read once)" in d for d in details), details
    gm = graph_of(ThreeProjections().to(dtype), torch.randn(2, K).to(dtype))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "sloth" in str(n.target)]
    assert targets == ["sloth.lora_linear_shared.default"], targets


def test_fp32_adapters_under_a_bf16_base():
    check(lambda: ThreeProjections(adapter_dtypes=(torch.float32,) * 3), torch.bfloat16, shared=3)


@pytest.mark.parametrize("make,shared", [
    pytest.param(lambda: ThreeProjections(scales=(2.0, 2.0, 0.5)), 2, id="v-another-scale"),
    pytest.param(lambda: ThreeProjections(scales=(2.0, 1.0, 0.5)), 0, id="three-scales"),
    pytest.param(lambda: ThreeProjections(ranks=(4, 4, 2)), 2, id="v-another-rank"),
    pytest.param(lambda: ThreeProjections(adapter_dtypes=(None, None, torch.float32)), 2, id="v-another-dtype"),
])
def test_members_must_agree(make, shared):
    check(make, torch.bfloat16, shared=shared)


def test_the_join_can_be_switched_off():
    check(ThreeProjections, torch.bfloat16, shared=0, options={"share_lora_input": False})
    with pytest.raises(Exception, match="share_lora_input must be True or False"):  # inside Dynamo's wrapper
        torch.compile(ThreeProjections(), backend="sloth", options={"share_lora_input": "yes"})(torch.randn(2, K))


# ---------------------------------------------------------------------------------------------------
# What the join must not do (found by a second reviewer): move a member across an in-place write or a
# grad-mode change, forget the option inside a checkpointed layer, or build kernels too wide for the GPU
# ---------------------------------------------------------------------------------------------------

class TwoProjections(nn.Module):
    """q and k on one x, with ``between`` run between them: a barrier the join must respect."""

    def __init__(self, between: str, rank: int = 4):
        super().__init__()
        g = seeded(0)
        self.between = between
        for name, n in zip("qk", (24, 8)):
            setattr(self, f"w{name}", nn.Parameter(torch.randn(n, K, generator=g) / math.sqrt(K), requires_grad=False))
            setattr(self, f"a{name}", nn.Parameter(torch.randn(rank, K, generator=g) / math.sqrt(K)))
            setattr(self, f"b{name}", nn.Parameter(torch.randn(n, rank, generator=g) / math.sqrt(rank)))
        self.t = nn.Parameter(torch.tensor(0.5))

    def _lora(self, x, name):
        w, a, b = (getattr(self, f"{p}{name}") for p in "wab")
        return F.linear(x, w) + 2.0 * (x @ a.t()) @ b.t()

    def forward(self, inp):
        x = inp * 1.0
        if self.between == "no_grad_q":
            with torch.no_grad():
                q = self._lora(x, "q")
        else:
            q = self._lora(x, "q")
        if self.between == "mul_":
            x.mul_(3.0)  # k must read the scaled x
        k = self._lora(x, "k")
        return torch.cat([q * k.sum(-1, keepdim=True), k], -1) + self.t * inp.sum()


def _run(module, x, options, grad=True):
    compiled = torch.compile(module, backend="sloth", options={"inner": "aot_eager", **options}, fullgraph=True)
    with torch.set_grad_enabled(grad):
        y = compiled(x)
    grads = {}
    if grad:
        y.sum().backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}
    ops = [s.op for s in sloth.last_report().sites if s.family == "lora"]
    return y.detach(), grads, ops


@pytest.mark.parametrize("between,grad", [("mul_", False), ("no_grad_q", True)],
                         ids=["in-place-write", "no-grad-region"])
def test_no_member_is_moved_across_a_barrier(between, grad):
    x = torch.randn(3, K, generator=seeded(1))
    eager_module = TwoProjections(between)
    with torch.set_grad_enabled(grad):
        y_eager = eager_module(x)
    eager_grads = {}
    if grad:
        y_eager.sum().backward()
        eager_grads = {n: p.grad for n, p in eager_module.named_parameters() if p.requires_grad}
    y, grads, ops = _run(TwoProjections(between), x, {}, grad=grad)
    assert ops == ["sloth.lora_linear"] * 2, ops
    torch.testing.assert_close(y, y_eager.detach(), rtol=1e-5, atol=1e-5)
    for name, g in eager_grads.items():  # aq, bq: None under no_grad, as in eager
        assert (grads[name] is None) == (g is None), name
        if g is not None:
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5)


def test_the_option_reaches_checkpointed_layers():
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = ThreeProjections()

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    x = torch.randn(3, K, generator=seeded(1))
    for share, op in ((False, "sloth.lora_linear"), (True, "sloth.lora_linear_shared")):
        _, _, ops = _run(Checkpointed(), x, {"share_lora_input": share})
        assert ops == [op] * 3, (share, ops)


@pytest.mark.parametrize("rank,ops", [
    (32, ["sloth.lora_linear_shared"] * 3),  # 96 adapter columns: one op
    (64, ["sloth.lora_linear_shared"] * 2 + ["sloth.lora_linear"]),  # 192: q + k joined, v alone
    (128, ["sloth.lora_linear"] * 3),  # 384: none joined
])
def test_a_group_is_cut_at_128_adapter_columns(rank, ops):
    """The joined kernels tile n r columns; past 128 the up and grad tiles outgrow the H200's shared memory."""
    x = torch.randn(3, K, generator=seeded(1))
    _, _, got = _run(ThreeProjections(ranks=(rank,) * 3), x, {}, grad=False)
    assert sorted(got) == sorted(ops), got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inductor_with_a_dynamic_batch(dtype):
    """The joined op through Inductor (the default inner compiler) with the batch marked dynamic: one graph
    serves three batch sizes, each within the tolerance rule of eager."""
    module = ThreeProjections().to(dtype)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return sloth_backend(gm, example_inputs)

    compiled = torch.compile(module, backend=backend)
    for batch in (3, 5, 7):
        x = torch.randn(batch, 5, K, generator=seeded(batch))
        eager_module = ThreeProjections().to(dtype)
        eager = forward_backward(eager_module, [x.to(dtype)], _trainable(eager_module))
        ref_module = ThreeProjections().double()
        reference = forward_backward(ref_module, [x.double()], _trainable(ref_module), dy_dtype=eager[0].dtype)
        xd = x.to(dtype).requires_grad_(True)
        torch._dynamo.mark_dynamic(xd, 0)  # on the leaf itself (forward_backward's detached copy would drop it)
        out = compiled(xd)
        dy = torch.randn(out.shape, generator=seeded(3)).to(out.dtype)  # forward_backward's cotangent
        actual = [out.detach(), *torch.autograd.grad(out, [xd, *_trainable(module)], dy)]
        assert [s.op for s in sloth.last_report().sites if s.family == "lora"] == ["sloth.lora_linear_shared"] * 3
        for name, a, e, r in zip(["out", "dx", "daq", "dbq", "dak", "dbk", "dav", "dbv"], actual, eager, reference):
            assert_close(f"{name} batch {batch}", a, e, r)
    assert len(graphs) == 1, f"{len(graphs)} graphs for three batch sizes"
