"""The family declarations (compiler/families.py): each family declared once, in its patterns file, and what is built
from the declarations (the pipeline's order, the anchor check, docs/families.md's table) agrees with them.

A declaration that goes stale fails here: an op a family's modules put in graphs that no declaration lists, an
option they read that none lists, a listed op that is not registered, a docs table not rewritten.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import re

import pytest
import torch

import sloth
from sloth.compiler import families as registry
from sloth.compiler.options import PassOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECLARED = registry.declared_families()


def _source(package: str) -> dict[str, str]:
    root = importlib.import_module(package)
    return {info.name: open(os.path.join(root.__path__[0], f"{info.name}.py"), encoding="utf-8").read()
            for info in pkgutil.iter_modules(root.__path__)}


def test_the_pipeline_runs_the_declared_families_in_their_order():
    assert [f.name for f in DECLARED] == list(sloth.FAMILIES)
    assert [f.order for f in DECLARED] == sorted(f.order for f in DECLARED)
    builtin = [p for p in registry.family_passes() if p.builtin]
    assert [(p.name, p.run, p.anchor, p.whole_module) for p in builtin] == \
        [(f.name, f.run, f.anchor, f.whole_module) for f in DECLARED]


def test_every_declaration_has_an_anchor_that_says_what_it_finds_and_a_summary():
    for family in DECLARED:
        assert callable(family.anchor) and family.anchor.__doc__, family.name
        assert family.summary and "\n" not in family.summary, family.name


@pytest.mark.parametrize("name", registry.TABLE_FILES)
def test_the_family_tables_are_written_from_the_declarations(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        text = f.read()
    start = text.index(registry.TABLE_BEGIN) + len(registry.TABLE_BEGIN)
    assert text[start:text.index(registry.TABLE_END)] == "\n" + registry.family_table(), \
        f"{name}'s family table is stale: run python -m sloth.compiler.families"


def test_declared_ops_are_registered_and_every_op_the_patterns_insert_is_declared():
    for name, module in _source("sloth.lowering").items():
        lowering = importlib.import_module(f"sloth.lowering.{name}")
        for register in (getattr(lowering, "register", None), getattr(lowering, "register_4bit", None)):
            if callable(register):
                register()
    declared = {op for f in DECLARED for op in f.emits}
    for op in declared:
        assert hasattr(torch.ops.sloth, op), f"declared op sloth.{op} is not registered"
    inserted = {m for text in _source("sloth.patterns").values() for m in re.findall(r"torch\.ops\.sloth\.(\w+)", text)}
    # norm_rope's pass joins a q/k rms_norm pair the rms_norm family put in the graph (rope declares norm_rope)
    assert inserted <= declared, f"ops the patterns put in graphs that no family declares: {inserted - declared}"


def test_declared_options_exist_and_every_option_the_patterns_read_is_declared():
    fields = {f.name for f in dataclasses.fields(PassOptions)}
    declared = {r for f in DECLARED for r in f.reads}
    assert declared <= fields, declared - fields
    read = {m for text in _source("sloth.patterns").values() for m in re.findall(r"\boptions\.(\w+)", text)}
    # top_level is the pipeline's (which graph this is), not a user option
    assert read - {"top_level"} <= declared, f"options the patterns read that no family declares: {read - declared}"


@pytest.mark.parametrize("change, message", [
    (lambda f: dataclasses.replace(f, order=None), "with an order"),
    (lambda f: "rms_norm", "must be a Family"),
])
def test_a_bad_declaration_is_named(monkeypatch, change, message):
    module = importlib.import_module("sloth.patterns.rms_norm")
    monkeypatch.setattr(module, "DECLARATION", change(module.DECLARATION))
    with pytest.raises(TypeError, match=message):
        registry.declared_families()


def test_two_declarations_of_one_name_or_order_are_refused(monkeypatch):
    module = importlib.import_module("sloth.patterns.l2_norm")
    declared = module.DECLARATION
    monkeypatch.setattr(module, "DECLARATION", dataclasses.replace(declared, name="rms_norm"))
    with pytest.raises(ValueError, match="same name"):
        registry.declared_families()
    monkeypatch.setattr(module, "DECLARATION", dataclasses.replace(declared, order=20))
    with pytest.raises(ValueError, match="same order"):
        registry.declared_families()


def test_the_declaration_on_the_extending_page_is_found(tmp_path, monkeypatch):
    # docs/extending.md's declaration, in a package of its own beside the toy family's pass and anchor
    with open(os.path.join(ROOT, "docs", "extending.md"), encoding="utf-8") as f:
        page = f.read()
    block = page[page.index("<!-- declaration example: begin -->"):page.index("<!-- declaration example: end -->")]
    code = block[block.index("```python") + len("```python"):block.rindex("```")]
    package = tmp_path / "toy_families"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "softcap.py").write_text("def fuse_softcap(gm, example_inputs, *, report, options):\n    return gm\n\n\n"
                                        "def is_softcap(node):\n    return False\n\n" + code)
    monkeypatch.syspath_prepend(str(tmp_path))
    (found,) = registry.declared_families("toy_families")
    assert (found.name, found.order, found.emits) == ("softcap", 75, ("softcap",))
    between = [f.name for f in DECLARED if f.order < found.order][-1:] + \
        [f.name for f in DECLARED if f.order > found.order][:1]
    assert between == ["glu", "cross_entropy"]  # what the page says: after glu


# Declared ops without a row in tests/test_bad_input.py yet, each with why; a declared op that is neither covered nor
# listed here fails below, as does one listed here that has gained its rows (the list only shrinks).
BAD_INPUT_GAPS = {
    "document_attention": "a packed-attention op whose bounds come from the runtime (runtime/packing.py)",
    "moe_experts": "tests/test_moe_op.py checks its values and its input checks",
    "window_bounds": "an index helper of sink_attention's, no float input",
}


def _test_source(name: str) -> str:
    with open(os.path.join(ROOT, "tests", name), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("family", DECLARED, ids=lambda f: f.name)
def test_every_declared_op_has_op_tests_on_the_gpu_lane_and_bad_input_rows(family):
    """Built from the declarations: each op a family emits is exercised by a file the GPU lane runs (its op tests,
    CPU and CUDA: benchmarks/gpu_lane.py's ``lane_files``) and has rows in tests/test_bad_input.py's table, so a new
    family's op cannot ship without either."""
    from benchmarks.gpu_lane import lane_files

    lane = {name: _test_source(name) for name in lane_files()}
    bad_input = _test_source("test_bad_input.py")
    for op in family.emits:
        assert any(re.search(rf"\b{op}\b", text) for text in lane.values()), \
            f"sloth.{op} ({family.name}) appears in no file of the GPU lane: {sorted(lane)}"
        has_rows = re.search(rf'Op\(\s*"{op}"', bad_input) is not None
        if op in BAD_INPUT_GAPS:
            assert not has_rows, f"sloth.{op} has bad-input rows now: drop it from BAD_INPUT_GAPS"
        else:
            assert has_rows, f"sloth.{op} ({family.name}) has no row in tests/test_bad_input.py's CASES"
