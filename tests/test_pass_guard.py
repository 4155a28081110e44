"""A pass that raises cannot stop a compile (compiler/pass_guard.py).

A built-in family's pass is replaced by one that runs the real pass (so the graph is already rewritten) and
then raises: the step must run with eager's loss and gradients, the report must name the family and the error,
that family's sites must be reported with the error as their reason, and every other family must still replace
its site as it does with the family switched off. The same for canonicalisation (no family can run: every site reported) and the recompute pass.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import sloth
from sloth.compiler import families, pipeline
from test_completeness import EveryFamily, every_family_inputs

pytestmark = pytest.mark.pass_failure


class Boom(RuntimeError):
    pass


def _raise_after(run):
    def exploding(gm, example_inputs, *, report, options):
        run(gm, example_inputs, report=report, options=options)  # the graph is half sloth's now
        raise Boom("rows % 0")
    return exploding


def _step(run, model, inputs):
    loss = run(*inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def _assert_eager_numbers(compiled_model, model, inputs):
    want_loss, want_grads = _step(model, model, inputs)
    got_loss, got_grads = _step(compiled_model, model, inputs)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-5, msg=name)


# One family of each kind, to keep CI's time: a plain one, one that changes what a later family sees (moe_route:
# glu takes the experts' GLU without it), one that records returned logits in the graph's meta (cross_entropy),
# LoRA, and a whole-module pass that reaches into the bodies (packed_attention).
@pytest.mark.parametrize("family", ["rms_norm", "moe_route", "cross_entropy", "lora", "packed_attention"])
def test_a_family_whose_pass_raises_leaves_the_graph_as_it_found_it(monkeypatch, family):
    # The oracle for the other families' counts: the same compile with the family switched off by name (with
    # moe_route off, say, glu takes the experts' GLU too).
    model, inputs = EveryFamily(), every_family_inputs()
    others = [f for f in sloth.FAMILIES if f != family]
    torch.compile(model, backend="sloth", options={"inner": "eager", "patterns": others})(*inputs)
    without = sloth.report().counts
    torch._dynamo.reset()
    sloth.reset_report()
    passes = [dataclasses.replace(p, run=_raise_after(p.run)) if p.name == family else p
              for p in families.family_passes()]
    monkeypatch.setattr(families, "_registry", passes)
    _assert_eager_numbers(torch.compile(model, backend="sloth", options={"inner": "eager"}), model, inputs)
    report = sloth.report()
    assert report.failed == {family: "internal error: Boom: rows % 0"}, str(report)
    assert family not in report.counts, str(report)
    assert report.counts == without, str(report)
    reasons = {r.reason for r in report.rejections if r.family == family}
    assert reasons == {f"the {family} pass raised and was undone (internal error: Boom: rows % 0)"}, str(report)
    assert "passes that raised and were undone" in str(report) and not report.unexplained


def test_canonicalisation_that_raises_leaves_every_site_reported(monkeypatch):
    def exploding(gm, example_inputs, *, report, options):
        # Damage first, as a real bug would: the first call computes something else.
        next(n for n in gm.graph.nodes if n.op == "call_function").target = torch.neg
        raise Boom("no spelling")
    monkeypatch.setattr(pipeline, "canonicalize_pass", exploding)
    model, inputs = EveryFamily(), every_family_inputs()
    _assert_eager_numbers(torch.compile(model, backend="sloth", options={"inner": "aot_eager"}), model, inputs)
    report = sloth.report()
    assert report.failed == {"canonicalize": "internal error: Boom: no spelling"} and not report.counts, str(report)
    # The anchors read canonical spellings, so some sites (F.silu's, rotate-half's) are not seen on this graph.
    assert {"cross_entropy", "moe_route", "causal_mask", "layer_norm"} <= {r.family for r in report.rejections}
    assert all("canonicalisation failed" in r.reason for r in report.rejections), str(report)


def test_recompute_that_raises_keeps_the_families_sites(monkeypatch):
    def exploding(gm, example_inputs, *, report, options):
        raise Boom("tags")
    monkeypatch.setattr(pipeline, "recompute_pass", exploding)
    model, inputs = EveryFamily(), every_family_inputs()
    _assert_eager_numbers(torch.compile(model, backend="sloth", options={"inner": "aot_eager"}), model, inputs)
    report = sloth.report()
    assert report.failed == {"recompute": "internal error: Boom: tags"}, str(report)
    assert report.counts == {f: 1 for f in sloth.FAMILIES}, str(report)
