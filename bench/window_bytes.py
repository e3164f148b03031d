"""What keeping sliding-window and chunked layers by token costs: stored bytes per token of every
family with such layers (CacheList members included: baichuan_m1), windows whole (before issue 29)
and by token (the engine's default now).

    python bench/window_bytes.py            # writes the window table into docs/models.md

Same models and accounting as bench/family_bytes.py (tiny configs widened to heads of 64, fp16
accounting, layer arrays only). Each family prefills the same tokens under raw and turbo4 with
the engine's logging (`turboquant.adapter.checkpoints.StateCheckpoints`), then is snapshotted twice: with
the window rows (by token) and without (whole). Per token is what grows with the tokens; the
whole windows are a fixed cost per entry (their size is the window's, 16 to 64 rows here).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

from common import family_arguments, git_revision, machine_line, markdown_table, replace_section  # noqa: E402
from family_bytes import build, split_bytes  # noqa: E402

MARKER = "window-bytes"
BLOCK = 256


def measure(model, scheme: str, tokens: int) -> tuple[tuple[int, int], tuple[int, int], int, int]:
    """((per-token bytes, fixed bytes) whole, the same by token, window layers, layers)."""
    import mlx.core as mx

    from turboquant.adapter.checkpoints import StateCheckpoints, chunk_ends
    from turboquant.adapter.making import compress_caches, make_prompt_cache
    from turboquant.adapter.snapshots import snapshot
    from turboquant.adapter.windows import settle_all, window_layers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caches = make_prompt_cache(model, scheme)
    log = StateCheckpoints.for_caches(caches, BLOCK)
    prompt = mx.arange(tokens)[None] % 100 + 1
    start = 0
    for end in chunk_ends(0, tokens, 512, log and log.boundary):
        mx.eval(model(prompt[:, start:end], cache=caches))
        if log is not None:
            log.record(caches, end)
        start = end
    settle_all(caches)
    compress_caches(caches)
    states = log.before(tokens) if log else None
    whole = split_bytes(snapshot(caches, tokens=tokens, checkpoints=states).layers)
    by_token = split_bytes(snapshot(caches, tokens=tokens, checkpoints=states, rows=log.rows(tokens),
                                  windows="token").layers)
    return whole, by_token, len(window_layers(caches)), len(caches)


def family_row(family: str, tokens: int) -> list | None:
    """[family, window layers / layers, then per scheme: B/token whole, by token, ratio; fixed
    bytes whole], or None for a family without window layers."""
    import arch_configs
    from turboquant.adapter.windows import window_layers

    model = arch_configs.build(family)
    if not window_layers(model.make_cache() if hasattr(model, "make_cache") else []):
        return None
    row: list = [family]
    for scheme in ("raw", "turbo4"):
        try:
            model = build(family, True)
            result = measure(model, scheme, tokens)
        except Exception:  # the widened config breaks an assumption of the family's code
            model = build(family, False)
            result = measure(model, scheme, tokens)
            row[0] = f"{family} (heads of 16)"
        (whole, fixed), (by_token, _), windows, layers = result
        if not windows:
            return None
        if scheme == "raw":
            row.append(f"{windows}/{layers}")
        row += [f"{whole / tokens:.0f}", f"{by_token / tokens:.0f}", f"{by_token / whole:.2f}" if whole else "-"]
        if scheme == "turbo4":
            row.append(f"{fixed:,}")
    return row


def _row_or_failure(family: str, tokens: int) -> list | None:
    """`family_row`, or the failure as a row (a family that fails is reported, not hidden)."""
    try:
        row = family_row(family, tokens)
    except Exception as e:
        row = [family, f"fails: {type(e).__name__}: {e}"[:80]] + [""] * 7
    if row is not None:
        print(" | ".join(map(str, row)), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    args = family_arguments(__doc__, 1024, argv)

    from arch_configs import NOT_BUILDABLE, families

    measured = (_row_or_failure(f, args.tokens) for f in args.families or families() if f not in NOT_BUILDABLE)
    rows = [row for row in measured if row is not None]
    header = ["family", "window layers", "raw B/token whole", "raw B/token by token", "raw by token x whole",
              "turbo4 B/token whole", "turbo4 B/token by token", "turbo4 by token x whole",
              "turbo4 whole windows, bytes per entry"]
    intro = (f"Stored bytes per token of the families with sliding-window or chunked layers or CacheList members "
             f"({args.tokens} tokens; "
             f"heads of 64, fp16 accounting, layer arrays only: see bench/window_bytes.py; revision "
             f"{git_revision()}; {machine_line()}).")
    print(intro)
    replace_section(args.out, MARKER, intro + "\n\n" + markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
