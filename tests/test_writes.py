"""compiler/writes.py: what an FX node may write in place, on the forms that once broke it: an aten packet whose
only writing overload is out= (aten.index: a read), and values whose storage cannot be read (functorch's batched
tensors, in a mask built with torch.vmap as Gemma 3's is)."""
from __future__ import annotations

import torch
import torch.fx as fx

from sloth.compiler import writes
from sloth.compiler.fx_utils import set_value


def _graph(*values):
    g = fx.Graph()
    nodes = [g.placeholder(f"p{i}") for i in range(len(values))]
    for node, value in zip(nodes, values):
        set_value(node, value)
    return g, nodes


def test_a_packet_writes_only_what_an_overload_writes_and_the_node_passes():
    g, (x, i) = _graph(torch.randn(3, 4), torch.tensor([0, 2]))
    read = g.call_function(torch.ops.aten.index, (x, [i]))
    assert writes.written(read) == []  # index.Tensor_out writes out=, not given
    out = g.placeholder("out")
    assert writes.written(g.call_function(torch.ops.aten.index, (x, [i]), {"out": out})) == [out]
    assert writes.written(g.call_function(torch.ops.aten.add_, (x, x))) == [x]  # a packet of in-place overloads


def test_values_without_a_readable_storage_are_taken_as_one_storage():
    batched = []
    torch.func.vmap(lambda row: batched.append(row) or row)(torch.randn(2, 3))  # a BatchedTensor, escaped
    g, (a, b, plain) = _graph(batched[0], batched[0], torch.randn(3))
    fill = g.call_method("fill_", (b, 0.0))
    assert writes.mutated_producer(g, {a}) is fill  # aliasing unknown: a write to b may be a write to a
    g2, (a2, plain2) = _graph(batched[0], torch.randn(3))
    g2.call_method("fill_", (plain2, 0.0))
    assert writes.mutated_producer(g2, {a2}) is None
