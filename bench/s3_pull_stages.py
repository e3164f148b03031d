"""Where a pull's time goes: its stages, run by run alternating with boto3's download of the same bytes.

    python bench/s3_pull_stages.py --tokens 4096 --runs 8 --write

One turbo4 entry (bench/storage.py's geometry) is put and pushed to a moto S3 server on loopback,
then pulled `--runs` times into a fresh home (its S3 client's first request made before the
timing, as in bench/s3_transfer.py), each pull right after boto3's transfer manager
downloads one object of the entry's stored size from the same server into memory (the floor of
bench/s3_transfer.py). The pull's S3 requests, its LMDB writes and the arrival and verification
of each object are timed by wrapping the tiers' methods (timing only: the code that runs is the
store's). Beside them, in the same runs, the durable-write floors of the same bytes: one plain
file written and fsynced, and the objects put into a fresh LMDB home in one call. Figures are
median (range) over the runs, in milliseconds from the start of the pull. `--write` puts the
table into docs/benchmarks.md (section bench-s3-pull-stages).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

STAGES = (
    ("manifest GET answered", "manifest"),
    ("map GET answered", "map"),
    ("first pack GET sent", "packs"),
    ("first object arrived", "first_arrival"),
    ("first LMDB write started", "first_write"),
    ("last object arrived", "last_arrival"),
    ("last object verified", "last_verified"),
    ("last LMDB write (objects + manifest) started", "last_write"),
    ("pull returned", "end"),
)


class Timeline:
    """Events of one pull, in seconds since `start`, recorded from any thread."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.events: list[tuple[str, float, float]] = []

    def add(self, what: str, began: float) -> None:
        self.events.append((what, began - self.start, time.perf_counter() - self.start))

    def first(self, what: str, end: bool = False) -> float | None:
        times = [e[2] if end else e[1] for e in self.events if e[0] == what]
        return min(times) if times else None

    def last(self, what: str, end: bool = False) -> float | None:
        times = [e[2] if end else e[1] for e in self.events if e[0] == what]
        return max(times) if times else None


def instrument(clock: list[Timeline]) -> None:
    """Wrap the S3 and LMDB tiers' methods and the pull's verification so that each call lands
    in `clock[0]`."""
    from tqstore.store import transfer
    from tqstore.store.tiers.lmdb import LmdbTier
    from tqstore.store.tiers.s3 import S3Tier

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                clock[0].add(label, t)

        wrapper.__wrapped__ = inner
        setattr(owner, name, wrapper)

    timed(S3Tier, "get_manifest", "manifest")
    timed(S3Tier, "get_map", "map")
    timed(LmdbTier, "put_objects", "write")
    timed(transfer, "_verified", "verified")
    read_range = S3Tier.read_range

    def reading(self, pack, start, cuts):
        clock[0].add("pack GET", time.perf_counter())
        for body in read_range(self, pack, start, cuts):
            clock[0].add("arrived", time.perf_counter())
            yield body

    S3Tier.read_range = reading


def durable_floors(payloads: list[bytes], root: Path) -> tuple[float, float]:
    """Seconds to write `payloads` to a plain file with an fsync, and into a fresh LMDB home
    (one put_objects call)."""
    from tqstore.config import load_config
    from tqstore.store.store import Store

    path = root / "floor.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for p in payloads:
            f.write(p)
        f.flush()
        os.fsync(f.fileno())
    plain = time.perf_counter() - t0
    path.unlink()
    home = root / "floor-home"
    store = Store.open(home, config=load_config(home, {}))
    import hashlib

    objects = {hashlib.sha256(p).digest(): p for p in payloads}
    t0 = time.perf_counter()
    store._tiers.lmdb.put_objects(objects)
    lmdb = time.perf_counter() - t0
    store.close()
    shutil.rmtree(home)
    return plain, lmdb


def verification_cpu(manifest, payloads: list[bytes]) -> tuple[float, float, float]:
    """Process CPU seconds, over the entry's objects, of sha256, of the full decode (what a pull
    ran before: the arrays built in MLX) and of the pull's checks now (transfer._verified:
    every check, arrays built only for the shared codecs)."""
    import hashlib

    from tqstore.store import transfer
    from tqstore.store.object_checks import decode, wants_for

    wants = wants_for(manifest, len(manifest.blocks), remote=True)
    check = getattr(transfer._verified, "__wrapped__", transfer._verified)
    spent = []
    for step in (lambda w, p: hashlib.sha256(p).digest(), lambda w, p: decode(p, w, w.sha256), check):
        t0 = time.process_time()
        for want, payload in zip(wants, payloads):
            step(want, payload)
        spent.append(time.process_time() - t0)
    return spent[0], spent[1], spent[2]


def run(tokens: int, runs: int) -> tuple[list[dict], dict]:
    """Stage times of `runs` pulls and the floors measured beside each."""
    import mlx.core as mx
    import numpy as np
    from boto3.s3.transfer import TransferConfig

    from common import LocalS3, compressed
    from s3_transfer import model_and_identities
    from storage import raw_snapshot
    from tqstore.config import load_config
    from tqstore.store.store import Store
    from tqstore.store.object_checks import wants_for

    scheme = "turbo4"
    model, model_id, codec_id = model_and_identities(scheme)
    s3 = LocalS3()
    root = Path(tempfile.mkdtemp(prefix="tqstore-pull-stages-", dir=os.environ.get("TQSTORE_BENCH_DIR")))
    out = []
    try:
        raw = raw_snapshot(tokens)
        mx.eval(raw.arrays())
        snap, _ = compressed(model, raw, scheme)
        home = root / "push"
        overrides = {"s3_url": s3.url("stages"), "s3_endpoint": s3.endpoint}
        config = load_config(home, overrides)
        store = Store.open(home, config=config)
        manifest = store.put("e", snap, list(range(tokens)), model=model_id, codec=codec_id, model_ref="bench",
                             prefill_seconds=1.0).manifest
        store.push("e")
        payloads = [store._tiers.lmdb.get_object(w.key) for w in wants_for(manifest, len(manifest.blocks), False)]
        store.close()
        part, concurrency = config.s3_part_size, config.s3_concurrency
        cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=concurrency)
        floor = np.random.default_rng(3).integers(0, 255, manifest.nbytes, dtype=np.uint8).tobytes()
        s3.client.upload_fileobj(io.BytesIO(floor), s3.bucket, "floor/object", Config=cfg)
        clock = [Timeline()]
        instrument(clock)
        for i in range(runs):
            t0 = time.perf_counter()
            s3.client.download_fileobj(s3.bucket, "floor/object", io.BytesIO(), Config=cfg)
            boto3_down = time.perf_counter() - t0
            other = root / f"pull-{i}"
            remote = Store.open(other, config=load_config(other, overrides))
            remote.ls(remote=True)  # its S3 client's first request, outside the timing (as in s3_transfer.py)
            clock[0] = Timeline()
            remote.pull("e")
            clock[0].add("end", clock[0].start)
            remote.close()
            shutil.rmtree(other)
            t, clock[0] = clock[0], Timeline()  # the floors' writes are not the pull's
            plain, lmdb = durable_floors(payloads, root)
            sha, decoded, checked = verification_cpu(manifest, payloads)
            writes = [e for e in t.events if e[0] == "write"]
            row = {"manifest": t.first("manifest", True), "map": t.last("map", True),
                   "packs": t.first("pack GET"), "first_arrival": t.first("arrived"),
                   "first_write": t.first("write"), "last_arrival": t.last("arrived"),
                   "last_verified": t.last("verified", True), "last_write": t.last("write"), "end": t.last("end", True),
                   "write_sum": sum(b - a for _, a, b in writes), "writes": len(writes),
                   "final_write": max(writes, key=lambda e: e[1])[2] - max(writes, key=lambda e: e[1])[1],
                   "boto3": boto3_down, "plain": plain, "lmdb": lmdb,
                   "sha256_cpu": sha, "decode_cpu": decoded, "check_cpu": checked}
            out.append(row)
            print(f"run {i + 1}: pull {row['end'] * 1e3:.0f} ms, boto3 {boto3_down * 1e3:.0f} ms, "
                  f"ratio {boto3_down / row['end']:.2f}, last arrival {row['last_arrival'] * 1e3:.0f} ms, "
                  f"writes {row['write_sum'] * 1e3:.0f} ms in {len(writes)}", file=sys.stderr, flush=True)
        meta = {"stored": manifest.nbytes, "objects": len(manifest.objects)}
    finally:
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out, meta


def ms(values: list[float]) -> str:
    values = [v * 1e3 for v in values]
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def table(rows: list[dict], meta: dict, tokens: int) -> str:
    """Stages and floors as median (range) over the runs."""
    from common import markdown_table

    lines = [[label, ms([r[key] for r in rows])] for label, key in STAGES if all(r[key] is not None for r in rows)]
    lines += [
        ["LMDB writes: time in put_objects, all calls (on the writer thread)", ms([r["write_sum"] for r in rows])
         + f" in {min(r['writes'] for r in rows)}-{max(r['writes'] for r in rows)} calls"],
        ["the last write (remaining objects + manifest, one synced commit)", ms([r["final_write"] for r in rows])],
        ["after the last arrival (verify, write, manifest)", ms([r["end"] - r["last_arrival"] for r in rows])],
        ["floor: boto3 download of the same bytes into memory", ms([r["boto3"] for r in rows])],
        ["floor: the same bytes written to a plain file + fsync", ms([r["plain"] for r in rows])],
        ["floor: the same objects put into a fresh LMDB home (one call)", ms([r["lmdb"] for r in rows])],
        ["CPU, all objects: sha256", ms([r["sha256_cpu"] for r in rows])],
        ["CPU, all objects: full decode, arrays built (the pull's check before this pass)",
         ms([r["decode_cpu"] for r in rows])],
        ["CPU, all objects: the pull's check now (no arrays built but the shared codecs')",
         ms([r["check_cpu"] for r in rows])],
        ["pull / boto3 (boto3 s / pull s)", statistics_ratio(rows)],
    ]
    head = f"{tokens} tokens, turbo4, {meta['stored'] / 1e6:.1f} MB in {meta['objects']} objects; ms from the pull's start"
    return markdown_table([head, f"median (range) over {len(rows)} runs"], lines)


def statistics_ratio(rows: list[dict]) -> str:
    ratios = [r["boto3"] / r["end"] for r in rows]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--write", action="store_true", help="write the tables into docs/benchmarks.md")
    args = parser.parse_args(argv)
    bodies = []
    for tokens in args.tokens:
        rows, meta = run(tokens, args.runs)
        bodies.append(table(rows, meta, tokens))
    body = "\n\n".join(bodies)
    from common import print_and_write

    return print_and_write("bench-s3-pull-stages", body, args.write, argv)


if __name__ == "__main__":
    sys.exit(main())
