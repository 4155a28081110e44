"""Packed supervised fine-tuning: useful tokens/s of padded against packed batches, eager / Inductor / sloth / Unsloth.

    python -m benchmarks.packed_sft --all                    # every variant, each in its own process (H200)
    python -m benchmarks.packed_sft --all --smoke            # CPU, 2-layer toy, a few hundred tokens a step

The workload (issue 18): a synthetic instruction-tuning set, fixed seed, document lengths log-normal with
median 300 tokens and sigma 0.9 (clipped to 16..4096; mean ~450), random token ids; the Llama-3-8B shape of
benchmarks/e2e.py with peft LoRA r=16 on every linear, bf16, fused AdamW, gradient checkpointing
(non-reentrant; Unsloth's own, offloaded, for Unsloth); about 16k tokens a step for every variant:

    padded   documents bucketed by length (the smallest of 256, 512, 1024, 2048, 4096 that holds them), each
             bucket's batches 16384 / bucket rows padded to the bucket, with ``attention_mask`` (a padded
             collator with length grouping; a bucket's last batch is filled up with its own first documents)
    packed   documents back to back in one row of 16384 tokens (first fit in dataset order), the tail padded
             with pads at position 0; position ids restart per document, no attention mask, labels -100 on
             each document's first token and the pads (DataCollatorWithFlattening's and TRL's padding-free
             format); Unsloth's batch also carries its ``packed_seq_lengths`` (pads: length-1 documents)

Every variant trains on the same documents (the ones that fill --steps packed rows). Compiled variants run
with ``automatic_dynamic_shapes`` off, so each padded bucket compiles once with static shapes (the masks'
families need them) and the packed row has one shape. Warm-up: one batch of each shape a variant sees; then
every batch is timed between two CUDA events. Useful tokens are the non-pad tokens a step trains on;
``useful tok/s`` = their sum / the time of all timed batches. ``syncs/step`` counts host syncs in one more
packed (or first-bucket) step (``torch.cuda.set_sync_debug_mode``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import common, copy_overlap

VARIANTS = ["eager-padded", "inductor-padded", "inductor-packed", "sloth-padded", "sloth-packed", "unsloth-packed"]
BUCKETS = (256, 512, 1024, 2048, 4096)
COLUMNS = ["variant", "useful tok/s", "x eager padded", "ms per 16k useful", "pad %", "peak GiB", "batches",
           "warm-up s", "first loss", "syncs/step", "sloth sites", "error"]


def document_lengths(total_tokens: int, seed: int, median: float, sigma: float, low: int, high: int) -> list[int]:
    """Log-normal lengths (median ``median``, shape ``sigma``) clipped to [low, high], until their sum
    reaches ``total_tokens``."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total_tokens:
        draw = torch.randn(256, generator=g).mul(sigma).add(math.log(median)).exp()
        lengths += [int(min(high, max(low, round(x)))) for x in draw.tolist()]
    return lengths


def make_documents(args: argparse.Namespace, vocab: int) -> list[torch.Tensor]:
    """Documents that fill ``args.steps`` packed rows of ``args.tokens`` (first fit, in order)."""
    high = min(BUCKETS[-1], args.tokens) if not args.smoke else args.tokens // 2
    lengths = document_lengths(args.tokens * args.steps * 2, args.seed, args.median, args.sigma,
                               16 if not args.smoke else 2, high)
    g = torch.Generator().manual_seed(args.seed + 1)
    rows, fill, docs = 0, 0, []
    for n in lengths:
        if fill + n > args.tokens:
            rows, fill = rows + 1, 0
            if rows == args.steps:
                break
        docs.append(torch.randint(0, vocab, (n,), generator=g))
        fill += n
    return docs


def packed_batches(docs: list[torch.Tensor], tokens: int, with_lengths: bool) -> list[dict[str, torch.Tensor]]:
    batches, row = [], []

    def close(row: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = torch.cat(row)
        pos = torch.cat([torch.arange(len(d)) for d in row])
        labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in row])
        pad = tokens - len(ids)
        batch = {"input_ids": torch.cat([ids, torch.zeros(pad, dtype=torch.long)])[None],
                 "position_ids": torch.cat([pos, torch.zeros(pad, dtype=torch.long)])[None],
                 "labels": torch.cat([labels, torch.full((pad,), -100)])[None]}
        if with_lengths:  # Unsloth's packing metadata: every document's length, each pad its own
            batch["packed_seq_lengths"] = torch.tensor([len(d) for d in row] + [1] * pad, dtype=torch.int32)
        batch["useful"] = len(ids)
        return batch

    for d in docs:
        if sum(len(r) for r in row) + len(d) > tokens:
            batches.append(close(row))
            row = []
        row.append(d)
    if row:
        batches.append(close(row))
    return batches


def padded_batches(docs: list[torch.Tensor], tokens: int, buckets: tuple[int, ...]) -> list[dict[str, Any]]:
    by_bucket: dict[int, list[torch.Tensor]] = {b: [] for b in buckets}
    for d in docs:
        by_bucket[next(b for b in buckets if len(d) <= b)].append(d)
    batches = []
    for bucket, members in by_bucket.items():
        rows = max(1, tokens // bucket)
        for start in range(0, len(members), rows):
            chunk = members[start:start + rows]
            chunk += members[:rows - len(chunk)]  # the last batch filled up with the bucket's first documents
            ids = torch.zeros(rows, bucket, dtype=torch.long)
            mask = torch.zeros(rows, bucket, dtype=torch.long)
            for i, d in enumerate(chunk):
                ids[i, :len(d)] = d
                mask[i, :len(d)] = 1
            labels = ids.masked_fill(mask == 0, -100)
            batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels,
                            "useful": int(mask.sum())})
    return batches


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks import e2e

    common.use_triton_interpreter_without_cuda()
    system, layout = args.variant.split("-")
    if system == "unsloth":
        from benchmarks import unsloth_variant

        unsloth_variant.import_first()
    sloth = common.import_sloth() if system == "sloth" else None
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model_args = argparse.Namespace(model="tiny-llama" if args.smoke else args.model, layers=args.layers,
                                    seq=max(args.tokens, BUCKETS[-1]), variant=system, qlora=False, grad_ckpt=True)
    model, cfg = e2e.build_model(model_args, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=cuda)
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(BUCKETS))
    compiled = e2e.compile_model(model, system, json.loads(args.sloth_options))
    docs = make_documents(args, cfg.vocab_size)
    buckets = BUCKETS if not args.smoke else tuple(b // 16 for b in BUCKETS)
    batches = (packed_batches(docs, args.tokens, with_lengths=system == "unsloth") if layout == "packed"
               else padded_batches(docs, args.tokens, buckets))
    batches = [{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in batches]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(batch: dict[str, Any]) -> torch.Tensor:
        loss = compiled(**{k: v for k, v in batch.items() if k != "useful"}).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    # Warm-up: one batch of each shape (every compile happens here), the first loss from the first batch.
    shapes: dict[tuple, dict] = {}
    for b in batches:
        shapes.setdefault(tuple(b["input_ids"].shape), b)
    start = time.perf_counter()
    first_loss = None
    for b in shapes.values():
        loss = step(b)
        first_loss = loss.float().item() if first_loss is None else first_loss
    sync()
    warmup = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    if cuda:
        end.record()
        torch.cuda.synchronize()
        seconds = begin.elapsed_time(end) / 1e3
    else:
        seconds = time.perf_counter() - t0
    useful = sum(b["useful"] for b in batches)
    total = sum(b["input_ids"].numel() for b in batches)
    syncs = copy_overlap.count_syncs(lambda: step(batches[0])) if cuda else None
    report = sloth.report() if sloth is not None else None
    return {
        "variant": args.variant,
        "useful tok/s": useful / seconds,
        "ms per 16k useful": seconds * 1e3 * 16384 / useful,
        "pad %": 100 * (total - useful) / total,
        "peak GiB": torch.cuda.max_memory_allocated() / common.GiB if cuda else None,
        "batches": len(batches),
        "useful tokens": useful,
        "seconds": seconds,
        "warm-up s": warmup,
        "first loss": first_loss,
        "syncs/step": syncs,
        "sloth sites": sum(report.counts.values()) if report is not None else None,
        "sloth counts": report.counts if report is not None else None,
        "sloth report": str(report) if report is not None else None,
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] if system != "eager" else None,
    }


def run_all(args: argparse.Namespace) -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, variant in enumerate(args.variants.split(","), 1):
            out, log = Path(tmp) / f"{variant}.json", Path(tmp) / f"{variant}.log"
            cmd = [sys.executable, "-m", "benchmarks.packed_sft", "--variant", variant, "--json-out", str(out),
                   "--model", args.model, "--tokens", str(args.tokens), "--steps", str(args.steps),
                   "--seed", str(args.seed), "--median", str(args.median), "--sigma", str(args.sigma),
                   "--sloth-options", args.sloth_options] + (["--layers", str(args.layers)] if args.layers else []) \
                + (["--smoke"] if args.smoke else [])
            start = time.perf_counter()
            with log.open("w") as fh:
                try:
                    rc: Any = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout,
                                             env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            if rc == 0 and out.exists():
                row = json.loads(out.read_text())
                print(f"[{i}] {variant}: {row['useful tok/s']:.0f} useful tok/s, pad {row['pad %']:.1f}%, peak "
                      f"{row['peak GiB'] or 0:.1f} GiB, first loss {row['first loss']:.4f}, syncs {row['syncs/step']}, "
                      f"sloth {row['sloth counts']} ({time.perf_counter() - start:.0f} s)", flush=True)
            else:
                tail = log.read_text().splitlines()[-20:]
                row = {"variant": variant, "error": next((ln for ln in reversed(tail) if "rror" in ln),
                                                         f"exit {rc}").strip()[:160]}
                print(f"[{i}] {variant}: FAILED ({rc})\n" + "\n".join("    " + ln for ln in tail), flush=True)
            rows.append(row)
    base = next((r for r in rows if r["variant"] == "eager-padded" and "useful tok/s" in r), None)
    for r in rows:
        if base and "useful tok/s" in r:
            r["x eager padded"] = r["useful tok/s"] / base["useful tok/s"]
    print(common.render_text(COLUMNS, rows))
    config = {k: v for k, v in vars(args).items() if k not in ("all", "json_out", "variant")}
    config["buckets"] = BUCKETS
    config["lengths"] = f"log-normal median {args.median}, sigma {args.sigma}, clipped to 16..4096"
    if not args.smoke:
        for path in common.write_result(common.result_record("packed_sft", config, COLUMNS, rows),
                                        suffix=f"-{args.model}-t{args.tokens}" + (f"-L{args.layers}" if args.layers else "")):
            print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--variant", choices=VARIANTS, default="sloth-packed")
    parser.add_argument("--variants", default=",".join(VARIANTS[:5]))
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens a step (packed row length)")
    parser.add_argument("--steps", type=int, default=6, help="packed rows of documents to train on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--median", type=float, default=300.0)
    parser.add_argument("--sigma", type=float, default=0.9)
    parser.add_argument("--sloth-options", default="{}")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.median = min(args.tokens, 256), min(args.median, 20.0)
    if args.all:
        return run_all(args)
    row = run_one(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(row, default=str))
    print(json.dumps({k: v for k, v in row.items() if k != "sloth report"}, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
