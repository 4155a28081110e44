"""The gqa_attention family: key and value heads repeated in place for SDPA are passed unrepeated with
``enable_gqa=True``; other repeats and the sites the guards refuse stay, with the reason in the report."""
from __future__ import annotations

import copy
import unittest.mock

import pytest
import torch
import torch.nn.functional as F
import transformers.integrations.sdpa_attention as sdpa_attention

import sloth
from sloth.patterns.gqa_attention import repeated_kv_pattern
from tests.pattern_checks import forward_backward, graph_of, seeded
from tests.test_models import VOCAB, assert_model_close, build, loss_and_grads
from tests.tolerance import assert_close

B, HQ, HK, L, D = 2, 6, 2, 7, 8  # odd sizes; 3 query heads per key head


def _sdpa_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


# Repeats as models spell them: each takes k [B, HK, L, D] to [B, HQ, L, D] with query head h reading key
# head h // 3.
def repeat_kv_getitem(x):  # transformers' repeat_kv
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, HQ // HK, s, d).reshape(b, h * (HQ // HK), s, d)


def unsqueeze_expand_flatten(x):
    return x.unsqueeze(2).expand(-1, -1, HQ // HK, -1, -1).flatten(1, 2)


def view_expand_view(x):
    b, h, s, d = x.shape
    return x.view(b, h, 1, s, d).expand(b, h, HQ // HK, s, d).contiguous().view(b, HQ, s, d)


def interleave(x):
    return torch.repeat_interleave(x, HQ // HK, dim=1)


def interleave_method_negative_dim(x):
    return x.repeat_interleave(HQ // HK, -3)


FORMS = [repeat_kv_getitem, unsqueeze_expand_flatten, view_expand_view, interleave, interleave_method_negative_dim]


def _attention(repeat, **kwargs):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, repeat(k), repeat(v), **kwargs)
    fn.__name__ = repeat.__name__
    return fn


def _qkv(dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    g = seeded(0)
    return [torch.randn(B, HQ, L, D, generator=g).to(device, dtype),
            torch.randn(B, HK, L, D, generator=g).to(device, dtype),
            torch.randn(B, HK, L, D, generator=g).to(device, dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("repeat", FORMS, ids=lambda f: f.__name__)
def test_repeated_heads_become_enable_gqa(repeat, is_causal, dtype, device):
    """Each spelling is rewritten (no repeat left, SDPA reads the key heads with enable_gqa) and the output and
    the gradients of q, k and v keep the tolerance rule against the fp64 pattern. On a GPU in fp32 torch has
    no fused kernel for grouped heads (flash and cuDNN take 16-bit only, the efficient kernel no groups): the
    site is refused there, with the reason."""
    fn = _attention(repeat, is_causal=is_causal)
    args = _qkv(dtype, device)
    sloth.reset_report()
    gm = graph_of(fn, *args)
    (node,) = _sdpa_nodes(gm)
    if device == "cuda" and dtype == torch.float32:
        assert not node.kwargs.get("enable_gqa")
        assert any("math kernel" in r.reason for r in sloth.report().rejections), str(sloth.report())
        return
    assert node.kwargs.get("enable_gqa") is True, node.format_node()
    assert [tuple(a.meta["example_value"].shape) for a in node.args[1:3]] == [(B, HK, L, D)] * 2
    assert not [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
                and ("expand" in str(n.target) or "repeat_interleave" in str(n.target))]
    assert sloth.report().counts == {"gqa_attention": 1}, str(sloth.report())

    compiled = torch.compile(fn, backend="sloth", fullgraph=True)
    ours = forward_backward(compiled, args, [])
    eager = forward_backward(fn, args, [])
    reference = forward_backward(lambda q, k, v: repeated_kv_pattern(q, k, v, HQ // HK, is_causal),
                                 [a.cpu().double() for a in args], [], dy_dtype=dtype)
    for name, a, e, r in zip(("out", "dq", "dk", "dv"), ours, eager, reference):
        assert_close(name, a.cpu(), e.cpu(), r)


def test_repeat_is_another_mapping_and_is_not_matched():
    """``k.repeat(1, G, 1, 1)`` gives query head h key head h % HK, not h // G: never enable_gqa."""
    def tiled(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat(1, HQ // HK, 1, 1), v.repeat(1, HQ // HK, 1, 1),
                                              is_causal=True)
    args = _qkv(torch.float32)
    sloth.reset_report()
    gm = graph_of(tiled, *args)
    (node,) = _sdpa_nodes(gm)
    assert not node.kwargs.get("enable_gqa")
    assert "gqa_attention" not in sloth.report().counts
    torch.testing.assert_close(torch.compile(tiled, backend="sloth")(*args), tiled(*args))


@pytest.mark.parametrize("case, reason", [
    ("mask", "keeps a mask"),
    ("dropout", "dropout"),
    ("value_only", "only one of key and value"),
])
def test_refused_sites_keep_their_repeats_with_a_reason(case, reason):
    """A site the guards refuse is left as it was and the report says why."""
    def fn(q, k, v, bias):
        if case == "mask":
            return F.scaled_dot_product_attention(q, repeat_kv_getitem(k), repeat_kv_getitem(v), attn_mask=bias)
        if case == "dropout":
            return F.scaled_dot_product_attention(q, repeat_kv_getitem(k), repeat_kv_getitem(v), dropout_p=0.25)
        return F.scaled_dot_product_attention(q, torch.cat([k] * (HQ // HK), 1), repeat_kv_getitem(v))
    args = _qkv(torch.float32) + [torch.randn(B, 1, L, L, generator=seeded(5))]
    sloth.reset_report()
    gm = graph_of(fn, *args)
    (node,) = _sdpa_nodes(gm)
    assert not node.kwargs.get("enable_gqa")
    report = sloth.report()
    assert "gqa_attention" not in report.counts
    assert any(r.family == "gqa_attention" and reason in r.reason for r in report.rejections), str(report)


def test_math_kernel_choice_is_refused():
    """Where torch would run grouped heads on its math kernel (which repeats them itself), the repeat stays."""
    fn = _attention(repeat_kv_getitem, is_causal=True)
    args = _qkv(torch.float32)
    sloth.reset_report()
    with unittest.mock.patch("torch._fused_sdp_choice", return_value=0):
        from sloth.patterns import gqa_attention
        gqa_attention._grouped_backend.cache_clear()
        try:
            gm = graph_of(fn, *args)
        finally:
            gqa_attention._grouped_backend.cache_clear()
    (node,) = _sdpa_nodes(gm)
    assert not node.kwargs.get("enable_gqa")
    assert any("math kernel" in r.reason for r in sloth.report().rejections), str(sloth.report())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_llama_with_transformers_repeat_kv(dtype):
    """transformers' own repeat_kv (the path it takes whenever it passes SDPA a mask, as 5.17 does under Dynamo;
    forced here): every layer's attention reads the key heads with enable_gqa, and the loss and every gradient
    keep the whole-model tolerance rule."""
    model = build("llama", dtype)
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with unittest.mock.patch.object(sdpa_attention, "use_gqa_in_sdpa", lambda *args, **kwargs: False):
        reference = loss_and_grads(copy.deepcopy(model).double(), ids)
        eager = loss_and_grads(model, ids)
        sloth.reset_report()
        ours = loss_and_grads(model, ids, run=torch.compile(model, backend="sloth"))
    assert sloth.report().counts.get("gqa_attention") == model.config.num_hidden_layers, str(sloth.report())
    assert_model_close(ours, eager, reference, dtype)
