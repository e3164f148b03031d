"""Checks over the repository's own text files."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.MULTILINE)


def test_no_merge_conflict_markers_are_left_in_docs_or_code():
    files = [p for d in ("docs", "tqstore", "turboquant", "cli", "bench", "tests", "tools")
             for p in (ROOT / d).rglob("*") if p.suffix in {".md", ".py"}]
    files += list(ROOT.glob("*.md"))
    left = [str(p.relative_to(ROOT)) for p in files if MARKER.search(p.read_text(encoding="utf-8"))]
    assert left == []
