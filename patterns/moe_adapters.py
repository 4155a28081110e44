"""Adapters applied beside the expert GEMMs (part of ``moe_route``, patterns/moe.py): a hand-written MoE whose
experts carry per-expert LoRA factors as stacked 3-D inputs and apply them next to each expert GEMM instead of
merging them into its weight::

    base = gemm(rows, W[e])                                  W [E, n, k] or [E, k, n] (the site's layout)
    out  = base + s * gemm(gemm(rows, A[e]), B[e])           A [E, r, k] or [E, k, r];  B [E, n, r] or [E, r, n]

which is ``rows @ (W[e] + s B[e] A[e])^T`` (B, A in the [E, n, r] / [E, r, k] orientation): exactly the op's LoRA
arguments (lowering/moe.py ``*_lora_b`` [E, n, r], ``*_lora_a`` [E, r, k], ``*_lora_scale``), whose products it
forms as grouped GEMMs at rank r, factor gradients included. So these sites take the op unchanged.

How a pair is recognised, on the canonical graph, from three expert GEMMs (compiler/anchors.py: each reads a
stacked 3-D float input), the adapter's ``gA`` and ``gB`` and the base ``g0``:

  - gB's row operand is gA's result through the *path ops*: views, casts, a multiplication or division by a
    Python constant (the scale), dropout that is off (eval, or p = 0);
  - gB's result, through the path ops (and a tensor scale, noted for a refusal), is added (``add``, ``add`` with
    ``alpha``, ``+=``, ``add_``) to g0's result through views and casts;
  - gA's row operand is g0's (the same value through views and casts, or the same gather written twice), reached
    from gA through the path ops (a scale on the adapter's input counts);
  - the shapes: A's two dims are r < k, B's r < n (the same r), and W's are {n, k}.

The orientation of each factor is read off which of its dims is r; the scale s is the product of the constants on
the way (and add's alpha). Neither is trusted alone: the probes (patterns/moe.py ``_accept``) compare the region
with the pattern on ``W + s B A`` with random nonzero factors, so a wrong orientation, a missed scale or a
different function is refused there, not fused.

What is recognised but refused (the site stays as written, the report says why): a tensor scale (a parameter,
a per-expert mask: the op's scale is a float), dropout active in training (the op has no dropout on the adapter's
input), factors for another number of experts than the weights (an adapter on some experts only), factors in
another dtype than the weights (the op takes them in the tokens' dtype; casting them would change the adapter's
rounding from what was written), and two adapters each found beside one GEMM (the op takes one a GEMM). Two
adapters summed onto one GEMM's result (``base + (l1 + l2)``, ``base + l1 + l2``) are not found as two: at most
the first is, the region reads the other's factors, and is refused with that reason.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx as fx

from .moe_sites import expert_operand, expert_weight_arg
from ..compiler.fx_utils import op_name, is_number, tensor_of

# Views and casts a path may pass through (canonical names; ``cast`` is the canonical dtype conversion).
_VIEWS = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "transpose", "permute", "t",
          "contiguous", "expand", "to", "cast", "type_as", "clone"}
_ADDS = {"add", "add_", "iadd", "__iadd__"}


@dataclasses.dataclass
class BesideAdapter:
    """``g0``'s result plus ``scale * gemm(gemm(rows, A[e]), B[e])``, with ``a``, ``b`` the factors' graph inputs.
    ``a_transposed``: A stored [E, k, r] (else [E, r, k]); ``b_transposed``: B stored [E, r, n] (else [E, n, r]).
    ``why_not``: recognised, but the op cannot take it (the site is refused with this reason)."""
    g0: fx.Node
    ga: fx.Node
    gb: fx.Node
    a: fx.Node
    b: fx.Node
    a_transposed: bool
    b_transposed: bool
    rank: int
    scale: float
    why_not: Optional[str] = None
    others: tuple[fx.Node, ...] = ()  # the GEMMs of further adapters beside g0 (refused: one a GEMM)

    def factors(self) -> tuple[fx.Node, fx.Node]:
        return self.a, self.b

    def op_factors(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B [E, n, r], A [E, r, k]), the op's orientation, from values of the stored factors (views)."""
        return (b.transpose(1, 2) if self.b_transposed else b), (a.transpose(1, 2) if self.a_transposed else a)


def _dropout(node: fx.Node) -> tuple[float, bool]:
    """(p, training) of ``F.dropout(x, p=0.5, training=True, inplace=False)`` / ``torch.dropout(x, p, train)``."""
    args, kwargs = node.args, node.kwargs
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
    return p, training


def _step(node: fx.Node) -> Optional[tuple[fx.Node, float, Optional[str]]]:
    """For a node on an adapter's path: (the operand whose value it carries, the constant factor it applies, why
    the op could not take it or None); None where no adapter path passes through ``node``."""
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], (fx.Node,
                                                                                                       int, float)):
        return None
    name, args = op_name(node), node.args
    if name in _VIEWS and isinstance(args[0], fx.Node):
        return args[0], 1.0, None
    if name in ("dropout", "dropout_") and isinstance(args[0], fx.Node):
        p, training = _dropout(node)
        if not is_number(p) or not isinstance(training, bool):
            return args[0], 1.0, "a dropout on the adapter whose rate or mode is not a constant"
        active = training and p > 0
        return args[0], 1.0, (f"dropout (p={p}) on the adapter is active in training; the op has none (eval mode or "
                              "p=0 fuse)" if active else None)
    if name not in ("mul", "div") or len(args) != 2 or node.kwargs:
        return None
    lhs, rhs = args
    if isinstance(lhs, fx.Node) and is_number(rhs):
        return (lhs, float(rhs), None) if name == "mul" else (lhs, 1.0 / rhs, None) if rhs else None
    if name == "mul" and isinstance(rhs, fx.Node) and is_number(lhs):
        return rhs, float(lhs), None
    if not (isinstance(lhs, fx.Node) and isinstance(rhs, fx.Node)):
        return None
    # both tensors: a scale when one operand has the result's shape and the other broadcasts to it (a scalar
    # parameter, a per-row factor); an elementwise product of two full tensors (act(gate) * up) is no path
    out, shapes = tensor_of(node), [tensor_of(n) for n in (lhs, rhs)]
    if out is None or None in shapes:
        return None
    full = [n for n, v in zip((lhs, rhs), shapes) if tuple(v.shape) == tuple(out.shape)]
    if len(full) != 1 or (name == "div" and full[0] is not lhs):
        return None
    other = rhs if full[0] is lhs else lhs
    return full[0], 1.0, (f"the adapter is scaled by a tensor ({other.name!r}, {tuple(tensor_of(other).shape)}); the "
                          "op's LoRA scale is a constant")


def rows_of(gemm: fx.Node) -> Optional[fx.Node]:
    """The float operand of an expert GEMM that is not its stacked weight (the rows it multiplies; a grouped GEMM's
    integer offsets are not), or None."""
    weight_arg, _ = expert_weight_arg(gemm)
    tensors = [a for a in gemm.args if isinstance(a, fx.Node) and a is not weight_arg
               and tensor_of(a) is not None and tensor_of(a).is_floating_point()]
    return tensors[0] if len(tensors) == 1 else None


def _viewed(node: fx.Node) -> list[fx.Node]:
    """``node`` and what it is a view or cast of, nearest first."""
    chain = [node]
    while op_name(chain[-1]) in _VIEWS and chain[-1].op != "placeholder" and chain[-1].args \
            and isinstance(chain[-1].args[0], fx.Node):
        chain.append(chain[-1].args[0])
    return chain


def _same_call(a: fx.Node, b: fx.Node) -> bool:
    """The same call on the same operands (``x[token]`` written twice), whose values are then equal."""
    return a.op == b.op and a.op in ("call_function", "call_method") and a.target == b.target \
        and a.args == b.args and a.kwargs == b.kwargs


def _back(start: fx.Node, stop) -> tuple[Optional[fx.Node], float, list[str]]:
    """Walk back from ``start`` through the path ops until ``stop(node)``: (that node or None, the constant scale
    on the way, reasons the op could not take the path)."""
    node, scale, reasons = start, 1.0, []
    for _ in range(32):
        if stop(node):
            return node, scale, reasons
        step = _step(node)
        if step is None:
            return None, scale, reasons
        node, factor, why_not = step
        scale *= factor
        reasons += [why_not] if why_not else []
    return None, scale, reasons


def _added_to(gb: fx.Node) -> tuple[Optional[fx.Node], float, list[str]]:
    """Follow gB's result forward through the path ops to the add that puts it beside something: (that other
    operand, the constant scale, reasons), or None where the result goes anywhere else."""
    node, scale, reasons = gb, 1.0, []
    for _ in range(32):
        if len(node.users) != 1:
            return None, scale, reasons
        user = next(iter(node.users))
        name = op_name(user)
        if name in _ADDS and len(user.args) == 2 and set(user.kwargs) <= {"alpha"}:
            side = user.args.index(node) if node in user.args else -1
            alpha = user.kwargs.get("alpha", 1)
            if side < 0 or user.args[0] is user.args[1] or not is_number(alpha) or (side == 0 and alpha != 1):
                return None, scale, reasons  # (with alpha the adapter must be the scaled operand, args[1])
            other = user.args[1 - side]
            return (other, scale * alpha, reasons) if isinstance(other, fx.Node) else (None, scale, reasons)
        step = _step(user)
        if step is None or step[0] is not node:
            return None, scale, reasons
        node, (_, factor, why_not) = user, step
        scale *= factor
        reasons += [why_not] if why_not else []
    return None, scale, reasons


def _dims(node: fx.Node) -> Optional[tuple[int, int, int]]:
    value = tensor_of(node)
    return tuple(value.shape) if value is not None and value.dim() == 3 else None


def _beside(gb: fx.Node, gemms: set[fx.Node]) -> Optional[BesideAdapter]:
    """The adapter whose second GEMM is ``gb``, or None where ``gb`` is not one."""
    rows = rows_of(gb)
    if rows is None:
        return None
    ga, scale, reasons = _back(rows, lambda n: n in gemms and n is not gb)
    if ga is None:
        return None
    base, post, more = _added_to(gb)
    if base is None:
        return None
    g0 = next((n for n in _viewed(base) if n in gemms and n not in (ga, gb)), None)
    if g0 is None or rows_of(g0) is None or rows_of(ga) is None:
        return None
    base_rows = _viewed(rows_of(g0))
    meet, pre, first = _back(rows_of(ga), lambda n: n in base_rows or _same_call(n, base_rows[-1]))
    if meet is None:
        return None
    a, b, w = expert_operand(ga), expert_operand(gb), expert_operand(g0)
    shapes = [_dims(n) for n in (a, b, w)]
    if None in shapes:
        return None
    (ea, *sa), (eb, *sb), (e, *sw) = shapes
    rank, k, n = min(sa), max(sa), max(sb)
    if sa[0] == sa[1] or sb[0] == sb[1] or min(sb) != rank or sorted((k, n)) != sorted(sw):
        return None  # not low rank, or not W's widths: no adapter of this GEMM
    why_not = next(iter(first + reasons + more), None)
    if why_not is None and (ea != e or eb != e):
        why_not = (f"the adapter's factors hold {ea} and {eb} experts' weights, the expert weights {e} (an adapter on "
                   "some experts only); the op takes one adapter an expert")
    dtypes = {tensor_of(n).dtype for n in (a, b)}
    if why_not is None and dtypes != {tensor_of(w).dtype}:
        why_not = (f"the adapter's factors are {', '.join(sorted(str(d).replace('torch.', '') for d in dtypes))} "
                   f"beside {str(tensor_of(w).dtype).replace('torch.', '')} expert weights; the op takes them in the "
                   "tokens' dtype (a cast would round the adapter unlike the code does)")
    return BesideAdapter(g0, ga, gb, a, b, a_transposed=sa[0] == k, b_transposed=sb[0] == rank, rank=rank,
                         scale=scale * post * pre, why_not=why_not)


def beside_adapters(gemms: list[fx.Node]) -> dict[fx.Node, BesideAdapter]:
    """The adapters applied beside expert GEMMs among ``gemms``, by their base GEMM g0. A GEMM with two adapters
    beside it gets the first with a reason (the op takes one a GEMM)."""
    found: dict[fx.Node, BesideAdapter] = {}
    pool = set(gemms)
    for gb in gemms:
        adapter = _beside(gb, pool)
        if adapter is None:
            continue
        if adapter.g0 in found:
            found[adapter.g0].why_not = "two adapters beside one expert GEMM; the op takes one a GEMM"
            found[adapter.g0].others += (adapter.ga, adapter.gb)
            continue
        found[adapter.g0] = adapter
    return found


def adapter_gemms(adapters: dict[fx.Node, BesideAdapter]) -> set[fx.Node]:
    """The expert GEMMs that belong to adapters (not the experts' own: they take no part in pairing)."""
    return {g for a in adapters.values() for g in (a.ga, a.gb, *a.others)}


def merged_weight(weight: torch.Tensor, adapter: Optional[BesideAdapter], a: Optional[torch.Tensor],
                  b: Optional[torch.Tensor]) -> torch.Tensor:
    """``weight`` [E, n, k] (the op's layout) plus ``scale * B @ A``, in fp32, for the probes' pattern."""
    if adapter is None:
        return weight
    lora_b, lora_a = adapter.op_factors(a.float(), b.float())
    return weight + adapter.scale * torch.bmm(lora_b, lora_a)

