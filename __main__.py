"""``python -m sloth``: what a user needs first.

Prints sloth's version and where it was imported from, the versions of torch, triton, transformers and peft, the
path sloth's ops would take on this machine (in the words of the report's first line: Triton kernels on the GPU,
Triton's CPU interpreter, or PyTorch references), whether ``torch.compile`` finds the "sloth" backend, and the
quick start. Nothing is compiled or run.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys

QUICK_START = """\
    import torch, sloth
    model = torch.compile(model, backend="sloth")   # a transformers / peft model; then train as usual
    model(input_ids=ids, labels=ids).loss.backward()
    print(sloth.report())                           # what was replaced, where, and what was refused"""

# What to do about the path, keyed by the words lowering/backend_choice.py's execution_path returns.
PATH_HINTS = {
    "Triton kernels on the GPU": "a CUDA GPU is visible: sloth's ops run their Triton kernels on it",
    "Triton's CPU interpreter": "no GPU; TRITON_INTERPRET=1: the Triton kernels run in Triton's CPU interpreter (slow)",
    "PyTorch references": "no GPU, TRITON_INTERPRET unset: each op runs its PyTorch reference; set "
                          "TRITON_INTERPRET=1 before importing triton, peft or sloth to run the Triton kernels "
                          "in Triton's CPU interpreter",
}


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def lines() -> list[str]:
    import torch

    from . import __file__ as package_file, __version__
    from .lowering.backend_choice import execution_path

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    path = execution_path([device])
    where = f" ({torch.cuda.get_device_name(0)})" if device.type == "cuda" else ""
    registered = "sloth" in torch._dynamo.list_backends()
    others = ", ".join(f"{name} {_version(name)}" for name in ("triton", "transformers", "peft"))
    return [
        f"sloth {__version__} ({os.path.dirname(package_file)})",
        f"torch {torch.__version__}, {others}, python {sys.version.split()[0]}",
        f"path: {path}{where}",
        f"  {PATH_HINTS.get(path, '')}",
        "backend: " + ('torch.compile finds backend="sloth" (entry point)' if registered else
                       'backend="sloth" is not registered with torch.compile: install the package '
                       "(pip install -e . in the repository) so that its entry point is seen"),
        "quick start:",
        QUICK_START,
        "more: the repository's README.md; python -m sloth.demo trains a small model beside eager",
    ]


def main() -> int:
    print("\n".join(lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
