"""Per-token log-probabilities (and entropy) of a linear head: sloth's token_logprobs op against TRL's fused head.

    python -m benchmarks.ops.token_logprobs [--smoke]

The shape of the RL-heads issue: 4096 tokens x hidden 4096 x vocab 128256, bf16, a frozen head (LoRA: only dx
is wanted), -100 on a tenth of the labels. Two cases, each reduced to the scalar a preference or RL loss ends in,
so every provider computes the same number and the same gradient:

- ``logp``: ``-sum_i logp_i / n_valid`` (a DPO loss's per-sequence log-probability sums, up to the sign and the
  grouping). sloth's mean cross-entropy (lowering/linear_cross_entropy.py) computes the same value and is the
  yardstick the issue names (the token op at most 1.1x its time);
- ``logp, ent logged``: the same loss, the entropy computed beside it for a metric (TRL's SFT and GRPO log it),
  no gradient through it; sloth's op as its pass emits it there (``dx_in_forward=1``, the default: the
  entropy's part of dx not computed);
- ``logp+ent``: ``-(sum_i logp_i + 0.01 sum_i H_i) / n_valid`` (an entropy bonus: both outputs get gradients;
  ``dx_in_forward=0``, as the pass emits it there: both parts recomputed in one backward pass), and ``sloth dx
  1+2``, both parts in the forward (``dx_in_forward=3``, slower on an H100 on 2026-12-08, kept to watch it).

Providers: eager (the logits, ``log_softmax``, ``gather``), Inductor on the same code, sloth's
``linear_token_logprobs``, and TRL 1.16's ``ChunkedLogProbFunction`` called as its trainers call it (the
non-ignored rows gathered first), with the outputs its trainers ask for: the log-probabilities (DPO), with the
entropy (GRPO with an entropy term), and with the entropy and is-top-1 (SFT's metrics). The issue's targets: the
token op at most 0.8x TRL's time for log-probs + entropy, and at most 1.1x sloth's mean loss; memory at most TRL's.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from benchmarks import common
from benchmarks.ops import harness
from benchmarks.ops.cross_entropy import TRL_NOTES, _add_rates, _inputs, trl_head

ENTROPY_WEIGHT = 0.01


def _total(logp: torch.Tensor, ent: torch.Tensor | None, case: str) -> torch.Tensor:
    """The case's sum: the entropy added with its weight (``logp+ent``), or read without a gradient (``logged``:
    its sum times zero keeps it computed and out of the gradient)."""
    if ent is None:
        return logp.sum()
    return logp.sum() + (ENTROPY_WEIGHT * ent.sum() if case == "logp+ent" else 0.0 * ent.detach().sum())


def _eager(case: str) -> Callable:
    def loss(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = (x @ w.t()).float()
        logp_all = torch.log_softmax(logits, -1)
        valid = labels != -100
        logp = logp_all.gather(-1, labels.clamp(min=0)[:, None])[:, 0] * valid
        ent = -(logp_all.exp() * logp_all).sum(-1) * valid if case != "logp" else None
        return -_total(logp, ent, case) / valid.sum().clamp(min=1)
    return loss


def _sloth(case: str, both_in_forward: bool = False) -> Callable:
    from sloth.lowering.token_logprobs import ENTROPY_GRAD, LOGP_GRAD, linear_token_logprobs

    # As the graph pass emits the op (patterns/token_logprobs.py _dx_in_forward), or both parts in the forward.
    dx_in_forward = LOGP_GRAD | ENTROPY_GRAD if both_in_forward else 0 if case == "logp+ent" else None

    def loss(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logp, ent = linear_token_logprobs(x, w, None, labels, entropy=case != "logp", dx_in_forward=dx_in_forward)
        return -_total(logp, ent, case) / (labels != -100).sum().clamp(min=1)
    return loss


def _sloth_mean_loss(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from sloth.lowering.linear_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(x, w, None, labels)


def _trl(outputs: tuple[str, ...], case: str) -> Callable | str:
    head = trl_head()
    if isinstance(head, str):
        return head

    def loss(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = labels != -100
        logp, ent, *_ = head.apply(x[mask], w, None, labels[mask], 1.0, 32768, None, 1.0, outputs)
        return -_total(logp, ent, case) / mask.sum().clamp(min=1)
    return loss


def main(argv: list[str] | None = None) -> int:
    args, device = harness.start(__doc__, argv)
    n, hidden, vocab = (37, 16, 1000) if args.smoke else (4096, 4096, 128256)
    copy_gbps = common.copy_bandwidth_gbps()
    peak_tflops = common.matmul_tflops() if device == "cuda" else 1.0
    inputs = _inputs(n, hidden, vocab, device, train_head=False)
    e = inputs[0].element_size()
    weight_bytes = vocab * hidden * e
    nbytes = {"fwd": n * hidden * e + weight_bytes, "bwd": 2 * n * hidden * e + weight_bytes,
              "fwd+bwd": 2 * n * hidden * e + weight_bytes}
    rows: list[dict[str, Any]] = []
    missing: dict[str, str] = {}
    trl_calls = {"logp": {"trl logp": ("log_probs",)},
                 "logged": {"trl logp+ent+top1": ("log_probs", "entropy", "is_top1")},
                 "logp+ent": {"trl logp+ent": ("log_probs", "entropy")}}
    for case, trl_rows in trl_calls.items():
        torch._dynamo.reset()
        eager = _eager(case)
        providers: dict[str, Callable] = {"eager": eager, "inductor": torch.compile(eager, dynamic=False),
                                          "sloth": _sloth(case)}
        if case == "logp+ent":
            providers["sloth dx 1+2"] = _sloth(case, both_in_forward=True)
        if case == "logp":
            providers["sloth mean loss"] = _sloth_mean_loss
        for name, outputs in trl_rows.items():
            trl = _trl(outputs, case)
            if callable(trl):
                providers[name] = trl
            else:
                missing[name] = trl
        shape = f"{'logp, ent logged' if case == 'logged' else case} {n}x{hidden}x{vocab}"
        case_rows = harness.run(shape, providers, inputs, nbytes, copy_gbps)
        case_rows += [{"shape": shape, "mode": "fwd+bwd", "provider": name, "error": why[:120]}
                      for name, why in missing.items() if name in trl_rows]
        _add_rates(case_rows, n, hidden, vocab, False, peak_tflops)
        rows += case_rows
    columns = harness.COLUMNS[:-1] + ["TFLOP/s", "% peak", "error"]
    print(common.render_text(columns, rows))
    if not args.smoke:
        config = {"dtype": "bfloat16", "tokens": n, "hidden": hidden, "vocab": vocab, "head": "frozen",
                  "ignored": "10% of labels", "entropy weight": ENTROPY_WEIGHT, "copy_gbps": copy_gbps,
                  "matmul_tflops": peak_tflops, "trl": TRL_NOTES}
        record = common.result_record("token_logprobs", config, columns, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 1 if any("error" in r and not r["provider"].startswith("trl") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
