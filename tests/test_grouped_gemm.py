"""lowering/grouped_gemm.py: the Triton grouped GEMMs (interpreted here) against per-group matmuls.

Oracle: each group's rows multiplied by its matrix with ``torch.matmul`` at the tested dtype ("eager") and in float64
(the reference); the tolerance rule of tests/tolerance.py. Odd sizes, empty groups at the start, middle and end, one
group holding every row, groups of several row tiles (at the interpreter's tiles and at 16-wide ones), rows read
through an index (the experts' sorted tokens), operands transposed, index vectors as strided views, and fewer rows in
the groups than the operand has.
"""
from __future__ import annotations

import pytest
import torch

from sloth.lowering.grouped_gemm import _ROW_TILES, _WEIGHT_TILES, _fitted, grouped_mm, grouped_mm_weight
from tolerance import assert_close

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# group sizes; 0 = an empty group
GROUPS = {
    "odd": [5, 0, 9, 3, 0],
    "one-group-all": [0, 0, 23, 0],
    "small": [1, 2],
    "many": [3, 0, 1, 7, 2, 0, 4, 5, 1, 0, 6],
    # groups of several row tiles (the interpreter's tiles are 32 rows, SMALL_TILES' 16): exact multiples, one row
    # past a multiple, and the grid's worst case (every group one row into a new tile)
    "multi-tile": [33, 0, 64, 17, 70, 32, 1],
}
# tiles of 16 (BLOCK_M, BLOCK_N, BLOCK_K): more row tiles a group and more K steps at these sizes
SMALL_TILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4)
# every group set at the interpreter's tiles, and the several-tile groups at 16-wide ones too
TILED = [pytest.param(g, None, id=f"{g}-default-tiles") for g in GROUPS] + \
    [pytest.param("multi-tile", SMALL_TILES, id="multi-tile-16-tiles")]


def _offs(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def _per_group(a: torch.Tensor, b: torch.Tensor, sizes: list[int], dtype: torch.dtype) -> torch.Tensor:
    """out[s] = a[s] @ b[group of s], one matmul a group, at ``dtype`` (rows past the groups: zeros)."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=dtype)
    start = 0
    for e, n in enumerate(sizes):
        out[start:start + n] = a[start:start + n].to(dtype) @ b[e].to(dtype)
        start += n
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,tiles", TILED)
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered"])
@pytest.mark.parametrize("b_layout", ["kn", "nk-transposed"])
def test_grouped_mm_matches_per_group_matmuls(dtype, groups, gather, b_layout, tiles, device):
    sizes = GROUPS[groups]
    g = torch.Generator().manual_seed(len(sizes))
    n_rows, n_k, n_n = sum(sizes), 37, 45
    if b_layout == "kn":
        b = torch.randn(len(sizes), n_k, n_n, generator=g)
    else:  # the experts' [E, N, K] weight used as W^T, a view
        b = torch.randn(len(sizes), n_n, n_k, generator=g).transpose(1, 2)
    if gather:  # T = 9 tokens, each read by several rows (as top-k assignments sorted by expert)
        source = torch.randn(9, n_k, generator=g)
        rows = torch.randint(0, 9, (n_rows,), generator=g)
        a = source[rows]
    else:
        source, rows = torch.randn(n_rows, n_k, generator=g), None
        a = source
    out = grouped_mm(source.to(device, dtype), b.to(device, dtype), _offs(sizes).to(device),
                     rows.to(device) if rows is not None else None, config=tiles).cpu()
    assert out.shape == (n_rows, n_n) and out.dtype == dtype
    eager = _per_group(a.to(dtype), b.to(dtype), sizes, dtype)
    reference = _per_group(a.to(dtype), b.to(dtype), sizes, torch.float64)
    assert_close("grouped_mm", out, eager, reference)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_mm_with_rows_past_the_last_group(dtype, device):
    # offs[-1] < S: the groups' rows are right (the rest, like torch._grouped_mm's, are left unspecified).
    a = torch.randn(10, 16, dtype=dtype)
    b = torch.randn(2, 16, 24, dtype=dtype)
    offs = torch.tensor([3, 7], dtype=torch.int32)
    out = grouped_mm(a.to(device), b.to(device), offs.to(device)).cpu()
    reference = _per_group(a, b, [3, 4], torch.float64)
    assert_close("grouped_mm", out[:7], _per_group(a, b, [3, 4], dtype)[:7], reference[:7])


def test_strided_index_vectors_are_read_as_given(device):
    # offs and rows as strided views (every other element of a longer vector): read through their strides.
    g = torch.Generator().manual_seed(5)
    sizes = [4, 0, 6, 3]
    offs_view = torch.stack([_offs(sizes), torch.full((4,), 10 ** 6, dtype=torch.int32)], 1).reshape(-1)[::2]
    source = torch.randn(7, 16, generator=g)
    rows = torch.randint(0, 7, (26,), generator=g)
    rows_view = rows[::2]
    b = torch.randn(4, 16, 24, generator=g)
    out = grouped_mm(source.to(device), b.to(device), offs_view.to(device), rows_view.to(device)).cpu()
    reference = _per_group(source[rows_view], b, sizes, torch.float64)
    assert_close("grouped_mm", out, _per_group(source[rows_view], b, sizes, torch.float32), reference)
    left, right = torch.randn(13, 8, generator=g), torch.randn(13, 12, generator=g)
    weight = grouped_mm_weight(left.to(device), right.to(device), offs_view.to(device)).cpu()
    start = 0
    for e, n in enumerate(sizes):
        torch.testing.assert_close(weight[e], left[start:start + n].t() @ right[start:start + n], atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,tiles", TILED)
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_grouped_mm_weight_matches_per_group_sums(dtype, groups, layout, tiles, device):
    sizes = GROUPS[groups]
    g = torch.Generator().manual_seed(7 + len(sizes))
    n_rows, n_k, n_n = sum(sizes), 29, 35
    left = torch.randn(n_rows, n_k, generator=g).to(dtype)
    right = torch.randn(n_rows, n_n, generator=g).to(dtype)
    on_device = [t.to(device) for t in (left, right)]
    if layout == "columns":  # column-major operands (a transpose's view; the op's own are row-major)
        on_device = [t.t().contiguous().t() for t in on_device]
    out = grouped_mm_weight(*on_device, _offs(sizes).to(device), config=tiles).cpu()
    assert out.shape == (len(sizes), n_k, n_n) and out.dtype == dtype

    def sums(dt):
        result, start = torch.zeros(len(sizes), n_k, n_n, dtype=dt), 0
        for e, n in enumerate(sizes):
            result[e] = left[start:start + n].to(dt).t() @ right[start:start + n].to(dt)
            start += n
        return result

    assert_close("grouped_mm_weight", out, sums(dtype), sums(torch.float64))
    for e, n in enumerate(sizes):
        if n == 0:  # an expert no token reached gets an exactly zero gradient
            assert not out[e].any()


def test_grouped_mm_agrees_with_torch_grouped_mm(device):
    # Where torch's CPU kernel runs (torch >= 2.9, 16-byte rows): the same products in fp32.
    if not hasattr(torch, "_grouped_mm") or device != "cpu":
        pytest.skip("torch._grouped_mm's fp32 kernel is its CPU one (torch >= 2.9); the GPU's is tested in bf16 by "
                    "tests/test_cuda_ops.py")
    g = torch.Generator().manual_seed(3)
    sizes = [4, 0, 11, 6]
    a, b = torch.randn(21, 32, generator=g), torch.randn(4, 32, 48, generator=g)
    ours, theirs = grouped_mm(a, b, _offs(sizes)), torch._grouped_mm(a, b, offs=_offs(sizes))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    left, right = torch.randn(21, 32, generator=g), torch.randn(21, 40, generator=g)
    torch.testing.assert_close(grouped_mm_weight(left, right, _offs(sizes)),
                               torch._grouped_mm(left.t(), right, offs=_offs(sizes)), atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_named():
    a, b = torch.randn(4, 8), torch.randn(2, 8, 8)
    with pytest.raises(TypeError, match="one dtype"):
        grouped_mm(a, b.bfloat16(), _offs([2, 2]))
    with pytest.raises(TypeError, match="offs"):
        grouped_mm(a, b, torch.tensor([2.0, 4.0]))
    with pytest.raises(ValueError, match="offs"):
        grouped_mm(a, b, _offs([4]))
    with pytest.raises(ValueError, match="row count"):
        grouped_mm_weight(a, torch.randn(5, 8), _offs([2, 2]))


@pytest.mark.parametrize("weight_form", [False, True], ids=["rows", "weight"])
def test_tiles_fit_the_devices_shared_memory(weight_form):
    # The H100's 227 KiB takes the measured tiles as they are; an A100's 163 and an L4's 99 get fewer stages, then
    # narrower tiles, until the pipelined operand tiles fit (a setting that does not fit fails at launch).
    tiles = _WEIGHT_TILES if weight_form else _ROW_TILES
    assert _fitted(tiles, 227 << 10, 2, weight_form) == tiles
    for limit in (163 << 10, 99 << 10, 48 << 10):
        fitted = _fitted(tiles, limit, 2, weight_form)
        m, n, k = fitted["BLOCK_M"], fitted["BLOCK_N"], fitted["BLOCK_K"]
        need = fitted["num_stages"] * ((k * m + m * n) if weight_form else (m * k + k * n)) * 2
        assert need <= limit and fitted["num_stages"] >= 2, (limit, fitted)
    assert _fitted(_ROW_TILES, 99 << 10, 2, False)["num_stages"] == 2  # 96 KiB in two stages
    assert _fitted(_ROW_TILES, 48 << 10, 2, False)["BLOCK_N"] < _ROW_TILES["BLOCK_N"]


def test_tiles_narrow_to_a_rank_wide_output(monkeypatch):
    # A LoRA factor's products are rank r wide: the tile is narrowed to them (16 columns, not 256 of which 240 are
    # zeros), and the weight form's output rows too.
    import sloth.lowering.grouped_gemm as grouped_gemm

    monkeypatch.setattr(grouped_gemm, "_shared_memory", lambda index: 227 << 10)
    config = grouped_gemm._cuda_config.__wrapped__
    assert config(0, torch.bfloat16, False, 16, 0)["BLOCK_N"] == 16
    assert config(0, torch.bfloat16, False, 256, 0) == _ROW_TILES  # _config caps the width at 256
    weight = config(0, torch.bfloat16, True, 16, 16)
    assert weight["BLOCK_N"] == 16 and weight["BLOCK_K"] == 16
    assert config(0, torch.bfloat16, True, 256, 256) == _WEIGHT_TILES
