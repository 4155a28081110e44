"""Convergence: a small Llama trained on real text for many steps, eager against sloth, from the same seed.

    python -m benchmarks.convergence [--steps 300] [--inner inductor] [--plot results/PATH.png]
    python -m benchmarks.convergence --replot results/RECORD.json --plot results/PATH.png   # a record's curves

One step's parity (the tests) does not show that an error too small to see in one step stays small over a run,
nor that the fused backward trains a model as well as autograd's. This runs the whole loop twice, the same
weights, batches and optimiser each time: once eagerly, once through ``torch.compile(backend="sloth")`` with
every family on, and compares the loss curves.

Text: the Python standard library's own ``.py`` sources (they ship with every Python), concatenated in sorted
path order, as bytes: vocabulary 256, no tokenizer. Batches are random windows (seeded), the same for both runs.
Model: Llama-shaped (RMSNorm, RoPE, SwiGLU, GQA, untied head), fp32, every parameter trained (AdamW, lr 3e-3), so
every family's forward and every gradient it returns shape the run.

Comparison: each curve smoothed by a trailing mean over ``window`` steps; the largest relative gap between the
smoothed curves after the first window, and the gap of the final smoothed losses. Two runs of the same program in
fp32 drift apart by rounding alone (the order of a sum differs between kernels), so the gap is held to a stated
bound, not to zero; the learning itself is shown by the final loss against the first.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import common

VOCAB = 256  # bytes


def corpus(n_bytes: int) -> torch.Tensor:
    """The first ``n_bytes`` of the standard library's ``.py`` files, concatenated in sorted path order, as int64."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= n_bytes:
            break
    data = b"".join(chunks)[:n_bytes]
    if len(data) < n_bytes:
        raise RuntimeError(f"the standard library at {root} holds only {len(data)} bytes of .py sources")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of ``batch`` random windows of ``seq`` bytes (a seeded generator: the same for both runs)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq, (steps, batch), generator=g)
    return [torch.stack([data[s:s + seq] for s in row.tolist()]) for row in starts]


def small_llama(seed: int, hidden: int, layers: int, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, rms_norm_eps=1e-5)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(device)


def train(data: list[torch.Tensor], *, compiled: bool, options: dict[str, Any], seed: int, hidden: int,
          layers: int, lr: float, device: str, backend: str = "sloth") -> tuple[list[float], Any]:
    """The loss of each step of one run; with ``compiled`` the model runs through ``backend`` (sloth's report
    returned; ``"inductor"``: plain torch.compile, the rounding-noise baseline)."""
    import sloth

    model = small_llama(seed, hidden, layers, device)
    model.train()
    if compiled and backend == "inductor":
        run = torch.compile(model)
    else:
        run = torch.compile(model, backend="sloth", options=options) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sloth.reset_report()
    losses = []
    for ids in data:
        ids = ids.to(device)
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, sloth.report() if compiled and backend == "sloth" else None


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def compare(eager: list[float], ours: list[float], window: int) -> dict[str, float]:
    """The largest relative gap of the smoothed curves after the first ``window`` steps, the final smoothed losses'
    relative gap, and the learning (first loss, final smoothed losses)."""
    a, b = smoothed(eager, window), smoothed(ours, window)
    gaps = [abs(x - y) / abs(x) for x, y in zip(a[window:], b[window:])]
    return {"first loss": eager[0], "eager final": a[-1], "sloth final": b[-1],
            "max smoothed gap": max(gaps) if gaps else 0.0, "final gap": abs(a[-1] - b[-1]) / abs(a[-1])}


def run_both(steps: int, batch: int = 8, seq: int = 64, hidden: int = 64, layers: int = 2, lr: float = 3e-3,
             window: int = 10, seed: int = 0, options: dict[str, Any] | None = None, device: str = "cpu",
             baseline: bool = False) -> tuple[list[float], list[float], dict[str, float], Any, list[float] | None]:
    """(eager losses, sloth losses, compare(...), sloth's report, Inductor's losses or None) for one configuration;
    with ``baseline`` the same run also goes through plain torch.compile, its gaps to eager added to the summary."""
    data = batches(corpus(1 << 20), steps, batch, seq, seed)
    kwargs = dict(seed=seed, hidden=hidden, layers=layers, lr=lr, device=device)
    eager, _ = train(data, compiled=False, options={}, **kwargs)
    ours, report = train(data, compiled=True, options=options or {}, **kwargs)
    summary = compare(eager, ours, window)
    inductor = None
    if baseline:
        inductor, _ = train(data, compiled=True, options={}, backend="inductor", **kwargs)
        base = compare(eager, inductor, window)
        summary |= {"inductor final": base["sloth final"], "inductor max smoothed gap": base["max smoothed gap"],
                    "inductor final gap": base["final gap"]}
    return eager, ours, summary, report, inductor


def _plot(eager: list[float], ours: list[float], window: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(smoothed(eager, window), label="eager", color="0.4")
    ax.plot(smoothed(ours, window), label="sloth", color="#c44e52", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {window} steps)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--inner", default="inductor", help="sloth's inner compiler (aot_eager: faster on a CPU)")
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of both smoothed curves (needs matplotlib)")
    parser.add_argument("--baseline", action="store_true",
                        help="also train through plain torch.compile (Inductor): how far rounding alone moves a run")
    parser.add_argument("--replot", type=Path, default=None,
                        help="draw --plot from this record (a JSON this script wrote) instead of training")
    args = parser.parse_args(argv)
    if args.replot:
        record = json.loads(args.replot.read_text())
        cfg = record["config"]
        if not args.plot:
            parser.error("--replot needs --plot")
        _plot([r["eager loss"] for r in record["rows"]], [r["sloth loss"] for r in record["rows"]], cfg["window"],
              args.plot, f"Llama-shaped {cfg['layers']} x {cfg['hidden']}, stdlib bytes, {cfg['steps']} steps, "
              f"{record['env']['device']}: eager vs sloth (every family)")
        print(f"wrote {args.plot}")
        return 0
    common.use_triton_interpreter_without_cuda()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    common.import_sloth()
    options = {} if args.inner == "inductor" else {"inner": args.inner}
    start = time.perf_counter()
    eager, ours, summary, report, inductor = run_both(args.steps, args.batch, args.seq, args.hidden, args.layers,
                                                      window=args.window, options=options, device=device,
                                                      baseline=args.baseline)
    seconds = time.perf_counter() - start
    print(report)
    for key, value in summary.items():
        print(f"{key}: {value:.4g}")
    print(f"{seconds:.0f} s")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"device": device}
    rows = [{"step": i, "eager loss": e, "sloth loss": s} for i, (e, s) in enumerate(zip(eager, ours))]
    for row, loss in zip(rows, inductor or []):
        row["inductor loss"] = loss
    record = common.result_record("convergence", config | {"summary": summary, "sites": dict(report.counts),
                                                            "seconds": round(seconds, 1)},
                                  ["step", "eager loss", "sloth loss"] + (["inductor loss"] if inductor else []), rows)
    for path in common.write_result(record, suffix=f"-s{args.steps}"):
        print(f"wrote {path}")
    if args.plot:
        _plot(eager, ours, args.window, args.plot, f"Llama-shaped {args.layers} x {args.hidden}, stdlib bytes, "
              f"{args.steps} steps, {device}: eager vs sloth (every family)")
        print(f"wrote {args.plot}")
    return 0 if math.isfinite(summary["sloth final"]) else 1


if __name__ == "__main__":
    sys.exit(main())
