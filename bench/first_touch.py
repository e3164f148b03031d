"""What writing into fresh memory costs beside a cold read of as many bytes (issue 28).

    python bench/first_touch.py --mb 64 256 --runs 5 --write

A restore decodes an entry into joined arrays allocated for it: memory the process has not
touched, whose every page the kernel must find and zero on the first write. This bench times
that first write on its own, per stored GB, in fresh anonymous mappings (the kernel's cost,
whatever allocator sits above it): a copy from a warm buffer into 4 KiB pages; the same into
memory advised to transparent huge pages (what `runs.blank` asks for on Linux); the huge pages
populated first by two threads at once, each over its half (MADV_POPULATE_WRITE), then the
copy; and the copy again into the now warm destination. Beside them, in the same run, the floor
that issue 28's restore targets are measured against: a sequential read of a file of as many
bytes with its pages dropped. Ranges over --runs runs. `--write` puts the table into
docs/benchmarks.md (section bench-first-touch).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from common import markdown_table, replace_section, stamp  # noqa: E402
from storage import cold_read_floor, span  # noqa: E402
from tqstore.madvise import HUGE_PAGE, HUGEPAGE, advise  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
POPULATE_WRITE = 23  # madvise(2): fault the range in, writable, now (Linux 5.14)
MODES = ("4 KiB pages, copy", "huge pages, copy", "huge pages: populate on 2 threads", "then the copy",
         "warm destination, copy", "floor: cold read of a file")


def mapping(nbytes: int, huge: bool) -> mmap.mmap:
    """A new anonymous mapping of `nbytes`, advised to huge pages when `huge`."""
    region = mmap.mmap(-1, nbytes)
    if huge:
        advise(np.frombuffer(region, np.uint8), HUGEPAGE, HUGE_PAGE)
    return region


def copies(region: mmap.mmap, source: np.ndarray, populate: bool) -> list[float]:
    """Seconds of: populating `region` on two threads (NaN where the kernel has no
    MADV_POPULATE_WRITE, or when not asked), copying `source` into it, copying it again."""
    dest = np.frombuffer(region, np.uint8)
    times = [float("nan")]
    if populate:
        t0 = time.perf_counter()
        took = populate_halves(dest)
        times[0] = time.perf_counter() - t0 if took else float("nan")
    for _ in range(2):
        t0 = time.perf_counter()
        np.copyto(dest, source)
        times.append(time.perf_counter() - t0)
    return times


def populate_halves(view: np.ndarray) -> bool:
    """MADV_POPULATE_WRITE over each half of `view`, the halves on two threads at once; whether
    the kernel took it."""
    cut = view.nbytes // 2 // HUGE_PAGE * HUGE_PAGE
    done = []
    other = threading.Thread(target=lambda: done.append(advise(view[cut:], POPULATE_WRITE, HUGE_PAGE)))
    other.start()
    done.append(advise(view[:cut], POPULATE_WRITE, HUGE_PAGE))
    other.join()
    return all(done)


def measured(nbytes: int, huge: bool, source: np.ndarray, populate: bool) -> list[float]:
    region = mapping(nbytes, huge)
    try:
        return copies(region, source, populate)
    finally:
        region.close()


def one_run(nbytes: int, source: np.ndarray, file: Path) -> dict[str, float]:
    """Seconds of each mode for `nbytes`, each in a fresh mapping."""
    _, small, _ = measured(nbytes, False, source, False)
    _, huge, warm = measured(nbytes, True, source, False)
    populated, then, _ = measured(nbytes, True, source, True)
    return dict(zip(MODES, (small, huge, populated, then, warm, cold_read_floor(file, nbytes))))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[64, 256], help="sizes, MiB (default 64 256)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv[1:])
    rows = []
    for mb in args.mb:
        nbytes = mb << 20
        source = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        with tempfile.TemporaryDirectory(dir=os.environ.get("TQSTORE_BENCH_DIR")) as tmp:
            file = Path(tmp) / "data"
            with open(file, "wb") as f:
                f.write(source.tobytes())
                f.flush()
                os.fsync(f.fileno())
            runs = [one_run(nbytes, source, file) for _ in range(args.runs)]
        gb = nbytes / 1e9
        for run in runs:
            print(f"{mb} MiB: " + ", ".join(f"{m} {s * 1000:.1f} ms" for m, s in run.items()), flush=True)
        rows.append([mb] + [span([r[m] / gb for r in runs], "{:.3f}") for m in MODES])
    body = f"{stamp(argv)}\n\n" + markdown_table(["MiB"] + [f"{m} (s/GB)" for m in MODES], rows)
    print(body)
    if args.write:
        replace_section(DOC, "bench-first-touch", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
