"""sloth's options, parsed and checked here and nowhere else: ``torch.compile(model, backend="sloth", options={...})``.

``parse_options(user)`` splits the user's dict into sloth's ``Options`` (typed, defaults filled in, bad values
refused with a message naming the option) and the Inductor config patches (every other key must be an Inductor
config name, dotted ones such as ``"triton.cudagraphs"`` too); a key that is neither is refused with the closest
names ("did you mean ...?"), as is a misspelt key inside ``offload`` or ``tiled_mlp``. The passes read
``PassOptions``, the part of ``Options`` they need, passed to every pass as ``options=`` (one signature for all).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from typing import Any, Optional

from .dump import dump_root
from .families import families

# What compiles the rewritten graph: Inductor, AOTAutograd without codegen, or plain eager (the ``inner`` option).
INNER_COMPILERS = ("inductor", "aot_eager", "eager")
# The ``memory`` option's goals (compiler/planner.py); a positive number of GiB is a budget.
MEMORY_GOALS = ("auto", "min", "off")


def check_memory(memory: Any) -> Any:
    """``memory`` if it is a goal or a budget (a finite number of GiB above 0), else a ValueError saying so."""
    if isinstance(memory, str) and memory in MEMORY_GOALS:
        return memory
    if isinstance(memory, numbers.Real) and not isinstance(memory, bool) and math.isfinite(memory) and memory > 0:
        return float(memory)
    raise ValueError(f"sloth: memory must be one of {list(MEMORY_GOALS)} or a number of GiB above 0, got {memory!r}")
# Names for the ``attention`` option: PyTorch's SDPA backends.
SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")
DEFAULT_MIN_BYTES = 64 * 2**20  # below this (8k tokens of a 4096-wide model in bf16) a copy costs more than it frees
OFFLOAD_NEEDS_PARTITION = ("sloth: offload acts on AOTAutograd's forward/backward partition, which inner='eager' "
                           "does not make; use inner='inductor' (default) or 'aot_eager'")


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """The ``offload`` option (compiler/offload_partition.py): which saved activations go to host memory.

    ``True`` gives the defaults; a dict sets any of the fields."""
    min_bytes: int = DEFAULT_MIN_BYTES
    """Offload saved tensors of at least this many bytes."""
    keep_last: int = 1
    """Keep on the device the ones the backward reads first (their reload could not hide behind anything)."""
    mid_layer: bool = False
    """Also save (and so offload) each checkpointed layer's residual stream between its blocks
    (``save_mid_layer_residuals``)."""
    prefetch_after_attention: bool = True
    """Where an attention backward runs between two reloads, start the second's copy only after it
    (``offload_saved``): one layer-sized buffer less at that backward (measured on an H100 at 16k tokens: 17.06
    instead of 17.19 GiB, 1831.0 against 1832.5 ms a step,
    benchmarks/results/2026-12-06_issue19_issue20_h100_morning2.md)."""


@dataclasses.dataclass(frozen=True)
class TiledMlpOptions:
    """The ``tiled_mlp`` option (patterns/tiled_mlp.py): a LoRA MLP run a block of rows at a time.

    ``True`` gives blocks of lowering/tiled_mlp.py's ``DEFAULT_TILE_ROWS``; a number sets the rows; a dict sets
    ``rows`` and/or ``recompute``."""
    rows: int
    """Rows per block: an MLP with more rows than that becomes one op run a block at a time."""
    recompute: bool = True
    """Recompute each block's gate and up in the backward instead of keeping them (the form measured on the H200:
    benchmarks/results/2026-12-02_issue19_tiled_mlp.md)."""


@dataclasses.dataclass(frozen=True)
class Options:
    """Every sloth option, as ``parse_options`` reads it from the user's dict; the defaults are the product's."""
    memory: Any = "auto"
    """The memory goal the plan's savers follow (compiler/planner.py): "auto", "min", "off" or a budget in GiB."""
    inner: str = "inductor"
    """What compiles the rewritten graph: "inductor", or "aot_eager" / "eager" for debugging."""
    patterns: Optional[tuple[str, ...]] = None
    """The families to run, by name (``[]``: none of sloth's passes); None: every registered family."""
    report: bool = False
    """Print each graph's report as it is compiled."""
    return_logits: Any = True
    """True: logits returned beside a fused loss are computed in the graph; "lazy": computed only when read (a frozen
    head's, in a training graph); False: an empty tensor in their place (``PassOptions``)."""
    recompute: bool = True
    """Recompute RMSNorm outputs in the backward instead of keeping them; False leaves it to Inductor."""
    share_lora_input: bool = True
    """LoRA linears that read one input (q, k, v; gate, up) become one op; False keeps one op each."""
    offload: Optional[OffloadOptions] = None
    """Saved activations to pinned host memory and back (None: off)."""
    tiled_mlp: Optional[TiledMlpOptions] = None
    """A LoRA MLP run a block of rows at a time (None: off)."""
    moe_recompute: bool = False
    """The MoE experts op recomputes its first grouped GEMM in the backward instead of keeping it."""
    mask_check: bool = True
    """An attention-mask input nobody proved causal is checked on the device once per tensor; False: no sync."""
    dump: Optional[str] = None
    """The folder for the graph before and after each pass (compiler/dump.py), or None; ``parse_options`` fills in
    ``$SLOTH_DUMP_DIR`` when the option is not given, and ``True`` means ``./sloth_dump``."""
    attention: Optional[tuple[str, ...]] = None
    """SDPA backends in priority order, from ``SDPA_BACKENDS``; None: PyTorch's own choice."""
    disable: tuple[str, ...] = ()
    """Passes switched off by name: families, and the partition / post-grad passes of compiler/late_passes.py."""
    given: frozenset[str] = frozenset()
    """Not an option: the names the user gave, whose values the plan leaves as they are."""

    def pass_options(self) -> "PassOptions":
        """What the passes read."""
        tiled = self.tiled_mlp
        return PassOptions(return_logits=self.return_logits, recompute=self.recompute,
                           share_lora_input=self.share_lora_input, tiled_mlp=tiled.rows if tiled else 0,
                           tiled_mlp_recompute=tiled.recompute if tiled else False, mask_check=self.mask_check,
                           moe_recompute=self.moe_recompute)


@dataclasses.dataclass(frozen=True)
class PassOptions:
    """Switches that trade exact semantics for memory; the defaults keep the model's outputs as they were.

    ``return_logits``: False lets the cross-entropy pass return an empty tensor in place of the logits
    when a loss is fused and the logits' only other use is being returned, so they are never computed
    (top-level graph only: a subgraph's outputs feed its caller); "lazy" returns them computed only when read
    (patterns/returned_logits.py), where the head is frozen and a backward follows.

    ``recompute``: True lets cheap sloth ops (RMSNorm) be recomputed in the backward instead of keeping
    their outputs from the forward (compiler/recompute.py); False keeps them, as Inductor would decide.

    ``share_lora_input``: True makes the LoRA linears that read one input (q, k, v; gate, up) one op, dense
    or 4-bit (patterns/lora_shared.py: fewer op calls and launches, x read once); False keeps one op each.
    The values are the same math; the input gradient's sum is rounded as eager rounds it rather than once.

    ``tiled_mlp``: rows per block, or 0 (off): a LoRA MLP with more rows than that becomes one op whose GLU,
    down projection and backward run a block at a time (patterns/tiled_mlp.py), so the backward's own rows x
    intermediate tensors exist one block at a time: memory for long context. ``tiled_mlp_recompute`` (True
    unless the user says otherwise): the op also recomputes each block's gate and up in the backward instead of
    keeping them, so no such tensor outlives a block, at the price of two GEMMs a block.

    ``moe_recompute``: True makes the MoE experts op (patterns/moe.py) keep nothing of its first GEMM's output
    for the backward and recompute it there (the gather of the token rows, the gate/up grouped GEMM and its
    adapter): S x 2I elements a layer less at the peak (96 MiB a layer at Qwen3-MoE's 2 x 2048 tokens, 1.1 GiB
    over its 12 layers) for one more grouped GEMM a layer, which a host-bound step hides. False (the default)
    keeps it.

    ``mask_check``: True lets a graph that reads an attention mask another graph or eager code made, which no
    compile-time proof covers, compare that tensor's values with the causal mask on the device once (one host
    sync per new mask tensor) and run ``is_causal`` attention when it is causal (patterns/mask_inputs.py,
    runtime/proven_masks.py); False runs such masks as written, with no sync.
    """
    return_logits: Any = True
    recompute: bool = True
    share_lora_input: bool = True
    tiled_mlp: int = 0
    tiled_mlp_recompute: bool = True
    mask_check: bool = True
    moe_recompute: bool = False
    # Not a user option: whether the pass may change the graph's outputs (the top-level graph, whose outputs
    # the backend's wrapper sees; patterns/returned_logits.py), False in subgraph bodies.
    top_level: bool = True


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options) if f.name != "given")


def parse_options(user: Optional[dict[str, Any]]) -> tuple[Options, dict[str, Any]]:
    """sloth's options from the user's dict, and the rest as Inductor config patches; a ValueError naming the
    option for a bad value, and for a key that is neither sloth's nor Inductor's, with the closest names."""
    import torch._inductor
    import torch._inductor.config as inductor_config

    user = dict(user or {})
    unknown = [k for k in user if k not in OPTION_NAMES and not (isinstance(k, str) and hasattr(inductor_config, k))]
    if unknown:
        names = OPTION_NAMES + tuple(torch._inductor.list_options())
        hints = "".join(_did_you_mean(k, names) for k in unknown)
        raise ValueError(f"sloth: unknown option(s) {unknown}{hints}; sloth's own options are {list(OPTION_NAMES)}, "
                         "and any other key must be an Inductor config name")
    inductor = {k: v for k, v in user.items() if k not in OPTION_NAMES}
    inner = user.get("inner", "inductor")
    if inner not in INNER_COMPILERS:
        raise ValueError(f"sloth: inner must be one of {list(INNER_COMPILERS)}, got {inner!r}")
    memory = check_memory(user.get("memory", "auto"))
    options = Options(
        memory=memory,
        inner=inner,
        patterns=_patterns(user.get("patterns")),
        report=bool(user.get("report", False)),
        return_logits=_return_logits(user.get("return_logits", True)),
        recompute=_bool(user, "recompute", True),
        share_lora_input=_bool(user, "share_lora_input", True),
        offload=_offload(user.get("offload", False)),
        tiled_mlp=_tiled_mlp(user.get("tiled_mlp", False)),
        moe_recompute=_bool(user, "moe_recompute", False),
        mask_check=_bool(user, "mask_check", True),
        dump=dump_root(user.get("dump")),
        attention=check_attention(user.get("attention")),
        disable=_disable(user.get("disable", ())),
        given=frozenset(k for k in user if k in OPTION_NAMES),
    )
    # Checks across options, before any work.
    if options.offload is not None and inner == "eager":
        raise ValueError(OFFLOAD_NEEDS_PARTITION)
    if inductor and inner != "inductor":
        raise ValueError(f"sloth: options {list(inductor)} are Inductor settings, but inner={inner!r}")
    return options, inductor


def _did_you_mean(key: Any, names: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(key), names, n=3)
    return f" ({key!r}: did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _return_logits(value: Any) -> Any:
    if value is True or value is False or value == "lazy":
        return value
    raise ValueError(f"sloth: return_logits must be True, False or 'lazy', got {value!r}")


def _bool(user: dict[str, Any], name: str, default: bool) -> bool:
    value = user.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"sloth: {name} must be True or False, got {value!r}")
    return value


def _patterns(value: Any) -> Optional[tuple[str, ...]]:
    """The families the user chose (one name or a list), None for all; a clear error for a name that is not a
    registered family."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    chosen = tuple(value)
    registered = families()
    unknown = [p for p in chosen if p not in registered]
    if unknown:
        raise ValueError(f"sloth: unknown pattern famil{'y' if len(unknown) == 1 else 'ies'} {unknown}; "
                         f"known: {list(registered)}")
    return chosen


def _disable(value: Any) -> tuple[str, ...]:
    """The passes switched off (one name or a list): registered families and the late passes; a clear error, with
    the closest names, for any other."""
    from .late_passes import LATE_PASS_NAMES

    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"sloth: disable must be a pass name or a list of them, got {value!r}")
    known = families() + LATE_PASS_NAMES
    unknown = [n for n in names if n not in known]
    if unknown:
        hints = "".join(_did_you_mean(n, known) for n in unknown)
        raise ValueError(f"sloth: disable: unknown pass(es) {unknown}{hints}; the passes are the families "
                         f"{list(families())} and {list(LATE_PASS_NAMES)}")
    return tuple(names)


def check_attention(names: Any) -> Optional[tuple[str, ...]]:
    """The ``attention`` option as a tuple of SDPA backends, or None; a clear error for anything else."""
    if names is None:
        return None
    if not isinstance(names, (list, tuple)) or not names or any(n not in SDPA_BACKENDS for n in names):
        raise ValueError(f"sloth: attention must be a non-empty list of SDPA backends from {list(SDPA_BACKENDS)} "
                         f"in priority order, got {names!r}")
    return tuple(names)


def _offload(value: Any) -> Optional[OffloadOptions]:
    """``offload``: False/None off, True the defaults, or a dict of ``OffloadOptions``' fields."""
    if value is None or value is False:
        return None
    if value is True:
        return OffloadOptions()
    if isinstance(value, dict):
        fields = tuple(f.name for f in dataclasses.fields(OffloadOptions))
        unknown = [k for k in value if k not in fields]
        if unknown:
            hints = "".join(_did_you_mean(k, fields) for k in unknown)
            raise ValueError(f"sloth: offload takes min_bytes, keep_last, mid_layer and prefetch_after_attention, "
                             f"not {sorted(unknown)}{hints}")
        policy = OffloadOptions(**value)
        for name in ("min_bytes", "keep_last"):
            got = getattr(policy, name)
            if not isinstance(got, int) or isinstance(got, bool) or got < 0:
                raise ValueError(f"sloth: offload's {name} must be an integer >= 0, got {got!r}")
        for name in ("mid_layer", "prefetch_after_attention"):
            got = getattr(policy, name)
            if not isinstance(got, bool):
                raise ValueError(f"sloth: offload's {name} must be True or False, got {got!r}")
        return policy
    raise ValueError(f"sloth: offload must be True, False or a dict of min_bytes / keep_last / mid_layer / "
                     f"prefetch_after_attention, got {value!r}")


def _tiled_mlp(value: Any) -> Optional[TiledMlpOptions]:
    """``tiled_mlp``: False off, True (blocks of lowering/tiled_mlp.py's DEFAULT_TILE_ROWS), a number of rows, or
    {"rows": N, "recompute": bool}; recompute unless told otherwise."""
    message = (f"sloth: tiled_mlp must be True, False, a positive number of rows per block or "
               f"{{'rows': N, 'recompute': True/False}}, got {value!r}")
    recompute = True
    if isinstance(value, dict):
        fields = ("rows", "recompute")
        unknown = [k for k in value if k not in fields]
        if unknown:
            raise ValueError(message + "".join(_did_you_mean(k, fields) for k in unknown))
        if not isinstance(value.get("recompute", True), bool):
            raise ValueError(message)
        recompute = value.get("recompute", True)
        value = value.get("rows", True)
    if value is False:
        return None
    if value is True:
        from ..lowering.tiled_mlp import DEFAULT_TILE_ROWS

        return TiledMlpOptions(DEFAULT_TILE_ROWS, recompute)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(message)
    return TiledMlpOptions(value, recompute)
