"""Host time of one Triton launch and of one call of each sloth op, on the GPU machine.

    python -m benchmarks.launch_overhead          (CUDA; the QLoRA rows need bitsandbytes)

Tiny shapes (16 rows), so the GPU finishes each kernel before the host has issued the next: the wall time of
a loop of calls is then the host's time per call, which is what a step without CUDA graphs pays on the
critical path when it is host-bound. The first record (2026-11-29_212631) also timed a cached launcher that
was then dropped (lowering/registration.py says why).
"""
from __future__ import annotations

import sys
import time

import torch

from benchmarks import common


def _host_us(fn, reps: int = 400) -> float:
    """Best of five loops of ``reps`` calls, microseconds a call (other work on the machine only adds)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
        torch.cuda.synchronize()
    return best


def _print_profile(fn, reps: int = 2000, top: int = 20) -> None:
    """What one call's host time is made of: ``reps`` calls under cProfile, the ``top`` functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def _qlora_calls(x, dy, a, b, h):
    """The QLoRA op's forward and backward calls on a double-quantised NF4 weight, or {} without bitsandbytes."""
    try:
        from bitsandbytes.functional import quantize_4bit
    except ImportError:
        return {}
    from sloth.lowering import qlora
    qlora.register()
    n, k = dy.shape[1], x.shape[1]
    packed, st = quantize_4bit(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64, blocksize=64,
                               quant_type="nf4", compress_statistics=True)
    state = (packed, st.absmax, st.state2.code, st.state2.absmax, st.offset, n, k, 64, "nf4")
    return {
        "sloth::qlora_linear": lambda: torch.ops.sloth.qlora_linear(x, *state, None, a, b, 2.0),
        "sloth::qlora_linear_backward": lambda: torch.ops.sloth.qlora_linear_backward(dy, x, *state, a, b, h, 2.0,
                                                                                      True),
    }


def _moe_calls(dev: str, dtype: torch.dtype) -> dict:
    """The MoE experts op, forward and its backward (frozen experts), on 16 tokens of Qwen3-MoE's layer (H 2048,
    I 768, 128 experts, top-8): its host cost, the ~15 PyTorch calls and 3-4 launches around its grouped GEMMs."""
    from sloth.lowering import moe

    moe.register()
    t, h, i, e, k = 16, 2048, 768, 128, 8
    g = torch.Generator(device="cpu").manual_seed(0)
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    weights = torch.softmax(torch.randn(t, k, generator=g), -1).to(dev, dtype)
    x = torch.randn(t, h, device=dev, dtype=dtype)
    gate_up = torch.randn(e, 2 * i, h, device=dev, dtype=dtype) / h ** 0.5
    down = torch.randn(e, h, i, device=dev, dtype=dtype) / i ** 0.5
    _, gu, order, offs = torch.ops.sloth.moe_experts(x, index, weights, gate_up, down, "silu")
    return {
        "sloth::moe_experts": lambda: torch.ops.sloth.moe_experts(x, index, weights, gate_up, down, "silu"),
        "sloth::moe_experts_backward (frozen experts)": lambda: torch.ops.sloth.moe_experts_backward(
            x, x, index, weights, gate_up, down, gu, order, offs, "silu", True, True, False, False),
    }


def main() -> int:
    common.import_sloth()
    from sloth.lowering import lora, rms_norm

    dev, bf16 = "cuda", torch.bfloat16
    torch.manual_seed(0)
    m, k, n, r = 16, 4096, 4096, 16
    x = torch.randn(m, k, device=dev, dtype=bf16)
    w = torch.randn(n, k, device=dev, dtype=bf16) / 64
    a = torch.randn(r, k, device=dev) / 64
    b = torch.randn(n, r, device=dev) / 64
    dy = torch.randn(m, n, device=dev, dtype=bf16)
    nw = torch.randn(k, device=dev, dtype=bf16)
    base = torch.randn(m, n, device=dev, dtype=bf16)
    h = torch.randn(m, r, device=dev)
    q = b.t()
    lora.register()
    rms_norm.register()
    from sloth.lowering import lora_shared

    lora_shared.register()
    # q, k and v of Llama-3-8B: one [4096, 4096] and two [1024, 4096] bases on one x, as three ops and as one.
    qkv_w = [w, w[:1024], w[1024:2048]]
    qkv_b = [b, b[:1024], b[1024:2048]]
    qkv_a = torch.cat([a, a, a])
    qkv_dy = [dy, dy[:, :1024].contiguous(), dy[:, 1024:2048].contiguous()]
    qkv_h = torch.randn(m, 3 * r, device=dev)
    calls = {
        "one launch (_lora_up_add_kernel)": lambda: lora._lora_up_add_kernel[(1, 64)](
            base, h, q, m, n, r, base.stride(0), h.stride(0), q.stride(0), q.stride(1), 0.5, 64,
            BLOCK_M=64, BLOCK_N=64, BLOCK_R=16, num_warps=4, num_stages=2),
        "sloth::lora_linear": lambda: torch.ops.sloth.lora_linear(x, w, None, a, b, 2.0),
        "sloth::lora_linear_backward": lambda: torch.ops.sloth.lora_linear_backward(dy, x, w, a, b, h, 2.0, True),
        "lora_forward, no dispatcher": lambda: lora.lora_forward(x, w, None, a, b, 2.0),
        "sloth::rms_norm": lambda: torch.ops.sloth.rms_norm(x, nw, 1e-6, 0.0, bf16),
        "sloth::rms_norm_backward": lambda: torch.ops.sloth.rms_norm_backward(x, x, nw, 1e-6, 0.0, True),
        "3 x sloth::lora_linear (q, k, v)": lambda: [torch.ops.sloth.lora_linear(x, wi, None, a, bi, 2.0)
                                                     for wi, bi in zip(qkv_w, qkv_b)],
        "sloth::lora_linear_shared (q, k, v)": lambda: torch.ops.sloth.lora_linear_shared(
            x, qkv_w, [None] * 3, qkv_a, qkv_b, 2.0),
        "3 x sloth::lora_linear_backward (q, k, v)": lambda: [
            torch.ops.sloth.lora_linear_backward(d, x, wi, a, bi, h, 2.0, True)
            for d, wi, bi in zip(qkv_dy, qkv_w, qkv_b)],
        "sloth::lora_linear_shared_backward (q, k, v)": lambda: torch.ops.sloth.lora_linear_shared_backward(
            qkv_dy, x, qkv_w, qkv_a, qkv_b, qkv_h, 2.0, True),
        **_qlora_calls(x, dy, a, b, h),
        **_moe_calls(dev, bf16),
    }
    # The runtime twins compiled graphs call instead of the custom ops.
    calls.update({
        "sloth_rt::lora_linear": lambda: torch.ops.sloth_rt.lora_linear(x, w, None, a, b, 2.0),
        "sloth_rt::lora_linear_backward": lambda: torch.ops.sloth_rt.lora_linear_backward(dy, x, w, a, b, h, 2.0,
                                                                                          True),
        "sloth_rt::rms_norm": lambda: torch.ops.sloth_rt.rms_norm(x, nw, 1e-6, 0.0, bf16),
        "sloth_rt::lora_linear_shared (q, k, v)": lambda: torch.ops.sloth_rt.lora_linear_shared(
            x, qkv_w, [None] * 3, qkv_a, qkv_b, 2.0),
        "sloth_rt::lora_linear_shared_backward (q, k, v)": lambda: torch.ops.sloth_rt.lora_linear_shared_backward(
            qkv_dy, x, qkv_w, qkv_a, qkv_b, qkv_h, 2.0, True),
    })
    rows = []
    for name, fn in calls.items():
        rows.append({"call": name, "host us": round(_host_us(fn), 2)})
        print(rows[-1], flush=True)
    _print_profile(calls["one launch (_lora_up_add_kernel)"])
    record = common.result_record("launch_overhead", {"m": m, "k": k, "n": n, "r": r, "dtype": "bf16"},
                                  ["call", "host us"], rows)
    common.write_result(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
