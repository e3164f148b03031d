"""Where a put's time goes, stage by stage, beside its floor (a plain synced LMDB put) in one run.

    python bench/put_profile.py --tokens 8192 --schemes raw turbo4 --runs 3

bench/storage.py's entry (Qwen2.5-0.5B's KV geometry, synthetic rows) is put into a fresh home
and, right after it, the same number of bytes go through the plain LMDB put that is its floor
(bench/storage.py `lmdb_put_floor`); the two alternate run by run. Each stage of the put is
timed where it runs (wall seconds and that thread's CPU seconds, so the stages on the hash and
writer threads show beside the main thread's): cutting the snapshot into blocks, copying each
group's bytes out of MLX, the header's encoding and read-back, the groups' zstd trials, the
payloads' SHA-256 (hash thread), the LMDB writes (the tier's copies into LMDB's pages) and the commits
(a write's wall less its copies: the queue, the commit and its fsync), building the written
blocks' MLX arrays and the join. The process's CPU seconds and the load average are printed
with each run: on a loaded machine wall seconds stretch, CPU seconds much less.

`--profile` adds cProfile's top functions of the last put (main thread, by own time); `--write`
puts the table into docs/benchmarks.md (section bench-put-profile); `--batch-mib N` sets the put's
batch size (each batch is a synced commit, the next encoded meanwhile).
`--tree DIR` measures another checkout's tqstore (a baseline) with this script's floor.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import storage  # noqa: E402
from common import markdown_table  # noqa: E402

# (module, attribute, stage): functions wrapped to time a stage wherever they run.
STAGES = (
    ("tqstore.store.put", "split_snapshot", "split into blocks"),
    ("tqstore.format.objects", "_group_bytes", "group bytes out of MLX"),
    ("tqstore.format.objects", "_blocks_bytes", "group bytes out of MLX"),
    ("tqstore.format.objects", "_cut_bytes", "group bytes out of MLX"),
    ("tqstore.format.objects", "encode_tables", "header encode"),
    ("tqstore.format.objects", "encode_header", "header encode"),
    ("tqstore.format.objects", "read_header", "header read-back"),
    ("tqstore.format.objects", "_encode", "zstd trials"),
    ("tqstore.store.put", "payload_sha256", "SHA-256 of payloads"),
    ("tqstore.store.tiers.lmdb.LmdbTier", "_put_batch", "LMDB writes (copies)"),
    ("tqstore.store.tiers.lmdb_env.LmdbEnv", "write", "LMDB write jobs (wall)"),
    ("tqstore.store.put", "build_run", "build written blocks"),
    ("tqstore.store.put", "build_object", "build other objects"),
    ("tqstore.store.put", "join_resident", "join"),
)


class Timer:
    """Wall and thread-CPU seconds per stage, summed over calls and threads."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.lock = threading.Lock()
        self.depth = threading.local()

    def wrap(self, owner: object, attr: str, stage: str) -> None:
        inner = getattr(owner, attr, None)
        if inner is None:  # a stage another tree (--tree) does not have
            return

        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                with self.lock:
                    self.wall[stage] += time.perf_counter() - t0
                    self.cpu[stage] += time.thread_time() - c0

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()


def install(timer: Timer) -> None:
    """Wrap every stage's function (a module's, or a tier class's method) with `timer`."""
    import importlib

    for where, attr, stage in STAGES:
        if where.endswith((".LmdbTier", ".LmdbEnv")):
            module, cls = where.rsplit(".", 1)
            owner = getattr(importlib.import_module(module), cls)
        else:
            owner = importlib.import_module(where)
        timer.wrap(owner, attr, stage)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--schemes", nargs="+", default=["raw", "turbo4"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile of the last put of each scheme")
    parser.add_argument("--tree", type=Path, help="measure another checkout's tqstore (a baseline)")
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--batch-mib", type=int, help="the put's batch size (tqstore.store.put._BATCH_BYTES), for "
                        "trying batches that commit while the next is encoded (default: the put's own)")
    args = parser.parse_args(argv)
    storage.use_tree(args.tree)

    import mlx.core as mx

    from common import compressed
    from tqstore.config import load_config
    from tqstore.models.identity import CodecIdentity, ModelIdentity
    from tqstore.store.store import Store
    from turboquant import make_prompt_cache, snapshot

    if args.batch_mib is not None:
        import tqstore.store.put

        tqstore.store.put._BATCH_BYTES = args.batch_mib << 20
    timer = Timer()
    install(timer)
    model = storage.kv_model()
    raw = storage.raw_snapshot(args.tokens)
    mx.eval(raw.arrays())
    snaps = {s: raw if s == "raw" else compressed(model, raw, s)[0] for s in args.schemes}
    model_id = ModelIdentity.from_model(model, kv_dtype="float32")
    root = Path(tempfile.mkdtemp(prefix="tqstore-put-", dir=os.environ.get("TQSTORE_BENCH_DIR")))
    rows, profiles = [], {}
    try:
        for i in range(args.runs):
            for scheme, snap in snaps.items():
                codec_id = CodecIdentity.from_snapshot(snapshot(make_prompt_cache(model, scheme)), scheme)
                home = root / f"{scheme}-{i}"
                store = Store.open(home, config=load_config(home, {}))
                timer.reset()
                prof = cProfile.Profile() if args.profile and i == args.runs - 1 else None
                load = os.getloadavg()[0]
                c0, t0 = time.process_time(), time.perf_counter()
                if prof:
                    prof.enable()
                result = store.put("e", snap, list(range(args.tokens)), model=model_id, codec=codec_id,
                                   model_ref="bench", prefill_seconds=1.0)
                if prof:
                    prof.disable()
                    profiles[scheme] = prof
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                stages = {k: (timer.wall[k], timer.cpu[k]) for _, _, k in STAGES}
                store.close()
                shutil.rmtree(home, ignore_errors=True)
                nbytes = result.manifest.nbytes
                fc0 = time.process_time()
                floor = storage.lmdb_put_floor(nbytes, root)
                floor_cpu = time.process_time() - fc0
                rows.append((scheme, i, nbytes, wall, cpu, floor, floor_cpu, load, stages))
                print(f"run {i + 1} {scheme}: put {wall:.3f}s (CPU {cpu:.3f}s), floor {floor:.3f}s (CPU "
                      f"{floor_cpu:.3f}s), put / floor {floor / wall:.2f}x, {nbytes / 1e6:.1f} MB, load {load:.1f}; "
                      + ", ".join(f"{k} {w:.3f}/{c:.3f}" for k, (w, c) in stages.items() if w), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def rng(values: list[float], fmt: str = "{:.3f}") -> str:
        return storage.span(values, fmt)

    # One row per line of the profile, two columns per scheme (wall, CPU): ranges over the runs.
    header, table = ["", *(f"{s} {what}" for s in snaps for what in ("wall s", "CPU s"))], []
    lines = [("stored MB", lambda r: (r[2] / 1e6, r[2] / 1e6)), ("load average", lambda r: (r[7], r[7])),
             ("put", lambda r: (r[3], r[4])), ("floor: plain synced LMDB put", lambda r: (r[5], r[6])),
             ("put / floor (x)", lambda r: (r[5] / r[3], r[6] / r[4]))]
    lines += [(k, lambda r, k=k: r[8][k]) for k in dict.fromkeys(k for _, _, k in STAGES)]
    for label, get in lines:
        row = [label]
        for scheme in snaps:
            mine = [get(r) for r in rows if r[0] == scheme]
            fmt = "{:.1f}" if label in ("stored MB", "load average") else "{:.2f}" if label.endswith("(x)") else "{:.3f}"
            row += [rng([m[0] for m in mine], fmt), rng([m[1] for m in mine], fmt)]
        table.append(row)
    body = markdown_table(header, table)
    print(body)
    if args.write:
        storage.write_docs({"bench-put-profile": body}, [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    for scheme, prof in profiles.items():
        print(f"\ncProfile of the last {scheme} put (main thread, own time):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
