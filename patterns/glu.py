"""Gated MLP family (``"glu"`` in the report): SwiGLU and GeGLU, gate and up separate or merged.

The meaning, as plain PyTorch (these functions are also the test oracle and the eager benchmark
baseline)::

    swiglu_pattern(gate, up)       Llama, Mistral, Qwen2/3, OLMo2, Phi3:  F.silu(gate) * up
    geglu_tanh_pattern(gate, up)   Gemma, Gemma2, Gemma3:                 F.gelu(gate, approximate="tanh") * up
    geglu_erf_pattern(gate, up)    exact-GELU gated MLPs:                 F.gelu(gate) * up

Variants matched on the canonical graph (see compiler/canonicalize.py, which turns ``nn.SiLU``,
``ACT2FN["silu"]``, ``x * sigmoid(x)``, ``nn.GELU``, ``ACT2FN["gelu_pytorch_tanh"]``, ``ACT2FN["gelu"]``, the
written-out tanh and erf GELU formulas into ``F.silu(g)`` / ``gelu(g, a)``, and ``chunk``, ``split`` and
``x[..., a:b]`` into ``torch.narrow``), whatever module wrote them::

    a   = F.silu(g) | gelu(g, "tanh") | gelu(g, "none")      a read by nothing but the product
    out = a * u  or  u * a                                   u of g's shape and dtype
    -> sloth.glu(g, u, act)
    and when g = narrow(m, -1, 0, n), u = narrow(m, -1, n, n) of one [..., 2n] tensor m (Phi3's gate_up_proj
    followed by chunk(2, dim=-1), or m[..., :n] / m[..., n:]):
    -> sloth.glu(m, None, act)       reads m in place and writes its gradient as one [..., 2n] tensor

The replacement computes in fp32 and rounds once (lowering/glu.py), so it is at least as accurate as every
variant above. Anything else says no and leaves the graph as it was: an activation read by someone else
too, float64 or mixed dtypes, an up that broadcasts, a gate or up that is not contiguous in its last
dimension (an interleaved split such as ``m[..., ::2]``). ``silu(g) * g`` (up is the gate itself) is the
same math with both operands one tensor; it is fused, and autograd adds the two gradients.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.canonicalize import gelu
from ..compiler.fx_utils import (insert_call, is_call, module_path, replace_and_erase, same_shape, same_size,
                                 source_location, tensor_of)
from ..compiler.options import PassOptions
from ..compiler.report import Report, Site

FAMILY = "glu"


def _lowering():
    """The kernel module, imported on first use (importing triton must wait for TRITON_INTERPRET; see
    patterns/rms_norm.py)."""
    from ..lowering import glu

    return glu

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def swiglu_pattern(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up``."""
    return F.silu(gate) * up


def geglu_tanh_pattern(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (Gemma's ``gelu_pytorch_tanh``)."""
    return F.gelu(gate, approximate="tanh") * up


def geglu_erf_pattern(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the exact (erf) GELU."""
    return F.gelu(gate) * up


PATTERNS = {"silu": swiglu_pattern, "gelu_tanh": geglu_tanh_pattern, "gelu_erf": geglu_erf_pattern}


@dataclasses.dataclass
class GluMatch:
    """A matched site: ``out``'s value equals ``sloth.glu(x, up, activation)``.

    ``up`` is None when ``x`` is the merged ``[..., 2n]`` projection whose halves are gate and up.
    """
    x: fx.Node
    up: Optional[fx.Node]
    activation: str
    out: fx.Node
    detail: str


def _activation_kind(node: fx.Node) -> Optional[str]:
    """The op's name for a canonical activation node, or None."""
    if is_call(node, F.silu) and len(node.args) == 1:
        return "silu"
    if is_call(node, gelu) and len(node.args) == 2:
        return {"tanh": "gelu_tanh", "none": "gelu_erf"}.get(node.args[1])
    return None


def _other_operand(mul: fx.Node, node: fx.Node) -> Any:
    a, b = mul.args
    return b if a is node else a


def _last_dim_contiguous(t: torch.Tensor) -> bool:
    return same_size(t.stride(-1), 1) or same_size(t.shape[-1], 1)


def _merged(gate: Any, up: Any) -> Optional[fx.Node]:
    """m when gate and up are the first and second halves of one tensor m's last dim, else None."""
    if not (is_call(gate, torch.narrow) and is_call(up, torch.narrow) and gate.args[0] is up.args[0]):
        return None
    m, g_dim, g_start, g_len = gate.args
    _, u_dim, u_start, u_len = up.args
    mt = tensor_of(m)
    if mt is None or (g_dim, u_dim, g_start) != (-1, -1, 0) or not (u_start == g_len == u_len):
        return None
    if not same_size(mt.shape[-1], 2 * g_len) or not _last_dim_contiguous(mt):
        return None
    return m


def _match(act: fx.Node, activation: str) -> Union[GluMatch, str, None]:
    """Match around an activation node. None: not gated; str: a near-miss and why."""
    products = [u for u in act.users
                if is_call(u, torch.mul) and isinstance(_other_operand(u, act), fx.Node)]
    if not products:
        return None  # a plain (ungated) MLP's activation, or one scaled by a constant
    if len(act.users) != 1:
        return "the activation's output has other users, so it cannot be fused away"
    out = products[0]
    gate, up = act.args[0], _other_operand(out, act)
    gt, ut, ot = tensor_of(gate), tensor_of(up), tensor_of(out)
    if gt is None or ut is None or ot is None:
        return "the shapes of gate and up are unknown"
    if gt.dtype == torch.float64 or ut.dtype == torch.float64:
        return "computes in float64; the fused kernel supports float32, bfloat16 and float16"
    if gt.dtype not in _KERNEL_DTYPES or not (gt.dtype == ut.dtype == ot.dtype):
        return (f"gate is {gt.dtype} and up is {ut.dtype}; the fused kernel needs both in one of float32, "
                "bfloat16 and float16").replace("torch.", "")
    if gt.dim() == 0 or not same_shape(gt, ut) or not same_shape(ot, gt):
        return (f"up {tuple(ut.shape)} broadcasts against gate {tuple(gt.shape)}; "
                "the fused kernel needs one shape")
    for name, t in (("gate", gt), ("up", ut)):
        if not _last_dim_contiguous(t):
            return (f"{name} is not contiguous in its last dimension (an interleaved or strided split such as "
                    "m[..., ::2]); only last-dim-contiguous splits are fused")
    m = _merged(gate, up)
    if m is not None:
        return GluMatch(m, None, activation, out, f"{activation}, merged gate_up")
    order = ", gate second" if (is_call(gate, torch.narrow) and is_call(up, torch.narrow)
                                and gate.args[0] is up.args[0]) else ""
    return GluMatch(gate, up, activation, out, f"{activation}, separate gate and up{order}")


def _replace(gm: fx.GraphModule, m: GluMatch) -> set[fx.Node]:
    """Insert the fused node for ``m``; returns the nodes erased."""
    out = tensor_of(m.out)
    fused = insert_call(gm.graph, m.out, torch.ops.sloth.glu.default, (m.x, m.up, m.activation), meta_from=m.out,
                        value=out.new_empty(out.shape))
    return replace_and_erase(m.out, fused, keep=(m.x, m.up))


def fuse_glu_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                  options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace every gated activation in the canonical graph with ``torch.ops.sloth.glu``.

    before:  a = F.silu(g); y = a * u                                  after:  y = sloth.glu(g, u, "silu")
    before:  g = narrow(m, -1, 0, n); u = narrow(m, -1, n, n); y = u * gelu(g, "tanh")
    after:   y = sloth.glu(m, None, "gelu_tanh")
    """
    _lowering().register()
    erased: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in erased or node.op != "call_function":
            continue
        activation = _activation_kind(node)
        if activation is None:
            continue
        found = _match(node, activation)
        if found is None:
            continue
        anchor = next(iter(node.users)) if len(node.users) == 1 else node
        if isinstance(found, str):
            report.reject(FAMILY, anchor, found)
            continue
        site = Site(FAMILY, "sloth.glu", module_path(anchor), source_location(anchor),
                    f"{found.detail}, {str(tensor_of(found.out).dtype).replace('torch.', '')}")
        erased |= _replace(gm, found)
        report.replaced(site)
    gm.graph.lint()
    gm.recompile()
    return gm
