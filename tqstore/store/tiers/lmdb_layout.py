"""The records of the LMDB tier: how an object is laid out in the named databases, written,
checked and removed. Every function works inside a transaction the caller owns.

    meta           b"schema" -> ASCII layout version
    manifests      entry name (ASCII) -> manifest bytes (opaque, written by the Store)
    manifest_used  entry name -> big-endian f64 Unix time of the last put or touch
    objects        32-byte key -> 65-byte header (HEADER)
    segments       32-byte key || u32 big-endian index -> one segment of the payload
    quarantine     32-byte key -> JSON {"reason", "time", "size"}
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import lmdb
import numpy as np

from tqstore.store.tiers.base import ObjectInfo

SCHEMA_VERSION = 1
DB_NAMES = (b"meta", b"manifests", b"manifest_used", b"objects", b"segments", b"quarantine")
# version u8 (1), payload sha256, payload size u64, segment count u32, bytes per segment u32,
# created f64, last used f64.
HEADER = struct.Struct(">B32sQIIdd")
TIME = struct.Struct(">d")
_INDEX = struct.Struct(">I")
# A value larger than a page goes to overflow pages behind a 16-byte page header: a segment
# carries segment_size - 16 payload bytes so that it fills whole pages (measured with LMDB 0.9:
# 1 MiB - 16 bytes takes 256 pages of 4 KiB, 1 MiB takes 257).
OVERFLOW_HEADER = 16
BATCH_KEYS = 1024  # keys per short read transaction when iterating


@dataclass(frozen=True)
class Problem:
    """One inconsistency found by `LmdbTier.verify` (kinds: bad_header, missing_segment,
    segment_length, checksum, orphan_segment)."""

    kind: str
    key: bytes
    detail: str


def write_object(
    txn: lmdb.Transaction, dbs: dict, key: bytes, payload: Sequence[memoryview], digest: bytes, segment_size: int,
    now: float
) -> None:
    """Write the segments and then the header of a new object (one transaction: atomic). The
    payload is given as consecutive byte buffers (joined, they are the object)."""
    per_segment = segment_size - OVERFLOW_HEADER
    size = sum(len(part) for part in payload)
    count = -(-size // per_segment)
    delete_segments(txn, dbs[b"segments"], key)  # leftovers of an interrupted quarantine
    for i, segment in enumerate(_segments_of(payload, per_segment)):
        txn.put(key + _INDEX.pack(i), segment, db=dbs[b"segments"])
    txn.put(key, HEADER.pack(1, digest, size, count, per_segment, now, now), db=dbs[b"objects"])
    txn.delete(key, db=dbs[b"quarantine"])


def _segments_of(payload: Sequence[memoryview], per_segment: int) -> Iterator[memoryview | bytes]:
    """The payload cut into segments of `per_segment` bytes (the last one shorter): a slice of a
    buffer where a segment lies inside one, else its pieces joined (LMDB copies each value into
    its pages anyway, so a slice costs no copy of its own)."""
    pieces: list[memoryview] = []
    held = 0
    for part in payload:
        at = 0
        while at < len(part):
            take = min(per_segment - held, len(part) - at)
            if not pieces and take == per_segment:
                yield part[at:at + take]
            else:
                pieces.append(part[at:at + take])
                held += take
                if held == per_segment:
                    yield b"".join(pieces)
                    pieces, held = [], 0
            at += take
    if pieces:
        yield b"".join(pieces)


def load_object(
    txn: lmdb.Transaction, dbs: dict, key: bytes, keep: bool
) -> tuple[bytes | None, Problem | None, bytes | None]:
    """(payload if `keep`, the problem if it fails its checks, raw header) of `key`; all None
    if absent. Checks the header, every segment's presence and length, and the sha256."""
    raw, found = segments(txn, dbs, key)
    if not isinstance(found, list):
        return None, found, raw
    digest = HEADER.unpack(raw)[1]
    hasher = hashlib.sha256()
    for part in found:
        hasher.update(part)
    if hasher.digest() != digest:
        detail = f"sha256 {hasher.hexdigest()} does not match the stored {digest.hex()}"
        return None, Problem("checksum", key, detail), raw
    return (b"".join(found) if keep else None), None, raw


def read_object(txn: lmdb.Transaction, dbs: dict, key: bytes, into: Callable[[int], np.ndarray] | None = None
                ) -> tuple[np.ndarray | None, Problem | None, bytes | None]:
    """`load_object` without the sha256: (payload, problem, raw header), the payload copied once
    from LMDB's pages (buffers valid inside `txn`) into a new numpy buffer, or into `into(size)`
    (a buffer of `size` bytes the caller reuses). For readers whose object format checks every
    byte against digests of its own (object format 3); checks the header and every segment's
    presence and length."""
    raw, found = segments(txn, dbs, key)
    if not isinstance(found, list):
        return None, found, raw
    size = HEADER.unpack(raw)[2]
    out = np.empty(size, np.uint8) if into is None else into(size)
    at = 0
    for part in found:  # numpy copies without the GIL
        out[at:at + len(part)] = np.frombuffer(part, np.uint8)
        at += len(part)
    return out, None, raw


def segments(txn: lmdb.Transaction, dbs: dict, key: bytes) -> tuple[bytes | None, list[memoryview] | Problem | None]:
    """(raw header, every segment of `key` as a buffer valid inside `txn`, or the problem with
    the header or a segment's presence or length); (None, None) if absent."""
    raw = copy(txn.get(key, db=dbs[b"objects"]))
    if raw is None:
        return None, None
    if len(raw) != HEADER.size or raw[0] != 1:
        return raw, Problem("bad_header", key, f"index entry of {len(raw)} bytes is unreadable")
    _, _, size, count, per_segment, _, _ = HEADER.unpack(raw)
    parts = []
    for i in range(count):
        part = txn.get(key + _INDEX.pack(i), db=dbs[b"segments"])
        if part is None:
            return raw, Problem("missing_segment", key, f"segment {i} of {count} is missing")
        expected = per_segment if i < count - 1 else size - per_segment * (count - 1)
        if len(part) != expected:
            return raw, Problem("segment_length", key, f"segment {i} has {len(part)} bytes, expected {expected}")
        parts.append(part)
    if sum(map(len, parts)) != size:
        return raw, Problem("segment_length", key, f"the segments hold {sum(map(len, parts))} bytes, expected {size}")
    return raw, parts


def header_info(key: bytes, raw: bytes) -> ObjectInfo:
    """The ObjectInfo of a raw header."""
    _, digest, size, count, per_segment, created, used = HEADER.unpack(raw)
    return ObjectInfo(key, size, digest.hex(), created, used, count, per_segment)


def delete_segments(txn: lmdb.Transaction, segments: object, key: bytes) -> bool:
    """Delete every segment of `key` (whatever the header says); whether there was one."""
    cursor, deleted = txn.cursor(db=segments), False
    if cursor.set_range(key):
        while bytes(cursor.key()[:32]) == key:
            deleted = True
            if not cursor.delete():  # delete() moves to the next record; False at the end
                break
    return deleted


def orphan_batch(txn: lmdb.Transaction, dbs: dict, after: bytes) -> tuple[list[bytes], bytes | None]:
    """Keys of objects that have segments but no header, from segment key `after` on (b"" for
    the start), one probe per object; returns them and where to continue (None at the end)."""
    cursor, orphans = txn.cursor(db=dbs[b"segments"]), []
    found = cursor.set_range(after) if after else cursor.first()
    for _ in range(BATCH_KEYS):
        if not found:
            return orphans, None
        key = bytes(cursor.key()[:32])
        if txn.get(key, db=dbs[b"objects"]) is None:
            orphans.append(key)
        if len(key) < 32:  # a damaged short key is a record of its own
            found = cursor.next()
        else:  # past every key || u32 of this object (and any damaged longer key it starts)
            beyond = _successor(key)
            found = beyond is not None and cursor.set_range(beyond)
    return orphans, (bytes(cursor.key()) if found else None)


def _successor(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key that starts with `prefix` (None: there is none)."""
    kept = prefix.rstrip(b"\xff")
    return kept[:-1] + bytes([kept[-1] + 1]) if kept else None


def key_batch(txn: lmdb.Transaction, db: object, after: bytes | None) -> list[bytes]:
    """Up to BATCH_KEYS keys of `db` after `after` (from the start if None)."""
    cursor = txn.cursor(db=db)
    found = cursor.first() if after is None else cursor.set_range(after)
    if found and after is not None and bytes(cursor.key()) == after:
        found = cursor.next()
    keys = []
    while found and len(keys) < BATCH_KEYS:
        keys.append(bytes(cursor.key()))
        found = cursor.next()
    return keys


def copy(value: memoryview | bytes | None) -> bytes | None:
    """Bytes out of a buffer that is only valid inside its transaction."""
    return None if value is None else bytes(value)
