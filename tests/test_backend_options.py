"""The backend's ``attention`` option: SDPA's backend priority while the graph is traced (or run, uncompiled)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import sloth.compiler.backend as backend
from sloth.compiler.backend import sdpa_priority, sloth_backend


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _qkv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 8, 16, generator=gen) for _ in range(3)]


def _aten_targets(fn, args) -> set[str]:
    return {str(n.target) for n in make_fx(fn)(*args).graph.nodes if n.op == "call_function"}


def test_priority_decides_which_kernel_is_traced():
    # On the CPU SDPA picks its flash kernel by default; with only math allowed it decomposes.
    q, k, v = _qkv()
    default = _aten_targets(attention, (q, k, v))
    assert any("flash_attention" in t for t in default), default
    with sdpa_priority(["math"]):
        math_only = _aten_targets(attention, (q, k, v))
    assert not any("flash_attention" in t for t in math_only), math_only
    with sdpa_priority(None):
        assert _aten_targets(attention, (q, k, v)) == default


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_option_is_in_force_while_compiling_and_for_eager_while_running(monkeypatch, inner):
    seen = []
    original = backend.compile_inner

    def recording(gm, example_inputs, inner, mode=None, inductor_options=None, **kwargs):
        seen.append(("compile", torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        compiled = original(gm, example_inputs, inner, mode, inductor_options, **kwargs)

        def run(*args):
            seen.append(("run", torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
            return compiled(*args)

        return run

    monkeypatch.setattr(backend, "compile_inner", recording)
    q, k, v = _qkv()
    torch._dynamo.reset()
    out = torch.compile(attention, backend="sloth", options={"inner": inner, "attention": ["math"]})(q, k, v)
    torch.testing.assert_close(out, attention(q, k, v))
    assert seen[0] == ("compile", False, True)
    # Compiled graphs carry the choice; an uncompiled one runs under the priority again.
    assert seen[1] == (("run", False, True) if inner == "eager" else ("run", True, True))
    assert torch.backends.cuda.flash_sdp_enabled()  # restored afterwards


@pytest.mark.parametrize("value", ["flash", [], ["flash", "fa3"], [3]], ids=["string", "empty", "unknown", "int"])
def test_bad_attention_option_names_the_option(value):
    with pytest.raises(ValueError, match="attention"):
        sloth_backend(torch.fx.symbolic_trace(lambda t: t + 1), [torch.randn(2)], options={"attention": value})


def test_aot_cache_cannot_hand_back_a_graph_compiled_with_other_settings(monkeypatch, tmp_path):
    # AOTAutograd's cache key shows neither the SDPA priority nor sloth's recompute tags, so a graph compiled
    # with them must not be cached: here a later compile without the option must not get the math-only graph.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    q, k, v = (t.requires_grad_() for t in _qkv())
    counters = torch._dynamo.utils.counters
    hits = []
    for options in ({"attention": ["math"]}, {}):
        torch._dynamo.reset()
        counters.clear()
        torch.compile(attention, backend="sloth", options=options)(q, k, v).sum().backward()
        hits.append(counters["aot_autograd"]["autograd_cache_hit"])
    assert hits == [0, 0], hits
    # and the cache itself is on for graphs without such settings: the second compile again is a hit
    torch._dynamo.reset()
    counters.clear()
    torch.compile(attention, backend="sloth")(q, k, v).sum().backward()
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1


def test_the_report_times_every_pass_that_ran():
    # Compile-time accounting: each enabled family's pass, canonicalisation, the anchor check and the recompute
    # tagging have a non-negative time in the report; a disabled family has none.
    import sloth
    from test_completeness import EveryFamily, every_family_inputs

    torch.compile(EveryFamily(), backend="sloth", options={"inner": "eager", "patterns": ["rms_norm", "glu"]})(
        *every_family_inputs())
    report = sloth.report()
    assert set(report.pass_seconds) == {"canonicalize", "rms_norm", "glu", "anchors", "recompute"}, report.pass_seconds
    assert all(seconds >= 0.0 for seconds in report.pass_seconds.values())
    assert "sloth's passes took" in str(report) and "rms_norm" in str(report)
