"""Activation offload at run time: the ops the offload partition (compiler/offload_partition.py) puts into the
compiled forward and backward graphs, and the state they share across one training step.

    forward:   h_cpu = sloth::offload(h)                      copy h to pinned host memory on a side stream
    backward:  token = sloth::offload_prefetch(h0_cpu)         start the first reload at the top of the backward
               h0 = sloth::reload(h0_cpu, h1_cpu, token)       wait for h0's copy; start h1's
               ...
               h1 = sloth::reload(h1_cpu, h2_cpu, None)        wait for h1's copy (issued above); start h2's

    and, with ``prefetch_after_attention`` (the default), where an attention's backward runs between two reloads:
               h2 = sloth::reload(h2_cpu, None, None)           wait for h2's copy; start nothing
               dq = aten._scaled_dot_product_..._backward(...)
               token3 = sloth::offload_prefetch(h3_cpu, dev, dq)  start h3's copy after the attention's backward
               h3 = sloth::reload(h3_cpu, h4_cpu, token3)

One side stream per device carries every copy, device-to-host in the forward and host-to-device in the
backward, so the copies queue behind one another and never behind compute. Each copy waits for an event
recorded on the compute stream when it is issued (its source is ready there) and records its own event; the
compute stream waits on that event only where the reloaded tensor is first used. The look-ahead is explicit
in the graph: reload i names the tensor reload i + 1 needs, and starts its copy as soon as its own has
arrived, so that copy runs while layer i's backward computes. At most two reloaded tensors are alive at a
time (the one in use and the one arriving): a double buffer, taken from PyTorch's caching allocator rather
than held by sloth, because a buffer sloth kept and rewrote could alias memory Inductor has since reused.

Host memory comes from a pinned pool (``PinnedPool``): each offload takes a free pinned buffer of its size,
allocating one only when none is free (the first step; allocating pinned memory synchronises the device, so
the steady state must not), and a buffer is free again once nothing holds the tensor handed out (autograd
released the step's saved tensors). A second forward before the backward therefore takes other buffers; it
never overwrites saved values. Nothing here synchronises the host with the device.

On the CPU (tests, and a CPU model) the same ops run with plain copies: the graph rewrite and the look-ahead
bookkeeping are the same, the copies synchronous.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Optional

import torch

# The ops live in sloth's namespace, defined with torch.library's low-level API: they are inserted after
# AOTAutograd partitioned the graph, so they need a kernel and a fake, never an autograd formula, and skip
# custom_op's per-call Python wrappers (~30 us a call on the H200).
_LIB = torch.library.Library("sloth", "FRAGMENT")
_LIB.define("offload(Tensor x) -> Tensor")
_LIB.define("offload_prefetch(Tensor x_host, Device device, Tensor? after=None) -> Tensor")
_LIB.define("reload(Tensor x_host, Tensor? next_host, Tensor? after, Device device) -> Tensor")


@dataclasses.dataclass
class OffloadStats:
    """What the offload ops moved since ``reset_stats()``: tensors and bytes each way, pinned bytes held."""
    offloaded: int = 0
    offloaded_bytes: int = 0
    reloaded: int = 0
    reloaded_bytes: int = 0
    prefetch_hits: int = 0  # reloads whose copy had been started by the reload before them (or the prefetch)


stats = OffloadStats()


def reset_stats() -> None:
    global stats
    stats = OffloadStats()


class PinnedPool:
    """Pinned host buffers by size, lent as tensors; a buffer is free when no tensor lent from it is alive."""

    def __init__(self) -> None:
        # nbytes -> [(buffer, its storage, the storage's use count when nothing is lent)]
        self._buffers: dict[int, list[tuple[torch.Tensor, torch.UntypedStorage, int]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _uses(storage: torch.UntypedStorage) -> int:
        return torch._C._storage_Use_Count(storage._cdata)

    def take(self, like: torch.Tensor, pin: bool) -> torch.Tensor:
        """A host tensor of ``like``'s shape and dtype (contiguous), from a free buffer of its size."""
        nbytes = like.numel() * like.element_size()
        with self._lock:
            same_size = self._buffers.setdefault(nbytes, [])
            # Free: no lent view alive anywhere (autograd's saved tensors, a reload in flight) adds a use.
            buffer = next((b for b, storage, idle in same_size if self._uses(storage) == idle), None)
            if buffer is None:
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                storage = buffer.untyped_storage()
                same_size.append((buffer, storage, self._uses(storage)))
            return buffer.view(like.dtype).view(like.shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for same in self._buffers.values() for b, _, _ in same)

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()


pool = PinnedPool()
_side_streams: dict[torch.device, "torch.cuda.Stream"] = {}
# host data_ptr -> (device tensor being filled, event recorded after its copy): reloads started ahead of use.
# An entry whose reload never runs (a backward that raised) holds its device tensor until that host buffer is
# offloaded into again, which drops it.
_in_flight: dict[int, tuple[torch.Tensor, Optional["torch.cuda.Event"]]] = {}


def _device_key(device: torch.device) -> torch.device:
    """``device`` with its index (a reload may name ``cuda`` where the offloaded tensor was on ``cuda:0``): the key
    of its side stream and staging slots, so an offload and its reload share them."""
    if device.index is None and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """``device``'s side stream, one per device: its copies run in order, so a reload starts after the offload
    that filled its host buffer."""
    key = _device_key(device)
    stream = _side_streams.get(key)
    if stream is None:
        stream = _side_streams[key] = torch.cuda.Stream(device=key)
    return stream


class StagingSlots:
    """Two device buffers per device that every offload stages its tensor through, taken in turn.

    Why staging at all: the side stream must not read ``x`` itself, because Inductor reuses a dead buffer's memory
    for a later kernel's output without any allocator call (so ``record_stream`` cannot guard it), and ``x``
    is dead to Inductor once this op returns. Why sloth's own two buffers and not a fresh clone each time: a
    clone freed with ``record_stream`` stays *allocated* until the host finds its copy's event complete, and
    the host runs layers ahead of the GPU. Measured on an H100 (Llama-3-8B, 16k tokens, offload, 2026-12-05,
    ``e2e --memory-peak``): 19 staging clones (2.4 GiB) were still allocated at the step's peak, in the first
    recomputed layer's backward; with the MLP tiled, 7 (0.9 GiB). Two slots hold 2 x 128 MiB there during the
    forward, and the backward (``release``, at its first reload) holds none. (Kept for the whole step, they took
    the tiled step's timed peak from 18.05 to 18.30 GiB: there the pile-up had not been at the timed peak.)

    Slot i is rewritten (on the compute stream) only after the device-to-host copy that last read it (on the
    side stream) has finished: the compute stream waits on that copy's event, a device-side wait, no host sync.
    A slot too small for a tensor is replaced by a larger one; the old buffer is handed to ``record_stream`` on
    the side stream before sloth drops it, so the allocator keeps its memory until its last copy is done (it is
    sloth's alone: nothing else can have reused it)."""

    def __init__(self) -> None:
        # device -> [buffer (uint8), event of the copy that last read it or None] for each of the two slots
        self._slots: dict[torch.device, list[list]] = {}
        self._turn: dict[torch.device, int] = {}

    def stage(self, x: torch.Tensor, compute: "torch.cuda.Stream", side: "torch.cuda.Stream") -> torch.Tensor:
        """``x`` copied (on ``compute``) into the next slot, as a contiguous tensor of its shape and dtype."""
        key = _device_key(x.device)
        slots = self._slots.setdefault(key, [[None, None], [None, None]])
        turn = self._turn.get(key, 0)
        self._turn[key] = 1 - turn
        slot = slots[turn]
        nbytes = x.numel() * x.element_size()
        if slot[1] is not None:
            compute.wait_event(slot[1])  # the copy that last read this slot is done before it is rewritten
        if slot[0] is None or slot[0].numel() < nbytes:
            if slot[0] is not None:
                slot[0].record_stream(side)
            slot[0] = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        staging = slot[0][:nbytes].view(x.dtype).view(x.shape)
        staging.copy_(x)
        return staging

    def copied(self, x_device: torch.device, side: "torch.cuda.Stream") -> None:
        """Record, on ``side``, the end of the copy that read the slot just staged."""
        key = _device_key(x_device)
        slot = self._slots[key][1 - self._turn[key]]
        slot[1] = torch.cuda.Event()
        slot[1].record(side)

    def release(self, device: torch.device, compute: "torch.cuda.Stream") -> None:
        """Drop ``device``'s slots (the backward needs none; its peak is where activation memory peaks): the
        compute stream first waits for the copies that read them, so that the allocator, which lends freed memory
        to work on the stream that allocated it (the compute stream, here) in stream order, never lets a later
        kernel write into a slot a copy is still reading. No host sync; nothing to do when none are held."""
        key = _device_key(device)
        slots = self._slots.pop(key, None)
        if slots is None:
            return
        for _, event in slots:
            if event is not None:
                compute.wait_event(event)
        self._turn.pop(key, None)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for slots in self._slots.values() for b, _ in slots if b is not None)


staging_slots = StagingSlots()


def _offload(x: torch.Tensor) -> torch.Tensor:
    host = pool.take(x, pin=x.is_cuda)
    _in_flight.pop(host.data_ptr(), None)  # a stale reload of this buffer's earlier contents must not be used
    stats.offloaded += 1
    stats.offloaded_bytes += x.numel() * x.element_size()
    if not x.is_cuda:
        host.copy_(x)
        return host
    # The device-to-device staging copy is about 0.06 ms per 128 MiB at the H200's bandwidth (read and write), on
    # the compute stream; in the 16k step's measurement the whole offload cost 4.6 ms a step, these copies included.
    compute, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
    staging = staging_slots.stage(x, compute, side)
    side.wait_stream(compute)  # the staging copy is made on the compute stream
    with torch.cuda.stream(side):
        host.copy_(staging, non_blocking=True)
    staging_slots.copied(x.device, side)
    return host


def _start_reload(host: torch.Tensor, device: torch.device) -> None:
    """Start copying ``host`` back to ``device`` (no wait), unless that copy is already under way."""
    key = host.data_ptr()
    if key in _in_flight:
        return
    if device.type != "cuda":
        _in_flight[key] = (host.to(device, copy=True), None)
        return
    compute = torch.cuda.current_stream(device)
    # The backward's first reload (the prefetch at its top, or a reload without one) ends the forward's staging:
    # its slots go before this target is allocated, which may then take their memory (a no-op after the first).
    staging_slots.release(device, compute)
    # Allocated on the compute stream, where it is used and freed; the side stream writes it after every
    # compute already queued (so no earlier use of this memory is overwritten).
    target = torch.empty_like(host, device=device)
    side = _side_stream(device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        target.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    _in_flight[key] = (target, done)


def _prefetch(x_host: torch.Tensor, device: torch.device, after: Optional[torch.Tensor] = None) -> torch.Tensor:
    # ``after``: only ordering (the graph places this op after the op that made it: an attention's backward)
    _start_reload(x_host, device)
    return torch.empty(0, device=device)


def _reload(x_host: torch.Tensor, next_host: Optional[torch.Tensor], after: Optional[torch.Tensor],
            device: torch.device) -> torch.Tensor:
    key = x_host.data_ptr()
    stats.prefetch_hits += key in _in_flight
    _start_reload(x_host, device)
    target, done = _in_flight.pop(key)
    if done is not None:
        torch.cuda.current_stream(device).wait_event(done)
    if next_host is not None:
        _start_reload(next_host, device)  # runs on the side stream while this tensor's layer computes
    stats.reloaded += 1
    stats.reloaded_bytes += target.numel() * target.element_size()
    return target


for _key in ("CPU", "CUDA"):
    _LIB.impl("offload", _offload, _key)
    _LIB.impl("offload_prefetch", _prefetch, _key)
    _LIB.impl("reload", _reload, _key)


@torch.library.register_fake("sloth::offload", lib=_LIB)
def _offload_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.register_fake("sloth::offload_prefetch", lib=_LIB)
def _prefetch_fake(x_host: torch.Tensor, device: torch.device, after: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.empty(0, device=device)


@torch.library.register_fake("sloth::reload", lib=_LIB)
def _reload_fake(x_host: torch.Tensor, next_host: Optional[torch.Tensor], after: Optional[torch.Tensor],
                 device: torch.device) -> torch.Tensor:
    return torch.empty(x_host.shape, dtype=x_host.dtype, device=device)
