"""The support table of docs/models.md: every mlx-lm family, its layer kinds and what the store
does with each, asked from the code (`turboquant.adapter.snapshots.layer_kind`) on the tiny configs
of tests/arch_configs.py, so that the table stays true as mlx-lm and tqstore change.

    .venv/bin/python bench/support_table.py          # prints the table and rewrites docs/models.md
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import arch_configs  # noqa: E402
import mlx.core as mx  # noqa: E402
from turboquant import make_prompt_cache  # noqa: E402
from turboquant.adapter.snapshots import PREFIX_KINDS, layer_kind  # noqa: E402
from turboquant.adapter.windows import leaves  # noqa: E402

SCHEME = "turbo4"
DOC = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- support-table:begin -->", "<!-- support-table:end -->"
# Why a layer kind is still stored whole per entry (the reason beside "whole entry only").
WHOLE_REASONS = {
    "CacheList": "a CacheList member has no block layout",
}


def row(family: str) -> list[str]:
    """[family, layer kinds, in memory, at rest, native, window, state, list, fields, whole, prefix
    reuse, state bytes per recurrent layer and block] for one family."""
    if family in arch_configs.NOT_BUILDABLE:
        return [family, "not built: " + arch_configs.NOT_BUILDABLE[family], *[""] * 10]
    try:
        model = arch_configs.build(family)
        caches = make_prompt_cache(model, SCHEME)
        mx.eval(model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8]]), cache=caches))
    except Exception as e:  # the table states what fails instead of hiding the family
        return [family, f"{SCHEME} caches fail: {type(e).__name__}: {str(e)[:80]}", *[""] * 10]
    kinds = [layer_kind(c) for c in caches]
    classes = collections.Counter(name for name, _ in kinds)
    by_kind = collections.Counter(kind for _, kind in kinds)
    listed = ", ".join(f"{n} x{k}" if k > 1 else n for n, k in classes.items())
    whole = sorted({WHOLE_REASONS.get(name.partition("(")[0], "a model's own cache class not in turboquant.records."
                                      "FIELD_PLANS (which of its fields only grow is the model's to say)")
                    for name, kind in kinds if kind not in PREFIX_KINDS})
    prefix = "yes" if not whole else f"whole entry only: {'; '.join(whole)}"
    # A recurrent state has the same size after any number of tokens: one per layer and block.
    # CacheList members included (a recurrent member is checkpointed like a recurrent layer).
    state_bytes = sorted({c.nbytes for _, c in leaves(caches) if layer_kind(c)[1] == "state"})
    return [family, listed, *(str(by_kind.get(k, 0)) for k in ("in memory", "at rest", "native", "window", "state",
                                                           "list", "fields", "whole")),
            prefix,
            ", ".join(f"{b:,}" for b in state_bytes)]


def table() -> str:
    head = ["family", f"layer kinds ({SCHEME} caches)", "in memory", "at rest", "native", "window", "state", "list",
            "fields", "whole", "prefix reuse", "state bytes / layer / block"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row(f)) + " |" for f in arch_configs.families()]
    return "\n".join(lines)


def main() -> None:
    text = table()
    print(text)
    doc = DOC.read_text()
    DOC.write_text(re.sub(f"{BEGIN}.*{END}", lambda _: f"{BEGIN}\n{text}\n{END}", doc, flags=re.S))


if __name__ == "__main__":
    main()
