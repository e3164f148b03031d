"""What finding a prompt's stored prefix costs (`Store.lookup`), by context length (issue 28).

    python bench/lookup_cost.py --tokens 4096 16384 65536 --runs 5 [--tree DIR] [--write]

Every question pays a lookup before its restore: the prompt against each stored entry's tokens and
block keys, then which tier holds each block. At long contexts this is part of the "rest" of a
first token (bench/restore_vs_recompute.py). Per context length, one turbo4 entry of synthetic
rows (2 layers of the storage bench's geometry: the lookup reads manifests and key indexes, not
the rows) is stored, and the lookup of a prompt of the entry's tokens plus 16 is timed three ways:
in a fresh Store (its first lookup parses the manifest, as a fresh `tqstore ask` does), again in
the same Store (a server's later requests), and for a prompt that leaves the entry after its
first half (a block prefix, not the whole entry). `--tree DIR` measures another checkout's
tqstore (a baseline), to run beside this one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import storage  # noqa: E402
from common import markdown_table, print_and_write  # noqa: E402

MARKER = "bench-lookup-cost"
WAYS = ("fresh Store (manifest parsed)", "same Store again", "prompt leaving at half (block prefix)")


def measure(tokens: int, runs: int, root: Path) -> dict[str, list[float]]:
    """Seconds of each way of looking up, `runs` times each, for one entry of `tokens` tokens."""
    import mlx.core as mx

    from common import compressed
    from tqstore.config import load_config
    from tqstore.models.identity import CodecIdentity, ModelIdentity
    from tqstore.store.store import Store
    from turboquant import make_prompt_cache, snapshot

    model = storage.kv_model(2)
    raw = storage.raw_snapshot(tokens, n_layers=2)
    mx.eval(raw.arrays())
    snap = compressed(model, raw, "turbo4")[0]
    model_id = ModelIdentity.from_model(model, kv_dtype="float32")
    codec_id = CodecIdentity.from_snapshot(snapshot(make_prompt_cache(model, "turbo4")), "turbo4")
    context = [(i * 7919) % 150000 for i in range(tokens)]
    home = root / f"lookup-{tokens}"
    config = load_config(home, {})
    store = Store.open(home, config=config)
    store.put("e", snap, context, model=model_id, codec=codec_id, model_ref="bench", prefill_seconds=1.0)
    store.close()
    prompts = {WAYS[0]: context + [5] * 16, WAYS[1]: context + [5] * 16,
               WAYS[2]: context[:tokens // 2] + [7] * (tokens - tokens // 2)}
    found: dict[str, list[float]] = {w: [] for w in WAYS}
    ids = {"model": model_id.digest, "codec": codec_id.digest}
    for _ in range(runs):
        store = Store.open(home, config=config)
        store.stats()  # opening the environment is not part of a lookup
        try:
            for way in WAYS:
                t0 = time.perf_counter()
                match = store.lookup(prompts[way], **ids)
                found[way].append(time.perf_counter() - t0)
                want = tokens if way != WAYS[2] else tokens // 2 // 256 * 256
                if match is None or match.tokens != want:
                    raise RuntimeError(f"{way}: matched {match and match.tokens} tokens, expected {want}")
        finally:
            store.close()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tree", type=Path, help="measure another checkout's tqstore (a baseline)")
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    storage.use_tree(args.tree)
    root = Path(tempfile.mkdtemp(prefix="tqstore-lookup-", dir=os.environ.get("TQSTORE_BENCH_DIR")))
    rows = []
    try:
        for tokens in args.tokens:
            found = measure(tokens, args.runs, root)
            for way, seconds in found.items():
                ms = [s * 1e3 for s in seconds]
                rows.append([f"{tokens:,}", way, f"{statistics.median(ms):.2f}", f"{min(ms):.2f}-{max(ms):.2f}"])
                print(f"{tokens} tokens, {way}: median {statistics.median(ms):.2f} ms", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tree = f"the tree at {args.tree}" if args.tree else "this tree"
    body = (f"{tree}; median and range of {args.runs} lookups each:\n\n"
            + markdown_table(["context tokens", "lookup", "ms (median)", "ms (range)"], rows))
    return print_and_write(MARKER, body, args.write, argv)


if __name__ == "__main__":
    raise SystemExit(main())
