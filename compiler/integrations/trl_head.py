"""TRL's fused LM head run by sloth's ``linear_token_logprobs`` in a process that trains with sloth.

TRL 1.16's trainers (SFT, DPO, KTO, GRPO, RLOO) give the model a fused LM head (``trl.trainer.utils.add_fused_lm_head``)
and call ``model(..., fused_lm_head=True)``, which runs the backbone, then ``_ChunkedLogProbFunction.apply(hidden,
weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs)`` on the labelled rows: per-token
log-probabilities and, as asked, the entropy, log sum p^2, the mean logit and is-top-1. No graph holds that head for
a pass to find: Dynamo breaks the graph before it (the labelled rows are a boolean-mask selection) and inside it
(``torch.mm(..., out=)``), so it runs eagerly. This integration puts sloth's op in its place: the same outputs from
one pass over vocabulary tiles, and for a frozen head (LoRA) the log-probabilities' dx computed in the forward
(``dx_in_forward``), two N x V x H matmuls where TRL's head does three (lowering/token_logprobs.py).

When it acts: when the call runs inside a ``torch.compile`` with sloth's backend (``backend="sloth"``,
``sloth.sloth_backend``, a ``functools.partial`` of it, under DDP too; ``sloth.explain`` shows it) and the
``token_logprobs`` family on (``options={"disable": ["token_logprobs"]}`` gives TRL's head back), and not under
DeepSpeed ZeRO-3 (TRL gathers the partitioned head for its own backward). Dynamo traces the head's frame
(``torch.compiler.is_compiling``): which backend the trace is for is read once at trace time
(``assume_constant_result``), and sloth's op goes into the graph, where the report lists it. On the CPU TRL scores
every row and the head joins the model's graph; on a GPU TRL first selects the labelled rows (a boolean mask: a
graph break), and the head is in the graph after it. A frame Dynamo gave up on runs eagerly inside the compiled call:
the backend is then the active compile callback's, the report gets the site once per ``sloth.reset_report()``, and
if sloth's op raises there (logged), TRL's head runs from then on. A traced call has no such fallback: an error
there is a compile error. Anywhere else (eager training, another backend, a lambda around sloth's backend), TRL's
own head runs. ``SLOTH_TRL_HEAD=0`` turns the integration off.

Differences from TRL's head, none in the values' meaning: sloth's rounding (fp32 statistics from the logits tile
in the compute dtype, as TRL's), ``chunk_size`` unused (sloth picks its own rows per tile), and an entropy that gets
a gradient after all is recomputed in the backward (TRL's trainers log it without one).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

from .import_hooks import when_imported

log = logging.getLogger("sloth")

_MODULE = "trl.trainer.utils"
_NAME = "_ChunkedLogProbFunction"  # how add_fused_lm_head refers to TRL's head, looked up at each call
_STATISTICS = ("log_sum_sq_probs", "mean_logits", "is_top1")
SITE_DETAIL = ("TRL's fused LM head (trl.kernels.ChunkedLogProbFunction), run by sloth: "
               "compiler/integrations/trl_head.py")


class SlothLMHead:
    """Stands in for TRL's ``ChunkedLogProbFunction``: ``apply`` takes its arguments and returns its five outputs."""

    def __init__(self, trl_head: Any) -> None:
        self.trl_head = trl_head
        self.failed: Optional[str] = None  # why sloth's op gave way to TRL's for the rest of the process

    def apply(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
              temperature: float, chunk_size: int, final_logit_softcapping: Optional[float] = None,
              logit_scale: float = 1.0, outputs: tuple[str, ...] = ("entropy", *_STATISTICS)) -> tuple:
        args = (hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)
        if self.failed is not None or hasattr(weight, "ds_id"):  # ds_id: a DeepSpeed ZeRO-3 parameter
            return self.trl_head.apply(*args)
        if torch.compiler.is_compiling():
            return _sloth_head(*args) if _traced_for_sloth() else self.trl_head.apply(*args)
        if not _running_under_sloth():
            return self.trl_head.apply(*args)
        try:
            result = _sloth_head(*args)
        except Exception as exc:  # never a crash of the user's step: TRL's head, and the log says why
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("sloth: TRL's fused LM head could not run on sloth's op (%s); TRL's own head runs from now on",
                        self.failed)
            return self.trl_head.apply(*args)
        from ..backend import note_site
        note_site("token_logprobs", "sloth.linear_token_logprobs", SITE_DETAIL)
        return result


def _sloth_options(backend: Any) -> Optional[dict]:
    """The options given to sloth's backend, when ``backend`` (a compile callback, or the backend Dynamo compiles
    for) is sloth's, through any of its wrappers: Dynamo's own (``_torchdynamo_orig_backend``), torch.compile's
    (``compiler_name``, ``compiler_fn``, ``kwargs``), DDP's graph splitter (``DDPOptimizer.compile_fn``, holding the
    backend as ``backend_compile_fn``), ``functools.partial(sloth_backend, options=...)``, and ``sloth.explain``'s
    capture; else None (a lambda around sloth's backend cannot be seen through: TRL's head runs there)."""
    from ..backend import sloth_backend

    options: dict = {}
    for _ in range(16):  # the wrappers, outermost first
        if backend is sloth_backend or getattr(backend, "sloth_explain", False):
            return options
        if getattr(backend, "compiler_name", None) == "sloth":
            return {**options, **((getattr(backend, "kwargs", None) or {}).get("options") or {})}
        if isinstance(backend, functools.partial):
            options = {**(backend.keywords.get("options") or {}), **options}
            backend = backend.func
        elif hasattr(backend, "_torchdynamo_orig_backend"):
            backend = backend._torchdynamo_orig_backend
        elif hasattr(getattr(backend, "__self__", None), "backend_compile_fn"):
            backend = backend.__self__.backend_compile_fn
        elif hasattr(backend, "compiler_fn"):
            backend = backend.compiler_fn
        else:
            return None
    return None


def _family_on(options: Optional[dict]) -> bool:
    """Whether a compile with these options (None: not sloth's) runs the ``token_logprobs`` family."""
    if options is None:
        return False
    from ..families import families
    from ..options import parse_options

    opts, _ = parse_options(options)
    return "token_logprobs" in (families() if opts.patterns is None else opts.patterns) and \
        "token_logprobs" not in opts.disable


@torch._dynamo.assume_constant_result
def _traced_for_sloth() -> bool:
    """Called while Dynamo traces the head: whether the graph goes to sloth's backend with the family on. Dynamo
    runs this at trace time and keeps the answer as a constant of the graph (no guard: a graph is for one backend).
    Reads Dynamo's own state (the translator's output graph); if that ever changes, TRL's head runs."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return _family_on(_sloth_options(InstructionTranslator.current_tx().output.compiler_fn))
    except Exception:
        return False


def _running_under_sloth() -> bool:
    """Called eagerly: whether a ``torch.compile`` with sloth's backend (the family on) is running this call (a
    frame Dynamo gave up on runs eagerly with the compile's callback still set)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback

        callback = get_eval_frame_callback()
        return callback not in (None, False) and _family_on(_sloth_options(callback))
    except Exception:
        return False


def _sloth_head(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                temperature: float, chunk_size: int, final_logit_softcapping: Optional[float], logit_scale: float,
                outputs: tuple[str, ...]) -> tuple:
    """TRL's five outputs from ``torch.ops.sloth.linear_token_logprobs``: the matmul in the compute dtype TRL uses
    (autocast's, else the hidden states'), every row scored (TRL passes only labelled rows, or clamped labels)."""
    from ...lowering.token_logprobs import default_dx_in_forward
    from ...patterns.token_logprobs import NO_IGNORED_ROWS

    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    # TRL's conventions: any integer labels; a softcap given as 0.0 is a cap of 1.0 (``softcap or 1.0``)
    softcap = 0.0 if final_logit_softcapping is None else float(final_logit_softcapping or 1.0)
    x, w = hidden.to(dtype), weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    # the log-probabilities' dx in the forward (a frozen head); an entropy differentiated after all is recomputed
    dx_in_forward = default_dx_in_forward(x, w, b)
    entropy = "entropy" in outputs
    statistics = any(name in outputs for name in _STATISTICS)
    with torch.autocast(device, enabled=False):
        logp, ent, stats, _ = torch.ops.sloth.linear_token_logprobs.default(
            x, w, b, targets.long(), NO_IGNORED_ROWS, softcap, float(logit_scale),
            float(temperature), entropy, dx_in_forward, statistics)
    picked = {"entropy": ent, "log_sum_sq_probs": stats[3] if statistics else None,
              "mean_logits": stats[4] if statistics else None, "is_top1": stats[5] > 0.5 if statistics else None}
    return (logp, *(picked[name] if name in outputs else None for name in ("entropy", *_STATISTICS)))


def register(module: Any) -> bool:
    """Put ``SlothLMHead`` in TRL's place in ``module`` (``trl.trainer.utils``); False if TRL has no such head."""
    trl_head = getattr(module, _NAME, None)
    if trl_head is None or isinstance(trl_head, SlothLMHead):
        return isinstance(trl_head, SlothLMHead)
    from ...lowering.token_logprobs import register as register_op

    register_op()  # defined before any trace reaches the head
    setattr(module, _NAME, SlothLMHead(trl_head))
    return True


def install() -> None:
    """Register now if TRL's trainer utilities are loaded, else once they are (``SLOTH_TRL_HEAD=0``: never)."""
    when_imported(_MODULE, register, package="trl", switch="SLOTH_TRL_HEAD")
