"""Linear + cross-entropy benchmark: eager, Inductor, Liger and sloth's fused op, plus a chunk sweep.

    python -m benchmarks.ops.cross_entropy [--smoke] [--sweep 32,64,128,256,512,1024]

The issue's shape: 4096 tokens x hidden 4096 x vocab 128256, bf16, mean over non-ignored labels
(-100 on a tenth of them), in two cases: a frozen head (LoRA and QLoRA: only dx is wanted) and a
trainable head (full fine-tuning: dx and dw). The op is matmul-bound, so the rate column is TFLOP/s
against the measured bf16 matmul peak: fwd+bwd does 2NVH FLOPs for the logits and 2NVH per gradient
(dx, and dw when trainable). "peak MiB" is memory allocated above the inputs during one call (the
issue's target: sloth's at most 10% of Inductor's). Liger is `LigerFusedLinearCrossEntropyLoss`
when liger_kernel imports, else its rows say why not. TRL's rows are the fused LM head TRL 1.16's trainers call
(``trl.kernels.ChunkedLogProbFunction``: per-token log-probabilities, the loss their negated sum over the
non-ignored tokens divided by their count, as ``SFTTrainer.compute_loss`` takes it), called as
``add_fused_lm_head`` calls it on a GPU (the non-ignored rows gathered first), once with the log-probabilities
alone (DPO's call) and once with the entropy and top-1 beside them (SFT's call, for its metrics); sloth's
``reduction="none"`` row is the per-token form a replacement of TRL's head would build on.

`--sweep` times sloth fwd+bwd at each rows-per-chunk value (the launcher's own rule is replaced for
the sweep only), so the rule in lowering/linear_cross_entropy.chunk_rows can be checked.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import sys
import types
from typing import Any, Callable

import torch

from benchmarks import common
from benchmarks.ops import harness


TRL_NOTES: list[str] = []  # how TRL's head was imported, when not as installed (in the record's config)
_OPTIONAL = ("trl logp", "trl logp+ent+top1")  # rows of packages that may be missing (TRL)


def _liger_provider() -> Callable | str:
    """Liger's fused linear cross-entropy as ``fn(x, w, labels)``, or why it is not available."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # not installed, or fails to import on this torch: the row says so
        return f"{type(exc).__name__}: {exc}"
    loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="mean")
    return lambda x, w, labels: loss_fn(w, x, labels)


def trl_head() -> type | str:
    """TRL's ``ChunkedLogProbFunction``, or why it is not available (its version noted in ``TRL_NOTES``)."""
    try:
        from trl.kernels import ChunkedLogProbFunction
    except Exception as exc:  # not installed: the row says so
        return f"{type(exc).__name__}: {exc}"
    version = f"trl {importlib.metadata.version('trl')}"
    if version not in TRL_NOTES:
        TRL_NOTES.append(version)
    try:  # the backward imports maybe_gather_lm_head_ctx (DeepSpeed ZeRO-3's gather; a no-op here) from it
        from trl.trainer import utils  # noqa: F401
    except Exception as exc:  # trl.trainer's dependencies (datasets, ...) not installed: the no-op in its place
        stub = types.ModuleType("trl.trainer.utils")
        stub.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        sys.modules["trl.trainer.utils"] = stub
        TRL_NOTES.append(f"trl.trainer.utils did not import ({type(exc).__name__}: {exc}); its "
                         "maybe_gather_lm_head_ctx, a no-op without DeepSpeed ZeRO-3, was stubbed as one")
    return ChunkedLogProbFunction


def _trl_provider(outputs: tuple[str, ...]) -> Callable | str:
    """TRL's fused LM head as ``fn(x, w, labels)`` -> the SFT loss, or why it is not available."""
    head = trl_head()
    if isinstance(head, str):
        return head

    def loss(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = labels != -100
        per_token = head.apply(x[mask], w, None, labels[mask], 1.0, 32768, None, 1.0, outputs)
        return -per_token[0].sum() / mask.sum().clamp(min=1)
    return loss


def _sloth_per_token(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """sloth's op with ``reduction="none"`` (recomputed in the backward), averaged outside it."""
    from sloth.lowering.linear_cross_entropy import linear_cross_entropy

    per_token = linear_cross_entropy(x, w, None, labels, reduction="none")
    return per_token.sum() / (labels != -100).sum().clamp(min=1)


def _inputs(n: int, hidden: int, vocab: int, device: str, train_head: bool) -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(n, hidden, generator=gen) / 4).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(device, torch.bfloat16)
    w.requires_grad_(train_head)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.1] = -100
    return [x, w, labels.to(device)]


def _add_rates(rows: list[dict[str, Any]], n: int, hidden: int, vocab: int, train_head: bool,
               peak_tflops: float) -> None:
    grads = 2 if train_head else 1
    flops = {"fwd": 2 * n * vocab * hidden, "bwd": 2 * grads * n * vocab * hidden,
             "fwd+bwd": 2 * (1 + grads) * n * vocab * hidden}
    for row in rows:
        ms = row.get("kernel ms") or row.get("ms")
        if ms:
            row["TFLOP/s"] = flops[row["mode"]] / (ms * 1e-3) / 1e12
            row["% peak"] = 100 * row["TFLOP/s"] / peak_tflops


def chunk_sweep(n: int, hidden: int, vocab: int, device: str, chunks: list[int]) -> list[dict[str, Any]]:
    """sloth fwd+bwd kernel ms and peak MiB at each rows-per-chunk value, frozen and trainable head."""
    from sloth.lowering import linear_cross_entropy as lce

    rule = lce.chunk_rows
    rows = []
    try:
        for train_head in (False, True):
            inputs = _inputs(n, hidden, vocab, device, train_head)
            for chunk in chunks:
                lce.chunk_rows = lambda *_, c=chunk: c
                fn = lambda x, w, labels: lce.linear_cross_entropy(x, w, None, labels)  # noqa: E731
                ms, kernel, peak = harness.time_case(fn, inputs, "fwd+bwd")
                rows.append({"head": "trainable" if train_head else "frozen", "rows/chunk": chunk, "ms": ms,
                             "kernel ms": kernel, "peak MiB": peak / common.MiB if peak is not None else None,
                             "rule": rule(n, vocab, hidden, train_head)})
                print(f"sweep {rows[-1]['head']:>9} chunk {chunk:5d}: {ms:8.3f} ms, kernel {kernel or 0:8.3f} ms, "
                      f"peak {rows[-1]['peak MiB'] or 0:8.0f} MiB", flush=True)
    finally:
        lce.chunk_rows = rule
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="", help="comma-separated rows per chunk to time (sloth only)")
    args, device = harness.start(__doc__, argv, parser)
    from sloth.lowering.linear_cross_entropy import linear_cross_entropy
    from sloth.patterns.cross_entropy import linear_cross_entropy_pattern

    n, hidden, vocab = (37, 16, 1000) if args.smoke else (4096, 4096, 128256)
    copy_gbps = common.copy_bandwidth_gbps()
    peak_tflops = common.matmul_tflops() if device == "cuda" else 1.0
    rows: list[dict[str, Any]] = []
    for train_head in (False, True):
        pattern = lambda x, w, labels: linear_cross_entropy_pattern(x, w, None, labels)  # noqa: E731
        torch._dynamo.reset()
        providers: dict[str, Callable] = {"eager": pattern, "inductor": torch.compile(pattern, dynamic=False),
                                          "sloth": lambda x, w, labels: linear_cross_entropy(x, w, None, labels)}
        liger = _liger_provider()
        if callable(liger) and device == "cuda":
            providers["liger"] = liger
        providers["sloth none"] = _sloth_per_token
        missing = {}
        for name, outputs in (("trl logp", ("log_probs",)), ("trl logp+ent+top1", ("log_probs", "entropy", "is_top1"))):
            trl = _trl_provider(outputs)
            if callable(trl):
                providers[name] = trl
            else:
                missing[name] = trl
        inputs = _inputs(n, hidden, vocab, device, train_head)
        e = inputs[0].element_size()
        # Minimal bytes (x, w, dx; dw when trained): the % copy columns only show how far from
        # bandwidth-bound the op is; TFLOP/s is the column that matters.
        weight_bytes = vocab * hidden * e
        weight_passes = 2 if train_head else 1
        nbytes = {"fwd": n * hidden * e + weight_bytes, "bwd": 2 * n * hidden * e + weight_bytes * weight_passes,
                  "fwd+bwd": 2 * n * hidden * e + weight_bytes * weight_passes}
        case = f"{'trainable' if train_head else 'frozen'} head {n}x{hidden}x{vocab}"
        case_rows = harness.run(case, providers, inputs, nbytes, copy_gbps)
        if not callable(liger):
            case_rows.append({"shape": case, "mode": "fwd+bwd", "provider": "liger", "error": liger[:120]})
        case_rows += [{"shape": case, "mode": "fwd+bwd", "provider": name, "error": why[:120]}
                      for name, why in missing.items()]
        _add_rates(case_rows, n, hidden, vocab, train_head, peak_tflops)
        rows += case_rows
    columns = harness.COLUMNS[:-1] + ["TFLOP/s", "% peak", "error"]
    print(common.render_text(columns, rows))
    sweep = chunk_sweep(n, hidden, vocab, device, [int(c) for c in args.sweep.split(",") if c]) if args.sweep else []
    if sweep:
        print(common.render_text(["head", "rows/chunk", "rule", "ms", "kernel ms", "peak MiB"], sweep))
    if not args.smoke:
        config = {"dtype": "bfloat16", "tokens": n, "hidden": hidden, "vocab": vocab, "ignored": "10% of labels",
                  "copy_gbps": copy_gbps, "matmul_tflops": peak_tflops, "chunk sweep": sweep, "trl": TRL_NOTES}
        record = common.result_record("cross_entropy", config, columns, rows)
        for path in common.write_result(record):
            print(f"wrote {path}")
    return 1 if any("error" in r and r["provider"] not in ("liger", *_OPTIONAL) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
