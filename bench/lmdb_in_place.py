"""Would reading LMDB values in place (zero copy) cut a restore's CPU work? (issue 28)

    python bench/lmdb_in_place.py --mib 136 --runs 5 [--write]

An LMDB restore copies each object out of LMDB's map into a buffer its reader thread reuses, then
checks every byte there (xxh3-128) and copies the groups into MLX memory
(tqstore/store/lmdb_reads.py). Reading the values in place, as buffers inside the read
transaction, would drop the first copy. This times the difference on the values themselves:
segment-sized values (1 MiB - 16 bytes, as the tier writes them) in a fresh LMDB file, their pages
in the page cache (a restore's read-ahead puts them there first), each read three ways in turn:
copied into a reused buffer and hashed there (what a restore does), hashed in place, and copied
only. Every way runs once per round, in turn, so each sees the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table, print_and_write  # noqa: E402

SEGMENT = (1 << 20) - 16  # payload bytes of one LMDB segment (tqstore/store/tiers/lmdb_layout.py)
MARKER = "bench-lmdb-in-place"


def fill(env: lmdb.Environment, count: int) -> None:
    """`count` segment-sized values of random bytes (8 distinct ones, repeated)."""
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 256, SEGMENT, dtype=np.uint8).tobytes() for _ in range(8)]
    with env.begin(write=True) as txn:
        for i in range(count):
            txn.put(i.to_bytes(4, "big"), values[i % 8])


def copy_then_hash(txn: lmdb.Transaction, count: int, buf: np.ndarray) -> None:
    for i in range(count):
        value = txn.get(i.to_bytes(4, "big"))
        buf[:len(value)] = np.frombuffer(value, np.uint8)
        xxhash.xxh3_128_digest(buf[:len(value)])


def hash_in_place(txn: lmdb.Transaction, count: int, buf: np.ndarray) -> None:
    for i in range(count):
        xxhash.xxh3_128_digest(txn.get(i.to_bytes(4, "big")))


def copy_only(txn: lmdb.Transaction, count: int, buf: np.ndarray) -> None:
    for i in range(count):
        value = txn.get(i.to_bytes(4, "big"))
        buf[:len(value)] = np.frombuffer(value, np.uint8)


WAYS = (("copied into a reused buffer, then hashed (a restore today)", copy_then_hash),
        ("hashed in place (zero copy)", hash_in_place),
        ("copied only", copy_only))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=136, help="MiB of values (default 136, a 16k turbo4 entry x2)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    count = max(1, (args.mib << 20) // SEGMENT)
    buf = np.empty(SEGMENT, np.uint8)
    seconds: dict[str, list[float]] = {name: [] for name, _ in WAYS}
    with tempfile.TemporaryDirectory(prefix="tqstore-lmdb-in-place-") as folder:
        env = lmdb.open(folder, map_size=2 * count * (SEGMENT + 4096) + (64 << 20))
        try:
            fill(env, count)
            with env.begin(buffers=True) as txn:
                copy_then_hash(txn, count, buf)  # the pages in the page cache and mapped, as after read-ahead
                for _ in range(args.runs):
                    for name, way in WAYS:
                        t0 = time.perf_counter()
                        way(txn, count, buf)
                        seconds[name].append(time.perf_counter() - t0)
        finally:
            env.close()
    nbytes = count * SEGMENT
    rows = [[name, f"{min(s) * 1e3:.1f}-{max(s) * 1e3:.1f}", f"{statistics.median(s) * 1e3:.1f}",
             f"{nbytes / statistics.median(s) / 1e9:.2f}"] for name, s in seconds.items()]
    body = (f"{count} values of {SEGMENT:,} bytes ({nbytes / 1e6:.0f} MB), {args.runs} rounds:\n\n"
            + markdown_table(["way", "ms (range)", "ms (median)", "GB/s (median)"], rows))
    return print_and_write(MARKER, body, args.write, argv)


if __name__ == "__main__":
    raise SystemExit(main())
