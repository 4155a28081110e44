"""Which tests are slow: those that took at least ``THRESHOLD_S`` seconds (setup, call and teardown together) in a
full run on the CPU, listed in tests/slow.txt. The README's test command leaves them out (tests/conftest.py), so
CI stays under 15 minutes on 2 cores; ``python -m pytest tests --slow`` runs them too, and the GPU lane always does.

What stays in the default run covers every family on every path: each op's tests on the interpreter and on its
PyTorch reference, each family's pattern tests, the model-level tests of both paths (tests/test_reference_path.py,
tests/test_models.py), the completeness check. What goes is the long tail: whole-trainer runs (TRL, Trainer,
torchrun), two-process runs, the coverage sweep's architectures beyond a few, model-sized checkpointed compiles.

To measure again (about 35 minutes on 2 cores), then rewrite the list:

    python -m pytest tests -q --slow --durations=0 > durations.txt
    python tests/slow.py durations.txt

Or, when CI nears its limit, add the default run's slowest (about 12 minutes): every test of at least
``ADD_THRESHOLD_S`` but those of ``KEEP`` (one whole-model run of each kind that CI keeps on purpose) and the fastest
of them in a file that would otherwise keep fewer than ``MIN_LEFT`` tests in the default run:

    python -m pytest tests -q --durations=0 > durations.txt
    python tests/slow.py --add durations.txt
"""
from __future__ import annotations

import collections
import os
import re
import sys

THRESHOLD_S = 4.0
ADD_THRESHOLD_S = 2.0
MIN_LEFT = 3  # tests a file keeps in the default run at the least, whatever they take
# Whole-model tests the default run keeps however long they take: a transformers model through every family in fp32
# and in bf16, a partial-rotary one, and the loss without logits.
KEEP = {"test_models.py::test_model_matches_eager[fp32-llama]", "test_models.py::test_model_matches_eager[bf16-qwen3]",
        "test_models.py::test_partial_rotary_model_matches_eager[phi]",
        "test_models.py::test_return_logits_false_drops_the_logits[llama]"}
HEADER = f"# tests that took >= {THRESHOLD_S:g} s on the CPU (tests/slow.py writes this file; --slow runs them)"
LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow.txt")


def read() -> set[str]:
    """The node ids listed in tests/slow.txt (relative to tests/, as pytest names them there)."""
    with open(LIST, encoding="utf-8") as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def _seconds(durations_output: str) -> collections.Counter:
    seconds: collections.Counter = collections.Counter()
    for line in durations_output.splitlines():
        match = re.match(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+)", line)
        if match:
            seconds[match.group(2)] += float(match.group(1))
    return seconds


def add(durations_output: str) -> int:
    """Add the default run's tests of at least ADD_THRESHOLD_S to the list, but KEEP's and, in each file, enough of
    the fastest to leave it ``MIN_LEFT`` tests in the default run; how many were added."""
    listed = read()
    seconds = _seconds(durations_output)
    left: collections.Counter = collections.Counter(n.split("::")[0] for n in seconds if n not in listed)
    new = set()
    for name in sorted((n for n, s in seconds.items() if s >= ADD_THRESHOLD_S and n not in KEEP and n not in listed),
                       key=lambda n: -seconds[n]):
        file = name.split("::")[0]
        if left[file] > MIN_LEFT:
            new.add(name)
            left[file] -= 1
    with open(LIST, "w", encoding="utf-8") as f:
        f.write(f"{HEADER}; and a default run's >= {ADD_THRESHOLD_S:g} s (tests/slow.py --add)\n")
        f.writelines(f"{n}\n" for n in sorted(listed | new))
    return len(new)


def write(durations_output: str) -> int:
    seconds = _seconds(durations_output)
    slow = sorted(n for n, s in seconds.items() if s >= THRESHOLD_S and n not in KEEP)
    with open(LIST, "w", encoding="utf-8") as f:
        f.write(HEADER + "\n")
        f.writelines(f"{n}\n" for n in slow)
    return len(slow)


if __name__ == "__main__":
    if sys.argv[1] == "--add":
        with open(sys.argv[2], encoding="utf-8") as f:
            print(f"{add(f.read())} slow tests added to {LIST}")
    else:
        with open(sys.argv[1], encoding="utf-8") as f:
            print(f"{write(f.read())} slow tests listed in {LIST}")
