"""Run a function right after a module is first imported, without importing it.

sloth adjusts three third-party libraries for Dynamo (peft_experts.py, hub_kernels.py, input_grads_hook.py beside
this file). Any may be imported before sloth or after it, and sloth must never import them on its own account, so
each adjustment runs at ``import sloth`` when its module is already loaded, else from a finder placed first on
``sys.meta_path`` that finds nothing itself: when the module is imported it has the path finder find it, and wraps
the loader's ``exec_module`` so that the callback runs once the module's code has run.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Callable


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` once ``name`` has been imported; removes itself on first use."""

    def __init__(self, name: str, callback: Callable) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_and_call(module):
            exec_module(module)
            callback(module)

        spec.loader.exec_module = exec_and_call
        return spec


def when_imported(name: str, callback: Callable, *, package: str, switch: str | None = None) -> None:
    """``callback(module)`` now if module ``name`` is loaded, else right after it is first imported. Nothing is
    installed when the environment variable ``switch`` (the adjustment's opt-out) is "0", when ``package`` (the
    top-level distribution ``name`` lives in) is not installed at all, or when a hook for ``name`` is already
    waiting."""
    if switch is not None and os.environ.get(switch, "1") == "0":
        return
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    if importlib.util.find_spec(package) is None:
        return
    if not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))
