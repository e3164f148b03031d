"""Restores from the memory tier (and from LMDB) of this tree beside another tree's, alternating.

    python bench/memory_restore.py --tokens 8192 16384 --schemes turbo4 raw --runs 3 \
        --baseline /tmp/main-tree --write

The entry is bench/storage.py's (synthetic rows with Qwen2.5-0.5B's KV geometry: 24 layers, 2
KV heads, head dim 64, float32). Per run, tree and cell, in a fresh process with that tree first
on the path: a put, then `load` from memory three times (the first right after the put, what
bench/storage.py's memory column times), then the store reopened and `load` from LMDB (pages
dropped where the kernel honours it), then `load` from memory again (what that restore left
there). GB/s are decoded bytes (memory) or stored bytes (LMDB) over the restore's wall time;
CPU is the process's CPU seconds of the same restore (less sensitive to other load on the
machine). The floor is a copy of the decoded bytes between warm buffers. Trees alternate run
by run, so drift on a shared machine spreads over both. `--write` puts the table into
docs/benchmarks.md (section bench-memory-restore).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def child(tree: Path, tokens: int, scheme: str) -> dict:
    """One cell in this process, `tree` first on the path."""
    sys.path.insert(0, str(tree))
    sys.path.insert(1, str(HERE))
    import mlx.core as mx

    import tqstore
    from common import compressed, drop_page_cache
    from storage import kv_model, memcpy_floor, raw_snapshot
    from tqstore.config import load_config
    from tqstore.models.identity import CodecIdentity, ModelIdentity
    from tqstore.store.store import Store
    from turboquant import make_prompt_cache, snapshot

    assert Path(tqstore.__file__).resolve().is_relative_to(tree.resolve()), tqstore.__file__
    model = kv_model()
    raw = raw_snapshot(tokens)
    mx.eval(raw.arrays())
    snap, _ = compressed(model, raw, scheme)
    decoded = sum(a.nbytes for a in snap.arrays())
    del raw
    home = Path(tempfile.mkdtemp(prefix="tqstore-memory-restore-", dir=os.environ.get("TQSTORE_BENCH_DIR")))
    config = load_config(home, {})
    out: dict = {"tokens": tokens, "scheme": scheme, "decoded": decoded, "tqstore": str(Path(tqstore.__file__).parent)}

    def timed(store, key: str) -> None:
        c0, t0 = time.process_time(), time.perf_counter()
        loaded, stats = store.load("e")
        out.setdefault(key, []).append((time.perf_counter() - t0, time.process_time() - c0, stats.tier))
        del loaded

    try:
        store = Store.open(home, config=config)
        t0 = time.perf_counter()
        result = store.put("e", snap, list(range(tokens)), model=ModelIdentity.from_model(model, kv_dtype="float32"),
                           codec=CodecIdentity.from_snapshot(snapshot(make_prompt_cache(model, scheme)), scheme),
                           model_ref="bench", prefill_seconds=1.0)
        out["put"], out["stored"] = time.perf_counter() - t0, result.manifest.nbytes
        del result, snap
        for _ in range(3):
            timed(store, "memory")
        store.close()
        store = Store.open(home, config=config)
        store.get("e")  # opening is not part of a restore
        drop_page_cache(home / "lmdb" / "data.mdb")
        timed(store, "lmdb")
        timed(store, "memory_after_lmdb")
        store.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    out["floor"] = memcpy_floor(decoded)
    return out


def span(values: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def table(rows: list[dict]) -> str:
    from common import markdown_table

    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["tokens"], r["scheme"], r["tree"]), []).append(r)
    out = []
    for (tokens, scheme, tree), runs in cells.items():
        decoded, stored = runs[0]["decoded"], runs[0]["stored"]
        first = [r["memory"][0] for r in runs]
        later = [m for r in runs for m in r["memory"][1:]]
        after = [r["memory_after_lmdb"][0] for r in runs]
        lmdb = [r["lmdb"][0] for r in runs]
        out.append([f"{tokens:,}", scheme, tree, f"{decoded / 1e6:.1f}",
                    span([decoded / w / 1e9 for w, _, _ in first]), span([c * 1e3 for _, c, _ in first], "{:.0f}"),
                    span([decoded / w / 1e9 for w, _, _ in later]),
                    span([decoded / w / 1e9 for w, _, _ in after]),
                    span([stored / w / 1e9 for w, _, _ in lmdb]), span([c * 1e3 for _, c, _ in lmdb], "{:.0f}"),
                    span([decoded / r["floor"] / 1e9 for r in runs])])
    return markdown_table(["tokens", "scheme", "tree", "decoded MB", "memory after put GB/s", "its CPU ms",
                           "memory again GB/s", "memory after an LMDB restore GB/s", "LMDB GB/s (stored)",
                           "its CPU ms", "copy floor GB/s"], out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--schemes", nargs="+", default=["turbo4", "raw"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another tree (e.g. `git archive` of main) to run beside this one")
    parser.add_argument("--baseline-name", default="main")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("TREE", "TOKENS", "SCHEME"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.child[0]), int(args.child[1]), args.child[2])))
        return 0
    trees = ([(args.baseline_name, args.baseline)] if args.baseline else []) + [("this", ROOT)]
    rows = []
    for run in range(args.runs):
        for tokens in args.tokens:
            for scheme in args.schemes:
                for name, tree in (trees if run % 2 == 0 else trees[::-1]):
                    done = subprocess.run([sys.executable, __file__, "--child", str(tree), str(tokens), scheme],
                                          capture_output=True, text=True, check=True)
                    row = {**json.loads(done.stdout.strip().splitlines()[-1]), "tree": name, "run": run}
                    rows.append(row)
                    print(f"run {run + 1} {name} {tokens} {scheme}: memory " + " ".join(
                        f"{w * 1e3:.1f}ms" for w, _, _ in row["memory"]) + f", lmdb {row['lmdb'][0][0] * 1e3:.1f}ms, "
                        f"memory after {row['memory_after_lmdb'][0][0] * 1e3:.1f}ms", flush=True)
    body = table(rows)
    print(body)
    if args.write:
        from common import replace_section, stamp

        command = ["bench/memory_restore.py", *(sys.argv[1:] if argv is None else argv)]
        replace_section(ROOT / "docs" / "benchmarks.md", "bench-memory-restore", f"{stamp(command)}\n\n{body}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
