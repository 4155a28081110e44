"""Launch-size arithmetic for the host side of the kernels (grids, tile sizes), in plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton ``ConstexprFunction`` objects in Triton 3.6: a call
from the host costs about 1.5 us (unwrapping constexprs), against 0.02 us for the integer expression, and a
LoRA forward plus backward makes ~20 such calls, ~224 times a step on Llama-3-8B, where sloth's step
without CUDA graphs is bound by the host. Same results (checked against Triton's for 0..2^16 in the tests);
a symbolic size (a SymInt while an op is traced) goes to Triton's own functions.
"""
from __future__ import annotations

from typing import Any

import triton


def cdiv(a: Any, b: Any) -> Any:
    """ceil(a / b) for positive b: the number of size-``b`` blocks covering ``a``."""
    return -(-a // b)


def next_power_of_2(n: Any) -> Any:
    """The smallest power of 2 >= n for n >= 1, 0 for n <= 0 (``triton.next_power_of_2``'s values)."""
    if isinstance(n, int):
        return 1 << (n - 1).bit_length() if n > 0 else 0
    return triton.next_power_of_2(n)
