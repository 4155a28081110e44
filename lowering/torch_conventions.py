"""Conventions of the installed torch that changed between its releases, asked of torch itself once, at import.

The kernels' manual backward passes must give eager's gradient where the math leaves a choice, and at a clamp's
bound it does: ``clamp(x, max=m)`` is not differentiable at ``x == m``. torch 2.13 and earlier pass the gradient
there (``where(min <= x <= max)``); torch 2.14 and later do not (a scalar bound gets ``where(min < x < max)``; a
tensor bound splits it, 0.5 each, as ``torch.minimum`` does). In bf16 such ties are common: a value of exactly 7.0,
GPT-OSS's limit, is one of the 128 representable values between 4 and 8.
"""
from __future__ import annotations

import torch
from torch.torch_version import TorchVersion


def _clamp_passes_gradient_at_bound() -> bool:
    """Whether ``torch.clamp`` with a scalar bound passes the gradient where the input equals the bound: asked of
    torch with one tiny backward; where that cannot run (sloth imported under a mode that intercepts it), the
    release that changed it decides."""
    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
            torch.clamp(x, max=1.0).backward()
        return bool(x.grad == 1.0)
    except Exception:  # noqa: BLE001 - any failure of the probe falls back to the version
        return TorchVersion(torch.__version__) < (2, 14)


# Read by lowering/moe_kernels.py (the clamped GLUs' derivatives) and lowering/l2_norm.py (F.normalize's clamp_min).
CLAMP_PASSES_AT_BOUND: bool = _clamp_passes_gradient_at_bound()
