"""``python -m sloth`` (the package's __main__.py): versions, the path sloth's ops would take, the backend's
registration and the quick start."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import torch

import sloth
from sloth import __main__ as sloth_main
from sloth.lowering.backend_choice import execution_path

PATHS = ("Triton kernels on the GPU", "Triton's CPU interpreter", "PyTorch references")


def _run(env_changes: dict) -> list[str]:
    env = dict(os.environ)
    env.update({k: v for k, v in env_changes.items() if v is not None})
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
    package = Path(sloth.__file__).parent  # not resolved: the device machine imports a symlink named sloth
    if package.name == "sloth":  # imported through a path entry (not an installed mapping): pass it on
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package.parent), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "sloth"], env=env, cwd=Path(__file__).parent, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_python_m_sloth_prints_versions_path_and_quick_start():
    cpu = not torch.cuda.is_available()
    out = _run({"TRITON_INTERPRET": None} if cpu else {})
    assert out[0].startswith(f"sloth {sloth.__version__} (")
    assert out[1].startswith(f"torch {torch.__version__}, triton ")
    assert "transformers " in out[1]
    path = next(line for line in out if line.startswith("path: "))
    assert path.startswith("path: PyTorch references" if cpu else "path: Triton kernels on the GPU")
    if cpu:  # the advice a CPU user needs: the variable, and when to set it
        assert "TRITON_INTERPRET=1 before importing triton, peft or sloth" in "\n".join(out)
    backend = next(line for line in out if line.startswith("backend: "))
    installed = any(e.name == "sloth" for e in importlib.metadata.entry_points(group="torch_dynamo_backends"))
    if installed:
        assert "finds" in backend
    assert "quick start:" in out
    assert any('torch.compile(model, backend="sloth")' in line for line in out)
    assert any("sloth.report()" in line for line in out)


def test_path_line_names_the_reports_path():
    """In this process (the interpreter on, without a GPU, as conftest sets it) the path line is the report's
    words for this device."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines = sloth_main.lines()
    assert f"path: {execution_path([device])}" in [line.split(" (")[0] for line in lines]
    assert set(sloth_main.PATH_HINTS) == set(PATHS)
