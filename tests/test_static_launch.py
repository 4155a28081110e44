"""lowering/static_launch.py: sloth's Triton launches through torch's static launcher after Triton's own choice of
compiled kernel. On CUDA every launch must give the bits Triton's own launch gives, for each specialisation
(integers equal to 1, sizes divisible by 16 or not, pointers aligned or not), skip empty grids, and fall back where
it must. Without CUDA (the interpreter's kernels) the kernel itself is returned, so the CPU suite checks only that."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import sloth.lowering.static_launch as static_launch
from sloth.lowering.registration import launch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the static launcher is CUDA-only")


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    """out = alpha * x + y over n elements."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, alpha * x + y, mask=mask)


def _axpy(kernel, x, y, alpha, block=64):
    out = torch.full_like(x, -7.0)
    n = x.numel()
    kernel[(triton.cdiv(n, block),)](x, y, out, n, alpha, BLOCK=block)
    return out


def test_interpreted_or_disabled_kernel_is_returned_as_is(monkeypatch):
    if not hasattr(_axpy_kernel, "device_caches"):  # the interpreter's kernel (the CPU suite)
        assert static_launch.static_launcher(_axpy_kernel) is _axpy_kernel
    monkeypatch.setattr(static_launch, "_ENABLED", False)
    assert static_launch.static_launcher(_axpy_kernel) is _axpy_kernel


def test_no_cuda_means_triton_launches(monkeypatch):
    monkeypatch.setattr(static_launch, "_PIECES_READ", False)
    monkeypatch.setattr(static_launch, "_LAUNCHERS", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    jit = triton.runtime.jit.JITFunction(_axpy_kernel.fn)  # a compiled-mode kernel, also under the interpreter
    assert static_launch.static_launcher(jit) is jit


@cuda
@pytest.mark.parametrize("n,offset", [(1, 0), (17, 0), (64, 0), (64, 1), (1000, 3), (4096, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_launch_matches_triton_bit_for_bit(n, offset, dtype, monkeypatch):
    monkeypatch.setattr(static_launch, "_LAUNCHERS", {})
    g = torch.Generator(device="cuda").manual_seed(n)
    # offset > 0 makes the pointers 4 or 2 bytes past 16-byte alignment: another specialisation of the kernel.
    x = torch.randn(n + offset, device="cuda", generator=g).to(dtype)[offset:]
    y = torch.randn(n + offset, device="cuda", generator=g).to(dtype)[offset:]
    fast = static_launch.static_launcher(_axpy_kernel)
    assert isinstance(fast, static_launch.StaticLauncher)
    expected = _axpy(_axpy_kernel, x, y, 0.37)
    first = _axpy(fast, x, y, 0.37)  # compiled already: the static path from the first call
    again = _axpy(fast, x, y, 0.37)
    assert torch.equal(first, expected) and torch.equal(again, expected)
    assert any(v is not None for v in fast.loaded.values()), "the static launcher was not used"
    assert not fast.off


@cuda
def test_first_call_compiles_through_triton_then_goes_static(monkeypatch):
    monkeypatch.setattr(static_launch, "_LAUNCHERS", {})
    kernel = triton.jit(_axpy_kernel.fn)  # a fresh JITFunction: nothing compiled yet
    fast = static_launch.static_launcher(kernel)
    x, y = torch.randn(300, device="cuda"), torch.randn(300, device="cuda")
    expected = 0.5 * x + y
    torch.testing.assert_close(_axpy(fast, x, y, 0.5), expected)
    assert not fast.loaded  # compiled and launched by Triton
    torch.testing.assert_close(_axpy(fast, x, y, 0.5), expected)
    assert list(fast.loaded.values())[0] is not None


@cuda
def test_empty_grid_launches_nothing(monkeypatch):
    monkeypatch.setattr(static_launch, "_LAUNCHERS", {})
    fast = static_launch.static_launcher(_axpy_kernel)
    x = torch.randn(64, device="cuda")
    _axpy(fast, x, x, 1.0)
    _axpy(fast, x, x, 1.0)
    out = torch.full((64,), 3.0, device="cuda")
    fast[(0,)](x, x, out, 64, 1.0, BLOCK=64)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 3.0))


@cuda
def test_a_key_triton_does_not_cache_turns_the_fast_path_off(monkeypatch):
    monkeypatch.setattr(static_launch, "_LAUNCHERS", {})
    fast = static_launch.static_launcher(triton.jit(_axpy_kernel.fn))
    monkeypatch.setattr(fast, "compute_cache_key", lambda *args: "no such key")
    x = torch.randn(100, device="cuda")
    torch.testing.assert_close(_axpy(fast, x, x, 2.0), 3.0 * x)
    assert fast.off
    torch.testing.assert_close(_axpy(fast, x, x, 2.0), 3.0 * x)  # Triton's own launch from now on


@cuda
def test_launch_hooks_fall_back_to_triton(monkeypatch):
    monkeypatch.setattr(static_launch, "_LAUNCHERS", {})
    seen = []
    fast = static_launch.static_launcher(_axpy_kernel)
    x = torch.randn(100, device="cuda")
    _axpy(fast, x, x, 1.0)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *args: seen.append(1))
    torch.testing.assert_close(_axpy(fast, x, x, 1.0), 2.0 * x)
    assert seen, "Triton's launch (with its hook) was not used"


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_launch_statically_with_the_same_bits(dtype, monkeypatch):
    from sloth.lowering import rms_norm as rms_norm_module

    rms_norm_module.register()
    x = torch.randn(37, 200, device="cuda", dtype=dtype)
    w = torch.randn(200, device="cuda", dtype=dtype)
    fast_out = torch.ops.sloth.rms_norm(x, w, 1e-6, 0.0, dtype)
    assert isinstance(launch(rms_norm_module._rms_norm_fwd_kernel), static_launch.StaticLauncher)
    monkeypatch.setattr(static_launch, "_ENABLED", False)
    assert launch(rms_norm_module._rms_norm_fwd_kernel) is rms_norm_module._rms_norm_fwd_kernel
    assert torch.equal(torch.ops.sloth.rms_norm(x, w, 1e-6, 0.0, dtype), fast_out)
