"""benchmarks/results/INDEX.md is what `python -m benchmarks.index` writes, and the suites of benchmarks/suites.py
name modules, options and switches that exist; the runner's time limit and summary work (no GPU, a few seconds)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import index, suites, variants
from sloth.compiler.options import parse_options

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_DIRS = ("compiler", "lowering", "patterns", "runtime")


def test_index_is_current():
    written = (index.RESULTS_DIR / index.INDEX_NAME).read_text()
    assert written == index.render(), "benchmarks/results/INDEX.md is stale: run python -m benchmarks.index"


def test_index_lists_every_file_once():
    text = (index.RESULTS_DIR / index.INDEX_NAME).read_text()
    names = sorted(p.name for p in index.RESULTS_DIR.iterdir() if p.is_file() and p.name != index.INDEX_NAME)
    for name in names:
        assert f"]({name})" in text, name
    recs = index.records()
    assert len({r.name for r in recs}) == len(recs)
    assert len(recs) + len(index.raw_files()) + sum(r.json_name not in (None, r.name) for r in recs) == len(names)


def test_index_reads_each_record_shape(tmp_path):
    (tmp_path / "2026-12-07_gpu_lane_h100.md").write_text(
        "# GPU lane: PASSED\n\n- commit: 22375ff (the device said 58a7413)\n- device: NVIDIA H100 80GB HBM3 (79 GiB)\n")
    (tmp_path / "2026-12-01_written.md").write_text(
        "# Something on the H200, 2026-12-01\n\nCode: commit 2ee21ed (the JSON files' `git_commit` reads d77e046;\n"
        "whose offload code d77e046 does not have).\n\n## Rows\n\ncommit 1234567 in a later section\n")
    (tmp_path / "2026-12-02_nothing.md").write_text("# An analysis\n\nNo machine, no commit.\n")
    (tmp_path / "2026-11-29_124756_e2e-llama3-8b.md").write_text(
        "### e2e on NVIDIA H200 (2026-11-29T12:47:56+00:00, torch 2.11.0+cu130, 5583d41)\n")
    (tmp_path / "2026-12-05_h100_152521_e2e-qwen3-moe.json").write_text(
        '{"benchmark": "e2e", "env": {"date": "2026-12-05T15:25:21+00:00", "device": "NVIDIA H100 80GB HBM3", '
        '"git_commit": "25b891ac26098119f7f3025dca9dced3a54aa913", "git_dirty": true, '
        '"sloth_env": {"SLOTH_MOE_ROUTE": "sort"}}, "config": {"variants": "sloth", '
        '"sloth_options": "{\\"return_logits\\": false}", "distributed": "none", "profile": true}}')
    (tmp_path / "2026-12-05_h100_logs.tgz").write_bytes(b"\0" * 10)
    by_name = {r.name: r for r in index.records(tmp_path)}
    lane = by_name["2026-12-07_gpu_lane_h100.md"]
    assert (lane.what, lane.device, lane.commit) == ("GPU lane: PASSED", "H100 80GB HBM3", "22375ff")
    written = by_name["2026-12-01_written.md"]
    assert (written.device, written.commit, written.date) == ("H200", "2ee21ed", "2026-12-01")
    nothing = by_name["2026-12-02_nothing.md"]
    assert (nothing.device, nothing.commit) == ("?", "?")
    table = by_name["2026-11-29_124756_e2e-llama3-8b.md"]
    assert (table.device, table.commit, table.date) == ("H200", "5583d41", "2026-11-29 12:47")
    run = by_name["2026-12-05_h100_152521_e2e-qwen3-moe.json"]
    assert (run.device, run.commit, run.date) == ("H100 80GB HBM3", "25b891a (dirty)", "2026-12-05 15:25")
    assert run.what == "e2e-qwen3-moe: sloth; return_logits=false; SLOTH_MOE_ROUTE=sort; --profile"
    assert index.missing(list(by_name.values())) == {"date": 0, "device": 1, "commit": 1}
    text = index.render(tmp_path)
    assert "| log archive | 0.0 KiB | [2026-12-05_h100_logs.tgz](2026-12-05_h100_logs.tgz) | - |" in text


def _steps():
    for suite in suites.SUITES:
        for call in suite.calls:
            for step in call.steps:
                yield suite, call, step


@pytest.mark.parametrize("suite", suites.SUITES, ids=lambda s: s.name)
def test_suite_steps_exist(suite):
    """Every module a step runs is a file; every --option it passes is one that module defines; every environment
    switch it sets is still read by the product code, every measurement variant exists and every sloth option and
    pass name it gives parses (else the step measures nothing)."""
    product = "\n".join(p.read_text() for d in PRODUCT_DIRS for p in (ROOT / d).rglob("*.py"))
    names = [step.name for call in suite.calls for step in call.steps]
    assert len(names) == len(set(names)), f"{suite.name}: step names share a log file"
    for call in suite.calls:
        if suite.device:
            assert call.limit_s <= suites.CALL_LIMIT_S, f"{suite.name}:{call.name} does not fit one device call"
        for step in call.steps:
            assert step.module, step
            path = ROOT / (step.module.replace(".", "/") + ".py")
            assert path.is_file(), f"{suite.name}:{call.name}:{step.name} runs {step.module}, not a file"
            source = path.read_text()
            for arg in step.argv[2:]:
                if arg.startswith("--"):
                    assert f'"{arg}"' in source, f"{step.module} defines no {arg} ({suite.name}:{step.name})"
            for key, _ in step.env:
                assert key in product, f"{key} is read nowhere in {', '.join(PRODUCT_DIRS)} ({step.name})"
            for flag, value in zip(step.argv, step.argv[1:]):
                if flag == "--sloth-variant":
                    assert value in variants.VARIANTS, f"{step.name}: no measurement variant {value!r}"
                if flag == "--sloth-options":
                    parse_options(json.loads(value))  # every option and pass name it gives still exists


@pytest.mark.parametrize("name", sorted(variants.VARIANTS))
def test_every_measurement_variant_sets_what_exists(name, monkeypatch):
    """benchmarks/variants.py's variants set module constants sloth still has (else a run measures the default)."""
    import sloth.compiler.recompute as recompute
    from sloth.lowering import glu_lora, lora, moe, moe_routing
    from sloth.patterns import norm_rope

    for module in (recompute, glu_lora, lora, moe, moe_routing, norm_rope):
        for key, value in vars(module).items():
            if key.isupper():
                monkeypatch.setattr(module, key, value)  # each variant's change undone after the test
    variants.apply([name])


def test_list_and_dry_run():
    listed = subprocess.run([sys.executable, "-m", "benchmarks.suites", "--list"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    for suite in suites.SUITES:
        assert re.search(rf"^{suite.name}  \(", listed.stdout, re.M), suite.name
    dry = subprocess.run([sys.executable, "-m", "benchmarks.suites", *(s.name for s in suites.SUITES), "--dry-run",
                          "--out", "/nonexistent/out"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    commands = [line for line in dry.stdout.splitlines() if not line.startswith("#")]
    assert len(commands) == sum(1 for _ in _steps())
    for line in commands:
        m = re.search(r"python -m (\S+)", line)
        assert m and (ROOT / (m.group(1).replace(".", "/") + ".py")).is_file(), line
    assert "python -m benchmarks.gpu_lane --out /nonexistent/out/lane" in dry.stdout
    assert not Path("/nonexistent/out").exists()
    one = subprocess.run([sys.executable, "-m", "benchmarks.suites", "lora_8b:peers", "--dry-run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert one.stdout.count("python -m benchmarks.e2e") == 2 and "lora_8b:default" not in one.stdout


def test_runner_limits_and_summarises(tmp_path, capsys):
    logs = tmp_path / "logs" / "s"
    logs.mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin"}
    rows = suites.Step("rows", 60, ("-c", "print('progress 1 GB/s'); print('[sloth] 5 ms/step'); print('x')"),
                       show=r"ms/step|GB/s", hide="GB/s$")
    assert suites.run_step(rows, tmp_path, logs, env) == 0
    slow = suites.Step("slow", 1, ("-c", "import time; time.sleep(60)"))
    assert suites.run_step(slow, tmp_path, logs, env) == 124
    printed = capsys.readouterr().out
    assert "rows: rc 0\n[sloth] 5 ms/step\n" in printed and "progress" not in printed
    assert "slow: rc 124 (past its 1 s)" in printed
    for i in range(9):
        (tmp_path / f"t{i}.md").write_text("table")
    suites._pack(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tgz", "tables.tgz"]


def test_main_runs_a_call_and_packs_its_logs(tmp_path, monkeypatch, capsys):
    step = suites.Step("hello", 60, ("-c", "import os; print('row', os.environ['OUT'])"), show="^row")
    monkeypatch.setattr(suites, "SUITES", (suites.Suite("tiny", "a test", (suites.Call("one", "one step", (step,)),)),))
    monkeypatch.setattr(suites, "_environment", lambda out: {"PATH": "/usr/bin:/bin", "OUT": str(out)})
    assert suites.main(["tiny", "--out", str(tmp_path)]) == 0
    assert f"== tiny:one (60 s of limits)\nhello: rc 0\nrow {tmp_path}\n" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["logs.tgz"]
    with pytest.raises(SystemExit, match="has no call"):
        suites.main(["tiny:two", "--dry-run"])
