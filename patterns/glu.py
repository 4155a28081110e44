"""Gated MLP family (``"glu"`` in the report): SwiGLU, GeGLU, ReGLU, ReLU²-GLU and GLU, gate and up separate or
merged.

The meaning, as plain PyTorch (these functions are also the test oracle and the eager benchmark baseline)::

    swiglu_pattern(gate, up)       Llama, Mistral, Qwen2/3, OLMo2, Phi3:  F.silu(gate) * up
    geglu_tanh_pattern(gate, up)   Gemma, Gemma2, Gemma3:                 F.gelu(gate, approximate="tanh") * up
    geglu_erf_pattern(gate, up)    exact-GELU gated MLPs:                 F.gelu(gate) * up
    reglu_pattern(gate, up)        ReGLU (``ACT2FN["relu"]``):            F.relu(gate) * up
    relu2_glu_pattern(gate, up)    BitNet (``ACT2FN["relu2"]``):          torch.square(F.relu(gate)) * up
    sigmoid_glu_pattern(gate, up)  the original GLU:                      torch.sigmoid(gate) * up

Variants matched on the canonical graph (see compiler/canonicalize.py, which turns ``nn.SiLU``,
``ACT2FN["silu"]``, ``x * sigmoid(x)`` (also through ``.float()`` casts), ``nn.GELU``, ``ACT2FN["gelu_pytorch_tanh"]``,
``ACT2FN["gelu"]``, the written-out tanh and erf GELU formulas, ``nn.ReLU`` and ``x.relu()`` into ``F.silu(g)`` /
``gelu(g, a)`` / ``torch.relu(g)``, ``relu(g) ** 2`` into ``torch.square``, and ``chunk``, ``split`` and
``x[..., a:b]`` into ``torch.narrow``), whatever module wrote them::

    a   = F.silu(g) | gelu(g, "tanh") | gelu(g, "none")      a read by nothing but the product
        | torch.relu(g) | torch.square(torch.relu(g)) | torch.sigmoid(g)
          [then casts: cast(F.silu(cast(g, fp32)), bf16) reads g itself, the op computing in fp32 anyway]
    out = a * u  or  u * a                                   u of g's shape and dtype
    -> sloth.glu(g, u, act)
    and when g = narrow(m, -1, 0, n), u = narrow(m, -1, n, n) of one [..., 2n] tensor m (Phi3's gate_up_proj
    followed by chunk(2, dim=-1), or m[..., :n] / m[..., n:]):
    -> sloth.glu(m, None, act)       reads m in place and writes its gradient as one [..., 2n] tensor

SiLU and GELU times a tensor of their shape are gated MLPs wherever they appear, so any such product is fused.
ReLU and sigmoid products are often something else (a gated attention's output times ``sigmoid(gate)``, an
indexer's ``relu(scores)`` times weights), so those are fused only in a gated product (patterns/glu_forms.py): gate
and up two linear projections of one input. A gated product whose activation is none of the op's (tanh, swish
with a beta, a clamped GLU's ``x * sigmoid(1.702 * x)``, ...) is refused with that activation written out.

The replacement computes in fp32 and rounds once (lowering/glu.py), so it is at least as accurate as every
variant above. Anything else says no and leaves the graph as it was: an activation read by someone else
too, float64 or mixed dtypes, an up that broadcasts, a gate or up that is not contiguous in its last
dimension (an interleaved split such as ``m[..., ::2]``). ``silu(g) * g`` (up is the gate itself) is the
same math with both operands one tensor; it is fused, and autograd adds the two gradients.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..compiler.anchors import cut_by_graph_boundary, returned_only
from ..compiler.canonicalize import cast, gelu
from ..compiler.fx_utils import (insert_call, is_call, module_path, replace_and_erase, same_shape, same_size,
                                 source_location, tensor_of)
from ..compiler.options import PassOptions
from ..compiler.families import Family
from ..compiler.report import Report, Site
from .glu_forms import ACTIVATION_NAMES, Activation, activation_of, describe, gated_product

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


def reglu_pattern(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """ReGLU: ``relu(gate) * up``."""
    return F.relu(gate) * up


def relu2_glu_pattern(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The squared-ReLU GLU (BitNet): ``relu(gate)^2 * up``, as transformers' ``ACT2FN["relu2"]`` writes it."""
    return torch.square(F.relu(gate)) * up


def sigmoid_glu_pattern(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The original GLU: ``sigmoid(gate) * up``."""
    return torch.sigmoid(gate) * up


# By the op's activation names (lowering/glu.py's ACTIVATIONS, patterns/glu_forms.py's ACTIVATION_NAMES).
PATTERNS = {"silu": swiglu_pattern, "gelu_tanh": geglu_tanh_pattern, "gelu_erf": geglu_erf_pattern,
            "relu": reglu_pattern, "relu2": relu2_glu_pattern, "sigmoid": sigmoid_glu_pattern}

# Activations fused times any tensor of their shape (module docstring); the others only in a gated product.
_ANYWHERE = ("silu", "gelu_tanh", "gelu_erf")


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


def _upcast_from(node: Any, dtype: torch.dtype) -> Any:
    """The node of ``dtype`` that ``node`` is exact upcasts of (``cast(g, fp32)`` of a bf16 g), else ``node``."""
    inner = node
    while is_call(inner, cast) and tensor_of(inner.args[0]) is not None and tensor_of(inner) is not None:
        wide, narrow = tensor_of(inner).dtype, tensor_of(inner.args[0]).dtype
        if torch.promote_types(wide, narrow) != wide:
            return node  # a rounding on the way: the activation did not read dtype's value exactly
        inner = inner.args[0]
        if narrow == dtype:
            return inner
    return node


def _gate_of(act: Activation) -> Any:
    """The gate the op reads: the activation's input, or, where casts follow the activation back to a narrower
    dtype (``F.silu(g.float()).to(g.dtype)``), the g it upcast: the op computes in fp32 and rounds once anyway.
    None where casts follow the activation but its input is no exact upcast of a tensor of their dtype."""
    if not act.casts:
        return act.gate
    outer = tensor_of(act.chain[0])
    gate = _upcast_from(act.gate, outer.dtype) if outer is not None else act.gate
    return None if gate is act.gate else gate


def _match(out: fx.Node, factor: fx.Node, up: fx.Node, act: Activation) -> Union[GluMatch, tuple[fx.Node, str]]:
    """``out = factor * up`` with ``factor`` = casts(act(gate)): the match, or (node, reason) for a near-miss."""
    if len(factor.users) != 1:
        return factor, "the activation's output has other users, so it cannot be fused away"
    if any(len(node.users) != 1 for node in act.chain):
        return out, "the activation's output has other users, so it cannot be fused away"
    gate = _gate_of(act)
    if gate is None:
        inner, outer = (getattr(tensor_of(n), "dtype", "an unknown dtype")
                        for n in (act.chain[act.casts], act.chain[0]))
        return out, (f"the activation is computed in {inner} and cast to {outer}, and its input is no {outer} tensor "
                     "upcast; the fused kernel computes in float32 from a gate of the output's dtype"
                     ).replace("torch.", "")
    gt, ut, ot = tensor_of(gate), tensor_of(up), tensor_of(out)
    if gt is None or ut is None or ot is None:
        return out, "the shapes of gate and up are unknown"
    if gt.dtype == torch.float64 or ut.dtype == torch.float64:
        return out, "computes in float64; the fused kernel supports float32, bfloat16 and float16"
    if gt.dtype not in _KERNEL_DTYPES or not (gt.dtype == ut.dtype == ot.dtype):
        return out, (f"gate is {gt.dtype} and up is {ut.dtype}; the fused kernel needs both in one of float32, "
                     "bfloat16 and float16").replace("torch.", "")
    if gt.dim() == 0 or not same_shape(gt, ut) or not same_shape(ot, gt):
        return out, (f"up {tuple(ut.shape)} broadcasts against gate {tuple(gt.shape)}; "
                     "the fused kernel needs one shape")
    for name, t in (("gate", gt), ("up", ut)):
        if not _last_dim_contiguous(t):
            return out, (f"{name} is not contiguous in its last dimension (an interleaved or strided split such as "
                         "m[..., ::2]); only last-dim-contiguous splits are fused")
    m = _merged(gate, up)
    if m is not None:
        return GluMatch(m, None, act.name, out, f"{act.name}, merged gate_up")
    order = ", gate second" if (is_call(gate, torch.narrow) and is_call(up, torch.narrow)
                                and gate.args[0] is up.args[0]) else ""
    return GluMatch(gate, up, act.name, out, f"{act.name}, separate gate and up{order}")


def _site(product: fx.Node) -> Union[GluMatch, tuple[fx.Node, str], None]:
    """What to do with a product: None (no gated activation), a match, or (node, reason) to refuse it at."""
    gated = gated_product(product)
    factors = [gated.gate.factor, gated.up.factor] if gated is not None else list(product.args)
    for factor in factors:
        up = _other_operand(product, factor)
        act = activation_of(factor)
        if act is None or not isinstance(up, fx.Node) or (act.name not in _ANYWHERE and gated is None):
            continue
        return _match(product, factor, up, act)
    if gated is not None:
        return product, (f"gate activation {describe(gated.gate)} is not one the glu op computes "
                         f"({', '.join(ACTIVATION_NAMES)})")
    return None


def _replace(gm: fx.GraphModule, m: GluMatch) -> set[fx.Node]:
    """Insert the fused node for ``m``; returns the nodes erased."""
    out = tensor_of(m.out)
    fused = insert_call(gm.graph, m.out, torch.ops.sloth.glu.default, (m.x, m.up, m.activation), meta_from=m.out,
                        value=out.new_empty(out.shape))
    return replace_and_erase(m.out, fused, keep=(m.x, m.up))


def fuse_glu_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                  options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Replace every gated activation in the canonical graph with ``torch.ops.sloth.glu``; refuse, with the
    reason, every other gated product (compiler/anchors.py's ``glu`` anchor).

    before:  a = F.silu(g); y = a * u                                  after:  y = sloth.glu(g, u, "silu")
    before:  g = narrow(m, -1, 0, n); u = narrow(m, -1, n, n); y = u * gelu(g, "tanh")
    after:   y = sloth.glu(m, None, "gelu_tanh")
    before:  g = linear(x, w_g); u = linear(x, w_u); y = torch.square(torch.relu(g)) * u
    after:   y = sloth.glu(g, u, "relu2")
    """
    _lowering().register()
    erased: set[fx.Node] = set()
    refused: set[tuple[fx.Node, str]] = set()  # an activation with two products is refused once
    for node in list(gm.graph.nodes):
        if node in erased or not is_call(node, torch.mul) or len(node.args) != 2:
            continue
        found = _site(node)
        if found is None:
            continue
        if isinstance(found, tuple):
            if found not in refused:
                refused.add(found)
                report.reject(FAMILY, *found)
            continue
        site = Site(FAMILY, "sloth.glu", module_path(node), source_location(node),
                    f"{found.detail}, {str(tensor_of(found.out).dtype).replace('torch.', '')}")
        erased |= _replace(gm, found)
        report.replaced(site)
    gm.graph.lint()
    gm.recompile()
    return gm


# The family's anchor (compiler/anchors.py): where its sites are, more broadly than its matchers take them.
def is_gate_activation(node: object) -> bool:
    """An activation that gates wherever it is multiplied (F.silu, gelu in sloth's canonical spelling): the GLU half
    ``cut_sites`` reports when a graph returns it. Not relu or sigmoid, which a graph returns for other
    reasons too (an ungated MLP's activation, a router's scores)."""
    return is_call(node, F.silu) or is_call(node, gelu)


def anchor(node: fx.Node) -> bool:
    """The ``glu`` family's anchor: an activation (F.silu, gelu) whose one user is a product: act(gate) * up; and the
    gate factor of any elementwise product of two linear projections of one input, one of them through a
    nonlinearity (whatever the activation: relu, relu^2, sigmoid, tanh, x * sigmoid(1.702 x), ...)

    An activation (F.silu, gelu) whose one user is a product with a tensor of its shape, or the gate factor of a
    gated product (patterns/glu_forms.py: two linear projections of one input, one through a nonlinearity)."""
    users = [u for u in node.users if is_call(u, torch.mul) and len(u.args) == 2]
    if is_gate_activation(node) and len(node.users) == 1 and users:
        other = users[0].args[1] if users[0].args[0] is node else users[0].args[0]
        act_t, other_t = tensor_of(node), tensor_of(other)  # a gate times an up of its shape; not a scale or a mask
        if act_t is not None and other_t is not None and tuple(act_t.shape) == tuple(other_t.shape):
            return True
    if not users:
        return False
    from ..patterns.glu_forms import gated_product  # patterns import compiler modules

    return any((gated := gated_product(u)) is not None and gated.gate.factor is node for u in users)


GLU_CUT = cut_by_graph_boundary("the activation is returned to another graph that multiplies it")


def cut_sites(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, str]]:
    """The family's ``cut_sites``: a gate activation ``gm`` returns, whose product with up another graph computes
    (measured: a 4-layer Llama with r = 64 adapters under DDP with 1 MB buckets on the CPU was split through layer 1's
    MLP this way)."""
    for node in gm.graph.nodes:
        if returned_only(node) and is_gate_activation(node):
            yield node, GLU_CUT


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_glu_pass, order=70, anchor=anchor, cut_sites=cut_sites,
                     emits=("glu",),
                     summary="gated MLPs: SwiGLU, GeGLU, relu, relu^2, sigmoid gates, merged or separate gate and up")
