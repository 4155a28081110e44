"""Autocast made explicit, for passes that replace an op autocast would have cast.

Under ``torch.autocast(device, dtype=d)`` (TRL's and transformers' ``bf16=True`` put it around the forward of a
float32 model) Dynamo's graph holds the ops as written and no casts: an op on autocast's lower-precision list
(``F.linear``, ``matmul``, SDPA) simply has a result in d while its inputs may be float32. Whether autocast was
entered outside the compiled function (no node says so) or inside it (``_enter_autocast`` / ``_exit_autocast``
nodes), the node's fake value is what autocast made of it. Without autocast those ops need one dtype for all their
floating-point operands and return it, so a result in another dtype than an operand's is autocast's doing, which
ran ``op(x.to(d), w.to(d), ...)``.

A custom op gets no autocast casts (the autocast dispatch keys fall through for it), so a pass that replaces such
an op with one must give it its inputs in d itself: ``autocast_dtype`` says which d, ``cast_to`` inserts the cast.
Backward then follows the casts as autocast's would: each operand's gradient is cast back to its own dtype.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.fx as fx

from .canonicalize import cast
from .fx_utils import dtype_of, insert_call

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def autocast_dtype(result: fx.Node, operands: dict[str, Any],
                   dtypes: tuple[torch.dtype, ...] = FUSED_DTYPES) -> Union[torch.dtype, str, None]:
    """The dtype autocast ran ``result`` (a linear, matmul or SDPA node) in, when one of its ``operands`` (by
    name, for the reason; None entries are absent operands) is in another dtype; None when they all share the
    result's dtype (no autocast, or inputs already in its dtype); why not when the result or an operand is not
    one of ``dtypes``, the fused op's."""
    d = dtype_of(result)
    present = {name: dtype_of(node) for name, node in operands.items() if node is not None}
    if d is None or all(dtype == d for dtype in present.values()):
        return None
    odd = next(((name, dtype) for name, dtype in [("the result", d), *present.items()] if dtype not in dtypes), None)
    if odd is not None:
        return (f"autocast runs {result.name} in {d} with {odd[0]} in {odd[1]}; the fused op takes "
                f"{', '.join(map(str, dtypes))}").replace("torch.", "")
    return d


def cast_to(before: fx.Node, node: Any, dtype: Optional[torch.dtype]) -> Any:
    """``node`` cast to ``dtype`` (autocast's cast, made explicit), inserted before ``before``; None, a None
    dtype and a tensor already in ``dtype`` are returned as they are."""
    if node is None or dtype is None or dtype_of(node) == dtype:
        return node
    return insert_call(before.graph, before, cast, (node, dtype), meta_from=before)
