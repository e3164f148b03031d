"""Stored bytes per token of every mlx-lm family at turbo4 and turbo8v3, against raw.

    python bench/family_bytes.py            # writes the family table into docs/models.md

Each family's tiny random config (tests/arch_configs.py: hidden 64, 4 layers, heads of 16, in
float16 here so raw is what a real fp16 model stores) prefills the same tokens under raw, turbo4
and turbo8v3; the table is the snapshot's layer bytes (every array a record holds: codes, norms,
scales, calibration, native states) per token, and raw over it. Shared codec arrays (per model,
not per token) are left out. The residence columns say how many layers each scheme compresses
in memory, at rest, or leaves native. Tiny heads (16) make TurboQuant's per-row norms weigh
more than on real models (heads of 64-128), so real ratios are higher; the ranking holds.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

from common import git_revision, machine_line, markdown_table, replace_section  # noqa: E402

SCHEMES = ("turbo4", "turbo8v3")
MARKER = "family-bytes"


def family_row(family: str, tokens: int) -> list | None:
    """[family, raw B/token, then per scheme B/token, x raw, in memory/at rest/native]."""
    import mlx.core as mx

    from arch_configs import build
    from turboquant.integration import compress_caches, make_prompt_cache, snapshot
    from turboquant.residence import Residence, residence_of

    model = build(family)
    model.set_dtype(mx.float16)
    prompt = mx.arange(1, tokens + 1)[None] % 100 + 1
    row: list = [family]
    raw = None
    for scheme in ("raw", *SCHEMES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            caches = make_prompt_cache(model, scheme)
        model(prompt, cache=caches)
        compress_caches(caches)
        per_token = sum(r.nbytes for r in snapshot(caches).layers) / tokens
        if scheme == "raw":
            raw = per_token
            row.append(f"{per_token:.0f}")
            continue
        counts = [sum(residence_of(c) is r for c in caches) for r in Residence]
        row += [f"{per_token:.0f}", f"{raw / per_token:.2f}", "/".join(map(str, counts))]
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--families", nargs="*", help="default: every family that builds")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "models.md")
    args = parser.parse_args(argv[1:])

    from arch_configs import NOT_BUILDABLE, families

    rows = []
    for family in args.families or [f for f in families() if f not in NOT_BUILDABLE]:
        try:
            rows.append(family_row(family, args.tokens))
        except Exception as e:  # a family that fails here is reported in the table, not hidden
            rows.append([family, f"fails: {type(e).__name__}: {e}"[:80]] + [""] * 6)
        print(" | ".join(map(str, rows[-1])), flush=True)
    header = ["family", "raw B/token"] + [h for s in SCHEMES for h in (f"{s} B/token", f"{s} x raw",
                                                                      f"{s} in memory/at rest/native")]
    body = (f"Stored bytes per token of every family's tiny config ({args.tokens} tokens, float16, layer arrays "
            f"only; `python bench/family_bytes.py`, revision {git_revision()}; {machine_line()}). Layers: "
            "compressed in memory / at rest / native.\n\n" + markdown_table(header, rows))
    replace_section(args.out, MARKER, body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
