"""Where an LMDB restore's time goes, stage by stage, beside its floor (a cold read).

    python bench/restore_costs.py --tokens 16384 --schemes turbo4 raw --runs 3 --write
    python bench/restore_costs.py --baseline ../old-checkout --runs 3    # the two trees alternately

An entry of synthetic rows with the real model's KV geometry (bench/storage.py's) is put into a
fresh home. Each run restores it with data.mdb's pages dropped (wall and CPU seconds of the
process: the restore reads ahead and decodes on threads, so CPU can exceed wall) beside a
sequential read of as many bytes of data.mdb with its pages dropped after the store closed (the
floor: pages an open environment maps cannot be dropped; checked with mincore). Then the same
work once more on one thread, stage by stage, pages dropped again, as `LmdbReads` does it: each
object's LMDB read (one copy out of LMDB's pages into a buffer that is reused, no hash), the
frame and binary header checks (the header's SHA-256, the tables validated once per distinct
table), the xxh3-128 of every group's stored bytes, the zstd decoding (with byte unshuffling),
the checks of each object against what the manifest expects, the `Run` (the joined arrays
allocated blank from the first and last blocks' headers, the block views), each block's groups
placed in their token slices (one copy), and the blocks, the join (a slice) and its evaluation.
Stage columns are seconds per stored GB; ranges over --runs runs. `--baseline` measures another
checkout and this one in alternate processes, with its stage columns empty where that tree has
no `Run`. `--write` puts the table into docs/benchmarks.md (section bench-restore-costs).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from common import compressed, drop_page_cache, markdown_table, replace_section, stamp  # noqa: E402
from storage import cold_read_floor, kv_model, raw_snapshot, span, use_tree  # noqa: E402

STAGES = ("lmdb read (into a reused buffer)", "frame + header checks", "xxh3 of stored bytes", "zstd + unshuffle",
          "checks against the manifest", "run: allocate (blank) + views", "run: place (one copy)", "blocks + join + eval",
          "sum of stages")


def stage_costs(store, manifest) -> dict[str, float] | None:
    """Seconds of each stage of one LMDB restore of `manifest` (object format 3), the path
    `restore_entry` takes (`LmdbReads`: read each object into a buffer that is reused, parse,
    check each block against the manifest, place its groups into a `Run` allocated from the
    first and last blocks; then the blocks as views of the run, the join), run serially on
    this thread. None for a tree without that path (a --tree baseline before it)."""
    import numpy as np
    import xxhash

    from tqstore.canonical import DTYPES
    from tqstore.format import objects
    from tqstore.format.blocks import SplitSnapshot, join_resident
    from tqstore.store.object_checks import check_parsed, decode_parsed, wants_for
    try:
        from tqstore.format.runs import Run
    except ImportError:
        return None

    lmdb, cost = store._tiers.lmdb, dict.fromkeys(STAGES, 0.0)
    wants, parsed, others = wants_for(manifest, len(manifest.blocks), False), {}, {}
    n, scratch = len(manifest.blocks), np.empty(0, np.uint8)

    def reused(size: int) -> np.ndarray:
        nonlocal scratch
        if scratch.size < size:
            scratch = np.empty(size, np.uint8)
        return scratch[:size]

    def read(want, buffer) -> tuple:
        t0 = time.perf_counter()
        payload, digest = lmdb.read_unhashed(want.key, into=buffer)
        t1 = time.perf_counter()
        header, groups, view = objects._read(payload, True, True)
        t2 = time.perf_counter()
        spans = [view[o:o + k] for o, k in zip(groups.offsets.tolist(), groups.stored.tolist())]
        for stored in spans:
            xxhash.xxh3_128_digest(stored)
        t3 = time.perf_counter()
        raws = [objects._decoded("", g.encoding, stored, g.nbytes, DTYPES[g.dtype][0].size)
                for g, stored in zip(header.groups, spans)]
        t4 = time.perf_counter()
        p = objects.Parsed(header, raws)
        if want.kind == "block":
            check_parsed(p, want)
        else:
            others[want.key] = decode_parsed(p, want, digest).obj
        t5 = time.perf_counter()
        for stage, seconds in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            cost[stage] += seconds
        return p

    ends = {b: read(wants[b], None) for b in (0, n - 1)}
    t0 = time.perf_counter()
    run = Run.allocate([ends[0].header] * (n - 1) + [ends[n - 1].header])
    cost["run: allocate (blank) + views"] = time.perf_counter() - t0
    for b, want in enumerate(wants):
        p = ends[b] if b in ends else read(want, reused if b < n else None)
        if b < n:
            t0 = time.perf_counter()
            run.place(b, p.header, p.raws)
            cost["run: place (one copy)"] += time.perf_counter() - t0
            parsed[b] = (b, p.header, p.raws if b in ends else None)
    t0 = time.perf_counter()
    blocks = run.blocks([parsed[b] for b in range(n)])
    snapshot, _ = join_resident(SplitSnapshot(blocks, others[wants[-2].key], others[wants[-1].key],
                                              manifest.block_size), n)
    mx.eval(*snapshot.arrays())
    cost["blocks + join + eval"] = time.perf_counter() - t0
    cost["sum of stages"] = sum(v for k, v in cost.items() if k != "sum of stages")
    return cost


def measure(tokens: int, scheme: str, runs: int) -> list:
    from tqstore.config import load_config
    from tqstore.models.identity import CodecIdentity, ModelIdentity
    from tqstore.store.store import Store
    from turboquant import make_prompt_cache, snapshot

    model = kv_model()
    raw = raw_snapshot(tokens)
    mx.eval(raw.arrays())
    snap, _ = compressed(model, raw, scheme)
    home = Path(tempfile.mkdtemp(prefix="tqstore-restore-costs-", dir=os.environ.get("TQSTORE_BENCH_DIR")))
    config = load_config(home, {})
    try:
        store = Store.open(home, config=config)
        manifest = store.put("e", snap, list(range(tokens)), model=ModelIdentity.from_model(model, kv_dtype="float32"),
                             codec=CodecIdentity.from_snapshot(snapshot(make_prompt_cache(model, scheme)), scheme),
                             model_ref="bench", prefill_seconds=1.0).manifest
        decoded = sum(a.nbytes for a in snap.arrays())
        store.close()
        del snap, raw
        data, out = home / "lmdb" / "data.mdb", []
        for i in range(runs):
            store = Store.open(home, config=config)
            store.get("e")
            drop_page_cache(data)
            c0, t0 = time.process_time(), time.perf_counter()
            store.load("e")
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            store.close()  # an open environment maps the pages it read: DONTNEED would leave them
            floor = cold_read_floor(data, manifest.nbytes)
            store = Store.open(home, config=config)
            store.get("e")
            drop_page_cache(data)
            stages = stage_costs(store, manifest)
            store.close()
            out.append((manifest.nbytes, decoded, wall, cpu, floor, stages))
            print(f"run {i + 1} {scheme}: restore {wall:.3f}s (CPU {cpu:.3f}s), floor {floor:.3f}s; " +
                  ", ".join(f"{k} {v:.3f}s" for k, v in (stages or {}).items()), flush=True)
        return out
    finally:
        shutil.rmtree(home, ignore_errors=True)


def table(found: dict[str, dict[str, list]], tokens: int) -> str:
    """One row per tree and scheme: `found` maps a tree's label to its runs per scheme."""
    header = ["tree", "tokens", "scheme", "stored MB", "decoded MB", "restore s", "restore CPU s", "cold read s",
              "restore / floor"] + [f"{s} (s/GB)" for s in STAGES]
    rows = []
    for label, schemes in found.items():
        for scheme, got in schemes.items():
            gb = got[0][0] / 1e9
            rows.append([label, tokens, scheme, f"{got[0][0] / 1e6:.1f}", f"{got[0][1] / 1e6:.1f}",
                         span([w for _, _, w, _, _, _ in got], "{:.3f}"), span([c for _, _, _, c, _, _ in got], "{:.3f}"),
                         span([f for _, _, _, _, f, _ in got], "{:.3f}"),
                         span([f / w for _, _, w, _, f, _ in got]) + "x"]
                        + [span([st[s] / gb for *_, st in got]) if got[0][-1] else "-" for s in STAGES])
    return markdown_table(header, rows)


def side_by_side(args: argparse.Namespace) -> dict[str, dict[str, list]]:
    """--baseline: one process per tree and run, the baseline's and this tree's alternating (so
    that a change in the machine's speed falls on both), each with its own floor."""
    found: dict[str, dict[str, list]] = {"baseline": {}, "this tree": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):
            for label, tree in (("baseline", args.baseline), ("this tree", None)):
                rows = Path(tmp) / "rows.json"
                cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--schemes", *args.schemes, "--runs", "1",
                       "--rows-json", str(rows)] + (["--tree", str(tree)] if tree else [])
                subprocess.run(cmd, check=True)
                for scheme, got in json.loads(rows.read_text()).items():
                    found[label].setdefault(scheme, []).extend(tuple(r) for r in got)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--schemes", nargs="+", default=["turbo4", "raw"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--tree", type=Path, help="measure the tqstore and turboquant of another checkout (a "
                        "baseline), with this script's floor and stages")
    parser.add_argument("--baseline", type=Path, help="measure another checkout and this tree alternately, one "
                        "process per run")
    parser.add_argument("--rows-json", type=Path, help=argparse.SUPPRESS)  # --baseline's child processes
    args = parser.parse_args(argv)
    if args.baseline:
        found = side_by_side(args)
    else:
        use_tree(args.tree)
        found = {"baseline" if args.tree else "this tree": {s: measure(args.tokens, s, args.runs) for s in args.schemes}}
        if args.rows_json:
            args.rows_json.write_text(json.dumps(next(iter(found.values()))))
            return 0
    body = table(found, args.tokens)
    print(body)
    if args.write:
        doc = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
        argv_ = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
        replace_section(doc, "bench-restore-costs", f"{stamp(argv_)}\n\n{body}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
