"""Reading a damaged LMDB file page by page, without LMDB: what `tqstore repair` salvages from.

LMDB maps data.mdb and trusts every page it reaches: a page past the end of a truncated file is
SIGBUS, a zeroed page is MDB_CORRUPTED for every read that crosses it. This reader walks the
B-trees of the newest meta page whose main tree is readable (the older one if the newest is
lost: LMDB keeps the previous commit intact) with `pread`, checks every page it reaches (its
number, its kind, every offset inside it) and skips a damaged page with the subtree below it,
so every record that is still reachable is read. Values larger than a page are returned as
references and read on demand. Bytes missing at the end of a truncated last page read as zeros:
whatever they damaged fails the digests that every salvaged record is checked against.

The layout is LMDB 0.9's on a 64-bit machine (lmdb.h, mdb.c): a 16-byte page header (number
u64, pad u16, flags u16, lower u16, upper u16 or an overflow page count u32), u16 node offsets
from byte 16, nodes of (lo u16, hi u16, flags u16, key size u16, key, data).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

_HEADER = struct.Struct("=QHHHH")  # page number, pad, flags, lower, upper
_NODE = struct.Struct("=HHHH")  # lo, hi, flags, key size
_PGNO = struct.Struct("=Q")
_PAGE_HEADER = 16
_BRANCH, _LEAF, _OVERFLOW = 0x01, 0x02, 0x04
_BIGDATA, _SUBDATA, _DUPDATA = 0x01, 0x02, 0x04
_DB_ROOT_AT = 40  # md_root inside a 48-byte MDB_db record
_DB_SIZE = 48
_META_DBS_AT = 40  # the free and main MDB_db records in a meta page
_META_MAGIC = 0xBEEFC0DE
_INVALID = (1 << 64) - 1  # the root of an empty tree
_MAX_DEPTH = 32


@dataclass(frozen=True)
class BigValue:
    """A value stored on overflow pages: read it with `PageReader.value`."""

    pgno: int
    size: int


class PageReader:
    """The records of one LMDB file, read page by page; `lost_pages` counts what could not be."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lost: set[int] = set()  # page numbers: a page walked again is not counted again
        self._fd = os.open(path, os.O_RDONLY)
        self._size = os.fstat(self._fd).st_size
        self.page_size = 4096
        self._dbs: dict[bytes, int] | None = None
        self._free_root = _INVALID

    @property
    def lost_pages(self) -> int:
        """How many distinct pages the walks so far could not read (whatever walked them)."""
        return len(self._lost)

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)

    def named_dbs(self) -> dict[bytes, int]:
        """The named databases and their root pages, from the newest meta page whose main tree
        can be read (empty when neither can)."""
        if self._dbs is None:
            self._dbs = {}
            for meta in self._metas():
                self.page_size, main = meta
                lost = self.lost_pages
                found = {key: _PGNO.unpack_from(value, _DB_ROOT_AT)[0]
                         for key, flags, value in self._walk(main, 0)
                         if flags & _SUBDATA and isinstance(value, bytes) and len(value) == _DB_SIZE}
                if self.lost_pages == lost or found:
                    self._dbs = found
                    break
        return self._dbs

    def records(self, db: bytes) -> dict[bytes, bytes | BigValue]:
        """Every readable record of the named database `db` (values as bytes or BigValue)."""
        root = self.named_dbs().get(db)
        if root is None:
            return {}
        return {key: value for key, flags, value in self._walk(root, 0) if not flags & (_SUBDATA | _DUPDATA)}

    def damaged_pages(self) -> int:
        """How many pages of the newest readable commit cannot be read: every tree (the named
        databases and LMDB's free list) walked, every overflow page's header checked."""
        trees = [*self.named_dbs().values(), self._free_root]
        for root in trees:
            for _, _, value in self._walk(root, 0):
                if isinstance(value, BigValue) and not self._overflow_sound(value):
                    self._lost.add(value.pgno)
        return self.lost_pages

    def value(self, value: bytes | BigValue) -> bytes | None:
        """A record's value; None when its overflow pages are damaged or past the end."""
        if isinstance(value, bytes):
            return value
        if not self._overflow_sound(value):
            return None
        return os.pread(self._fd, value.size, value.pgno * self.page_size + _PAGE_HEADER)

    # --- internals -----------------------------------------------------------------------------

    def _metas(self) -> list[tuple[int, int]]:
        """(page size, main root) of the valid meta pages, the newest first."""
        found = []
        for index in (0, 1):
            for psize in (4096, 8192, 16384, 65536, 512, 1024, 2048, 32768):
                page = self._read(index * psize, 160)
                if page is None or struct.unpack_from("=I", page, 16)[0] != _META_MAGIC:
                    continue
                if struct.unpack_from("=I", page, _META_DBS_AT)[0] != psize:
                    continue
                main = _PGNO.unpack_from(page, _META_DBS_AT + _DB_SIZE + _DB_ROOT_AT)[0]
                txnid = _PGNO.unpack_from(page, 144)[0]
                found.append((txnid, psize, main, _PGNO.unpack_from(page, _META_DBS_AT + _DB_ROOT_AT)[0]))
                break
        found.sort(reverse=True)
        self._free_root = found[0][3] if found else _INVALID
        return [(psize, main) for _, psize, main, _ in found]

    def _overflow_sound(self, value: BigValue) -> bool:
        start = value.pgno * self.page_size
        head = self._read(start, _PAGE_HEADER)
        if head is None or start + _PAGE_HEADER + value.size > self._size:
            return False
        pgno, _, flags, _, _ = _HEADER.unpack(head)
        return pgno == value.pgno and bool(flags & _OVERFLOW)

    def _read(self, offset: int, size: int) -> bytes | None:
        if offset >= self._size:
            return None
        data = os.pread(self._fd, size, offset)
        return data + bytes(size - len(data))  # the missing end of a truncated last page

    def _page(self, pgno: int) -> bytes | None:
        """Page `pgno` if it is a sound branch or leaf page, else None (counted as lost)."""
        page = self._read(pgno * self.page_size, self.page_size) if 2 <= pgno < _INVALID else None
        if page is not None:
            number, _, flags, lower, upper = _HEADER.unpack_from(page)
            kind = flags & (_BRANCH | _LEAF | _OVERFLOW)
            if number == pgno and kind in (_BRANCH, _LEAF) and _PAGE_HEADER <= lower <= upper <= self.page_size:
                return page
        self._lost.add(pgno)
        return None

    def _walk(self, pgno: int, depth: int):
        """(key, node flags, value) of every readable leaf node below page `pgno`."""
        if pgno == _INVALID:
            return
        page = self._page(pgno) if depth < _MAX_DEPTH else None
        if page is None:
            return
        _, _, flags, lower, _ = _HEADER.unpack_from(page)
        for i in range((lower - _PAGE_HEADER) // 2):
            (at,) = struct.unpack_from("=H", page, _PAGE_HEADER + 2 * i)
            if at + _NODE.size > self.page_size:
                self._lost.add(pgno)
                return
            lo, hi, node_flags, ksize = _NODE.unpack_from(page, at)
            key = page[at + _NODE.size:at + _NODE.size + ksize]
            if flags & _BRANCH:
                yield from self._walk(lo | hi << 16 | node_flags << 32, depth + 1)
                continue
            size, data_at = lo | hi << 16, at + _NODE.size + ksize
            if node_flags & _BIGDATA:
                value = BigValue(_PGNO.unpack_from(page, data_at)[0], size) if data_at + 8 <= self.page_size else None
            else:
                value = page[data_at:data_at + size] if data_at + size <= self.page_size else None
            if value is None:
                self._lost.add(pgno)
                continue
            yield bytes(key), node_flags, value


def damaged_pages(folder: Path) -> int:
    """How many pages of the LMDB file in `folder` cannot be read (0 for a sound or new one)."""
    data = folder / "data.mdb"
    if not data.exists() or data.stat().st_size == 0:
        return 0
    reader = PageReader(data)
    try:
        return reader.damaged_pages()
    finally:
        reader.close()
