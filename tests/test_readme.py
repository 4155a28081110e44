"""The README and docs/ pages: every relative link resolves, the README keeps the two set-up commands that
.ci/run and users copy, it stays short, and its results tables are what benchmarks/results_table.py writes from the
records. Reads files only (no model, no compile)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SETUP_COMMANDS = [
    "    pip install torch==2.13.0 -e '.[interpreter]' && python -m sloth.demo",
    "    pip install torch==2.13.0 -e '.[test]' && python -m pytest tests -q",
]
MAX_README_LINES = 220
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(page: Path) -> list[str]:
    """The targets of the page's markdown links and images that point into the repository (no scheme, not
    a bare #anchor), with code blocks and inline code left out."""
    text = _CODE.sub("", _FENCE.sub("", page.read_text()))
    targets = [m.group(1) for m in _LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)}: links to files that do not exist: {missing}"


def test_link_finder_sees_links():
    assert "docs/families.md" in relative_links(README)
    assert "benchmarks/README.md" in relative_links(README)


def test_readme_has_exactly_the_two_setup_commands():
    lines = README.read_text().splitlines()
    assert [line for line in lines if line.startswith("    pip install ")] == SETUP_COMMANDS
    # .ci/run reads the test command with this pattern and needs exactly one match
    assert len([line for line in lines if re.match(r"^    pip install .*python -m pytest", line)]) == 1


def test_readme_is_short():
    count = len(README.read_text().splitlines())
    assert count <= MAX_README_LINES, f"README.md has {count} lines, at most {MAX_README_LINES}: move detail to docs/"


def test_results_tables_are_the_records():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "benchmarks" / "results_table.py")
    results_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results_table)
    text = README.read_text()
    assert text.count(results_table.BEGIN) == 1 and text.count(results_table.END) == 1
    assert results_table.rewrite(text, results_table.tables()) == text, \
        "README.md's results block is stale: run python -m benchmarks.results_table"
