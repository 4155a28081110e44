"""A family of one's own (compiler/families.py), the graph dumps (compiler/dump.py) and the pass times.

The toy family below is docs/extending.md's example, verbatim between the two marker lines (a test checks that
the page holds the same text): it fuses a logit soft-cap, ``cap * tanh(x / cap)``, into a custom op of its own
registered with torch.library, and is registered after sloth's GLU family.
"""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn as nn

import sloth
from sloth.compiler import families as registry
from test_completeness import EveryFamily, every_family_inputs

# --- docs example begins
import torch
import torch.fx as fx
import sloth


@torch.library.custom_op("toy::softcap", mutates_args=())
def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), one op (in real life a fused kernel)."""
    return cap * torch.tanh(x / cap)


softcap.register_fake(lambda x, cap: torch.empty_like(x))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.cap = inputs[1]


def _backward(ctx, grad):  # d/dx cap * tanh(x / cap) = 1 - tanh(x / cap)^2
    t = torch.tanh(ctx.saved_tensors[0] / ctx.cap)
    return grad * (1 - t * t), None


softcap.register_autograd(_backward, setup_context=_setup)


def is_call(node, target):
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def softcap_parts(node):
    """(x, cap) if ``node`` is cap * tanh(x / cap) in sloth's canonical graph (torch.mul/div/tanh), else None."""
    if not is_call(node, torch.mul):
        return None
    cap, tanh = node.args if isinstance(node.args[0], (int, float)) else node.args[::-1]
    if not (isinstance(cap, (int, float)) and is_call(tanh, torch.tanh) and is_call(tanh.args[0], torch.div)):
        return None
    x, divisor = tanh.args[0].args
    return (x, float(cap)) if divisor == cap else None


def fuse_softcap(gm, example_inputs, *, report, options):
    for node in [n for n in gm.graph.nodes if softcap_parts(n)]:
        (x, cap), tanh = softcap_parts(node), next(a for a in node.args if isinstance(a, fx.Node))
        if len(tanh.users) > 1 or len(tanh.args[0].users) > 1:
            report.reject("softcap", node, "tanh(x / cap) is also read elsewhere")
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(torch.ops.toy.softcap, (x, cap))
        fused.meta = dict(node.meta)  # shape, dtype and source line, for the passes after this one
        node.replace_all_uses_with(fused)
        for dead in (node, tanh, tanh.args[0]):
            gm.graph.erase_node(dead)
        report.replaced_at("softcap", fused, "toy.softcap", f"cap={cap}")
    gm.recompile()
    return gm


def is_softcap(node):  # the anchor: every site the family should either replace or explain
    return softcap_parts(node) is not None


sloth.register_family("softcap", fuse_softcap, anchor=is_softcap, after="glu")
# --- docs example ends
sloth.unregister_family("softcap")  # registered only while this file's tests run (the fixture below), so the
#                                     rest of the suite, in the same worker process, sees the built-in families


@pytest.fixture(autouse=True, scope="module")
def _softcap_registered():
    sloth.register_family("softcap", fuse_softcap, anchor=is_softcap, after="glu")
    yield
    sloth.unregister_family("softcap")


class Capped(nn.Module):
    """Two soft-capped projections (the forms Gemma 2 uses on attention scores and logits), the second
    with its tanh also read elsewhere, so the family must say why it left it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(12, 20)
        self.out = nn.Linear(20, 7)

    def forward(self, x):
        h = 30.0 * torch.tanh(self.proj(x) / 30.0)
        t = torch.tanh(self.out(h) / 5.0)
        return torch.mul(t, 5.0), t.sum()


def _inputs():
    return (torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(0), requires_grad=True),)


def _loss(outputs):
    capped, extra = outputs
    return (capped * torch.linspace(-1, 1, capped.shape[-1])).sum() + extra


def test_docs_hold_the_example_verbatim():
    text = open(__file__).read()
    example = text.split("# --- docs example begins\n")[1].split("# --- docs example ends\n")[0]
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "extending.md")).read()
    assert example in page, "docs/extending.md's example differs from tests/test_extension.py's"


def test_registered_family_runs_in_its_place():
    assert sloth.families().index("softcap") == sloth.families().index("glu") + 1
    assert "softcap" not in sloth.FAMILIES  # the built-in ones
    assert [p.name for p in registry.family_passes() if p.builtin] == list(sloth.FAMILIES)


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_toy_family_matches_reports_and_equals_eager(inner):
    model = Capped()
    (x,) = _inputs()
    expected = model(x)
    _loss(expected).backward()
    want_x, want_w = x.grad.clone(), model.proj.weight.grad.clone()
    x.grad = None
    model.zero_grad()

    got = torch.compile(model, backend="sloth", options={"inner": inner})(x)
    _loss(got).backward()
    report = sloth.report()
    assert report.counts.get("softcap") == 1, str(report)
    [site] = [s for s in report.sites if s.family == "softcap"]
    assert site.op == "toy.softcap" and site.detail == "cap=30.0"
    assert site.module == "" and "torch.tanh(self.proj(x) / 30.0)" in site.source  # Capped.forward's own line
    [rejection] = [r for r in report.rejections if r.family == "softcap"]
    assert "also read elsewhere" in rejection.reason
    assert "softcap" in report.pass_seconds and report.pass_seconds["softcap"] >= 0.0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    torch.testing.assert_close(x.grad, want_x)
    torch.testing.assert_close(model.proj.weight.grad, want_w)


def test_toy_family_switched_off_by_name():
    model = Capped()
    (x,) = _inputs()
    others = [f for f in sloth.families() if f != "softcap"]
    got = torch.compile(model, backend="sloth", options={"inner": "eager", "patterns": others})(x)
    report = sloth.report()
    assert "softcap" not in report.counts and "softcap" in report.disabled, str(report)
    assert not any(r.family == "softcap" for r in report.rejections)
    torch.testing.assert_close(got[0], model(x)[0])


def test_toy_family_in_explain():
    report = sloth.explain(Capped(), *_inputs())
    assert report.counts.get("softcap") == 1, str(report)


@pytest.mark.unexplained_sites
def test_a_registered_family_that_says_nothing_is_caught():
    sloth.register_family("silent_cap", lambda gm, example_inputs, *, report, options: gm,
                          anchor=is_softcap, before="softcap")
    try:
        others = [f for f in sloth.families() if f != "softcap"]
        torch.compile(Capped(), backend="sloth", options={"inner": "eager", "patterns": others})(*_inputs())
    finally:
        sloth.unregister_family("silent_cap")
    report = sloth.report()
    assert list(report.unexplained) == ["silent_cap"] and report.anchors_left["silent_cap"] == 2, str(report)
    assert "silent_cap" not in sloth.families()


def _noop(gm, example_inputs, *, report, options):
    return gm


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(name="rms_norm"), ValueError, "already a built-in family"),
    (dict(name="softcap"), ValueError, "already a family registered earlier"),
    (dict(name="canonicalize"), ValueError, "pipeline's own passes"),
    (dict(name="lean_backward"), ValueError, "pipeline's own passes"),  # a post-grad pass's name (late_passes.py)
    (dict(name="not a name"), ValueError, "identifier"),
    (dict(after="no_such_family"), ValueError, "after='no_such_family' is not a registered family"),
    (dict(before="no_such_family"), ValueError, "before='no_such_family' is not a registered family"),
    (dict(before="glu", after="rope"), ValueError, "not both"),
    (dict(run=lambda gm: gm), TypeError, r"must take \(gm, example_inputs, \*, report, options\)"),
    (dict(run=lambda gm, example_inputs, report: gm), TypeError, "must take"),
    (dict(run="fuse_it"), TypeError, "must be callable"),
    (dict(anchor=3), TypeError, "anchor"),
])
def test_bad_registration_is_refused_with_a_reason(kwargs, error, message):
    before = sloth.families()
    arguments = dict(name="mine", run=_noop)
    arguments.update(kwargs)
    name, run = arguments.pop("name"), arguments.pop("run")
    with pytest.raises(error, match=message):
        sloth.register_family(name, run, **arguments)
    assert sloth.families() == before


def test_unregister_refuses_builtin_and_unknown():
    with pytest.raises(ValueError, match="built-in family"):
        sloth.unregister_family("glu")
    with pytest.raises(ValueError, match="no family 'nothing' is registered"):
        sloth.unregister_family("nothing")


def test_pass_that_returns_something_else_is_named():
    sloth.register_family("returns_none", lambda gm, example_inputs, *, report, options: None)
    try:
        with pytest.raises(Exception, match="'returns_none' pass returned NoneType"):
            torch.compile(Capped(), backend="sloth", options={"inner": "eager"})(*_inputs())
    finally:
        sloth.unregister_family("returns_none")


def _stages(folder):
    return sorted(f for f in os.listdir(folder))


def test_dumps_show_each_pass_that_changed_the_graph(tmp_path):
    model = EveryFamily()
    torch.compile(model, backend="sloth", options={"inner": "eager", "dump": str(tmp_path)})(*every_family_inputs())
    report = sloth.report()
    [folder] = report.dumps
    assert os.path.dirname(folder) == str(tmp_path) and re.fullmatch(r"graph_\d+_\d+", os.path.basename(folder))
    assert f"graphs dumped to: {folder}" in str(report)
    changed = ["canonicalize", "layer_norm", "rms_norm", "l2_norm", "rope", "moe_route", "moe_router", "glu",
               "cross_entropy", "token_logprobs", "lora", "packed_attention", "causal_mask", "sink_attention",
               "gqa_attention"]  # not softcap
    expected = ["00_before.py"] + [f"{i:02d}_{stage}.{ext}" for i, stage in enumerate(changed, 1)
                                   for ext in ("diff", "py")]
    assert _stages(folder) == sorted(expected)
    read = lambda name: open(os.path.join(folder, name)).read()  # noqa: E731
    assert "scaled_dot_product_attention(q_1, k_1, v, attn_mask = mask)" in read("00_before.py")
    ops = {"layer_norm": "sloth.layer_norm", "rms_norm": "sloth.rms_norm", "l2_norm": "sloth.l2_norm",
           "rope": "sloth.rope", "moe_route": "sloth.moe_experts",
           "moe_router": "sloth.moe_router", "glu": "sloth.glu",
           "cross_entropy": "sloth.linear_cross_entropy", "token_logprobs": "sloth.linear_token_logprobs",
           "lora": "sloth.lora_linear",
           "packed_attention": "sloth.document_attention", "causal_mask": "is_causal = True",
           "sink_attention": "sloth.sink_attention", "gqa_attention": "enable_gqa = True"}
    for i, stage in enumerate(changed[1:], 2):
        diff = read(f"{i:02d}_{stage}.diff")
        added = [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
        assert any(ops[stage] in line for line in added), (stage, diff)
        assert f"--- {i - 1:02d}_{changed[i - 2]}.py" in diff
    assert "torch.ops.sloth" not in read("01_canonicalize.py")


def test_dumps_from_the_environment_and_for_explain(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOTH_DUMP_DIR", str(tmp_path))
    report = sloth.explain(Capped(), *_inputs())
    [folder] = report.dumps
    stages = _stages(folder)
    assert "00_before.py" in stages and any(s.endswith("_softcap.diff") for s in stages), stages
    assert "toy.softcap" in open(os.path.join(folder, [s for s in stages if s.endswith("_softcap.py")][0])).read()


def test_dump_off_by_default_and_bad_value(tmp_path, monkeypatch):
    monkeypatch.delenv("SLOTH_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    torch.compile(Capped(), backend="sloth", options={"inner": "eager"})(*_inputs())
    assert sloth.report().dumps == [] and os.listdir(tmp_path) == []
    with pytest.raises(Exception, match="dump must be a folder path"):
        torch.compile(Capped(), backend="sloth", options={"inner": "eager", "dump": 3})(*_inputs())


def test_pass_times_cover_every_pass_that_ran():
    torch.compile(EveryFamily(), backend="sloth", options={"inner": "eager"})(*every_family_inputs())
    seconds = sloth.report().pass_seconds
    assert set(seconds) == {"canonicalize", *sloth.families(), "anchors", "recompute"}, seconds
    assert all(s >= 0.0 for s in seconds.values())
