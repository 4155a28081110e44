"""Recompute instead of save (compiler/recompute.py): RMSNorm outputs that a backward reads are recomputed
there, under the partitioner Inductor uses, with gradients bit for bit those of the saving graph."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy

import sloth
from sloth.compiler.backend import sloth_backend
from checkpointing import enable_checkpointing
from test_models import VOCAB, build_lora

def _partitioned(options: dict, graphs: dict):
    """A backend: sloth's passes, then AOTAutograd with Inductor's min-cut partitioner and no codegen; the
    forward and backward graphs land in ``graphs``."""
    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return gm.forward
        return compiler

    def backend(gm, example_inputs):
        sloth_backend(gm, example_inputs, options={"inner": "eager", **options})  # rewrites gm in place
        return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                            partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)

    return backend


def _saved_norm_outputs(forward: torch.fx.GraphModule) -> int:
    """How many of the forward graph's outputs (the user's outputs, then what the backward keeps) are
    sloth.rms_norm results or views of one."""
    def origin(node):
        while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args and \
                isinstance(node.args[0], torch.fx.Node) and getattr(node.target, "is_view", False):
            node = node.args[0]
        return node

    (outputs,) = [n.args[0] for n in forward.graph.nodes if n.op == "output"]
    return sum(1 for o in outputs if isinstance(o, torch.fx.Node)
               and getattr(origin(o), "target", None) is torch.ops.sloth.rms_norm.default)


def _norm_calls(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is torch.ops.sloth.rms_norm.default)


def _loss_and_lora_grads(model, ids, run):
    loss = run(input_ids=ids, labels=ids).loss
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    return [loss.detach(), *torch.autograd.grad(loss, params)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_model_recomputes_the_norms_the_adapters_read(dtype):
    model = build_lora("llama", dtype)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    results, graphs = {}, {}
    for recompute in (False, True):
        graphs[recompute] = {}
        torch._dynamo.reset()
        sloth.reset_report()
        compiled = torch.compile(model, backend=_partitioned({"recompute": recompute}, graphs[recompute]))
        results[recompute] = _loss_and_lora_grads(model, ids, compiled)
        # 2 layers x (input norm, post-attention norm) + the final norm
        assert sloth.report().counts["rms_norm"] == 5
        assert sloth.report().recomputed == ({"rms_norm": 5} if recompute else {}), str(sloth.report())
    # Saving: each layer's two norm outputs are kept for the adapters' weight gradients. The final norm's feeds
    # the fused loss, which forms its gradient in the forward and keeps nothing of it, and it is one output more:
    # the input of the returned logits, for their gradient should one arrive (patterns/returned_logits.py).
    assert _saved_norm_outputs(graphs[False]["forward"]) == 4 + 1
    assert _norm_calls(graphs[False]["backward"]) == 0
    # Recomputing: none of the layers' kept, all four recomputed in the backward from the residual stream it
    # keeps anyway; the final norm's output is still returned.
    assert _saved_norm_outputs(graphs[True]["forward"]) == 0 + 1
    assert _norm_calls(graphs[True]["backward"]) == 4
    # ... each just before the backward op that reads it (the partitioner's autograd-order pass), not all at
    # the start of the backward, which would hold them all at once again.
    sloth_ops = [str(n.target) for n in graphs[True]["backward"].graph.nodes
                 if n.op == "call_function" and str(n.target).startswith("sloth.")]
    assert all(not (a == b == "sloth.rms_norm.default") for a, b in zip(sloth_ops, sloth_ops[1:])), sloth_ops
    for saved, recomputed in zip(results[False], results[True]):
        torch.testing.assert_close(recomputed, saved, rtol=0, atol=0)


class CheckpointedBlock(nn.Module):
    """A norm inside torch.utils.checkpoint: its tags come from the checkpoint, not from sloth."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.w = nn.Parameter(torch.randn(hidden))
        self.proj = nn.Linear(hidden, hidden)

    def inner(self, x):
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.w
        return self.proj(y)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def test_checkpointed_bodies_keep_their_own_policy():
    model = CheckpointedBlock()
    x = torch.randn(4, 32, requires_grad=True)
    graphs: dict = {}
    torch._dynamo.reset()
    sloth.reset_report()
    out = torch.compile(model, backend=_partitioned({}, graphs))(x)
    out.sum().backward()
    assert sloth.report().counts.get("rms_norm") == 1
    assert sloth.report().recomputed == {}  # the norm is in the checkpoint's body, recomputed by it already
    ref = copy.deepcopy(model)
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_recompute_option_must_be_a_bool():
    with pytest.raises(ValueError, match="recompute"):
        sloth_backend(torch.fx.symbolic_trace(lambda t: t + 1), [torch.randn(2)], options={"recompute": "yes"})


def test_report_names_what_is_recomputed():
    def norm_then_linear(x, w, p):
        xf = x.float()
        return F.linear((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w, p)

    x, w, p = torch.randn(3, 16), torch.randn(16), torch.randn(8, 16, requires_grad=True)
    torch._dynamo.reset()
    sloth.reset_report()
    torch.compile(norm_then_linear, backend="sloth", options={"inner": "aot_eager"})(x, w, p).sum().backward()
    assert "marked to be recomputed in backward, not saved: 1 sloth.rms_norm outputs" in str(sloth.report())


def _strict_cleanup_recompute_tags(joint_module, *, is_default_partition):
    """torch's cleanup_recompute_tags as older releases wrote it: ``ac_graph_id`` read from every pair of
    tagged nodes without checking that it is there."""
    from torch._functorch.partitioners import must_recompute

    for node in joint_module.graph.nodes:
        if must_recompute(node):
            for user in node.users:
                if must_recompute(user) and user.meta["ac_graph_id"] > node.meta["ac_graph_id"]:
                    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return joint_module


@pytest.mark.parametrize("strict", [False, True], ids=["this-torch", "older-partitioner"])
def test_checkpointed_lora_model_with_tagged_norms(monkeypatch, strict):
    # Checkpointed layers feed the final norm, which sloth tags: both kinds of tag meet in the partitioner.
    if strict:
        import torch._functorch.partitioners as partitioners

        monkeypatch.setattr(partitioners, "cleanup_recompute_tags", _strict_cleanup_recompute_tags)
    model = build_lora("llama", torch.float32)
    enable_checkpointing(model, use_reentrant=False)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    eager = _loss_and_lora_grads(model, ids, model)
    graphs: dict = {}
    torch._dynamo.reset()
    sloth.reset_report()
    compiled = _loss_and_lora_grads(model, ids, torch.compile(model, backend=_partitioned({}, graphs)))
    assert sloth.report().recomputed == {"rms_norm": 1}  # the final norm; the layers' are in checkpoint bodies
    for ours, theirs in zip(compiled, eager):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
