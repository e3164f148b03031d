"""The page-by-page reader of a damaged data.mdb (tqstore/store/tiers/lmdb_pages.py)."""

from __future__ import annotations

import hashlib
import struct

from tqstore.store.tiers.lmdb import LmdbTier
from tqstore.store.tiers.lmdb_pages import PageReader


def test_a_damaged_page_is_counted_once_however_often_it_is_walked(tmp_path):
    """Before: `lost_pages` grew on every walk, so `repair` reported a zeroed leaf twice when it
    read the records and then counted the damaged pages (and again on every further walk)."""
    tier = LmdbTier.open(tmp_path / "lmdb", segment_size=4096, map_size=1 << 24, min_free_disk_bytes=0)
    tier.put_objects({hashlib.sha256(b"%d" % i).digest(): bytes([i]) * 20_000 for i in range(40)})
    tier.close()
    data = tmp_path / "lmdb" / "data.mdb"
    reader = PageReader(data)
    root, size = reader.named_dbs()[b"segments"], reader.page_size
    reader.close()
    with open(data, "r+b") as f:
        f.seek(root * size)
        page = f.read(size)
        assert struct.unpack_from("=H", page, 10)[0] & 1, "the segments' root is a branch page"
        lo, hi, flags, _ = struct.unpack_from("=HHHH", page, struct.unpack_from("=H", page, 16)[0])
        f.seek((lo | hi << 16 | flags << 32) * size)
        f.write(bytes(size))  # the first leaf of the segments
    reader = PageReader(data)
    try:
        assert reader.records(b"segments") and reader.lost_pages == 1
        assert reader.records(b"segments") and reader.lost_pages == 1
        assert reader.damaged_pages() == reader.damaged_pages() == reader.lost_pages == 1
    finally:
        reader.close()
