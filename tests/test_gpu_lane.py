"""benchmarks/gpu_lane.py's dry run: the lane's selection collects (files exist, both phases' -k expressions select
tests) and its record is written; and a failing phase makes the lane's exit status non-zero."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lane(*args: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_lane", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_dry_run_collects_both_phases(tmp_path):
    done = _lane("--dry-run", "--files", "test_tolerance.py", "test_l2_norm_op.py", "test_cuda_ops.py", out=tmp_path)
    record = (tmp_path / "gpu_lane.md").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# GPU lane (dry run: collected only): PASSED" in record
    rows = {line.split(" | ")[0].strip("| "): line for line in record.splitlines() if line.startswith("| s")}
    shared = int(rows["shared"].split(" | ")[2])
    serial = int(rows["serial"].split(" | ")[2])
    assert shared > 50 and serial > 10, record  # test_cuda_ops.py's model-sized cases go to the serial phase
    for key in ("commit", "device", "torch", "triton", "transformers"):
        assert f"- {key}: " in record


def test_a_failure_fails_the_lane(tmp_path):
    failing = tmp_path / "test_gpu_lane_sample_failure.py"
    failing.write_text("def test_fails():\n    assert 1 == 2, 'on purpose'\n")
    done = _lane("--files", str(failing), "--workers", "1", "--budget", "120", out=tmp_path)
    record = (tmp_path / "gpu_lane.md").read_text()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED" in record and "test_gpu_lane_sample_failure.py::test_fails" in record and "on purpose" in record
