"""The ``offload`` option: the partitioner's saved activations moved to host memory and back (runtime/offload.py).

AOTAutograd's partitioner splits the joint graph into a forward that returns the tensors the backward needs
("saved") and a backward that takes them. With gradient checkpointing those are each checkpointed layer's
inputs: T x H per layer, 4 GiB at Llama-3-8B 16k over 32 layers. This wraps the partitioner Inductor uses
(``min_cut_rematerialization_partition``, as ``config.custom_partitioner_fn``) and rewrites the pair it
returns:

    forward:  h = ...; ...; output(..., h)              becomes  h = ...; h_host = sloth.offload(h); ...;
                                                                 output(..., h_host)
    backward: placeholder h; ... first use of h ...     becomes  h_dev = sloth.reload(h_host, next_host, token)
                                                                 ... first use of h_dev ...

for every saved tensor that is an intermediate of the forward (not a graph input: a parameter or a batch stays
alive anyway), contiguous (a view too: its values are copied, and its base is freed unless something else
keeps it), and at least ``min_bytes``; the ``keep_last`` of them that the backward reads first stay
on the device, since their reload could not hide behind anything (in a decoder with a fused loss: the final
norm's input, read by the loss's backward; the last layer's input is then reloaded during that backward). Reloads run
in the order the backward first reads them; each names the next one's host tensor, and a prefetch at the top
of the backward starts the first, so every copy overlaps the backward of the layer before.

Why here and not saved-tensor hooks: the compiled backward is one autograd node for the whole graph and reads
all its saved tensors when it starts, so hooks would bring every offloaded tensor back at once, at the peak.
Why not torch's own ``enable_activation_offloading``: on torch 2.11 it is marked for testing, copies into
pageable memory, and acts only on forward nodes marked ``should_offload`` in the joint graph; this works the
same on 2.11 and 2.13, with pinned memory and an explicit look-ahead.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

from ..runtime import offload as offload_runtime
from . import fx_utils
from .fx_utils import is_attention_backward
from .options import OffloadOptions

_NORMS = ("sloth::rms_norm", "sloth::layer_norm")


def save_mid_layer_residuals(joint: fx.Graph) -> int:
    """Tag MUST_SAVE, in the joint graph, every input of a norm inside a checkpointed region that has the shape of
    one of that region's inputs: the residual stream between a decoder layer's attention and its MLP (the
    region's other norms, on q or k heads, have other shapes). Returns how many were tagged.

    Why: a checkpointed layer saves only its input, so its backward recomputes the whole layer before the MLP's
    backward (the MLP's input is the residual after attention), and the attention's recomputed tensors (q, k, v,
    the rotated q and k, the attention output: about 0.9 GiB at 16k tokens of Llama-3-8B) stay alive through the
    MLP's backward, where the 16k step's peak is. With the residual saved, AOTAutograd's backward, ordered as the
    autograd engine runs it, recomputes the attention only when its own backward needs it. The residual is one
    more T x H tensor a layer, which the offload moves to host memory like the layer's input."""
    in_region: dict[Any, set] = {}  # region -> the shapes of its inputs (nodes outside it that it reads)
    for node in joint.nodes:
        region = node.meta.get("ac_graph_id")
        if region is not None:
            in_region.setdefault(region, set()).update(
                tuple(i.meta["val"].shape) for i in node.all_input_nodes
                if i.meta.get("ac_graph_id") != region and isinstance(i.meta.get("val"), torch.Tensor))
    tagged = 0
    for node in joint.nodes:
        if not (isinstance(node.target, torch._ops.OpOverload) and node.target._schema.name in _NORMS):
            continue
        x, region = node.args[0], node.meta.get("ac_graph_id")
        # only the checkpoint's own preference is overridden: a policy a user asked for (MUST_RECOMPUTE) stays
        if region is None or not isinstance(x, fx.Node) or x.meta.get("ac_graph_id") != region \
                or x.meta.get("recompute") != CheckpointPolicy.PREFER_RECOMPUTE:
            continue
        value = x.meta.get("val")
        if isinstance(value, torch.Tensor) and tuple(value.shape) in in_region[region]:
            x.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            tagged += 1
    return tagged


@dataclasses.dataclass
class OffloadRecord:
    """What the offload rewrite did to one partitioned graph (kept in ``Report.offload``)."""
    tensors: int
    nbytes: int  # bytes per step moved each way (at the shapes the graph was compiled for)
    kept: int  # saved activations of at least min_bytes left on the device (keep_last)
    skipped_small: int


def _nbytes(value: torch.Tensor) -> int:
    numel = value.numel()
    if not isinstance(numel, int):  # symbolic: the size this graph was traced at
        numel = numel.node.hint if getattr(numel.node, "hint", None) is not None else 0
    return int(numel) * value.element_size()


def _fake(value: torch.Tensor) -> contextlib.AbstractContextManager:
    """The fake mode ``value`` belongs to, so new metadata tensors are fake (and symbolic shapes stay so)."""
    mode = getattr(value, "fake_mode", None)
    return mode if mode is not None else contextlib.nullcontext()


def _contiguous(value: torch.Tensor) -> bool:
    try:
        return bool(value.is_contiguous())
    except Exception:  # a data-dependent answer under symbolic shapes: not offloaded
        return False


def _late_prefetches(bw: fx.GraphModule, chosen: list, bw_order: dict) -> dict[int, fx.Node]:
    """For each reload i whose next reload's copy would otherwise start with it: the last attention backward
    between reload i's first use and reload i + 1's, where that copy then starts instead (a tensor of that op's
    output; its first, if the op returns several). {i: that node}; reloads with no attention between them keep the
    look-ahead as it was.

    Why: a reload's device buffer is allocated when its copy starts. With ``mid_layer`` the backward reloads each
    layer's input before its attention is recomputed and then starts the copy of the next layer's mid-layer
    residual, whose buffer was then alive through the attention's backward, where the 16k step peaks (its
    workspace: 514 MiB of cuDNN's at Llama-3-8B 16k on an H100). Started after it, the copy has the q/k/v
    projections' backward to hide behind instead of the whole attention backward."""
    late = {}
    attentions = [n for n in bw.graph.nodes if n in bw_order and is_attention_backward(n)]
    for i in range(len(chosen) - 1):
        start, end = chosen[i][0], chosen[i + 1][0]  # positions in the graph as partitioned (``bw_order``)
        attention = [n for n in attentions if start < bw_order[n] < end]
        if not attention:
            continue
        point = attention[-1]
        if not isinstance(point.meta.get("val"), torch.Tensor):  # several outputs: after the first one read
            outputs = sorted((u for u in point.users if isinstance(u.meta.get("val"), torch.Tensor)),
                             key=bw_order.__getitem__)
            if not outputs or bw_order[outputs[0]] >= end:  # read only after reload i + 1's use: no place
                continue
            point = outputs[0]
        late[i] = point
    return late


def offload_saved(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int,
                  policy: OffloadOptions) -> OffloadRecord:
    """Rewrite a partitioned (forward, backward) pair so the chosen saved activations live on the host."""
    output = fw.graph.find_nodes(op="output")[0]
    outputs = list(output.args[0])
    bw_inputs = {p.name: p for p in bw.graph.find_nodes(op="placeholder")}
    bw_order = {node: i for i, node in enumerate(bw.graph.nodes)}
    candidates, small = [], 0
    returned = set(outputs[:num_fwd_outputs])  # a tensor the forward also returns stays alive on the device anyway
    for position in range(num_fwd_outputs, len(outputs)):
        saved = outputs[position]
        value = saved.meta.get("val") if isinstance(saved, fx.Node) else None
        # The host copy and the reload are contiguous, so only a contiguous tensor keeps its layout through them.
        if (not isinstance(value, torch.Tensor) or saved.op != "call_function" or saved in returned
                or saved.name not in bw_inputs or not bw_inputs[saved.name].users or value.device.type == "meta"
                or not _contiguous(value)):
            continue
        if _nbytes(value) < policy.min_bytes:
            small += 1
            continue
        placeholder = bw_inputs[saved.name]
        first_use = min(placeholder.users, key=bw_order.__getitem__)
        candidates.append((bw_order[first_use], position, saved, placeholder, first_use))
    candidates.sort(key=lambda c: c[0])
    kept, chosen = candidates[:policy.keep_last], candidates[policy.keep_last:]
    if not chosen:
        return OffloadRecord(0, 0, len(kept), small)

    for _, position, saved, _, _ in chosen:
        # Right after the tensor is computed: its copy starts at once and hides behind the rest of the forward,
        # and nothing holds it to the end of the forward (Inductor frees it after its last use there).
        with fw.graph.inserting_after(saved):
            host = fw.graph.call_function(torch.ops.sloth.offload.default, (saved,))
        with _fake(saved.meta["val"]):
            host.meta["val"] = offload_runtime._offload_fake(saved.meta["val"])
        outputs[position] = host
    output.args = (tuple(outputs),) + tuple(output.args[1:])

    host_values = []
    for _, _, saved, placeholder, _ in chosen:
        value = placeholder.meta["val"]
        with _fake(value):
            placeholder.meta["val"] = offload_runtime._offload_fake(value)
        host_values.append(value)
    first_placeholder, device = chosen[0][3], host_values[0].device
    with bw.graph.inserting_after(list(bw_inputs.values())[-1]):
        token = bw.graph.call_function(torch.ops.sloth.offload_prefetch.default, (first_placeholder, device))
    with _fake(host_values[0]):
        token.meta["val"] = torch.empty(0, device=device)
    ours = {token}  # the prefetch and the reloads read host tensors; every other user gets the reloaded one
    late = _late_prefetches(bw, chosen, bw_order) if policy.prefetch_after_attention else {}
    after = {0: token}  # reload i -> the token it waits on (the prefetch that started its copy)
    for i, point in late.items():  # the copy reload i + 1 needs, started right after an attention's backward
        with bw.graph.inserting_after(point):
            later = bw.graph.call_function(torch.ops.sloth.offload_prefetch.default,
                                           (chosen[i + 1][3], host_values[i + 1].device, point))
        with _fake(host_values[i + 1]):
            later.meta["val"] = torch.empty(0, device=host_values[i + 1].device)
        ours.add(later)
        after[i + 1] = later
    for i, (_, _, saved, placeholder, first_use) in enumerate(chosen):
        following = chosen[i + 1][3] if i + 1 < len(chosen) and i not in late else None
        users = [u for u in placeholder.users if u not in ours]
        with bw.graph.inserting_before(first_use):
            reloaded = bw.graph.call_function(torch.ops.sloth.reload.default,
                                              (placeholder, following, after.get(i), host_values[i].device))
        reloaded.meta["val"] = host_values[i]
        ours.add(reloaded)
        for user in users:
            user.replace_input_with(placeholder, reloaded)
    fw.graph.lint()
    bw.graph.lint()
    fw.recompile()
    bw.recompile()
    nbytes = sum(_nbytes(c[2].meta["val"]) for c in chosen)
    return OffloadRecord(len(chosen), nbytes, len(kept), small)


class OffloadPartitioner(CustomPartitionerFn):
    """Inductor's default partitioner, then ``offload_saved`` on its result; records what it did."""

    def __init__(self, policy: OffloadOptions, records: list):
        self.policy = policy
        self.records = records

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        if self.policy.mid_layer:
            save_mid_layer_residuals(gm.graph)
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        self.records.append(offload_saved(fw, bw, kwargs["num_fwd_outputs"], self.policy))
        return fw, bw

    def uuid(self) -> Optional[Any]:
        return (get_hash_for_files((__file__, offload_runtime.__file__, fx_utils.__file__)), self.policy.min_bytes,
                self.policy.keep_last, self.policy.mid_layer, self.policy.prefetch_after_attention)
