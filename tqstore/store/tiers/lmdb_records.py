"""Index records of the LMDB tier that are damaged one by one: found, described and fixed without
touching the others (`tqstore verify` lists them, `tqstore repair` fixes them).

One bad record must cost that record only: a `meta/schema` value that is not a number, a
manifest stored under a key that is not a valid entry name (bytes no name can have), a
`manifest_used` time that is not 8 bytes, a quarantine record that is not its JSON. Object
headers and segments have their own checks (lmdb_layout.load_object) and manifests their own
parser (manifest.py). Every function works inside a transaction the caller owns.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import lmdb

from tqstore.names import is_valid_name
from tqstore.store.tiers.lmdb_layout import TIME

_LAST_TIME = 253402300799.0  # 9999-12-31 23:59:59 UTC, the last second datetime can show


@dataclass(frozen=True)
class DamagedRecord:
    """One damaged record: its database, raw key and what is wrong with it."""

    db: str
    key: bytes
    detail: str

    @property
    def label(self) -> str:
        """The key as text (bytes that are not ASCII as backslash escapes)."""
        return key_label(self.key)


def key_label(key: bytes) -> str:
    """A manifest key as the name `ls`, `verify` and `rm` show and accept."""
    return key.decode("ascii", "backslashreplace")


def schema_number(value: bytes | None) -> int | None:
    """The layout version a `meta/schema` value holds; None if it is not a decimal number."""
    text = None if value is None else bytes(value)
    return int(text) if text and text.isdigit() and len(text) <= 9 else None


def used_time(value: bytes | None) -> float | None:
    """The Unix time a `manifest_used` value holds; None if it is missing or damaged (not 8
    bytes, or not a time from 1970 to 9999: -inf, nan and 1e300 break every date format)."""
    if value is None or len(value) != TIME.size:
        return None
    (when,) = TIME.unpack(value)
    return when if 0.0 <= when <= _LAST_TIME else None


def find_damaged(txn: lmdb.Transaction, dbs: dict) -> list[DamagedRecord]:
    """Every damaged index record, in database order."""
    found = []
    schema = txn.get(b"schema", db=dbs[b"meta"])
    if schema is not None and schema_number(schema) is None:
        found.append(DamagedRecord("meta", b"schema", f"layout version {bytes(schema)[:16]!r} is not a number"))
    for key in txn.cursor(db=dbs[b"manifests"]).iternext(values=False):
        if not is_valid_name(key_label(bytes(key))):
            found.append(DamagedRecord("manifests", bytes(key), "the manifest's key is not a valid entry name"))
    for key, value in txn.cursor(db=dbs[b"manifest_used"]):
        if len(value) != TIME.size:
            found.append(DamagedRecord("manifest_used", bytes(key), f"last-used time of {len(value)} bytes, not "
                                                                    f"{TIME.size}"))
        elif used_time(value) is None:
            found.append(DamagedRecord("manifest_used", bytes(key), f"last-used time {TIME.unpack(value)[0]!r} is "
                                                                    "not a date from 1970 to 9999"))
    for key, value in txn.cursor(db=dbs[b"quarantine"]):
        if quarantine_record(value) is None:
            found.append(DamagedRecord("quarantine", bytes(key), "quarantine record is not its JSON"))
    return found


def quarantine_record(value: bytes) -> dict | None:
    """A quarantine record's {"reason", "time", "size"}, or None if it is damaged."""
    try:
        record = json.loads(bytes(value))
    except (UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("reason"), str) and \
        isinstance(record.get("time"), (int, float)) and isinstance(record.get("size"), int)
    return record if ok else None


def fix(txn: lmdb.Transaction, dbs: dict, record: DamagedRecord, schema_version: int) -> None:
    """Make `record` sound: the schema is written again, a last-used time is set to now, any
    other record is dropped (a manifest with its last-used time)."""
    if record.db == "meta":
        txn.put(b"schema", str(schema_version).encode(), db=dbs[b"meta"])
    elif record.db == "manifest_used":
        txn.put(record.key, TIME.pack(time.time()), db=dbs[b"manifest_used"])
    else:
        txn.delete(record.key, db=dbs[record.db.encode()])
        if record.db == "manifests":
            txn.delete(record.key, db=dbs[b"manifest_used"])
