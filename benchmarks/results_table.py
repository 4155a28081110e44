"""Write the README's results tables from the e2e records in benchmarks/results/.

    python -m benchmarks.results_table            # rewrite the block between the README's results markers
    python -m benchmarks.results_table --check    # exit 1 if the README's block differs from what the records give

Which records and rows go in is benchmarks/results_table.json: one table per device, each row a record file and the
variant in it (``sloth``, ``unsloth``, ``inductor``, ``eager``, ``liger``). Every number, the workload, the
options, the versions and the commit are read from the record itself, and a record from another device than its
table's is an error, so a table never mixes machines. sloth rows that ran with options (or ``SLOTH_*``
switches) are marked as such and must come after the default rows of their table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SPEC = Path(__file__).resolve().parent / "results_table.json"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

MODELS = {"llama3-8b": "Llama-3-8B", "qwen3-moe": "Qwen3-MoE 12 layers, 128 experts, top-8",
          "gpt-oss-20b": "GPT-OSS-20B"}
VARIANTS = {"sloth": "sloth", "unsloth": "Unsloth", "inductor": "Inductor", "eager": "eager", "liger": "Liger"}


def _workload(config: dict) -> str:
    """The record's training step in words, e.g. "Llama-3-8B, LoRA, 1 x 16384, checkpointing"."""
    model = MODELS.get(config["model"], config["model"])
    if config.get("layers"):
        model += f" cut to {config['layers']} layers"
    if config["model"] == "llama3-8b":
        lora = "QLoRA NF4" if config.get("qlora") else "LoRA"
    else:
        lora = "LoRA on attention" + (" and experts" if config.get("lora_experts") else "")
    words = [model, lora, f"{config['batch']} x {config['seq']}"]
    if config.get("grad_ckpt"):
        words.append("checkpointing")
    if config.get("distributed", "none") != "none":
        words.append(config["distributed"])
    return ", ".join(words)


def _options(record: dict, variant: str) -> str:
    """"" for a default run, else the sloth options, measurement variants and (older records) SLOTH_* switches it
    ran with, as code."""
    if variant != "sloth":
        return ""
    options = json.loads(record["config"].get("sloth_options") or "{}")
    switches = record["env"].get("sloth_env") or {}
    parts = [f"`{json.dumps(options)}`"] if options else []
    parts += [f"`{name}={value}`" for name, value in sorted(switches.items())]
    parts += [f"`--sloth-variant {v}`" for v in record["config"].get("sloth_variant") or ()]
    return ", ".join(parts)


def _row(name: str, variant: str, device: str) -> tuple[str, bool, dict]:
    record = json.loads((RESULTS / name).read_text())
    if record.get("benchmark") != "e2e":
        raise SystemExit(f"{name}: not an e2e record")
    if record["env"].get("device") != device:
        raise SystemExit(f"{name}: ran on {record['env'].get('device')!r}, not on this table's {device!r}")
    rows = [row for row in record["rows"] if row["variant"] == variant and not row.get("error")]
    if len(rows) != 1:
        raise SystemExit(f"{name}: {len(rows)} error-free rows of variant {variant!r}, expected 1")
    row = rows[0]
    options = _options(record, variant)
    run = VARIANTS.get(variant, variant) + (f", **option** {options}" if options else "")
    median = row.get("step ms median")
    ms = f"{row['step ms']:.1f}" + (f" ({median:.1f})" if median is not None else "")
    date = record["env"]["date"][:10]
    commit = str(record["env"].get("git_commit") or "?")[:7]
    link = f"[{date}, {commit}](benchmarks/results/{name})"
    line = f"| {_workload(record['config'])} | {run} | {ms} | {row['peak GiB']:.2f} | {link} |"
    return line, bool(options), record["env"]


def _versions(envs: list[dict]) -> str:
    parts = []
    for key in ("torch", "triton", "transformers", "peft"):
        values = sorted({str(env.get(key)) for env in envs if env.get(key)})
        if values:
            parts.append(f"{key} {' / '.join(values)}")
    return ", ".join(parts)


def tables() -> str:
    """The markdown that goes between the README's markers."""
    spec = json.loads(SPEC.read_text())
    out = []
    for table in spec["tables"]:
        lines, envs, seen_option = [], [], False
        for name, variant in table["rows"]:
            line, is_option, env = _row(name, variant, table["device"])
            if variant == "sloth" and not is_option and seen_option:
                raise SystemExit(f"{name}: a default sloth row after an option row; put the default rows first")
            seen_option |= is_option
            lines.append(line)
            envs.append(env)
        out += [f"#### {table['device']} ({_versions(envs)})",
                "| workload | run | step ms, mean (median) | peak GiB | record |", "|---|---|---|---|---|", *lines, ""]
    return "\n".join(out).rstrip("\n")


def rewrite(text: str, block: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md: no {BEGIN} ... {END} block")
    return text[:start + len(BEGIN)] + "\n" + block + "\n" + text[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's block is not what the records give")
    args = parser.parse_args()
    readme = ROOT / "README.md"
    text = readme.read_text()
    new = rewrite(text, tables())
    if args.check:
        if new != text:
            print("README.md: the results block differs from the records; run python -m benchmarks.results_table")
            return 1
        return 0
    if new != text:
        readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
