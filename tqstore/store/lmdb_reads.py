"""An entry's objects read out of LMDB ahead of the restoring thread, checked, and, where every
block comes from LMDB, decoded straight into their joined arrays.

Threads, one per core, stay READ_AHEAD objects per thread ahead of the caller: each copies one
object out of LMDB once and checks every byte against the object's own digests (format 3: one
xxh3 pass, not the tier's sha256 as well), decoding as it goes; LMDB copies, hashing and zstd
release the GIL. No MLX off the caller's thread but the numpy copies into a `Run` (MLX arrays
are made and joined by the caller).

A run of blocks is decoded in place: the first and the last block are read first, on the
caller's thread, and their headers size the joined arrays of all of them (`runs.Run`; the
blocks between hold as many tokens as the first, as every block but the last does). Each reader
thread then copies a block out of LMDB into a buffer of its own that it reuses (warm pages, where
a new buffer per object paid the first touch of its pages), checks it there, and copies its
groups into their token slices. Before, every block was copied out of LMDB into new memory, and
only once all were read, into new zero-filled joined arrays on the caller's thread: two first
touches of fresh memory per byte and a zero fill, none of it overlapped with the reads.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tqstore.errors import CorruptBlock, TqstoreError
from tqstore.format.header import Header
from tqstore.format.objects import Parsed, parse as parse_object
from tqstore.format.runs import Run
from tqstore.store.object_checks import BAD_CONTENT, Want
from tqstore.store.tiers.lmdb import LmdbTier

READ_AHEAD = 2  # LMDB objects per reader thread read and verified ahead of the one being built
MIN_RUN = 3  # blocks: fewer are read and built as before (two reads on the caller's thread would be all of them)


@dataclass(frozen=True)
class Placed:
    """Block `index` of a run, checked in full and copied into its slices of the run's arrays;
    with its decoded groups only where the caller read it (the first and the last block: block
    0's calibration arrays are built from them)."""

    header: Header
    index: int
    raws: list[np.ndarray] | None = None


Read = tuple[Parsed | Placed | TqstoreError, str, int] | None | CorruptBlock


class LmdbReads:
    """The objects of `wants` read from `lmdb`, in order (iterate once): each None (absent),
    CorruptBlock (the tier quarantined it), or (the object parsed and checked in full, or placed,
    or why it is not the object wanted; the digest it was recorded with; its stored bytes). The
    first `run` wants, blocks 0..run-1 of one entry, are decoded into `self.run` where it could
    be allocated (None otherwise, or before iterating)."""

    def __init__(self, lmdb: LmdbTier, wants: list[Want], run: int = 0) -> None:
        self._lmdb, self._wants, self._n = lmdb, wants, run if run >= MIN_RUN else 0
        self.run: Run | None = None
        self._scratch = threading.local()

    def __iter__(self) -> Iterator[Read]:
        keys = [w.key for w in self._wants]
        if self._n:  # the run's last block is read first, beside its first
            keys.insert(1, keys.pop(self._n - 1))
        streaming = threading.Thread(target=self._lmdb.read_soon, args=(keys,), name="tqstore-read-soon", daemon=True)
        streaming.start()
        try:
            yield from self._reads()
        finally:
            streaming.join()

    def _reads(self) -> Iterator[Read]:
        ready: dict[int, Read] = {}
        if self._n:
            ends = (0, self._n - 1)
            ready = {i: self._read(self._wants[i]) for i in ends}
            self.run = _allocate([ready[i] for i in ends], self._n)
            if self.run is not None:
                for i in ends:
                    parsed = ready[i][0]
                    self.run.place(i, parsed.header, parsed.raws)
                    ready[i] = (Placed(parsed.header, i, parsed.raws), *ready[i][1:])
        tasks = [(w, i if self.run is not None and i < self._n else None) for i, w in enumerate(self._wants)]
        if len(self._wants) - len(ready) < 2:
            for i, (want, at) in enumerate(tasks):
                yield ready[i] if i in ready else self._read(want, at)
            return
        workers = os.cpu_count() or 1
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tqstore-read") as pool:
            ahead, queued, todo = READ_AHEAD * workers, deque(), iter(enumerate(tasks))
            for i, (want, at) in todo:
                queued.append(ready[i] if i in ready else pool.submit(self._read, want, at))
                if len(queued) > ahead:
                    yield _result(queued.popleft())
            while queued:
                yield _result(queued.popleft())

    def _read(self, want: Want, at: int | None = None) -> Read:
        """One object; with `at`, block `at` of the run, read into this thread's buffer and
        placed (read again into a buffer of its own if it does not fit the run)."""
        try:
            found = self._lmdb.read_unhashed(want.key, into=None if at is None else self._buffer)
        except CorruptBlock as exc:
            return exc
        if found is None:
            return None
        payload, digest = found
        try:
            parsed = parse_object(payload, expect=want.expect)
        except BAD_CONTENT as exc:
            return exc, digest, len(payload)
        if at is None:
            return parsed, digest, len(payload)
        if parsed.raws is None or not self.run.fits(at, parsed.header):
            return self._read(want)
        self.run.place(at, parsed.header, parsed.raws)
        return Placed(parsed.header, at), digest, len(payload)

    def _buffer(self, size: int) -> np.ndarray:
        """`size` bytes of this thread's reused buffer (grown as needed)."""
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.size < size:
            buf = self._scratch.buf = np.empty(size, np.uint8)
        return buf[:size]


def _allocate(ends: list[Read], n: int) -> Run | None:
    """The run of `n` blocks whose first and last were read as `ends`, or None where either is
    not a block that decodes into one (missing, damaged, an older format, ungrouped)."""
    parsed = [r[0] if isinstance(r, tuple) else None for r in ends]
    if any(not isinstance(p, Parsed) or p.raws is None for p in parsed):
        return None
    return Run.allocate([parsed[0].header] * (n - 1) + [parsed[1].header])


def _result(item: Future | Read) -> Read:
    return item.result() if isinstance(item, Future) else item
