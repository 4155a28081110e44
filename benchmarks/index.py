"""benchmarks/results/INDEX.md: one line per record (date, what, device, commit, file), then the raw data.

    python -m benchmarks.index            # rewrite INDEX.md, print how many records leave each field unsaid
    python -m benchmarks.index --check    # exit status 1 if INDEX.md differs from what would be written

A record is a markdown file in benchmarks/results/, or a JSON document with no markdown file of its name beside it.
Records come in three shapes, and each field is read from what the record itself says:
- a benchmark's JSON (``common.write_result``) and the table made from it: the JSON's ``env`` gives the date,
  ``device`` and ``git_commit`` (with ``git_dirty``); "what" is the file's name after its timestamp, then the
  variants, sloth's options, the ``SLOTH_*`` switches and the e2e flags it ran with;
- a table transcribed by hand (``### e2e on <device> (<date>, ..., <commit>)``, no JSON): its heading;
- a written record (``# <title>``): the title, then the lines above its first ``## `` section: a "Device" line
  (else the one GPU its title names, else the first "NVIDIA <GPU>" there, else CPU where it says so), and the
  hashes written after "commit" or "code" (or in a table column headed "commit"); a hash the record cites only as
  what a JSON file "says" is not taken.
A field a record does not state is "?": nothing is guessed from neighbouring files. The other files (log archives,
logs, kernel and memory profiles, charts) are listed as raw data with the records that cite them by name.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
INDEX_NAME = "INDEX.md"
UNKNOWN = "?"
FIELDS = ("date", "device", "commit")

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d)(?:_(?:h100_|h200_)?(\d\d)(\d\d)(?:\d\d)?(?=_))?")
_TABLE_HEADING = re.compile(r"^###\s+\S+\s+on\s+(.+?)\s+\((\d{4}-\d\d-\d\d)T(\d\d:\d\d)[^,]*,(.*)\)\s*$")
_HASH = r"([0-9a-f]{7,40})\b"
# "commit 46c9d02", "Commits 672c3f1", "Code: commit 2ee21ed", ", code 13f33ce"; not "offload code d77e046" (a module's
# code) nor "`git_commit` reads d77e046" (what a JSON file says when the device's git metadata was stale)
_COMMIT_AFTER_WORD = re.compile(r"(?:\b[Cc]ommits?|(?:^|[,;(]\s*)code|\bCode)\b[:*`\s]*(?:commit\s+)?`?" + _HASH)
_GPU = re.compile(r"\b(?:NVIDIA\s+)?((?:H100|H200|A100|B200|GH200|L40S|L4)\b(?: \d+GB)?(?: HBM\w*| PCIe| SXM\w*)?)")
_NVIDIA_GPU = re.compile(r"\bNVIDIA\s+((?:[A-Z]+\d+[A-Z]*)(?: \d+GB)?(?: HBM\w*| PCIe| SXM\w*)?)")


@dataclass
class Record:
    name: str
    date: str
    what: str
    device: str
    commit: str
    json_name: str | None = None


def _has_digit(token: str) -> bool:
    return any(c.isdigit() for c in token)


def _short_commit(commit: str) -> str:
    """'25b891ac26098119...' -> '25b891a'; suffixes the launcher added ('5aca939+lora-wip') are kept."""
    m = re.match(r"^([0-9a-f]{8,40})$", commit)
    return m.group(1)[:7] if m else commit


def _stamp(name: str) -> str:
    m = _STAMP.match(name)
    if not m:
        return UNKNOWN
    return f"{m.group(1)} {m.group(2)}:{m.group(3)}" if m.group(2) else m.group(1)


def _stem_label(name: str) -> str:
    """The file's name after its timestamp: '2026-12-05_h100_152521_e2e-qwen3-moe-b2-s2048.json' -> 'e2e-qwen3-...'."""
    stem = name.rsplit(".", 1)[0]
    return re.sub(r"^\d{4}-\d\d-\d\d_(?:h100_|h200_)?(?:\d{4,6}_)?", "", stem)


def _options(options: Any) -> str:
    """sloth's options, one 'key=value' each; a list of family names as its length."""
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except ValueError:
            return options
    if not isinstance(options, dict) or not options:
        return ""
    parts = []
    for key, value in options.items():
        if isinstance(value, list):
            parts.append(f"{key}=[{len(value)} names]")
        else:
            parts.append(f"{key}={json.dumps(value, separators=(',', ':'))}")
    return " ".join(parts)


def _from_json(name: str, doc: dict[str, Any], json_name: str) -> Record:
    env = doc.get("env") or {}
    config = doc.get("config") or {}
    what = [_stem_label(name)]
    variants = config.get("variants") or config.get("variant")
    if variants:
        what[0] += f": {variants}"
    options = _options(config.get("sloth_options"))
    if options:
        what.append(options)
    switches = env.get("sloth_env") or {}
    what += [f"{k}={v}" for k, v in sorted(switches.items())]
    what += [f"variant {v}" for v in config.get("sloth_variant") or ()]
    for flag in ("profile", "host_profile", "memory_peak", "copy_overlap", "no_telemetry"):
        if config.get(flag):
            what.append("--" + flag.replace("_", "-"))
    for key in ("distributed", "guard_filter"):
        if config.get(key) not in (None, "", "none"):
            what.append(f"--{key.replace('_', '-')} {config[key]}")
    date = env.get("date") or ""
    m = re.match(r"^(\d{4}-\d\d-\d\d)T(\d\d:\d\d)", date)
    commit = str(env.get("git_commit") or "")
    if commit:
        commit = _short_commit(commit) + (" (dirty)" if env.get("git_dirty") else "")
    device = str(env.get("device") or "")
    return Record(name=name, date=f"{m.group(1)} {m.group(2)}" if m else _stamp(name), what="; ".join(what),
                  device=device.removeprefix("NVIDIA ") or UNKNOWN, commit=commit or UNKNOWN, json_name=json_name)


def _header_block(lines: list[str]) -> list[str]:
    """The title and the lines above the first '## ' section: where a record states its set-up."""
    block = []
    for i, line in enumerate(lines):
        if i > 0 and line.startswith("## "):
            break
        block.append(line)
    return block


def _table_column(block: list[str], word: str) -> list[str]:
    """The cells of every column whose heading names `word` in the markdown tables of `block`."""
    cells, column = [], None
    for line in block:
        if not line.startswith("|"):
            column = None
            continue
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None:
            heads = [re.findall(r"\w+", c.lower()) for c in row]
            column = next((i for i, words in enumerate(heads) if word in words), -1)
        elif column >= 0 and column < len(row) and not set(row[column]) <= set("-: "):
            cells.append(row[column])
    return cells


def _device(title: str, block: list[str]) -> str:
    for line in block:
        if re.match(r"^\W*device\b", line, re.IGNORECASE):
            m = _GPU.search(line)
            if m:
                return m.group(1)
    named = {m.group(1) for m in _GPU.finditer(title)}
    if len({n.split()[0] for n in named}) == 1:
        return sorted(named, key=len)[-1]
    for line in block:
        m = _NVIDIA_GPU.search(line)
        if m:
            return m.group(1)
    text = "\n".join(block)
    if re.search(r"\bCPU\b|\+cpu\b", text):
        return "CPU"
    return UNKNOWN


def _commits(block: list[str]) -> str:
    text = " ".join(line.strip() for line in block)  # a hash may sit on the line after its "commit"
    found = [m.group(1) for m in _COMMIT_AFTER_WORD.finditer(text) if _has_digit(m.group(1))]
    for cell in _table_column(block, "commit"):
        found += [h for h in re.findall(_HASH, cell) if _has_digit(h)]
    unique = list(dict.fromkeys(_short_commit(h) for h in found))
    if not unique:
        return UNKNOWN
    return ", ".join(unique[:4]) + (f" +{len(unique) - 4}" if len(unique) > 4 else "")


def _from_markdown(name: str, text: str) -> Record:
    lines = text.splitlines()
    first = next((line for line in lines if line.strip()), "")
    m = _TABLE_HEADING.match(first)
    if m:  # a table transcribed by hand, no JSON beside it
        tail = [p.strip() for p in m.group(4).split(",")]
        commit = tail[-1].split()[0] if tail and tail[-1] else ""
        return Record(name=name, date=f"{m.group(2)} {m.group(3)}", what=_stem_label(name) + " (transcribed table)",
                      device=m.group(1).removeprefix("NVIDIA "),
                      commit=_short_commit(commit) if re.match(_HASH, commit) else UNKNOWN)
    title = first.lstrip("#").strip() if first.startswith("#") else _stem_label(name)
    block = _header_block(lines)
    return Record(name=name, date=_stamp(name), what=title, device=_device(title, block), commit=_commits(block))


def records(results: Path = RESULTS_DIR) -> list[Record]:
    """Every record in `results`, by file name (the names start with their UTC date)."""
    out = []
    names = {p.name for p in results.iterdir() if p.is_file()}
    for name in sorted(names):
        stem, _, ext = name.rpartition(".")
        if name == INDEX_NAME or ext not in ("md", "json"):
            continue
        if ext == "json" and f"{stem}.md" in names:
            continue  # listed with its table
        path = results / name
        json_name = f"{stem}.json" if f"{stem}.json" in names else None
        doc = None
        if json_name:
            try:
                doc = json.loads((results / json_name).read_text())
            except ValueError:
                doc = None
        if isinstance(doc, dict) and "env" in doc:
            record = _from_json(name, doc, json_name)
        elif ext == "md":
            record = _from_markdown(name, path.read_text())
            record.json_name = json_name
        else:  # a JSON document of another shape (the coverage sweep's list of rows)
            record = Record(name=name, date=_stamp(name), what=_stem_label(name), device=UNKNOWN, commit=UNKNOWN)
        out.append(record)
    return out


def _raw_kind(name: str) -> str:
    if name.endswith((".tgz", ".tar.gz")):
        return "log archive"
    if name.endswith(".log"):
        return "log"
    if name.endswith(".png"):
        return "chart"
    if "memory-peak" in name:
        return "memory peak"
    if "hostprofile" in name:
        return "host profile"
    return "kernel profile" if name.endswith(".txt") else "file"


def raw_files(results: Path = RESULTS_DIR) -> list[Path]:
    return sorted(p for p in results.iterdir()
                  if p.is_file() and p.name != INDEX_NAME and p.suffix not in (".md", ".json"))


def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.1f} MiB"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def missing(recs: list[Record]) -> dict[str, int]:
    return {field: sum(getattr(r, field) == UNKNOWN for r in recs) for field in FIELDS}


def render(results: Path = RESULTS_DIR) -> str:
    recs = records(results)
    raws = raw_files(results)
    texts = {r.name: (results / r.name).read_text() for r in recs if r.name.endswith(".md")}
    lacking = missing(recs)
    sizes: dict[str, list[int]] = {}
    for p in raws:
        sizes.setdefault(_raw_kind(p.name), []).append(p.stat().st_size)
    lines = [
        "# Benchmark records",
        "",
        "Generated by `python -m benchmarks.index` from the files beside it; do not edit by hand "
        "(tests/test_benchmarks_index.py checks it is current). How to run the benchmarks and why the raw data "
        "stays here: [../README.md](../README.md).",
        "",
        f"{len(recs)} records ({sum(r.json_name is not None for r in recs)} with their JSON), "
        f"{len(raws)} raw data files ("
        + ", ".join(f"{len(v)} {k}s ({_size(sum(v))})" for k, v in sorted(sizes.items())) + "). "
        "A \"?\" is a field the record does not state: "
        + ", ".join(f"{field} in {n}" for field, n in lacking.items()) + ".",
        "",
        "## Records",
        "",
        "| date (UTC) | what | device | commit | record |",
        "|---|---|---|---|---|",
    ]
    for r in recs:
        link = f"[{r.name}]({r.name})" + (f" · [json]({r.json_name})" if r.json_name and r.json_name != r.name else "")
        lines.append(f"| {r.date} | {_cell(r.what)} | {_cell(r.device)} | {_cell(r.commit)} | {link} |")
    lines += [
        "",
        "## Raw data",
        "",
        "Log archives, logs, profiles and charts, kept as they came back from the device; \"cited by\" lists the "
        "records that name the file.",
        "",
        "| date (UTC) | kind | size | file | cited by |",
        "|---|---|---|---|---|",
    ]
    for p in raws:
        cited = [name for name, text in texts.items() if p.name in text]
        lines.append(f"| {_stamp(p.name)} | {_raw_kind(p.name)} | {_size(p.stat().st_size)} | [{p.name}]({p.name}) | "
                     + (", ".join(f"[{c}]({c})" for c in cited) or "-") + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with INDEX.md instead of writing it")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    text = render(args.results)
    path = args.results / INDEX_NAME
    if args.check:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} is out of date: run python -m benchmarks.index", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    recs = records(args.results)
    print(f"wrote {path}: {len(recs)} records, {len(raw_files(args.results))} raw data files")
    for field, n in missing(recs).items():
        print(f"  records that do not state their {field}: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
