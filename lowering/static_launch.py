"""sloth's Triton launches on CUDA through torch's static launcher, after Triton's own choice of compiled kernel.

Without CUDA graphs, a step of a small or MoE model waits on its host, and the largest share of that host time is
sloth's ~400 Triton launches a step (benchmarks/results/2026-12-06_h100_1317_hostprofile-sloth-qwen3-moe.txt:
``JITFunction.run`` and Triton's launcher, 22 ms a step under the profiler). Per launch ``JITFunction.run``
(Triton 3.6 to 3.9):

1. reads the compile options (debug, instrumentation mode) and the device's current stream, runs pre-run hooks;
2. binds and specialises the arguments (native code) and turns the result into a cache key;
3. looks the compiled kernel up (compiling it on a miss);
4. checks that the globals the kernel read have not changed;
5. builds launch metadata for launch hooks, and calls Triton's launcher, whose Python allocates the global and
   profile scratch (none for sloth's kernels) before its C launch.

``StaticLauncher`` keeps 1-3 exactly (Triton's own binder and ``compute_cache_key``, so the kernel that runs is
the one Triton would pick for these arguments) and replaces 4-5 by the C launch Inductor uses for its own kernels
(``torch._inductor.runtime.static_triton_launcher``), loaded once per compiled kernel and device. Step 4 is
dropped: sloth's kernels read module constants that are never reassigned.

It falls back to Triton's ``run`` (the same results, its usual cost) for: a key not compiled yet (the first call
per specialisation compiles through Triton), pre-run or launch hooks (profilers such as
proton), a kernel the static launcher refuses (scratch memory, several CTAs, TMA descriptors), any Triton or
torch without the pieces named above, and everything that is not CUDA (the CPU interpreter). A key that Triton's
own launch does not put in its cache (options this module reads differently from that Triton version) turns the
fast path off for that kernel. ``SLOTH_STATIC_LAUNCH=0`` (set before ``import sloth``) turns it off everywhere.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

_ENABLED = os.environ.get("SLOTH_STATIC_LAUNCH", "1") != "0"

_CUBIN_DIR: Optional[str] = None


def _cubin_dir() -> str:
    """A private folder for the cubins the static launcher loads (it loads from a file)."""
    global _CUBIN_DIR
    if _CUBIN_DIR is None:
        _CUBIN_DIR = tempfile.mkdtemp(prefix="sloth-cubin-")
    return _CUBIN_DIR


def _pieces() -> Optional[tuple[Any, ...]]:
    """Triton's driver, knobs, cache-key function and torch's static launcher class, or None where one is missing."""
    try:
        import torch
        from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel
        from triton import knobs
        from triton.runtime import driver
        from triton.runtime.jit import compute_cache_key
    except Exception:  # an older torch or Triton: Triton's own launches
        return None
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        return None
    return driver, knobs, compute_cache_key, StaticallyLaunchedCudaKernel


class _Static:
    """One compiled kernel loaded for the static launcher on one device: the launch and which of the bound
    arguments the cubin takes (constexprs, including integers Triton specialised to constants, are not passed)."""

    __slots__ = ("kernel", "keep")

    def __init__(self, kernel: Any, keep: tuple[int, ...]) -> None:
        self.kernel = kernel
        self.keep = keep


def _load(compiled: Any, arg_names: list[str], device: int, launcher_cls: Any) -> Optional[_Static]:
    """``compiled`` (a Triton ``CompiledKernel``) ready for the static launcher on ``device``, or None where the
    launcher refuses it."""
    try:
        if not hasattr(compiled, "_cubin_path"):
            compiled._cubin_path = None  # Inductor's kernels carry the path; ours are written out from the binary
        static = launcher_cls(compiled)
        static.reload_cubin_from_raw(os.path.join(_cubin_dir(), f"{compiled.hash}.cubin"))
        static.load_kernel(device)
    except Exception:  # NotImplementedError for scratch, clusters, TMA; anything else: Triton's own launch
        return None
    src = compiled.src
    signature = src.signature
    constants = getattr(src, "constants", {})
    keep = tuple(i for i, name in enumerate(arg_names)
                 if signature.get(name) != "constexpr" and (i,) not in constants and i not in constants)
    if len(keep) != len(static.arg_tys):
        return None
    return _Static(static, keep)


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook is set: a function, or a ``HookChain`` (Triton 3.5+'s default) holding one."""
    return hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))


class StaticLauncher:
    """``kernel[grid](*args)`` for a Triton ``JITFunction``, launched as the module docstring says."""

    def __init__(self, fn: Any, pieces: tuple[Any, ...]) -> None:
        self.fn = fn
        self.driver, self.knobs, self.compute_cache_key, self.launcher_cls = pieces
        self.loaded: dict[tuple[int, Any], Optional[_Static]] = {}  # (device, key) -> launch, None: refused
        self.off = False  # a key Triton's own launch did not cache: this module's options differ from Triton's
        self.fpsan = hasattr(self.knobs.compilation, "fpsan_homomorphic_casts")

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def _with_options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's keyword arguments (meta-parameters, num_warps, ...) with the options ``JITFunction.run`` adds
        before binding (Triton 3.6 to 3.9)."""
        knobs = self.knobs
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", self.fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        if self.fpsan:  # Triton 3.7+
            kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        return kwargs

    def run(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        fn, knobs = self.fn, self.knobs
        if (self.off or fn.pre_run_hooks or _hooked(knobs.runtime.launch_enter_hook)
                or _hooked(knobs.runtime.launch_exit_hook)
                or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None):
            return fn[grid](*args, **kwargs)
        device = self.driver.active.get_current_device()
        kernel_cache, kernel_key_cache, _, _, binder = fn.device_caches[device]
        bound_args, specialization, options = binder(*args, **self._with_options(kwargs))
        key = self.compute_cache_key(kernel_key_cache, specialization, options)
        static = self.loaded.get((device, key), False)
        if static is False:
            compiled = kernel_cache.get(key)
            if compiled is None:  # not compiled yet: Triton compiles and launches it
                fn[grid](*args, **kwargs)
                if kernel_cache.get(key) is None:
                    self.off = True
                return None
            static = None if hasattr(compiled, "result") else _load(compiled, fn.arg_names, device,
                                                                    self.launcher_cls)
            self.loaded[(device, key)] = static
        if static is None:
            return fn[grid](*args, **kwargs)
        grid_size = len(grid)
        grid_0 = grid[0]
        grid_1 = grid[1] if grid_size > 1 else 1
        grid_2 = grid[2] if grid_size > 2 else 1
        if grid_0 * grid_1 * grid_2 == 0:  # Triton's launcher skips an empty grid; CUDA would refuse it
            return None
        values = tuple(bound_args.values())
        try:
            static.kernel.run(grid_0, grid_1, grid_2, self.driver.active.get_current_stream(device),
                              *[values[i] for i in static.keep])
        except Exception:  # an argument the static launcher cannot pass: Triton's launch for this key from now on
            self.loaded[(device, key)] = None
            return fn[grid](*args, **kwargs)
        return None


_PIECES: Optional[tuple[Any, ...]] = None
_PIECES_READ = False
_LAUNCHERS: dict[Any, StaticLauncher] = {}


def static_launcher(fn: Any) -> Any:
    """``fn``'s ``StaticLauncher``, or ``fn`` itself where the fast path is off or unavailable (see the module
    docstring); either is launched as ``result[grid](*args)``."""
    global _PIECES, _PIECES_READ
    if not _ENABLED or not hasattr(fn, "device_caches"):  # the CPU interpreter's kernels have no device caches
        return fn
    launcher = _LAUNCHERS.get(fn)
    if launcher is not None:
        return launcher
    if not _PIECES_READ:
        _PIECES, _PIECES_READ = _pieces(), True
    if _PIECES is None:
        return fn
    launcher = _LAUNCHERS[fn] = StaticLauncher(fn, _PIECES)
    return launcher
