"""Fused MoE experts (transformers 5.x ``*Experts`` modules): ``torch.ops.sloth.moe_experts`` and its manual backward.

Shapes (legend): T tokens, K experts a token, S = T*K assignments, E experts, H hidden, I intermediate.
Layouts as in transformers 5.24 ``Qwen3MoeExperts``: ``gate_up_proj [E, 2I, H]`` (gate rows ``[:I]``, up rows
``[I:]``, ``F.linear(x, gate_up_proj[e]).chunk(2, -1)``, not interleaved), ``down_proj [E, H, I]``. The op equals::

    out[t] = sum_k w[t, k] * down_proj[e] @ (act(gate_e @ x[t]) * (up_e @ x[t])),   e = top_k_index[t, k]

with ``act`` one of ``"silu"``, ``"gelu_tanh"`` (transformers' ``gelu_pytorch_tanh``) or ``"gelu"`` (erf);
``moe_experts_pattern`` below is transformers' eager loop, the test oracle.

GPT-OSS's experts (transformers 5.24 ``GptOssExperts``) are the same sum with three differences, each an
argument: per-expert biases after both GEMMs (``gate_up_bias [E, 2I]``, ``down_bias [E, H]``; the down bias is
inside the router weighting), gate and up *interleaved* (``interleaved=True``: gate column j is column 2j of
``gate_up_proj[e] @ x``, up column j is 2j+1) and ``act="swiglu_oai"``, its clamped GLU::

    g' = min(g, limit),  u' = clamp(u, -limit, limit),  h = g' * sigmoid(alpha * g') * (u' + 1)

(``alpha`` 1.702, ``limit`` 7.0 in its config). DeepSeek-V4 and Hunyuan-V4 clamp the same way around a plain
SwiGLU, without alpha or the ``+ 1``: ``act="silu_clamped"``, ``h = silu(g') * u'``. GPT-OSS's transposed weight
layout (``[E, H, 2I]``, ``[E, I, H]``) is the caller's view (the pattern passes ``.transpose(1, 2)``, no copy), and
the weight gradients are formed in that layout (``_weight_grad``). For these variants the GLU between the GEMMs is
``moe_kernels.expert_glu_forward`` (the gate/up bias added in it) and its backward the same weighted kernel as the
others' (lowering/moe_kernels.py); the dispatch, grouped GEMMs, combine and the recompute of h in the backward are
the same.

Ungated experts (transformers 5.25 ``NemotronHExperts``, ``ErgoExpertProjections``: ``has_gate=False``), with
``gated=False``: the first weight is ``up_proj [E, I, H]`` (passed as ``gate_up_proj``; Ergo's ``[E, H, I]`` as a
transposed view, as GPT-OSS's), ``down_proj [E, H, I]``, and::

    out[t] = sum_k w[t, k] * down_proj[e] @ act(up_proj[e] @ x[t])

with ``act`` ``"relu2"`` (relu(u)^2, NemotronH's ``mlp_hidden_act`` default and Ergo's), ``"silu"``, ``"gelu"`` or
``"gelu_tanh"``. Why a flag and not more activation names: gating is a property of the weight layout (W1's rows are
2I or I, what the shape checks read), orthogonal to the activation (silu runs gated in Qwen3 and ungated in a
plain MLP), so one boolean serves every activation instead of doubling the names; it is appended last so every
existing call and graph keeps its meaning. The dispatch, grouped GEMMs, combine, biases (``gate_up_bias [E, I]``)
and LoRA factors (B1 ``[E, I, r]``) are the gated path's with 2I replaced by I; only the elementwise pass between
the GEMMs changes (moe_kernels' kernels with ``GATED=False``), and the gated path runs exactly the launches it ran.

Dispatch, with no host sync and no data-dependent shape: the S assignments are sorted by expert id (stable, so
rows of one expert keep token order); ``offs[e]`` (int32, [E]) is the end of expert e's rows. The forward's sort,
offs, inverse permutation and token of each row come from one counting sort in two launches
(lowering/moe_routing.py: per-block one-hot counts, no ``bincount``, whose size depends on the largest id); the
backward forms the token of each row and the inverse again from the saved order (one launch).
The tokens' rows are read in that order, the two expert GEMMs are grouped GEMMs over ``offs``, the GLU is
``lowering/glu.py``'s kernel (fp32 inside, one rounding), and the weighted sum back to tokens is one kernel
(``lowering/moe_kernels.py``'s ``combine``) reading each token's K rows through the inverse permutation and summing
them in fp32: every token has exactly K rows, so the scatter-add is a deterministic reduction, with no atomics
(``index_add_`` on CUDA adds duplicates in arbitrary order).
Ids must lie in [0, E): checking that needs a host sync, so it is not checked; rows with other ids are undefined.

Grouped GEMM (``_grouped_mm_plan``): ``torch._grouped_mm`` where it runs (CUDA bf16 on sm90, and the CPU kernel of
torch >= 2.9 for fp32/bf16/fp16), both needing 16-byte-aligned strides (H and 2I, I multiples of 8 bf16 elements);
on a GPU the GEMMs that read the tokens' rows go to lowering/grouped_gemm.py's Triton kernel, which reads them
through the order instead of a gathered [S, H] copy, where experts average few rows ("mixed", ``GATHER_ROWS_PER_EXPERT``
says where it pays); where ``_grouped_mm`` does not run, the Triton kernel takes every GEMM (16-bit floats on sm80+,
any float in the CPU interpreter); elsewhere ``_grouped_mm_reference``, the same math with per-row gathered weights
(bmm over [S, k, n] weight copies, no per-expert loop: a loop would need the group sizes on the host). Measured on
torch 2.13 CPU: ``_grouped_mm`` raises "strides should be multiple of 16 bytes" for bf16 I=20, and leaves rows past
``offs[-1]`` uninitialised.

Backward derivation. Per sorted row r (token t, expert e, router weight w_r), with gu_r = W_gu[e] x_t = (g_r, u_r),
h_r = a(g_r) * u_r, y_r = W_d[e] h_r and out_t = sum_r w_r y_r; given dout::

    c_r      = W_d[e]^T dout_t                       (one grouped GEMM, [S, I])
    d w_r    = <dout_t, y_r> = <c_r, h_r>            (y_r is never kept nor recomputed)
    dh_r     = w_r c_r
    d g_r    = dh_r * u_r * a'(g_r),   d u_r = dh_r * a(g_r)            (glu backward; it also rewrites h_r)
    dx_t     = sum_r W_gu[e]^T d gu_r                (grouped GEMM, then the sum over K as in the forward)
    dW_gu[e] = sum_{r in e} d gu_r x_t^T,   dW_d[e] = sum_{r in e} dout_t (w_r h_r)^T    (2d x 2d grouped GEMMs)

With biases (b1 = gate_up_bias, b2 = down_bias) gu_r includes b1[e] and y_r includes b2[e], so
``d w_r = <c_r, h_r> + <dout_t, b2[e]>``, ``d b1[e] = sum_{r in e} d gu_r`` and ``d b2[e] = sum_{r in e} w_r dout_t``
(fp32 sums over each expert's sorted rows, ``moe_kernels.segment_sum``: no atomics). The clamped GLU's derivative
passes where the clamp did not bind (``g <= limit``, ``-limit <= u <= limit``, as ``torch.clamp``'s backward): with
s = sigmoid(alpha g')::

    d g = dh * (u' + 1) * (s + alpha g' s (1 - s)) * [g <= limit],    d u = dh * g' s * [|u| <= limit]

LoRA on the experts (peft's ``target_parameters`` on the stacked weights, in the op's layout ``W_eff[e] = W[e] +
s B[e] A[e]``, B ``[E, n, r]``, A ``[E, r, k]``, one pair a GEMM, ``*_lora_b`` / ``*_lora_a`` / ``*_lora_scale``): the
adapter's share of each GEMM is two more grouped GEMMs at rank r, so neither the merged ``[E, n, k]`` weight nor its
gradient is ever formed (peft forms both each step: 1.2 GB a layer at Qwen3-30B-A3B's experts in bf16)::

    gu_r  += s1 B1 (A1 x_t),        y_r += s2 B2 (A2 h_r)
    c_r   += s2 A2^T (B2^T dout_t)                                   (the down adapter's share of W_d_eff^T dout)
    dx_t  += sum_r s1 A1^T (B1^T d gu_r)
    dB1[e] = sum_{r in e} d gu_r (s1 A1 x_t)^T,    dA1[e] = sum_{r in e} (s1 B1^T d gu_r) x_t^T
    dB2[e] = sum_{r in e} dout_t (s2 A2 w_r h_r)^T,  dA2[e] = sum_{r in e} (s2 B2^T dout_t) (w_r h_r)^T

(the rank-r products A x and A (w h) are recomputed in the backward, not saved; ``d w_r = <c_r, h_r>`` holds with
the adapter's share in c). The factors are made contiguous first: peft hands permuted views, E*n*r elements.

Ungated backward. Per sorted row r, u_r = W_up[e] x_t (+ b1[e]) [I], h_r = a(u_r), y_r = W_d[e] h_r; given dout::

    c_r       = W_d[e]^T dout_t,        d w_r = <c_r, h_r>,        dh_r = w_r c_r
    d u_r     = dh_r * a'(u_r)          (relu2: a'(u) = 2 relu(u); silu, gelu: lowering/glu.py's a')
    dx_t      = sum_r W_up[e]^T d u_r,  dW_up[e] = sum_{r in e} d u_r x_t^T,  dW_d[e] = sum_{r in e} dout_t (w_r h_r)^T

the gated derivation with d gu replaced by d u (and the bias and adapter terms the same with d u for d gu).

Saved for backward: x, the routing, the weights, gu [S, 2I] (u [S, I] ungated; the pre-activation: recomputing it
would repeat the largest forward GEMM, 2*S*H*2I FLOPs), the sort order [S] and offs [E]. With ``recompute_gu``
(the ``moe_recompute`` option) gu is not kept: the backward gathers the rows and runs the first GEMM, its adapter
and bias again (``_first_gemm``, the forward's own calls), S*2I elements less at the peak for that GEMM. h [S, I]
is not saved: dh, the GLU backward, d w and (when the down projection trains) w h are one pass over c and gu
(``moe_kernels.glu_backward_weighted``), and dx's sum over K is ``combine`` again. The weight gradients are formed
only for weights that require grad (frozen experts under LoRA get none, and their two 2d x 2d GEMMs are skipped).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .backend_choice import triton_interpreter_on
from .devices import check_one_device
from .glu import glu_forward
from .grouped_gemm import grouped_mm, grouped_mm_weight
from .moe_kernels import combine, expert_glu_forward, expert_glu_math, glu_backward_weighted, segment_sum
from .moe_routing import invert_order, route
from .registration import define, fake

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Our activation names -> lowering/glu.py's (the Triton GLU kernels' activations).
ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_tanh", "gelu": "gelu_erf"}
# Every activation the op takes: those, GPT-OSS's clamped GLU and DeepSeek-V4's clamped SwiGLU (module docstring),
# functions of gate and up together (lowering/moe_kernels.py's expert GLU kernels).
ALL_ACTIVATIONS = (*ACTIVATIONS, "swiglu_oai", "silu_clamped")
# The activations of ungated experts (``gated=False``: h = act(u)), the op's names.
UNGATED_ACTIVATIONS = ("relu2", *ACTIVATIONS)


def moe_experts_pattern(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str = "silu",
                        gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                        interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0,
                        gate_up_lora_b: torch.Tensor | None = None, gate_up_lora_a: torch.Tensor | None = None,
                        down_lora_b: torch.Tensor | None = None, down_lora_a: torch.Tensor | None = None,
                        gate_up_lora_scale: float = 1.0, down_lora_scale: float = 1.0, gated: bool = True
                        ) -> torch.Tensor:
    """transformers 5.24 ``Qwen3MoeExperts.forward`` (``GptOssExperts.forward`` with the biases, ``interleaved``
    and ``"swiglu_oai"``; with ``gated=False`` 5.25's ``NemotronHExperts.forward``, ``act(F.linear(x, up_proj[e]))``),
    eager loop (host syncs and all): the meaning and the oracle. LoRA factors, where given, are merged first as
    peft's ``target_parameters`` does (``baddbmm(W, B, A, alpha=scale)``)."""
    if gate_up_lora_b is not None:
        gate_up_proj = torch.baddbmm(gate_up_proj, gate_up_lora_b, gate_up_lora_a, alpha=gate_up_lora_scale)
    if down_lora_b is not None:
        down_proj = torch.baddbmm(down_proj, down_lora_b, down_lora_a, alpha=down_lora_scale)
    num_experts = gate_up_proj.shape[0]
    final = torch.zeros_like(x)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        gu = F.linear(x[token_idx], gate_up_proj[expert_idx])
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[expert_idx]
        h = F.linear(expert_glu_math(gu, act, interleaved, alpha, limit, gated), down_proj[expert_idx])
        if down_bias is not None:
            h = h + down_bias[expert_idx]
        h = h * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, h.to(final.dtype))
    return final


# ---------------------------------------------------------------------------------------------------
# Grouped GEMM
# ---------------------------------------------------------------------------------------------------

def _aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm's requirement: 16-byte-aligned data and strides (the unit stride excepted)."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s == 1 or (s * size) % 16 == 0 for s in t.stride())


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """A CUDA device's compute capability, asked once per device (each op call checks it, up to four times)."""
    return torch.cuda.get_device_capability(index)


def grouped_mm_runs(device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether the op's GEMMs at these sizes take ``torch._grouped_mm`` (else the reference, S*k*n memory): what
    ``_grouped_mm_plan`` decides at run time, from what is known at compile time (fresh activations and
    parameters are 16-byte aligned; the strides are multiples of H, 2I and I elements)."""
    size = dtype.itemsize
    if not hasattr(torch, "_grouped_mm") or any((n * size) % 16 for n in (hidden, inter, 2 * inter)):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and _capability(_index(device)) >= (9, 0)
    return device.type == "cpu" and dtype in _FLOAT_DTYPES


def _grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, group_of_row: torch.Tensor
                          ) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` for the two forms used here, in plain PyTorch without host sync.

    a [S, k], b [E, k, n] -> [S, n]: row s times b[group_of_row[s]], by bmm on gathered weights (S*k*n memory).
    a [k, S], b [S, n] -> [E, k, n]: per-row outer products (fp32) summed over each group's rows in row order by
    ``moe_kernels.segment_sum``, rounded once. Not ``index_add_``: on CUDA its atomic adds land in any order, so the
    weight gradients of fp32 experts (which take this path on a GPU) changed bits from run to run.
    ``group_of_row`` [S] is the expert of each row, the information ``offs`` carries, in a gatherable form.
    """
    if b.dim() == 3:
        return torch.bmm(a.unsqueeze(1), b[group_of_row]).squeeze(1)
    k, n = a.shape[0], b.shape[1]
    products = (a.t().float().unsqueeze(2) * b.float().unsqueeze(1)).view(a.shape[1], k * n)
    return segment_sum(products, offs, group_of_row, None, a.dtype).view(offs.shape[0], k, n)


class _Lazy:
    """A tensor formed on first use (``value()``), for an operand only one of two paths reads."""

    def __init__(self, make):
        self._make, self._value = make, None

    def value(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._make()
        return self._value


class _Gathered(_Lazy):
    """``source[index]``, the sorted rows of a [T, .] tensor (token ``index[s]`` for sorted row s): the Triton grouped
    GEMM reads them through the index; any other use forms the [S, .] copy, once."""

    def __init__(self, source: torch.Tensor, index: torch.Tensor):
        super().__init__(lambda: source[index])
        self.source, self.index = source, index


# Which grouped GEMMs the op runs: "auto" (below), or "triton", "grouped_mm" for one kind throughout, or "mixed"
# wherever torch._grouped_mm runs on a GPU (whatever the rows an expert and the adapters), to measure one against
# another (benchmarks/variants.py sets the others).
GEMM_CHOICE = "auto"
# "auto" reads the tokens' rows through the sort order in Triton's GEMM (the forward's first GEMM, its recompute, the
# backward's first) where experts get at most this many rows on average, and runs every other GEMM in
# torch._grouped_mm. H100, bf16, 4096 tokens (benchmarks/results/2026-12-06_h100_103628_grouped_gemm.md), ms with
# _grouped_mm's gather included / Triton's 128 x 256 tiles:
#     Qwen3-MoE (256 rows an expert):    first GEMM 0.522 / 0.537, backward's first 0.333 / 0.267
#     GPT-OSS-20B (512 rows an expert):  1.125 / 1.168, 0.586 / 0.572
#     Mixtral-8x7B (1024 rows an expert): 3.280 / 3.690, 1.556 / 1.758
# and the GEMMs on rows the op forms anyway (second forward, dx, weight gradients) 1.2-2.4x slower in Triton. At
# Qwen3-MoE's shape the pair saves 0.05 ms a layer and, more to the point, never writes the two gathered [S, H]
# copies (128 MiB each, both alive at the backward's peak under moe_recompute).
GATHER_ROWS_PER_EXPERT = 256


class GroupedGemm:
    """The grouped GEMMs of one op call over the groups ``offs`` (the rows of expert e; ``group_of_row``, a tensor
    or ``_Lazy``, names each row's expert): ``gemm(a, b)`` is ``torch._grouped_mm(a, b, offs=offs)`` computed by
    ``backend``: "grouped_mm" (torch's), "triton" (lowering/grouped_gemm.py, which reads a ``_Gathered`` operand
    through its index), "mixed" (Triton's for a ``_Gathered`` operand, torch's for the rest) or "reference"
    (``_grouped_mm_reference``).

    Which is decided once a call (``_grouped_mm_plan``), not once a GEMM: every operand other than the op's weights
    is a tensor the call forms, fresh (so aligned) with row strides among H, 2I (I ungated), I and the adapters'
    ranks, which the plan's size check covers, or a transpose of one. A check per GEMM cost ~9 us of host time on
    the CPU, 18 of them a call with LoRA on the experts."""

    def __init__(self, offs: torch.Tensor, group_of_row, backend: str):
        self.offs, self.group_of_row, self.backend = offs, group_of_row, backend

    def __call__(self, a, b: torch.Tensor) -> torch.Tensor:
        if isinstance(a, _Gathered) and b.dim() == 3 and self.backend in ("triton", "mixed"):
            return grouped_mm(a.source, b, self.offs, a.index)
        if self.backend == "triton":
            if b.dim() == 2:  # [K, S] x [S, N] -> [E, K, N]: a is left.t() (never gathered: _weight_grad forms it)
                return grouped_mm_weight(a.t(), b, self.offs)
            return grouped_mm(a, b, self.offs)
        if isinstance(a, _Gathered):
            a = a.value()
        if self.backend in ("grouped_mm", "mixed"):
            return torch._grouped_mm(a, b, offs=self.offs)
        ids = self.group_of_row
        return _grouped_mm_reference(a, b, self.offs, ids.value() if isinstance(ids, _Lazy) else ids)


def _triton_gemm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether "auto" may run the Triton grouped GEMM here: 16-bit floats on a GPU of sm80 or later, any float in the
    CPU interpreter. Not fp32 on a GPU: at 512 tokens of Qwen3-MoE's H and I (32 experts) the router weights'
    gradient came out at 2.9x eager's error on an H100 (tests/test_cuda_ops.py's rule is 2x; the cause is not found),
    so fp32 experts keep the reference GEMM there as before, which the pattern refuses at sizes its gathered weights
    cannot hold. Not before sm80 (bf16 tensor-core products): untested there, the reference as before."""
    if device.type == "cuda":
        return _capability(_index(device)) >= (8, 0) and (dtype in (torch.bfloat16, torch.float16)
                                                           or GEMM_CHOICE == "triton")
    return device.type == "cpu" and triton_interpreter_on()


def gemm_runs(device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether the op's grouped GEMMs run without the reference's gathered weights (S*k*n memory): torch's
    ``_grouped_mm`` (``grouped_mm_runs``) or Triton's (``_triton_gemm_runs``)."""
    return ((GEMM_CHOICE != "triton" and grouped_mm_runs(device, dtype, hidden, inter))
            or (GEMM_CHOICE != "grouped_mm" and _triton_gemm_runs(device, dtype)))


def _grouped_mm_plan(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                     factors: tuple, n_rows: int = 0) -> str:
    """The backend of one call's grouped GEMMs (``GroupedGemm``). Where ``grouped_mm_runs`` at its sizes (H and I; it
    checks 2I too, the gated first weight's rows), each adapter factor's last two sizes (n or k, and the rank) are
    multiples of 16 bytes too and both weights (maybe transposed views) 16-byte aligned: "grouped_mm", or on a GPU
    "mixed" when the experts get at most ``GATHER_ROWS_PER_EXPERT`` of the ``n_rows`` sorted rows on average, with
    or without LoRA factors (the Qwen3-MoE step with LoRA on attention and experts, one H100 lease: 70.8 ms with
    "mixed", 72.6 with "grouped_mm", benchmarks/results/2026-12-06_issue20_static_launch_h100.md). Else "triton"
    where ``_triton_gemm_runs``, else "reference". GEMM_CHOICE "triton" or "grouped_mm" forces one; mixed takes
    "mixed" on a GPU wherever "grouped_mm" would run. ``factors``: the adapters' contiguous factors, None where not
    given (the op checked their dtype and shapes)."""
    hidden, size = x.shape[1], x.element_size()
    if (GEMM_CHOICE != "triton" and grouped_mm_runs(x.device, x.dtype, hidden, down_proj.shape[2])
            and all((f.shape[-1] * size) % 16 == 0 and (f.shape[-2] * size) % 16 == 0 for f in factors if f is not None)
            and _aligned(gate_up_proj) and _aligned(down_proj)):
        few_rows = n_rows <= GATHER_ROWS_PER_EXPERT * gate_up_proj.shape[0]
        auto = GEMM_CHOICE == "auto" and few_rows
        return "mixed" if (auto or GEMM_CHOICE == "mixed") and x.device.type == "cuda" else "grouped_mm"
    if GEMM_CHOICE != "grouped_mm" and _triton_gemm_runs(x.device, x.dtype):
        return "triton"
    return "reference"


# ---------------------------------------------------------------------------------------------------
# Forward and backward
# ---------------------------------------------------------------------------------------------------

def _check_inputs(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act, gate_up_bias=None,
                  down_bias=None, gate_up_lora_b=None, gate_up_lora_a=None, down_lora_b=None, down_lora_a=None,
                  interleaved=False, gated=True) -> None:
    op = "sloth.moe_experts"
    if gated and act not in ALL_ACTIVATIONS:
        raise ValueError(f"{op}: act must be one of {list(ALL_ACTIVATIONS)}, got {act!r}"
                         + (" (an activation of ungated experts: gated=False)" if act in UNGATED_ACTIVATIONS else ""))
    if not gated and act not in UNGATED_ACTIVATIONS:
        raise ValueError(f"{op}: act of ungated experts (gated=False) must be one of {list(UNGATED_ACTIVATIONS)}, "
                         f"got {act!r}")
    if not gated and interleaved:
        raise ValueError(f"{op}: interleaved gate/up needs gated experts; gated=False has no gate")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: top_k_index must be int32 or int64, got {top_k_index.dtype}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: top_k_index must be [T, K] with T = {x.shape[0]}, got {tuple(top_k_index.shape)}")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"{op}: top_k_weights must be a float tensor, got {top_k_weights.dtype}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"{op}: top_k_weights must have top_k_index's shape {tuple(top_k_index.shape)}, "
                         f"got {tuple(top_k_weights.shape)}")
    rows = "2I" if gated else "I (ungated: the up projection)"
    if gate_up_proj.dim() != 3 or (gated and gate_up_proj.shape[1] % 2) or gate_up_proj.shape[2] != x.shape[1]:
        raise ValueError(f"{op}: gate_up_proj must be [E, {rows}, H] with H = {x.shape[1]}, "
                         f"got {tuple(gate_up_proj.shape)}")
    n_experts, n_first = gate_up_proj.shape[0], gate_up_proj.shape[1]
    n_inter = n_first // 2 if gated else n_first
    if down_proj.dim() != 3 or tuple(down_proj.shape) != (n_experts, x.shape[1], n_inter):
        raise ValueError(f"{op}: down_proj must be [E, H, I] = {(n_experts, x.shape[1], n_inter)} (from gate_up_proj "
                         f"and x), got {tuple(down_proj.shape)}")
    biases = [(name, b, shape) for name, b, shape in (("gate_up_bias", gate_up_bias, (n_experts, n_first)),
                                                       ("down_bias", down_bias, (n_experts, x.shape[1])))
              if b is not None]
    for name, b, shape in biases:
        if tuple(b.shape) != shape:
            raise ValueError(f"{op}: {name} must be {list(shape)}, got {tuple(b.shape)}")
    for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj), *((n, b) for n, b, _ in biases)):
        if w.dtype != x.dtype:
            raise TypeError(f"{op}: {name} must have x's dtype {x.dtype}, got {w.dtype}")
    adapters = _check_adapters(op, x.dtype, (("gate_up", gate_up_proj, gate_up_lora_b, gate_up_lora_a),
                                             ("down", down_proj, down_lora_b, down_lora_a)))
    check_one_device(op, ("x", x), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights),
                     ("gate_up_proj", gate_up_proj), ("down_proj", down_proj), *((n, b) for n, b, _ in biases),
                     *adapters)


def _check_adapters(op: str, dtype: torch.dtype, weights) -> list[tuple[str, torch.Tensor]]:
    """Each (name, weight [E, n, k], B, A): B [E, n, r] and A [E, r, k] both given or both None, in x's dtype;
    the (name, tensor) pairs given, for the device check."""
    given = []
    for name, w, b, a in weights:
        if (b is None) != (a is None):
            raise ValueError(f"{op}: {name}_lora_b and {name}_lora_a must be given together (one was None)")
        if b is None:
            continue
        n_experts, n, k = w.shape
        if b.dim() != 3 or tuple(b.shape[:2]) != (n_experts, n):
            raise ValueError(f"{op}: {name}_lora_b must be [E, n, r] with (E, n) = {(n_experts, n)} (from "
                             f"{name}_proj), got {tuple(b.shape)}")
        if a.dim() != 3 or tuple(a.shape) != (n_experts, b.shape[2], k):
            raise ValueError(f"{op}: {name}_lora_a must be [E, r, k] = {(n_experts, b.shape[2], k)} (from "
                             f"{name}_proj and {name}_lora_b), got {tuple(a.shape)}")
        for part, t in (("b", b), ("a", a)):
            if t.dtype != dtype:
                raise TypeError(f"{op}: {name}_lora_{part} must have x's dtype {dtype}, got {t.dtype}")
        given += [(f"{name}_lora_b", b), (f"{name}_lora_a", a)]
    return given


def _dense_glu(act: str, interleaved: bool, gate_up_bias, gated: bool) -> bool:
    """Whether the forward's GLU is lowering/glu.py's (the dense MLP's kernel): a gate-only activation on halves with
    no gate/up bias; else moe_kernels.expert_glu_forward (also every ungated activation)."""
    return gated and act in ACTIVATIONS and not interleaved and gate_up_bias is None


def _adapter_rows(gemm: GroupedGemm, rows: torch.Tensor, lora_b: torch.Tensor, lora_a: torch.Tensor, scale: float
                  ) -> torch.Tensor:
    """scale * B[e] A[e] rows_r for each sorted row r of expert e ([S, k] -> [S, n]): a LoRA adapter's share of an
    expert GEMM, two grouped GEMMs at rank r, the [E, n, k] product never formed."""
    u = gemm(rows, lora_a.transpose(1, 2))
    return gemm(u * scale, lora_b.transpose(1, 2))


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """An adapter factor in its [E, ., .] layout, contiguous (peft's are permuted views; at rank r a copy is
    E*n*r elements, and grouped GEMMs want row- or column-major operands)."""
    return t.contiguous() if t is not None else None


def moe_experts_forward(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str,
                        gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                        interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0,
                        gate_up_lora_b: torch.Tensor | None = None, gate_up_lora_a: torch.Tensor | None = None,
                        down_lora_b: torch.Tensor | None = None, down_lora_a: torch.Tensor | None = None,
                        gate_up_lora_scale: float = 1.0, down_lora_scale: float = 1.0, gated: bool = True,
                        recompute_gu: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, H], gu [S, 2I] (u [S, I] ungated), order [S], offs [E]); the last three are the backward's
    residuals. With ``recompute_gu`` gu is returned empty ([0, 2I]): the backward forms it again
    (``_first_gemm``), so it is not kept from the forward."""
    _check_inputs(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act, gate_up_bias, down_bias,
                  gate_up_lora_b, gate_up_lora_a, down_lora_b, down_lora_a, interleaved, gated)
    top_k = top_k_index.shape[1]
    order, sorted_ids, offs, inverse, token_of_row = route(top_k_index, gate_up_proj.shape[0])
    b1, a1, b2, a2 = (_contiguous(t) for t in (gate_up_lora_b, gate_up_lora_a, down_lora_b, down_lora_a))
    gemm = GroupedGemm(offs, sorted_ids, _grouped_mm_plan(x, gate_up_proj, down_proj, (b1, a1, b2, a2),
                                                        top_k_index.numel()))
    # Each [S, .] intermediate is dropped after its last read, so the next is not allocated beside it (x_SH and
    # y_SH are S*H elements each, 128 MiB at Qwen3-MoE's layer of 4096 tokens).
    gu_S2I, h_SI = _first_gemm(gemm, _Gathered(x, token_of_row), gate_up_proj, b1, a1, gate_up_lora_scale,
                               gate_up_bias, sorted_ids, act, interleaved, alpha, limit, gated)
    y_SH = gemm(h_SI, down_proj.transpose(1, 2))
    if b2 is not None:
        y_SH = y_SH + _adapter_rows(gemm, h_SI, b2, a2, down_lora_scale)
    del h_SI
    if down_bias is not None:
        y_SH = y_SH + down_bias[sorted_ids]
    out = combine(y_SH, inverse, top_k, top_k_weights, x.dtype)
    return out, (gu_S2I.new_empty((0, gu_S2I.shape[1])) if recompute_gu else gu_S2I), order, offs


def _first_gemm(gemm: GroupedGemm, x_SH: _Gathered, gate_up_proj: torch.Tensor, b1, a1, scale: float,
                gate_up_bias, sorted_ids: torch.Tensor | _Lazy, act: str, interleaved: bool, alpha: float,
                limit: float, gated: bool, with_h: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(gu [S, 2I], h [S, I]) of the sorted rows ``x_SH`` (the tokens' rows, read through the index): the first
    grouped GEMM, its adapter, the gate/up bias (added by the expert GLU kernel, which returns gu with it) and the
    GLU. The forward's and, under ``recompute_gu``, the backward's: the same calls in the same order, so the same
    bits. Without ``with_h`` the lowering/glu.py GLU is skipped and h is None (the expert GLU kernel, which adds the
    bias, still runs)."""
    gu_S2I = gemm(x_SH, gate_up_proj.transpose(1, 2))
    if b1 is not None:
        gu_S2I = gu_S2I + _adapter_rows(gemm, x_SH, b1, a1, scale)
    del x_SH
    if _dense_glu(act, interleaved, gate_up_bias, gated):
        return gu_S2I, glu_forward(gu_S2I, None, ACTIVATIONS[act]) if with_h else None
    ids = sorted_ids.value() if isinstance(sorted_ids, _Lazy) else sorted_ids
    return expert_glu_forward(gu_S2I, gate_up_bias, ids, ACTIVATIONS.get(act, act), interleaved, alpha, limit, gated)


def _transposed(w: torch.Tensor) -> bool:
    """Whether the [E, k, n] weight is a transposed view of an [E, n, k] tensor (GPT-OSS's layout, as the pattern
    passes it): its last two dimensions column-major."""
    return w.stride(1) == 1 and w.stride(2) != 1


def _weight_grad(gemm: GroupedGemm, left, right, like: torch.Tensor) -> torch.Tensor:
    """d W[e] = sum over e's rows of left_r^T right_r ([E, k, n] from left [S, k] and right [S, n]), laid out as
    ``like`` (``torch.empty_like``'s strides, which the fake implementation gives): for a transposed weight it is
    formed as [E, n, k] and transposed, so the gradient reaches the [E, n, k] parameter with no copy (at
    GPT-OSS-20B's experts the copies would move 1.6 GB a backward). A gathered operand is formed here."""
    left, right = (t.value() if isinstance(t, _Gathered) else t for t in (left, right))
    if _transposed(like):
        return gemm(right.t(), left).transpose(1, 2)
    return gemm(left.t(), right)


def moe_experts_backward(dout: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                         gate_up_proj: torch.Tensor, down_proj: torch.Tensor, gu: torch.Tensor, order: torch.Tensor,
                         offs: torch.Tensor, act: str, compute_dx: bool, compute_dw: bool, compute_d_gate_up: bool,
                         compute_d_down: bool, gate_up_bias: torch.Tensor | None = None,
                         down_bias: torch.Tensor | None = None, interleaved: bool = False, alpha: float = 1.702,
                         limit: float = 7.0, compute_d_gate_up_bias: bool = False, compute_d_down_bias: bool = False,
                         gate_up_lora_b: torch.Tensor | None = None, gate_up_lora_a: torch.Tensor | None = None,
                         down_lora_b: torch.Tensor | None = None, down_lora_a: torch.Tensor | None = None,
                         gate_up_lora_scale: float = 1.0, down_lora_scale: float = 1.0,
                         compute_d_gate_up_lora: bool = False, compute_d_down_lora: bool = False,
                         gated: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d top_k_weights, d gate_up_proj, d down_proj, d gate_up_bias, d down_bias, d gate_up_lora_b,
    d gate_up_lora_a, d down_lora_b, d down_lora_a), each an empty tensor where not asked for (an adapter's two
    factors are asked for together)."""
    top_k = top_k_index.shape[1]
    inverse, token_of_row = invert_order(order, top_k)
    # The experts of the sorted rows, which the reference grouped GEMM and the biases read: formed once, on first use.
    sorted_ids = _Lazy(lambda: top_k_index.reshape(-1)[order])
    b1, a1, b2, a2 = (_contiguous(t) for t in (gate_up_lora_b, gate_up_lora_a, down_lora_b, down_lora_a))
    gemm = GroupedGemm(offs, sorted_ids, _grouped_mm_plan(x, gate_up_proj, down_proj, (b1, a1, b2, a2),
                                                        top_k_index.numel()))
    s1, s2 = gate_up_lora_scale, down_lora_scale
    if gu.shape[0] != order.shape[0]:  # the forward ran with recompute_gu: gu again, as the forward formed it
        gu, _ = _first_gemm(gemm, _Gathered(x, token_of_row), gate_up_proj, b1, a1, s1, gate_up_bias, sorted_ids,
                            act, interleaved, alpha, limit, gated, with_h=False)
    dout_SH = _Gathered(dout.to(x.dtype), token_of_row)
    c_SI = gemm(dout_SH, down_proj)
    if b2 is not None:  # c = W_d_eff^T dout = W_d^T dout + s2 A2^T (B2^T dout)
        v2_Sr = gemm(dout_SH, b2) * s2
        c_SI = c_SI + gemm(v2_Sr, a2)
    d_gate_up_bias, d_down_bias = x.new_empty(0), x.new_empty(0)
    d_w_add = None
    if down_bias is not None:
        # y_r = W_d h_r + b2[e], so d w_r gains <dout_t, b2[e]>; d b2[e] sums w_r dout_t over e's rows
        if compute_dw:
            d_w_add = (dout_SH.value().float() * down_bias[sorted_ids.value()].float()).sum(-1)
        if compute_d_down_bias:
            d_down_bias = segment_sum(dout_SH.value(), offs, sorted_ids.value(), top_k_weights.reshape(-1)[order],
                                      down_bias.dtype)
    down_lora_trains = b2 is not None and compute_d_down_lora
    d_gu, dw_S, hw_SI = glu_backward_weighted(c_SI, gu, top_k_weights, order, ACTIVATIONS.get(act, act), compute_dw,
                                              compute_d_down or down_lora_trains, interleaved, alpha, limit, d_w_add,
                                              gated)
    del c_SI, gu  # as in the forward, each [S, .] intermediate is dropped after its last read (gu: when recomputed)
    if gate_up_bias is not None and compute_d_gate_up_bias:
        d_gate_up_bias = segment_sum(d_gu, offs, sorted_ids.value(), None, gate_up_bias.dtype)
    # A fresh empty tensor for each gradient not formed: a custom op's outputs may not alias one another.
    dw = dw_S.view(top_k_weights.shape) if compute_dw else x.new_empty(0)
    d_down = _weight_grad(gemm, dout_SH, hw_SI, down_proj) if compute_d_down else x.new_empty(0)
    d_b2, d_a2 = x.new_empty(0), x.new_empty(0)
    if down_lora_trains:  # d B2[e] = sum_r dout_t (s2 A2 w_r h_r)^T,  d A2[e] = sum_r (s2 B2^T dout_t) (w_r h_r)^T
        d_b2 = gemm(dout_SH.value().t(), gemm(hw_SI, a2.transpose(1, 2)) * s2)
        d_a2 = gemm(v2_Sr.t(), hw_SI)
    del dout_SH, hw_SI
    gate_up_lora_trains = b1 is not None and compute_d_gate_up_lora
    v1_Sr = None
    if b1 is not None and (compute_dx or gate_up_lora_trains):  # s1 B1^T d gu_r
        v1_Sr = gemm(d_gu, b1) * s1
    dx = x.new_empty(0)
    if compute_dx:
        dx_SH = gemm(d_gu, gate_up_proj)
        if v1_Sr is not None:  # dx_t gains sum_r s1 A1^T B1^T d gu_r
            dx_SH = dx_SH + gemm(v1_Sr, a1)
        dx = combine(dx_SH, inverse, top_k, None, x.dtype)
    d_gate_up, d_b1, d_a1 = x.new_empty(0), x.new_empty(0), x.new_empty(0)
    if compute_d_gate_up or gate_up_lora_trains:
        x_SH = _Gathered(x, token_of_row)
        if compute_d_gate_up:
            d_gate_up = _weight_grad(gemm, d_gu, x_SH, gate_up_proj)
        if gate_up_lora_trains:  # d B1[e] = sum_r d gu_r (s1 A1 x_t)^T,  d A1[e] = sum_r (s1 B1^T d gu_r) x_t^T
            d_b1 = gemm(d_gu.t(), gemm(x_SH, a1.transpose(1, 2)) * s1)
            d_a1 = gemm(v1_Sr.t(), x_SH.value())
    return dx, dw, d_gate_up, d_down, d_gate_up_bias, d_down_bias, d_b1, d_a1, d_b2, d_a2


# ---------------------------------------------------------------------------------------------------
# Registration with torch.library: a graph citizen with a fake implementation and its own backward.
# ---------------------------------------------------------------------------------------------------

# moe_experts_forward's arguments from gate_up_bias on, as their defaults (a call may leave them out)
_DEFAULTS = (None, None, False, 1.702, 7.0, None, None, None, None, 1.0, 1.0, True, False)
_N_INPUTS = 6 + len(_DEFAULTS)


def _setup_context(ctx, inputs, output) -> None:
    x, top_k_index, top_k_weights, gate_up_proj, down_proj, act, gate_up_bias, down_bias, interleaved, alpha, \
        limit, gate_up_lora_b, gate_up_lora_a, down_lora_b, down_lora_a, gate_up_lora_scale, down_lora_scale, \
        gated, _recompute_gu = (*inputs, *_DEFAULTS[len(inputs) - 6:])
    _, gu, order, offs = output
    ctx.save_for_backward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gu, order, offs, gate_up_bias,
                          down_bias, gate_up_lora_b, gate_up_lora_a, down_lora_b, down_lora_a)
    ctx.mark_non_differentiable(gu, order, offs)  # residuals returned to be saved, not used
    ctx.act, ctx.interleaved, ctx.alpha, ctx.limit = act, interleaved, alpha, limit
    ctx.scales = (gate_up_lora_scale, down_lora_scale)
    ctx.gated = gated


def _backward(ctx, dout, _dgu, _dorder, _doffs):
    x, top_k_index, top_k_weights, gate_up_proj, down_proj, gu, order, offs, gate_up_bias, down_bias, \
        gate_up_lora_b, gate_up_lora_a, down_lora_b, down_lora_a = ctx.saved_tensors
    passed = len(ctx.needs_input_grad)  # the arguments given: the defaults left out have no entry
    need = (*ctx.needs_input_grad, *(False,) * (_N_INPUTS - passed))
    grads = torch.ops.sloth.moe_experts_backward(
        dout, x, top_k_index, top_k_weights, gate_up_proj, down_proj, gu, order, offs, ctx.act,
        need[0], need[2], need[3], need[4], gate_up_bias, down_bias, ctx.interleaved, ctx.alpha, ctx.limit,
        need[6], need[7], gate_up_lora_b, gate_up_lora_a, down_lora_b, down_lora_a, *ctx.scales,
        need[11] or need[12], need[13] or need[14], ctx.gated)
    dx, dw, d_gate_up, d_down, d_gate_up_bias, d_down_bias, d_b1, d_a1, d_b2, d_a2 = grads
    wanted = lambda i, g: g if need[i] else None  # noqa: E731
    return (wanted(0, dx), None, wanted(2, dw), wanted(3, d_gate_up), wanted(4, d_down), None,
            wanted(6, d_gate_up_bias), wanted(7, d_down_bias), None, None, None, wanted(11, d_b1), wanted(12, d_a1),
            wanted(13, d_b2), wanted(14, d_a2), None, None, None, None)[:passed]


@functools.cache
def register() -> None:
    """Define ``sloth::moe_experts`` and ``sloth::moe_experts_backward`` (idempotent)."""
    fwd = define("sloth::moe_experts", moe_experts_forward)
    bwd = define("sloth::moe_experts_backward", moe_experts_backward)

    @fake(fwd)
    def _(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act, gate_up_bias=None, down_bias=None,
          interleaved=False, alpha=1.702, limit=7.0, gate_up_lora_b=None, gate_up_lora_a=None, down_lora_b=None,
          down_lora_a=None, gate_up_lora_scale=1.0, down_lora_scale=1.0, gated=True, recompute_gu=False):
        _check_inputs(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act, gate_up_bias, down_bias,
                      gate_up_lora_b, gate_up_lora_a, down_lora_b, down_lora_a, interleaved,
                      gated)  # shapes only: fake-safe
        n_rows = top_k_index.numel()
        return (x.new_empty(x.shape), x.new_empty((0 if recompute_gu else n_rows, gate_up_proj.shape[1])),
                top_k_index.new_empty((n_rows,), dtype=torch.int64),
                top_k_index.new_empty((gate_up_proj.shape[0],), dtype=torch.int32))

    @fake(bwd)
    def _(dout, x, top_k_index, top_k_weights, gate_up_proj, down_proj, gu, order, offs, act,
          compute_dx, compute_dw, compute_d_gate_up, compute_d_down, gate_up_bias=None, down_bias=None,
          interleaved=False, alpha=1.702, limit=7.0, compute_d_gate_up_bias=False, compute_d_down_bias=False,
          gate_up_lora_b=None, gate_up_lora_a=None, down_lora_b=None, down_lora_a=None, gate_up_lora_scale=1.0,
          down_lora_scale=1.0, compute_d_gate_up_lora=False, compute_d_down_lora=False, gated=True):
        with_bias = lambda b, wanted: b.new_empty(b.shape) if b is not None and wanted else x.new_empty(0)  # noqa: E731
        return (x.new_empty(x.shape if compute_dx else 0),
                top_k_weights.new_empty(top_k_weights.shape) if compute_dw else x.new_empty(0),
                torch.empty_like(gate_up_proj) if compute_d_gate_up else x.new_empty(0),  # its layout: _weight_grad
                torch.empty_like(down_proj) if compute_d_down else x.new_empty(0),
                with_bias(gate_up_bias, compute_d_gate_up_bias), with_bias(down_bias, compute_d_down_bias),
                with_bias(gate_up_lora_b, compute_d_gate_up_lora), with_bias(gate_up_lora_a, compute_d_gate_up_lora),
                with_bias(down_lora_b, compute_d_down_lora), with_bias(down_lora_a, compute_d_down_lora))

    fwd.register_autograd(_backward, setup_context=_setup_context)


def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, act: str = "silu", gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, interleaved: bool = False, alpha: float = 1.702,
                limit: float = 7.0, gate_up_lora_b: torch.Tensor | None = None,
                gate_up_lora_a: torch.Tensor | None = None, down_lora_b: torch.Tensor | None = None,
                down_lora_a: torch.Tensor | None = None, gate_up_lora_scale: float = 1.0,
                down_lora_scale: float = 1.0, gated: bool = True, recompute_gu: bool = False) -> torch.Tensor:
    """Fused MoE experts, equal to ``moe_experts_pattern``; see the module docstring for the math (``gated=False``:
    ungated experts, ``gate_up_proj`` then the up projection [E, I, H]; ``recompute_gu``: the first GEMM's output
    formed again in the backward instead of kept)."""
    register()
    return torch.ops.sloth.moe_experts(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act, gate_up_bias,
                                       down_bias, interleaved, alpha, limit, gate_up_lora_b, gate_up_lora_a,
                                       down_lora_b, down_lora_a, gate_up_lora_scale, down_lora_scale, gated,
                                       recompute_gu)[0]
