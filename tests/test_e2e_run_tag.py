"""benchmarks/e2e.py's ``_run_tag``: the part of a run's text-file names (profile, host profile, memory peak) that
tells two runs of one device call apart, so the second does not write over the first's file."""
from __future__ import annotations

import argparse

from benchmarks.e2e import _run_tag


def _tag(sloth_options: str, qlora: bool = False, lora_experts: bool = False, variants: tuple = ()) -> str:
    return _run_tag(argparse.Namespace(sloth_options=sloth_options, qlora=qlora, lora_experts=lora_experts,
                                       sloth_variant=list(variants)))


def test_each_option_that_changes_a_run_is_in_its_tag() -> None:
    assert _tag("{}") == ""
    assert _tag('{"return_logits": false}') == ""  # off: the default's file name
    assert _tag('{"offload": true, "tiled_mlp": true}', qlora=True) == "-qlora-offload-tiled_mlp"
    assert _tag('{"moe_recompute": true}', lora_experts=True) == "-lora-experts-moe_recompute"
    # a dict-valued option: its key, and the keys set to true in it
    assert _tag('{"offload": {"mid_layer": true}, "tiled_mlp": true}') == "-offload-mid_layer-tiled_mlp"
    assert _tag('{"offload": {"min_bytes": 0}}') == "-offload"
    assert len({_tag('{"offload": true}'), _tag('{"offload": {"mid_layer": true}}')}) == 2
    # passes switched off by name, and measurement variants (benchmarks/variants.py)
    assert _tag('{"disable": ["lean_backward", "runtime_twins"]}') == "-disable-lean_backward-runtime_twins"
    assert _tag("{}", variants=("moe_route_sort",)) == "-moe_route_sort"
