"""Returned logits computed only when read, with a gradient only when one arrives.

A transformers ``*ForCausalLM`` returns its logits beside the loss, and most training steps never read them
(the Trainer keeps the loss alone). Computed in the graph, they cost their memory at the end of the forward,
``N x V`` in the model's dtype (4 GiB at Llama-3-8B, 16384 tokens), and twice that again in float32 under
accelerate's mixed precision, whose forward wrapper returns ``logits.float()``; and a compiled graph is one
autograd node for all its outputs, so AOTAutograd materialises a zero ``[N, V]`` gradient for them and runs the
lm_head's input gradient on it in every backward (measured on the H200 at Llama-3-8B 2 x 2048: 4.6 ms of the
step's 6.3 ms matmul excess and a 1 GiB zero fill, ``benchmarks/results/2026-12-01_1144_profile-*``).

So the cross-entropy pass (patterns/cross_entropy.py) returns them through a slot, and ``reattach`` hands the
caller a ``LazyLogits``: a tensor of the logits' shape, dtype and device that holds ``x``, ``w`` and ``b`` and

    logits = cast(linear(cast(x, c), cast(w, c), cast(b, c)), out)      (c: autocast's dtype, else none)

- "lazy", in a training graph whose head is frozen (LoRA, QLoRA): the graph returns x in their place and the
  loss computes its own tiles (as with ``return_logits=False``); the logits are computed the first time anything
  reads them (any op, ``.tolist()``, ``.numpy()``, printing) and kept for later reads; a dtype conversion alone
  (``.float()``) gives lazy logits of that dtype. A step that never reads them never forms them; one that reads
  them (TRL's token accuracy) pays one lm_head matmul after the forward. The value is eager's: the same linear on
  the same x, w and b in the same dtypes. A head changed in place before the first read (the version counter
  says so) or freed raises instead of giving the new head's logits; a write through ``.data`` bumps no version
  and is not seen. Not in a distributed process: FSDP frees the gathered head after the forward.
- "computed", where the head trains (an optimiser step would change w before a late read) or in no training
  graph: the graph computes them, detached, with x as one more output, and they are returned as they are.

In autograd the logits are the output of ``ReturnedLogits``, a node of their own whose gradient is not
materialised, so the caller who differentiates them gets eager's linear backward (``g`` the gradient, cast to
the projection's dtype as eager's ``.float()`` backward does, flattened to ``[N, V]``):

    dx = cast(g @ cast(w, c), x.dtype),   dw = cast(g.T @ cast(x, c), w.dtype),   db = cast(g.sum(0), b.dtype)

and the caller who does not pays nothing. ``x`` is kept for that (N x H, 128 MiB at 8B and 16384 tokens).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

META_KEY = "sloth_returned_logits"


@dataclasses.dataclass(frozen=True)
class ReturnedLogitsSlot:
    """Output ``output`` of the graph stands for ``cast(linear(x, w, b), out_dtype)``, computed in ``compute_dtype``
    (autocast's; None: x's and w's own); ``w`` and ``b`` are the graph's inputs ``w_input`` and ``b_input``. Lazy
    (``x_output`` None): that output is x. Computed: it is the logits, detached, and x is output ``x_output`` (an
    extra one, stripped before the caller sees it)."""
    output: int
    w_input: int
    b_input: Optional[int]
    out_dtype: torch.dtype
    compute_dtype: Optional[torch.dtype] = None
    x_output: Optional[int] = None


def _cast(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    return t if t is None or dtype is None else t.to(dtype)


def compute_logits(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], out_dtype: torch.dtype,
                   compute_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The logits a slot stands for (module docstring), with no autograd and no ambient autocast: the dtypes are
    the graph's, whatever context reads them."""
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        return F.linear(_cast(x, compute_dtype), _cast(w, compute_dtype), _cast(b, compute_dtype)).to(out_dtype)


# Methods that read a tensor's data without dispatching an op: they get the computed logits.
_READS_DATA = ("tolist", "numpy", "__array__", "data_ptr", "untyped_storage", "storage", "__reduce_ex__",
               "__dlpack__", "__dlpack_device__")


class LazyLogits(torch.Tensor):
    """The logits of a lazy slot, computed on first read (module docstring). A wrapper tensor: its metadata is the
    logits', its data ``x``, ``w`` and ``b`` until something reads it."""

    @staticmethod
    def __new__(cls, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], out_dtype: torch.dtype,
                compute_dtype: Optional[torch.dtype] = None, versions: Optional[tuple] = None):
        shape = (*x.shape[:-1], w.shape[0])
        made = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=out_dtype, device=x.device)
        made._parts = (x.detach(), w.detach(), None if b is None else b.detach(), compute_dtype)
        # the head's version counters when the logits were formed: a later in-place change is caught on first read
        made._versions = versions if versions is not None else (w._version, None if b is None else b._version)
        made._value = None
        return made

    def computed(self) -> torch.Tensor:
        """The logits as a plain tensor, computed the first time."""
        if self._value is None:
            x, w, b, compute_dtype = self._parts
            if (w._version, None if b is None else b._version) != self._versions or w.untyped_storage().size() == 0:
                raise RuntimeError(
                    "sloth: these logits are read after the lm_head's weight changed in place (an optimizer step?) "
                    "or was freed; sloth computes returned logits when they are first read "
                    "(patterns/returned_logits.py), so read them before the weight changes")
            self._value = compute_logits(x, w, b, self.dtype, compute_dtype)
            self._parts = (None, None, None, compute_dtype)  # x and the head are no longer needed here
        return self._value

    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(self.computed())

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in _READS_DATA:
            args = tuple(a.computed() if isinstance(a, LazyLogits) else a for a in args)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], LazyLogits) and args[0]._value is None \
                and set(kwargs) <= {"dtype"} and kwargs.get("dtype") is not None:
            this = args[0]  # a dtype conversion alone (accelerate's .float()): lazy logits of that dtype
            x, w, b, compute_dtype = this._parts
            converted = LazyLogits(x, w, b, kwargs["dtype"], compute_dtype, versions=this._versions)
            # the same x, w and b: detached again here, below autograd, w would get a version counter of its own
            converted._parts = this._parts
            return converted

        def computed(t: Any) -> Any:
            return t.computed() if isinstance(t, LazyLogits) else t

        out = func(*tree_map(computed, args), **tree_map(computed, kwargs))
        if isinstance(kwargs.get("out"), LazyLogits):
            return kwargs["out"]  # written into the computed value: the wrapper is what the op returns
        first = func._schema.arguments[0] if func._schema.arguments else None
        if first is not None and first.alias_info is not None and first.alias_info.is_write \
                and isinstance(args[0], LazyLogits):
            return args[0]  # an in-place op wrote into the computed value; the wrapper is what it returns
        return out


class ReturnedLogits(torch.autograd.Function):
    """The logits in the forward (``LazyLogits`` of x, w, b, or ``value[0]``, the graph's); eager's linear
    gradients in the backward, only when one arrives."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], out_dtype: torch.dtype,
                compute_dtype: Optional[torch.dtype], value: list):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w)
        ctx.compute_dtype = compute_dtype
        ctx.b_dtype = None if b is None else b.dtype
        # ``value`` comes in a list, not as an input: an input returned as a view could not be written in place
        # (logits.div_(temperature)), as eager's logits can
        return LazyLogits(x, w, b, out_dtype, compute_dtype) if value[0] is None else value[0]

    @staticmethod
    def backward(ctx, g: Optional[torch.Tensor]):
        if g is None:
            return None, None, None, None, None, None
        x, w = ctx.saved_tensors
        projection_dtype = ctx.compute_dtype or torch.promote_types(x.dtype, w.dtype)
        g_NV = g.reshape(-1, g.shape[-1]).to(projection_dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (g_NV @ _cast(w, ctx.compute_dtype)).to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = (g_NV.t() @ _cast(x, ctx.compute_dtype).reshape(-1, x.shape[-1])).to(w.dtype)
        if ctx.needs_input_grad[2]:
            db = g_NV.sum(0).to(ctx.b_dtype)
        return dx, dw, db, None, None, None


def reattach(compiled: Callable, slots: list[ReturnedLogitsSlot]) -> Callable:
    """``compiled`` with each slot's logits put in place (in autograd where their inputs require grad) and the extra
    outputs removed."""
    extra = sorted(slot.x_output for slot in slots if slot.x_output is not None)

    def run(*args: Any) -> Any:
        returned = compiled(*args)
        outputs = list(returned)
        for slot in slots:
            lazy = slot.x_output is None
            x = outputs[slot.output if lazy else slot.x_output]
            value = None if lazy else outputs[slot.output]
            w = args[slot.w_input]
            b = args[slot.b_input] if slot.b_input is not None else None
            if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
                outputs[slot.output] = ReturnedLogits.apply(x, w, b, slot.out_dtype, slot.compute_dtype, [value])
            elif lazy:
                outputs[slot.output] = LazyLogits(x, w, b, slot.out_dtype, slot.compute_dtype)
        for index in reversed(extra):
            del outputs[index]
        return type(returned)(outputs) if isinstance(returned, tuple) else outputs

    return run


def reattach_returned(gm: Any, compiled: Callable) -> Callable:
    """The cross-entropy family's ``after_compile``: ``compiled`` reattached where its pass recorded slots in
    ``gm.meta[META_KEY]``, else as it is."""
    slots = gm.meta.get(META_KEY)
    return reattach(compiled, slots) if slots else compiled
