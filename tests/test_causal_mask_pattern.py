"""The causal-mask family: an SDPA mask proven causal at compile time becomes ``is_causal=True``; any other
mask stays, with the reason in the report."""
from __future__ import annotations

import unittest.mock

import pytest
import torch
import torch.nn.functional as F
import transformers
import transformers.masking_utils
from torch import nn

import sloth
from sloth.patterns import causal_mask, mask_rows
from sloth.runtime import proven_masks
from sloth.patterns.causal_mask import causal_mask_pattern, causal_reason, causal_reference
from tests.pattern_checks import forward_backward, graph_of, seeded
from tests.test_models import VOCAB, assert_model_close, build, loss_and_grads, tiny_config
from tests.tolerance import assert_close
from checkpointing import enable_checkpointing

B, H, L, D = 2, 3, 7, 8  # odd sizes: a transposed or shifted mask cannot pass by symmetry


def _sdpa_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


# Causal masks as hand-written models spell them: each (q, k, v) -> attention output.
def tril_bool(q, k, v):
    mask = torch.tril(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def triu_neg_inf(q, k, v):
    mask = torch.full((q.shape[-2], k.shape[-2]), float("-inf"), device=q.device).triu(1)
    return F.scaled_dot_product_attention(q, k, v, mask.to(q.dtype))  # positional attn_mask


def arange_compare(q, k, v):
    i = torch.arange(q.shape[-2], device=q.device)
    j = torch.arange(k.shape[-2], device=q.device)
    mask = (j[None, None, None, :] <= i[None, None, :, None]).expand(q.shape[0], 1, -1, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)


def finfo_min_fill(q, k, v):
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=0.3)


def shorter_queries_top_left(q, k, v):
    """L < S, masked top-left as torch's is_causal is: the mask is exactly torch's, so it is replaced."""
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


CAUSAL_FORMS = [tril_bool, triu_neg_inf, arange_compare, finfo_min_fill]


def _qkv(dtype: torch.dtype, kv_len: int = L) -> list[torch.Tensor]:
    g = seeded(0)
    return [torch.randn(B, H, L, D, generator=g).to(dtype), torch.randn(B, H, kv_len, D, generator=g).to(dtype),
            torch.randn(B, H, kv_len, D, generator=g).to(dtype)]


def _assert_causal_rewrite(fn, args) -> None:
    sloth.reset_report()
    gm = graph_of(fn, *args)
    (node,) = _sdpa_nodes(gm)
    assert node.kwargs.get("is_causal") is True and node.kwargs.get("attn_mask") is None \
        and (len(node.args) <= 3 or node.args[3] is None), node.format_node()
    # The mask's producers are gone (nothing else read them).
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch.tril, torch.ones,
                                                                                      torch.full, torch.arange)]
    assert sloth.report().counts == {"causal_mask": 1}, str(sloth.report())


@pytest.mark.parametrize("fn", CAUSAL_FORMS + [shorter_queries_top_left], ids=lambda f: f.__name__)
def test_causal_masks_become_is_causal(fn) -> None:
    args = _qkv(torch.float32, kv_len=11 if fn is shorter_queries_top_left else L)
    _assert_causal_rewrite(fn, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", CAUSAL_FORMS, ids=lambda f: f.__name__)
def test_rewritten_attention_matches_masked_forward_and_gradients(fn, dtype: torch.dtype) -> None:
    """Output and q/k/v gradients of the compiled (is_causal) form against the masked pattern, fp64 reference."""
    args = _qkv(dtype)
    compiled = torch.compile(fn, backend="sloth", options={"inner": "aot_eager"}, fullgraph=True)
    ours = forward_backward(compiled, args, [])
    eager = forward_backward(fn, args, [])
    reference = forward_backward(fn, [a.double() for a in args], [], dy_dtype=dtype)
    assert sloth.report().counts == {"causal_mask": 1}, str(sloth.report())
    for name, a, e, r in zip(["out", "dq", "dk", "dv"], ours, eager, reference):
        assert_close(name, a, e, r)


def test_pattern_function_is_the_masked_attention() -> None:
    q, k, v = _qkv(torch.float64)
    mask = causal_reference(L, L)
    torch.testing.assert_close(causal_mask_pattern(q, k, v, mask), F.scaled_dot_product_attention(q, k, v,
                                                                                                  is_causal=True))


# Near misses: the mask stays, and the report says why.
def sliding_window(q, k, v):
    ones = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ones.tril() & ones.triu(-2))


def one_future_token(q, k, v):
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def alibi_bias(q, k, v):
    i = torch.arange(q.shape[-2], device=q.device)
    distance = (i[None, :] - i[:, None]).to(q.dtype)
    bias = torch.where(distance <= 0, 0.5 * distance, torch.tensor(float("-inf"), dtype=q.dtype))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def bottom_right_shorter_queries(q, k, v):
    """L < S masked bottom-right (a KV cache's alignment): not torch's top-left is_causal."""
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - q.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def prefix_lm(q, k, v):
    j = torch.arange(k.shape[-2], device=q.device)
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril() | (j < 3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def prefix_lm_in_place(q, k, v):
    """The mask node is the tril; the setitem writes into it afterwards (evaluating the tril alone would pass)."""
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    mask[:, :3] = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal_then_view_written(q, k, v):
    """Written through a view of the mask: the aliasing is seen through the example values' storage."""
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    mask.view(-1)[1] = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@torch.library.custom_op("sloth_test::open_prefix", mutates_args=("mask",))
def open_prefix(n: int, mask: torch.Tensor) -> None:
    """A mutable custom op writing its second argument."""
    mask[:, :n] = True


@open_prefix.register_fake
def _(n, mask):
    return None


def written_by_custom_op(q, k, v):
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    torch.ops.sloth_test.open_prefix(3, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _widen(x, mask):
    mask[:, :3] = True
    return x * 2


def written_inside_checkpointed_body(q, k, v):
    """The body writes the mask; the top-level attention reads it afterwards."""
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    q2 = torch.utils.checkpoint.checkpoint(_widen, q, mask, use_reentrant=False)
    return F.scaled_dot_product_attention(q2, k, v, attn_mask=mask)


def random_but_all_true(q, k, v):
    """Causal in value, but a random draw: one evaluation would freeze it and skip the generator's advance."""
    mask = (torch.rand(q.shape[-2], k.shape[-2], device=q.device) < 2.0).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("fn, kv_len, reason", [
    (sliding_window, L, "not the causal mask"),
    (one_future_token, L, "not the causal mask"),
    (prefix_lm, L, "not the causal mask"),
    (prefix_lm_in_place, L, "in place"),
    (causal_then_view_written, L, "in place"),
    (written_by_custom_op, L, "in place"),
    (written_inside_checkpointed_body, L, "in place"),
    (random_but_all_true, L, "random"),
    (alibi_bias, L, "additive bias"),
    (bottom_right_shorter_queries, 11, "not the causal mask"),
], ids=lambda p: getattr(p, "__name__", None) or str(p)[:12])
def test_other_masks_stay_with_reason(fn, kv_len: int, reason: str) -> None:
    args = _qkv(torch.float32, kv_len)
    sloth.reset_report()
    gm = graph_of(fn, *args)
    (node,) = _sdpa_nodes(gm)
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    assert isinstance(mask, torch.fx.Node) and not node.kwargs.get("is_causal"), node.format_node()
    report = sloth.report()
    assert report.counts.get("causal_mask", 0) == 0
    (rejection,) = [r for r in report.rejections if r.family == "causal_mask"]
    assert reason in rejection.reason, rejection.reason
    # The compiled function still computes what the pattern does.
    compiled = torch.compile(fn, backend="sloth", options={"inner": "eager"})
    torch.testing.assert_close(compiled(*args), fn(*args))


def _attend_in_body(q, k, v, mask):
    mask[:, :3] = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_checkpointed_body_writing_its_mask_keeps_it() -> None:
    """The caller passes a causal mask, but the body widens it before attending: not replaced, and the result is
    the pattern's."""
    def fn(q, k, v):
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        return torch.utils.checkpoint.checkpoint(_attend_in_body, q, k, v, mask, use_reentrant=False)

    args = _qkv(torch.float32)
    sloth.reset_report()
    out = torch.compile(fn, backend="sloth", options={"inner": "eager"})(*args)
    assert sloth.report().counts.get("causal_mask", 0) == 0, str(sloth.report())
    torch.testing.assert_close(out, fn(*args))


def test_query_and_key_by_keyword() -> None:
    def fn(q, k, v):
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=mask)

    args = _qkv(torch.float32)
    sloth.reset_report()
    graph_of(fn, *args)
    assert sloth.report().counts == {"causal_mask": 1}, str(sloth.report())


def test_mask_from_an_input_stays() -> None:
    args = _qkv(torch.float32)
    mask = causal_reference(L, L)  # causal in value, but an input: the next call may pass another
    sloth.reset_report()
    graph_of(causal_mask_pattern, *args, mask)
    (rejection,) = sloth.report().rejections
    assert "graph input" in rejection.reason, rejection.reason


class BufferMask(nn.Module):
    """nanoGPT's registered causal buffer: lifted into a graph input by Dynamo, so it is not proven."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("causal", torch.ones(L, L, dtype=torch.bool).tril())

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.causal)


def test_buffer_mask_stays() -> None:
    sloth.reset_report()
    graph_of(BufferMask(), *_qkv(torch.float32))
    assert sloth.report().counts.get("causal_mask", 0) == 0
    assert [r.family for r in sloth.report().rejections] == ["causal_mask"], str(sloth.report())


def test_dynamic_lengths_stay_with_reason() -> None:
    sloth.reset_report()
    compiled = torch.compile(tril_bool, backend="sloth", options={"inner": "eager"}, dynamic=True)
    args = _qkv(torch.float32)
    torch.testing.assert_close(compiled(*args), tril_bool(*args))
    report = sloth.report()
    assert report.counts.get("causal_mask", 0) == 0
    assert all("symbolic" in r.reason for r in report.rejections if r.family == "causal_mask") \
        and any(r.family == "causal_mask" for r in report.rejections), str(report)


def test_switched_off_by_name() -> None:
    sloth.reset_report()
    others = [f for f in sloth.FAMILIES if f != "causal_mask"]
    torch.compile(tril_bool, backend="sloth", options={"inner": "eager", "patterns": others})(*_qkv(torch.float32))
    report = sloth.report()
    assert report.counts.get("causal_mask", 0) == 0 and report.disabled == ["causal_mask"], str(report)


def test_causal_reason_checks_every_broadcast_slice() -> None:
    mask = causal_reference(L, L).expand(B, 1, L, L).clone()
    assert causal_reason(mask, L, L) is None
    mask[1, 0, 4, 5] = True  # one batch row sees one future key
    assert "not the causal mask" in causal_reason(mask, L, L)
    assert "does not end in" in causal_reason(causal_reference(L, L), L, L + 1)
    assert "neither bool nor" in causal_reason(causal_reference(L, L).int(), L, L)


def test_causal_reason_block_by_block(monkeypatch) -> None:
    # The check compares rows a block at a time (no full-size reference); blocks of 3 over 7 rows, last one short.
    monkeypatch.setattr(proven_masks, "_ROWS_PER_BLOCK", 3)
    assert causal_reason(causal_reference(L, L).expand(B, 1, L, L), L, L) is None
    assert causal_reason(causal_reference(L, L)[None, None, :, :], L, L) is None
    for row in range(L - 1):  # a future key seen in any block
        mask = causal_reference(L, L).clone()
        mask[row, row + 1] = True
        assert "not the causal mask" in causal_reason(mask, L, L), row
    mask = causal_reference(L, L).clone()
    mask[L - 1, 0] = False  # a past key hidden in the short last block
    assert "not the causal mask" in causal_reason(mask, L, L)


def flat_then_viewed(q, k, v):
    """Causal, but made flat and viewed as [L, S]: a view that merges dims is not evaluated by rows."""
    n, s = q.shape[-2], k.shape[-2]
    flat = torch.arange(n * s, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=((flat % s) <= (flat // s)).view(n, s))


@pytest.fixture
def rows_only(monkeypatch):
    """A 0-byte budget: every mask goes through the row-block evaluation (patterns/mask_rows.py), as a 128k x
    128k mask does on the device; blocks of 3 rows over B x 7 x 7 masks (the last block short)."""
    monkeypatch.setattr(causal_mask, "CPU_EVALUATION_BYTES", 0)
    monkeypatch.setattr(mask_rows, "ROW_BLOCK_ELEMENTS", 3 * B * L)


def test_mask_too_large_and_not_row_local_stays_with_reason(rows_only) -> None:
    # A mask whose evaluation would outgrow the budget and which cannot be made a block of rows at a time stays,
    # as a 128k x 128k mask would where its producers outgrow a quarter of the device's free memory.
    sloth.reset_report()
    args = _qkv(torch.float32)
    torch.testing.assert_close(torch.compile(flat_then_viewed, backend="sloth", options={"inner": "eager"})(*args),
                               flat_then_viewed(*args))
    report = sloth.report()
    assert report.counts.get("causal_mask", 0) == 0, str(report)
    [rejection] = [r for r in report.rejections if r.family == "causal_mask"]
    assert "would hold up to" in rejection.reason and "a block of rows at a time" in rejection.reason, rejection.reason
    assert "view" in rejection.reason, rejection.reason


def test_flat_then_viewed_is_causal_when_it_fits() -> None:
    # The near-miss above is refused only for its size: under the budget it is proven whole.
    _assert_causal_rewrite(flat_then_viewed, _qkv(torch.float32))


@pytest.mark.parametrize("fn", CAUSAL_FORMS + [shorter_queries_top_left], ids=lambda f: f.__name__)
@pytest.mark.parametrize("rows", [1, 3], ids=["rows1", "rows3"])
def test_causal_masks_proven_by_row_blocks(rows_only, monkeypatch, fn, rows: int) -> None:
    monkeypatch.setattr(mask_rows, "ROW_BLOCK_ELEMENTS", rows * B * L)
    _assert_causal_rewrite(fn, _qkv(torch.float32, 11 if fn is shorter_queries_top_left else L))


@pytest.mark.parametrize("fn, kv_len, reason", [
    (sliding_window, L, "not the causal mask"),
    (one_future_token, L, "not the causal mask"),
    (prefix_lm, L, "not the causal mask"),
    (alibi_bias, L, "additive bias"),
    (bottom_right_shorter_queries, 11, "not the causal mask"),
], ids=lambda p: getattr(p, "__name__", None) or str(p)[:12])
def test_other_masks_by_row_blocks_stay_with_reason(rows_only, fn, kv_len: int, reason: str) -> None:
    test_other_masks_stay_with_reason(fn, kv_len, reason)


def test_row_blocks_see_every_row() -> None:
    """The blocks of a [B, 1, L, S] mask are its rows in order; a mask wrong in one row of the last (short)
    block is caught there."""
    def build(q, k, v):
        i = torch.arange(q.shape[-2], device=q.device)
        j = torch.arange(k.shape[-2], device=q.device)
        hidden = (i == L - 1)[None, None, :, None] & (j == 0)[None, None, None, :]  # the last row misses key 0
        allowed = (j[None, None, None, :] <= i[None, None, :, None]) & ~hidden
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.expand(q.shape[0], 1, -1, -1))

    captured = {}

    def backend(graph, example_inputs):
        captured["gm"] = graph
        return graph

    torch.compile(build, backend=backend)(*_qkv(torch.float32))
    gm = captured["gm"]
    (sdpa,) = _sdpa_nodes(gm)
    mask = sdpa.kwargs.get("attn_mask", sdpa.args[3] if len(sdpa.args) > 3 else None)
    producers, why_not = causal_mask._closed_producers(mask)
    assert why_not is None
    whole = causal_mask._evaluate(gm, producers, mask)
    for rows in (1, 3, L):
        with unittest.mock.patch.object(mask_rows, "ROW_BLOCK_ELEMENTS", rows * B * L):
            plan, why_not = mask_rows.RowBlocks.build(producers, mask)
            assert why_not is None and plan.rows == rows
            blocks = list(plan.blocks())
        assert [r0 for r0, _ in blocks] == list(range(0, L, rows))
        assert torch.equal(torch.cat([b for _, b in blocks], dim=-2), whole)
        assert "not the causal mask" in causal_mask.causal_reason_by_rows(plan, L, L)


# transformers up to 5.17 builds the causal mask whenever Dynamo traces (its _ignore_causal_mask_sdpa says no
# under tracing); 5.24 passes is_causal itself when there is no padding mask. Reproduced here by patching.
@pytest.fixture
def transformers_517_masks(monkeypatch):
    monkeypatch.setattr(transformers.masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)


@pytest.mark.parametrize("model_type, checkpointing", [
    ("llama", False), ("llama", True), ("qwen3", False), ("mistral", False), ("phi3", False),
    ("gemma3_text", False), ("olmo2", False), ("starcoder2", False)],
    ids=lambda p: {True: "checkpointed", False: "plain"}.get(p, p) if isinstance(p, bool) else p)
def test_transformers_materialised_causal_mask(transformers_517_masks, model_type: str, checkpointing: bool) -> None:
    """Every layer's SDPA gets is_causal (checkpointed layers receive the mask from the top-level graph), and
    the loss and every gradient agree with eager under the whole-model tolerance rule."""
    model = build(model_type, torch.float32)
    if checkpointing:
        enable_checkpointing(model, use_reentrant=False)
    model.train()
    ids = torch.randint(3, VOCAB, (2, 11), generator=seeded(1))
    sloth.reset_report()
    compiled = torch.compile(model, backend="sloth", options={"inner": "aot_eager"})
    ours = loss_and_grads(model, ids, compiled)
    eager = loss_and_grads(model, ids)
    reference = loss_and_grads(model.double(), ids)
    model.float()
    report = sloth.report()
    assert report.counts.get("causal_mask") == model.config.num_hidden_layers, str(report)
    assert not [r for r in report.rejections if r.family == "causal_mask"], str(report)
    assert_model_close(ours, eager, reference, torch.float32)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_transformers_causal_mask_proven_by_row_blocks(transformers_517_masks, rows_only, checkpointing: bool) -> None:
    """transformers 5.17's mask, past the budget (as at 128k tokens on the H200), is proven a block of rows at a
    time: every layer gets is_causal."""
    test_transformers_materialised_causal_mask(None, "llama", checkpointing)


def test_sliding_window_layers_keep_their_mask(transformers_517_masks) -> None:
    """Gemma3 with a 4-token window over 11 tokens: the sliding layer's mask is not causal and stays (with the
    reason), the full-attention layer's becomes is_causal; the loss still equals eager's."""
    config = tiny_config("gemma3_text")
    config.sliding_window = 4
    config.layer_types = ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(3, VOCAB, (2, 11), generator=seeded(1))
    sloth.reset_report()
    loss = torch.compile(model, backend="sloth", options={"inner": "eager"})(input_ids=ids, labels=ids).loss
    report = sloth.report()
    assert report.counts.get("causal_mask") == 1, str(report)
    reasons = [r.reason for r in report.rejections if r.family == "causal_mask"]
    assert len(reasons) == 1 and "not the causal mask" in reasons[0], reasons
    torch.testing.assert_close(loss, model(input_ids=ids, labels=ids).loss)


def test_transformers_padding_mask_stays_with_reason(transformers_517_masks) -> None:
    """With an attention_mask passed (even all ones), the mask reads the input: kept, and the report says so."""
    model = build("llama", torch.float32)
    ids = torch.randint(3, VOCAB, (2, 11), generator=seeded(1))
    sloth.reset_report()
    torch.compile(model, backend="sloth", options={"inner": "eager"})(
        input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    reasons = [r.reason for r in sloth.report().rejections if r.family == "causal_mask"]
    assert len(reasons) == model.config.num_hidden_layers and all("graph input" in r for r in reasons), reasons


def test_row_blocks_read_dunder_methods_as_their_operators() -> None:
    # transformers 5.17's checkpointed graph on the H200 spelled a comparison as the method ``__eq__``; a method
    # or reflected dunder is the operator it stands for (``__rand__`` is ``and_``), an unknown name stays itself.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    names = {m: mask_rows._name(graph.call_method(m, (x, x))) for m in ("__eq__", "__rand__", "__or__", "__rsub__",
                                                                         "__matmul__", "expand")}
    assert names == {"__eq__": "eq", "__rand__": "and_", "__or__": "or_", "__rsub__": "sub", "__matmul__": "matmul",
                     "expand": "expand"}
    assert "matmul" not in mask_rows._ELEMENTWISE
