"""The family registry: how a pattern family is declared, and the one way it joins the pipeline.

A family is declared once, in its own patterns file, as a ``Family``: its name, its pass, its place in the
order, its anchor (where its sites are), the ops it puts in graphs and the options it reads::

    DECLARATION = Family("rms_norm", fuse_rms_norm_pass, order=20, anchor=anchor, emits=("rms_norm",),
                         summary="RMSNorm (Llama, Gemma's 1 + w, q/k norms) -> one op")

The pipeline finds every ``DECLARATION`` in sloth's patterns package (``declared_families``) and registers
them in ``order``; the completeness check, the report, the family tables (README.md and docs/families.md,
written by ``python -m sloth.compiler.families``) and the family-wide tests are built from the same declarations, so adding a
family touches its patterns file, its lowering file(s) and its tests (docs/extending.md).

A user's family joins the same registry at run time:

    sloth.register_family("scaled_tanh", fuse_scaled_tanh, anchor=is_tanh, after="glu")

A pass has the pipeline's one signature

    pass(gm, example_inputs, *, report, options) -> gm

It gets everything a built-in one gets: it runs on the top-level graph and on every subgraph body (unless
``whole_module``, which runs once on the top level and reaches into the bodies itself), after
canonicalisation, with the report and the options; it is timed in ``report.pass_seconds``, shown in the graph
dumps and switched off by name like any family (``options={"disable": [...]}``). With an ``anchor`` (a
predicate on canonical-graph nodes, one per site a user would expect handled) every anchor the pass neither
replaced nor explained with ``report.reject`` is reported as unexplained (compiler/anchors.py).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from typing import Any, Callable, Iterable, Optional

import torch.fx as fx

GraphPass = Callable[..., fx.GraphModule]
Anchor = Callable[[fx.Node], bool]

# Names of the pipeline's passes that are not families (keys of report.pass_seconds too); the partition and
# post-grad passes' names (compiler/late_passes.py) are taken as well (``_taken_names``).
RESERVED = ("canonicalize", "anchors", "recompute")


def _taken_names() -> tuple[str, ...]:
    from .late_passes import LATE_PASS_NAMES  # (imports Inductor's pass machinery: only when a user registers)

    return RESERVED + LATE_PASS_NAMES


@dataclasses.dataclass(frozen=True)
class Family:
    """One family: its declaration (sloth's own, in its patterns file) or a user's registration.

    ``order``: a built-in family's place (lower runs first; a family may rely on the ones before it having run).
    ``emits``: the ``torch.ops.sloth`` ops its pass puts in graphs (their ``_backward`` ops come with them).
    ``reads``: the ``PassOptions`` fields its pass reads. ``summary``: one line for the docs' family table.

    What a family needs beyond its pass, each declared with it (the backend calls them without knowing the family):
    ``records``: the keys of ``gm.meta`` its pass writes (cleared before the passes: a graph split by Dynamo's DDP
    optimizer gives every piece the whole graph's meta dict). ``cut_sites(gm)``: (node, reason) for each half of its
    pattern that a graph boundary cut and ``gm`` returns, which no anchor sees. ``compile_with(gm, compile_once,
    options)``: how a graph its pass rewrote is compiled, where that is not one call of ``compile_once(first=True)``
    (the causal mask: twice, the version chosen per call). ``after_compile(gm, compiled)``: the compiled graph
    wrapped (the cross-entropy family's returned logits put back into autograd)."""
    name: str
    run: GraphPass
    order: Optional[int] = None
    anchor: Optional[Anchor] = None
    whole_module: bool = False  # run once on the top-level graph, which reaches into its bodies itself
    emits: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    summary: str = ""
    records: tuple[str, ...] = ()
    cut_sites: Optional[Callable[[fx.GraphModule], Iterable[tuple[fx.Node, str]]]] = None
    compile_with: Optional[Callable[..., Callable]] = None
    after_compile: Optional[Callable[[fx.GraphModule, Callable], Callable]] = None
    builtin: bool = False


_registry: list[Family] = []


def family_passes() -> tuple[Family, ...]:
    """The registered families in the order their passes run."""
    return tuple(_registry)


def families() -> tuple[str, ...]:
    """The names of the registered families, in the order their passes run (built-in ones and the user's)."""
    return tuple(p.name for p in _registry)


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
                    after: Optional[str] = None, whole_module: bool = False) -> Family:
    """Add the family ``name`` whose pass is ``run`` to the pipeline, ``before`` or ``after`` a registered
    family (at most one of them; neither: after every family registered so far). Returns its entry.

    Errors name the problem: a name that is not an identifier, clashes with a registered family or one of
    the pipeline's own passes; an unknown or doubled position; a pass that cannot be called as
    ``run(gm, example_inputs, report=..., options=...)``; an anchor that is not callable.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"sloth.register_family: a family's name must be an identifier string, got {name!r}")
    taken = {p.name: p for p in _registry}
    if name in taken:
        kind = "a built-in family" if taken[name].builtin else "a family registered earlier"
        raise ValueError(f"sloth.register_family: {name!r} is already {kind}; pick another name "
                         "(sloth.unregister_family removes one you registered)")
    if name in _taken_names():
        raise ValueError(f"sloth.register_family: {name!r} is the name of one of the pipeline's own passes "
                         f"{list(_taken_names())}; pick another name")
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
    entry = Family(name, run, anchor=anchor, whole_module=bool(whole_module))
    _registry.insert(position, entry)
    return entry


def unregister_family(name: str) -> None:
    """Remove a family registered with ``register_family`` (sloth's built-in ones stay: switch them off with
    ``options={"disable": [...]}``)."""
    for i, entry in enumerate(_registry):
        if entry.name == name:
            if entry.builtin:
                raise ValueError(f"sloth.unregister_family: {name!r} is a built-in family; leave it out of "
                                 "options={'patterns': [...]} to switch it off")
            del _registry[i]
            return
    raise ValueError(f"sloth.unregister_family: no family {name!r} is registered; registered: {list(families())}")


def declared_families(package: str = "sloth.patterns") -> list[Family]:
    """Every ``DECLARATION`` (a ``Family``) in the modules of ``package``, in ``order``. Errors name a declaration
    without an order, two with one name or one order, and a declaration that is not a ``Family``."""
    found: list[Family] = []
    root = importlib.import_module(package)
    for info in sorted(pkgutil.iter_modules(root.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{package}.{info.name}")
        declared = getattr(module, "DECLARATION", None)
        if declared is None:
            continue
        if not isinstance(declared, Family) or declared.order is None:
            raise TypeError(f"sloth: {module.__name__}.DECLARATION must be a Family with an order, got {declared!r}")
        found.append(declared)
    for key in ("name", "order"):
        values = [getattr(f, key) for f in found]
        doubled = sorted({v for v in values if values.count(v) > 1})
        if doubled:
            raise ValueError(f"sloth: two families declare the same {key}: {doubled}")
    return sorted(found, key=lambda f: f.order)


def register_declared(package: str = "sloth.patterns") -> None:
    """Register the declared families of ``package`` (sloth's own: ``compiler.pipeline`` calls this at import)."""
    for declared in declared_families(package):
        if declared.name in families():
            continue
        _check_signature(declared.name, declared.run)
        _registry.append(dataclasses.replace(declared, builtin=True))


def pass_records() -> set[str]:
    """Every registered family's ``records``: the keys of ``gm.meta`` sloth's passes write."""
    return {key for f in _registry for key in f.records}


def compile_with_families(gm: fx.GraphModule, compile_once: Callable[[bool], Callable], options: Any) -> Callable:
    """``gm`` compiled through every registered family's ``compile_with`` (in registry order, the first outermost),
    then wrapped by each one's ``after_compile``; with none, ``compile_once(True)``."""
    def through(hooks: list[Callable[..., Callable]], first: bool) -> Callable:
        if not hooks:
            return compile_once(first)
        return hooks[0](gm, lambda inner_first: through(hooks[1:], first and inner_first), options)

    compiled = through([f.compile_with for f in _registry if f.compile_with is not None], True)
    return after_compile(gm, compiled)


def after_compile(gm: fx.GraphModule, compiled: Callable) -> Callable:
    """``compiled`` wrapped by every registered family's ``after_compile``, in registry order."""
    for f in _registry:
        if f.after_compile is not None:
            compiled = f.after_compile(gm, compiled)
    return compiled


def family_table() -> str:
    """The docs' family table (docs/families.md), from the declarations: name, what it fuses, ops, options read."""
    rows = ["| family | fuses | ops | options read |", "|---|---|---|---|"]
    for f in declared_families():
        ops = ", ".join(f"`sloth.{op}`" for op in f.emits) or "none (SDPA's own arguments)"
        reads = ", ".join(f"`{r}`" for r in f.reads) or "-"
        rows.append(f"| `{f.name}` | {f.summary} | {ops} | {reads} |")
    return "\n".join(rows) + "\n"


TABLE_BEGIN, TABLE_END = "<!-- family table: python -m sloth.compiler.families -->", "<!-- end of family table -->"


def write_family_table(path: str) -> bool:
    """Rewrite the table between the markers in ``path``; whether it changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    new = text[:start] + "\n" + family_table() + text[end:]
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text


# The files whose family table is written from the declarations, relative to the repository root.
TABLE_FILES = ("README.md", "docs/families.md")

if __name__ == "__main__":
    import os

    from sloth.compiler import families as registry  # the package's module (this file runs as __main__ here)

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in TABLE_FILES:
        path = os.path.join(root, name)
        print(("rewrote " if registry.write_family_table(path) else "up to date: ") + path)
