"""Triton launches without Triton's per-call JIT dispatch: ``cached(kernel)[grid](*args, **kwargs)``.

``kernel[grid](...)`` runs ``JITFunction.run`` on every call: it binds and specialises every argument, builds a
string cache key from the specialisation and the launch options, checks the kernel's globals and asks the
driver for the device and stream before the launch itself. sloth's ops launch 2,700 kernels a step of the
Llama-3-8B LoRA benchmark from Python (each op a ``custom_op``), and that step is host-bound without CUDA
graphs, so this dispatch is paid on the critical path.

Here the first call with a given *specialisation key* goes through ``kernel[grid]`` (which compiles or finds
the kernel and launches it) and keeps the ``CompiledKernel`` it returns; later calls with the same key call
its launcher directly. The key is at least as fine as Triton's own specialisation, so a hit always finds the
kernel Triton would have chosen (a finer key only costs an extra miss, which is Triton's normal path):

    tensor argument       (dtype, data_ptr % 16 == 0)          Triton: the pointer type and 16-byte alignment
    int argument          (int, v == 1, v % 16 == 0, range)    Triton: 1 is a constant, % 16 a divisibility
                                                               attribute, the range picks i32 / i64 / u64
    float / bool / None   the type                             Triton: fp32 / i1 / constexpr None
    constexpr parameter   its value (positional or keyword)    part of the compiled kernel
    launch options        (name, value) of every other keyword num_warps, num_stages, ...
    device                the current CUDA device

Anything else (a tensor subclass, a tuple argument, a launch hook such as Proton's being installed, the
interpreter) goes through ``kernel[grid]`` every time. Kernels are assumed not to read Python globals that
change after their first compilation (Triton checks that on each call; sloth's kernels use module-level
constexprs only).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

_I32 = (-2 ** 31, 2 ** 31 - 1)
_I64 = (-2 ** 63, 2 ** 63 - 1)


def _int_key(v: int) -> tuple:
    kind = 0 if _I32[0] <= v <= _I32[1] else 1 if _I64[0] <= v <= _I64[1] else 2
    return (v == 1, v % 16 == 0, kind)


def arg_key(v: Any) -> Any:
    """The part of a specialisation key one runtime (non-constexpr) argument contributes, or raise
    ``_Uncacheable`` for argument kinds handled only by Triton's own dispatch."""
    t = type(v)
    if t is torch.Tensor or t is torch.nn.Parameter:
        return (v.dtype, v.data_ptr() % 16 == 0)
    if t is int:
        return _int_key(v)
    if t is float or t is bool or v is None:
        return t
    raise _Uncacheable(t)


class _Uncacheable(Exception):
    pass


class _Plan:
    """How one call shape (number of positional arguments, keyword names) maps to the kernel's parameters:
    which positions are constexpr (their values join the key) and how to assemble the launcher's
    argument list (every parameter in signature order, defaults filled in, launch options left out)."""

    def __init__(self, params: list, n_pos: int, kw_names: tuple[str, ...]):
        names = [p.name for p in params]
        kw_params = [k for k in kw_names if k in names]
        self.constexpr_pos = tuple(i for i in range(n_pos) if params[i].is_constexpr)
        self.runtime_pos = tuple(i for i in range(n_pos) if not params[i].is_constexpr)
        self.sources: list[tuple[int, Any]] = []  # (0, position) | (1, keyword) | (2, default value)
        for i, p in enumerate(params):
            if i < n_pos:
                self.sources.append((0, i))
            elif p.name in kw_params:
                self.sources.append((1, p.name))
            elif p.has_default:
                self.sources.append((2, p.default))
            else:
                raise TypeError(f"missing argument {p.name!r}")
        self.runtime_kw = tuple(k for k in kw_params if not params[names.index(k)].is_constexpr)
        self.static_kw = tuple(k for k in kw_names if k not in self.runtime_kw)  # constexprs and launch options

    def values(self, args: tuple, kwargs: dict) -> list:
        return [args[s] if kind == 0 else kwargs[s] if kind == 1 else s for kind, s in self.sources]


class CachedLauncher:
    """``kernel[grid](*args, **kwargs)`` with the compiled kernel looked up by a cheap key (module docstring)."""

    def __init__(self, kernel: Any, current_device: Callable[[], int], current_stream: Callable[[int], int],
                 hooks_installed: Callable[[], bool]):
        self.kernel = kernel
        self._params = kernel.params
        self._current_device = current_device
        self._current_stream = current_stream
        self._hooks_installed = hooks_installed
        self._plans: dict[tuple, _Plan] = {}
        self._compiled: dict[tuple, Any] = {}
        self.hits = 0
        self.misses = 0

    def __getitem__(self, grid: tuple) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid: tuple, args: tuple, kwargs: dict) -> Any:
        if callable(grid):
            return self.kernel[grid](*args, **kwargs)
        shape = (len(args), tuple(kwargs))
        plan = self._plans.get(shape)
        if plan is None:
            plan = self._plans[shape] = _Plan(self._params, len(args), shape[1])
        try:
            key = (self._current_device(), shape, tuple(kwargs[k] for k in plan.static_kw),
                   tuple(args[i] for i in plan.constexpr_pos),
                   tuple(arg_key(args[i]) for i in plan.runtime_pos),
                   tuple(arg_key(kwargs[k]) for k in plan.runtime_kw))
            compiled = self._compiled.get(key)
        except (_Uncacheable, TypeError):  # an argument kind left to Triton, or an unhashable constexpr
            return self.kernel[grid](*args, **kwargs)
        if compiled is None or self._hooks_installed():
            self.misses += 1
            compiled = self.kernel[grid](*args, **kwargs)
            if compiled is not None and not hasattr(compiled, "result"):  # not an async-compile future
                self._compiled[key] = compiled
            return compiled
        self.hits += 1
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, self._current_stream(key[0]), compiled.function, compiled.packed_metadata,
                     None, None, None, *plan.values(args, kwargs))
        return compiled


@functools.cache
def cached(kernel: Any) -> CachedLauncher:
    """The one ``CachedLauncher`` of a ``triton.jit`` kernel on CUDA."""
    from triton import knobs

    def hooks_installed() -> bool:
        return knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook is not None

    return CachedLauncher(kernel, torch.cuda.current_device, torch._C._cuda_getCurrentRawStream, hooks_installed)
