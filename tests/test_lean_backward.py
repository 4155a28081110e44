"""The backward rewrites of compiler/lean_backward.py: recomputed LoRA forwards read only for h dropped,
gradients written over activations nothing reads again, and input norms formed again after the attention's
backward.

The backward ops given no h recompute the forward's h bit for bit; the in-place GLU-LoRA backward gives the
functional one's numbers bit for bit, with d_gate and d_up in gate's and up's memory; each rewrite applies
only where its conditions hold (the forward's y unread; gate and up made by the graph, read by nothing else,
sharing their memory with nothing); and a checkpointed LoRA Llama through Inductor gets all three in its
backward, with the same loss and gradients bit for bit as without them; its tiled MLP is not run again at all, nor,
with offload's mid_layer, its o_proj.
"""
from __future__ import annotations

import functools
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

import sloth
from sloth.compiler import lean_backward
from sloth.lowering import glu_lora, lora
from checkpointing import enable_checkpointing
from pattern_checks import seeded
from test_models import VOCAB, build_lora, loss_and_grads


def _backward_args(rows: int, inter: int, out: int, rank: int, dtype: torch.dtype, merged: bool,
                   device: str = "cpu"):
    """(dy, gate, up, activation, w, a, b, h, scale) for the backward ops, h from the op's own forward."""
    gen = seeded(11)
    gate = torch.randn(rows, 2 * inter if merged else inter, generator=gen).to(device, dtype)
    up = None if merged else torch.randn(rows, inter, generator=gen).to(device, dtype)
    w = (torch.randn(out, inter, generator=gen) / inter**0.5).to(device, dtype)
    a = (torch.randn(rank, inter, generator=gen) / inter**0.5).to(device)
    b = (torch.randn(out, rank, generator=gen) / rank**0.5).to(device)
    glu_lora.register()
    _, h = torch.ops.sloth.glu_lora_linear(gate, up, "silu", w, None, a, b, 2.0)
    dy = torch.randn(rows, out, generator=gen).to(device, dtype)
    return dy, gate, up, "silu", w, a, b, h, 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_inplace_op_gives_the_functional_ops_bits(dtype, merged, layout, device):
    dy, gate, up, *rest = _backward_args(37, 24, 20, 4, dtype, merged, device)
    if layout == "transposed":  # not contiguous: computed apart and copied over (a write through a copy is lost)
        gate = gate.t().contiguous().t()
    d_gate, d_up, da, db = torch.ops.sloth.glu_lora_linear_backward(dy, gate, up, *rest)
    gate_before = gate.clone()
    got_da, got_db = torch.ops.sloth.glu_lora_linear_backward_inplace(dy, gate, up, *rest)
    assert not torch.equal(gate, gate_before)
    assert torch.equal(gate, d_gate)
    if not merged:
        assert torch.equal(up, d_up)
    assert torch.equal(got_da, da) and torch.equal(got_db, db)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backwards_given_no_h_recompute_the_forwards_bits(dtype, device):
    dy, gate, up, activation, w, a, b, h, scale = _backward_args(37, 24, 20, 4, dtype, False, device)
    got = torch.ops.sloth.glu_lora_linear_backward(dy, gate, up, activation, w, a, b, None, scale)
    want = torch.ops.sloth.glu_lora_linear_backward(dy, gate, up, activation, w, a, b, h, scale)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    x = torch.randn(37, 24, generator=seeded(12)).to(device, dtype)
    lora.register()
    _, h_x = torch.ops.sloth.lora_linear(x, w, None, a, b, 0.5)
    dy_x = torch.randn(37, 20, generator=seeded(13)).to(device, dtype)
    got = torch.ops.sloth.lora_linear_backward(dy_x, x, w, a, b, None, 0.5, True)
    want = torch.ops.sloth.lora_linear_backward(dy_x, x, w, a, b, h_x, 0.5, True)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_4bit_backwards_in_place_and_given_no_h_give_the_same_bits():
    functional = pytest.importorskip("bitsandbytes.functional")
    glu_lora.register_4bit()
    gen = seeded(15)
    # 128 inputs: whole 64-element blocks per row, which bitsandbytes' CPU dequantisation needs
    gate, up = torch.randn(9, 128, generator=gen).bfloat16(), torch.randn(9, 128, generator=gen).bfloat16()
    w = (torch.randn(20, 128, generator=gen) / 128**0.5).bfloat16()
    a, b = torch.randn(4, 128, generator=gen) / 128**0.5, torch.randn(20, 4, generator=gen) / 2
    packed, state = functional.quantize_4bit(w, blocksize=64, quant_type="nf4")
    quant = (packed, state.absmax, None, None, None, 20, 128, 64, "nf4")
    _, h = torch.ops.sloth.glu_qlora_linear(gate, up, "silu", *quant, None, a, b, 2.0)
    dy = torch.randn(9, 20, generator=gen).bfloat16()
    want = torch.ops.sloth.glu_qlora_linear_backward(dy, gate, up, "silu", *quant, a, b, h, 2.0)
    da, db = torch.ops.sloth.glu_qlora_linear_backward_inplace(dy, gate, up, "silu", *quant, a, b, None, 2.0)
    assert torch.equal(gate, want[0]) and torch.equal(up, want[1])
    assert torch.equal(da, want[2]) and torch.equal(db, want[3])


def _lora_forward_and_backward(x, w, a, b, dy, read_y: bool):
    y, h = torch.ops.sloth.lora_linear(x, w, None, a, b, 0.5)
    dx, da, db = torch.ops.sloth.lora_linear_backward(dy, x, w, a, b, h, 0.5, True)
    return (dx, da, db, y) if read_y else (dx, da, db)


@pytest.mark.parametrize("read_y", [False, True], ids=["y-unread", "y-read"])
def test_pass_drops_a_forward_read_only_for_h(read_y):
    gen = seeded(14)
    lora.register()
    x, w = torch.randn(9, 8, generator=gen), torch.randn(6, 8, generator=gen)
    a, b, dy = torch.randn(2, 8, generator=gen), torch.randn(6, 2, generator=gen), torch.randn(9, 6, generator=gen)
    inputs = (x, w, a, b, dy)
    gm = _traced(lambda *t: _lora_forward_and_backward(*t, read_y=read_y), inputs)
    want = gm(*inputs)
    assert lean_backward.drop_recomputed_forwards(gm.graph) == (0 if read_y else 1)
    gm.recompile()
    forwards = [n for n in gm.graph.nodes if n.target == torch.ops.sloth.lora_linear.default]
    assert len(forwards) == (1 if read_y else 0)
    assert all(torch.equal(p, q) for p, q in zip(gm(*inputs), want))


def _traced(fn, args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _call(dy, gate, up, w, a, b, h):
    return torch.ops.sloth.glu_lora_linear_backward(dy, gate, up, "silu", w, a, b, h, 2.0)


@pytest.mark.parametrize("case", ["read-by-it-alone", "read-before-it"])
def test_pass_writes_over_activations_the_graph_owns(case):
    dy, gate, up, _, w, a, b, h, _ = _backward_args(9, 8, 6, 2, torch.float32, merged=False)
    inputs = (dy, gate, up, w, a, b, h)

    def owned(dy, g0, u0, w, a, b, h):  # gate and up made here and read by nothing after the backward
        g, u = g0 * 2, u0 + 1
        before = (g * u).sum() if case == "read-before-it" else dy.sum()  # as the last layer's recomputed forward
        d_gate, d_up, da, db = _call(dy, g, u, w, a, b, h)
        return d_gate.sum(-1), d_up, da, db, before

    gm = _traced(owned, inputs)
    want = gm(*inputs)
    assert lean_backward.write_gradients_in_place(gm.graph) == 1
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.sloth.glu_lora_linear_backward_inplace.default in targets
    assert torch.ops.sloth.glu_lora_linear_backward.default not in targets
    got = gm(*inputs)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("case", ["graph-inputs", "read-again", "views-of-one-tensor"])
def test_pass_leaves_activations_it_does_not_own(case):
    dy, gate, up, _, w, a, b, h, _ = _backward_args(9, 8, 6, 2, torch.float32, merged=False)

    def graph_inputs(dy, g0, u0, w, a, b, h):  # saved tensors: a backward's inputs are never written
        return _call(dy, g0, u0, w, a, b, h)

    def read_again(dy, g0, u0, w, a, b, h):
        g = g0 * 2
        d_gate, d_up, da, db = _call(dy, g, u0 + 1, w, a, b, h)
        return d_gate + g, d_up, da, db

    def views_of_one_tensor(dy, g0, u0, w, a, b, h):
        g, u = torch.cat([g0, u0]).chunk(2)  # row halves: contiguous, one storage
        return _call(dy, g, u, w, a, b, h)

    fn = {"graph-inputs": graph_inputs, "read-again": read_again, "views-of-one-tensor": views_of_one_tensor}[case]
    gm = _traced(fn, (dy, gate, up, w, a, b, h))
    assert lean_backward.write_gradients_in_place(gm.graph) == 0


def _checkpointed_step(model, ids, enabled: bool, monkeypatch, options=None):
    """Loss, gradients, and the generated code's calls of sloth ops by name (the forward graph's and the
    backward's together)."""
    torch._dynamo.reset()
    sloth.reset_report()
    # The backend function, not its name: a checkout that is not pip-installed (the device's) has no entry point.
    options = {**(options or {}), **({} if enabled else {"disable": ["lean_backward"]})}
    run = torch.compile(model, backend=functools.partial(sloth.sloth_backend, options=options))
    (loss, grads), codes = run_and_get_code(lambda: loss_and_grads(model, ids, run=run))
    calls: dict[str, int] = {}
    for name in (m for code in codes for m in re.findall(r"torch\.ops\.sloth_rt\.(\w+)\.default\(", code)):
        calls[name] = calls.get(name, 0) + 1
    return loss, grads, calls


def test_checkpointed_lora_llama_through_inductor_gets_the_rewrites_with_the_same_bits(monkeypatch, device):
    model = build_lora("llama", torch.float32).to(device)
    model.config.use_cache = False  # else transformers warns under checkpointing, which splits the graph
    enable_checkpointing(model)
    model.train()
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5)).to(device)
    loss, grads, calls = _checkpointed_step(model, ids, True, monkeypatch)
    plain_loss, plain_grads, plain_calls = _checkpointed_step(model, ids, False, monkeypatch)
    # Without the rewrites each layer's down projection runs twice (forward, and again in the backward for h);
    # with them once, except in the last layer, whose output the final norm's backward reads (recomputed, as
    # it is made inside the checkpointed layer): there the recomputed forward reads gate and up too, before
    # the backward op. The MLP's backward is in place in every layer. o_proj runs twice either way: its
    # output makes the residual the post-attention norm's backward reads.
    assert plain_calls["glu_lora_linear"] == 2 * layers and calls["glu_lora_linear"] == layers + 1, \
        (calls, plain_calls)
    assert calls["glu_lora_linear_backward_inplace"] == layers and "glu_lora_linear_backward" not in calls
    assert plain_calls["glu_lora_linear_backward"] == layers and "glu_lora_linear_backward_inplace" not in plain_calls
    assert calls["lora_linear"] == plain_calls["lora_linear"] == 2 * layers
    # Rewrite 3: each layer's input norm, recomputed for q/k/v and read again for their gradients after the
    # attention's backward, is formed a second time there; not in the first layer, whose input (the frozen
    # embeddings' output, no gradient) nothing reads after the attention's backward: forming the norm there
    # would keep it alive through it.
    assert calls["rms_norm"] == plain_calls["rms_norm"] + layers - 1, (calls, plain_calls)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[n], plain_grads[n]) for n in grads)


def test_checkpointed_tiled_mlp_and_o_proj_with_mid_layer_are_not_run_again(monkeypatch, device):
    # The tiled MLP's backward recomputes gate and up block by block and, given no h1 and h2, their adapter
    # activations with them: the op's forward runs once a step except in the last layer (its output is read).
    # With offload's mid_layer the residual after attention is saved, so o_proj is not run again either.
    model = build_lora("llama", torch.float32).to(device)
    model.config.use_cache = False
    enable_checkpointing(model)
    model.train()
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5)).to(device)
    options = {"tiled_mlp": 8, "offload": {"min_bytes": 0, "mid_layer": True}}  # 18 rows: three blocks
    loss, grads, calls = _checkpointed_step(model, ids, True, monkeypatch, options)
    plain_loss, plain_grads, plain_calls = _checkpointed_step(model, ids, False, monkeypatch, options)
    assert plain_calls["lora_mlp_tiled"] == 2 * layers and calls["lora_mlp_tiled"] == layers + 1, (calls, plain_calls)
    assert plain_calls["lora_linear"] == 2 * layers and calls["lora_linear"] == layers
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[n], plain_grads[n]) for n in grads)
