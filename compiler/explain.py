"""``sloth.explain``: what sloth would replace in a model, without compiling or training it."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from . import backend as _backend
from .dump import dump_root
from .families import after_compile
from .pipeline import families, run_passes
from .report import Report


def explain(model_or_fn: Callable, *args: Any, **kwargs: Any) -> Report:
    """Capture ``model_or_fn(*args, **kwargs)`` with Dynamo, run every pass, and return the merged Report.

    The call runs once under ``torch.no_grad()`` (through the rewritten graphs, eagerly), so the model
    must accept these inputs; nothing is compiled by Inductor and no gradient is taken. Every registered family
    runs (a user's too); ``$SLOTH_DUMP_DIR`` dumps the graphs as the backend's ``dump`` option does.
    """
    if not callable(model_or_fn):
        raise TypeError(f"sloth.explain: expected a model or function, got {type(model_or_fn).__name__}")
    merged = Report()

    def capture(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        report = Report(sites=_backend._sites_given(gm))
        gm = run_passes(gm, example_inputs, families(), report, dump_root=dump_root(None))
        merged.merge(report)
        _backend._publish(report)
        return after_compile(gm, gm.forward)

    capture.sloth_explain = True  # integrations act as under sloth's backend (compiler/integrations/trl_head.py)
    with torch.no_grad():
        torch.compile(model_or_fn, backend=capture)(*args, **kwargs)
    return merged
