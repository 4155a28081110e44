"""Activation offload (options={"offload": ...}; compiler/offload_partition.py, runtime/offload.py) on the CPU.

The copies are synchronous here, but the graph rewrite, the order of the reloads and their look-ahead, and the
pinned pool's bookkeeping are the GPU's: the gradients must be bit-identical with and without offload, since
moving a tensor and back changes no bit.
"""
from __future__ import annotations

import copy
import operator
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

import sloth
from sloth.compiler.offload_partition import offload_saved as _OFFLOAD_SAVED  # the rewrite, before any test wraps it
from sloth.runtime import offload as runtime
from checkpointing import enable_checkpointing
from test_models import VOCAB, build_lora, loss_and_grads


class Layer(nn.Module):
    """A pre-norm residual block: RMSNorm and SwiGLU written by hand, so sloth's ops run inside the body."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.Parameter(torch.rand(d) + 0.5)
        self.gate_up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Checkpointed(nn.Module):
    def __init__(self, d: int = 24, layers: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(d, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))

    def forward(self, x):
        x = self.proj(x)  # so the first layer's input is an activation, not a graph input
        for layer in self.layers:
            x = checkpoint.checkpoint(layer, x, use_reentrant=False)
        return x.square().mean()


def _step(model, run, x):
    model.zero_grad(set_to_none=True)
    loss = run(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _identical(a, b):
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(g, h) for g, h in zip(a[1], b[1]))


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_offload_gives_identical_gradients_and_says_what_it_moved(inner):
    model = Checkpointed()
    x = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(1))
    plain = _step(model, torch.compile(model, backend="sloth", options={"inner": inner}), x)
    assert sloth.report().offload == []
    torch._dynamo.reset()
    sloth.reset_report()
    runtime.reset_stats()
    run = torch.compile(model, backend="sloth", options={"inner": inner, "offload": {"min_bytes": 0}})
    _identical(_step(model, run, x), plain)
    report = sloth.report()
    [record] = report.offload
    # Four checkpointed layers save their inputs, and the loss saves the last layer's output: that one, read
    # first by the backward, stays; the layers' inputs go.
    assert (record.tensors, record.kept) == (4, 1), str(report)
    assert record.nbytes == 4 * x.numel() * 4
    assert "offloaded to host memory: 4 saved activation(s)" in str(report)
    assert report.counts.get("rms_norm") == 4 and report.counts.get("glu") == 4, str(report)
    stats = runtime.stats
    assert stats.offloaded == stats.reloaded == 4 and stats.offloaded_bytes == stats.reloaded_bytes == record.nbytes
    assert stats.prefetch_hits == 4  # each reload's copy was started ahead of it (the first by the prefetch)
    _identical(_step(model, run, x), plain)  # a second step, reusing the pool's buffers


def test_pool_reused_in_steady_state_and_two_forwards_before_backward():
    model = Checkpointed()
    xs = [torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    options = {"inner": "aot_eager"}
    plain = torch.compile(model, backend="sloth", options=options)

    def two_forwards(run):
        model.zero_grad(set_to_none=True)
        losses = [run(x) for x in xs]  # both graphs' saved tensors alive at once
        (losses[0] + 2 * losses[1]).backward()
        return torch.stack(losses).detach(), [p.grad.clone() for p in model.parameters()]

    expected = two_forwards(plain)
    torch._dynamo.reset()
    runtime.pool.clear()
    run = torch.compile(model, backend="sloth", options={**options, "offload": {"min_bytes": 0}})
    _identical(two_forwards(run), expected)
    held = runtime.pool.nbytes
    assert held == 2 * 4 * xs[0].numel() * 4  # one buffer per offloaded tensor per forward alive
    _identical(two_forwards(run), expected)
    assert runtime.pool.nbytes == held  # the second step took the first's buffers again


def test_no_grad_forward_offloads_nothing():
    model = Checkpointed()
    x = torch.randn(2, 7, 24)
    run = torch.compile(model, backend="sloth", options={"inner": "aot_eager", "offload": {"min_bytes": 0}})
    runtime.reset_stats()
    with torch.no_grad():
        got = run(x)
    torch.testing.assert_close(got, model(x))
    assert runtime.stats.offloaded == 0 and sloth.report().offload == []


def test_small_tensors_stay_by_default():
    model = Checkpointed()
    run = torch.compile(model, backend="sloth", options={"inner": "aot_eager", "offload": True})
    _step(model, run, torch.randn(2, 7, 24))
    [record] = sloth.report().offload
    assert record.tensors == 0 and record.skipped_small == 5, record  # every layer input is under 64 MiB


def test_transformers_checkpointing_with_peft_lora():
    model = build_lora("llama", torch.float32)
    model.config.num_hidden_layers = 2
    enable_checkpointing(model)
    model.train()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    plain = loss_and_grads(model, ids, run=torch.compile(model, backend="sloth", options={"inner": "aot_eager"}))
    torch._dynamo.reset()
    sloth.reset_report()
    run = torch.compile(model, backend="sloth", options={"inner": "aot_eager", "offload": {"min_bytes": 0}})
    got = loss_and_grads(model, ids, run=run)
    assert torch.equal(got[0], plain[0])
    assert got[1].keys() == plain[1].keys() and all(torch.equal(got[1][n], plain[1][n]) for n in got[1])
    report = sloth.report()
    assert sum(r.tensors for r in report.offload) >= 1, str(report)
    assert report.counts.get("lora", 0) > 0, str(report)


def _order_in_backward(mid_layer: bool, monkeypatch, graphs: Optional[list] = None,
                       **offload) -> tuple[list[str], tuple, list]:
    """(the sloth and attention ops of the backward graph, in order; loss and gradients; offload records) of a
    checkpointed 2-layer Llama with LoRA, offloaded with ``mid_layer`` (and the other ``offload`` options); the
    backward graph module is appended to ``graphs`` if given."""
    from sloth.compiler import offload_partition

    graphs = [] if graphs is None else graphs
    kept_before = len(graphs)

    def keeping(fw, bw, num_fwd_outputs, policy):
        record = _OFFLOAD_SAVED(fw, bw, num_fwd_outputs, policy)
        graphs.append(bw)
        return record

    monkeypatch.setattr(offload_partition, "offload_saved", keeping)
    model = build_lora("llama", torch.float32)
    model.config.num_hidden_layers = 2
    model.config.use_cache = False  # else transformers warns under checkpointing, which splits the graph
    enable_checkpointing(model)
    model.train()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    sloth.reset_report()
    run = torch.compile(model, backend="sloth",
                        options={"inner": "aot_eager", "offload": {"min_bytes": 0, "mid_layer": mid_layer, **offload}})
    got = loss_and_grads(model, ids, run=run)
    (bw,) = graphs[kept_before:]
    names = [n.target.name() for n in bw.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
             and (n.target.namespace == "sloth" or "scaled_dot_product" in n.target.name())]
    return names, got, sloth.report().offload


def test_mid_layer_residuals_offloaded_and_attention_recomputed_after_the_mlp_backward(monkeypatch):
    # offload's mid_layer: each checkpointed layer's residual between attention and MLP is saved (and offloaded),
    # so the backward recomputes a layer's attention only after that layer's MLP backward, not before it; the
    # same bits, one more tensor a layer moved.
    plain_order, plain, plain_records = _order_in_backward(False, monkeypatch)
    order, got, records = _order_in_backward(True, monkeypatch)
    assert torch.equal(got[0], plain[0])
    assert got[1].keys() == plain[1].keys() and all(torch.equal(got[1][n], plain[1][n]) for n in got[1])
    assert sum(r.tensors for r in records) == sum(r.tensors for r in plain_records) + 2

    def first(names, op):
        return next(i for i, name in enumerate(names) if name.startswith(op))

    # the first layer the backward reaches (the last): its attention recomputed before (plain) or after (mid_layer)
    # its MLP's backward
    assert first(plain_order, "sloth::rope") < first(plain_order, "sloth::glu_lora_linear_backward"), plain_order
    assert first(order, "sloth::rope") > first(order, "sloth::glu_lora_linear_backward"), order


@pytest.mark.parametrize("mid_layer", [True, False], ids=["mid_layer", "layer_inputs"])
def test_prefetch_after_attention_starts_the_next_copy_after_the_attention_backward(mid_layer, monkeypatch):
    # prefetch_after_attention: where an attention's backward runs between two reloads, the second's copy (and
    # its device buffer) starts right after it, from its own prefetch op, instead of with the first reload; the
    # same bits, the same tensors moved, every reload still announced by the one before or by a prefetch. On by
    # default: the run with the defaults is the late one.
    plain_order, plain, plain_records = _order_in_backward(mid_layer, monkeypatch, prefetch_after_attention=False)
    runtime.reset_stats()
    graphs = []
    order, got, records = _order_in_backward(mid_layer, monkeypatch, graphs)
    assert runtime.stats.reloaded > 0
    assert runtime.stats.prefetch_hits == runtime.stats.reloaded  # every copy started ahead
    (bw,) = graphs
    nodes = list(bw.graph.nodes)
    late = [n for n in nodes if n.target == torch.ops.sloth.offload_prefetch.default][1:]
    assert len(late) == 1, order
    # its ``after`` is an output of the attention backward just before it, and the reload before it starts no copy
    made_by = late[0].args[2]
    source = made_by.args[0] if made_by.target is operator.getitem else made_by
    assert "attention" in str(source.target) and "backward" in str(source.target), source.format_node()
    assert nodes.index(late[0]) == nodes.index(made_by) + 1
    reloads = [n for n in nodes if n.target == torch.ops.sloth.reload.default]
    before = [r for r in reloads if nodes.index(r) < nodes.index(late[0])]
    assert before[-1].args[1] is None and any(r.args[2] is late[0] for r in reloads), before[-1].format_node()
    assert torch.equal(got[0], plain[0])
    assert got[1].keys() == plain[1].keys() and all(torch.equal(got[1][n], plain[1][n]) for n in got[1])
    assert [r.tensors for r in records] == [r.tensors for r in plain_records]
    assert plain_order.count("sloth::offload_prefetch") == 1, plain_order  # the one at the top of the backward
    attention = [i for i, name in enumerate(order) if "scaled_dot_product" in name and "backward" in name]
    late_at = [i for i, name in enumerate(order) if name == "sloth::offload_prefetch"][1:]
    # the last layer's attention backward is followed by the copy the next reload needs; the first layer's is the
    # backward's last (nothing left to fetch); with more layers, each one's in between
    assert len(attention) == 2 and len(late_at) == 1, order
    assert late_at[0] == attention[0] + 1, order
    reload_at = [i for i, name in enumerate(order) if name == "sloth::reload"]
    assert any(r > late_at[0] for r in reload_at), order
    assert sloth.report().offload and all(r.tensors for r in records)


@pytest.mark.parametrize("value, message", [
    ("yes", "offload must be True, False or a dict"),
    ({"min_bytes": -1}, "min_bytes must be an integer >= 0"),
    ({"keep_last": 1.5}, "keep_last must be an integer >= 0"),
    ({"layers": 3}, "offload takes min_bytes, keep_last, mid_layer and prefetch_after_attention"),
    ({"mid_layer": 1}, "mid_layer must be True or False"),
    ({"prefetch_after_attention": "yes"}, "prefetch_after_attention must be True or False"),
])
def test_bad_offload_option(value, message):
    with pytest.raises(Exception, match=message):
        torch.compile(Checkpointed(), backend="sloth", options={"inner": "aot_eager", "offload": value})(
            torch.randn(2, 3, 24))


def test_offload_needs_a_partition():
    with pytest.raises(Exception, match="inner='eager'"):
        torch.compile(Checkpointed(), backend="sloth", options={"inner": "eager", "offload": True})(torch.randn(2, 3, 24))


class _Stream:
    """Records what a CUDA stream was told to wait for (the staging slots' device-side ordering)."""

    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


class _Event:
    def record(self, stream):
        self.stream = stream


def test_staging_slots_alternate_wait_for_their_last_copy_and_go_in_the_backward(monkeypatch):
    """Offloads stage through two slots in turn; a slot is rewritten only after the compute stream waits for the copy
    that last read it; a larger tensor gets a larger slot; release() makes the compute stream wait for every copy
    still reading a slot, then holds nothing (the CUDA path's bookkeeping, with CPU tensors and fake streams)."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    kept = []  # buffers handed to the side stream when a slot grows
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: kept.append((t.numel(), stream)))
    slots, compute, side = runtime.StagingSlots(), _Stream(), _Stream()
    xs = [torch.randn(3, 5) for _ in range(3)] + [torch.randn(4, 6, dtype=torch.float64)]
    staged, events = [], []
    for x in xs:
        staging = slots.stage(x, compute, side)
        assert torch.equal(staging, x) and staging.is_contiguous() and staging.dtype == x.dtype
        staged.append(staging.data_ptr())
        slots.copied(x.device, side)
        events.append(slots._slots[x.device][(len(events)) % 2][1])
    assert staged[0] == staged[2] and staged[0] != staged[1]  # two slots, taken in turn
    assert compute.waited == [events[0], events[1]]  # the third and fourth offloads waited for the first two copies
    assert slots.nbytes == 15 * 4 + 24 * 8  # the second slot grew to the fp64 tensor's size (bytes)
    assert kept == [(60, side)]  # its old buffer kept from reuse until the side stream's copies are done
    slots.release(xs[0].device, compute)
    assert compute.waited[2:] == [events[2], events[3]] and slots.nbytes == 0
    slots.release(xs[0].device, compute)  # nothing held: nothing to wait for
    assert len(compute.waited) == 4
