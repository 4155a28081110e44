"""How sloth's ops become torch.library operators: one way, ``custom_op`` (opaque to the compiler) with a twin.

    define("sloth::name", fn)   the operator, from a function of tensors (its type hints give the schema), and its
                                runtime twin
    fake(op)(impl)              op.register_fake(impl), for the op and its twin
    RUNTIME_TWINS               custom op -> its runtime twin, the op a compiled graph calls (below)
    RESTRIDED                   outputs of a PyTorch reference (CPU, no interpreter) copied into the layout the
                                fake declares, per op: on that path each op and twin returns what its fake declares

Every call of an op from a compiled graph runs fn in Python, and each Triton launch goes through Triton's JIT
dispatch. Tried and not kept (docs/history.md): ``triton_op``, where AOTAutograd traces fn into the graph and
Inductor launches the kernels from its generated wrapper, with no Python per op; on the H200 a 4-layer step was no
faster (44.9 vs 45.2 ms), the GPU time grew 2.6% and compiling took 2.3 times longer
(benchmarks/README.md, "What closed the LoRA gap"). Nor a launcher of sloth's own: one that kept each kernel's
``CompiledKernel`` under a specialisation key built in Python was slower than Triton 3.6's own dispatch on the H200
(23.9 vs 16.4 us a launch, LoRA step 277.5 vs 263.4 ms; benchmarks/results/2026-11-29_212631_launch_overhead.json,
commit bfd1dc1); Triton's binder with torch's static launcher was no faster on an H100 (10.97 vs 11.13 us a launch,
the Qwen3-MoE step 49.9 vs 49.65 ms; benchmarks/results/2026-12-06_issue20_static_launch_h100.md, commit 8592dd2):
most of a launch is the native specialisation and the C launch, which both paths keep.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch._ops import OpOverload

from .backend_choice import triton_interpreter_on


# Runtime twins. A custom op called from a compiled graph goes through custom_op's Python wrappers on every
# call, also where nothing needs them: its autograd kernel (Python, which finds grad mode off inside
# AOTAutograd's compiled forward and backward and redispatches) and its backend wrapper (which checks that no
# output aliases an input). Each op therefore gets a twin, ``sloth_rt::<name>``: the same schema, tags and
# function, defined with torch.library's low-level API, the function registered for every device
# (CompositeExplicitAutograd, as custom_op registers it) and autograd a fallthrough. compiler/late_passes.py
# swaps each op for its twin in the graphs Inductor compiles (after AOTAutograd has traced the op's autograd,
# so nothing there needs it). CPU, torch 2.13, one call with six arguments: 9.3 us through custom_op (no
# grad), 3.5 us through the twin. H200 host (a slow lease, benchmarks/results/2026-11-30_015139_launch_overhead.*):
# rms_norm 88.7 -> 37.3 us a call, lora_linear 147.4 -> 119.3, the joined q/k/v backward (list arguments)
# 728.9 -> 407.8.
RUNTIME_TWINS: dict[OpOverload, OpOverload] = {}
_RUNTIME_LIB = torch.library.Library("sloth_rt", "DEF")


def add_twin(op: Any, fn: Callable) -> None:
    """Define ``op``'s runtime twin computing ``fn`` (``define`` calls this)."""
    overload = op._opoverload
    schema = str(overload._schema)
    name = schema.split("(", 1)[0].split("::", 1)[1]
    _RUNTIME_LIB.define(name + schema[schema.index("("):], tags=tuple(overload.tags))
    _RUNTIME_LIB.impl(name, fn, "CompositeExplicitAutograd")
    _RUNTIME_LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")
    RUNTIME_TWINS[overload] = getattr(torch.ops.sloth_rt, name).default
    # CPU tensors: the op's and its twin's kernel lays the reference path's outputs out as the fake declares.
    op.register_kernel("cpu", _as_declared(overload, fn))
    _RUNTIME_LIB.impl(name, _as_declared(overload, fn), "CPU")


# The reference path's outputs that ``_as_declared`` had to copy into their declared layout, counted per op (the
# tests of that path require none: each reference returns its fake's layout itself).
RESTRIDED: Counter = Counter()


def _as_declared(overload: OpOverload, fn: Callable) -> Callable:
    """``fn`` for CPU tensors. Where Triton's interpreter is off, ``fn`` ran the op's PyTorch reference, whose
    outputs need not have the strides of the fake's (a matmul's result is contiguous; the Triton path allocates
    each output as the fake does): every tensor output whose layout differs is copied into the declared one, since
    Inductor asserts each output's size and strides against the fake's; a different size or dtype raises. The
    declaration comes from calling the op on meta copies of the arguments, which its fake serves."""
    def run(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if triton_interpreter_on():
            return result
        declared = overload(*_on_meta(args), **{key: _on_meta(value) for key, value in kwargs.items()})
        if isinstance(result, torch.Tensor):
            return _laid_out_as(overload, 0, result, declared)
        if isinstance(result, (tuple, list)):
            return type(result)(_laid_out_as(overload, i, r, d) for i, (r, d) in enumerate(zip(result, declared)))
        return result

    return run


def _on_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_on_meta(v) for v in value)
    return value


def _laid_out_as(overload: OpOverload, index: int, value: Any, declared: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.shape != declared.shape or value.dtype != declared.dtype:
        raise RuntimeError(f"{overload}: output {index} of the PyTorch reference is {value.dtype} "
                           f"{tuple(value.shape)}, its fake declares {declared.dtype} {tuple(declared.shape)}")
    same = value.numel() == 0 or all(n == 1 or a == b for n, a, b in zip(value.shape, value.stride(),
                                                                        declared.stride()))
    if same:  # as Inductor's assert_size_stride: a dimension of size 1 may have any stride
        return value
    RESTRIDED[str(overload)] += 1
    return torch.empty_strided(value.shape, declared.stride(), dtype=value.dtype, device=value.device).copy_(value)


def add_twin_fake(op: Any, impl: Callable) -> None:
    """Register ``impl`` as the fake of ``op``'s twin, if it has one."""
    twin = RUNTIME_TWINS.get(op._opoverload)
    if twin is not None:
        torch.library.register_fake(twin, impl)


def define(name: str, fn: Callable, mutates_args: tuple[str, ...] = ()) -> Any:
    """The operator ``name`` (e.g. "sloth::rms_norm") computing ``fn``, functional unless ``mutates_args`` names
    the inputs it writes, and its runtime twin."""
    op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
    add_twin(op, fn)
    return op


def fake(op: Any) -> Callable[[Callable], Callable]:
    """Decorator registering ``impl`` as ``op``'s (and its twin's) fake (shape-only) implementation."""

    def register(impl: Callable) -> Callable:
        op.register_fake(impl)
        add_twin_fake(op, impl)
        return impl

    return register
