"""A PNG chart of end-to-end results: step time and peak memory per variant, side by side.

    python -m benchmarks.chart results/A.json [results/B.json ...] --out results/chart.png \
        [--reference "Unsloth (DESIGN.md)=269,30.7"] [--title "..."]

Every row of every given e2e JSON becomes one bar, named by its variant (" + CUDA graphs" when its run set
``triton.cudagraphs``; the last row wins when a name repeats). Memory is ``max_memory_allocated``, except for
CUDA-graph rows, whose activations live in a graph pool that counter misses: there it is
``max_memory_reserved`` (marked "reserved"). ``--reference name=ms,GiB`` adds a row measured elsewhere, drawn
hatched so it is not mistaken for one of ours. Needs matplotlib (``pip install matplotlib``; not a
dependency of sloth).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _cudagraphs(record: dict, variant: str) -> bool:
    """Whether ``variant``'s run in ``record`` (one e2e JSON) replayed CUDA graphs."""
    key = "sloth_options" if variant == "sloth" else "inductor_options" if variant == "inductor" else None
    options = json.loads(record["config"].get(key) or "{}") if key else {}
    return bool(options.get("triton.cudagraphs")) or record["config"].get("mode") == "reduce-overhead"


def load_rows(paths: list[Path]) -> dict[str, tuple[float, float]]:
    rows: dict[str, tuple[float, float]] = {}
    for path in paths:
        record = json.loads(path.read_text())
        for row in record["rows"]:
            if row.get("step ms") is None or row.get("peak GiB") is None:
                continue
            if _cudagraphs(record, row["variant"]):
                if row.get("reserved GiB") is None:  # an older run: its allocated peak would mislead
                    raise SystemExit(f"{path}: a CUDA-graph row without 'reserved GiB'; leave it out")
                rows[f"{row['variant']} + CUDA graphs (reserved)"] = (row["step ms"], row["reserved GiB"])
            else:
                rows[row["variant"]] = (row["step ms"], row["peak GiB"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference", action="append", default=[], help="name=ms,GiB measured elsewhere")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("benchmarks.chart needs matplotlib: pip install matplotlib")

    rows = load_rows(args.results)
    references = {}
    for ref in args.reference:
        name, _, values = ref.partition("=")
        ms, gib = (float(v) for v in values.split(","))
        references[name] = (ms, gib)
    names = list(rows) + list(references)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, index, label in ((axes[0], 0, "step time (ms), lower is better"), (axes[1], 1, "peak memory (GiB)")):
        values = [(rows.get(n) or references[n])[index] for n in names]
        bars = ax.barh(names, values, color=["#c44e52" if n.startswith("sloth") else "#8c8c8c" for n in names])
        for bar, name in zip(bars, names):
            if name in references:
                bar.set_hatch("//")
                bar.set_facecolor("white")
                bar.set_edgecolor("#4c4c4c")
        for bar, value in zip(bars, values):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.1f}", va="center", fontsize=9)
        ax.set_xlabel(label)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values) * 1.18)
    fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
