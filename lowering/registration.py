"""How sloth's ops become torch.library operators: ``custom_op`` (opaque to the compiler) or ``triton_op``.

    define("sloth::name", fn)   the operator, from a function of tensors (its type hints give the schema)
    fake(op)(impl)              op.register_fake(impl); nothing under triton_op, where fn is its own fake
    launch(kernel)[grid](...)   how fn launches a Triton kernel: wrap_triton(kernel) under triton_op

With ``custom_op`` every call of an op from a compiled graph runs fn in Python, and each Triton launch goes
through Triton's JIT dispatch: on the H200 that host time (0.3 ms a LoRA forward, 0.45 ms a backward,
benchmarks/results/2026-11-29_1739_profile-sloth-host-L4.txt) exceeds the GPU time of a LoRA step. With
``triton_op`` AOTAutograd traces fn itself into the graph (its torch ops plus one higher-order op per kernel
launch) and Inductor launches the same kernels from its generated wrapper, with no Python per op.

``triton_op`` is chosen when ``SLOTH_TRITON_OP=1`` is set before sloth is imported and the kernels are not
interpreted (Triton's CPU interpreter makes its own kernel objects, which ``wrap_triton`` refuses before torch
2.14). The op's meaning, its backward (``register_autograd``) and its kernels are the same either way; one
difference: Inductor launches a user kernel with its own compile options and drops launch options such as
``enable_fp_fusion``, so a kernel must not rely on them for its numbers (lowering/nf4.py rounds explicitly).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from .backend_choice import triton_interpreter_on

TRITON_OP: bool = (os.environ.get("SLOTH_TRITON_OP", "0") == "1" and not triton_interpreter_on()
                   and hasattr(torch.library, "triton_op"))


def define(name: str, fn: Callable) -> Any:
    """The operator ``name`` (e.g. "sloth::rms_norm") computing ``fn``, functional (it mutates no input)."""
    if TRITON_OP:
        return torch.library.triton_op(name, fn, mutates_args=())
    return torch.library.custom_op(name, mutates_args=())(fn)


def fake(op: Any) -> Callable[[Callable], Callable]:
    """Decorator registering ``impl`` as ``op``'s fake (shape-only) implementation; under triton_op the op's
    own function already is one, so ``impl`` is left unused."""
    if TRITON_OP:
        return lambda impl: impl
    return op.register_fake


def launch(kernel: Any) -> Any:
    """``kernel`` as the op's function should launch it: ``launch(kernel)[grid](*args)``.

    Tried and not kept: a launcher that kept each kernel's ``CompiledKernel`` under a specialisation key built
    in Python and called its launcher directly, skipping ``JITFunction.run``. On the H200 it was slower than
    Triton 3.6's own dispatch, whose argument specialisation is native code: 23.9 vs 16.4 us a launch, LoRA
    step 277.5 vs 263.4 ms on one lease (benchmarks/results/2026-11-29_212631_launch_overhead.json and the
    e2e records beside it; commit bfd1dc1)."""
    if TRITON_OP:
        return torch.library.wrap_triton(kernel)
    return kernel
