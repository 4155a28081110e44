"""The backend's options (compiler/options.py): every default, every bad value's message, "did you mean" for a
misspelt key at the top level and inside ``offload`` and ``tiled_mlp``, Inductor config keys passed through, and
the README's Options table naming exactly sloth's options. Parsing only, no compile: a second or so for the file."""
from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

import sloth.compiler.backend as backend
from sloth.compiler.backend import sloth_backend
from sloth.compiler.options import (DEFAULT_MIN_BYTES, OPTION_NAMES, OffloadOptions, Options, PassOptions,
                                    TiledMlpOptions, parse_options)
from sloth.lowering.tiled_mlp import DEFAULT_TILE_ROWS

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def _id(user: dict) -> str:
    """A readable test id from an options dict: {"offload": {"min_bytes": -1}} -> offload-min_bytes--1."""
    return re.sub(r"[^\w-]+", "-", str(user).replace("'", "")).strip("-")[:48]


@pytest.fixture(autouse=True)
def _no_dump_dir(monkeypatch):
    monkeypatch.delenv("SLOTH_DUMP_DIR", raising=False)


def test_defaults():
    options, inductor = parse_options(None)
    assert inductor == {}
    assert options == Options() == parse_options({})[0]
    assert dataclasses.asdict(options) == dict(
        memory="auto", inner="inductor", patterns=None, report=False, return_logits=True, recompute=True,
        share_lora_input=True, offload=None, tiled_mlp=None, moe_recompute=False, mask_check=True, dump=None,
        attention=None, disable=(), given=frozenset())
    assert options.pass_options() == PassOptions(tiled_mlp=0, tiled_mlp_recompute=False)
    assert PassOptions() == PassOptions(return_logits=True, recompute=True, share_lora_input=True, tiled_mlp=0,
                                        tiled_mlp_recompute=True, mask_check=True, moe_recompute=False, top_level=True)
    assert OffloadOptions() == OffloadOptions(min_bytes=DEFAULT_MIN_BYTES, keep_last=1, mid_layer=False,
                                              prefetch_after_attention=True)
    assert DEFAULT_MIN_BYTES == 64 * 2**20


VALUES = [
    ({"inner": "aot_eager"}, "inner", "aot_eager"),
    ({"patterns": "glu"}, "patterns", ("glu",)),
    ({"patterns": ["rms_norm", "glu"]}, "patterns", ("rms_norm", "glu")),
    ({"patterns": []}, "patterns", ()),
    ({"report": 1}, "report", True),  # any truthy value, as before
    ({"return_logits": False}, "return_logits", False),
    ({"recompute": False}, "recompute", False),
    ({"share_lora_input": False}, "share_lora_input", False),
    ({"moe_recompute": True}, "moe_recompute", True),
    ({"mask_check": False}, "mask_check", False),
    ({"attention": ["flash", "math"]}, "attention", ("flash", "math")),
    ({"offload": True}, "offload", OffloadOptions()),
    ({"offload": False}, "offload", None),
    ({"offload": None}, "offload", None),
    ({"offload": {"min_bytes": 0, "mid_layer": True}}, "offload", OffloadOptions(min_bytes=0, mid_layer=True)),
    ({"tiled_mlp": True}, "tiled_mlp", TiledMlpOptions(DEFAULT_TILE_ROWS, True)),
    ({"tiled_mlp": 8}, "tiled_mlp", TiledMlpOptions(8, True)),
    ({"tiled_mlp": {"rows": 8, "recompute": False}}, "tiled_mlp", TiledMlpOptions(8, False)),
    ({"tiled_mlp": {"recompute": False}}, "tiled_mlp", TiledMlpOptions(DEFAULT_TILE_ROWS, False)),
    ({"tiled_mlp": {"rows": False}}, "tiled_mlp", None),
    ({"disable": "lean_backward"}, "disable", ("lean_backward",)),
    ({"disable": ["rms_norm", "runtime_twins", "offload"]}, "disable", ("rms_norm", "runtime_twins", "offload")),
]


@pytest.mark.parametrize("user, field, expected", [pytest.param(*case, id=_id(case[0])) for case in VALUES])
def test_values(user, field, expected):
    assert getattr(parse_options(user)[0], field) == expected


def test_tiled_mlp_reaches_the_passes():
    assert parse_options({"tiled_mlp": {"rows": 8, "recompute": False}})[0].pass_options().tiled_mlp == 8
    on = parse_options({"tiled_mlp": 16})[0].pass_options()
    assert (on.tiled_mlp, on.tiled_mlp_recompute) == (16, True)


def test_dump(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_options({"dump": True})[0].dump == os.path.abspath("sloth_dump")
    assert parse_options({"dump": "here"})[0].dump == os.path.abspath("here")
    monkeypatch.setenv("SLOTH_DUMP_DIR", str(tmp_path / "env"))
    assert parse_options({})[0].dump == str(tmp_path / "env")
    assert parse_options({"dump": False})[0].dump is None  # off even when the variable is set


BOOLS = ("recompute", "share_lora_input", "moe_recompute", "mask_check")
TILED = r"tiled_mlp must be True, False, a positive number of rows per block or \{'rows': N, 'recompute'"


BAD = [
    *[({name: "yes"}, f"sloth: {name} must be True or False, got 'yes'") for name in BOOLS],
    ({"return_logits": "yes"}, "sloth: return_logits must be True, False or 'lazy', got 'yes'"),
    ({"inner": "nvcc"}, r"inner must be one of \['inductor', 'aot_eager', 'eager'\], got 'nvcc'"),
    ({"patterns": ["rms_norm", "nope"]}, r"unknown pattern family \['nope'\]; known: \["),
    ({"disable": ["lean_backwards"]}, r"disable: unknown pass\(es\) \['lean_backwards'\] \('lean_backwards': did you "
                                      r"mean 'lean_backward'\?\); the passes are the families \["),
    ({"disable": 3}, "disable must be a pass name or a list of them, got 3"),
    ({"attention": "flash"}, "attention must be a non-empty list of SDPA backends"),
    ({"attention": []}, "attention must be a non-empty list of SDPA backends"),
    ({"attention": ["flash", "fa3"]}, "attention must be a non-empty list of SDPA backends"),
    ({"dump": 3}, "dump must be a folder path, True"),
    ({"offload": "yes"}, "offload must be True, False or a dict"),
    ({"offload": {"min_bytes": -1}}, "offload's min_bytes must be an integer >= 0, got -1"),
    ({"offload": {"keep_last": 1.5}}, "offload's keep_last must be an integer >= 0, got 1.5"),
    ({"offload": {"mid_layer": 1}}, "offload's mid_layer must be True or False, got 1"),
    ({"offload": {"prefetch_after_attention": "yes"}}, "offload's prefetch_after_attention must be True or False"),
    ({"offload": {"layers": 3}}, r"offload takes min_bytes, keep_last, mid_layer and prefetch_after_attention, "
                                 r"not \['layers'\]"),
    *[({"tiled_mlp": v}, TILED) for v in (0, -4, 2.5, "yes", {"rows": 8, "recompute": "no"}, {"blocks": 8})],
    ({"offload": True, "inner": "eager"}, "offload acts on AOTAutograd's forward/backward partition"),
    ({"max_autotune": True, "inner": "eager"}, r"options \['max_autotune'\] are Inductor settings, but inner='eager'"),
    ({"zzzq": 1}, r"unknown option\(s\) \['zzzq'\]; sloth's own options are \['memory', 'inner', "),
]


@pytest.mark.parametrize("user, message", [pytest.param(*case, id=_id(case[0])) for case in BAD])
def test_bad_values(user, message):
    with pytest.raises(ValueError, match=message):
        parse_options(user)


@pytest.mark.parametrize("user, hint", [
    ({"retrun_logits": False}, "'retrun_logits': did you mean 'return_logits'?"),
    ({"triton.cudagraph": True}, "'triton.cudagraph': did you mean 'triton.cudagraphs'"),  # Inductor's names too
    ({"max_autotun": True}, "'max_autotun': did you mean 'max_autotune'"),
    ({"offload": {"keeplast": 2}}, "not ['keeplast'] ('keeplast': did you mean 'keep_last'?)"),
    ({"tiled_mlp": {"row": 8}}, "got {'row': 8} ('row': did you mean 'rows'?)"),
], ids=["top-level", "inductor-dotted", "inductor", "offload", "tiled_mlp"])
def test_did_you_mean(user, hint):
    with pytest.raises(ValueError, match=re.escape(hint)):
        parse_options(user)


def test_inductor_keys_pass_through():
    user = {"max_autotune": True, "triton.cudagraphs": False, "return_logits": False}
    options, inductor = parse_options(user)
    assert inductor == {"max_autotune": True, "triton.cudagraphs": False} and not options.return_logits
    assert user == {"max_autotune": True, "triton.cudagraphs": False, "return_logits": False}  # not consumed


def test_backend_hands_inductor_keys_to_the_inner_compiler(monkeypatch):
    seen = []
    monkeypatch.setattr(backend, "compile_inner",
                        lambda gm, inputs, inner, mode=None, inductor_options=None, **kw: seen.append(
                            (inner, inductor_options)) or gm.forward)
    gm = torch.fx.symbolic_trace(lambda t: t + 1)
    sloth_backend(gm, [torch.randn(2)], options={"max_autotune": True, "report": False})
    assert seen == [("inductor", {"max_autotune": True})]


def test_a_misspelt_option_fails_before_the_passes(monkeypatch):
    # Before compiler/options.py, an unknown key was refused only by the inner compiler, after sloth's passes ran.
    monkeypatch.setattr(backend, "run_passes", lambda *a, **k: pytest.fail("the passes ran"))
    with pytest.raises(ValueError, match="did you mean 'mask_check'"):
        sloth_backend(torch.fx.symbolic_trace(lambda t: t + 1), [torch.randn(2)], options={"mask_chek": False})


def test_readme_options_table_names_every_option():
    text = open(README).read()
    table = text[text.index("## Options"):]
    table = table[:table.index("\n\n", table.index("| option |"))]
    rows = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert sorted(rows) == sorted(OPTION_NAMES), rows
    assert "| any other key |" in table
