"""lowering/fast_launch.py: a cached launch finds the kernel Triton's dispatch would choose, or asks Triton.

The CPU interpreter has no compiled kernels, so the launcher runs here against a recording stand-in for a
``triton.jit`` kernel: each miss must go to ``kernel[grid]`` (Triton's own dispatch), each hit must call the
compiled launcher with the grid, the stream and every parameter in signature order."""
from __future__ import annotations

import pytest
import torch

from sloth.lowering.fast_launch import CachedLauncher


class _Param:
    def __init__(self, name, is_constexpr=False, default=None, has_default=False):
        self.name, self.is_constexpr, self.default, self.has_default = name, is_constexpr, default, has_default


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class _Kernel:
    """Stands in for ``kernel(p_x, n, scale, MODE: constexpr, BLOCK: constexpr = 64)``."""
    params = [_Param("p_x"), _Param("n"), _Param("scale"), _Param("MODE", True),
              _Param("BLOCK", True, 64, True)]

    def __init__(self):
        self.dispatches = []
        self.compiled = []

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.dispatches.append((grid, args, kwargs))
            self.compiled.append(_Compiled())
            return self.compiled[-1]
        return dispatch


def _launcher(hooks=lambda: False):
    kernel = _Kernel()
    return kernel, CachedLauncher(kernel, lambda: 0, lambda device: 1234, hooks)


def test_hit_calls_the_compiled_launcher_with_every_parameter_in_order():
    kernel, launcher = _launcher()
    x = torch.zeros(64)
    launcher[(3,)](x, 32, 0.5, 1, num_warps=4)
    assert len(kernel.dispatches) == 1 and kernel.compiled[0].launches == []
    launcher[(5, 2)](x, 48, 0.25, 1, num_warps=4)  # 48 is divisible by 16 like 32: the same kernel
    assert len(kernel.dispatches) == 1
    assert kernel.compiled[0].launches == [(5, 2, 1, 1234, "fn", "meta", None, None, None, x, 48, 0.25, 1, 64)]
    launcher[(1,)](x, 48, 0.25, 1, BLOCK=128, num_warps=4)  # a new keyword set: new plan, new key
    assert len(kernel.dispatches) == 2
    launcher[(1,)](x, 16, 2.0, 1, BLOCK=128, num_warps=4)
    assert kernel.compiled[1].launches[-1][-5:] == (x, 16, 2.0, 1, 128)


@pytest.mark.parametrize("change", [
    "int_not_divisible", "int_one", "int_64_bit", "dtype", "misaligned", "constexpr_positional",
    "constexpr_keyword", "launch_option"])
def test_every_specialisation_triton_makes_is_a_miss(change):
    kernel, launcher = _launcher()
    x = torch.zeros(64, dtype=torch.bfloat16)
    base = dict(args=(x, 32, 0.5, 1), kwargs=dict(BLOCK=64, num_warps=4))
    launcher[(1,)](*base["args"], **base["kwargs"])
    args, kwargs = list(base["args"]), dict(base["kwargs"])
    if change == "int_not_divisible":
        args[1] = 33
    elif change == "int_one":
        args[1] = 1
    elif change == "int_64_bit":
        args[1] = 2 ** 40
    elif change == "dtype":
        args[0] = x.float()
    elif change == "misaligned":
        args[0] = x[1:]  # 2 bytes past a 16-byte boundary
    elif change == "constexpr_positional":
        args[3] = 2
    elif change == "constexpr_keyword":
        kwargs["BLOCK"] = 128
    else:
        kwargs["num_warps"] = 8
    launcher[(1,)](*args, **kwargs)
    assert len(kernel.dispatches) == 2, change
    assert kernel.compiled[0].launches == []


def test_arguments_it_cannot_key_and_launch_hooks_go_through_triton_every_time():
    kernel, launcher = _launcher()

    class Sub(torch.Tensor):
        pass

    s = torch.zeros(4).as_subclass(Sub)
    for _ in range(2):
        launcher[(1,)](s, 32, 0.5, 1)
    assert len(kernel.dispatches) == 2
    for _ in range(2):
        launcher[(1,)](torch.zeros(4), 32, 0.5, [1])  # an unhashable constexpr
    assert len(kernel.dispatches) == 4
    for _ in range(2):
        launcher[lambda meta: (1,)](torch.zeros(4), 32, 0.5, 1)  # a callable grid
    assert len(kernel.dispatches) == 6

    hooked = [False]
    kernel, launcher = _launcher(lambda: hooked[0])
    launcher[(1,)](torch.zeros(4), 32, 0.5, 1)
    hooked[0] = True  # e.g. Proton's profiling hook installed after the first launch
    launcher[(1,)](torch.zeros(4), 32, 0.5, 1)
    assert len(kernel.dispatches) == 2 and all(c.launches == [] for c in kernel.compiled)


def test_a_missing_argument_is_named():
    _, launcher = _launcher()
    with pytest.raises(TypeError, match="'MODE'"):
        launcher[(1,)](torch.zeros(4), 32, 0.5)
