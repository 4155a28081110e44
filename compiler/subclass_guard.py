"""Tensor subclasses (DTensor) reaching a sloth op: the graph left as it was, every site reported with the reason.

sloth's ops are registered for plain tensors. A ``DTensor`` (tensor parallelism's sharded activations and
weights, ``parallelize_module`` with ``use_local_output=False``, or FSDP2 parameters read outside their module)
dispatches each op to a sharding rule, and sloth's ops have none: AOTAutograd's trace would fail with
"Operator sloth.glu.default does not have a sharding strategy registered". Where the graph holds such values
(Dynamo's example values say so), the backend keeps a copy of the graph before its passes; if a pass put a sloth op
on a subclass value, the rewritten graph is dropped for the copy, and the pipeline runs again with every family's
sites reported instead of replaced (``refuse``). Graphs whose sloth ops see only plain tensors (FSDP2's unsharded
parameters inside a module's forward; tensor parallelism's default local outputs) keep their rewrite.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .fx_utils import subgraphs, value_of


def _subclass_name(value: Any) -> Optional[str]:
    """The type name of ``value`` when it is a tensor subclass that wraps others (DTensor and its kind), else None.
    Fake tensors and parameters are plain tensors here."""
    if isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value):
        return type(value).__name__
    return None


def holds_subclass_values(gm: fx.GraphModule) -> bool:
    """Whether any node of ``gm`` or of its subgraph bodies has a tensor-subclass example value."""
    return any(_subclass_name(value_of(n)) for m in [gm, *subgraphs(gm)] for n in m.graph.nodes)


def sloth_op_on_subclass(gm: fx.GraphModule) -> Optional[str]:
    """Why the rewritten ``gm`` cannot run (a sloth op reading a tensor-subclass value), or None."""
    for module in [gm, *subgraphs(gm)]:
        for node in module.graph.nodes:
            if node.op != "call_function" or getattr(node.target, "namespace", None) != "sloth":
                continue  # sloth's ops are OpOverloads of the "sloth" namespace (torch.ops.sloth.*.default)
            for arg in node.all_input_nodes:
                name = _subclass_name(value_of(arg))
                if name:
                    return (f"a {name} value ({arg.name}) would reach {node.target}, which has no {name} rule (sloth's "
                            f"ops take plain tensors): tensor parallelism's sharded values, or a parameter read outside "
                            f"its FSDP2 module; the graph runs as written")
    return None


def snapshot(gm: fx.GraphModule) -> Optional[fx.GraphModule]:
    """A copy of ``gm`` to fall back to, when it holds tensor-subclass values; None otherwise."""
    return copy.deepcopy(gm) if holds_subclass_values(gm) else None
