"""The LMDB tier (the SSD): manifests, the object index and object payloads in one environment.

Payloads are cut into fixed-size segments (the last one shorter) so that the overflow pages LMDB
frees when an object is deleted fit the next object's segments, instead of fragmenting the file;
a segment holds segment_size - 16 bytes so that, with LMDB's page header, it fills whole pages.
An object's header and all its segments are written in one transaction; `put_objects` returns
once its objects are committed, and a manifest is written either in the transaction of the last
of its objects (`put_objects(..., manifest=...)`, the publish path: one synced commit for an
entry of up to 64 MiB) or after them in its own, so a killed process leaves at worst orphan
objects, never a visible manifest with missing objects. The records are described in lmdb_layout.py.

Concurrency: one environment per process and real path (`LmdbTier.open` keeps the registry;
py-lmdb 3.0 refuses a second open anyway), every write on one writer thread, reads in short
transactions on the caller's thread (lmdb_env.py). Several processes may share the environment
through LMDB's own locking. The map grows on demand; users never see MapFullError.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from tqstore.config import Config
from tqstore.units import MiB
from tqstore.errors import CorruptBlock, FormatVersionTooNew, TqstoreError
from tqstore.madvise import WILLNEED, advise
from tqstore.names import validate_name
from tqstore.store.tiers.base import ManifestInfo, ObjectInfo, PutCounts, check_key
from tqstore.store.tiers.lmdb_env import LmdbEnv, check_data_file, hold_open_lock, lmdb_failure, release_open_lock
from tqstore.store.tiers.lmdb_records import (
    DamagedRecord, find_damaged, fix, key_label, quarantine_record, schema_number, used_time,
)
from tqstore.store.tiers.lmdb_layout import (
    BATCH_KEYS, DB_NAMES, HEADER, SCHEMA_VERSION, TIME, Problem, copy, delete_segments, key_batch,
    header_info, load_object, orphan_batch, read_object, segments, write_object,
)

# A write transaction keeps its dirty pages in RAM until commit: batch put_objects by bytes.
_TXN_BYTES = 64 * MiB
_READ_SOON_KEYS = 8  # objects per read transaction of `read_soon`

_REGISTRY: dict[str, LmdbTier] = {}  # realpath -> this process's one open tier for it
_REGISTRY_LOCK = threading.Lock()



@dataclass(frozen=True)
class LmdbStats:
    """Sizes and counts of one LMDB environment."""

    file_bytes: int  # data.mdb on disk
    used_bytes: int  # pages holding live data (file_bytes - used_bytes is reusable free space)
    map_bytes: int  # current map size (address space, grows on demand)
    object_count: int
    payload_bytes: int
    manifest_count: int
    quarantine_count: int


@dataclass(frozen=True)
class QuarantineRecord:
    """An object removed because it failed verification."""

    key: bytes
    reason: str
    time: float
    size: int


@dataclass(frozen=True)
class CompactResult:
    """data.mdb sizes before and after `compact`."""

    bytes_before: int
    bytes_after: int


class LmdbTier:
    """Objects and manifests in one LMDB environment. Open it with `LmdbTier.open`."""

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        segment_size: int = Config.segment_size,
        map_size: int = Config.lmdb_map_size,
        min_free_disk_bytes: int = Config.min_free_disk_bytes,
    ) -> LmdbTier:
        """The process's tier for the environment folder `path` (created if missing).

        A second open of the same real path returns the same instance (the first settings win).
        Refused in a process forked from one that had the environment open.
        """
        folder = Path(path).expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TqstoreError(f"cannot create the LMDB folder {folder}: {exc.strerror}") from exc
        real = os.path.realpath(folder)
        with _REGISTRY_LOCK:
            tier = _REGISTRY.get(real)
            if tier is None:
                env = LmdbEnv(Path(real), DB_NAMES, SCHEMA_VERSION, map_size, min_free_disk_bytes)
                tier = _REGISTRY[real] = cls(env, segment_size)
            tier._env.check_usable()
            return tier

    @classmethod
    def from_config(cls, config: Config) -> LmdbTier:
        """`open` with the folder and settings of `config`."""
        return cls.open(
            config.lmdb_path,
            segment_size=config.segment_size,
            map_size=config.lmdb_map_size,
            min_free_disk_bytes=config.min_free_disk_bytes,
        )

    def __init__(self, env: LmdbEnv, segment_size: int) -> None:
        self._env = env
        self.path = env.path
        self.segment_size = segment_size
        self._touches: list[Future] = []
        self._touch_lock = threading.Lock()

    # --- objects -------------------------------------------------------------------------------

    def put_object(self, key: bytes, payload: bytes) -> bool:
        """Store `payload` under `key`; False (and nothing written) if the key already exists."""
        return self.put_objects({key: payload}).stored == 1

    def put_objects(self, objects: Mapping[bytes, bytes | Sequence[memoryview]], sha256s: Mapping[bytes, str] | None = None,
                    manifest: tuple[str, Callable[[dict[bytes, ObjectInfo]], bytes | None]] | None = None
                    ) -> PutCounts:
        """Store many objects; existing keys are skipped, never rewritten.

        Each object is atomic; objects are committed in batches of about 64 MiB. A payload is
        bytes, or consecutive buffers that joined are its bytes (each copied once, into LMDB).
        `sha256s` gives hex digests the caller has just computed from these very bytes (not
        hashed again).
        `manifest` (name, make) ends the last batch's transaction with a manifest: `make` gets
        the stored ObjectInfo of every key of `objects` as that transaction sees it (another
        process's copy where one was stored first) and returns the manifest's bytes, or None to
        write none. The objects and their manifest then commit together: one synced commit
        where a put used to pay two, and never a visible manifest without its objects.
        """
        known = sha256s or {}
        items = [(check_key(k), parts, bytes.fromhex(known[k]) if k in known else payload_sha256(parts))
                 for k, parts in ((k, _buffers(p)) for k, p in objects.items())]
        if manifest is not None:
            validate_name(manifest[0])
        batches: list[list[tuple[bytes, tuple[memoryview, ...], bytes]]] = [[]]
        size = 0
        for item in items:
            if size >= _TXN_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(item)
            size += _length(item[1])
        stored = 0
        for n, batch in enumerate(batches):
            last = n == len(batches) - 1
            if batch or (last and manifest is not None):
                stored += self._env.write(self._put_batch, batch, manifest if last else None, [i[0] for i in items],
                                          needed=sum(_length(i[1]) for i in batch))
        return PutCounts(stored, len(items) - stored)

    def get_object(self, key: bytes) -> bytes | None:
        """The payload of `key`, verified (segment count and lengths, sha256), or None.

        A payload that fails verification is quarantined and raises CorruptBlock.
        """
        found = self.get_verified(key)
        return None if found is None else found[0]

    def get_verified(self, key: bytes) -> tuple[bytes, str] | None:
        """`get_object` with the hex sha256 the payload was just verified against."""
        return self._checked_read(key, lambda txn, key: load_object(txn, self._env.dbs, key, keep=True))

    def read_unhashed(self, key: bytes, into: Callable[[int], np.ndarray] | None = None
                      ) -> tuple[np.ndarray, str] | None:
        """The payload of `key` copied once into a numpy buffer (a new one, or `into(size)`: one
        the caller reuses), with the sha256 recorded when it was written, or None; the segments
        are checked (count, lengths) but not hashed: for callers that check every byte against
        the object's own digests (object format 3; a format 1 or 2 object is then checked
        against its frame's digest). A payload that fails these checks is quarantined and
        raises CorruptBlock."""
        return self._checked_read(key, lambda txn, key: read_object(txn, self._env.dbs, key, into))

    def read_soon(self, keys: Iterable[bytes]) -> None:
        """Ask the kernel to start reading the payloads of `keys` into the page cache (madvise
        WILLNEED over LMDB's map), without waiting: reads of them that follow find their pages
        there, and the disk streams while the reader checks and decodes what it already has.
        Absent or damaged objects are left to the reads."""
        keys = [check_key(k) for k in keys]

        def advise_all(batch: list[bytes], txn) -> None:
            for key in batch:
                found = segments(txn, self._env.dbs, key)[1]
                for part in found if isinstance(found, list) else ():
                    advise(part, WILLNEED)

        for at in range(0, len(keys), _READ_SOON_KEYS):  # short transactions: a map resize waits for none long
            self._env.read(functools.partial(advise_all, keys[at:at + _READ_SOON_KEYS]))

    def _checked_read(self, key: bytes, read) -> tuple[object, str] | None:
        key = check_key(key)
        payload, problem, header = self._env.read(lambda txn: read(txn, key))
        if problem is not None:
            self._env.write(self._quarantine, key, header, f"{problem.kind}: {problem.detail}")
            raise CorruptBlock(
                f"object {key.hex()} in the LMDB store at {self.path} is corrupt ({problem.detail}); "
                "it was quarantined and counts as a miss: it will be fetched or recomputed again"
            )
        return None if payload is None else (payload, HEADER.unpack(header)[1].hex())

    def has_object(self, key: bytes) -> bool:
        """Whether `key` is in the index (without reading or verifying its payload)."""
        return self.has_objects([key])[0]

    def has_objects(self, keys: Sequence[bytes]) -> list[bool]:
        """`has_object` of each key, in one read transaction (a lookup asks for every block of
        an entry: 258 transactions cost 4 ms at 64k tokens on the 2-core CPU)."""
        keys = [check_key(k) for k in keys]
        objects = self._env.dbs[b"objects"]
        return self._env.read(lambda txn: [txn.get(k, db=objects) is not None for k in keys])

    def object_info(self, key: bytes) -> ObjectInfo | None:
        """The index entry of `key`, or None."""
        key = check_key(key)
        raw = self._env.read(lambda txn: copy(txn.get(key, db=self._env.dbs[b"objects"])))
        return None if raw is None else header_info(key, raw)

    def touch_objects(self, keys: Iterable[bytes], when: float | None = None) -> int:
        """Set the last-used time of existing objects (default now); returns how many exist."""
        keys = [check_key(k) for k in keys]
        return self._env.write(self._touch_objects, keys, time.time() if when is None else when)

    def delete_objects(self, keys: Iterable[bytes]) -> int:
        """Delete objects (index entry and segments); returns how many existed.

        A second, tiny commit follows: LMDB lets a transaction reuse the pages freed by an
        earlier one only once a later commit has superseded it (the previous snapshot stays
        readable until then), and on a full disk the next put needs exactly those pages.
        """
        keys = [check_key(k) for k in keys]
        deleted = self._env.write(self._delete_objects, keys)
        if deleted:
            self._env.write(self._settle)
        return deleted

    def iter_object_keys(self) -> Iterator[bytes]:
        """Every object key, in key order, read in short transactions of 1024 keys."""
        return self._iter_keys(b"objects")

    # --- manifests -----------------------------------------------------------------------------

    def put_manifest(self, name: str, data: bytes) -> None:
        """Create or replace the manifest `name` (and mark it used now)."""
        validate_name(name)
        self._env.write(self._put_manifest, name.encode(), bytes(data), needed=len(data))

    def replace_manifest(self, name: str, expected: bytes, data: bytes, *, mark_used: bool) -> bool:
        """Replace the manifest `name` with `data` only if it still is `expected`, in one write
        transaction (False, nothing written, when another writer changed or removed it since it
        was read). `mark_used`: a pin marks the entry used; a push's bookkeeping must not, or
        it would reorder eviction."""
        validate_name(name)
        return self._env.write(self._replace_manifest, name.encode(), bytes(expected), bytes(data), mark_used,
                               needed=len(data))

    def get_manifest(self, name: str) -> bytes | None:
        """The manifest `name`, or None."""
        key = validate_name(name).encode()
        return self._env.read(lambda txn: copy(txn.get(key, db=self._env.dbs[b"manifests"])))

    def delete_manifest(self, name: str) -> bool:
        """Delete the manifest `name`; False if there was none."""
        return self._env.write(self._delete_manifest, validate_name(name).encode())

    def list_manifests(self) -> list[ManifestInfo]:
        """Every manifest with its size and last-used time, by name."""
        self._settle_touches()
        return self._env.read(self._list_manifests)

    def touch(self, name: str, when: float | None = None) -> bool:
        """Mark the manifest `name` used now, or at `when` (for LRU eviction); False if there is none."""
        return self._env.write(self._touch, validate_name(name).encode(), time.time() if when is None else when)

    def touch_soon(self, name: str) -> None:
        """`touch` on the writer thread without waiting for its commit (a read's bookkeeping);
        a touch that fails (a full disk) is dropped. Reads of last-used times wait for it."""
        future = self._env.write_soon(self._touch, validate_name(name).encode(), time.time())
        with self._touch_lock:
            self._touches = [f for f in self._touches if not f.done()] + [future]

    def _settle_touches(self) -> None:
        with self._touch_lock:
            pending, self._touches = self._touches, []
        wait(pending)

    # --- maintenance ---------------------------------------------------------------------------

    def quarantine(self, key: bytes, reason: str) -> bool:
        """Remove an intact object whose content is not what its key promises (a format or
        identity failure found by the caller); recorded like a checksum failure. False if absent."""
        key = check_key(key)
        header = self._env.read(lambda txn: copy(txn.get(key, db=self._env.dbs[b"objects"])))
        if header is None:
            return False
        self._env.write(self._quarantine, key, header, reason)
        return True

    def clear_quarantine(self) -> int:
        """Forget the quarantine records (their objects are already gone); returns how many."""
        def job(txn: lmdb.Transaction) -> int:
            db = self._env.dbs[b"quarantine"]
            count = txn.stat(db)["entries"]
            txn.drop(db, delete=False)
            return count

        return self._env.write(job)

    def quarantined(self) -> list[QuarantineRecord]:
        """Objects removed because they failed verification (until stored again)."""
        def read(txn: lmdb.Transaction) -> list[QuarantineRecord]:
            records = []
            for key, value in txn.cursor(db=self._env.dbs[b"quarantine"]):
                record = quarantine_record(value)
                if record is None:
                    continue  # damaged: listed by damaged_records
                records.append(QuarantineRecord(bytes(key), record["reason"], record["time"], record["size"]))
            return records

        return self._env.read(read)

    def stats(self) -> LmdbStats:
        """File size, pages in use, map size and counts."""
        file_bytes, map_bytes, page_size = self._env.info()

        def read(txn: lmdb.Transaction) -> LmdbStats:
            dbs = self._env.dbs
            page_stats = [txn.stat(db) for db in dbs.values()] + [self._env.main_db_stat()]
            pages = sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"] for s in page_stats)
            headers = txn.cursor(db=dbs[b"objects"]).iternext(keys=False)
            return LmdbStats(
                file_bytes=file_bytes,
                used_bytes=pages * page_size,
                map_bytes=map_bytes,
                object_count=txn.stat(dbs[b"objects"])["entries"],
                payload_bytes=sum(HEADER.unpack(h)[2] for h in headers if len(h) == HEADER.size),
                manifest_count=txn.stat(dbs[b"manifests"])["entries"],
                quarantine_count=txn.stat(dbs[b"quarantine"])["entries"],
            )

        return self._env.read(read)

    def verify(self) -> list[Problem]:
        """Check every object (header, segments, sha256) and look for orphan segments.

        Read-only: nothing is quarantined or repaired. Runs in many short read transactions.
        """
        problems = []
        for key in self.iter_object_keys():
            problem = self._env.read(lambda txn, key=key: load_object(txn, self._env.dbs, key, keep=False)[1])
            if problem is not None:
                problems.append(problem)
        after: bytes | None = b""
        while after is not None:
            orphans, after = self._env.read(lambda txn, after=after: orphan_batch(txn, self._env.dbs, after))
            problems += [Problem("orphan_segment", k, "segments without an index entry") for k in orphans]
        return problems

    def delete_orphan_segments(self, keys: Iterable[bytes]) -> int:
        """Delete the segments of `keys` that have no index entry (verify's orphan_segment,
        whatever the key's length); returns how many keys had some."""
        def job(txn: lmdb.Transaction, keys: list[bytes]) -> int:
            dbs, removed = self._env.dbs, 0
            for key in keys:
                if txn.get(key, db=dbs[b"objects"]) is None:
                    removed += delete_segments(txn, dbs[b"segments"], key)
            return removed

        keys = [bytes(k) for k in keys]
        return self._env.write(job, keys) if keys else 0

    def check_room(self, nbytes: int) -> None:
        """DiskFull if writing `nbytes` now would be refused by the free-disk guard."""
        self._env.read(lambda txn: self._env.check_free_disk(nbytes, txn))

    def damaged_records(self) -> list[DamagedRecord]:
        """Index records that are damaged one by one (lmdb_records.py); [] when all are sound."""
        return self._env.read(lambda txn: find_damaged(txn, self._env.dbs))

    def manifest_record(self, key: bytes) -> bytes | None:
        """The raw manifest stored under `key`, whatever the key (for repairs)."""
        return self._env.read(lambda txn: copy(txn.get(key, db=self._env.dbs[b"manifests"])))

    def fix_records(self, records: Iterable[DamagedRecord]) -> int:
        """Fix or drop each damaged record (lmdb_records.fix); returns how many."""
        records = list(records)

        def job(txn: lmdb.Transaction) -> int:
            for record in records:
                fix(txn, self._env.dbs, record, SCHEMA_VERSION)
            return len(records)

        return self._env.write(job) if records else 0

    def compact(self) -> CompactResult:
        """Rewrite the environment without free pages (LMDB files never shrink by themselves).

        Copies it compactly to a temp file in the same folder, then atomically replaces data.mdb
        and reopens. No other process may have this environment open meanwhile: that is checked
        before and after the copy (ConflictError), but a process opening it in the last instant
        before the replacement would keep writing to the old file, so stop servers first.
        """
        return CompactResult(*self._env.compact())

    def close(self) -> None:
        """Finish queued writes and close the environment (a later `open` reopens it)."""
        with _REGISTRY_LOCK:
            if _REGISTRY.get(str(self.path)) is self:
                del _REGISTRY[str(self.path)]
        self._env.close()

    def __repr__(self) -> str:
        return f"LmdbTier({str(self.path)!r})"

    # --- write jobs (writer thread) --------------------------------------------------------------

    def _put_batch(self, txn: lmdb.Transaction, batch: list[tuple[bytes, tuple[memoryview, ...], bytes]],
                   manifest: tuple[str, Callable[[dict[bytes, ObjectInfo]], bytes | None]] | None,
                   keys: list[bytes]) -> int:
        dbs = self._env.dbs
        new = [item for item in batch if txn.get(item[0], db=dbs[b"objects"]) is None]
        self._env.check_free_disk(sum(_length(payload) for _, payload, _ in new), txn)
        now = time.time()
        for key, payload, digest in new:
            write_object(txn, dbs, key, payload, digest, self.segment_size, now)
        if manifest is not None:
            stored = {key: txn.get(key, db=dbs[b"objects"]) for key in keys}
            infos = {key: header_info(key, bytes(raw)) for key, raw in stored.items() if raw is not None}
            data = manifest[1](infos)
            if data is not None:
                self._put_manifest(txn, manifest[0].encode(), bytes(data))
        return len(new)

    def _quarantine(self, txn: lmdb.Transaction, key: bytes, header: bytes | None, reason: str) -> None:
        objects = self._env.dbs[b"objects"]
        if copy(txn.get(key, db=objects)) != header:
            return  # already quarantined, or stored again since it was read
        txn.delete(key, db=objects)
        delete_segments(txn, self._env.dbs[b"segments"], key)
        size = HEADER.unpack(header)[2] if header and len(header) == HEADER.size else 0
        record = {"reason": reason, "time": time.time(), "size": size}
        txn.put(key, json.dumps(record).encode(), db=self._env.dbs[b"quarantine"])

    def _touch_objects(self, txn: lmdb.Transaction, keys: list[bytes], when: float) -> int:
        objects, found = self._env.dbs[b"objects"], 0
        for key in keys:
            raw = txn.get(key, db=objects)
            if raw is not None and len(raw) == HEADER.size:
                fields = HEADER.unpack(raw)
                txn.put(key, HEADER.pack(*fields[:-1], when), db=objects)
                found += 1
        return found

    def _delete_objects(self, txn: lmdb.Transaction, keys: list[bytes]) -> int:
        deleted = 0
        for key in keys:
            deleted += bool(txn.delete(key, db=self._env.dbs[b"objects"]))
            delete_segments(txn, self._env.dbs[b"segments"], key)
        return deleted

    def _put_manifest(self, txn: lmdb.Transaction, name: bytes, data: bytes) -> None:
        self._env.check_free_disk(len(data), txn)
        txn.put(name, data, db=self._env.dbs[b"manifests"])
        txn.put(name, TIME.pack(time.time()), db=self._env.dbs[b"manifest_used"])

    def _replace_manifest(self, txn: lmdb.Transaction, name: bytes, expected: bytes, data: bytes,
                          mark_used: bool) -> bool:
        if txn.get(name, db=self._env.dbs[b"manifests"]) != expected:
            return False
        self._env.check_free_disk(len(data), txn)
        txn.put(name, data, db=self._env.dbs[b"manifests"])
        if mark_used:
            txn.put(name, TIME.pack(time.time()), db=self._env.dbs[b"manifest_used"])
        return True

    def _settle(self, txn: lmdb.Transaction) -> None:
        txn.put(b"settled", TIME.pack(time.time()), db=self._env.dbs[b"meta"])

    def _delete_manifest(self, txn: lmdb.Transaction, name: bytes) -> bool:
        txn.delete(name, db=self._env.dbs[b"manifest_used"])
        return bool(txn.delete(name, db=self._env.dbs[b"manifests"]))

    def _touch(self, txn: lmdb.Transaction, name: bytes, when: float) -> bool:
        if txn.get(name, db=self._env.dbs[b"manifests"]) is None:
            return False
        txn.put(name, TIME.pack(when), db=self._env.dbs[b"manifest_used"])
        return True

    # --- reads ---------------------------------------------------------------------------------

    def _list_manifests(self, txn: lmdb.Transaction) -> list[ManifestInfo]:
        used = self._env.dbs[b"manifest_used"]
        infos = []
        for name, data in txn.cursor(db=self._env.dbs[b"manifests"]):
            # A damaged key or time is listed as is (the name then fails validation downstream,
            # the time counts as never used): one bad record must not hide the others.
            last = used_time(txn.get(name, db=used)) or 0.0
            infos.append(ManifestInfo(key_label(bytes(name)), len(data), last))
        return infos

    def _iter_keys(self, db_name: bytes) -> Iterator[bytes]:
        after: bytes | None = None
        while True:
            batch = self._env.read(lambda txn, after=after: key_batch(txn, self._env.dbs[db_name], after))
            yield from batch
            if len(batch) < BATCH_KEYS:
                return
            after = batch[-1]


def _buffers(payload: bytes | Sequence[memoryview]) -> tuple[memoryview, ...]:
    """A payload as byte buffers: bytes-like objects are one, a sequence of them is itself."""
    if isinstance(payload, (bytes, bytearray, memoryview, np.ndarray)):
        return (memoryview(payload).cast("B"),)
    return tuple(memoryview(part).cast("B") for part in payload)


def _length(parts: tuple[memoryview, ...]) -> int:
    return sum(len(part) for part in parts)


def payload_sha256(parts: Sequence[memoryview]) -> bytes:
    """The sha256 of a payload given as consecutive buffers."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.digest()


def reset_newer_schema(path: str | os.PathLike[str]) -> str | None:
    """Set the layout version of the LMDB store in `path` back to this tqstore's when it claims a
    newer one but holds nothing of a newer layout (damage, not a newer tqstore); a note saying
    so, or None when there was nothing to do. FormatVersionTooNew when records of another layout
    are there (a real newer store: it is left alone). Call it before the store is opened."""
    folder = Path(path)
    if not (folder / "data.mdb").exists():
        return None
    gate = hold_open_lock(folder)  # not while another process compacts it
    try:
        check_data_file(folder)
        return _reset_newer_schema(folder)
    finally:
        release_open_lock(gate)


def _reset_newer_schema(folder: Path) -> str | None:
    try:
        env = lmdb.open(str(folder), max_dbs=len(DB_NAMES) + 2, max_readers=8)
    except lmdb.Error as exc:
        raise lmdb_failure(folder, exc) from exc
    try:
        with env.begin(write=True) as txn:
            names = {bytes(k) for k in txn.cursor().iternext(values=False)}
            if b"meta" not in names:
                return None
            meta = env.open_db(b"meta", txn=txn)
            claimed = schema_number(txn.get(b"schema", db=meta))
            if claimed is None or claimed <= SCHEMA_VERSION:
                return None
            newer = sorted(n.decode(errors="replace") for n in names - set(DB_NAMES))
            objects = env.open_db(b"objects", txn=txn) if b"objects" in names else None
            other_headers = objects is not None and any(
                len(h) == HEADER.size and h[0] != 1 for h in txn.cursor(db=objects).iternext(keys=False))
            if newer or other_headers:
                found = f"databases {', '.join(newer)}" if newer else "object headers of another version"
                raise FormatVersionTooNew(
                    f"the LMDB store at {folder} has layout version {claimed} and holds {found}: it was written by a "
                    f"newer tqstore (this one reads layout {SCHEMA_VERSION}); upgrade tqstore, or use another --home")
            txn.put(b"schema", str(SCHEMA_VERSION).encode(), db=meta)
    except lmdb.Error as exc:
        raise lmdb_failure(folder, exc) from exc
    finally:
        env.close()
    return (f"meta schema: the store claimed layout version {claimed}, but every record is layout "
            f"{SCHEMA_VERSION}: set back to {SCHEMA_VERSION}")


@atexit.register
def _close_all() -> None:
    """Close every open tier at exit so queued writes finish before the interpreter stops."""
    for tier in list(_REGISTRY.values()):
        tier.close()
