"""Graph dumps: each compiled graph as readable code before sloth, after canonicalisation and after each family
pass that changed it, with a diff against the stage before, in a folder named for the graph.

    torch.compile(model, backend="sloth", options={"dump": "sloth_dump"})      # or SLOTH_DUMP_DIR=sloth_dump

    sloth_dump/graph_0_0/00_before.py         the graph Dynamo handed over (subgraph bodies included)
                         01_canonicalize.py    after canonicalisation, 01_canonicalize.diff against 00
                         02_rms_norm.py        after the first family that changed it, 02_rms_norm.diff
                         ...

A graph is named for Dynamo's compile id (frame 0, its compile 0: ``graph_0_0``; a recompile of that frame is
``graph_0_1``), or numbered in order when it has none (``sloth.explain``, a direct backend call). A stage that
changed nothing writes no file. The code is ``GraphModule.print_readable`` with each node's shape and dtype and
the source line it came from, so a diff shows which lines of the model each replacement took. The report
lists the folders (``Report.dumps``). Like ``TORCH_COMPILE_DEBUG`` for Dynamo and Inductor, but for sloth's
passes; the dumps cost compile time (not counted in ``report.pass_seconds``), so they are off by default.
"""
from __future__ import annotations

import difflib
import itertools
import os
from typing import Optional, Union

import torch.fx as fx

ENV_VAR = "SLOTH_DUMP_DIR"

_unnamed = itertools.count()
_opened: set[str] = set()  # folders this process has written, so a second graph of one name gets its own


def dump_root(option: Union[None, bool, str, os.PathLike]) -> Optional[str]:
    """The folder the ``dump`` option (or, when it is not given, ``$SLOTH_DUMP_DIR``) asks for, or None.

    ``True`` means ``./sloth_dump``; ``False`` turns dumps off even when the variable is set."""
    if option is None:
        option = os.environ.get(ENV_VAR) or None
    if option is None or option is False:
        return None
    if option is True:
        return os.path.abspath("sloth_dump")
    if isinstance(option, (str, os.PathLike)) and str(option):
        return os.path.abspath(os.fspath(option))
    raise ValueError(f"sloth: dump must be a folder path, True (./sloth_dump) or False, got {option!r}")


def render(gm: fx.GraphModule) -> str:
    """The graph and its subgraph bodies as readable Python with shapes, dtypes and source lines."""
    return gm.print_readable(print_output=False)


class GraphDump:
    """The stages of one graph through sloth's passes, written as they happen."""

    def __init__(self, root: str, gm: fx.GraphModule):
        compile_id = gm.meta.get("dynamo_compile_id")
        if compile_id is not None:
            name = "graph_" + str(compile_id).replace("/", "_").replace(" ", "")
        else:
            name = f"graph_unnamed_{next(_unnamed)}"
        folder, suffix = os.path.join(root, name), 1
        while folder in _opened:  # one compile id seen twice in a process (a second model, after reset)
            suffix += 1
            folder = os.path.join(root, f"{name}_{suffix}")
        _opened.add(folder)
        os.makedirs(folder, exist_ok=True)
        for stale in os.listdir(folder):  # an earlier process's stages would mix with this one's
            if stale.endswith((".py", ".diff")):
                os.remove(os.path.join(folder, stale))
        self.folder = folder
        self._stage = 0
        self._last: Optional[tuple[str, str]] = None  # (file name, code) of the last stage written

    def snapshot(self, stage: str, gm: fx.GraphModule) -> None:
        """Write the graph after ``stage`` if it differs from the last stage written, with the diff."""
        code = render(gm)
        if self._last is not None and code == self._last[1]:
            return
        file_name = f"{self._stage:02d}_{stage}"
        with open(os.path.join(self.folder, file_name + ".py"), "w") as f:
            f.write(code)
        if self._last is not None:
            diff = difflib.unified_diff(self._last[1].splitlines(keepends=True), code.splitlines(keepends=True),
                                        fromfile=self._last[0] + ".py", tofile=file_name + ".py")
            with open(os.path.join(self.folder, file_name + ".diff"), "w") as f:
                f.writelines(diff)
        self._last = (file_name, code)
        self._stage += 1
