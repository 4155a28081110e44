"""Every Triton kernel sloth launches at Llama-3-8B shapes compiles for the H200 (sm_90), checked on the CPU.

The interpreter runs kernels that sm_90 code generation may refuse (an interleaved tile feeding tl.trans
did, in lowering/nf4_matmul.py, whose every launch setting is compiled here too), and the device is lent 30 minutes a session. So: run each op's launcher
at a real shape with every kernel replaced by a recorder (nothing executes, so the shapes can be large),
turn each recorded launch into a Triton signature and constants, and compile them all for
``GPUTarget("cuda", 90, 32)`` in a process without TRITON_INTERPRET (the kernels must be JIT functions
there). Each must compile and fit the H200's 232,448 bytes of shared memory a block. ``UPCAST`` (the
interpreter's bf16-dot workaround) is compiled as on the GPU, off.
"""
from __future__ import annotations

import inspect
import os
import pickle
import subprocess
import sys

import pytest
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

import sloth.lowering.glu as glu
import sloth.lowering.l2_norm as l2_norm
import sloth.lowering.layer_norm as layer_norm
import sloth.lowering.linear_cross_entropy as lce
import sloth.lowering.lora as lora
import sloth.lowering.lora_members as lora_members
import sloth.lowering.moe_kernels as moe_kernels
import sloth.lowering.moe_router as moe_router
import sloth.lowering.moe_router_biased as moe_router_biased
import sloth.lowering.nf4 as nf4
import sloth.lowering.nf4_matmul as nf4_matmul
import sloth.lowering.rms_norm as rms_norm
import sloth.lowering.rope as rope
from sloth.lowering.backend_choice import triton_interpreter_on

_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
                 torch.int32: "i32", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}
H200_SHARED_BYTES = 232448


class _Recorder:
    """Stands in for a kernel: records each ``kernel[grid](*args, **kwargs)`` and runs nothing."""

    def __init__(self, module: str, name: str, kernel, launches: list):
        self.module, self.name, self.kernel, self.launches = module, name, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(_describe(self.module, self.name, self.kernel, args, kwargs))
        return launch


def _describe(module: str, name: str, kernel, args: tuple, kwargs: dict) -> tuple:
    """(module, kernel name, signature, constants, divisible, options) of one launch, picklable. As Triton's
    launch specialises (runtime/jit.py, 3.6): an int equal to 1 becomes the constant 1, and an int that is a
    multiple of 16 or a 16-byte aligned pointer is marked divisible by 16 (``divisible``: the parameter
    names), which lets the compiler pipeline loads through shared memory with async copies: compiled
    without it, a kernel can use far less shared memory than it does on the GPU (a down kernel that split
    the factor itself, since dropped: 192 KB here, 256 KB on the H200, past its 227 KB)."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    params = inspect.signature(kernel.fn).parameters  # an InterpretedFunction here: read the Python function
    values = dict(zip(params, args)) | kwargs
    signature, constants, divisible = {}, {}, []
    for param in params.values():
        value = values.get(param.name, None if param.default is inspect.Parameter.empty else param.default)
        if "constexpr" in str(param.annotation) or value is None:
            signature[param.name] = "constexpr"
            # The interpreter's constexprs, True here, are False on the GPU: compile the GPU's branch.
            constants[param.name] = False if param.name in ("UPCAST", "INTERPRETED") else value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TRITON_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                divisible.append(param.name)
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int) and value == 1:
            signature[param.name], constants[param.name] = "constexpr", 1
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                divisible.append(param.name)
        else:
            signature[param.name] = "fp32"
    return module, name, signature, constants, divisible, options


def _record(monkeypatch) -> list:
    launches: list = []
    for module in (glu, l2_norm, layer_norm, lce, lora, lora_members, moe_kernels, moe_router, moe_router_biased,
                   nf4, nf4_matmul, rms_norm, rope):
        for name, value in list(vars(module).items()):
            if name.endswith("_kernel") and hasattr(value, "arg_names"):
                monkeypatch.setattr(module, name, _Recorder(module.__name__, name, value, launches))
    return launches


def _llama_launches() -> None:
    """Each op's launcher at Llama-3-8B shapes (4096 tokens, hidden 4096, intermediate 14336, 32 q and 8 kv
    heads of 128), in the dtypes a bf16 LoRA step uses; the tensors are never read."""
    bf16, f32 = torch.bfloat16, torch.float32
    n, h, inter, r = 4096, 4096, 14336, 16
    x, w = torch.empty(n, h, dtype=bf16), torch.empty(h, dtype=bf16)
    rms_norm._rms_norm_fwd(x, w, 1e-5, 0.0, bf16)
    rms_norm._rms_norm_bwd(x, x, w, 1e-5, 0.0, True)
    gate = torch.empty(n, inter, dtype=bf16)
    for activation in ("silu", "gelu_tanh"):
        glu.glu_forward(gate, gate, activation)
        glu.glu_backward_impl(gate, gate, gate, activation)
        glu.glu_backward_impl(torch.empty(n, inter, dtype=bf16), gate, gate, activation, y_over_dy=True)
        # in place over gate and up (compiler/lean_backward.py), with and without the hidden over dy
        glu.glu_backward_impl(torch.empty(n, inter, dtype=bf16), gate, torch.empty(n, inter, dtype=bf16),
                              activation, y_over_dy=True, in_place=True)
        glu.glu_backward_impl(gate, torch.empty(n, inter, dtype=bf16), torch.empty(n, inter, dtype=bf16),
                              activation, in_place=True)
    # Merged gate/up with n % 16 == 8: dy's stride n and gate's 2n differ in alignment, so the y stores take
    # another layout than the dy loads (the kernel's barrier is for this case).
    glu.glu_backward_impl(torch.empty(n, 1032, dtype=bf16), torch.empty(n, 2064, dtype=bf16), None, "silu",
                          y_over_dy=True)
    q, k = torch.empty(2, 32, 2048, 128, dtype=bf16), torch.empty(2, 8, 2048, 128, dtype=bf16)
    cos = torch.empty(1, 1, 2048, 128, dtype=bf16)
    rope._rope_fwd(q, k, cos, cos)
    rope._rope_bwd(q, k, cos, cos, bf16, bf16)
    half = torch.empty(1, 1, 2048, 64, dtype=bf16)
    rope._rope_fwd(q, k, half, half, interleaved=True)  # GPT-J pairs
    rope._rope_single_fwd(q, torch.empty(1, 1, 2048, 32, dtype=bf16), torch.empty(1, 1, 2048, 32, dtype=bf16))
    for adapter, rank in ((f32, r), (bf16, r), (f32, 64)):  # rank 64: the down kernel's K tile shrinks to fit
        for k_in, n_out in ((h, h), (h, inter), (inter, h)):
            xi = torch.empty(n, k_in, dtype=bf16)
            wi, a, b = torch.empty(n_out, k_in, dtype=bf16), torch.empty(rank, k_in, dtype=adapter), \
                torch.empty(n_out, rank, dtype=adapter)
            y, hh = lora.lora_forward(xi, wi, None, a, b, 2.0)
            lora.lora_backward(torch.empty(n, n_out, dtype=bf16), xi, wi, a, b, hh, 2.0, True)
    # The joined q/k/v op tiles n r adapter columns: 48 at r 16, and 128 (two members at r 64), the most
    # patterns/lora_shared.py lets one op have. Its tiles do not depend on the row count: 256 rows keep the
    # CPU's real base matmuls cheap.
    from sloth.lowering import lora_shared

    xs = torch.empty(256, h, dtype=bf16)
    # q/k/v, two at r 64, gate/up; fp32 and bf16 adapters (the product modes tile differently: a members kernel
    # that branched per member needed three times the shared memory with bf16 adapters, which the H200 refused)
    for adapter, rank, outs in ((f32, r, (h, 1024, 1024)), (f32, 64, (h, h)), (f32, r, (inter, inter)),
                                (bf16, r, (h, 1024, 1024)), (bf16, 64, (h, h))):
        ws, bs = [torch.empty(o, h, dtype=bf16) for o in outs], [torch.empty(o, rank, dtype=adapter) for o in outs]
        a = torch.empty(len(outs) * rank, h, dtype=adapter)
        *_, hh = lora_shared.lora_shared_forward(xs, ws, [None] * len(outs), a, bs, 2.0)
        lora_shared.lora_shared_backward([torch.empty(256, o, dtype=bf16) for o in outs], xs, ws, a, bs, hh, 2.0,
                                         True)
    labels = torch.zeros(n, dtype=torch.int64)
    head = torch.empty(128256, h, dtype=bf16)
    lce._lce_fwd(x, head, None, labels, -100, "mean", 0.0, 1.0, 0.0, True, False)
    # the logits the graph returns, read in place, the gradient tiles in a buffer of their own
    lce._lce_fwd(x, head, None, labels, -100, "mean", 0.0, 1.0, 0.0, True, False, torch.empty(n, 128256, dtype=bf16))
    packed = torch.empty(inter * h // 2, dtype=torch.uint8)
    nf4.dequantize_4bit(packed, torch.empty(inter * h // 64), 64, "nf4", (inter, h), bf16)
    nf4.dequantize_absmax(torch.empty(inter * h // 64, dtype=torch.uint8), torch.empty(inter * h // 64 // 256),
                          torch.empty(256), 0.0, 256)
    nf4.dequantize_4bit_nested(packed, torch.empty(inter * h // 64, dtype=torch.uint8),
                               torch.empty(inter * h // 64 // 256), torch.empty(256), 0.0, 64, "nf4", (inter, h), bf16)
    for nested in (None, [(torch.empty(inter * h // 64 // 256), torch.empty(256), torch.zeros(()), 256)] * 2):
        absmax = torch.empty(inter * h // 64, dtype=torch.uint8 if nested else f32)
        nf4.dequantize_4bit_members([packed] * 2, [absmax] * 2, nested, 64, "nf4", [(inter, h)] * 2, bf16)
    for config in nf4_matmul.CONFIGS:  # the fused 4-bit matmul's launch settings, benchmarked on the GPU
        nf4_matmul.nf4_matmul(x, packed, torch.empty(inter * h // 64), 64, "nf4", inter, h, config=config)
    # LayerNorm and L2 norm at the hidden size and at a head's (q/k L2 norms of 128), weight and bias on and off
    for cols in (h, 128):
        xl = torch.empty(n, cols, dtype=bf16)
        wl = torch.empty(cols, dtype=bf16)
        layer_norm._layer_norm_fwd(xl, wl, wl, 1e-5, bf16)
        layer_norm._layer_norm_fwd(xl, None, None, 1e-5, bf16)
        layer_norm._layer_norm_bwd(xl, xl, wl, 1e-5, True, True)
        layer_norm._layer_norm_bwd(xl, xl, None, 1e-5, False, False)
        for clamp in (True, False):
            l2_norm._l2_norm_fwd(xl, 1e-6, clamp, bf16)
            l2_norm._l2_norm_bwd(xl, xl, 1e-6, clamp)
    # The MoE experts' kernels between the grouped GEMMs at Qwen3-MoE's layer (4096 tokens, top-8, H 2048, I 768)
    # and Mixtral-8x7B's expert width (I 14336, top-2)
    for top_k, hidden, width in ((8, 2048, 768), (2, 4096, 14336)):
        rows = n * top_k
        order = torch.empty(rows, dtype=torch.int64)
        moe_kernels.combine(torch.empty(rows, hidden, dtype=bf16), order, top_k, torch.empty(n, top_k, dtype=bf16),
                            bf16)
        moe_kernels.combine(torch.empty(rows, hidden, dtype=bf16), order, top_k, None, bf16)
        for want in (True, False):
            moe_kernels.glu_backward_weighted(torch.empty(rows, width, dtype=bf16),
                                              torch.empty(rows, 2 * width, dtype=bf16), torch.empty(n, top_k, dtype=f32),
                                              order, "silu", want, want)
    # GPT-OSS-20B's experts (top-4, H 2880, I 2880, 32 experts): the expert GLU forward with its bias, the weighted
    # backward interleaved with the down bias's d w term, the biases' segment sums; DeepSeek-V4's clamped SwiGLU
    rows, hidden, width, experts = n * 4, 2880, 2880, 32
    ids, offs = torch.empty(rows, dtype=torch.int64), torch.empty(experts, dtype=torch.int32)
    order = torch.empty(rows, dtype=torch.int64)
    for act, interleaved in (("swiglu_oai", True), ("silu_clamped", False)):
        moe_kernels.expert_glu_forward(torch.empty(rows, 2 * width, dtype=bf16), torch.empty(experts, 2 * width,
                                       dtype=bf16), ids, act, interleaved, 1.702, 7.0)
        moe_kernels.glu_backward_weighted(torch.empty(rows, width, dtype=bf16),
                                          torch.empty(rows, 2 * width, dtype=bf16), torch.empty(n, 4, dtype=bf16),
                                          order, act, True, True, interleaved, 1.702, 7.0,
                                          torch.empty(rows, dtype=f32))
    moe_kernels.expert_glu_forward(torch.empty(rows, 2 * width, dtype=bf16), None, ids, "swiglu_oai", True, 1.702, 7.0)
    moe_kernels.segment_sum(torch.empty(rows, 2 * width, dtype=bf16), offs, ids, None, bf16)
    moe_kernels.segment_sum(torch.empty(rows, hidden, dtype=bf16), offs, ids, torch.empty(rows, dtype=f32), bf16)
    # Ungated experts (NemotronH's relu2, transformers' has_gate=False) at a Nemotron-3-Nano-like layer (top-6, I 1856,
    # 128 experts): the GATED=False forward with and without the up bias, and the weighted backward.
    rows, width, experts = n * 6, 1856, 128
    ids, order = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.int64)
    for act, bias in (("relu2", None), ("relu2", torch.empty(experts, width, dtype=bf16)), ("silu", None)):
        moe_kernels.expert_glu_forward(torch.empty(rows, width, dtype=bf16), bias, ids, act, False, 1.702, 7.0,
                                       gated=False)
    for want in (True, False):
        moe_kernels.glu_backward_weighted(torch.empty(rows, width, dtype=bf16), torch.empty(rows, width, dtype=bf16),
                                          torch.empty(n, 6, dtype=f32), order, "relu2", want, want, gated=False)
    # The routers: Qwen3-MoE's (128 experts, top-8, renormalised or not), Mixtral's (8, top-2), GPT-OSS's (32,
    # top-4, softmax over the k) and the kernel's limits (512 experts, top-32), bf16 logits, fp32 weights.
    for experts, top_k, modes in ((128, 8, ((True, False), (True, True))), (8, 2, ((True, True),)),
                                  (32, 4, ((False, False),)), (512, 32, ((True, True),))):
        logits = torch.empty(n, experts, dtype=bf16)
        for softmax_first, renorm in modes:
            moe_router._moe_router_fwd(logits, top_k, softmax_first, renorm, f32)
            moe_router._moe_router_bwd(torch.empty(n, top_k, dtype=f32), logits,
                                       torch.zeros(n, top_k, dtype=torch.int64), softmax_first, renorm)
    # The bias-corrected routers: DeepSeek-V3's (256 experts, 8 groups by top-2 sum, top-4 groups, top-8, renormalised
    # + 1e-20), GLM-4.5-Air-like flat 128 top-8, ERNIE-4.5's softmax with a clamp, Kolibri's logits choice; fp32.
    for experts, top_k, score, choose, groups, top2, fill, renorm, eps in (
            (256, 8, "sigmoid", False, (8, 4), True, float("-inf"), 1, 1e-20),
            (128, 8, "sigmoid", False, (1, 1), True, float("-inf"), 1, 0.0),
            (64, 6, "softmax", False, (1, 1), True, float("-inf"), 2, 1e-12),
            (64, 8, "sigmoid", True, (8, 2), False, 0.0, 0, 0.0)):
        logits = torch.empty(n, experts, dtype=f32)
        moe_router_biased._moe_router_biased_fwd(logits, torch.empty(experts, dtype=f32), top_k, score, choose,
                                                 *groups, top2, fill, renorm, eps, f32)
        moe_router_biased._moe_router_biased_bwd(torch.empty(n, top_k, dtype=f32), logits,
                                                 torch.zeros(n, top_k, dtype=torch.int64), score, renorm, eps)


_COMPILE = r"""
import importlib, pickle, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
results = []
for module, name, signature, constants, divisible, options in pickle.loads(sys.stdin.buffer.read()):
    kernel = getattr(importlib.import_module(module), name)
    names = list(kernel.arg_names)
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(k),): backend.parse_attr("D") for k in divisible})
    try:
        compiled = triton.compile(source, target=target, options=options)
        ptx = compiled.asm["ptx"]
        rounded = (len(re.findall(r"\bfma\.\S*f32", ptx)), "mul.rn.f32" in ptx and "add.rn.f32" in ptx)
        results.append((name, constants, compiled.metadata.shared, rounded, None))
    except Exception as exc:
        results.append((name, constants, None, None, f"{type(exc).__name__}: {str(exc)[-300:]}"))
sys.stdout.buffer.write(pickle.dumps(results))
"""


class _NoMatmuls(TorchDispatchMode):
    """The launchers' own matmuls (cuBLAS on the GPU) return uninitialised tensors of their shape instead of
    running: the recorded kernels never read their inputs, and the CPU's bf16 matmuls at these shapes took
    most of the suite's time (over 10 minutes on a 2-core machine)."""

    _OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}
    _OUT_OPS = {torch.ops.aten.mm.out, torch.ops.aten.addmm.out, torch.ops.aten.addmm_.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._OUT_OPS:
            return kwargs["out"] if "out" in kwargs else args[0]
        if func in self._OPS:
            meta = func(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
            return torch.empty(meta.shape, dtype=meta.dtype)
        return func(*args, **kwargs)


def test_every_kernel_compiles_for_the_h200(monkeypatch):
    if not triton_interpreter_on():
        # The launchers take their Triton branch for CPU tensors only under the interpreter; without it they run
        # the references on the empty tensors (a GPU machine: the GPU lane runs every kernel there instead).
        pytest.skip("records launches through Triton's CPU interpreter (TRITON_INTERPRET=1); without it the "
                    "launchers run their PyTorch references")
    launches = _record(monkeypatch)
    # nf4_matmul shrinks its tiles under the interpreter; record the settings the GPU launches.
    monkeypatch.setattr(nf4_matmul, "triton_interpreter_on", lambda: False)
    with torch.no_grad(), _NoMatmuls():
        _llama_launches()
    unique = list({pickle.dumps(launch): launch for launch in launches}.values())
    kernels = {launch[1] for launch in unique}
    assert {"_rms_norm_fwd_kernel", "_glu_fwd_kernel", "_rope_kernel", "_lora_down_kernel", "_lora_up_add_kernel",
            "_lora_grad_kernel", "_lce_rows_kernel", "_dequantize_4bit_kernel", "_split_members_kernel",
            "_down_members_kernel", "_up_add_members_kernel", "_dequantize_4bit_members_kernel",
            "_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel", "_l2_norm_fwd_kernel", "_l2_norm_bwd_kernel",
            "_combine_kernel", "_glu_backward_weighted_kernel", "_expert_glu_fwd_kernel", "_moe_router_fwd_kernel",
            "_moe_router_bwd_kernel", "_moe_router_biased_fwd_kernel", "_moe_router_biased_bwd_kernel"} <= kernels, kernels
    assert sum(launch[1] == "_nf4_matmul_kernel" for launch in unique) == len(nf4_matmul.CONFIGS), unique
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], input=pickle.dumps(unique), env=env,
                          capture_output=True, timeout=900)
    if done.returncode and b"ptxas" in done.stderr:
        pytest.skip("no ptxas in this Triton install")
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    results = pickle.loads(done.stdout)
    failed = [(name, error) for name, _, _, _, error in results if error]
    assert not failed, failed
    too_big = [(name, shared) for name, _, shared, _, _ in results if shared > H200_SHARED_BYTES]
    assert not too_big, too_big
    # A nested absmax is rounded twice (bitsandbytes' two ops) even with fp fusion on, as Inductor compiles a
    # user kernel (these launches are compiled with Triton's default, fusion on):
    # explicitly rounded PTX multiply and add, no FMA.
    nested = [(name, rounded) for name, constants, _, rounded, _ in results
              if name == "_dequantize_absmax_kernel" or
              (name in ("_dequantize_4bit_kernel", "_dequantize_4bit_members_kernel") and constants["NESTED"])]
    assert len(nested) == 3 and all(fmas == 0 and explicit for _, (fmas, explicit) in nested), nested
