"""Join a RoPE with the RMSNorms of its q and k heads: ``sloth.rope(norm(q), norm(k))`` -> ``sloth.norm_rope``.

Qwen3, Qwen3-MoE, Gemma 3 and others write, per attention::

    q = self.q_norm(self.q_proj(h).view(b, s, -1, d)).transpose(1, 2)       (the same for k)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)

After the rms_norm and rope families that graph holds ``sloth.rms_norm`` twice and ``sloth.rope`` once, three op
calls forward and three backward; lowering/norm_rope.py is the same math in one (the module docstring says what
it saves). The rope pass calls ``join_qk_norms`` on each q/k pair it made; it joins when

- q and k each come from a ``sloth.rms_norm`` (both: one without a norm is a RoPE of another kind of input),
- through views that keep each row of D elements whole (transpose or permute not moving the last dim, view,
  reshape or unsqueeze keeping it), which commute with a row-wise norm and are replayed on the norm's input,
- read by nothing else (a normed q read elsewhere must still exist),
- the two norms give one dtype (the op's ``norm_dtype``) and their eps and offsets are numbers, not graph inputs.

Otherwise the three ops stay as they are, which is correct and merely slower: nothing to report as left. The
report's two rms_norm sites and the rope site then name ``sloth.norm_rope``. ``JOIN = False`` leaves every pair
unjoined, for A/B measurements (benchmarks/variants.py's ``norm_rope_apart``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from ..compiler.fx_utils import arg_of, insert_call, is_last_dim, same_size, tensor_of, value_of
from ..compiler.report import Report
from ..lowering.layout import empty_heads, is_bshd

JOIN = True  # False leaves the q/k norms and RoPE apart, for measuring the join (benchmarks/variants.py)


def qk_rms_norm_pattern(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float = 1e-6,
                        offset: float = 0.0) -> torch.Tensor:
    """Qwen3's ``Qwen3RMSNorm`` on a head (``offset=1``: Gemma 3's ``(1 + w)`` in fp32, rounded once at the end, as
    ``Gemma3RMSNorm`` does); the norm half of the op's meaning."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return h.to(dtype)
    if offset:
        return (h * (offset + weight.float())).to(dtype)
    return weight * h.to(dtype)


def qk_norm_rope_pattern(q: torch.Tensor, k: torch.Tensor, q_weight: Optional[torch.Tensor],
                         k_weight: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6,
                         offset: float = 0.0, unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``sloth.norm_rope`` replaces, as Qwen3's attention writes it: each head of q and k normalised, then
    transformers' ``apply_rotary_pos_emb`` (partial rotary when cos is narrower than the heads)."""
    from .rope import partial_rope_pattern

    return partial_rope_pattern(qk_rms_norm_pattern(q, q_weight, eps, offset),
                                qk_rms_norm_pattern(k, k_weight, eps, offset), cos, sin, unsqueeze_dim)


# Views that keep each row of the last dim whole: method name -> the torch function that replays it (a ``view``
# is replayed as ``reshape``: the norm's input may be strided where its output was contiguous).
_ROW_VIEWS = {"transpose": torch.transpose, "permute": torch.permute, "view": torch.reshape,
              "reshape": torch.reshape, "unsqueeze": torch.unsqueeze}
_FUNCTIONS = {torch.transpose: "transpose", torch.permute: "permute", torch.reshape: "reshape",
              torch.unsqueeze: "unsqueeze"}


def _view_name(node: fx.Node) -> Optional[str]:
    if node.op == "call_method" and node.target in _ROW_VIEWS:
        return node.target
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target)
    return None


def _view_args(node: fx.Node, name: str) -> Optional[tuple]:
    """The replayed view's arguments after its input, or None where they are not plain."""
    rest = tuple(node.args[1:])
    if node.kwargs:
        return None
    if name in ("permute", "view", "reshape") and len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        rest = (tuple(rest[0]),)
    elif name in ("permute", "view", "reshape"):
        rest = (rest,)
    return rest


def _keeps_rows(node: fx.Node, name: str, args: tuple) -> bool:
    """Whether the view ``node`` (of ``name`` with ``args``) keeps each last-dim row of its input whole."""
    before, after = tensor_of(node.args[0]), tensor_of(node)
    if before is None or after is None or before.dim() == 0 or after.dim() == 0 \
            or not same_size(before.shape[-1], after.shape[-1]):
        return False
    ndim = before.dim()
    if name == "transpose":
        return len(args) == 2 and all(isinstance(d, int) and not is_last_dim(d, ndim) for d in args)
    if name == "permute":
        return len(args[0]) == ndim and all(isinstance(d, int) for d in args[0]) and is_last_dim(args[0][-1], ndim)
    if name == "unsqueeze":
        return len(args) == 1 and isinstance(args[0], int) and args[0] not in (-1, ndim)
    return True  # view / reshape with the same last dim: row-major order keeps rows whole


def _norm_behind(x: Any, rms_norm: Any) -> Optional[tuple[fx.Node, list[tuple[fx.Node, str, tuple]]]]:
    """(the sloth.rms_norm node x comes from, the views between them in order), or None."""
    chain: list[tuple[fx.Node, str, tuple]] = []
    node = x
    while isinstance(node, fx.Node) and len(node.users) == 1:
        if node.op == "call_function" and node.target is rms_norm:
            return node, chain[::-1]
        name = _view_name(node)
        args = _view_args(node, name) if name else None
        if args is None or not _keeps_rows(node, name, args):
            return None
        chain.append((node, name, args))
        node = node.args[0]
    return None


def _replay(graph: fx.Graph, before: fx.Node, source: fx.Node, chain: list[tuple[fx.Node, str, tuple]]) -> fx.Node:
    """The chain of views applied to ``source`` instead of to the norm's output."""
    for node, name, args in chain:
        source = insert_call(graph, before, _ROW_VIEWS[name], (source, *args), meta_from=node)
    return source


def join_qk_norms(gm: fx.GraphModule, rope: fx.Node, report: Report) -> Optional[fx.Node]:
    """Replace ``rope`` (a ``sloth.rope`` node) and the RMSNorms of its q and k by one ``sloth.norm_rope`` node
    where the module docstring's conditions hold; returns it, or None (the graph unchanged). The norms' sites in
    the report are re-pointed to the new op; the rope pass records the rope site."""
    from ..lowering import norm_rope as lowering  # registers the op on first use

    if not JOIN or arg_of(rope, 5, "deinterleave", False):
        return None  # switched off; or DeepSeek's layout, whose rope heads no per-head norm precedes
    if not hasattr(torch.ops.sloth, "rms_norm"):
        return None  # never defined in this process (the rms_norm family off): no norm node can be in the graph
    rms_norm = torch.ops.sloth.rms_norm.default
    found = [_norm_behind(x, rms_norm) for x in rope.args[:2]]
    if any(f is None for f in found):
        return None
    (norm_q, chain_q), (norm_k, chain_k) = found
    if norm_q is norm_k:
        return None
    dtypes = [arg_of(n, 4, "out_dtype") or tensor_of(n.args[0]).dtype for n in (norm_q, norm_k)]
    if dtypes[0] != dtypes[1]:
        return None
    eps = [arg_of(n, 2, "eps", 1e-6) for n in (norm_q, norm_k)]
    offsets = [arg_of(n, 3, "offset", 0.0) for n in (norm_q, norm_k)]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (*eps, *offsets)):
        return None  # a symbolic eps (a graph input): the norms keep it, the join would have to specialise it
    lowering.register()
    graph = gm.graph
    q_in = _replay(graph, rope, norm_q.args[0], chain_q)
    k_in = _replay(graph, rope, norm_k.args[0], chain_k)
    weights = [arg_of(n, 1, "weight") for n in (norm_q, norm_k)]
    eps, offsets = [float(v) for v in eps], [float(v) for v in offsets]
    cos, sin = rope.args[2], rope.args[3]
    interleaved = bool(arg_of(rope, 4, "interleaved", False))
    # q and k before their norms are the projections' outputs: the result takes their layout (lowering/rope.py)
    bshd = all(is_bshd(tensor_of(n)) for n in (q_in, k_in))
    values = tuple(empty_heads(t, t.shape, t.dtype, bshd) for t in value_of(rope))  # the rope's shapes and dtypes
    fused = insert_call(graph, rope, torch.ops.sloth.norm_rope.default,
                        (q_in, k_in, *weights, cos, sin, *eps, *offsets, dtypes[0], interleaved)
                        + ((True,) if bshd else ()),
                        meta_from=rope, value=values)
    rope.replace_all_uses_with(fused)
    graph.erase_node(rope)
    for norm, chain in ((norm_q, chain_q), (norm_k, chain_k)):  # each read only by the next (_norm_behind)
        for node, _, _ in reversed(chain):
            graph.erase_node(node)
        graph.erase_node(norm)
    for norm in (norm_q, norm_k):
        report.rejoined("rms_norm", norm, "sloth.norm_rope", "joined with the RoPE after it")
    return fused
