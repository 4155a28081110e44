"""The LoRA adapter kernels at the shapes and strides a Llama-3-8B step calls them with, beside candidate
forms of the two that fall furthest below the copy bandwidth in the step's profile (H200).

    python -m benchmarks.ops.lora_insitu [--smoke]

The step's profile (benchmarks/results/2026-11-30_0206_sloth-Lall.txt) put the single-member up_add
kernel at ~33% of copy bandwidth over its 191 calls and the down kernel at ~50%, against 70% and 45% in
benchmarks/ops/lora_sweep.py, which timed r = 16 with the forward's strides only. Here each kernel runs at
every (M, N or K, r, factor layout) a step uses, timed as GPU kernel time with the L2 flushed before each
call, and printed as % of the measured copy bandwidth over the bytes the kernel must move:

    up_add  base[M, N] += s * h[M, R] @ q[R, N]      reads and writes base   (q = b.T forward, a for dx)
    down    h[M, R] = x[M, K] @ p[K, R]               reads x                 (p = a.T forward, b backward)

Candidates (prototypes here; a winner moves to lowering/lora.py with its tests):

    up_add rows   one program per BLOCK_M rows and column group, looping over its column tiles, so the
                  factor rows stay loaded and the next base tile's load overlaps the current tile's store
                  (num_stages): the form lora.py ships since this script's first run, which timed it
                  against one program per tile (UP_CONFIG's comment has the numbers)
    down splitk   the K loop split over programs (the shipped kernel has M / 64 = 64 programs for 4096
                  tokens, half the H200's 132 SMs), partials summed by the last program of each row block
                  in split order (deterministic, as lora._grad_tile does)
    cuBLAS        Unsloth's forms for reference: base.addmm_(h16, b16.T) and x @ a16.T in bf16

Each candidate is checked against the shipped kernel's result before it is timed.
"""
from __future__ import annotations

import argparse
import itertools
from typing import Any, Callable

import torch

from benchmarks import common
from benchmarks.ops import harness

common.use_triton_interpreter_without_cuda()  # before triton is imported: the prototypes below are kernels
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

common.import_sloth()
from sloth.lowering.lora import _dot16  # noqa: E402
from sloth.lowering.rounding import INTERPRETED, round_to  # noqa: E402


@triton.jit
def _up_add_rows_kernel(p_base, p_h, p_q, M, N, R, stride_bm, stride_hm, stride_qr, stride_qn, scale, cols_per_group,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK_R: tl.constexpr,
                        PRECISION: tl.constexpr):
    """base[rows of block pid 0, columns of group pid 1] += scale * h[rows, R] @ q[R, columns], a column tile
    at a time; the product over R in CHUNK_R-wide dots (CHUNK_R = BLOCK_R: one dot, h's rows loaded once)."""
    i_m, i_g = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_r = tl.arange(0, BLOCK_R)
    b_h = tl.load(p_h + o_m[:, None] * stride_hm + o_r[None, :], mask=m_m[:, None] & (o_r < R)[None, :], other=0.0)
    col_start = i_g * cols_per_group
    col_stop = tl.minimum(col_start + cols_per_group, N)
    for n0 in range(col_start, col_stop, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < col_stop
        if CHUNK_R == BLOCK_R:
            b_q = tl.load(p_q + o_r[:, None] * stride_qr + o_n[None, :] * stride_qn,
                          mask=(o_r < R)[:, None] & m_n[None, :], other=0.0)
            b_low = tl.dot(b_h, b_q.to(tl.float32), input_precision=PRECISION)
        else:
            b_low = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in tl.static_range(0, BLOCK_R, CHUNK_R):
                o_c = r0 + tl.arange(0, CHUNK_R)
                b_hc = tl.load(p_h + o_m[:, None] * stride_hm + o_c[None, :], mask=m_m[:, None] & (o_c < R)[None, :],
                               other=0.0)
                b_q = tl.load(p_q + o_c[:, None] * stride_qr + o_n[None, :] * stride_qn,
                              mask=(o_c < R)[:, None] & m_n[None, :], other=0.0)
                b_low = tl.dot(b_hc, b_q.to(tl.float32), b_low, input_precision=PRECISION)
        m_mn = m_m[:, None] & m_n[None, :]
        p_tile = p_base + o_m[:, None] * stride_bm + o_n[None, :]
        b_y = tl.load(p_tile, mask=m_mn, other=0.0).to(tl.float32) + scale * b_low
        tl.store(p_tile, round_to(b_y, p_base.dtype.element_ty), mask=m_mn)


def up_add_rows_(base, h, q, scale, block_m, block_n, groups, num_warps, num_stages, chunk_r=0, precision="tf32x3"):
    n_rows, n_cols = base.shape
    per_group = triton.cdiv(triton.cdiv(n_cols, groups), block_n) * block_n
    block_r = max(16, triton.next_power_of_2(h.shape[1]))
    _up_add_rows_kernel[(triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, per_group))](
        base, h, q, n_rows, n_cols, h.shape[1], base.stride(0), h.stride(0), q.stride(0), q.stride(1), float(scale),
        per_group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, CHUNK_R=min(chunk_r or block_r, block_r),
        PRECISION=precision, num_warps=num_warps, num_stages=num_stages)
    return base


@triton.jit
def _down_splitk_kernel(p_x, p_p, p_h, p_ws, p_count, M, K, R, stride_xm, stride_hm, k_per_split, n_splits,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                        THREE_DOTS: tl.constexpr):
    """h[rows of block pid 0, R] = x[rows, K] @ p[K, R] with p the [K, 4 BLOCK_R] bf16 split of an fp32 factor
    (lora._split_factor_kernel), program pid 1 forming the sum over its K range; the last of a row block's
    programs adds the partials in split order. THREE_DOTS: the hi, mid and lo parts as three BLOCK_R-wide dots
    into one accumulator (the split's zero fourth part not loaded) instead of one 4 BLOCK_R-wide dot."""
    i_m, i_s = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_c = tl.arange(0, 4 * BLOCK_R)
    o_r = tl.arange(0, BLOCK_R)
    m_m = o_m < M
    k_start = i_s * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    if THREE_DOTS:
        b_h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < k_stop
            b_x = tl.load(p_x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
            p_row = p_p + o_k[:, None] * (4 * BLOCK_R) + o_r[None, :]
            b_h = _dot16(b_x, tl.load(p_row, mask=m_k[:, None], other=0.0), b_h, INTERPRETED)
            b_h = _dot16(b_x, tl.load(p_row + BLOCK_R, mask=m_k[:, None], other=0.0), b_h, INTERPRETED)
            b_h = _dot16(b_x, tl.load(p_row + 2 * BLOCK_R, mask=m_k[:, None], other=0.0), b_h, INTERPRETED)
    else:
        b_acc = tl.zeros((BLOCK_M, 4 * BLOCK_R), dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < k_stop
            b_x = tl.load(p_x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
            b_p = tl.load(p_p + o_k[:, None] * (4 * BLOCK_R) + o_c[None, :], mask=m_k[:, None], other=0.0)
            b_acc = _dot16(b_x, b_p, b_acc, INTERPRETED)
        b_h = tl.sum(tl.reshape(b_acc, (BLOCK_M, 4, BLOCK_R)), axis=1)
    m_tile = m_m[:, None] & (o_r < R)[None, :]
    o_tile = o_m[:, None] * BLOCK_R + o_r[None, :]
    if n_splits == 1:
        tl.store(p_h + o_m[:, None] * stride_hm + o_r[None, :], b_h, mask=m_tile)
    else:
        tl.store(p_ws + i_s * M * BLOCK_R + o_tile, b_h, mask=m_tile)
        tl.debug_barrier()
        if tl.atomic_add(p_count + i_m, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
            b_sum = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for s in range(0, n_splits):
                b_sum += tl.load(p_ws + s * M * BLOCK_R + o_tile, mask=m_tile, other=0.0, cache_modifier=".cg")
            tl.store(p_h + o_m[:, None] * stride_hm + o_r[None, :], b_sum, mask=m_tile)
            tl.atomic_xchg(p_count + i_m, 0)


def down_splitk(x, split, rank, block_r, block_m, block_k, splits, num_warps, num_stages, ws, counters,
                three_dots=False):
    n_rows, k = x.shape
    per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    h = torch.empty((n_rows, rank), dtype=torch.float32, device=x.device)
    _down_splitk_kernel[(triton.cdiv(n_rows, block_m), triton.cdiv(k, per_split))](
        x, split, h, ws, counters, n_rows, k, rank, x.stride(0), h.stride(0), per_split, triton.cdiv(k, per_split),
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, THREE_DOTS=three_dots, num_warps=num_warps,
        num_stages=num_stages)
    return h


def _print_ranked(scores: dict[str, list[float]], title: str) -> None:
    """The 12 settings (or references) of the highest mean % of copy over the cases, each with its per-case %;
    one that failed in any case (NaN) is left out."""
    ranked = sorted(((sum(v) / len(v), k) for k, v in scores.items() if all(x == x for x in v)), reverse=True)
    print(f"{title}, mean % of copy over the cases (best 12):")
    for score, name in ranked[:12]:
        print(f"  {score:5.1f}%  {name}  [" + " ".join(f"{v:.0f}" for v in scores[name]) + "]")


def _pct(fn: Callable[[], Any], nbytes: int, copy_gbps: float) -> float:
    ms = common.kernel_ms(fn)
    return float("nan") if ms is None else 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("up_add", "down"), help="time one kernel's cases only")
    parser.add_argument("--min-rank", type=int, default=0, help="only the cases of at least this rank")
    args, device = harness.start(__doc__, argv, parser)
    import sloth.lowering.lora as lora

    smoke = args.smoke or device == "cpu"
    m = 96 if smoke else 4096
    copy_gbps = common.copy_bandwidth_gbps()
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, copy {copy_gbps:.0f} GB/s, "
          f"M {m}, shipped UP_CONFIG {lora.UP_CONFIG} DOWN_CONFIG {lora.DOWN_CONFIG}", flush=True)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    # (what, N, R, factor layout): the step's single-member up_add calls per layer
    up_cases = [("o fwd", 4096, 16, "b.T"), ("down fwd", 4096, 16, "b.T"), ("o dx", 4096, 16, "a"),
                ("down dx", 14336, 16, "a"), ("qkv dx", 4096, 48, "a"), ("gate/up dx", 4096, 32, "a")]
    if smoke:
        up_cases = [(w, 160, r, lay) for w, _, r, lay in up_cases[2:5]]
    up_rows = [dict(block_m=bm, block_n=bn, groups=g, num_warps=nw, num_stages=ns)
               for bm, bn, g, nw, ns in itertools.product((32, 64), (128, 256), (1, 2, 4), (4, 8), (2, 3))]
    up_rows += [dict(block_m=bm, block_n=64, groups=g, num_warps=nw, num_stages=ns)
                for bm, g, nw, ns in itertools.product((64, 128), (2, 4, 8), (4, 8), (2, 3))]
    # the product's cost at r 32 and 48: in 16-wide dots, and (not exact enough to ship; to see whether the tile is
    # bound by tf32x3's three products) one tf32 product
    up_rows += [dict(block_m=32, block_n=128, groups=4, num_warps=nw, num_stages=3, chunk_r=16) for nw in (4, 8)]
    up_rows += [dict(block_m=32, block_n=128, groups=4, num_warps=4, num_stages=3, precision="tf32")]
    if smoke:
        up_rows = up_rows[:2] + up_rows[-3:]
    up_cases = [case for case in up_cases if case[2] >= args.min_rank]
    if args.only == "down":
        up_cases = []
    print("\nup_add: % of copy (bytes: read and write base)")
    scores: dict[str, list[float]] = {}
    for what, n, r, layout in up_cases:
        base0 = rand(m, n, dtype=torch.bfloat16)
        h = rand(m, r)
        q = rand(n, r, scale=0.25).t() if layout == "b.T" else rand(r, n, scale=0.01)
        ref = lora._up_add_(base0.clone(), h, q, 0.5)
        base = base0.clone()
        nbytes = 2 * m * n * 2
        row = {"shipped": _pct(lambda: lora._up_add_(base, h, q, 0.5), nbytes, copy_gbps)}
        if device == "cuda":
            h16, q16 = h.bfloat16(), q.bfloat16()
            row["cuBLAS addmm_ bf16"] = _pct(lambda: base.addmm_(h16, q16, alpha=0.5), nbytes, copy_gbps)
            other = torch.empty_like(base)
            row["aten add_ (3 MN)"] = _pct(lambda: base.add_(other), 3 * m * n * 2, copy_gbps)
        for cfg in up_rows:
            name = "rows " + " ".join(f"{k}={v}" for k, v in cfg.items())
            try:
                got = up_add_rows_(base0.clone(), h, q, 0.5, **cfg)
                exact = "chunk_r" not in cfg and "precision" not in cfg  # the shipped tile math: the same bits
                close = (got.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
                if not (torch.equal(got, ref) if exact else close):
                    row[name] = float("nan")
                    print(f"  {what} {name}: differs from the shipped kernel "
                          f"({(got.float() - ref.float()).abs().max().item():.3g})", flush=True)
                    continue
                row[name] = _pct(lambda: up_add_rows_(base, h, q, 0.5, **cfg), nbytes, copy_gbps)
            except Exception as exc:  # a setting Triton cannot compile
                row[name] = float("nan")
                print(f"  {what} {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        print(f"{what} (N {n}, r {r}, q {layout}): " + "  ".join(f"{k} {v:.1f}%" for k, v in row.items()
                                                                  if not k.startswith("rows")), flush=True)
        best = sorted(((v, k) for k, v in row.items() if k.startswith("rows") and v == v), reverse=True)[:3]
        print("    best here: " + "; ".join(f"{k[5:]} {v:.1f}%" for v, k in best), flush=True)
        for k, v in row.items():
            scores.setdefault(k, []).append(v)
    _print_ranked(scores, "up_add")

    # (what, K, R, factor): the step's single-member down calls per layer (bf16 x, fp32 factor: split mode)
    down_cases = [("o fwd x@a.T", 4096, 16, "a.T"), ("down fwd", 14336, 16, "a.T"), ("o bwd dy@b", 4096, 16, "b"),
                  ("down bwd dy@b", 4096, 16, "b"), ("qkv-like r48", 4096, 48, "a.T")]
    if smoke:
        down_cases = [(w, 320, r, lay) for w, _, r, lay in down_cases[:2]]
    down_grid = [dict(block_m=bm, block_k=bk, splits=s, num_warps=nw, num_stages=ns, three_dots=t)
                 for bm, bk, s, nw, ns, t in itertools.product((64, 128), (128, 256), (1, 2, 4), (4, 8), (3,),
                                                              (False, True))]
    if smoke:
        down_grid = [dict(block_m=32, block_k=64, splits=s, num_warps=4, num_stages=2, three_dots=t)
                     for s in (1, 3) for t in (False, True)]
    if args.only == "up_add":
        down_cases = []
    print("\ndown: % of copy (bytes: read x)")
    scores = {}
    for what, k, r, layout in down_cases:
        x = rand(m, k, dtype=torch.bfloat16)
        p = rand(r, k, scale=k ** -0.5).t() if layout == "a.T" else rand(k, r, scale=0.25)
        ref = lora._down(x, p)
        block_r = lora._block_r(r)
        split = torch.empty((k, 4 * block_r), dtype=torch.bfloat16, device=device)
        lora._split_factor_kernel[(triton.cdiv(k, 64),)](p, split, k, r, p.stride(0), p.stride(1), BLOCK_K=64,
                                                          BLOCK_R=block_r, num_warps=4)
        ws = torch.empty(4 * m * block_r, dtype=torch.float32, device=device)
        counters = torch.zeros(triton.cdiv(m, 32), dtype=torch.int32, device=device)
        nbytes = m * k * 2
        row = {"shipped": _pct(lambda: lora._down(x, p), nbytes, copy_gbps)}
        if device == "cuda":
            p16 = p.bfloat16()
            row["cuBLAS mm bf16"] = _pct(lambda: x @ p16, nbytes, copy_gbps)
        for cfg in down_grid:
            name = "splitk " + " ".join(f"{kk}={v}" for kk, v in cfg.items())
            cols = (3 if cfg["three_dots"] else 4) * block_r
            if lora.down_smem_bytes(cfg["block_m"], cfg["block_k"], cols, 2, 2, cfg["num_stages"]) > 220_000:
                continue
            try:
                got = down_splitk(x, split, r, block_r, ws=ws, counters=counters, **cfg)
                err = (got - ref).abs().max().item() / ref.abs().max().item()
                if err > 1e-4 or counters.any():  # fp32 sums in another order: ~1e-5 seen
                    row[name] = float("nan")
                    print(f"  {what} {name}: relative error {err:.3g} vs the shipped kernel, counters "
                          f"{int(counters.count_nonzero())} not reset", flush=True)
                    continue
                row[name] = _pct(lambda: down_splitk(x, split, r, block_r, ws=ws, counters=counters, **cfg), nbytes,
                                 copy_gbps)
            except Exception as exc:
                row[name] = float("nan")
                print(f"  {what} {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        print(f"{what} (K {k}, r {r}, p {layout}): " + "  ".join(f"{kk} {v:.1f}%" for kk, v in row.items()
                                                                  if not kk.startswith("splitk")), flush=True)
        for kk, v in row.items():
            scores.setdefault(kk, []).append(v)
    _print_ranked(scores, "down (splitk excludes the factor split launch)")


if __name__ == "__main__":
    main()
