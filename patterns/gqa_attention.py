"""Grouped-query attention family (``"gqa_attention"`` in the report): key and value heads repeated to every
query head only to be read by SDPA are passed unrepeated, with ``enable_gqa=True``.

The meaning::

    K = repeat_interleave(k, G, dim=1)            k: [B, Hk, S, D], K: [B, Hk * G, S, D], same for v
    scaled_dot_product_attention(q, K, V, ...) == scaled_dot_product_attention(q, k, v, ..., enable_gqa=True)

(SDPA's ``enable_gqa`` reads key head ``h // G`` for query head ``h``, which is what ``repeat_interleave`` and
transformers' ``repeat_kv`` build.) The gradients agree too: the repeat's backward sums the G heads' dK, which
the fused kernels do inside (in fp32, before the one rounding).

Why it pays: the repeated K and V are written out in full ([B, Hq, S, D] each, G times k's size) in the forward,
saved for the backward (or formed again in a checkpointed layer's recompute), and the backward forms dK and dV
at the query heads' size and then sums them. SDPA's fused kernels take the groups themselves (flash and, on
torch >= 2.8, cuDNN). At Llama-3-8B's shape (32 query heads, 8 key heads, head dim 128) that is 2 x 128 MiB of
repeated keys and values a layer at 16k tokens, 2 x 96 MiB more of dK and dV at the query heads' size in its
backward; without checkpointing the repeated pair is saved by every layer (2 GiB over 32 layers at 2 x 2048).
transformers repeats them itself whenever it passes SDPA a mask (up to 5.17 always while Dynamo traces: the
causal_mask family then drops the mask, the repeat stays) and hand-written models often do.

Variants (on the canonical graph, whatever module wrote them), checked by shape, not by name:

    x[:, :, None].expand(B, Hk, G, S, D).reshape(B, Hk * G, S, D)      transformers' repeat_kv (also
                                                                        unsqueeze(2) or a reshape/view that
                                                                        inserts the new dim; view or flatten
                                                                        for the merge, contiguous() or
                                                                        clone() before it)
    repeat_interleave(x, G, dim=1)  (or dim=-3)

A site whose mask is a graph input another graph made (FSDP2's per-layer graphs, a graph break: the causal_mask
family compiles such a graph twice, ``is_causal`` and as written, chosen per call) gets the grouped heads in its
``is_causal`` version only (``GQA_WHEN_CAUSAL`` in the graph's meta, applied by patterns/mask_inputs.py): the
version as written keeps the mask and so its repeats.

``x.repeat(1, G, 1, 1)`` is another mapping (key head ``h % Hk``) and is not matched. Left as they were, with the
reason in the report: an SDPA that keeps a mask (the fused kernels take groups only without one: torch picks
its math kernel, which repeats the heads anyway), dropout (its random stream is drawn per query head; the
kernels need not draw the same), key and value repeated differently, or a device / dtype / head dim for
which torch would run grouped heads on its math kernel (asked of ``torch._fused_sdp_choice`` at compile
time, on small tensors of the site's device, dtype and heads).
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from ..compiler.fx_utils import is_function, is_method, is_number, module_path, source_location, tensor_of
from ..compiler.options import PassOptions
from ..compiler.families import Family
from ..compiler.report import Report, Site
from ..compiler.fx_utils import subgraphs
from .causal_mask import MASK_INPUT_SITES
from .packed_attention import _sdpa_arguments

FAMILY = "gqa_attention"
# Graph meta key: the SDPA sites whose mask is chosen per call, to read grouped heads in the graph's is_causal
# version: [(graph module, SDPA node, key heads node, value heads node)] (patterns/mask_inputs.py applies them).
GQA_WHEN_CAUSAL = "sloth_gqa_when_causal_sites"
# torch's SDPBackend numbering (torch._fused_sdp_choice's answer): the kernel that repeats grouped heads itself.
_MATH = 0
_PROBE_LENGTH = 128  # the probe's sequence length: the backend choice reads heads, head dim, dtype, device


def repeated_kv_pattern(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int,
                        is_causal: bool = True) -> torch.Tensor:
    """The meaning, as plain PyTorch: attention over key / value heads repeated ``groups`` times each."""
    k, v = (torch.repeat_interleave(t, groups, dim=1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def _shape(node: Any) -> Optional[tuple]:
    value = tensor_of(node)
    return tuple(value.shape) if value is not None else None


def _full_slice(index: Any) -> bool:
    return index is Ellipsis or (isinstance(index, slice) and index == slice(None))


def _singleton_inserted(node: Any) -> Optional[fx.Node]:
    """x for a node that is x with a dim of size 1 inserted at position 2 ([B, Hk, S, D] -> [B, Hk, 1, S, D]):
    ``x[:, :, None]``, ``x.unsqueeze(2)`` or a reshape / view to that shape; else None. Inserting a size-1 dim
    keeps every element where it was, so the shapes decide."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    source = node.args[0]
    before, after = _shape(source), _shape(node)
    if before is None or after is None or len(before) != 4 or after != before[:2] + (1,) + before[2:]:
        return None
    if is_function(node, operator.getitem):
        index = node.args[1]
        if isinstance(index, tuple) and sum(i is None for i in index) == 1 \
                and all(i is None or _full_slice(i) for i in index):
            return source
        return None
    if is_method(node, "unsqueeze") or is_function(node, torch.unsqueeze):
        return source  # at 2, or at 3 with S == 1: the shapes above say the same elements
    if is_method(node, "reshape", "view") or is_function(node, torch.reshape):
        return source
    return None


def repeated_heads(node: Any) -> Optional[tuple[fx.Node, int]]:
    """(x, G) when ``node`` is x [B, Hk, S, D] with each head repeated G > 1 times in place
    (``repeat_interleave(x, G, dim=1)``, in any spelling of the module docstring), else None."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method") or not node.args:
        return None
    out = _shape(node)
    if out is None or len(out) != 4:
        return None
    if is_method(node, "repeat_interleave") or is_function(node, torch.repeat_interleave):
        source = node.args[0]
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        before = _shape(source)
        if isinstance(repeats, int) and not isinstance(repeats, bool) and repeats > 1 and dim in (1, -3) \
                and before is not None and len(before) == 4 \
                and out == (before[0], before[1] * repeats) + before[2:]:
            return source, repeats
        return None
    merged = node
    if is_method(merged, "flatten") or is_function(merged, torch.flatten):
        dims = tuple(merged.args[1:3]) if len(merged.args) >= 3 else None
        if dims not in ((1, 2), (1, -3), (-4, 2), (-4, -3)):
            return None
    elif not (is_method(merged, "reshape", "view") or is_function(merged, torch.reshape)):
        return None
    expanded = merged.args[0]
    while is_method(expanded, "contiguous", "clone") and len(expanded.args) == 1:
        expanded = expanded.args[0]  # a copy of the expand holds the same values
    if not (is_method(expanded, "expand") or is_function(expanded, torch.Tensor.expand)):
        return None
    wide = _shape(expanded)
    if wide is None or len(wide) != 5 or out != (wide[0], wide[1] * wide[2], wide[3], wide[4]) or wide[2] <= 1:
        return None
    source = _singleton_inserted(expanded.args[0])
    if source is None or _shape(source) != (wide[0], wide[1], wide[3], wide[4]):
        return None  # the expand must widen only the inserted dim: [B, Hk, 1, S, D] -> [B, Hk, G, S, D]
    return source, wide[2]


def is_repeated_kv_attention(node: fx.Node) -> bool:
    """An SDPA call whose key or value has its heads repeated in place: the family's anchor."""
    params = _sdpa_arguments(node)
    if params is None:
        return False
    return repeated_heads(params.get("key")) is not None or repeated_heads(params.get("value")) is not None


@functools.lru_cache(maxsize=None)
def _grouped_backend(device: str, dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int,
                     value_dim: int, is_causal: bool, requires_grad: bool) -> int:
    """The SDPA backend torch picks for grouped heads with these properties (``torch._fused_sdp_choice`` on
    small tensors: it reads devices, dtypes, heads and head dims, not the sequence length)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def probe(heads: int, dim: int) -> torch.Tensor:
        return torch.zeros(1, heads, _PROBE_LENGTH, dim, device=device, dtype=dtype, requires_grad=requires_grad)
    with unset_fake_temporarily():  # real tensors: the choice is made by the device's own dispatch
        q, k, v = probe(q_heads, head_dim), probe(kv_heads, head_dim), probe(kv_heads, value_dim)
        return int(torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, enable_gqa=True))


def _refusal(params: dict[str, Any], k: tuple[fx.Node, int], v: tuple[fx.Node, int],
             when_causal: bool = False) -> Optional[str]:
    """Why the site keeps its repeated heads, or None; ``when_causal``: judged for the graph's version in which the
    causal_mask family dropped the mask (the site's mask is chosen per call)."""
    if params["attn_mask"] is not None and not when_causal:
        return ("SDPA keeps a mask: torch's fused kernels take grouped heads only without one (its math kernel, "
                "which it would pick, repeats them anyway)")
    dropout = params["dropout_p"]
    if not (is_number(dropout) and float(dropout) == 0.0):
        return "dropout in the attention: its random stream is drawn per query head and need not match"
    if k[1] != v[1]:
        return f"key and value repeated differently ({k[1]} and {v[1]} times)"
    q, key, value = tensor_of(params["query"]), tensor_of(k[0]), tensor_of(v[0])
    if q is None or key is None or value is None or q.dim() != 4:
        return "no example values for the query, key and value (or not [B, H, S, D])"
    if q.shape[1] != key.shape[1] * k[1] or key.shape[1] != value.shape[1]:
        return "the query heads are not the key heads times the repeat"
    if not isinstance(params["is_causal"], bool) or params["enable_gqa"] is not False:
        return "is_causal or enable_gqa is not a constant False/True"
    try:
        backend = _grouped_backend(str(q.device), q.dtype, q.shape[1], key.shape[1], q.shape[-1], value.shape[-1],
                                   when_causal or params["is_causal"], bool(q.requires_grad or key.requires_grad))
    except (RuntimeError, TypeError) as error:
        return f"torch could not say which kernel would take grouped heads here ({error})"
    if backend == _MATH:
        return (f"torch would run grouped heads on its math kernel on {q.device.type} in {q.dtype} at head dim "
                f"{q.shape[-1]} (it repeats them itself there)")
    return None


def set_grouped(node: fx.Node, key: fx.Node, value: fx.Node) -> None:
    """Make the SDPA call ``node`` read ``key`` and ``value`` with ``enable_gqa=True``, wherever they were passed."""
    args = list(node.args)
    kwargs = dict(node.kwargs)
    for position, name, new in ((1, "key", key), (2, "value", value)):
        if position < len(args):
            args[position] = new
        else:
            kwargs[name] = new
    if len(args) > 7:
        args[7] = True
    else:
        kwargs["enable_gqa"] = True
    node.args, node.kwargs = tuple(args), kwargs


def fuse_gqa_attention_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, report: Report,
                            options: PassOptions = PassOptions()) -> fx.GraphModule:
    """Pass every SDPA's in-place repeated key and value heads unrepeated, with ``enable_gqa=True``, where the
    guards of the module docstring allow, in ``gm`` and its bodies; the repeats left without readers are erased.
    Sites whose mask is chosen per call are recorded for the graph's is_causal version (``GQA_WHEN_CAUSAL``)."""
    per_call = {node for _, node, _ in gm.meta.get(MASK_INPUT_SITES, ())}
    when_causal = []
    for graph_module in [gm, *subgraphs(gm)]:
        changed = False
        for node in list(graph_module.graph.nodes):
            if not is_repeated_kv_attention(node):
                continue
            params = _sdpa_arguments(node)
            k, v = repeated_heads(params["key"]), repeated_heads(params["value"])
            if k is None or v is None:
                report.reject(FAMILY, node, "only one of key and value has its heads repeated")
                continue
            chosen_per_call = node in per_call and params["attn_mask"] is not None
            why = _refusal(params, k, v, when_causal=chosen_per_call)
            if why:
                report.reject(FAMILY, node, why)
                continue
            heads = f"{tensor_of(k[0]).shape[1]} key / value heads read by {tensor_of(k[0]).shape[1] * k[1]} query heads"
            if chosen_per_call:
                when_causal.append((graph_module, node, k[0], v[0]))
                report.kept_on_purpose(FAMILY, node)
                report.replaced(Site(FAMILY, "enable_gqa=True when causal", module_path(node), source_location(node),
                                     f"{heads}, not repeated in the version run when the mask is causal (chosen "
                                     "per call); repeated in the version as written"))
                continue
            repeated = [params["key"], params["value"]]
            set_grouped(node, k[0], v[0])
            _erase_chains(repeated)
            changed = True
            report.replaced(Site(FAMILY, "enable_gqa=True", module_path(node), source_location(node),
                                 f"{heads}, not repeated"))
        if changed:
            graph_module.graph.lint()
            graph_module.recompile()
    if when_causal:
        gm.meta[GQA_WHEN_CAUSAL] = when_causal
    return gm


_CHAIN_METHODS = ("reshape", "view", "flatten", "expand", "unsqueeze", "repeat_interleave", "contiguous", "clone")
_CHAIN_FUNCTIONS = (operator.getitem, torch.reshape, torch.flatten, torch.unsqueeze, torch.repeat_interleave,
                    torch.Tensor.expand)


def _erase_chains(nodes: list[fx.Node]) -> None:
    """Erase the repeat chains ending at ``nodes`` (their view and repeat nodes) as far as nothing else reads
    them."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node.users \
                or not (is_method(node, *_CHAIN_METHODS) or is_function(node, *_CHAIN_FUNCTIONS)):
            continue
        inputs = node.all_input_nodes
        node.graph.erase_node(node)
        stack.extend(inputs)


# The family's declaration (compiler/families.py): the pipeline, the anchor check and the docs' table read it.
DECLARATION = Family(FAMILY, fuse_gqa_attention_pass, order=130, anchor=is_repeated_kv_attention, whole_module=True,
                     records=(GQA_WHEN_CAUSAL,),
                     summary=("key and value heads repeated for SDPA -> SDPA's `enable_gqa=True` on the unrepeated "
                              "heads"))
