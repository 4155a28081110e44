"""The GPU test lane: every op test, tests/test_cuda_ops.py and the pattern tests that run on CUDA, in one command
that fits one device call (10 minutes on one H100/H200 with 16 cores), with a markdown record.

    python -m benchmarks.gpu_lane --out $OUT     # on the device machine: exit status 0 only if nothing failed
    python -m benchmarks.gpu_lane --dry-run      # anywhere: collects the same selection, runs nothing

Why the result does not depend on how many workers share the GPU (pytest -n auto gave 6 failed, 268 passed on an
H100 where each failure passed alone; a record of 2026-12-06 names one cause: four workers held 26 + 22 + 21 +
10 GiB at once, and the fourth ran out of memory):
- a fixed number of workers (``--workers``, 8: the shared phase in 161 s on a warm H100, not done in 305 s with
  4), each capped at an equal share of the GPU's memory (``SLOTH_TEST_GPU_MEMORY_FRACTION``, read by
  tests/conftest.py): a test that needs more than its share fails every time, whatever its neighbours do, instead
  of when they happen to be large at once;
- the model-sized cases (``SERIAL``: Qwen3-MoE, GPT-OSS-20B, Nemotron, DeepSeek-V3, Llama-3-8B shapes, the 2^31
  element offsets) run afterwards in one process with the whole GPU;
- no test depends on timing: no Triton autotuning in lowering/, and the one kernel with atomics (lowering/lora.py's
  split counters) adds its partials in a fixed order (tests/test_lora_op.py checks the bits twice);
- a wall-clock budget per phase, so a hung test shows as a timeout in the record rather than a lost device call.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

# The pattern and model tests with CUDA cases of their own (test_qlora.py: the qlora_linear op's; test_trl_head.py:
# sloth's op against TRL's Triton head).
PATTERN_FILES = ["test_gqa_attention_pattern.py", "test_attention_chunks.py", "test_grouped_gemm.py",
                 "test_sm90_compile.py", "test_lean_backward.py", "test_peft_experts.py", "test_qlora.py",
                 "test_trl_head.py"]
# Model-sized cases (tens of GiB each, or minutes of one GPU): by test id, run alone after the rest.
SERIAL = ("qwen3-moe or nemotron or gpt-oss-20b or gpt-oss-window or gpt-oss-full or deepseek-v3 or llama-3-8b "
          "or 4096x2048 or 3000-512 or past_two_to_the_31")


def lane_files() -> list[str]:
    """The op tests (one per fused op), the tolerance rule's own test, tests/test_cuda_ops.py, the pattern files."""
    ops = sorted(p.name for p in TESTS.glob("test_*_op.py"))
    return [*ops, "test_tolerance.py", "test_cuda_ops.py", *(f for f in PATTERN_FILES if (TESTS / f).exists())]


@dataclass
class Phase:
    name: str
    args: list[str]  # pytest's, after the files
    workers: int
    budget_s: float
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)  # (test id, first line of the message)
    wall_s: float = 0.0
    returncode: int | None = None
    timed_out: bool = False


def _sloth_importable(env: dict) -> dict:
    """The device machine's copy of the checkout is not pip-installed and its folder is not named sloth: import it
    as sloth through a symlink, as the device machine does."""
    probe = subprocess.run([sys.executable, "-c", "import sloth"], cwd=ROOT, env=env, capture_output=True)
    if probe.returncode == 0:
        return env
    pkg = Path(tempfile.mkdtemp(prefix="sloth_lane_"))
    (pkg / "sloth").symlink_to(ROOT, target_is_directory=True)
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(pkg), env.get("PYTHONPATH")]))}


def _has_plugin(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def run_phase(phase: Phase, files: list[str], env: dict, log_dir: Path, dry_run: bool) -> Phase:
    junit = log_dir / f"{phase.name}.xml"
    # From the repository root: some pattern files import tests.pattern_checks
    # (python -m puts the root on sys.path); tests/pytest.ini still holds the configuration.
    paths = [f if os.path.isabs(f) else f"tests/{f}" for f in files]
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rfE", "--slow",
           f"--junitxml={junit}", *paths, *phase.args]
    if dry_run:
        cmd.append("--collect-only")
    elif phase.workers > 1:
        cmd += ["-n", str(phase.workers)]
    if not dry_run and _has_plugin("pytest_timeout"):
        cmd += ["--timeout", "300"]  # one test past 5 minutes is hung: fail it, keep the rest of the phase
    phase_env = dict(env)
    if phase.workers > 1:
        # each worker's share of the GPU, less room for the CUDA contexts (~0.5 GiB each)
        phase_env["SLOTH_TEST_GPU_MEMORY_FRACTION"] = f"{0.95 / phase.workers:.3f}"
    start = time.monotonic()
    with open(log_dir / f"{phase.name}.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=phase_env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=phase.budget_s)
            phase.returncode = proc.returncode
        except subprocess.TimeoutExpired:
            phase.timed_out = True
    phase.wall_s = time.monotonic() - start
    if dry_run:
        phase.passed = _collected(log_dir / f"{phase.name}.log")
    elif junit.exists():
        _read_junit(phase, junit)
    return phase


def _collected(log: Path) -> int:
    """Collected test ids in a ``--collect-only -q`` log (lines ``file.py::test[...]``)."""
    return sum(1 for line in log.read_text().splitlines() if "::" in line and not line.startswith(("FAILED", "ERROR")))


def _read_junit(phase: Phase, junit: Path) -> None:
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            phase.passed += 1
        elif outcome.tag == "skipped":
            phase.skipped += 1
        else:
            phase.failed += outcome.tag == "failure"
            phase.errors += outcome.tag == "error"
            first = (outcome.get("message") or outcome.text or "").strip().splitlines()
            phase.failures.append((name, first[0][:200] if first else outcome.tag))


def _failed(phase: Phase) -> bool:
    """A failure, an error, a timeout or any other pytest exit but 0 and 5 (nothing selected: a --files subset)."""
    return phase.timed_out or bool(phase.failures) or phase.returncode not in (0, 5)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _commit() -> str:
    """GIT_COMMIT where set (the device's copy of the tree may carry a stale .git: benchmarks/README.md), else git's
    HEAD and whether the tree differs from it."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here: set GIT_COMMIT)"


def environment() -> dict[str, str]:
    import torch

    info = {"commit": _commit(), "host": platform.node(), "python": platform.python_version(),
            "torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers"),
            "CUDA": str(torch.version.cuda)}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm{props.major}{props.minor})"
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "?"
    else:
        info["device"] = "cpu (no CUDA device: the tests' Triton kernels run in the interpreter)"
    return info


def write_record(path: Path, info: dict, phases: list[Phase], wall_s: float, dry_run: bool) -> None:
    ok = not any(_failed(p) for p in phases)
    lines = [f"# GPU lane{' (dry run: collected only)' if dry_run else ''}: {'PASSED' if ok else 'FAILED'}", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, `python -m benchmarks.gpu_lane"
             f"{' --dry-run' if dry_run else ''}`, {wall_s:.0f} s in all.", ""]
    lines += [f"- {key}: {value}" for key, value in info.items()]
    lines += ["", "| phase | workers | " + ("collected" if dry_run else "passed | failed | errors | skipped")
              + " | wall s | note |", "|---|---|" + ("---|" if dry_run else "---|---|---|---|") + "---|---|"]
    for p in phases:
        counts = f"{p.passed}" if dry_run else f"{p.passed} | {p.failed} | {p.errors} | {p.skipped}"
        note = f"timed out at {p.budget_s:.0f} s" if p.timed_out else f"pytest exit {p.returncode}"
        lines.append(f"| {p.name} | {p.workers} | {counts} | {p.wall_s:.0f} | {note} |")
    failures = [(p.name, test, first) for p in phases for test, first in p.failures]
    if failures:
        lines += ["", "## Failures", ""] + [f"- `{test}` ({name}): {first}" for name, test, first in failures]
    lines += ["", "Logs and JUnit files beside this record (`logs/`), when run with `--out`."]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="folder for the record and logs (default: benchmarks/results)")
    parser.add_argument("--dry-run", action="store_true", help="collect the lane's tests only (any machine)")
    parser.add_argument("--workers", type=int, default=8, help="xdist workers of the shared phase (default 8)")
    parser.add_argument("--budget", type=float, default=570.0, help="seconds for both phases together (default 570)")
    parser.add_argument("--serial-budget", type=float, default=300.0,
                        help="seconds of the budget kept for the serial phase (default 300: its 70 model-sized "
                             "cases took 162 s on a warm H100, 40 of them 250 s on a fresh one)")
    parser.add_argument("--files", nargs="*", help="test files instead of the lane's (names under tests/)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    files = args.files or lane_files()
    env = _sloth_importable({**os.environ, "PYTHONUNBUFFERED": "1",
                             "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                                       "expandable_segments:True")})
    out = args.out or ROOT / "benchmarks" / "results"
    log_dir = (args.out / "logs") if args.out else Path(tempfile.mkdtemp(prefix="gpu_lane_logs_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # The serial phase keeps its share; the shared phase (161 s with 8 workers on a warm H100) gets the rest, and
    # whatever it leaves goes to the serial phase too.
    shared = Phase("shared", ["-k", f"not ({SERIAL})"], args.workers, max(30.0, args.budget - args.serial_budget))
    run_phase(shared, files, env, log_dir, args.dry_run)
    serial = Phase("serial", ["-k", SERIAL], 1, max(30.0, args.budget - (time.monotonic() - started)))
    run_phase(serial, files, env, log_dir, args.dry_run)
    phases = [shared, serial]

    info = environment()
    stamp = datetime.date.today().isoformat()
    device = info["device"].split(" (")[0].replace(" ", "_").lower()
    record = out / ("gpu_lane.md" if args.out else f"{stamp}_gpu_lane_{device}{'_dry' if args.dry_run else ''}.md")
    out.mkdir(parents=True, exist_ok=True)
    write_record(record, info, phases, time.monotonic() - started, args.dry_run)
    print(record.read_text())
    return 1 if any(_failed(p) for p in phases) else 0


if __name__ == "__main__":
    sys.exit(main())
