"""The family registry: the one way a pattern family joins the pipeline, for sloth's own families and a user's.

    sloth.register_family("scaled_tanh", fuse_scaled_tanh, anchor=is_tanh, after="glu")

A family is a name, a pass with the pipeline's one signature

    pass(gm, example_inputs, *, report, options) -> gm

and a place in the order of families (``before=`` or ``after=`` a registered family; default: last). The pass
gets everything a built-in one gets: it runs on the top-level graph and on every subgraph body (unless
``whole_module``, which runs once on the top level and reaches into the bodies itself), after
canonicalisation, with the report and the options; it is timed in ``report.pass_seconds``, shown in the graph
dumps and switched off by name like any family (``options={"patterns": [...]}``). With an ``anchor`` (a
predicate on canonical-graph nodes, one per site a user would expect handled) every anchor the pass neither
replaced nor explained with ``report.reject`` is reported as unexplained (compiler/anchors.py).

sloth's built-in families register here in roadmap order when ``compiler.pipeline`` is imported.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Optional

import torch.fx as fx

GraphPass = Callable[..., fx.GraphModule]
Anchor = Callable[[fx.Node], bool]

# Names of the pipeline's passes that are not families (keys of report.pass_seconds too).
RESERVED = ("canonicalize", "anchors", "recompute")


@dataclasses.dataclass(frozen=True)
class FamilyPass:
    """One registered family: its name, its pass, its anchor predicate (optional), and how it runs."""
    family: str
    run: GraphPass
    anchor: Optional[Anchor] = None
    whole_module: bool = False  # run once on the top-level graph, which reaches into its bodies itself
    builtin: bool = False


_registry: list[FamilyPass] = []


def family_passes() -> tuple[FamilyPass, ...]:
    """The registered families in the order their passes run."""
    return tuple(_registry)


def families() -> tuple[str, ...]:
    """The names of the registered families, in the order their passes run (built-in ones and the user's)."""
    return tuple(p.family for p in _registry)


def _check_signature(name: str, run: GraphPass) -> None:
    if not callable(run):
        raise TypeError(f"sloth.register_family: the pass for {name!r} must be callable, got {type(run).__name__}")
    try:
        signature = inspect.signature(run)
    except (TypeError, ValueError):
        return  # a builtin or C callable without a signature: take it on trust
    try:
        signature.bind(None, None, report=None, options=None)
    except TypeError as error:
        raise TypeError(f"sloth.register_family: the pass for {name!r} must take (gm, example_inputs, *, report, "
                        f"options) and return the graph module; its signature is {signature} ({error})") from None


def register_family(name: str, run: GraphPass, *, anchor: Optional[Anchor] = None, before: Optional[str] = None,
                    after: Optional[str] = None, whole_module: bool = False, _builtin: bool = False) -> FamilyPass:
    """Add the family ``name`` whose pass is ``run`` to the pipeline, ``before`` or ``after`` a registered
    family (at most one of them; neither: after every family registered so far). Returns its entry.

    Errors name the problem: a name that is not an identifier, clashes with a registered family or one of
    the pipeline's own passes; an unknown or doubled position; a pass that cannot be called as
    ``run(gm, example_inputs, report=..., options=...)``; an anchor that is not callable.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"sloth.register_family: a family's name must be an identifier string, got {name!r}")
    taken = {p.family: p for p in _registry}
    if name in taken:
        kind = "a built-in family" if taken[name].builtin else "a family registered earlier"
        raise ValueError(f"sloth.register_family: {name!r} is already {kind}; pick another name "
                         "(sloth.unregister_family removes one you registered)")
    if name in RESERVED:
        raise ValueError(f"sloth.register_family: {name!r} is the name of one of the pipeline's own passes "
                         f"{list(RESERVED)}; pick another name")
    _check_signature(name, run)
    if anchor is not None and not callable(anchor):
        raise TypeError(f"sloth.register_family: anchor for {name!r} must be a predicate on fx nodes, "
                        f"got {type(anchor).__name__}")
    if before is not None and after is not None:
        raise ValueError("sloth.register_family: give before= or after=, not both")
    position = len(_registry)
    for where, offset in ((before, 0), (after, 1)):
        if where is None:
            continue
        if where not in taken:
            raise ValueError(f"sloth.register_family: {'before' if offset == 0 else 'after'}={where!r} is not a "
                             f"registered family; registered: {list(families())}")
        position = list(taken).index(where) + offset
    entry = FamilyPass(name, run, anchor=anchor, whole_module=bool(whole_module), builtin=_builtin)
    _registry.insert(position, entry)
    return entry


def unregister_family(name: str) -> None:
    """Remove a family registered with ``register_family`` (sloth's built-in ones stay: switch them off with
    ``options={"patterns": [...]}``)."""
    for i, entry in enumerate(_registry):
        if entry.family == name:
            if entry.builtin:
                raise ValueError(f"sloth.unregister_family: {name!r} is a built-in family; leave it out of "
                                 "options={'patterns': [...]} to switch it off")
            del _registry[i]
            return
    raise ValueError(f"sloth.unregister_family: no family {name!r} is registered; registered: {list(families())}")
