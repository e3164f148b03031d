"""Damage to a closed store's LMDB file, for tests that a damaged object is never served."""

from __future__ import annotations

import lmdb


def flip_segment_byte(path: str, key: bytes) -> None:
    """Flip a byte in the middle of object `key`'s first segment (the store must be closed)."""
    env = lmdb.open(path, max_dbs=10)
    segments = env.open_db(b"segments")
    with env.begin(write=True) as txn:
        seg_key = key + (0).to_bytes(4, "big")
        data = bytearray(txn.get(seg_key, db=segments))
        data[len(data) // 2] ^= 0xFF
        txn.put(seg_key, bytes(data), db=segments)
    env.close()
